package natsbroker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/consumer"
)

// Handler applies a message and reports whether it did (false: a duplicate
// it had applied before). The example's shop.Warehouse is one. It is the
// consumer core's, shared by every broker's Consumer.
type Handler = consumer.Handler

// BatchHandler is a Handler that can also apply several messages in one
// transaction, all or none: applied[i] reports whether msgs[i] was applied;
// on an error none was. shop.Warehouse is one, through
// [postgres.Outbox.ApplyBatch].
type BatchHandler = consumer.BatchHandler

// DefaultRetryDelay is how long a [Consumer] asks JetStream to wait before
// it delivers again a message whose handling failed, when
// [ConsumerOptions.RetryDelay] is zero.
const DefaultRetryDelay = time.Second

// DefaultMaxRetryDelay is the longest a [Consumer] asks JetStream to wait
// before it delivers again a message whose handling keeps failing, when
// [ConsumerOptions.MaxRetryDelay] is zero.
const DefaultMaxRetryDelay = 30 * time.Second

// pullExpiry is how long one of a Consumer's pull requests lasts.
const pullExpiry = 5 * time.Second

// DefaultPrefetch is how many messages a [Consumer] asks JetStream for at
// a time, when [ConsumerOptions.Prefetch] is zero.
const DefaultPrefetch = 10

// DefaultMaxOutOfOrder is how many deliveries a [Consumer] gives a message
// that arrives before its predecessor, when [ConsumerOptions.MaxOutOfOrder] is
// zero, before it terminates it; more if the rule on MaxOutOfOrder asks
// for more.
const DefaultMaxOutOfOrder = 20

// ErrOutOfOrderBound is returned, wrapped, by [NewConsumer] for a
// ConsumerOptions.MaxOutOfOrder too small for the consumer's AckWait and
// RetryDelay.
var ErrOutOfOrderBound = errors.New("natsbroker: MaxOutOfOrder would terminate a message whose predecessor is only late")

// ConsumerOptions configures a [Consumer]: [NewConsumer] checks it and
// refuses a bad value with an error wrapping [postgres.ErrInvalidConfig]
// that names it. Zero means the default in every field; a negative value
// is refused.
type ConsumerOptions struct {
	// RetryDelay is how long a failed message waits before it is delivered
	// again; zero means DefaultRetryDelay.
	RetryDelay time.Duration

	// MaxRetryDelay is the longest a message that keeps failing waits
	// between deliveries: the wait doubles from RetryDelay up to it. Zero
	// means DefaultMaxRetryDelay.
	MaxRetryDelay time.Duration

	// Prefetch is how many messages Run asks for at a time; zero means
	// DefaultPrefetch, and it is at least MaxBatch.
	Prefetch int

	// MaxBatch is the most messages Run hands a BatchHandler at once, of
	// those already delivered: it never waits to fill a batch. Zero, 1,
	// or a handler that is not a BatchHandler, means one message at a
	// time, the article's way.
	MaxBatch int

	// MaxOutOfOrder is how many deliveries a message that arrives before
	// its predecessor gets before it is terminated, counting those that
	// found it out of order only (a delivery that failed for another
	// reason, a database that was down, spends none); each Consumer counts
	// the deliveries it saw, in memory. The rule: MaxOutOfOrder
	// times RetryDelay must be at least twice the JetStream consumer's
	// AckWait, since a predecessor whose delivery was lost (a server that
	// died with it in flight, a consumer that died before its ack) comes
	// again only after AckWait, and its successor must not be terminated
	// before that. Zero means DefaultMaxOutOfOrder or the rule's least,
	// whichever is more (61 with the defaults: about a minute); NewConsumer
	// refuses a value below the rule's least, with ErrOutOfOrderBound.
	MaxOutOfOrder int

	// Logger, if not nil, is told of each message terminated.
	Logger *slog.Logger

	// TracerProvider and MeterProvider are where the consumer reports (nil:
	// otel's global ones). Each message is a consumer span, "process
	// <subject>", with a link to the relay's publish span whose context the
	// message carries in its traceparent header (its creation context, as
	// OpenTelemetry's messaging conventions ask), and also its child, which
	// the conventions allow when one message is processed at a time: so the
	// trace of the request that wrote the row goes on, in one trace, to its
	// Handle and the warehouse's transaction. The meter counts
	// messaging.client.consumed.messages by outbox.result: applied,
	// duplicate, retry, out_of_order or terminated. They are read when Run
	// starts.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// Retention, with its Keep set, has Run keep the consumer's records
	// bounded: every Retention.Every it deletes, in Retention.Forget (the
	// consumer's database), the keys of messages applied longer than Keep
	// ago, and Forgotten counts them. Keep must be at least the stream's
	// MaxAge, which Run reads through JetStream: a stream delivers a
	// message again for as long as it holds it (a consumer replayed from
	// the start). Run refuses to start, with an error wrapping
	// consumer.ErrRetentionTooShort, on a Keep below it or on a stream
	// that keeps its messages for ever.
	Retention consumer.Retention

	// JetStream is the client Run reads the stream's MaxAge through;
	// Retention needs it.
	JetStream jetstream.JetStream
}

