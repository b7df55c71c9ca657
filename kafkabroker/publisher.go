// Package kafkabroker is the outbox's broker side on Kafka: a [Publisher]
// through which a [postgres.OutboxRelay] or [postgres.LogRelay] publishes
// to a topic, and a [Consumer], a member of a consumer group, that feeds
// the records to a [Handler], such as one built on
// [postgres.Outbox.ApplyOnce]. It is built on franz-go's kgo client, which
// the caller makes with the settings of its cluster (brokers, TLS, SASL);
// it imports the outbox package only.
//
// Delivery stays at least once, end to end: Kafka drops no copy a relay
// sends again (its idempotent producer drops its own retries only, within
// one producer session), so every copy reaches the consumer, which drops it
// by the message's key.
package kafkabroker

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Version is this module's version, the one postgres/CHANGELOG.md
// describes.
const Version = postgres.Version

// Topic is the topic a Publisher publishes to unless its options name
// another.
const Topic = "outbox"

// The record headers that carry what Kafka has no place of its own for:
// the message's key, its id, its type, its aggregate and seq, and its
// payload's content type when it is not JSON. The record's key is the
// aggregate (its message key for a message of none), so that an
// aggregate's events share a partition and keep their order; its
// timestamp is when the row was written.
const (
	HeaderKey         = "outbox-key"
	HeaderID          = "outbox-id"
	HeaderType        = "outbox-type"
	HeaderAggregate   = "outbox-aggregate"
	HeaderSeq         = "outbox-seq"
	HeaderContentType = "content-type"
)

// Publisher publishes outbox messages to a Kafka topic: it is a
// [postgres.MessageBroker] and a [postgres.BatchPublisher] for the relays.
// Publish and PublishBatch return only once every in-sync replica has the
// records (acks=all) from an idempotent producer, which keeps a
// partition's records in their order across its own retries; they return
// soon after ctx ends, with an error that says the outcome is unknown.
//
// What the cluster says comes back as the relay needs it:
//   - a record over the topic's or the client's size limit (sent alone
//     to tell it from the records the broker refused with it, in its
//     partition's produce batch), one whose time is outside what the
//     topic takes, or one the broker calls invalid, can never be stored:
//     an error wrapping
//     [postgres.ErrRejected], which a relay may park; so is a message whose
//     own headers Kafka cannot carry beside the Publisher's (a reserved
//     or empty name, text that is not UTF-8), refused before anything of
//     its call is sent, and the messages after it not sent;
//   - everything else (a broker down, a partition with no leader, an
//     unknown topic, no answer before ctx ended) may pass: an error
//     wrapping [postgres.ErrBrokerUnavailable]; the topic may hold the
//     record all the same, and the relay publishes it again, a copy the
//     consumer drops by its key.
//
// PublishBatch sends its records at once and waits for each in order. A
// relay with order per aggregate hands it no two messages of one
// aggregate, so a record refused cannot have a later record of its
// aggregate stored ahead of it by the same call; with WholeTable, a relay
// publishes one message at a time.
//
// A Publisher is safe for concurrent use. Make one with [NewPublisher].
type Publisher struct {
	cl       *kgo.Client
	topic    string
	ceSource string
}

// PublisherOptions configures a [Publisher]: [NewPublisher] checks it and
// refuses a bad value with an error wrapping [postgres.ErrInvalidConfig]
// that names it. The zero PublisherOptions publishes to Topic, without
// CloudEvents attributes.
type PublisherOptions struct {
	// Topic is where the records go; "" means Topic.
	Topic string
	// CloudEventsSource, if not empty, makes each record a CloudEvent too,
	// in the binary content mode of the CloudEvents Kafka protocol binding:
	// ce_specversion 1.0, ce_id its key, ce_type its type, ce_source this
	// source, ce_subject its aggregate (if any), ce_time when it was
	// written, and content-type its payload's media type. It names the
	// producer: a URI-reference such as "/shop".
	CloudEventsSource string
}

