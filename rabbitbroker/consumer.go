package rabbitbroker

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/consumer"
)

// Handler applies a message and reports whether it did (false: a copy it
// had applied before, dropped by its key). The example's shop.Warehouse is
// one, through [postgres.Outbox.ApplyOnce]. It is the consumer core's,
// shared by every broker's Consumer.
type Handler = consumer.Handler

// BatchHandler is a Handler that can also apply several messages in one
// transaction, all or none: applied[i] reports whether msgs[i] was applied;
// on an error none was. The example's shop.Warehouse is one, through
// [postgres.Outbox.ApplyBatch].
type BatchHandler = consumer.BatchHandler

// Defaults of a [Consumer]'s fields left zero.
const (
	DefaultPrefetch      = 10
	DefaultRetryDelay    = time.Second
	DefaultMaxRetryDelay = 30 * time.Second
	DefaultHandleTimeout = 30 * time.Second
)

// ConsumerOptions configures a [Consumer]: [NewConsumer] checks it and
// refuses a bad value with an error wrapping [postgres.ErrInvalidConfig]
// that names it. Zero means the default in every field; a negative value
// is refused.
type ConsumerOptions struct {
	// Prefetch is how many unacked messages RabbitMQ sends ahead (the
	// channel's basic.qos); zero means DefaultPrefetch, and it is at
	// least MaxBatch.
	Prefetch int
	// MaxBatch is the most messages a worker hands a BatchHandler at once,
	// of those it holds: it never waits to fill a batch. Zero, 1, or a
	// handler that is not a BatchHandler, means one message at a
	// time, the article's way.
	MaxBatch int
	// RetryDelay is the wait before a failed message is first tried again,
	// or before one out of order is handed back, and between
	// reconnections; zero means DefaultRetryDelay.
	RetryDelay time.Duration
	// MaxRetryDelay is the longest wait between two tries of a message
	// that keeps failing for a reason that may pass: the wait doubles from
	// RetryDelay up to it. Zero means DefaultMaxRetryDelay.
	MaxRetryDelay time.Duration
	// HandleTimeout bounds each call of the Handler: one that runs out of
	// time failed for a reason that may pass, and is tried again. Zero means
	// DefaultHandleTimeout.
	HandleTimeout time.Duration
	// Concurrency is how many messages Run handles at once, each on one of
	// as many workers: all the messages of an aggregate go to the same
	// worker (by a hash of the aggregate, or of the key for a message with
	// none), which handles them in the queue's order, so each aggregate's
	// order holds while different aggregates are applied side by side.
	// Zero means 1. Prefetch bounds what the workers hold in all:
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
	// applied, duplicate, retry (cut short by Run's end), out_of_order
	// (handed back) or dead_lettered. They are read when Run starts.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// Retention, with its Keep set, has Run keep the consumer's records
	// bounded: every Retention.Every it deletes, in Retention.Forget (the
	// consumer's database), the keys of messages applied longer than Keep
	// ago, and Forgotten counts them. RabbitMQ keeps nothing of a message
	// once it is acked, so no window of the broker's bounds Keep: it is the
	// team's word that no copy waits in the queue, or is sent again by a
	// relay, longer than Keep.
	Retention consumer.Retention
}