// Consumer feeds the messages of a JetStream pull consumer to a Handler, one
// at a time, and tells JetStream what became of each:
//   - handled (applied, or a duplicate): Ack, only after the handler has
//     returned, so after the warehouse's transaction committed. A consumer
//     that dies before its ack leaves the message to be delivered again
//     after the consumer's AckWait, and the handler drops that copy by its
//     key: the broker's duplicate window is not what keeps it from being
//     applied twice;
//   - failed for a reason that may pass (a database that is down, a lock
//     timeout, a Handle that ran out of time): NakWithDelay, to be
//     delivered again, RetryDelay after its first failure and twice as long
//     after each next one, up to MaxRetryDelay, for as long as it takes:
//     the JetStream consumer's MaxDeliver is left unlimited (see
//     ConsumerConfig), so no count of failures gives up on it. The Logger
//     hears of each step of the backoff, not of each delivery;
//   - arrived before its predecessor (ErrOutOfOrder): NakWithDelay
//     (RetryDelay), to be delivered again once the predecessor may have
//     applied;
//   - never to be applied (a payload the handler cannot read, wrapping
//     [postgres.ErrMalformedMessage], or no key, an error the handler wraps
//     around [postgres.ErrPermanent], or headers that are not an outbox
//     message's), or still before its predecessor after MaxOutOfOrder
//     deliveries with no message before it in the stream still pending on
//     the JetStream consumer (its predecessor was terminated, or parked in
//     the outbox, and may never come; see MaxOutOfOrder for how many is
//     enough): Term, with the reason, and a log line at level Error; it is
//     not delivered again. JetStream publishes an advisory for each message
//     terminated ($JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.<stream>.<consumer>),
//     with the reason, for an operator to find it by; the message stays in
//     the stream.
//
// The JetStream consumer's AckWait runs from a message's delivery, also
// while it waits in the client's buffer behind others. So a Consumer asks
// for Prefetch messages at a time, and gives each Handle a deadline of
// AckWait / (2 × Prefetch): a full buffer is handled within half of
// AckWait, and no message is delivered again only because the ones before
// it were slow. A Handle that runs out of time is asked for again, as any
// failure that may pass.
//
// A predecessor that is only slow, failing for a reason that passes for an
// hour, keeps its successors waiting that hour, not terminated: a message is
// terminated for being out of order only once nothing before it in the
// stream is pending on the JetStream consumer. Waiting and OldestWaiting
// say how many messages this Consumer has asked for again and not yet
// handled, and since when; what waits is kept by JetStream, not in memory.
//
// With MaxBatch above 1 and a [BatchHandler], Run hands the handler the
// messages already delivered, up to MaxBatch, in one HandleBatch: one
// transaction and one commit for them all, then an Ack for each. A batch
// that fails (any of its messages out of order, malformed, or a failure
// that may pass) wrote nothing, and Run then handles its messages one at a
// time with Handle, each as above: one message that cannot apply never
// holds up or gives up on the others.
//
// A Consumer is not safe for concurrent use, but for Waiting and
// OldestWaiting: run one Run at a time. Several Consumers, in one process
// or many, may share one JetStream consumer, which spreads the messages
// among them. Create one with [NewConsumer].
type Consumer struct {
	consumer jetstream.Consumer
	prefix   string // of its subjects, which decode takes off for the type

	opts ConsumerOptions // with the defaults filled in, but MaxOutOfOrder's

	// core decides what becomes of each message, as every broker's
	// Consumer does; this one tells JetStream.
	core *consumer.Core

	keeper *consumer.Keeper // the Retention, checked against the stream's MaxAge
}

