package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/metric"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
	"example.com/patterns/enterprise/outbox/rabbitbroker/rabbittest"
)

// rabbitMQ is the shop's broker on RabbitMQ (-broker rabbitmq): one node,
// which the shop starts as its child process (Debian's rabbitmq-server, on
// loopback ports of its own, its data in the store folder, so that a shop
// started again on the same folder finds its queue and messages), and the
// topology rabbitbroker.DefaultTopology names: the exchange outbox and the
// warehouse's quorum queue. Down stops the node, Up starts it again on the
// same folder.
//
// Unlike JetStream, RabbitMQ drops no copy itself: the copy a lost ack
// makes the relay send again reaches the warehouse, which drops it by its
// key (the page's "copies dropped" under the warehouse); and a queue keeps
// no message once the warehouse acknowledged it, so there is no replay.
type rabbitMQ struct {
	topology  rabbitbroker.Topology
	publisher *rabbitbroker.Publisher
	url       atomic.Pointer[string]                // the node's, read without mu: a dial never waits for a Down or Up
	warehouse atomic.Pointer[rabbitbroker.Consumer] // once Warehouse made it

	mu   sync.Mutex // guards node (not safe for concurrent use); held through a Down or Up
	node *rabbittest.Node

	adminMu sync.Mutex       // guards admin
	admin   *amqp.Connection // the page's and /outbox's questions; dialled again when closed
}

func startRabbitMQ(store string, nodes int) (*rabbitMQ, error) {
	if nodes != 1 {
		return nil, fmt.Errorf("-broker rabbitmq runs one node, not -nodes %d", nodes)
	}
	node, err := rabbittest.Start(rabbittest.Options{Dir: store})
	if err != nil {
		return nil, err
	}
	b := &rabbitMQ{topology: rabbitbroker.DefaultTopology, node: node}
	b.setURL()
	if b.publisher, err = rabbitbroker.NewPublisher(b.dial, rabbitbroker.PublisherOptions{Exchange: b.topology.Exchange}); err != nil {
		node.Stop()
		return nil, err
	}
	return b, nil
}

// dial connects to the node, giving up after brokerTimeout.
func (b *rabbitMQ) dial() (*amqp.Connection, error) {
	return amqp.DialConfig(b.URL(), amqp.Config{Dial: amqp.DefaultDial(brokerTimeout)})
}

func (b *rabbitMQ) Name() string { return "RabbitMQ" }

func (b *rabbitMQ) URL() string { return *b.url.Load() }

// setURL records the node's URL, which a start on new ports changes (a
// port taken: rabbittest). Called with mu held, or before b is shared.
func (b *rabbitMQ) setURL() {
	url := b.node.URL()
	b.url.Store(&url)
}

func (b *rabbitMQ) Provision(ctx context.Context) (string, error) {
	err := b.ask(ctx, func(ch *amqp.Channel) error { return b.topology.Declare(ch) })
	if err != nil {
		return "", fmt.Errorf("provision exchange %s and queue %s: %w", b.topology.Exchange, b.topology.Queue, err)
	}
	return fmt.Sprintf("exchange %s and quorum queue %s (dead letters: %s)", b.topology.Exchange, b.topology.Queue, b.topology.DeadLetterQueue()), nil
}

func (b *rabbitMQ) Check(ctx context.Context) error {
	err := b.ask(ctx, func(ch *amqp.Channel) error {
		if err := ch.ExchangeDeclarePassive(b.topology.Exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			return err
		}
		_, err := ch.QueueDeclarePassive(b.topology.Queue, true, false, false, false, nil)
		return err
	})
	if err != nil {
		return fmt.Errorf("exchange %s, queue %s: %w: run shop migrate first", b.topology.Exchange, b.topology.Queue, err)
	}
	return nil
}

