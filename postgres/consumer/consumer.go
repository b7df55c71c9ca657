// Package consumer is what a consumer of outbox messages does with each
// message, whichever broker brought it: the one policy that natsbroker's,
// rabbitbroker's and kafkabroker's Consumers share. A broker's adapter
// translates a delivery into a [Delivery], asks a [Core] what became of
// it, and tells its broker (an ack, a delivery asked for again, a message
// set aside); the Core holds the rest:
//
//   - applied once, through the Handler (postgres.Outbox.ApplyOnce), or a
//     copy the Handler dropped by its key: [Applied], [Duplicate];
//   - a failure that may pass (a database down, a lock timeout, a Handle
//     out of time): tried again, RetryDelay after the first failure and
//     twice as long after each next one up to MaxRetryDelay, in place
//     ([Core.Handle]: the messages behind it keep their order) or by the
//     broker's next delivery ([Core.Try] says how long to wait): [Retry];
//   - a message that arrives before its predecessor (postgres.ErrOutOfOrder):
//     waited for, RetryDelay apart, and set aside only past MaxOutOfOrder
//     tries with nothing before it that may still come: [OutOfOrder];
//   - a message that can never apply (not an outbox message, a payload the
//     handler cannot read, no key, postgres.ErrPermanent): [SetAside] at
//     once, with a log line at level Error;
//   - a batch applied in one transaction through a [BatchHandler], or, if
//     it fails, each of its messages on its own ([Core.Batch]);
//   - the counters, and how many messages wait and since when.
//
// Every decision has one set of tests, in this package, on a handler of
// its own; each adapter's suite runs it against its real broker.
package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Handler applies a message and reports whether it did (false: a copy it
// had applied before, dropped by its key). The example's shop.Warehouse is
// one, through [postgres.Outbox.ApplyOnce].
type Handler interface {
	Handle(ctx context.Context, msg postgres.Message) (applied bool, err error)
}

// BatchHandler is a Handler that can also apply several messages in one
// transaction, all or none: applied[i] reports whether msgs[i] was applied;
// on an error none was. The example's shop.Warehouse is one, through
// [postgres.Outbox.ApplyBatch].
type BatchHandler interface {
	Handler
	HandleBatch(ctx context.Context, msgs []postgres.Message) (applied []bool, err error)
}

// Outcome is what became of a delivery, and so what the adapter tells its
// broker.
type Outcome int

const (
	// Applied: the handler applied it. Acknowledge it.
	Applied Outcome = iota + 1
	// Duplicate: the handler had applied it before and dropped this copy.
	// Acknowledge it.
	Duplicate
	// Retry: it failed for a reason that may pass. In Try, have the broker
	// deliver it again after the Verdict's Delay; Handle never returns it.
	Retry
	// OutOfOrder: it arrived before its predecessor. Have the broker
	// deliver it again after the Verdict's Delay (Try), or at once (Handle,
	// which waited RetryDelay already).
	OutOfOrder
	// SetAside: it can never apply. Tell the broker not to deliver it
	// again (terminate, dead-letter) or go past it; the Core logged it.
	SetAside
	// Stopped: the context ended first. Tell the broker nothing: it
	// delivers the message again, to this consumer or another.
	Stopped
)

var outcomeNames = [...]string{Applied: "applied", Duplicate: "duplicate", Retry: "retry", OutOfOrder: "out_of_order", SetAside: "set_aside", Stopped: "stopped"}

// String is the outcome's name, as in the outbox.result of the metric
// (where Stopped counts as "retry", and SetAside by the Policy's name).
func (o Outcome) String() string {
	if o < Applied || o > Stopped {
		return fmt.Sprintf("Outcome(%d)", int(o))
	}
	return outcomeNames[o]
}

// Delivery is one delivery of a message, as its adapter read it.
type Delivery struct {
	// Message is the outbox message it carries.
	Message postgres.Message
	// Err, if not nil, says why the delivery is not an outbox message (a
	// header missing or unreadable): it is set aside without a Handle.
	Err error
	// Destination names the span: "process <Destination>" (a subject, a
	// queue, a topic); Attrs are the span's own attributes.
	Destination string
	Attrs       []attribute.KeyValue
	// Where are log attributes saying where the message is, for an
	// operator to find it ("subject", s; "partition", p, "offset", o).
	Where []any
	// Delivered is how many times the broker has delivered it, this time
	// counted: Try's backoff grows with it. Zero means the broker does not
	// say, and counts as 1.
	Delivered int
	// Pending, if not nil, is asked when the message has been found before
	// its predecessor MaxOutOfOrder times: it says, in a few words for the
	// log, what before it is still pending on the broker ("stream
	// sequences 4 to 6": the predecessor may be among it, failing for a
	// reason that passes), or "" when nothing is, and the predecessor can
	// no longer come. While something is pending the message waits,
	// however long; nil Pending means nothing can be.
	Pending func(ctx context.Context) string
}

// Verdict is what became of a delivery.
type Verdict struct {
	Outcome Outcome
	// Err is the handler's error, for Retry, OutOfOrder and SetAside:
	// the reason to give the broker.
	Err error
	// Delay is, for Retry and OutOfOrder from Try, how long the broker
	// should wait before it delivers the message again.
	Delay time.Duration
}

// Defaults of a [Policy]'s zero fields.
const (
	DefaultRetryDelay    = time.Second
	DefaultMaxRetryDelay = 30 * time.Second
	DefaultHandleTimeout = 30 * time.Second
)

// Policy is how a Core handles messages. The adapters fill it from their
// ConsumerOptions, with their own defaults. Zero means the default in
// RetryDelay, MaxRetryDelay and HandleTimeout (DefaultRetryDelay,
// DefaultMaxRetryDelay or RetryDelay if longer, DefaultHandleTimeout); New
// refuses what cannot work.
type Policy struct {
	// RetryDelay is the wait after a message's first failure, and the wait
	// before a message out of order is tried again; the wait doubles after
	// each next failure, up to MaxRetryDelay.
	RetryDelay, MaxRetryDelay time.Duration
	// HandleTimeout bounds each Handle call, and each HandleBatch call
	// unless Batch is given a bound of its own. A Handle that runs out of
	// it failed for a reason that may pass.
	HandleTimeout time.Duration
	// MaxBatch is the most messages Batch hands a BatchHandler at once;
	// zero or 1, or a Handler that is no BatchHandler, means one at a time.
	MaxBatch int
	// MaxOutOfOrder is how many times a message may be found before its
	// predecessor, counted across its deliveries by this Core, before it is
	// set aside (if nothing before it is pending: see Delivery.Pending).
	// Zero means never: the broker's own limit bounds it.
	MaxOutOfOrder int
	// HandBack has Handle return a message out of order (after waiting
	// RetryDelay), for the broker to deliver it again behind others, rather
	// than try it again in place; a broker that cannot hand a message back
	// (Kafka) leaves it false.
	HandBack bool
	// SetAsideAs is what the broker calls a message set aside, for the log
	// and the metric: "terminated", "dead-lettered"; empty means "set aside".
	SetAsideAs string
	// Logger, if not nil, hears of each message set aside (Error), each step
	// of a backoff, not each try (Warn), and each message handled after
	// failures (Info).
	Logger *slog.Logger
}

// Core handles deliveries as its Policy says, through its Handler, and
// counts what became of them.
//
// Its counters, Waiting and OldestWaiting may be read at any time. Try,
// Handle and Batch may be called from several goroutines at once, as long
// as each message's deliveries are handled one at a time, in its
// aggregate's order (an adapter hands an aggregate to one goroutine);
// Start and Stop are called around them, not during. Create one with New.
type Core struct {
	handler Handler
	batcher BatchHandler // nil if handler is none, or MaxBatch is 1
	p       Policy

	tel *postgres.ConsumerTelemetry

	applied, duplicates, outOfOrder, setAside atomic.Int64

	mu           sync.Mutex
	early        map[string]int       // by key: how many times each message was found before its predecessor
	waitingSince map[string]time.Time // by key: each message tried again, since its first failure
}

// New returns a Core that hands messages to h as p says, its zero fields
// the defaults. It refuses, with an error wrapping
// [postgres.ErrInvalidConfig] that names it, no handler, a negative
// setting, and a MaxRetryDelay below RetryDelay.
func New(h Handler, p Policy) (*Core, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: consumer: %s", postgres.ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case h == nil:
		return nil, bad("no handler")
	case p.RetryDelay < 0, p.MaxRetryDelay < 0, p.HandleTimeout < 0:
		return nil, bad("Policy: a negative duration (RetryDelay %v, MaxRetryDelay %v, HandleTimeout %v)", p.RetryDelay, p.MaxRetryDelay, p.HandleTimeout)
	}
	if p.RetryDelay == 0 {
		p.RetryDelay = DefaultRetryDelay
	}
	if p.MaxRetryDelay == 0 {
		p.MaxRetryDelay = max(DefaultMaxRetryDelay, p.RetryDelay)
	}
	if p.HandleTimeout == 0 {
		p.HandleTimeout = DefaultHandleTimeout
	}
	switch {
	case p.MaxRetryDelay < p.RetryDelay:
		return nil, bad("Policy: MaxRetryDelay %v is below RetryDelay %v", p.MaxRetryDelay, p.RetryDelay)
	case p.MaxBatch < 0, p.MaxOutOfOrder < 0:
		return nil, bad("Policy: a negative count (MaxBatch %d, MaxOutOfOrder %d)", p.MaxBatch, p.MaxOutOfOrder)
	}
	if p.SetAsideAs == "" {
		p.SetAsideAs = "set aside"
	}
	c := &Core{handler: h, p: p}
	if b, ok := h.(BatchHandler); ok && p.MaxBatch > 1 {
		c.batcher = b
	}
	return c, nil
}