// Applied, Duplicates and SetAside count the messages the handler applied,
// the copies it dropped, and the messages this Consumer terminated (set
// aside: they can never apply), as every broker's Consumer counts them.
func (c *Consumer) Applied() int64    { return c.core.Applied() }
func (c *Consumer) Duplicates() int64 { return c.core.Duplicates() }
func (c *Consumer) SetAside() int64   { return c.core.SetAside() }

// Forgotten is how many keys and positions Run deleted as its Retention
// says.
func (c *Consumer) Forgotten() int64 { return c.keeper.Forgotten() }

// Waiting is how many messages this Consumer has asked JetStream for again,
// after failures that may pass or for arriving before their predecessor,
// and not yet handled (nor terminated); OldestWaiting is how long ago the
// oldest of them first failed, or zero. They may be read while Run runs.
// A message asked for again and then handled by another Consumer sharing
// the JetStream consumer is counted until Run stops.
func (c *Consumer) Waiting() int { return c.core.Waiting() }

// OldestWaiting: see Waiting.
func (c *Consumer) OldestWaiting() time.Duration { return c.core.OldestWaiting() }

// NewConsumer returns a Consumer that feeds the messages of c, a consumer
// created with ConsumerConfig (or Names.ConsumerConfig: the subject prefix
// it takes off for each message's type is c's filter's), to h, as opts
// says. It refuses, with an error wrapping [postgres.ErrInvalidConfig] that
// names it, no consumer, no handler, a negative setting, a MaxRetryDelay
// below RetryDelay, and a MaxOutOfOrder below its rule's least for c's
// AckWait (wrapping [ErrOutOfOrderBound] too). It connects to nothing.
func NewConsumer(c jetstream.Consumer, h Handler, opts ConsumerOptions) (*Consumer, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: natsbroker: %s", postgres.ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case c == nil:
		return nil, bad("NewConsumer: no JetStream consumer")
	case h == nil:
		return nil, bad("NewConsumer: no handler")
	case opts.RetryDelay < 0, opts.MaxRetryDelay < 0:
		return nil, bad("ConsumerOptions: a negative delay (RetryDelay %v, MaxRetryDelay %v)", opts.RetryDelay, opts.MaxRetryDelay)
	case opts.Prefetch < 0, opts.MaxBatch < 0, opts.MaxOutOfOrder < 0:
		return nil, bad("ConsumerOptions: a negative count (Prefetch %d, MaxBatch %d, MaxOutOfOrder %d)", opts.Prefetch, opts.MaxBatch, opts.MaxOutOfOrder)
	}
	opts.RetryDelay = orDefault(opts.RetryDelay, DefaultRetryDelay)
	opts.MaxRetryDelay = orDefault(opts.MaxRetryDelay, max(DefaultMaxRetryDelay, opts.RetryDelay))
	if opts.MaxRetryDelay < opts.RetryDelay {
		return nil, bad("ConsumerOptions.MaxRetryDelay %v is below RetryDelay %v", opts.MaxRetryDelay, opts.RetryDelay)
	}
	maxOutOfOrder, ackWait, err := outOfOrderBound(c, opts)
	if err != nil {
		return nil, fmt.Errorf("%w: natsbroker: %w", postgres.ErrInvalidConfig, err)
	}
	maxBatch := 1
	if _, ok := h.(BatchHandler); ok {
		maxBatch = max(opts.MaxBatch, 1)
	}
	opts.Prefetch = max(orDefault(opts.Prefetch, DefaultPrefetch), maxBatch)
	opts.MaxBatch = maxBatch
	core, err := consumer.New(h, consumer.Policy{
		RetryDelay: opts.RetryDelay, MaxRetryDelay: opts.MaxRetryDelay,
		// A full buffer is handled within half of AckWait: see Consumer.
		HandleTimeout: ackWait / time.Duration(2*opts.Prefetch),
		MaxBatch:      maxBatch, MaxOutOfOrder: maxOutOfOrder,
		SetAsideAs: "terminated", Logger: opts.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("natsbroker: %w", err)
	}
	if opts.Retention.Keep > 0 && opts.JetStream == nil {
		return nil, bad("ConsumerOptions.Retention needs JetStream, to read the stream's MaxAge")
	}
	stream := c.CachedInfo().Stream
	keeper, err := consumer.NewKeeper(opts.Retention, func(ctx context.Context) (time.Duration, error) {
		s, err := opts.JetStream.Stream(ctx, stream)
		if err != nil {
			return 0, fmt.Errorf("stream %s: %w", stream, err)
		}
		if age := s.CachedInfo().Config.MaxAge; age > 0 {
			return age, nil
		}
		return -1, nil // kept for ever
	}, opts.Logger)
	if err != nil {
		return nil, fmt.Errorf("natsbroker: %w", err)
	}
	return &Consumer{consumer: c, prefix: prefixOf(c), opts: opts, core: core, keeper: keeper}, nil
}