// Check reports, with an error wrapping [postgres.ErrInvalidConfig] that
// names it, what [NewPublisher] would refuse of o. It connects to nothing.
func (o PublisherOptions) Check() error {
	if o.Topic != "" && !topicName(o.Topic) {
		return fmt.Errorf("%w: kafkabroker: PublisherOptions.Topic %q: want 1 to 249 of letters, digits, '.', '_' and '-'", postgres.ErrInvalidConfig, o.Topic)
	}
	if o.CloudEventsSource != "" {
		if _, err := url.Parse(o.CloudEventsSource); err != nil ||
			strings.ContainsFunc(o.CloudEventsSource, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
			return fmt.Errorf("%w: kafkabroker: PublisherOptions.CloudEventsSource %q: want a URI-reference, such as /shop", postgres.ErrInvalidConfig, o.CloudEventsSource)
		}
	}
	return nil
}

// topicName reports whether s is a name Kafka takes for a topic.
func topicName(s string) bool {
	if s == "" || len(s) > 249 || s == "." || s == ".." {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// NewPublisher returns a Publisher that publishes through cl, made by the
// caller for its cluster. It refuses, with an error wrapping
// [postgres.ErrInvalidConfig], no client, what opts.Check refuses, and a
// client that cannot say "taken" honestly: one whose RequiredAcks is not
// AllISRAcks, or with DisableIdempotentWrite (kgo's defaults are both
// right). It does not create the topic: see [Provision].
func NewPublisher(cl *kgo.Client, opts PublisherOptions) (*Publisher, error) {
	if cl == nil {
		return nil, fmt.Errorf("%w: kafkabroker: NewPublisher: no client", postgres.ErrInvalidConfig)
	}
	if err := opts.Check(); err != nil {
		return nil, err
	}
	if acks, _ := cl.OptValue(kgo.RequiredAcks).(kgo.Acks); acks != kgo.AllISRAcks() {
		return nil, fmt.Errorf("%w: kafkabroker: the client's RequiredAcks is not AllISRAcks: a record one replica took may be lost with it", postgres.ErrInvalidConfig)
	}
	if off, _ := cl.OptValue(kgo.DisableIdempotentWrite).(bool); off {
		return nil, fmt.Errorf("%w: kafkabroker: the client has DisableIdempotentWrite: its retries may store a record twice, or out of order", postgres.ErrInvalidConfig)
	}
	topic := opts.Topic
	if topic == "" {
		topic = Topic
	}
	return &Publisher{cl: cl, topic: topic, ceSource: opts.CloudEventsSource}, nil
}

// MessagingSystem is "kafka", the relay's messaging.system for the spans
// of its sends ([postgres.MessagingSystem]).
func (p *Publisher) MessagingSystem() string { return "kafka" }

// Publish publishes msg and waits until every in-sync replica has it, or
// for ctx to end.
func (p *Publisher) Publish(ctx context.Context, msg postgres.Message) error {
	_, err := p.PublishBatch(ctx, []postgres.Message{msg})
	return err
}

// PublishBatch sends every message of msgs at once, then waits for their
// acknowledgements in order, and returns how many, from the first, were
// taken before the first that was not, with that one's error. A message
// after it may have been taken too: the relay publishes it again, a copy
// the consumer drops by its key.
func (p *Publisher) PublishBatch(ctx context.Context, msgs []postgres.Message) (int, error) {
	// A message whose headers Kafka cannot carry as they are is refused
	// before anything is sent: nothing after it is stored ahead of it.
	var refused error
	for i, msg := range msgs {
		if err := checkHeaders(msg); err != nil {
			msgs, refused = msgs[:i], fmt.Errorf("message %s to topic %s: %w: %w", msg.Key, p.topic, err, postgres.ErrRejected)
			break
		}
	}
	results := make([]chan error, len(msgs))
	for i, msg := range msgs {
		done := make(chan error, 1)
		results[i] = done
		p.cl.Produce(ctx, p.record(msg), func(_ *kgo.Record, err error) { done <- err })
	}
	for i, done := range results {
		select {
		case err := <-done:
			if tooLarge(err) {
				// The broker refuses a partition's whole produce batch for
				// one record over its limit: this one may be only its
				// neighbour. Alone, it says which it is.
				err = p.cl.ProduceSync(ctx, p.record(msgs[i])).FirstErr()
			}
			if err != nil {
				return i, p.failed(ctx, msgs[i], err)
			}
		case <-ctx.Done():
			return i, p.failed(ctx, msgs[i], ctx.Err())
		}
	}
	return len(msgs), refused
}

// tooLarge reports whether err is the broker's refusal of a produce batch
// for its size.
func tooLarge(err error) bool {
	return errors.Is(err, kerr.MessageTooLarge) || errors.Is(err, kerr.RecordListTooLarge)
}

// checkHeaders says why msg's own headers cannot go as Kafka record
// headers beside the Publisher's: a name this Publisher or CloudEvents'
// Kafka binding sets (postgres.ReservedHeader: outbox-key, ce_id, …), which
// a consumer would read in place of the outbox's; an empty name; a name or
// value that is not UTF-8, as Kafka's clients read header names as text.
// postgres.Outbox.Write refuses all of these already; this guards what a
// caller publishes by hand.
func checkHeaders(msg postgres.Message) error {
	for k, v := range msg.Headers {
		switch {
		case k == "" || !utf8.ValidString(k):
			return fmt.Errorf("header name %q: want a non-empty UTF-8 name", k)
		case postgres.ReservedHeader(k):
			return fmt.Errorf("header %q: a name the publisher or a binding sets itself", k)
		case !utf8.ValidString(v):
			return fmt.Errorf("header %q: its value is not UTF-8 text", k)
		}
	}
	return nil
}

// failed says what err, from publishing msg, means for the relay.
func (p *Publisher) failed(ctx context.Context, msg postgres.Message, err error) error {
	switch {
	case tooLarge(err):
		return fmt.Errorf("message %s to topic %s: %d bytes, over the size the topic or the client takes, sent alone: %w: %w",
			msg.Key, p.topic, len(msg.Payload), postgres.ErrRejected, err)
	case errors.Is(err, kerr.InvalidTimestamp):
		// Sent again, it is refused again: the row's time is outside what
		// the topic takes (message.timestamp.before.max.ms and .after.max.ms,
		// or the older message.timestamp.difference.max.ms), as an old row
		// replayed or put back may be.
		return fmt.Errorf("message %s to topic %s: its time %s is outside what the topic takes: %w: %w",
			msg.Key, p.topic, msg.Time.UTC().Format(time.RFC3339), postgres.ErrRejected, err)
	case errors.Is(err, kerr.InvalidRecord), errors.Is(err, kerr.CorruptMessage):
		return fmt.Errorf("message %s to topic %s: the broker calls it invalid: %w: %w", msg.Key, p.topic, postgres.ErrRejected, err)
	case ctx.Err() != nil:
		return fmt.Errorf("message %s to topic %s: no acknowledgement before the context ended, so whether the topic stored it is unknown: %w: %w",
			msg.Key, p.topic, postgres.ErrBrokerUnavailable, err)
	}
	return fmt.Errorf("message %s to topic %s: %w: %w", msg.Key, p.topic, postgres.ErrBrokerUnavailable, err)
}

// record is msg as Kafka carries it.
func (p *Publisher) record(msg postgres.Message) *kgo.Record {
	key := msg.Aggregate
	if key == "" {
		key = msg.Key // no order to keep: spread by the message's own key
	}
	r := &kgo.Record{Topic: p.topic, Key: []byte(key), Value: []byte(msg.Payload), Timestamp: msg.Time}
	add := func(k, v string) { r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)}) }
	if msg.Key != "" {
		add(HeaderKey, msg.Key)
	}
	add(HeaderID, strconv.FormatInt(msg.ID, 10))
	add(HeaderType, msg.Type)
	if msg.Aggregate != "" {
		add(HeaderAggregate, msg.Aggregate)
		add(HeaderSeq, strconv.FormatInt(msg.Seq, 10))
	}
	for _, k := range []string{"traceparent", "tracestate"} { // W3C's names
		if v := msg.TraceContext[k]; v != "" {
			add(k, v)
		}
	}
	if msg.ContentType != "" || p.ceSource != "" {
		ct := msg.ContentType
		if ct == "" {
			ct = "application/json"
		}
		add(HeaderContentType, ct)
	}
	for k, v := range msg.Headers { // the team's own, none of the names above (postgres.ErrInvalidHeader)
		add(k, v)
	}
	if p.ceSource != "" {
		id := msg.Key
		if id == "" {
			id = strconv.FormatInt(msg.ID, 10)
		}
		add("ce_specversion", "1.0")
		add("ce_id", id)
		add("ce_type", msg.Type)
		add("ce_source", p.ceSource)
		if msg.Aggregate != "" {
			add("ce_subject", msg.Aggregate)
		}
		if !msg.Time.IsZero() {
			add("ce_time", msg.Time.UTC().Format(time.RFC3339Nano))
		}
	}
	return r
}