// Consumer feeds the messages of a queue to a Handler, in the queue's order
// (one at a time, or each aggregate's in order with Concurrency), and tells
// RabbitMQ what became of each:
//   - handled (applied, or a copy dropped by its key): basic.ack, only after
//     the handler returned, so after its transaction committed. A consumer
//     that dies before its ack leaves the message to be delivered again, and
//     the handler drops that copy. RabbitMQ drops no copies itself: every
//     copy a relay published reaches Handle, and Duplicates counts those
//     dropped;
//   - failed for a reason that may pass (a database that is down, a lock
//     timeout, a Handle that ran out of HandleTimeout): tried again in
//     place, however long it takes, RetryDelay after the first failure and
//     twice as long after each next one, up to MaxRetryDelay, so the
//     messages behind it keep their order; it is never handed back for it,
//     so such failures spend none of the queue's deliveries. Waiting and
//     OldestWaiting say how many wait so and since when, and the Logger
//     hears of each step of the backoff, not of each try. What waits is
//     bounded by Prefetch: RabbitMQ sends no more unacked messages;
//   - arrived before its predecessor ([postgres.ErrOutOfOrder]): handed
//     back after RetryDelay, spending a delivery. The messages of an
//     aggregate go to one worker in the queue's order, so a predecessor that
//     merely fails waits in front of it and this does not happen; it
//     happens when the predecessor is not ahead of it in the queue (lost,
//     or dead-lettered by an operator's hand);
//   - never to be applied (a payload the handler cannot read, wrapping
//     [postgres.ErrMalformedMessage], no key, an error the handler wraps
//     around [postgres.ErrPermanent], headers that are not an outbox
//     message's): basic.nack without requeue, which dead-letters it at
//     once, with a log line at level Error.
//
// A message handed back more often than the queue's x-delivery-limit
// (Topology.DeliveryLimit) is dead-lettered by RabbitMQ. The dead-letter
// queue keeps it for an operator. One more thing spends a delivery: a
// message held unacked past the server's consumer_timeout (30 minutes by
// default) closes the channel, and RabbitMQ delivers it again; an outage
// of the handler's database longer than the delivery limit times
// consumer_timeout would dead-letter the message waiting in front.
//
// With MaxBatch above 1 and a [BatchHandler], each worker hands the handler
// the messages it holds already, up to MaxBatch, in one HandleBatch: one
// transaction and one commit for them all, then one basic.ack with
// multiple set for the batch when Concurrency is 1 (every earlier delivery
// of the channel is settled then), or one basic.ack each. A batch that
// fails wrote nothing, and the worker then handles its messages one at a
// time with Handle, each as above: one message that cannot apply never
// holds up or gives up on the others.
//
// Run reconnects after its connection or channel closed (a node restarted),
// RetryDelay apart; the messages it had not acked are delivered again.
//
// A Consumer is not safe for concurrent use: run one Run at a time; its
// Handler is called from Concurrency goroutines at once. Create one with
// [NewConsumer].
type Consumer struct {
	dial  func() (*amqp.Connection, error)
	queue string

	opts ConsumerOptions // with the defaults filled in

	// core decides what becomes of each message, as every broker's
	// Consumer does; this one tells RabbitMQ.
	core *consumer.Core

	keeper *consumer.Keeper // the Retention
}

// NewConsumer returns a Consumer of queue, over connections dial makes,
// that feeds h, as opts says. It refuses, with an error wrapping
// [postgres.ErrInvalidConfig] that names it, no dial, no queue, no
// handler, a negative setting, and a MaxRetryDelay below RetryDelay. It
// connects to nothing.
func NewConsumer(dial func() (*amqp.Connection, error), queue string, h Handler, opts ConsumerOptions) (*Consumer, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: rabbitbroker: %s", postgres.ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case dial == nil:
		return nil, bad("NewConsumer: no dial")
	case queue == "":
		return nil, bad("NewConsumer: no queue")
	case h == nil:
		return nil, bad("NewConsumer: no handler")
	case opts.RetryDelay < 0, opts.MaxRetryDelay < 0, opts.HandleTimeout < 0:
		return nil, bad("ConsumerOptions: a negative duration (RetryDelay %v, MaxRetryDelay %v, HandleTimeout %v)",
			opts.RetryDelay, opts.MaxRetryDelay, opts.HandleTimeout)
	case opts.Prefetch < 0, opts.MaxBatch < 0, opts.Concurrency < 0:
		return nil, bad("ConsumerOptions: a negative count (Prefetch %d, MaxBatch %d, Concurrency %d)", opts.Prefetch, opts.MaxBatch, opts.Concurrency)
	}
	opts.RetryDelay = orDefault(opts.RetryDelay, DefaultRetryDelay)
	opts.MaxRetryDelay = orDefault(opts.MaxRetryDelay, max(DefaultMaxRetryDelay, opts.RetryDelay))
	if opts.MaxRetryDelay < opts.RetryDelay {
		return nil, bad("ConsumerOptions.MaxRetryDelay %v is below RetryDelay %v", opts.MaxRetryDelay, opts.RetryDelay)
	}
	opts.HandleTimeout = orDefault(opts.HandleTimeout, DefaultHandleTimeout)
	opts.Concurrency = orDefault(opts.Concurrency, 1)
	core, err := consumer.New(h, consumer.Policy{
		RetryDelay: opts.RetryDelay, MaxRetryDelay: opts.MaxRetryDelay, HandleTimeout: opts.HandleTimeout,
		MaxBatch: opts.MaxBatch, HandBack: true, SetAsideAs: "dead-lettered", Logger: opts.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("rabbitbroker: %w", err)
	}
	opts.MaxBatch = core.MaxBatch()
	opts.Prefetch = max(orDefault(opts.Prefetch, DefaultPrefetch), opts.MaxBatch)
	keeper, err := consumer.NewKeeper(opts.Retention, nil, opts.Logger)
	if err != nil {
		return nil, fmt.Errorf("rabbitbroker: %w", err)
	}
	return &Consumer{dial: dial, queue: queue, opts: opts, core: core, keeper: keeper}, nil
}

