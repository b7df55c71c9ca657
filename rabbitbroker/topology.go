// Package rabbitbroker publishes an outbox's messages to RabbitMQ and
// consumes them: a [Publisher] that is a [postgres.MessageBroker] and a
// [postgres.BatchPublisher] for the relays, and a [Consumer] for the
// services that apply them.
//
// RabbitMQ keeps no record of the messages it took: every copy a relay
// publishes again (after a lost confirm, a shutdown, a broker that came
// back) reaches the consumer, which must drop it by its key, as
// [postgres.Outbox.ApplyOnce] does. See the README for what a confirm promises.
package rabbitbroker

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Topology names where an outbox's messages go: Exchange, a durable topic
// exchange, routes each message by its type (its routing key) to Queue, a
// durable quorum queue (replicated on every node of a cluster up to the
// server's default, and written to disk before a confirm); a message Queue
// gives up on goes to Queue+".dead", through the fanout exchange
// Exchange+".dead".
//
// Queue has a single active consumer (x-single-active-consumer): of the
// Consumers attached, one at a time receives its messages, in the queue's
// order, so each aggregate's messages are applied in the order the relay
// published them; the others wait, and one takes over when it goes. (The
// consistent-hash exchange would spread aggregates over several queues, a
// consumer each, for more throughput; it is one more plugin and one more
// thing to size.)
//
// A message is given up on, and dead-lettered, when it is handed back
// (basic.nack with requeue) more than DeliveryLimit times
// (x-delivery-limit), or at once when a Consumer finds it can never be
// applied.
type Topology struct {
	Exchange      string
	Queue         string
	DeliveryLimit int
}

// DefaultTopology is the exchange "outbox" and the warehouse's queue.
var DefaultTopology = Topology{Exchange: "outbox", Queue: "warehouse", DeliveryLimit: 20}

// ErrTopology is wrapped by Declare's error for a topology that names
// nothing or gives no delivery limit.
var ErrTopology = errors.New("rabbitbroker: invalid topology")

// DeadLetterQueue is the queue of the messages Queue gave up on.
func (t Topology) DeadLetterQueue() string { return t.Queue + ".dead" }

// Declare declares t's exchanges and queues on ch, and binds them; it may be
// called again (declaring what exists, with the same arguments, changes
// nothing), but RabbitMQ refuses, closing ch, arguments that differ from
// those a queue was made with.
func (t Topology) Declare(ch *amqp.Channel) error {
	if t.Exchange == "" || t.Queue == "" || t.DeliveryLimit < 1 {
		return fmt.Errorf("%w: %+v", ErrTopology, t)
	}
	dead := t.Exchange + ".dead"
	if err := ch.ExchangeDeclare(t.Exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", t.Exchange, err)
	}
	if err := ch.ExchangeDeclare(dead, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", dead, err)
	}
	if _, err := ch.QueueDeclare(t.DeadLetterQueue(), true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}); err != nil {
		return fmt.Errorf("declare queue %s: %w", t.DeadLetterQueue(), err)
	}
	if err := ch.QueueBind(t.DeadLetterQueue(), "", dead, false, nil); err != nil {
		return fmt.Errorf("bind queue %s: %w", t.DeadLetterQueue(), err)
	}
	if _, err := ch.QueueDeclare(t.Queue, true, false, false, false, amqp.Table{
		amqp.QueueTypeArg:            amqp.QueueTypeQuorum,
		amqp.SingleActiveConsumerArg: true,
		"x-delivery-limit":           t.DeliveryLimit,
		"x-dead-letter-exchange":     dead,
	}); err != nil {
		return fmt.Errorf("declare queue %s: %w", t.Queue, err)
	}
	if err := ch.QueueBind(t.Queue, "#", t.Exchange, false, nil); err != nil {
		return fmt.Errorf("bind queue %s: %w", t.Queue, err)
	}
	return nil
}

// Check reports whether t's exchanges and queues exist on the server conn
// is connected to, changing nothing (passive declares, each on a channel of
// its own, since the server closes the channel of one that fails): an error
// names the first that is missing. It cannot see bindings; Declare makes
// them.
func (t Topology) Check(conn *amqp.Connection) error {
	if t.Exchange == "" || t.Queue == "" || t.DeliveryLimit < 1 {
		return fmt.Errorf("%w: %+v", ErrTopology, t)
	}
	passive := []struct {
		what, name string
		declare    func(ch *amqp.Channel) error
	}{
		{"exchange", t.Exchange, func(ch *amqp.Channel) error {
			return ch.ExchangeDeclarePassive(t.Exchange, amqp.ExchangeTopic, true, false, false, false, nil)
		}},
		{"exchange", t.Exchange + ".dead", func(ch *amqp.Channel) error {
			return ch.ExchangeDeclarePassive(t.Exchange+".dead", amqp.ExchangeFanout, true, false, false, false, nil)
		}},
		{"queue", t.Queue, func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclarePassive(t.Queue, true, false, false, false, nil)
			return err
		}},
		{"queue", t.DeadLetterQueue(), func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclarePassive(t.DeadLetterQueue(), true, false, false, false, nil)
			return err
		}},
	}
	for _, p := range passive {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		err = p.declare(ch)
		ch.Close()
		if err != nil {
			return fmt.Errorf("%s %s: %w (declare the topology first)", p.what, p.name, err)
		}
	}
	return nil
}
