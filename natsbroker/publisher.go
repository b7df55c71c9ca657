package natsbroker

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Publisher publishes outbox messages to JetStream: it is a
// [postgres.MessageBroker], a [postgres.BatchPublisher] and a
// [postgres.SequencePublisher] for the relays.
//
// Each message goes to SubjectPrefix + its type, with its key as
// Nats-Msg-Id, so that the stream stores a message once however often the
// relay publishes it within the duplicate window, and with its id,
// aggregate and seq in headers (HeaderID, HeaderAggregate, HeaderSeq),
// beside the payload's content type (HeaderContentType) when it is not
// JSON and the team's own headers.
// Publish, PublishBatch and PublishSequence return only once the stream has
// acknowledged the messages. What an ack promises is the stream's and the server's to choose:
// with one replica, the server wrote the message (on disk only with
// sync_interval: always); with three, two of the servers hold it. The
// README has what each survives, and REFERENCE.md what each costs.
//
// What the server says comes back as the relay needs it:
//   - an acknowledgement, including one that says the stream had the
//     message already (a duplicate, counted by Duplicates), is a success;
//   - a payload over the server's or the stream's limit, and a type that
//     makes no valid subject, can never succeed: errors wrapping
//     [postgres.ErrRejected], which a relay may park (the client checks
//     the server's max_payload as it learned it when it connected; before
//     refusing a message over it, the Publisher asks the server again, and
//     if the limit was raised since, reconnects to learn it and returns
//     an error wrapping [postgres.ErrBrokerUnavailable], to try again);
//   - everything else, a server that does not answer, a connection that is
//     closed or reconnecting, a stream with no leader, no stream that takes
//     the subject (a broker not yet provisioned, or misconfigured: the
//     message is not at fault, and parking it would lose its place), no
//     ack before the context ended, may pass: errors wrapping
//     [postgres.ErrBrokerUnavailable].
//     After such an error the stream may hold the message all the same (the
//     ack lost on its way back); the relay publishes it again, and the
//     duplicate window drops the copy.
//
// A Publisher is safe for concurrent use by multiple goroutines. Create one
// with [NewPublisher].
type Publisher struct {
	js         jetstream.JetStream
	prefix     string // of the subjects, as its Names say
	ceSource   string // CloudEvents' source, if it publishes CloudEvents
	duplicates atomic.Int64
}

// PublisherOptions configures a [Publisher]: [NewPublisher] checks it and
// refuses a bad value with an error wrapping [postgres.ErrInvalidConfig]
// that names it. The zero PublisherOptions publishes no CloudEvents
// attributes.
type PublisherOptions struct {
	// CloudEventsSource, if not empty, makes the Publisher publish each
	// message as a CloudEvent too, in the binary content mode of the
	// CloudEvents NATS protocol binding (spec 1.0): beside its own
	// headers, a message carries ce-specversion 1.0, ce-id its key,
	// ce-type its type, ce-source this source, ce-subject its aggregate
	// (if any), ce-time when it was written, and content-type its
	// payload's media type (application/json for JSON), so that a consumer
	// that knows CloudEvents and not this package, such as the CloudEvents
	// Go SDK, reads it as an event. It names the producer: a URI-reference
	// such as "/shop" or "https://shop.example.com".
	CloudEventsSource string
}

// Check reports, with an error wrapping [postgres.ErrInvalidConfig] that
// names it, what [NewPublisher] would refuse of o: a CloudEventsSource that
// is not a URI-reference. It connects to nothing.
func (o PublisherOptions) Check() error {
	if o.CloudEventsSource != "" {
		if err := checkSource(o.CloudEventsSource); err != nil {
			return fmt.Errorf("%w: PublisherOptions.CloudEventsSource: %w", postgres.ErrInvalidConfig, err)
		}
	}
	return nil
}

// checkSource says what is wrong with a CloudEvents source, if anything.
func checkSource(source string) error {
	if _, err := url.Parse(source); source == "" || err != nil ||
		strings.ContainsFunc(source, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
		return fmt.Errorf("natsbroker: CloudEvents source %q: want a URI-reference, such as /shop", source)
	}
	return nil
}