// ask calls f with a channel of its own on the admin connection (a
// channel, since RabbitMQ closes one on a refused question), for as long
// as ctx allows: amqp091's calls heed no context, so a call that outlives
// ctx is left to end when its connection does.
func (b *rabbitMQ) ask(ctx context.Context, f func(*amqp.Channel) error) error {
	done := make(chan error, 1)
	go func() {
		conn, err := b.adminConn()
		if err != nil {
			done <- err
			return
		}
		ch, err := conn.Channel()
		if err != nil {
			done <- err
			return
		}
		err = f(ch)
		ch.Close()
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (b *rabbitMQ) adminConn() (*amqp.Connection, error) {
	b.adminMu.Lock()
	defer b.adminMu.Unlock()
	if b.admin != nil && !b.admin.IsClosed() {
		return b.admin, nil
	}
	conn, err := amqp.DialConfig(b.URL(), amqp.Config{Dial: amqp.DefaultDial(brokerTimeout)})
	if err != nil {
		return nil, err
	}
	b.admin = conn
	return conn, nil
}

func (b *rabbitMQ) Publisher() postgres.MessageBroker { return b.publisher }

// Warehouse is rabbitbroker's Consumer of the warehouse's queue.
func (b *rabbitMQ) Warehouse(h handler, logger *slog.Logger, meters metric.MeterProvider) (runner, error) {
	c, err := rabbitbroker.NewConsumer(b.dial, b.topology.Queue, h, rabbitbroker.ConsumerOptions{Logger: logger, MeterProvider: meters})
	if err != nil {
		return nil, err
	}
	b.warehouse.Store(c)
	return c, nil
}

// Stored is how many messages wait in the warehouse's queue, ready for a
// consumer: RabbitMQ drops each once the warehouse acknowledged it.
func (b *rabbitMQ) Stored(ctx context.Context) (int64, error) {
	var n int64
	err := b.ask(ctx, func(ch *amqp.Channel) error {
		q, err := ch.QueueDeclarePassive(b.topology.Queue, true, false, false, false, nil)
		n = int64(q.Messages)
		return err
	})
	return n, err
}

// Dropped is zero: RabbitMQ keeps no record of what it took, and drops no
// copy.
func (b *rabbitMQ) Dropped() int64 { return 0 }

func (b *rabbitMQ) ConsumerView(ctx context.Context) (map[string]any, error) {
	var ready, consumers, dead int
	err := b.ask(ctx, func(ch *amqp.Channel) error {
		q, err := ch.QueueDeclarePassive(b.topology.Queue, true, false, false, false, nil)
		if err != nil {
			return err
		}
		ready, consumers = q.Messages, q.Consumers
		d, err := ch.QueueDeclarePassive(b.topology.DeadLetterQueue(), true, false, false, false, nil)
		dead = d.Messages
		return err
	})
	if err != nil {
		return nil, err
	}
	view := map[string]any{"pending": ready, "consumers": consumers, "deadLetters": dead}
	if c := b.warehouse.Load(); c != nil {
		view["handedBack"], view["deadLettered"] = c.HandedBack(), c.DeadLettered()
		view["waiting"], view["oldestWaitingSeconds"] = c.Waiting(), c.OldestWaiting().Seconds()
	}
	return view, nil
}

func (b *rabbitMQ) Replay(context.Context, handler, metric.MeterProvider) error { return errNoReplay }

func (b *rabbitMQ) Down() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.node.Down()
	return "down"
}

func (b *rabbitMQ) Up() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	err := b.node.Up()
	b.setURL()
	return err
}

// State says "up" or "down", or "changing" while a Down or Up runs (the
// page's read of it does not wait for one).
func (b *rabbitMQ) State() string {
	if !b.mu.TryLock() {
		return "changing"
	}
	defer b.mu.Unlock()
	if b.node.IsUp() {
		return "up"
	}
	return "down"
}

func (b *rabbitMQ) Stop() {
	b.publisher.Close()
	b.adminMu.Lock()
	if b.admin != nil {
		b.admin.Close()
	}
	b.adminMu.Unlock()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.node.Stop()
}

var _ messageBroker = (*rabbitMQ)(nil)