// Applied, Duplicates, HandedBack and DeadLettered count the messages the
// handler applied, the copies it dropped, the deliveries this Consumer
// handed back (requeued: out of order), and the messages it dead-lettered
// (not those RabbitMQ dead-lettered past the delivery limit).
func (c *Consumer) Applied() int64      { return c.core.Applied() }
func (c *Consumer) Duplicates() int64   { return c.core.Duplicates() }
func (c *Consumer) HandedBack() int64   { return c.core.OutOfOrder() }
func (c *Consumer) DeadLettered() int64 { return c.core.SetAside() }

// SetAside is DeadLettered, by the name every broker's Consumer gives it.
func (c *Consumer) SetAside() int64 { return c.core.SetAside() }

// Forgotten is how many keys and positions Run deleted as its Retention
// says.
func (c *Consumer) Forgotten() int64 { return c.keeper.Forgotten() }

// Waiting is how many messages are being tried again in place now, after
// failures that may pass, and OldestWaiting how long ago the oldest of
// them first failed (zero if none waits): what to watch during an outage
// of the handler's database. Both are safe to call while Run runs.
func (c *Consumer) Waiting() int { return c.core.Waiting() }

// OldestWaiting: see Waiting.
func (c *Consumer) OldestWaiting() time.Duration { return c.core.OldestWaiting() }

