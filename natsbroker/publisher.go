package natsbroker

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

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
// aggregate and seq in headers (HeaderID, HeaderAggregate, HeaderSeq).
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
//     [postgres.ErrRejected], which a relay may park;
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
	duplicates atomic.Int64
}

// NewPublisher returns a Publisher that publishes through js, created by
// the caller with the options its deployment needs (a domain or an API
// prefix, jetstream.WithPublishAsyncMaxPending, and
// jetstream.WithPublishAsyncTimeout, which frees the client's slot for an
// asynchronous publish whose ack was lost: PublishBatch itself stops
// waiting when its context ends). It does not create the stream: provision
// it apart with StreamConfig, and check it with CheckStream.
func NewPublisher(js jetstream.JetStream) *Publisher {
	return DefaultNames.NewPublisher(js)
}

// Duplicates is how many messages the stream acknowledged as duplicates: it
// had stored them before, within its window, and dropped the new copy.
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

// MaxAtomicBatch is the most messages PublishSequence sends in one atomic
// batch: the server's limit, unless its configuration lowers it (a batch
// over the limit is refused, and its messages go one at a time).
const MaxAtomicBatch = 1000

// PublishSequence publishes msgs in atomic batches (JetStream's, ADR-50: the
// stream stores all of a batch's messages, in their order, or none of them)
// of up to MaxAtomicBatch, one round trip each, and returns how many, from
// the first, the stream acknowledged, with the error of the first it did
// not. The stream must allow atomic publishing (StreamConfig sets it;
// CheckStream checks it).
//
// A batch the stream refuses as a whole (one message over its size, one
// it stored before within its duplicate window, a stream that does not allow
// atomic batches) goes again one message at a time, through Publish, which
// finds the message at fault, stops at it and says why; the batches after
// it go on as batches. A batch whose answer did not come (the context
// ended, the connection closed) may have been stored whole: the error wraps
// [postgres.ErrBrokerUnavailable], and the relay publishes it again, as a
// batch refused for its duplicates, and so one at a time.
func (p *Publisher) PublishSequence(ctx context.Context, msgs []postgres.Message) (int, error) {
	if len(msgs) == 0 {
		return 0, nil
	}
	if err := p.connected(msgs[0]); err != nil {
		return 0, err
	}
	done := 0
	for done < len(msgs) {
		batch := msgs[done:min(len(msgs), done+MaxAtomicBatch)]
		err := p.atomic(ctx, batch)
		if errors.Is(err, postgres.ErrBrokerUnavailable) {
			return done, err
		}
		if err != nil { // refused whole: find the message at fault
			for i, msg := range batch {
				if err := p.Publish(ctx, msg); err != nil {
					return done + i, err
				}
			}
		}
		done += len(batch)
	}
	return done, nil
}

// batchAck is the stream's answer to an atomic batch's last message: how
// many messages it stored, or why it stored none.
type batchAck struct {
	Batch string              `json:"batch"`
	Count int                 `json:"count"`
	Error *jetstream.APIError `json:"error"`
}

// The headers of an atomic batch's messages (ADR-50).
const (
	batchIDHeader     = "Nats-Batch-Id"       // the batch's id, the same in each of its messages
	batchSeqHeader    = "Nats-Batch-Sequence" // the message's place in its batch, from 1
	batchCommitHeader = "Nats-Batch-Commit"   // "1" on the last: store the batch
)

// errBatchRefused is atomic's error for a batch the stream refused whole.
var errBatchRefused = errors.New("atomic batch refused")

// atomic sends msgs as one atomic batch: each message with the batch's id
// and its place in it, without a reply, and the last with the commit, as a
// request whose reply is the batch's ack. It returns nil once the stream
// stored them all, an error wrapping errBatchRefused if it refused them
// (it stored none), and one wrapping postgres.ErrBrokerUnavailable if the
// answer did not come.
func (p *Publisher) atomic(ctx context.Context, msgs []postgres.Message) error {
	nc, id := p.js.Conn(), rand.Text()
	for i, msg := range msgs {
		m := p.natsMsg(msg)
		m.Header.Set(batchIDHeader, id)
		m.Header.Set(batchSeqHeader, strconv.Itoa(i+1))
		if i < len(msgs)-1 {
			if err := nc.PublishMsg(m); err != nil {
				return fmt.Errorf("%w: message %d of %d: %w", errBatchRefused, i+1, len(msgs), err)
			}
			continue
		}
		m.Header.Set(batchCommitHeader, "1")
		reply, err := nc.RequestMsgWithContext(ctx, m)
		if err != nil {
			if errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, nats.ErrBadSubject) { // the client's checks: not sent
				return fmt.Errorf("%w: message %d of %d: %w", errBatchRefused, i+1, len(msgs), err)
			}
			return fmt.Errorf("atomic batch of %d messages: %w", len(msgs), p.failed(ctx, msg, err))
		}
		var ack batchAck
		switch err := json.Unmarshal(reply.Data, &ack); {
		case err != nil:
			return fmt.Errorf("%w: atomic batch of %d messages: answer %q: %w", postgres.ErrBrokerUnavailable, len(msgs), reply.Data, err)
		case ack.Error != nil:
			return fmt.Errorf("%w: %d messages: %w", errBatchRefused, len(msgs), ack.Error)
		case ack.Batch != id || ack.Count != len(msgs):
			return fmt.Errorf("%w: the stream answered batch %s of %d with one of %s of %d",
				errBatchRefused, id, len(msgs), ack.Batch, ack.Count)
		}
	}
	return nil
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
	case errors.Is(err, nats.ErrMaxPayload), errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum):
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
	return m
}