// MaxBatch is the most messages Batch takes at once: Policy.MaxBatch if
// the Handler is a BatchHandler, else 1.
func (c *Core) MaxBatch() int {
	if c.batcher == nil {
		return 1
	}
	return c.p.MaxBatch
}

// Start readies c for a run of its adapter, reporting through tel (nil:
// nowhere), with no message counted as out of order yet.
func (c *Core) Start(tel *postgres.ConsumerTelemetry) {
	c.tel = tel
	c.mu.Lock()
	defer c.mu.Unlock()
	c.early = map[string]int{}
}

// Stop ends a run: no message waits any longer on this consumer (those
// asked for again may be handled by another).
func (c *Core) Stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.waitingSince)
}

// Applied, Duplicates, OutOfOrder and SetAside count the messages the
// handler applied, the copies it dropped, the deliveries found before
// their predecessors and handed back (or asked for again), and the
// messages set aside.
func (c *Core) Applied() int64    { return c.applied.Load() }
func (c *Core) Duplicates() int64 { return c.duplicates.Load() }
func (c *Core) OutOfOrder() int64 { return c.outOfOrder.Load() }
func (c *Core) SetAside() int64   { return c.setAside.Load() }

// Waiting is how many messages failed for a reason that may pass, or
// arrived before their predecessor (but for those Handle hands back), and
// are not yet handled nor set aside; OldestWaiting is how long ago the oldest of them first failed, or
// zero: what to watch during an outage of the handler's database.
func (c *Core) Waiting() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.waitingSince)
}