// Run consumes until ctx ends, and then returns ctx's error. A message
// whose handling ctx cut short is neither acked nor handed back: RabbitMQ
// delivers it again once the channel closes.
func (c *Consumer) Run(ctx context.Context) error {
	if c == nil || c.dial == nil || c.core == nil {
		return fmt.Errorf("%w: rabbitbroker: a Consumer that NewConsumer did not make", postgres.ErrInvalidConfig)
	}
	keeping, stopKeeping := context.WithCancel(ctx)
	kept := make(chan struct{})
	go func() { defer close(kept); c.keeper.Run(keeping) }()
	defer func() { stopKeeping(); <-kept }()
	c.core.Start(postgres.NewConsumerTelemetry(c.opts.TracerProvider, c.opts.MeterProvider, instrumentationName, "rabbitmq",
		"applied, duplicate, retry, out_of_order or dead_lettered"))
	defer c.core.Stop()
	for {
		err := c.consume(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if c.opts.Logger != nil {
			c.opts.Logger.Warn("consumer disconnected; connecting again", "queue", c.queue, "error", err)
		}
		if !sleep(ctx, c.opts.RetryDelay) {
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
	prefetch := c.opts.Prefetch
	if err := ch.Qos(prefetch, 0, false); err != nil {
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
	workers := make([]chan amqp.Delivery, c.opts.Concurrency)
	var wg sync.WaitGroup
	for i := range workers {
		workers[i] = make(chan amqp.Delivery, prefetch)
		wg.Go(func() {
			for d := range workers[i] {
				if ctx.Err() != nil {
					continue
				}
				var err error
				if c.opts.MaxBatch > 1 {
					err = c.handleBatch(ctx, gather(d, workers[i], c.opts.MaxBatch), len(workers) == 1)
				} else {
					err = c.handle(ctx, d)
				}
				if err != nil {
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

// handle has the core handle d, trying it again in place while it fails
// for a reason that may pass, and tells RabbitMQ what became of it; it
// returns an error only when it could not.
func (c *Consumer) handle(ctx context.Context, d amqp.Delivery) error {
	return c.settle(d, c.core.Handle(ctx, c.delivery(d)))
}

// settle tells RabbitMQ what became of d: an ack, a requeue (out of
// order: it spends a delivery, which x-delivery-limit bounds), or a nack
// without requeue, which dead-letters it.
func (c *Consumer) settle(d amqp.Delivery, v consumer.Verdict) error {
	switch v.Outcome {
	case consumer.Applied, consumer.Duplicate:
		return d.Ack(false)
	case consumer.OutOfOrder:
		return d.Nack(false, true)
	case consumer.SetAside:
		return d.Nack(false, false)
	default: // Stopped: delivered again once the channel closes
		return nil
	}
}

// delivery is d as the core takes it.
func (c *Consumer) delivery(d amqp.Delivery) consumer.Delivery {
	m, err := decode(d)
	return consumer.Delivery{Message: m, Err: err, Destination: c.queue, Where: []any{"queue", c.queue},
		Attrs: []attribute.KeyValue{attribute.String("messaging.rabbitmq.destination.routing_key", d.RoutingKey)}}
}

// gatherWait is how long a worker waits for more messages to add to a
// batch: long enough to take what the channel is handing it, short enough
// to add no delay a reader would see.
const gatherWait = time.Millisecond

// gather is first and what follows it on w, up to most messages, taken
// within gatherWait.
func gather(first amqp.Delivery, w <-chan amqp.Delivery, most int) []amqp.Delivery {
	batch := []amqp.Delivery{first}
	timer := time.NewTimer(gatherWait)
	defer timer.Stop()
	for len(batch) < most {
		select {
		case d, ok := <-w:
			if !ok {
				return batch
			}
			batch = append(batch, d)
		case <-timer.C:
			return batch
		}
	}
	return batch
}

// handleBatch applies batch in one HandleBatch and acks it, with multiple
// set when every earlier delivery of the channel is settled; if the batch
// fails, it handles each message one at a time. It returns an error only
// when it could not tell RabbitMQ what became of a message.
func (c *Consumer) handleBatch(ctx context.Context, batch []amqp.Delivery, multiple bool) error {
	ds := make([]consumer.Delivery, len(batch))
	for i, d := range batch {
		ds[i] = c.delivery(d)
	}
	if _, ok := c.core.Batch(ctx, ds, 0); !ok {
		if ctx.Err() != nil {
			return nil // delivered again once the channel closes
		}
		// Nothing was applied: each message on its own says what it is.
		for _, d := range batch {
			if err := c.handle(ctx, d); err != nil {
				return err
			}
		}
		return nil
	}
	if multiple {
		return batch[len(batch)-1].Ack(true)
	}
	for _, d := range batch {
		if err := d.Ack(false); err != nil {
			return err
		}
	}
	return nil
}

// instrumentationName names this package's tracer and meter.
const instrumentationName = "example.com/patterns/enterprise/outbox/rabbitbroker"

// errNotOutbox is what decode wraps: the message was not published by a
// Publisher.
var errNotOutbox = errors.New("not an outbox message")

// decode is d as a Publisher published it.
func decode(d amqp.Delivery) (postgres.Message, error) {
	m := postgres.Message{Type: d.Type, Payload: string(d.Body), Key: d.MessageId}
	if d.ContentType != "application/json" {
		m.ContentType = d.ContentType
	}
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
	for k, v := range d.Headers { // the rest are the team's own, as the Publisher put them: strings
		if s, ok := v.(string); ok && !postgres.ReservedHeader(k) { // RabbitMQ's own x-delivery-count among those left out
			if m.Headers == nil {
				m.Headers = map[string]string{}
			}
			m.Headers[k] = s
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
