package shop

import (
	"context"
	"errors"
	"fmt"

	"example.com/patterns/enterprise/outbox"
	"example.com/patterns/enterprise/outbox/postgres"
)

// AdaptBroker returns a [postgres.MessageBroker] that publishes through b, a
// broker whose Publish takes no context, such as [outbox.InMemoryBroker]:
// the lesson's fake broker behind the real relay.
//
// Such a broker gets the message's ID, Type and Payload: the Key and the
// aggregate are not passed on. Its [outbox.ErrBrokerUnavailable] comes back
// wrapping [postgres.ErrBrokerUnavailable] too. And it cannot be stopped. If
// ctx ends before b.Publish returns, the adapter returns ctx's error at once
// and leaves the call running in a goroutine of its own until b returns;
// whether b accepted the message is then unknown, so a relay leaves it
// unsent and it goes again. A broker that hangs for ever therefore keeps one
// goroutine per relay pass that met it. Give a real broker a Publish that
// takes the context instead.
func AdaptBroker(b outbox.MessageBroker) postgres.MessageBroker {
	return adapted{b}
}

type adapted struct{ b outbox.MessageBroker }

func (a adapted) Publish(ctx context.Context, msg postgres.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m := outbox.Message{ID: msg.ID, Type: msg.Type, Payload: msg.Payload}
	if ctx.Done() == nil { // a context that never ends: no need to watch it
		return unavailable(a.b.Publish(m))
	}
	done := make(chan error, 1) // buffered: the call may finish after we stopped waiting
	go func() { done <- a.b.Publish(m) }()
	select {
	case err := <-done:
		return unavailable(err)
	case <-ctx.Done():
		return fmt.Errorf("broker did not answer before the context ended, so whether it accepted the message is unknown: %w", ctx.Err())
	}
}

// unavailable makes the root package's ErrBrokerUnavailable the outbox
// package's as well.
func unavailable(err error) error {
	if errors.Is(err, outbox.ErrBrokerUnavailable) && !errors.Is(err, postgres.ErrBrokerUnavailable) {
		return fmt.Errorf("%w: %w", postgres.ErrBrokerUnavailable, err)
	}
	return err
}
