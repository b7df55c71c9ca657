package postgres

// A team's own headers, and payloads that are not JSON: what Outbox.Write
// checks of them before it writes anything.

import (
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"strings"
	"unicode/utf8"
)

// ErrInvalidHeader is returned, wrapped, by [Outbox.Write] for an
// Event.Headers that a broker could not carry as it is, naming the header:
// a name that is not 1 to [MaxHeaderNameLen] bytes of letters, digits, '-',
// '_' and '.' (NATS refuses ':' and spaces in a name, and both brokers
// compare names byte for byte); a name the brokers or this repository's
// publishers set themselves ([ReservedHeader]: Outbox-Id, Outbox-Aggregate,
// Outbox-Seq, content-type, traceparent, tracestate, RabbitMQ's own x-
// headers such as x-death and x-delivery-count, and the namespaces NATS
// and CloudEvents keep, Nats-*, ce-*, ce_* and cloudEvents_*, in any
// case; a team's own X-Request-Id is carried); a value longer than [MaxHeaderValueLen] bytes, not UTF-8, or holding a
// control character (a line break would end a NATS header); or more than
// [MaxHeaders] of them. Nothing is written.
var ErrInvalidHeader = errors.New("postgres: header no broker can carry")

// ErrInvalidContentType is returned, wrapped, by [Outbox.Write] for an
// Event.ContentType that is not a media type ("application/x-protobuf",
// "text/plain; charset=utf-8"), or is longer than 200 bytes. Nothing is
// written.
var ErrInvalidContentType = errors.New("postgres: not a media type")

// The limits of Event.Headers.
const (
	MaxHeaders        = 16
	MaxHeaderNameLen  = 64
	MaxHeaderValueLen = 1024
)

// reservedNames are the header names, in lower case, that this
// repository's publishers and the brokers set themselves: a team's header
// of the same name would be overwritten, or would overwrite one (the
// outbox- names carry a message's id, key, type, aggregate and seq where
// the broker has no place of its own for them, as on Kafka). The x-
// names are RabbitMQ's: what it adds to a message it dead-letters, counts,
// moves (a shovel), reads from a stream, or delays (the delayed message
// exchange).
var reservedNames = map[string]bool{
	"outbox-id": true, "outbox-aggregate": true, "outbox-seq": true, "outbox-key": true, "outbox-type": true,
	"content-type": true, "traceparent": true, "tracestate": true,
	"x-death": true, "x-delivery-count": true,
	"x-first-death-exchange": true, "x-first-death-queue": true, "x-first-death-reason": true,
	"x-last-death-exchange": true, "x-last-death-queue": true, "x-last-death-reason": true,
	"x-received-from": true, "x-shovelled": true, "x-shovelled-timestamp": true,
	"x-stream-offset": true, "x-stream-filter-value": true, "x-delay": true,
}

// reservedPrefixes are the namespaces, in lower case, that a broker or a
// specification keeps for itself: NATS's Nats-*, which the server reads;
// CloudEvents' attributes in each binding (ce-, ce_, cloudEvents_, and
// cloudEvents: as this repository's RabbitMQ publisher writes them); and
// RabbitMQ's x-opt-*, its AMQP 1.0 annotations.
var reservedPrefixes = []string{"nats-", "ce-", "ce_", "cloudevents_", "cloudevents:", "x-opt-"}

// ReservedHeader reports whether name, in any case, names a header that
// this repository's publishers or the brokers set themselves, by its exact
// name or in a namespace a broker or CloudEvents keeps (see
// [ErrInvalidHeader]): Event.Headers may not hold one, and a consumer
// leaves them out of Message.Headers, which are the team's own. A team's
// own X- header, such as X-Request-Id, is not one.
func ReservedHeader(name string) bool {
	lower := strings.ToLower(name)
	if reservedNames[lower] {
		return true
	}
	for _, p := range reservedPrefixes {
		if strings.HasPrefix(lower, p) {
			return true
		}
	}
	return false
}

// checkHeaders says what is wrong with headers, if anything, and returns
// them as a JSON object, or nil for none.
func checkHeaders(headers map[string]string) ([]byte, error) {
	if len(headers) == 0 {
		return nil, nil
	}
	if len(headers) > MaxHeaders {
		return nil, fmt.Errorf("%w: %d headers, at most %d", ErrInvalidHeader, len(headers), MaxHeaders)
	}
	for name, value := range headers {
		if !headerName(name) {
			return nil, fmt.Errorf("%w: name %.80q: want 1 to %d bytes of letters, digits, '-', '_' and '.'",
				ErrInvalidHeader, name, MaxHeaderNameLen)
		}
		if ReservedHeader(name) {
			return nil, fmt.Errorf("%w: name %q: one the brokers set themselves", ErrInvalidHeader, name)
		}
		if len(value) > MaxHeaderValueLen {
			return nil, fmt.Errorf("%w: %s: a value of %d bytes, at most %d", ErrInvalidHeader, name, len(value), MaxHeaderValueLen)
		}
		if !utf8.ValidString(value) || strings.ContainsFunc(value, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			return nil, fmt.Errorf("%w: %s: value %.80q is not UTF-8 text without control characters", ErrInvalidHeader, name, value)
		}
	}
	return json.Marshal(headers)
}

// headerName reports whether name is 1 to MaxHeaderNameLen bytes of
// letters, digits, '-', '_' and '.'.
func headerName(name string) bool {
	if name == "" || len(name) > MaxHeaderNameLen {
		return false
	}
	for _, c := range []byte(name) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// isJSON reports whether contentType is JSON's: empty (the default) or
// application/json, with any parameters.
func isJSON(contentType string) bool {
	mediaType, _, err := mime.ParseMediaType(contentType)
	return contentType == "" || err == nil && mediaType == "application/json"
}

// checkContentType says what is wrong with contentType, if anything.
func checkContentType(contentType string) error {
	if contentType == "" {
		return nil
	}
	if _, _, err := mime.ParseMediaType(contentType); err != nil || len(contentType) > 200 {
		return fmt.Errorf("%w: %.80q", ErrInvalidContentType, contentType)
	}
	return nil
}

// decodeHeaders is the headers column's JSON object as a map; nil for none.
func decodeHeaders(text string) (map[string]string, error) {
	if text == "" {
		return nil, nil
	}
	var h map[string]string
	if err := json.Unmarshal([]byte(text), &h); err != nil {
		return nil, fmt.Errorf("the row's headers %.80q: %w", text, err)
	}
	return h, nil
}

// bodyColumns are the columns of a row that make a Message's body: its
// payload as JSON text (empty if it has none), its bytes if it is of
// another content type (NULL if not), the content type, and the headers
// as a JSON object (empty for none). A rowBody scans them.
const bodyColumns = `COALESCE(payload::text, ''), body, COALESCE(content_type, ''), COALESCE(headers::text, '')`

// rowBody is where bodyColumns are scanned, to be set on a Message.
type rowBody struct {
	payload, contentType, headers string
	body                          []byte
}

// dest are the destinations of bodyColumns, in their order.
func (b *rowBody) dest() []any { return []any{&b.payload, &b.body, &b.contentType, &b.headers} }

// setOn sets m's Payload, ContentType and Headers from what was scanned.
func (b *rowBody) setOn(m *Message) error {
	m.Payload, m.ContentType = b.payload, b.contentType
	if b.body != nil {
		m.Payload = string(b.body)
	}
	var err error
	m.Headers, err = decodeHeaders(b.headers)
	return err
}
