package natsbroker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Handler applies a message and reports whether it did (false: a duplicate
// it had applied before). The example's shop.Warehouse is one.
type Handler interface {
	Handle(ctx context.Context, msg postgres.Message) (applied bool, err error)
}

// BatchHandler is a Handler that can also apply several messages in one
// transaction, all or none: applied[i] reports whether msgs[i] was applied;
// on an error none was. shop.Warehouse is one, through
// [postgres.Outbox.ApplyBatch].
type BatchHandler interface {
	Handler
	HandleBatch(ctx context.Context, msgs []postgres.Message) (applied []bool, err error)
}

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

// ErrOutOfOrderBound is returned, wrapped, by [NewConsumer] (and by
// [Consumer.Run], for a Consumer NewConsumer did not check) for a
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
	handler  Handler

	opts ConsumerOptions // with the defaults filled in, but MaxOutOfOrder's

	telemetry *postgres.ConsumerTelemetry

	// outOfOrder counts, by message key, the deliveries each message has
	// spent arriving before its predecessor: the bound counts those only,
	// not the deliveries an outage of the handler's database spent.
	outOfOrder map[string]int

	mu           sync.Mutex
	waitingSince map[string]time.Time // by key, each message asked for again and not yet handled
}

// Waiting is how many messages this Consumer has asked JetStream for again,
// after failures that may pass or for arriving before their predecessor,
// and not yet handled (nor terminated); OldestWaiting is how long ago the
// oldest of them first failed, or zero. They may be read while Run runs.
// A message asked for again and then handled by another Consumer sharing
// the JetStream consumer is counted until Run stops.
func (c *Consumer) Waiting() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.waitingSince)
}

// OldestWaiting: see Waiting.
func (c *Consumer) OldestWaiting() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	var oldest time.Time
	for _, at := range c.waitingSince {
		if oldest.IsZero() || at.Before(oldest) {
			oldest = at
		}
	}
	if oldest.IsZero() {
		return 0
	}
	return time.Since(oldest)
}

// waiting notes that the message keyed key waits (failed, asked for
// again), or, with done, that it no longer does.
func (c *Consumer) waiting(key string, done bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case done:
		delete(c.waitingSince, key)
	case c.waitingSince == nil:
		c.waitingSince = map[string]time.Time{key: time.Now()}
	default:
		if _, ok := c.waitingSince[key]; !ok {
			if len(c.waitingSince) >= maxTracked {
				clear(c.waitingSince) // a bound on memory: the gauge starts again
			}
			c.waitingSince[key] = time.Now()
		}
	}
}

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
	if _, _, err := outOfOrderBound(c, opts); err != nil {
		return nil, fmt.Errorf("%w: natsbroker: %w", postgres.ErrInvalidConfig, err)
	}
	return &Consumer{consumer: c, handler: h, prefix: prefixOf(c), opts: opts}, nil
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
// postgres.ErrInvalidConfig.
func (c *Consumer) Run(ctx context.Context) error {
	if c == nil || c.consumer == nil || c.handler == nil {
		return fmt.Errorf("%w: natsbroker: a Consumer that NewConsumer did not make", postgres.ErrInvalidConfig)
	}
	maxBatch := 1
	batcher, ok := c.handler.(BatchHandler)
	if ok {
		maxBatch = max(c.opts.MaxBatch, 1)
	}
	prefetch := max(orDefault(c.opts.Prefetch, DefaultPrefetch), maxBatch)
	maxOutOfOrder, ackWait, err := outOfOrderBound(c.consumer, c.opts)
	if err != nil {
		return err
	}
	deadline := ackWait / time.Duration(2*prefetch)
	// Each pull request lasts pullExpiry, with idle heartbeats from the
	// server every half of it: a pull parked on a server that died is given
	// up, and made again to whichever server leads the consumer now, within
	// about pullExpiry, not the client's default 30 s.
	c.telemetry = postgres.NewConsumerTelemetry(c.opts.TracerProvider, c.opts.MeterProvider, instrumentationName, "nats",
		"applied, duplicate, retry, out_of_order or terminated")
	c.outOfOrder = map[string]int{}
	defer func() { c.mu.Lock(); clear(c.waitingSince); c.mu.Unlock() }()
	it, err := c.consumer.Messages(jetstream.PullMaxMessages(prefetch), jetstream.PullExpiry(pullExpiry))
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
		if maxBatch > 1 {
			batch := []jetstream.Msg{msg}
			for len(batch) < maxBatch {
				// Only what is delivered already: a batch never waits to fill.
				more, err := it.Next(jetstream.NextMaxWait(gatherWait))
				if err != nil {
					break // none now, or an error the next turn meets
				}
				batch = append(batch, more)
			}
			err = c.handleBatch(ctx, batcher, batch, deadline, maxOutOfOrder)
		} else {
			err = c.handle(ctx, msg, deadline, maxOutOfOrder)
		}
		if err != nil && ctx.Err() == nil {
			return err
		} // after ctx ended, the next turn hands the rest of the buffer back

	}
}