// OldestWaiting: see Waiting.
func (c *Core) OldestWaiting() time.Duration {
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

// maxTracked is the most messages a Core tracks at once, as waiting or as
// out of order; past it the tracking starts again, which delays a message's
// setting aside and never hastens one.
const maxTracked = 100_000

// waiting notes that the message keyed key waits, or, with done, that it
// is handled or set aside.
func (c *Core) waiting(key string, done bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if done {
		delete(c.waitingSince, key)
		delete(c.early, key)
		return
	}
	if c.waitingSince == nil {
		c.waitingSince = map[string]time.Time{}
	}
	if _, ok := c.waitingSince[key]; !ok {
		if len(c.waitingSince) >= maxTracked {
			clear(c.waitingSince) // a bound on memory: the gauge starts again
		}
		c.waitingSince[key] = time.Now()
	}
}

// foundEarly counts one more time the message keyed key was found before
// its predecessor, and returns the count.
func (c *Core) foundEarly(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.early == nil || len(c.early) >= maxTracked {
		c.early = map[string]int{} // a bound on memory: the counts start again
	}
	c.early[key]++
	return c.early[key]
}

// Try handles d once and returns what became of it, for an adapter whose
// broker delivers a message again by itself after a delay (JetStream's
// NakWithDelay): Retry with the backoff after d's Delivered-th failure,
// OutOfOrder with RetryDelay.
func (c *Core) Try(ctx context.Context, d Delivery) (v Verdict) {
	sctx, done := c.process(ctx, d)
	defer func() { done(v) }()
	if d.Err != nil {
		return c.setAsideNow(d, d.Err)
	}
	m := d.Message
	applied, err := c.call(sctx, m)
	switch {
	case ctx.Err() != nil:
		return Verdict{Outcome: Stopped, Err: ctx.Err()}
	case err == nil:
		return c.handled(m, applied, "deliveries", d.Delivered)
	case permanent(err):
		return c.setAsideNow(d, err)
	case errors.Is(err, postgres.ErrOutOfOrder):
		if gone := c.predecessorGone(ctx, d, "deliveries"); gone != nil {
			return c.setAsideNow(d, fmt.Errorf("%w %v", err, gone))
		}
		c.waiting(m.Key, false)
		c.outOfOrder.Add(1)
		return Verdict{Outcome: OutOfOrder, Err: err, Delay: c.p.RetryDelay}
	default:
		c.waiting(m.Key, false)
		n := max(d.Delivered, 1)
		delay := c.delayAfter(n)
		if c.p.Logger != nil && (n == 1 || c.delayAfter(n-1) < delay) {
			c.p.Logger.Warn("message failed; asking for it again", append(c.about(m),
				"delivery", n, "next_delivery_in", delay, "error", err)...)
		}
		return Verdict{Outcome: Retry, Err: err, Delay: delay}
	}
}

// Handle handles d until it is applied, dropped as a copy, set aside, or
// (with HandBack) found before its predecessor, trying failures that may
// pass again in place, so that the messages behind it keep their order:
// RetryDelay after the first failure and twice as long after each next,
// up to MaxRetryDelay, however long it takes. It returns Stopped if ctx
// ends first, and the message no longer counts as Waiting.
func (c *Core) Handle(ctx context.Context, d Delivery) (v Verdict) {
	sctx, done := c.process(ctx, d)
	defer func() {
		if v.Outcome == Stopped {
			c.waiting(d.Message.Key, true) // it no longer waits here: the broker hands it to whoever comes next
		}
		done(v)
	}()
	if d.Err != nil {
		return c.setAsideNow(d, d.Err)
	}
	m := d.Message
	stopped := Verdict{Outcome: Stopped}
	delay := c.p.RetryDelay
	for attempt := 1; ; attempt++ {
		applied, err := c.call(sctx, m)
		switch {
		case ctx.Err() != nil:
			stopped.Err = ctx.Err()
			return stopped
		case err == nil:
			return c.handled(m, applied, "attempts", attempt)
		case permanent(err):
			return c.setAsideNow(d, err)
		case errors.Is(err, postgres.ErrOutOfOrder):
			if gone := c.predecessorGone(ctx, d, "tries"); gone != nil {
				return c.setAsideNow(d, fmt.Errorf("%w %v", err, gone))
			}
			if !c.p.HandBack { // one handed back waits in the broker, not here
				c.waiting(m.Key, false)
			}
			if c.p.Logger != nil {
				what := "trying it again in place"
				if c.p.HandBack {
					what = "handing it back"
				}
				c.p.Logger.Warn("message arrived before its predecessor; "+what, append(c.about(m), "error", err)...)
			}
			if !sleep(ctx, c.p.RetryDelay) {
				stopped.Err = ctx.Err()
				return stopped
			}
			if c.p.HandBack {
				c.outOfOrder.Add(1)
				return Verdict{Outcome: OutOfOrder, Err: err}
			}
			continue
		}
		c.waiting(m.Key, false)
		// One line a step of the backoff, not a try: an outage of an hour
		// logs a handful of lines a message, not thousands.
		if c.p.Logger != nil && (attempt == 1 || c.delayAfter(attempt-1) < delay) {
			c.p.Logger.Warn("message failed; trying it again in place", append(c.about(m),
				"attempt", attempt, "next_try_in", delay, "error", err)...)
		}
		if !sleep(ctx, delay) {
			stopped.Err = ctx.Err()
			return stopped
		}
		delay = min(2*delay, c.p.MaxRetryDelay)
	}
}

// Batch applies ds in one HandleBatch, within timeout (zero:
// HandleTimeout), and reports each one's verdict (Applied or Duplicate).
// It returns false, having applied nothing, if the Core takes no batches,
// a delivery is not an outbox message, or the batch failed: the adapter
// then hands each delivery to Try or Handle on its own (unless ctx ended),
// so that one message that cannot apply never holds up or gives up on the
// others.
func (c *Core) Batch(ctx context.Context, ds []Delivery, timeout time.Duration) ([]Verdict, bool) {
	if c.batcher == nil || len(ds) == 0 {
		return nil, false
	}
	msgs := make([]postgres.Message, len(ds))
	for i, d := range ds {
		if d.Err != nil {
			return nil, false
		}
		msgs[i] = d.Message
	}
	if timeout <= 0 {
		timeout = c.p.HandleTimeout
	}
	var done func([]string, error)
	sctx := ctx
	if c.tel != nil {
		sctx, done = c.tel.ProcessBatch(ctx, msgs, ds[0].Destination)
	}
	hctx, cancel := context.WithTimeout(sctx, timeout)
	applied, err := c.batcher.HandleBatch(hctx, msgs)
	cancel()
	if err == nil && len(applied) != len(msgs) {
		err = fmt.Errorf("HandleBatch reported %d results for %d messages", len(applied), len(msgs))
	}
	if err != nil {
		if done != nil {
			done(nil, err)
		}
		return nil, false
	}
	vs := make([]Verdict, len(ds))
	results := make([]string, len(ds))
	for i, d := range ds {
		vs[i] = c.handled(d.Message, applied[i], "deliveries", d.Delivered)
		results[i] = vs[i].Outcome.String()
	}
	if done != nil {
		done(results, nil)
	}
	return vs, true
}

// call is one Handle of m, within HandleTimeout.
func (c *Core) call(ctx context.Context, m postgres.Message) (bool, error) {
	hctx, cancel := context.WithTimeout(ctx, c.p.HandleTimeout)
	defer cancel()
	return c.handler.Handle(hctx, m)
}

// handled counts m, applied or a copy, and logs it if it had failed before
// (n, the deliveries or attempts it took, named so, above 1).
func (c *Core) handled(m postgres.Message, applied bool, what string, n int) Verdict {
	c.waiting(m.Key, true)
	if n > 1 && c.p.Logger != nil {
		c.p.Logger.Info("message handled after failures that passed", append(c.about(m), what, n)...)
	}
	if applied {
		c.applied.Add(1)
		return Verdict{Outcome: Applied}
	}
	c.duplicates.Add(1)
	return Verdict{Outcome: Duplicate}
}

// predecessorGone counts d's message as found before its predecessor
// once more, and, past MaxOutOfOrder with nothing before it pending,
// returns why it is set aside; nil while it may wait.
func (c *Core) predecessorGone(ctx context.Context, d Delivery, tries string) error {
	n := c.foundEarly(d.Message.Key)
	if c.p.MaxOutOfOrder == 0 || n < c.p.MaxOutOfOrder || ctx.Err() != nil {
		return nil
	}
	if d.Pending != nil {
		if pending := d.Pending(ctx); pending != "" {
			// Its predecessor may be among them, failing for a reason
			// that passes: it waits, however long that takes.
			if n == c.p.MaxOutOfOrder && c.p.Logger != nil {
				c.p.Logger.Warn("message still before its predecessor, which may still be pending; waiting for it",
					append(c.about(d.Message), "out_of_order_"+tries, n, "pending", pending)...)
			}
			return nil
		}
	}
	return fmt.Errorf("after %d %s out of order, with nothing before it pending: its predecessor may never come", n, tries)
}

// setAsideNow counts and logs d as set aside, for err.
func (c *Core) setAsideNow(d Delivery, err error) Verdict {
	c.waiting(d.Message.Key, true)
	c.setAside.Add(1)
	if c.p.Logger != nil {
		c.p.Logger.Error("message "+c.p.SetAsideAs+": it can never be applied", append(append(d.Where[:len(d.Where):len(d.Where)], c.about(d.Message)...), "error", err)...)
	}
	return Verdict{Outcome: SetAside, Err: err}
}

// about is m's log attributes.
func (c *Core) about(m postgres.Message) []any {
	return []any{"key", m.Key, "aggregate", m.Aggregate, "seq", m.Seq}
}

// process starts d's span, if c reports, and returns the function that
// ends it with the verdict.
func (c *Core) process(ctx context.Context, d Delivery) (context.Context, func(Verdict)) {
	if c.tel == nil {
		return ctx, func(Verdict) {}
	}
	sctx, done := c.tel.Process(ctx, d.Message, d.Destination, d.Attrs...)
	return sctx, func(v Verdict) { done(c.result(v.Outcome), v.Err) }
}

// result is o's outbox.result: Stopped counts as retry (it comes again),
// SetAside by the broker's name for it.
func (c *Core) result(o Outcome) string {
	switch o {
	case Stopped:
		return Retry.String()
	case SetAside:
		return strings.NewReplacer(" ", "_", "-", "_").Replace(c.p.SetAsideAs)
	}
	return o.String()
}

// delayAfter is the backoff after a message's nth failure: RetryDelay,
// doubled n-1 times, at most MaxRetryDelay.
func (c *Core) delayAfter(n int) time.Duration {
	delay := c.p.RetryDelay
	for i := 1; i < n && delay < c.p.MaxRetryDelay; i++ {
		delay *= 2
	}
	return min(delay, c.p.MaxRetryDelay)
}

// permanent reports whether err says the message can never apply.
func permanent(err error) bool {
	return errors.Is(err, postgres.ErrMalformedMessage) || errors.Is(err, postgres.ErrNoMessageKey) || errors.Is(err, postgres.ErrPermanent)
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

// HandleTimeout is the Policy's bound on each Handle call.
func (c *Core) HandleTimeout() time.Duration { return c.p.HandleTimeout }