// outOfOrderBound is how many deliveries a message out of order gets, as
// opts.MaxOutOfOrder and its rule for c's AckWait say, and that AckWait; an
// error wrapping ErrOutOfOrderBound if opts.MaxOutOfOrder is below the
// rule's least.
func outOfOrderBound(c jetstream.Consumer, opts ConsumerOptions) (int, time.Duration, error) {
	ackWait := c.CachedInfo().Config.AckWait
	if ackWait <= 0 {
		ackWait = 30 * time.Second // the server's default
	}
	retry := orDefault(opts.RetryDelay, DefaultRetryDelay)
	least := int(2*ackWait/retry) + 1
	switch n := opts.MaxOutOfOrder; {
	case n == 0:
		return max(DefaultMaxOutOfOrder, least), ackWait, nil
	case n < least:
		return 0, ackWait, fmt.Errorf("%w: ConsumerOptions.MaxOutOfOrder %d: %d deliveries %v apart is less than twice AckWait, %v; want at least %d",
			ErrOutOfOrderBound, n, n, retry, ackWait, least)
	default:
		return n, ackWait, nil
	}
}

// Run handles messages until ctx ends, and then returns ctx's error; or
// until it cannot tell JetStream what became of a message, or can receive
// no more (its connection is closed, its consumer deleted), and then
// returns that error. A server that goes down and comes back is not such
// an error: the client reconnects and Run goes on. A message whose
// handling ctx cut short is neither acked nor asked for again: it is
// delivered again after the consumer's AckWait. A Consumer that NewConsumer
// did not make is refused at once, with an error wrapping
// postgres.ErrInvalidConfig; a Retention shorter than the stream keeps its
// messages, with one wrapping consumer.ErrRetentionTooShort.
func (c *Consumer) Run(ctx context.Context) error {
	if c == nil || c.consumer == nil || c.core == nil {
		return fmt.Errorf("%w: natsbroker: a Consumer that NewConsumer did not make", postgres.ErrInvalidConfig)
	}
	if err := c.keeper.CheckWindow(ctx); err != nil {
		return fmt.Errorf("natsbroker: %w", err)
	}
	keeping, stopKeeping := context.WithCancel(ctx)
	kept := make(chan struct{})
	go func() { defer close(kept); c.keeper.Run(keeping) }()
	defer func() { stopKeeping(); <-kept }()
	c.core.Start(postgres.NewConsumerTelemetry(c.opts.TracerProvider, c.opts.MeterProvider, instrumentationName, "nats",
		"applied, duplicate, retry, out_of_order or terminated"))
	defer c.core.Stop()
	// Each pull request lasts pullExpiry, with idle heartbeats from the
	// server every half of it: a pull parked on a server that died is given
	// up, and made again to whichever server leads the consumer now, within
	// about pullExpiry, not the client's default 30 s.
	it, err := c.consumer.Messages(jetstream.PullMaxMessages(c.opts.Prefetch), jetstream.PullExpiry(pullExpiry))
	if err != nil {
		return fmt.Errorf("consume: %w", err)
	}
	defer it.Stop()
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if ctx.Err() != nil {
			if err == nil {
				msg.Nak() // a stop hands it back; if this fails, AckWait does
			}
			return handBack(ctx, it)
		}
		if errors.Is(err, jetstream.ErrNoHeartbeat) {
			continue // the server was silent a while; the iterator pulls again
		}
		if err != nil {
			return fmt.Errorf("consume: %w", err)
		}
		if c.opts.MaxBatch > 1 {
			batch := []jetstream.Msg{msg}
			for len(batch) < c.opts.MaxBatch {
				// Only what is delivered already: a batch never waits to fill.
				more, err := it.Next(jetstream.NextMaxWait(gatherWait))
				if err != nil {
					break // none now, or an error the next turn meets
				}
				batch = append(batch, more)
			}
			err = c.handleBatch(ctx, batch)
		} else {
			err = c.handle(ctx, msg)
		}
		if err != nil && ctx.Err() == nil {
			return err
		} // after ctx ended, the next turn hands the rest of the buffer back
	}
}