// NewPublisher returns a Publisher that publishes through js, created by
// the caller with the options its deployment needs (a domain or an API
// prefix, jetstream.WithPublishAsyncMaxPending, and
// jetstream.WithPublishAsyncTimeout, which frees the client's slot for an
// asynchronous publish whose ack was lost: PublishBatch itself stops
// waiting when its context ends), as opts says. It refuses no js, and
// what opts.Check refuses, with an error wrapping [postgres.ErrInvalidConfig].
// It does not create the stream: provision it apart with StreamConfig, and
// check it with CheckStream.
func NewPublisher(js jetstream.JetStream, opts PublisherOptions) (*Publisher, error) {
	return DefaultNames.NewPublisher(js, opts)
}

// Duplicates is how many messages the stream acknowledged as duplicates: it
// had stored them before, within its window, and dropped the new copy. A
// fast batch's ack does not say which of its messages were, so
// PublishSequence counts none.
func (p *Publisher) Duplicates() int64 { return p.duplicates.Load() }

// MessagingSystem is "nats", the relay's messaging.system for the spans of
// its sends ([postgres.MessagingSystem]).
func (p *Publisher) MessagingSystem() string { return "nats" }

// Publish publishes msg and waits for the stream's ack, or for ctx to end.
func (p *Publisher) Publish(ctx context.Context, msg postgres.Message) error {
	if err := p.connected(msg); err != nil {
		return err
	}
	ack, err := p.js.PublishMsg(ctx, p.natsMsg(msg))
	if err != nil {
		return p.failed(ctx, msg, err)
	}
	p.acked(ack)
	return nil
}

// PublishBatch publishes every message of msgs without waiting for the acks
// in between (JetStream's asynchronous publish), then waits for the acks in
// order, and returns how many, from the first, were acknowledged before the
// first that was not, with that one's error. The messages after it were sent
// too and may be stored: a relay publishes them again in a later pass, and
// the duplicate window drops those copies.
func (p *Publisher) PublishBatch(ctx context.Context, msgs []postgres.Message) (int, error) {
	if len(msgs) == 0 {
		return 0, nil
	}
	if err := p.connected(msgs[0]); err != nil {
		return 0, err
	}
	futures := make([]jetstream.PubAckFuture, 0, len(msgs))
	var sendErr error
	for _, msg := range msgs {
		f, err := p.js.PublishMsgAsync(p.natsMsg(msg))
		if err != nil {
			sendErr = err
			break
		}
		futures = append(futures, f)
	}
	for i, f := range futures {
		select {
		case ack := <-f.Ok():
			p.acked(ack)
		case err := <-f.Err():
			return i, p.failed(ctx, msgs[i], err)
		case <-ctx.Done():
			return i, p.failed(ctx, msgs[i], ctx.Err())
		}
	}
	if sendErr != nil {
		return len(futures), p.failed(ctx, msgs[len(futures)], sendErr)
	}
	return len(msgs), nil
}

// MaxSequenceBatch is the most messages PublishSequence sends in one batch:
// it bounds what one batch holds in flight and what the server keeps for it.
const MaxSequenceBatch = 1000

