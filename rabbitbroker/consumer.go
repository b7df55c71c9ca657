package rabbitbroker

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Handler applies a message and reports whether it did (false: a copy it
// had applied before, dropped by its key). The example's shop.Warehouse is
// one, through [postgres.ApplyOnce].
type Handler interface {
	Handle(ctx context.Context, msg postgres.Message) (applied bool, err error)
}

// Defaults of a [Consumer]'s fields left zero.
const (
	DefaultPrefetch      = 10
	DefaultRetryDelay    = time.Second
	DefaultMaxAttempts   = 5
	DefaultHandleTimeout = 30 * time.Second
)

// Consumer feeds the messages of a queue to a Handler, in the queue's order
// (one at a time, or each aggregate's in order with Concurrency), and tells
// RabbitMQ what became of each:
//   - handled (applied, or a copy dropped by its key): basic.ack, only after
//     the handler returned, so after its transaction committed. A consumer
//     that dies before its ack leaves the message to be delivered again, and
//     the handler drops that copy. RabbitMQ drops no copies itself: every
//     copy a relay published reaches Handle, and Duplicates counts those
//     dropped;
//   - failed for a reason that may pass (a database that is down): tried
//     again in place after RetryDelay, so the messages behind it keep
//     their order, up to MaxAttempts tries, then handed back
//     (basic.nack, requeue), which spends one of the queue's deliveries;
//   - arrived before its predecessor ([postgres.ErrOutOfOrder]): handed
//     back after RetryDelay, spending a delivery;
//   - never to be applied (a payload the handler cannot read, wrapping
//     [postgres.ErrMalformedMessage], no key, headers that are not an
//     outbox message's): basic.nack without requeue, which dead-letters it
//     at once, with a log line at level Error.
//
// A message handed back more often than the queue's x-delivery-limit
// (Topology.DeliveryLimit) is dead-lettered by RabbitMQ: nothing is tried
// for ever. The dead-letter queue keeps it for an operator.
//
// Run reconnects after its connection or channel closed (a node restarted),
// RetryDelay apart; the messages it had not acked are delivered again.
//
// A Consumer is not safe for concurrent use: run one Run at a time; its
// Handler is called from Concurrency goroutines at once. Create one with
// [NewConsumer].
type Consumer struct {
	dial    func() (*amqp.Connection, error)
	queue   string
	handler Handler

	// Prefetch is how many unacked messages RabbitMQ sends ahead (the
	// channel's basic.qos); zero or less means DefaultPrefetch.
	Prefetch int
	// RetryDelay is the wait before a failed message is tried again, or
	// handed back, and between reconnections; zero or less means
	// DefaultRetryDelay.
	RetryDelay time.Duration
	// MaxAttempts is how many times a delivery is tried in place before it
	// is handed back; zero or less means DefaultMaxAttempts.
	MaxAttempts int
	// HandleTimeout bounds each call of the Handler: one that runs out of
	// time failed for a reason that may pass, and is tried again. Zero or
	// less means DefaultHandleTimeout.
	HandleTimeout time.Duration
	// Concurrency is how many messages Run handles at once, each on one of
	// as many workers: all the messages of an aggregate go to the same
	// worker (by a hash of the aggregate, or of the key for a message with
	// none), which handles them in the queue's order, so each aggregate's
	// order holds while different aggregates are applied side by side.
	// Zero or less means 1. Prefetch bounds what the workers hold in all:
	// set it to at least Concurrency.
	Concurrency int
	// Logger, if not nil, is told of each message dead-lettered, each
	// failure and each reconnection.
	Logger *slog.Logger

	// TracerProvider and MeterProvider are where the consumer reports (nil:
	// otel's global ones), as natsbroker's Consumer does. Each delivery is a
	// consumer span, "process <queue>", the child of the relay's publish
	// span whose context the message carries in its traceparent header, and
	// linked to it (its creation context): the trace of the request that
	// wrote the row goes on to Handle and the handler's transaction. The
	// meter counts messaging.client.consumed.messages by outbox.result:
	// applied, duplicate, retry (handed back after MaxAttempts, or cut short
	// by Run's end), out_of_order (handed back) or dead_lettered. They are
	// read when Run starts.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	telemetry *postgres.ConsumerTelemetry

	applied, duplicates, handedBack, deadLettered atomic.Int64
}

// NewConsumer returns a Consumer of queue, over connections dial makes,
// that feeds h.
func NewConsumer(dial func() (*amqp.Connection, error), queue string, h Handler) *Consumer {
	return &Consumer{dial: dial, queue: queue, handler: h}
}

// Applied, Duplicates, HandedBack and DeadLettered count the messages the
// handler applied, the copies it dropped, the deliveries this Consumer
// handed back (requeued: out of order, or failed MaxAttempts times), and the
// messages it dead-lettered (not those RabbitMQ dead-lettered past the
// delivery limit).
func (c *Consumer) Applied() int64      { return c.applied.Load() }
func (c *Consumer) Duplicates() int64   { return c.duplicates.Load() }
func (c *Consumer) HandedBack() int64   { return c.handedBack.Load() }
func (c *Consumer) DeadLettered() int64 { return c.deadLettered.Load() }

// Run consumes until ctx ends, and then returns ctx's error. A message
// whose handling ctx cut short is neither acked nor handed back: RabbitMQ
// delivers it again once the channel closes.
func (c *Consumer) Run(ctx context.Context) error {
	c.telemetry = postgres.NewConsumerTelemetry(c.TracerProvider, c.MeterProvider, instrumentationName, "rabbitmq",
		"applied, duplicate, retry, out_of_order or dead_lettered")
	for {
		err := c.consume(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if c.Logger != nil {
			c.Logger.Warn("consumer disconnected; connecting again", "queue", c.queue, "error", err)
		}
		if !sleep(ctx, orDefault(c.RetryDelay, DefaultRetryDelay)) {
			return ctx.Err()
		}
	}
}

// consume consumes over one connection until it or its channel closes, or
// ctx ends.
func (c *Consumer) consume(ctx context.Context) error {
	conn, err := c.dial()
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open a channel: %w", err)
	}
	if err := ch.Qos(orDefault(c.Prefetch, DefaultPrefetch), 0, false); err != nil {
		return fmt.Errorf("qos: %w", err)
	}
	deliveries, err := ch.ConsumeWithContext(ctx, c.queue, "", false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %s: %w", c.queue, err)
	}
	// Each worker handles its share in order; the first that cannot tell
	// RabbitMQ what became of a message stops them all. The deferred stop
	// runs before the connection closes: what the workers held and had not
	// acked is delivered again once it does.
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	workers := make([]chan amqp.Delivery, orDefault(c.Concurrency, 1))
	var wg sync.WaitGroup
	for i := range workers {
		workers[i] = make(chan amqp.Delivery, orDefault(c.Prefetch, DefaultPrefetch))
		wg.Go(func() {
			for d := range workers[i] {
				if ctx.Err() != nil {
					continue
				}
				if err := c.handle(ctx, d); err != nil {
					stop(err)
				}
			}
		})
	}
	defer func() {
		for _, w := range workers {
			close(w)
		}
		wg.Wait()
	}()
	for {
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case d, ok := <-deliveries:
			if !ok {
				return fmt.Errorf("deliveries of %s ended: %w", c.queue, amqp.ErrClosed)
			}
			select {
			case workers[worker(d, len(workers))] <- d:
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		}
	}
}

// worker is the worker of n that handles d: the same for every message of
// its aggregate.
func worker(d amqp.Delivery, n int) int {
	by, _ := d.Headers[HeaderAggregate].(string)
	if by == "" {
		by = d.MessageId
	}
	h := fnv.New32a()
	h.Write([]byte(by))
	return int(h.Sum32() % uint32(n))
}

// handle handles d and tells RabbitMQ what became of it; it returns an
// error only when it could not.
func (c *Consumer) handle(ctx context.Context, d amqp.Delivery) error {
	m, err := decode(d)
	sctx, done := c.telemetry.Process(ctx, m, c.queue,
		attribute.String("messaging.rabbitmq.destination.routing_key", d.RoutingKey))
	result := "retry"
	defer func() { done(result, err) }()
	if err != nil {
		result = "dead_lettered"
		return c.deadLetter(d, m, err)
	}
	retry := orDefault(c.RetryDelay, DefaultRetryDelay)
	for attempt := 1; ; attempt++ {
		hctx, cancel := context.WithTimeout(sctx, orDefault(c.HandleTimeout, DefaultHandleTimeout))
		var applied bool
		applied, err = c.handler.Handle(hctx, m)
		cancel()
		switch {
		case ctx.Err() != nil:
			return nil // delivered again once the channel closes
		case err == nil && applied:
			c.applied.Add(1)
			result = "applied"
			return d.Ack(false)
		case err == nil:
			c.duplicates.Add(1)
			result = "duplicate"
			return d.Ack(false)
		case errors.Is(err, postgres.ErrMalformedMessage), errors.Is(err, postgres.ErrNoMessageKey):
			result = "dead_lettered"
			return c.deadLetter(d, m, err)
		}
		if c.Logger != nil {
			c.Logger.Warn("message failed", "key", m.Key, "aggregate", m.Aggregate, "seq", m.Seq, "attempt", attempt, "error", err)
		}
		if !sleep(ctx, retry) {
			return nil
		}
		if errors.Is(err, postgres.ErrOutOfOrder) || attempt >= orDefault(c.MaxAttempts, DefaultMaxAttempts) {
			if errors.Is(err, postgres.ErrOutOfOrder) {
				result = "out_of_order"
			}
			c.handedBack.Add(1)
			return d.Nack(false, true) // spends a delivery: x-delivery-limit bounds them
		}
	}
}

// deadLetter hands d back for good: the queue dead-letters it.
func (c *Consumer) deadLetter(d amqp.Delivery, m postgres.Message, err error) error {
	c.deadLettered.Add(1)
	if c.Logger != nil {
		c.Logger.Error("message dead-lettered: it can never be applied", "queue", c.queue, "key", m.Key,
			"aggregate", m.Aggregate, "seq", m.Seq, "error", err)
	}
	return d.Nack(false, false)
}

// instrumentationName names this package's tracer and meter.
const instrumentationName = "example.com/patterns/enterprise/outbox/rabbitbroker"

// errNotOutbox is what decode wraps: the message was not published by a
// Publisher.
var errNotOutbox = errors.New("not an outbox message")

// decode is d as a Publisher published it.
func decode(d amqp.Delivery) (postgres.Message, error) {
	m := postgres.Message{Type: d.Type, Payload: string(d.Body), Key: d.MessageId}
	str := func(k string) string { s, _ := d.Headers[k].(string); return s }
	m.Aggregate = str(HeaderAggregate)
	for _, k := range []string{"traceparent", "tracestate"} {
		if v := str(k); v != "" {
			if m.TraceContext == nil {
				m.TraceContext = map[string]string{}
			}
			m.TraceContext[k] = v
		}
	}
	var err error
	if m.ID, err = strconv.ParseInt(str(HeaderID), 10, 64); err != nil {
		return m, fmt.Errorf("%w: header %s: %w", errNotOutbox, HeaderID, err)
	}
	if m.Aggregate != "" {
		if m.Seq, err = strconv.ParseInt(str(HeaderSeq), 10, 64); err != nil {
			return m, fmt.Errorf("%w: header %s: %w", errNotOutbox, HeaderSeq, err)
		}
	}
	if m.Key == "" {
		return m, fmt.Errorf("%w: no message_id", errNotOutbox)
	}
	return m, nil
}

// sleep waits d, or until ctx ends, and reports whether it waited d.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func orDefault[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}