// handle has the core handle msg once and tells JetStream what became of
// it; it returns an error only when it could not.
func (c *Consumer) handle(ctx context.Context, msg jetstream.Msg) error {
	v := c.core.Try(ctx, c.delivery(msg))
	return c.settle(msg, v)
}

// settle tells JetStream what became of msg: an ack, a delivery asked for
// again after the verdict's delay, or a termination with its reason.
func (c *Consumer) settle(msg jetstream.Msg, v consumer.Verdict) error {
	switch v.Outcome {
	case consumer.Applied, consumer.Duplicate:
		return ack(msg.Ack(), "ack", msg)
	case consumer.Retry, consumer.OutOfOrder:
		return ack(msg.NakWithDelay(v.Delay), "ask again for", msg)
	case consumer.SetAside:
		return ack(msg.TermWithReason(v.Err.Error()), "terminate", msg)
	default: // Stopped: delivered again after AckWait
		return v.Err
	}
}

// delivery is msg as the core takes it.
func (c *Consumer) delivery(msg jetstream.Msg) consumer.Delivery {
	m, err := decode(msg, c.prefix)
	return consumer.Delivery{Message: m, Err: err, Destination: msg.Subject(), Where: []any{"subject", msg.Subject()},
		Delivered: deliveries(msg), Pending: func(ctx context.Context) string { return c.pendingBefore(ctx, msg) }}
}

// gatherWait is how long Run waits for one more message to add to a batch:
// long enough to take what the client has buffered, short enough to add
// no delay a reader would see.
const gatherWait = time.Millisecond

// handleBatch applies batch in one HandleBatch, within as many of a
// Handle's deadlines as it has messages, and acks each; if the batch
// fails, it handles each message one at a time. It returns an error only
// when it could not tell JetStream what became of a message.
func (c *Consumer) handleBatch(ctx context.Context, batch []jetstream.Msg) error {
	ds := make([]consumer.Delivery, len(batch))
	for i, msg := range batch {
		ds[i] = c.delivery(msg)
	}
	vs, ok := c.core.Batch(ctx, ds, c.core.HandleTimeout()*time.Duration(len(batch)))
	if !ok {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// Nothing was applied: each message on its own says what it is.
		for _, msg := range batch {
			if err := c.handle(ctx, msg); err != nil {
				return err
			}
		}
		return nil
	}
	for i, msg := range batch {
		if err := c.settle(msg, vs[i]); err != nil {
			return err
		}
	}
	return nil
}