// PublishSequence publishes msgs in JetStream's fast batches (server 2.14
// and later) of up to MaxSequenceBatch: the messages of a batch go without
// waiting in between, the stream stores them in their order, ends the
// batch at the first it does not store, and answers once, with how many it
// stored. PublishSequence returns how many messages, from the first, the
// stream stored, with the error of the first it did not. The stream must
// allow batch publishing (StreamConfig sets it; CheckStream checks it).
//
// A message the stream already holds within its duplicate window counts
// as stored (the batch skips it and goes on), so a batch published again
// after a lost answer goes through at the batch's rate. A message the
// stream refuses (over its size) ends the batch: the error wraps
// [postgres.ErrRejected], and nothing after it is stored. A batch whose
// answer did not come (the context ended, the connection closed) returns
// the messages the stream said it had stored on the way (its flow acks),
// with an error wrapping [postgres.ErrBrokerUnavailable]: the stream may
// hold some of the rest, which the relay publishes again and the duplicate
// window drops.
func (p *Publisher) PublishSequence(ctx context.Context, msgs []postgres.Message) (int, error) {
	if len(msgs) == 0 {
		return 0, nil
	}
	if err := p.connected(msgs[0]); err != nil {
		return 0, err
	}
	done := 0
	for done < len(msgs) {
		batch := msgs[done:min(len(msgs), done+MaxSequenceBatch)]
		n, err := p.fastBatch(ctx, batch)
		done += n
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// batchAnswer is one of the stream's answers to a fast batch: a flow ack
// (Type "ack": the batch's messages up to Seq are stored), an error for the
// message Seq of the batch (Type "err"), a gap, or, with no Type, the
// stream's ack of the whole batch (Batch and Count: how many it stored) or
// its refusal of a message (Error).
type batchAnswer struct {
	Type  string              `json:"type"`
	Seq   int                 `json:"seq"`
	Batch string              `json:"batch"`
	Count int                 `json:"count"`
	Error *jetstream.APIError `json:"error"`
}

// The operations of a fast batch, the last but one token of each message's
// reply subject (nats-server's FastBatchOp constants).
const (
	fastBatchStart  = 0 // the first message
	fastBatchAppend = 1 // the messages after it
	fastBatchEnd    = 3 // no message: end the batch after the one before (EOB)
)

// fastBatchFlow is how many stored messages a fast batch's stream may let
// go by before it sends a flow ack.
const fastBatchFlow = 100

// fastBatch sends msgs as one fast batch and returns how many of them, from
// the first, the stream stored. Each message has, as its reply subject, a
// subject of its own under an inbox the batch listens on: the inbox, the
// batch's id, the flow, "fail" (the batch ends at a gap or an error), the
// message's place in the batch and its operation. After the messages comes
// the end of the batch, an empty message in the place after the last, so
// that the stream ends the batch and answers even when the last message is
// refused.
func (p *Publisher) fastBatch(ctx context.Context, msgs []postgres.Message) (int, error) {
	nc, id := p.js.Conn(), rand.Text()
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox + ".>")
	if err != nil {
		return 0, p.failed(ctx, msgs[0], err)
	}
	defer sub.Unsubscribe()
	reply := func(seq, op int) string {
		return fmt.Sprintf("%s.%s.%d.fail.%d.%d.$FI", inbox, id, fastBatchFlow, seq, op)
	}
	sent, refused := len(msgs), error(nil)
	for i, msg := range msgs {
		m := p.natsMsg(msg)
		m.Reply = reply(i+1, min(i, fastBatchAppend))
		if err := nc.PublishMsg(m); err != nil {
			if !errors.Is(err, nats.ErrMaxPayload) && !errors.Is(err, nats.ErrBadSubject) {
				return 0, p.failed(ctx, msg, err) // the answers may not come: assume none was stored
			}
			sent, refused = i, p.failed(ctx, msg, err) // the client's checks: not sent
			break
		}
	}
	if sent == 0 {
		return 0, refused
	}
	end := nats.NewMsg(p.natsMsg(msgs[sent-1]).Subject)
	end.Reply = reply(sent+1, fastBatchEnd)
	if err := nc.PublishMsg(end); err != nil {
		return 0, p.failed(ctx, msgs[0], err)
	}

	stored, errs := 0, map[int]*jetstream.APIError{}
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil && ctx.Err() != nil {
			// The answers that came before the context ended still count.
			if pending, perr := sub.NextMsg(0); perr == nil {
				m, err = pending, nil
			}
		}
		if err != nil {
			if stored < sent {
				return stored, fmt.Errorf("fast batch of %d messages, %d stored before: %w", sent, stored, p.failed(ctx, msgs[stored], err))
			}
			return stored, refused
		}
		var a batchAnswer
		if err := json.Unmarshal(m.Data, &a); err != nil {
			return stored, fmt.Errorf("%w: fast batch of %d messages: answer %q: %w", postgres.ErrBrokerUnavailable, sent, m.Data, err)
		}
		seq := placeInBatch(m.Subject)
		switch {
		case a.Type == "ack":
			stored = max(stored, a.Seq)
		case a.Type == "err":
			errs[a.Seq] = a.Error
		case a.Type != "":
			// a gap: the batch ends, and its ack says where
		case a.Batch == id:
			return p.batchStored(ctx, msgs, sent, a.Count, errs[a.Count+1], refused)
		case a.Error != nil && seq == 1: // the first message refused: no batch
			return 0, p.failed(ctx, msgs[0], a.Error)
		case a.Error != nil && seq > sent: // the end refused: the batch waits until the stream drops it
			return stored, fmt.Errorf("fast batch of %d messages, %d stored before its end was refused: %w: %w", sent, stored, postgres.ErrBrokerUnavailable, a.Error)
		case a.Error != nil:
			errs[seq] = a.Error // refused before it was a part of the batch: the next message ends the batch
		}
	}
}