// handle handles msg, within deadline, and returns an error only when it
// could not tell JetStream what became of it.
func (c *Consumer) handle(ctx context.Context, msg jetstream.Msg, deadline time.Duration, maxOutOfOrder int) (ackErr error) {
	m, err := decode(msg, c.prefix)
	// The message's context is the span's parent and also its link: see
	// the doc of TracerProvider.
	sctx, done := c.telemetry.Process(ctx, m, msg.Subject())
	var applied bool
	result := "retry"
	defer func() { done(result, err) }()
	if err == nil {
		hctx, cancel := context.WithTimeout(sctx, deadline)
		applied, err = c.handler.Handle(hctx, m)
		cancel()
	}
	if errors.Is(err, postgres.ErrOutOfOrder) {
		result = "out_of_order"
		if len(c.outOfOrder) >= maxTracked {
			clear(c.outOfOrder) // a bound on memory: the counts start again
		}
		c.outOfOrder[m.Key]++
		if n := c.outOfOrder[m.Key]; n >= maxOutOfOrder && ctx.Err() == nil {
			if pending := c.pendingBefore(ctx, msg); pending != nil {
				// Its predecessor may be among them, failing for a reason
				// that passes: it waits, however long that takes.
				if n == maxOutOfOrder && c.opts.Logger != nil {
					c.opts.Logger.Warn("message still before its predecessor, which may still be pending; waiting for it",
						"key", m.Key, "aggregate", m.Aggregate, "seq", m.Seq, "out_of_order_deliveries", n, "pending", pending)
				}
			} else {
				err = fmt.Errorf("%w after %d deliveries out of order, with nothing before it pending: its predecessor may never come", err, n)
				result = "terminated"
				return c.terminate(msg, m, err)
			}
		}
	}
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case err == nil:
		result = map[bool]string{true: "applied", false: "duplicate"}[applied]
		delete(c.outOfOrder, m.Key)
		c.waiting(m.Key, true)
		if n := deliveries(msg); n > 1 && c.opts.Logger != nil {
			c.opts.Logger.Info("message handled after failures that passed", "key", m.Key, "aggregate", m.Aggregate, "seq", m.Seq, "deliveries", n)
		}
		return ack(msg.Ack(), "ack", msg)
	case errors.Is(err, postgres.ErrMalformedMessage), errors.Is(err, postgres.ErrNoMessageKey), errors.Is(err, postgres.ErrPermanent), errors.Is(err, errNotOutbox):
		result = "terminated"
		return c.terminate(msg, m, err)
	case errors.Is(err, postgres.ErrOutOfOrder):
		c.waiting(m.Key, false)
		return ack(msg.NakWithDelay(c.opts.RetryDelay), "ask again for", msg)
	default:
		c.waiting(m.Key, false)
		return ack(msg.NakWithDelay(c.backoff(msg, m, err)), "ask again for", msg)
	}
}

// gatherWait is how long Run waits for one more message to add to a batch:
// long enough to take what the client has buffered, short enough to add
// no delay a reader would see.
const gatherWait = time.Millisecond