// handBack drains it, after ctx ended: the messages prefetched and not yet
// handled are handed back at once (Nak), instead of waiting out AckWait in
// a buffer nobody reads, and it returns ctx's error once none is left. It
// must be Drain: Stop would drop the buffer.
func handBack(ctx context.Context, it jetstream.MessagesContext) error {
	it.Drain()
	for {
		msg, err := it.Next()
		if err != nil {
			return ctx.Err()
		}
		msg.Nak() // if this fails, AckWait does
	}
}

// deliveries is how many times JetStream has delivered msg, this one
// counted; 1 if its metadata cannot be read.
func deliveries(msg jetstream.Msg) int {
	meta, err := msg.Metadata()
	if err != nil || meta.NumDelivered < 1 {
		return 1
	}
	return int(meta.NumDelivered)
}

// pendingBefore is, when some message before msg in the stream is still
// pending on the JetStream consumer (delivered and not acked: msg's
// predecessor may be one, failing for a reason that passes), a description
// of them; "" when none is and the predecessor can no longer come from the
// stream. A consumer whose state cannot be read is taken to have some.
func (c *Consumer) pendingBefore(ctx context.Context, msg jetstream.Msg) string {
	meta, err := msg.Metadata()
	if err != nil {
		return err.Error()
	}
	ictx, cancel := context.WithTimeout(ctx, infoTimeout)
	defer cancel()
	info, err := c.consumer.Info(ictx)
	if err != nil {
		return "the consumer's state cannot be read: " + err.Error()
	}
	// The ack floor is the stream sequence below which every message the
	// consumer delivered is acked or terminated: msg itself is pending, so
	// the floor is at most just below it.
	if floor := info.AckFloor.Stream; floor+1 < meta.Sequence.Stream {
		return fmt.Sprintf("at least one of stream sequences %d to %d", floor+1, meta.Sequence.Stream-1)
	}
	return ""
}

// infoTimeout bounds the request for the JetStream consumer's state.
const infoTimeout = 5 * time.Second

// instrumentationName names this package's tracer and meter.
const instrumentationName = "example.com/patterns/enterprise/outbox/natsbroker"

func ack(err error, what string, msg jetstream.Msg) error {
	if err != nil {
		return fmt.Errorf("%s message %s: %w", what, msg.Headers().Get(jetstream.MsgIDHeader), err)
	}
	return nil
}

// errNotOutbox is what decode wraps: the message was not published by a
// Publisher.
var errNotOutbox = errors.New("not an outbox message")

// decode is msg as the relay published it, under the subject prefix.
func decode(msg jetstream.Msg, prefix string) (postgres.Message, error) {
	h := msg.Headers()
	m := postgres.Message{
		Type:      strings.TrimPrefix(msg.Subject(), prefix),
		Payload:   string(msg.Data()),
		Key:       h.Get(jetstream.MsgIDHeader),
		Aggregate: h.Get(HeaderAggregate),
	}
	for _, k := range []string{"traceparent", "tracestate"} { // as the relay's span put them
		if v := h.Get(k); v != "" {
			if m.TraceContext == nil {
				m.TraceContext = map[string]string{}
			}
			m.TraceContext[k] = v
		}
	}
	if ct := h.Get(HeaderContentType); ct != "application/json" { // which a CloudEvent carries
		m.ContentType = ct
	}
	for k, v := range h { // the rest are the team's own
		if !postgres.ReservedHeader(k) && len(v) > 0 {
			if m.Headers == nil {
				m.Headers = map[string]string{}
			}
			m.Headers[k] = v[0]
		}
	}
	var err error
	if m.ID, err = strconv.ParseInt(h.Get(HeaderID), 10, 64); err != nil {
		return m, fmt.Errorf("%w: header %s: %w", errNotOutbox, HeaderID, err)
	}
	if m.Aggregate != "" {
		if m.Seq, err = strconv.ParseInt(h.Get(HeaderSeq), 10, 64); err != nil {
			return m, fmt.Errorf("%w: header %s: %w", errNotOutbox, HeaderSeq, err)
		}
	}
	return m, nil
}

func orDefault[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}