// batchStored is fastBatch's result once the stream stored count of the
// sent messages: all of msgs, or up to the one refused, with why.
func (p *Publisher) batchStored(ctx context.Context, msgs []postgres.Message, sent, count int, why *jetstream.APIError, refused error) (int, error) {
	switch {
	case count > sent:
		return 0, fmt.Errorf("%w: the stream stored %d messages of a fast batch of %d", postgres.ErrBrokerUnavailable, count, sent)
	case count == sent:
		return count, refused // nil, or the refusal of the message after the last sent
	case why != nil:
		return count, p.failed(ctx, msgs[count], why)
	}
	return count, fmt.Errorf("message %s: the stream ended the fast batch after %d of %d messages without saying why: %w",
		msgs[count].Key, count, sent, postgres.ErrBrokerUnavailable)
}

// placeInBatch is the message's place in its fast batch that the reply
// subject of one of the batch's answers gives (zero if none).
func placeInBatch(subject string) int {
	tokens := strings.Split(subject, ".")
	if len(tokens) < 4 {
		return 0
	}
	seq, _ := strconv.Atoi(tokens[len(tokens)-3])
	return seq
}

// connected fails at once while the connection to the server is down. The
// client would otherwise keep the message in a buffer, to send it once it
// reconnects, and the relay's pass would wait for an ack until its budget ran
// out, holding its rows all that time.
func (p *Publisher) connected(msg postgres.Message) error {
	if nc := p.js.Conn(); !nc.IsConnected() {
		return fmt.Errorf("message %s: connection to the server is %v: %w", msg.Key, nc.Status(), postgres.ErrBrokerUnavailable)
	}
	return nil
}

func (p *Publisher) acked(ack *jetstream.PubAck) {
	if ack.Duplicate {
		p.duplicates.Add(1)
	}
}

// failed says what err, from publishing msg, means for the relay.
func (p *Publisher) failed(ctx context.Context, msg postgres.Message, err error) error {
	subject := p.prefix + msg.Type
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("message %s to %s: no ack before the context ended, so whether the stream stored it is unknown: %w: %w",
			msg.Key, subject, postgres.ErrBrokerUnavailable, err)
	case errors.Is(err, nats.ErrMaxPayload):
		return p.overLimit(msg, subject, err)
	case errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum):
		return fmt.Errorf("message %s to %s: %d bytes: %w: %w", msg.Key, subject, len(msg.Payload), postgres.ErrRejected, err)
	case errors.Is(err, nats.ErrBadSubject):
		return fmt.Errorf("message %s: type %q makes no valid subject: %w: %w", msg.Key, msg.Type, postgres.ErrRejected, err)
	case errors.Is(err, jetstream.ErrNoStreamResponse), errors.Is(err, nats.ErrNoResponders):
		// Nobody answered: either no stream takes the subject, which stays
		// so until someone provisions one, or JetStream is not up yet.
		// Either way the broker is at fault, not the message.
		if _, lookup := p.js.StreamNameBySubject(ctx, subject); errors.Is(lookup, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("message %s: no stream takes subject %s, so the broker is not provisioned as the relay needs: %w",
				msg.Key, subject, postgres.ErrBrokerUnavailable)
		}
	}
	return fmt.Errorf("message %s to %s: %w: %w", msg.Key, subject, postgres.ErrBrokerUnavailable, err)
}

