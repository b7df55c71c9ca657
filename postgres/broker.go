package postgres

import (
	"context"
	"errors"
	"fmt"

	"example.com/patterns/enterprise/outbox"
)

// Message is an outbox row as this package's relay publishes it: the root
// package's [outbox.Message], whose ID is the row's id, and the row's key.
type Message struct {
	outbox.Message

	// Key names the message where consumers meet: a UUID the row was given at
	// insert, unique across producers, and kept by every copy a re-send makes.
	// ID is unique only within one database's sequence, and not even there
	// once the sequence is reset, so consumers drop duplicates by Key, and a
	// broker that deduplicates (JetStream's Nats-Msg-Id) should be given Key
	// too. It
	// is empty for a message published without an outbox, by
	// DirectOrderService.
	Key string

	// Aggregate names what the message is about, such as "order/17", and
	// Seq is its number among that aggregate's messages, from 1: a consumer
	// that has applied Seq n of an aggregate applies n+1 next, and can tell
	// a message that arrives before its predecessor. Empty and zero for a
	// message that needs no order.
	Aggregate string
	Seq       int64
}

// ErrRejected is what a [MessageBroker] wraps to say that it refused a
// message for ever: a payload over its limit, a destination that does not
// exist. Publishing it again cannot succeed, so a relay may park it
// ([OutboxRelay.ParkAfter]). Every other error, such as
// [outbox.ErrBrokerUnavailable], is taken as one that may pass: a broker that
// is down, however long, never has a message parked.
var ErrRejected = errors.New("postgres: message rejected by the broker")

// MessageBroker is the producer side of a message broker, as this package's
// relay and [DirectOrderService] use it: the root package's
// [outbox.MessageBroker] with a context, so that a relay can stop a publish
// that hangs instead of holding its claim, and its transaction, for as long
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

// BatchPublisher is a [MessageBroker] that can also publish several messages
// at once, without waiting for each acknowledgement before it sends the next
// message, as JetStream's asynchronous publish and Kafka's producer do. A
// relay pass with [OutboxRelay.PerAggregate] publishes its batch through
// PublishBatch when its broker has one; one without it publishes a message
// at a time, since a broker may store a batch's messages after one it
// refused, ahead of it.
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

// AdaptBroker returns a [MessageBroker] that publishes through b, a broker
// whose Publish takes no context, such as [outbox.InMemoryBroker].
//
// Such a broker gets msg.Message: the Key is not passed on. And it cannot be
// stopped. If ctx ends before b.Publish returns, the
// adapter returns ctx's error at once and leaves the call running in a
// goroutine of its own until b returns; whether b accepted the message is
// then unknown, so a relay leaves it unsent and it goes again. A broker that
// hangs for ever therefore keeps one goroutine per relay pass that met it.
// Give a real broker a Publish that takes the context instead.
func AdaptBroker(b outbox.MessageBroker) MessageBroker {
	return adapted{b}
}

type adapted struct{ b outbox.MessageBroker }

func (a adapted) Publish(ctx context.Context, msg Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if ctx.Done() == nil { // a context that never ends: no need to watch it
		return a.b.Publish(msg.Message)
	}
	done := make(chan error, 1) // buffered: the call may finish after we stopped waiting
	go func() { done <- a.b.Publish(msg.Message) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("broker did not answer before the context ended, so whether it accepted the message is unknown: %w", ctx.Err())
	}
}