// handleBatch applies batch in one HandleBatch, within as many deadlines as
// it has messages, and acks each; if the batch fails, it handles each
// message one at a time. It returns an error only when it could not tell
// JetStream what became of a message.
func (c *Consumer) handleBatch(ctx context.Context, h BatchHandler, batch []jetstream.Msg, deadline time.Duration, maxOutOfOrder int) error {
	msgs := make([]postgres.Message, len(batch))
	var err error
	for i, msg := range batch {
		if msgs[i], err = decode(msg, c.prefix); err != nil {
			break
		}
	}
	var applied []bool
	if err == nil {
		sctx, done := c.telemetry.ProcessBatch(ctx, msgs, batch[0].Subject())
		hctx, cancel := context.WithTimeout(sctx, deadline*time.Duration(len(batch)))
		applied, err = h.HandleBatch(hctx, msgs)
		cancel()
		if err == nil && len(applied) != len(msgs) {
			err = fmt.Errorf("HandleBatch reported %d results for %d messages", len(applied), len(msgs))
		}
		var results []string
		if err == nil {
			results = make([]string, len(applied))
			for i, a := range applied {
				results[i] = map[bool]string{true: "applied", false: "duplicate"}[a]
			}
		}
		done(results, err)
	}
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// Nothing was applied: each message on its own says what it is.
		for _, msg := range batch {
			if err := c.handle(ctx, msg, deadline, maxOutOfOrder); err != nil {
				return err
			}
		}
		return nil
	}
	for i, msg := range batch {
		m := msgs[i]
		delete(c.outOfOrder, m.Key)
		c.waiting(m.Key, true)
		if n := deliveries(msg); n > 1 && c.opts.Logger != nil {
			c.opts.Logger.Info("message handled after failures that passed", "key", m.Key, "aggregate", m.Aggregate, "seq", m.Seq, "deliveries", n)
		}
		if err := ack(msg.Ack(), "ack", msg); err != nil {
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

// backoff is how long msg, whose handling failed with err for a reason that
// may pass, waits before its next delivery: RetryDelay after its first
// delivery, doubled after each next one, up to MaxRetryDelay. It logs each
// step, not each delivery: an outage of an hour logs a handful of lines a
// message, not thousands.
func (c *Consumer) backoff(msg jetstream.Msg, m postgres.Message, err error) time.Duration {
	n := deliveries(msg)
	delay := c.delayAfter(n)
	if c.opts.Logger != nil && (n == 1 || c.delayAfter(n-1) < delay) {
		c.opts.Logger.Warn("message failed; asking for it again", "key", m.Key, "aggregate", m.Aggregate, "seq", m.Seq,
			"delivery", n, "next_delivery_in", delay, "error", err)
	}
	return delay
}

// delayAfter is the backoff after a message's nth delivery failed.
func (c *Consumer) delayAfter(n int) time.Duration {
	delay := c.opts.RetryDelay
	most := c.opts.MaxRetryDelay
	for i := 1; i < n && delay < most; i++ {
		delay *= 2
	}
	return min(delay, most)
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
// of them; nil when none is and the predecessor can no longer come from the
// stream. A consumer whose state cannot be read is taken to have some.
func (c *Consumer) pendingBefore(ctx context.Context, msg jetstream.Msg) any {
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
	return nil
}

// infoTimeout bounds the request for the JetStream consumer's state.
const infoTimeout = 5 * time.Second

// maxTracked is the most messages whose out-of-order deliveries a Consumer
// counts at once; past it the counts start again, which delays a
// termination and never hastens one.
const maxTracked = 100_000

// instrumentationName names this package's tracer and meter.
const instrumentationName = "example.com/patterns/enterprise/outbox/natsbroker"

// terminate tells JetStream never to deliver msg again, with err as the
// reason, and logs it.
func (c *Consumer) terminate(msg jetstream.Msg, m postgres.Message, err error) error {
	delete(c.outOfOrder, m.Key)
	c.waiting(m.Key, true)
	if c.opts.Logger != nil {
		c.opts.Logger.Error("message terminated: it can never be applied", "subject", msg.Subject(), "key", m.Key,
			"aggregate", m.Aggregate, "seq", m.Seq, "error", err)
	}
	return ack(msg.TermWithReason(err.Error()), "terminate", msg)
}

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