// overLimit says what a message over the client's max_payload means. The
// client learned that limit when it connected, and keeps it: a server
// whose max_payload was raised since is not asked again. So before it
// refuses the message for good, overLimit asks the server its limit now,
// on a connection of its own made with the same options and closed at
// once. If the server takes the message now, it has the Publisher's
// connection reconnect, to learn the new limit, and says to try again
// (ErrBrokerUnavailable): a row parked for its size, put back once the
// limit was raised, goes without a restart of the relay. Otherwise, or if
// the server cannot be asked, the message is refused (ErrRejected).
func (p *Publisher) overLimit(msg postgres.Message, subject string, err error) error {
	nc := p.js.Conn()
	size, learned := len(msg.Payload), nc.MaxPayload()
	opts := nc.Opts
	opts.Name += " (max_payload probe)"
	opts.AllowReconnect, opts.RetryOnFailedConnect = false, false
	opts.ClosedCB, opts.DisconnectedErrCB, opts.ReconnectedCB, opts.DiscoveredServersCB, opts.AsyncErrorCB = nil, nil, nil, nil, nil
	opts.ConnectedCB, opts.LameDuckModeHandler, opts.ReconnectErrCB = nil, nil, nil
	probe, perr := opts.Connect()
	if perr == nil {
		now := probe.MaxPayload()
		probe.Close()
		if now > learned {
			nc.ForceReconnect()
			return fmt.Errorf("message %s to %s: %d bytes, over the %d the client learned when it connected, where the server now takes %d: reconnecting to learn it, to publish the message again: %w",
				msg.Key, subject, size, learned, now, postgres.ErrBrokerUnavailable)
		}
	}
	return fmt.Errorf("message %s to %s: %d bytes, over the server's max_payload (%d): %w: %w", msg.Key, subject, size, learned, postgres.ErrRejected, err)
}

// natsMsg is msg as JetStream carries it.
func (p *Publisher) natsMsg(msg postgres.Message) *nats.Msg {
	m := nats.NewMsg(p.prefix + msg.Type)
	m.Data = []byte(msg.Payload)
	if msg.Key != "" { // none for DirectOrderService's messages: nothing to deduplicate by
		m.Header.Set(jetstream.MsgIDHeader, msg.Key)
	}
	m.Header.Set(HeaderID, strconv.FormatInt(msg.ID, 10))
	if msg.Aggregate != "" {
		m.Header.Set(HeaderAggregate, msg.Aggregate)
		m.Header.Set(HeaderSeq, strconv.FormatInt(msg.Seq, 10))
	}
	for k, v := range msg.TraceContext { // traceparent, tracestate: W3C's names
		m.Header.Set(k, v)
	}
	if msg.ContentType != "" { // JSON's when absent
		m.Header.Set(HeaderContentType, msg.ContentType)
	}
	for k, v := range msg.Headers { // the team's own, none of the names above or below (postgres.ErrInvalidHeader)
		m.Header.Set(k, v)
	}
	if p.ceSource != "" {
		setCloudEvent(m.Header, msg, p.ceSource)
	}
	return m
}

// setCloudEvent sets on h the headers of msg as a CloudEvent in binary
// content mode: the NATS binding's ce- prefix before each attribute's name,
// and datacontenttype as content-type.
func setCloudEvent(h nats.Header, msg postgres.Message, source string) {
	id := msg.Key
	if id == "" { // a message published without an outbox
		id = strconv.FormatInt(msg.ID, 10)
	}
	h.Set("ce-specversion", "1.0")
	h.Set("ce-id", id)
	h.Set("ce-type", msg.Type)
	h.Set("ce-source", source)
	if msg.Aggregate != "" {
		h.Set("ce-subject", msg.Aggregate)
	}
	if !msg.Time.IsZero() {
		h.Set("ce-time", msg.Time.UTC().Format(time.RFC3339Nano))
	}
	contentType := msg.ContentType
	if contentType == "" {
		contentType = "application/json"
	}
	h.Set(HeaderContentType, contentType)
}
