package postgres

import (
	"context"
	"errors"
	"time"
)

// Message is an outbox row as the relay publishes it and a consumer
// receives it. It is this package's own type, not the root teaching
// package's Message that it extends (with the key and the aggregate), so
// that a team imports the outbox without the lesson.
type Message struct {
	ID      int64  // the row's id: unique in one database, in the order rows were inserted
	Type    string // the event type, such as "UserRegistered"; see [ErrInvalidEventType]
	Payload string // the event as JSON, byte for byte as Outbox.Write encoded it; bytes if ContentType says so

	// ContentType is the payload's media type when it is not JSON
	// (Event.ContentType): empty for JSON.
	ContentType string

	// Headers are the team's own headers (Event.Headers), which a broker
	// carries unchanged; nil for none.
	Headers map[string]string

	// Time is when the event was written: its row's created_at, the start of
	// the transaction that wrote it. Zero for a message published without
	// an outbox.
	Time time.Time

	// Key names the message where consumers meet: a UUID the row was given at
	// insert, unique across producers, and kept by every copy a re-send makes.
	// ID is unique only within one database's sequence, and not even there
	// once the sequence is reset, so consumers drop duplicates by Key, and a
	// broker that deduplicates (JetStream's Nats-Msg-Id) should be given Key
	// too. It is empty for a message published without an outbox.
	Key string

	// Aggregate names what the message is about, such as "account/17", and
	// Seq is its number among that aggregate's messages, from 1: a consumer
	// that has applied Seq n of an aggregate applies n+1 next, and can tell
	// a message that arrives before its predecessor. Empty and zero for a
	// message that needs no order.
	Aggregate string
	Seq       int64

	// TraceContext is the W3C trace context (traceparent, and tracestate
	// if any) that the message carries to its consumers: the relay's
	// publish span, in the trace of the transaction that wrote the row, or
	// that transaction's own context when the relay records no spans. A
	// broker passes it on in its headers; a consumer starts its span from
	// it with [ContextWithTrace]. Nil when the row was written outside any
	// trace and the relay records none.
	TraceContext map[string]string
}

// ErrRejected is what a [MessageBroker] wraps to say that it refused a
// message for ever: a payload over its limit, a destination that does not
// exist. Publishing it again cannot succeed, so a relay may park it
// ([RelayConfig.ParkAfter]). Every other error, such as
// [ErrBrokerUnavailable], is taken as one that may pass: a broker that
// is down, however long, never has a message parked.
//
// Its text, like ErrBrokerUnavailable's, begins "outbox:", as the lesson's
// errors do: it says what the broker did, not PostgreSQL.
var ErrRejected = errors.New("outbox: message rejected by the broker")

// ErrBrokerUnavailable is what a [MessageBroker] wraps to say that it could not
// reach the broker, or gave up waiting for its answer: the message may go
// through on a later try, and so may every message after it. A relay pass stops
// at it, with order per aggregate too, which passes over only the aggregate of
// a message refused in any other way.
var ErrBrokerUnavailable = errors.New("outbox: message broker unavailable")

// MessageBroker is the producer side of a message broker, as the relay uses
// it: the root teaching package's MessageBroker with a context, so that a
// relay can stop a publish that hangs instead of holding its claim, and its transaction, for as long
// as the broker takes.
//
// Publish hands msg to the broker and returns once the broker has accepted
// it (nil) or refused it, or ctx has ended (an error). An error means the
// broker may not have accepted the message; it may also have accepted it
// (an acknowledgement lost on the way back), which is why delivery is at
// least once. Publish must return soon after ctx ends.
//
// Implementations must be safe for concurrent use by multiple goroutines.
type MessageBroker interface {
	Publish(ctx context.Context, msg Message) error
}

// BatchPublisher is a [MessageBroker] that can also publish several messages at
// once, without waiting for each acknowledgement before it sends the next
// message, as JetStream's asynchronous publish and Kafka's producer do. A relay
// pass with order per aggregate (the default) publishes through PublishBatch
// the rows of its batch that hold no aggregate twice, and a
// [LogRelay] a transaction's rows the same way; a polling relay with WholeTable
// publishes a message at a time, since a broker may store a batch's messages
// after one it refused, ahead of it. A [SequencePublisher] does not: the relays
// hand it their whole batch.
//
// PublishBatch publishes msgs, in their order, and returns how many of them,
// counted from the first, the broker accepted, and, if that is fewer than
// len(msgs), the error of the first message it did not accept (nil only when
// it accepted all of them). A message after that one may have been accepted
// too: the relay does not mark it, and publishes it again in a later pass, so
// the broker or the consumers must drop such copies. PublishBatch must
// return soon after ctx ends, with what was accepted by then.
type BatchPublisher interface {
	MessageBroker
	PublishBatch(ctx context.Context, msgs []Message) (accepted int, err error)
}

// SequencePublisher is a [MessageBroker] that publishes several messages at
// once and keeps their order: of the messages one PublishSequence call is
// given, the broker stores the first few, and never a message after one it did
// not store, as JetStream's fast batch does (it ends at the first message it
// refuses). The relays hand it their whole batch, with
// [RelayConfig.WholeTable] as with order per aggregate: the order a consumer
// sees is the rows' order, at the cost of one round trip a batch instead of one a
// message.
//
// PublishSequence publishes msgs, in their order, and returns how many of
// them, counted from the first, the broker accepted, and, if that is fewer
// than len(msgs), the error of the first message it did not accept (nil
// only when it accepted all of them). It may have stored more than it
// reports (an acknowledgement lost on its way back), but only whole
// prefixes of msgs; the relay publishes what it did not report again, so
// the broker or the consumers must drop such copies. Which message of a
// batch the broker refused is the implementation's to find out: by
// publishing them again one at a time, for example. PublishSequence must
// return soon after ctx ends, with what was accepted by then.
type SequencePublisher interface {
	MessageBroker
	PublishSequence(ctx context.Context, msgs []Message) (accepted int, err error)
}
