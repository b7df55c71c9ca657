package consumer_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/consumer"
)

// handler answers each Handle of a key with the errors scripted for it,
// in turn, and then applies it once; a key handled again after that is a
// copy. It can also take batches.
type handler struct {
	mu      sync.Mutex
	script  map[string][]error
	applied map[string]bool
	calls   map[string]int
	batches int
	during  func(calls int) // called inside each Handle, with the key's calls so far
	batch   error           // what HandleBatch fails with, if not nil
	results int             // if not zero, how many results HandleBatch reports
}

func newHandler(script map[string][]error) *handler {
	return &handler{script: script, applied: map[string]bool{}, calls: map[string]int{}}
}

func (h *handler) Handle(ctx context.Context, m postgres.Message) (bool, error) {
	h.mu.Lock()
	h.calls[m.Key]++
	n, during := h.calls[m.Key], h.during
	var err error
	if s := h.script[m.Key]; len(s) > 0 {
		err, h.script[m.Key] = s[0], s[1:]
	}
	h.mu.Unlock()
	if during != nil {
		during(n)
	}
	if err != nil {
		return false, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.applied[m.Key] {
		return false, nil
	}
	h.applied[m.Key] = true
	return true, nil
}

func (h *handler) HandleBatch(_ context.Context, msgs []postgres.Message) ([]bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.batches++
	if h.batch != nil {
		return nil, h.batch
	}
	applied := make([]bool, len(msgs))
	for i, m := range msgs {
		applied[i] = !h.applied[m.Key]
		h.applied[m.Key] = true
	}
	if h.results != 0 {
		return applied[:h.results], nil
	}
	return applied, nil
}

func (h *handler) callsOf(key string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls[key]
}

// logBuffer is a log the core writes to while a test reads it.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// lines are the log's lines that hold each of parts.
func (l *logBuffer) lines(parts ...string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
next:
	for _, line := range strings.Split(l.b.String(), "\n") {
		for _, p := range parts {
			if !strings.Contains(line, p) {
				continue next
			}
		}
		out = append(out, line)
	}
	return out
}

func newCore(t *testing.T, h consumer.Handler, p consumer.Policy) (*consumer.Core, *logBuffer) {
	t.Helper()
	logs := &logBuffer{}
	p.Logger = slog.New(slog.NewTextHandler(logs, nil))
	if p.RetryDelay == 0 {
		p.RetryDelay = time.Millisecond
	}
	if p.MaxRetryDelay == 0 {
		p.MaxRetryDelay = 8 * time.Millisecond
	}
	if p.HandleTimeout == 0 {
		p.HandleTimeout = time.Minute
	}
	c, err := consumer.New(h, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the core's log:\n%s", strings.Join(logs.lines(""), "\n"))
		}
	})
	return c, logs
}

func delivery(key string, seq int64) consumer.Delivery {
	return consumer.Delivery{Message: postgres.Message{Key: key, Type: "OrderPlaced", Aggregate: "order/1", Seq: seq},
		Destination: "orders", Where: []any{"queue", "orders"}}
}

var errDown = errors.New("the database is down")

// Try, for a broker that delivers a message again by itself: a failure
// that may pass is asked for again after RetryDelay, twice as long after
// each next delivery, up to MaxRetryDelay; the log hears of each step of
// the backoff, not of each delivery; Waiting says it waits until it is
// applied, and the log says after how many deliveries.
func TestTryAsksAgainLaterAndLaterAndLogsEachStepOnce(t *testing.T) {
	h := newHandler(map[string][]error{"k1": {errDown, errDown, errDown, errDown, errDown, errDown}})
	c, logs := newCore(t, h, consumer.Policy{RetryDelay: 10 * time.Millisecond, MaxRetryDelay: 40 * time.Millisecond})
	c.Start(nil)
	var delays []time.Duration
	for n := 1; n <= 6; n++ {
		d := delivery("k1", 1)
		d.Delivered = n
		v := c.Try(context.Background(), d)
		if v.Outcome != consumer.Retry || !errors.Is(v.Err, errDown) {
			t.Fatalf("delivery %d: %v (%v); want Retry with the handler's error", n, v.Outcome, v.Err)
		}
		delays = append(delays, v.Delay)
		if c.Waiting() != 1 || c.OldestWaiting() <= 0 {
			t.Errorf("delivery %d: %d waiting for %v; want 1, for a while", n, c.Waiting(), c.OldestWaiting())
		}
	}
	if got := fmt.Sprint(delays); got != "[10ms 20ms 40ms 40ms 40ms 40ms]" {
		t.Errorf("delays %s; want [10ms 20ms 40ms 40ms 40ms 40ms]", got)
	}
	if n := len(logs.lines(`msg="message failed; asking for it again" key=k1`)); n != 3 {
		t.Errorf("%d lines of the backoff; want 3, one a step (10, 20 and 40 ms)", n)
	}
	d := delivery("k1", 1)
	d.Delivered = 7
	if v := c.Try(context.Background(), d); v.Outcome != consumer.Applied {
		t.Fatalf("the seventh delivery: %v (%v); want Applied", v.Outcome, v.Err)
	}
	if c.Waiting() != 0 || c.OldestWaiting() != 0 || c.Applied() != 1 {
		t.Errorf("after it applied: %d waiting for %v, %d applied; want 0, 0 and 1", c.Waiting(), c.OldestWaiting(), c.Applied())
	}
	if line := logs.lines(`msg="message handled after failures that passed" key=k1`); len(line) != 1 || !strings.Contains(line[0], "deliveries=7") {
		t.Errorf("the log says %q; want one line, deliveries=7", line)
	}
	if v := c.Try(context.Background(), d); v.Outcome != consumer.Duplicate || c.Duplicates() != 1 {
		t.Errorf("a copy: %v, %d duplicates; want Duplicate and 1", v.Outcome, c.Duplicates())
	}
}

// Handle, for a broker whose order must hold behind a failing message:
// the message is tried again in place, the waits doubling, while Waiting
// says it waits, and Handle returns once it applied: one call of the
// handler a try.
func TestHandleTriesAgainInPlaceUntilItPasses(t *testing.T) {
	h := newHandler(map[string][]error{"k1": {errDown, errDown, errDown, errDown, errDown}})
	var waiting []int
	h.during = func(int) { waiting = append(waiting, -1) }
	c, logs := newCore(t, h, consumer.Policy{RetryDelay: time.Millisecond, MaxRetryDelay: 4 * time.Millisecond})
	h.during = func(int) { waiting = append(waiting, c.Waiting()) }
	c.Start(nil)
	if v := c.Handle(context.Background(), delivery("k1", 1)); v.Outcome != consumer.Applied {
		t.Fatalf("Handle: %v (%v); want Applied", v.Outcome, v.Err)
	}
	if h.callsOf("k1") != 6 {
		t.Errorf("the handler was called %d times; want 6: five failures, then the apply", h.callsOf("k1"))
	}
	if got := fmt.Sprint(waiting); got != "[0 1 1 1 1 1]" {
		t.Errorf("Waiting during each try: %s; want [0 1 1 1 1 1]", got)
	}
	if c.Waiting() != 0 || c.Applied() != 1 {
		t.Errorf("after: %d waiting, %d applied; want 0 and 1", c.Waiting(), c.Applied())
	}
	if n := len(logs.lines(`msg="message failed; trying it again in place" key=k1`)); n != 3 {
		t.Errorf("%d lines of the backoff; want 3, one a step (1, 2 and 4 ms)", n)
	}
	if line := logs.lines(`msg="message handled after failures that passed"`); len(line) != 1 || !strings.Contains(line[0], "attempts=6") {
		t.Errorf("the log says %q; want one line, attempts=6", line)
	}
}

// What can never apply is set aside at once, by either way of handling:
// a delivery that is no outbox message (the handler is not called), a
// payload the handler cannot read, no key, and an error the handler wraps
// around ErrPermanent. The log says it at Error, where the message is and
// by the broker's name for it, and SetAside counts it.
func TestWhatCanNeverApplyIsSetAsideAtOnce(t *testing.T) {
	cases := map[string]error{
		"malformed": fmt.Errorf("decode: %w", postgres.ErrMalformedMessage),
		"no key":    postgres.ErrNoMessageKey,
		"permanent": fmt.Errorf("order 17 was deleted: %w", postgres.ErrPermanent),
		"no outbox": nil,
	}
	for name, err := range cases {
		for _, how := range []string{"Try", "Handle"} {
			t.Run(name+"/"+how, func(t *testing.T) {
				h := newHandler(map[string][]error{"k1": {err}})
				c, logs := newCore(t, h, consumer.Policy{SetAsideAs: "dead-lettered"})
				c.Start(nil)
				d := delivery("k1", 1)
				if err == nil {
					d.Err = errors.New("not an outbox message: header outbox-id missing")
				}
				v := map[string]func(context.Context, consumer.Delivery) consumer.Verdict{"Try": c.Try, "Handle": c.Handle}[how](context.Background(), d)
				want := 1
				if err == nil {
					want = 0
				}
				if v.Outcome != consumer.SetAside || v.Err == nil || h.callsOf("k1") != want || c.SetAside() != 1 {
					t.Errorf("%v (%v), %d calls, %d set aside; want SetAside with a reason, %d calls, 1", v.Outcome, v.Err, h.callsOf("k1"), c.SetAside(), want)
				}
				if line := logs.lines("level=ERROR", `msg="message dead-lettered: it can never be applied"`, "queue=orders", "key=k1"); len(line) != 1 {
					t.Errorf("the log's Error lines naming k1 and its queue: %q; want one", line)
				}
			})
		}
	}
}

// A message found before its predecessor waits for it: Try asks for it
// again after RetryDelay; past MaxOutOfOrder, it waits on while something
// before it is pending on the broker (said once in the log), and is set
// aside once nothing is, saying after how many deliveries.
func TestTryWaitsForALatePredecessorWithinItsBound(t *testing.T) {
	early := func(n int) []error {
		errs := make([]error, n)
		for i := range errs {
			errs[i] = postgres.ErrOutOfOrder
		}
		return errs
	}
	h := newHandler(map[string][]error{"k2": early(10)})
	c, logs := newCore(t, h, consumer.Policy{RetryDelay: 7 * time.Millisecond, MaxOutOfOrder: 3})
	c.Start(nil)
	pending := "stream sequence 1"
	d := delivery("k2", 2)
	d.Pending = func(context.Context) string { return pending }
	for i := 1; i <= 5; i++ {
		v := c.Try(context.Background(), d)
		if v.Outcome != consumer.OutOfOrder || v.Delay != 7*time.Millisecond {
			t.Fatalf("delivery %d, its predecessor pending: %v after %v; want OutOfOrder after RetryDelay", i, v.Outcome, v.Delay)
		}
	}
	if n := len(logs.lines("message still before its predecessor, which may still be pending; waiting for it")); n != 1 {
		t.Errorf("%d lines say it waits for a pending predecessor; want 1", n)
	}
	pending = ""
	v := c.Try(context.Background(), d)
	if v.Outcome != consumer.SetAside || !errors.Is(v.Err, postgres.ErrOutOfOrder) || !strings.Contains(v.Err.Error(), "after 6 deliveries out of order") {
		t.Fatalf("with nothing pending: %v (%v); want SetAside after 6 deliveries out of order", v.Outcome, v.Err)
	}
	if c.OutOfOrder() != 5 || c.SetAside() != 1 || c.Waiting() != 0 {
		t.Errorf("out of order %d, set aside %d, waiting %d; want 5, 1, 0", c.OutOfOrder(), c.SetAside(), c.Waiting())
	}
}

// Handle with HandBack returns a message found early after RetryDelay,
// for the broker to hand it back; without, it tries it again in place,
// and applies it once its predecessor came, or sets it aside past
// MaxOutOfOrder tries.
func TestHandleHandsBackOrWaitsInPlaceForALatePredecessor(t *testing.T) {
	early := []error{postgres.ErrOutOfOrder, postgres.ErrOutOfOrder}
	t.Run("hand back", func(t *testing.T) {
		h := newHandler(map[string][]error{"k2": early})
		c, _ := newCore(t, h, consumer.Policy{HandBack: true})
		c.Start(nil)
		if v := c.Handle(context.Background(), delivery("k2", 2)); v.Outcome != consumer.OutOfOrder || h.callsOf("k2") != 1 || c.OutOfOrder() != 1 || c.Waiting() != 0 {
			t.Errorf("%v, %d calls, %d handed back, %d waiting; want OutOfOrder, 1, 1, and none waiting here", v.Outcome, h.callsOf("k2"), c.OutOfOrder(), c.Waiting())
		}
	})
	t.Run("in place, the predecessor comes", func(t *testing.T) {
		h := newHandler(map[string][]error{"k2": early})
		c, _ := newCore(t, h, consumer.Policy{MaxOutOfOrder: 3})
		c.Start(nil)
		if v := c.Handle(context.Background(), delivery("k2", 2)); v.Outcome != consumer.Applied || h.callsOf("k2") != 3 {
			t.Errorf("%v, %d calls; want Applied on the third", v.Outcome, h.callsOf("k2"))
		}
	})
	t.Run("in place, it never comes", func(t *testing.T) {
		h := newHandler(map[string][]error{"k2": append(early, early...)})
		c, _ := newCore(t, h, consumer.Policy{MaxOutOfOrder: 3})
		c.Start(nil)
		v := c.Handle(context.Background(), delivery("k2", 2))
		if v.Outcome != consumer.SetAside || h.callsOf("k2") != 3 || !strings.Contains(fmt.Sprint(v.Err), "after 3 tries out of order") {
			t.Errorf("%v (%v), %d calls; want SetAside after 3 tries", v.Outcome, v.Err, h.callsOf("k2"))
		}
	})
}

// Batch applies its deliveries in one HandleBatch and counts each; it
// declines, applying nothing, when the handler takes no batches, a
// delivery is no outbox message, the batch fails, or the handler reports
// results that do not match: the adapter then handles each on its own.
func TestBatchAppliesInOneCallOrDeclines(t *testing.T) {
	ds := []consumer.Delivery{delivery("k1", 1), delivery("k2", 2), delivery("k3", 3)}
	h := newHandler(nil)
	h.applied["k2"] = true
	c, _ := newCore(t, h, consumer.Policy{MaxBatch: 10})
	c.Start(nil)
	if c.MaxBatch() != 10 {
		t.Errorf("MaxBatch %d; want 10", c.MaxBatch())
	}
	vs, ok := c.Batch(context.Background(), ds, 0)
	if !ok || len(vs) != 3 || vs[0].Outcome != consumer.Applied || vs[1].Outcome != consumer.Duplicate || vs[2].Outcome != consumer.Applied || h.batches != 1 {
		t.Fatalf("Batch: %v %v, %d calls; want Applied, Duplicate, Applied in one call", vs, ok, h.batches)
	}
	if c.Applied() != 2 || c.Duplicates() != 1 {
		t.Errorf("applied %d, duplicates %d; want 2 and 1", c.Applied(), c.Duplicates())
	}
	declines := map[string]func() (*consumer.Core, []consumer.Delivery){
		"a handler with no batches": func() (*consumer.Core, []consumer.Delivery) {
			c, _ := newCore(t, struct{ consumer.Handler }{newHandler(nil)}, consumer.Policy{MaxBatch: 10})
			return c, ds
		},
		"MaxBatch 1": func() (*consumer.Core, []consumer.Delivery) {
			c, _ := newCore(t, newHandler(nil), consumer.Policy{MaxBatch: 1})
			return c, ds
		},
		"no outbox message": func() (*consumer.Core, []consumer.Delivery) {
			c, _ := newCore(t, newHandler(nil), consumer.Policy{MaxBatch: 10})
			bad := append([]consumer.Delivery(nil), ds...)
			bad[1].Err = errors.New("not an outbox message")
			return c, bad
		},
		"a failed batch": func() (*consumer.Core, []consumer.Delivery) {
			h := newHandler(nil)
			h.batch = errDown
			c, _ := newCore(t, h, consumer.Policy{MaxBatch: 10})
			return c, ds
		},
		"too few results": func() (*consumer.Core, []consumer.Delivery) {
			h := newHandler(nil)
			h.results = 2
			c, _ := newCore(t, h, consumer.Policy{MaxBatch: 10})
			return c, ds
		},
	}
	for name, make := range declines {
		c, ds := make()
		c.Start(nil)
		if vs, ok := c.Batch(context.Background(), ds, 0); ok || vs != nil || c.Applied() != 0 || c.Duplicates() != 0 {
			t.Errorf("%s: %v %v, applied %d; want declined, nothing counted", name, vs, ok, c.Applied())
		}
	}
}

// A context that ends stops a handling: Handle waiting in place returns
// Stopped, not Retry, and so does Try whose Handle it cut short; nothing
// is counted as handled or set aside, and the broker is told nothing.
func TestAnEndedContextStopsAHandling(t *testing.T) {
	h := newHandler(map[string][]error{"k1": {errDown, errDown, errDown}})
	c, _ := newCore(t, h, consumer.Policy{RetryDelay: time.Hour, MaxRetryDelay: time.Hour})
	c.Start(nil)
	ctx, cancel := context.WithCancel(context.Background())
	h.during = func(int) { cancel() }
	if v := c.Handle(ctx, delivery("k1", 1)); v.Outcome != consumer.Stopped || !errors.Is(v.Err, context.Canceled) {
		t.Errorf("Handle: %v (%v); want Stopped", v.Outcome, v.Err)
	}
	if v := c.Try(ctx, delivery("k1", 1)); v.Outcome != consumer.Stopped {
		t.Errorf("Try: %v (%v); want Stopped", v.Outcome, v.Err)
	}
	if c.Applied()+c.Duplicates()+c.SetAside()+c.OutOfOrder() != 0 {
		t.Errorf("something was counted: applied %d, duplicates %d, set aside %d, out of order %d", c.Applied(), c.Duplicates(), c.SetAside(), c.OutOfOrder())
	}
	c.Stop()
	if c.Waiting() != 0 {
		t.Errorf("after Stop, %d waiting; want none", c.Waiting())
	}
}

// Each Handle runs within HandleTimeout: one that runs out of it failed
// for a reason that may pass, and is tried again.
func TestEachHandleRunsWithinItsTimeout(t *testing.T) {
	slow := handlerFunc(func(ctx context.Context, m postgres.Message) (bool, error) {
		<-ctx.Done()
		return false, ctx.Err()
	})
	c, _ := newCore(t, slow, consumer.Policy{HandleTimeout: 5 * time.Millisecond})
	c.Start(nil)
	if v := c.Try(context.Background(), delivery("k1", 1)); v.Outcome != consumer.Retry || !errors.Is(v.Err, context.DeadlineExceeded) {
		t.Errorf("a Handle that ran out of time: %v (%v); want Retry", v.Outcome, v.Err)
	}
}

type handlerFunc func(ctx context.Context, m postgres.Message) (bool, error)

func (f handlerFunc) Handle(ctx context.Context, m postgres.Message) (bool, error) { return f(ctx, m) }

// New refuses what cannot work, naming it, with ErrInvalidConfig.
func TestNewRefusesAPolicyThatCannotWork(t *testing.T) {
	ok := consumer.Policy{RetryDelay: time.Second, MaxRetryDelay: time.Minute, HandleTimeout: time.Second}
	bad := map[string]func(p *consumer.Policy){
		"a negative RetryDelay":    func(p *consumer.Policy) { p.RetryDelay = -1 },
		"MaxRetryDelay below":      func(p *consumer.Policy) { p.MaxRetryDelay = time.Millisecond },
		"a negative HandleTimeout": func(p *consumer.Policy) { p.HandleTimeout = -1 },
		"a negative MaxBatch":      func(p *consumer.Policy) { p.MaxBatch = -1 },
		"a negative MaxOutOfOrder": func(p *consumer.Policy) { p.MaxOutOfOrder = -1 },
	}
	for name, change := range bad {
		p := ok
		change(&p)
		if _, err := consumer.New(newHandler(nil), p); !errors.Is(err, postgres.ErrInvalidConfig) {
			t.Errorf("%s: %v; want ErrInvalidConfig", name, err)
		}
	}
	if _, err := consumer.New(nil, ok); !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), "no handler") {
		t.Errorf("no handler: %v; want ErrInvalidConfig naming it", err)
	}
	if _, err := consumer.New(newHandler(nil), ok); err != nil {
		t.Errorf("a good policy: %v", err)
	}
}

// counter records what the consumed-messages counter is told.
type counter struct {
	noop.Int64Counter
	mu     sync.Mutex
	counts map[string]int64
}

func (c *counter) Add(_ context.Context, n int64, opts ...metric.AddOption) {
	attrs := metric.NewAddConfig(opts).Attributes()
	v, _ := attrs.Value(attribute.Key("outbox.result"))
	c.mu.Lock()
	defer c.mu.Unlock()
	c.counts[v.AsString()] += n
}

type meter struct {
	noop.Meter
	c *counter
}

func (m meter) Int64Counter(string, ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	return m.c, nil
}

type meterProvider struct {
	noop.MeterProvider
	c *counter
}

func (p meterProvider) Meter(string, ...metric.MeterOption) metric.Meter { return meter{c: p.c} }

// The metric counts each handling by its outbox.result: a message set
// aside by the broker's name for it, a stopped one as a retry (it comes
// again), and each message of a batch.
func TestTheMetricCountsEachHandlingByItsResult(t *testing.T) {
	cnt := &counter{counts: map[string]int64{}}
	h := newHandler(map[string][]error{"k2": {postgres.ErrPermanent}, "k3": {errDown}, "k4": {postgres.ErrOutOfOrder}})
	c, _ := newCore(t, h, consumer.Policy{SetAsideAs: "terminated", MaxBatch: 5})
	c.Start(postgres.NewConsumerTelemetry(nil, meterProvider{c: cnt}, "test", "test", "all"))
	ctx := context.Background()
	for _, k := range []string{"k1", "k1", "k2", "k3", "k4"} {
		c.Try(ctx, delivery(k, 1))
	}
	c.Batch(ctx, []consumer.Delivery{delivery("k5", 1), delivery("k6", 1)}, 0)
	stopped, cancel := context.WithCancel(ctx)
	cancel()
	c.Try(stopped, delivery("k7", 1))
	want := "map[applied:3 duplicate:1 out_of_order:1 retry:2 terminated:1]"
	if got := fmt.Sprint(cnt.counts); got != want {
		t.Errorf("counted %s; want %s", got, want)
	}
}

// The zero Policy is the defaults, as every broker's options are: a
// message out of order is asked for again after DefaultRetryDelay, and a
// Handle is bounded by DefaultHandleTimeout. (New refused a zero
// RetryDelay, MaxRetryDelay or HandleTimeout.)
func TestTheZeroPolicyIsTheDefaults(t *testing.T) {
	c, err := consumer.New(newHandler(map[string][]error{"k2": {postgres.ErrOutOfOrder}}), consumer.Policy{})
	if err != nil {
		t.Fatalf("New with the zero Policy: %v", err)
	}
	c.Start(nil)
	if v := c.Try(context.Background(), delivery("k2", 2)); v.Outcome != consumer.OutOfOrder || v.Delay != consumer.DefaultRetryDelay {
		t.Errorf("%v after %v; want OutOfOrder after DefaultRetryDelay (%v)", v.Outcome, v.Delay, consumer.DefaultRetryDelay)
	}
	if got := c.HandleTimeout(); got != consumer.DefaultHandleTimeout {
		t.Errorf("HandleTimeout %v; want %v", got, consumer.DefaultHandleTimeout)
	}
	long, err := consumer.New(newHandler(nil), consumer.Policy{RetryDelay: time.Minute})
	if err != nil {
		t.Errorf("New with a RetryDelay above DefaultMaxRetryDelay and no MaxRetryDelay: %v; want MaxRetryDelay to follow it", err)
	} else if long == nil {
		t.Error("no Core")
	}
}

// A message handed back (HandBack) is handed back only after RetryDelay,
// so that the broker does not deliver it again at once, in a loop, before
// its predecessor had a chance: a Handle stopped during that wait reports
// Stopped, not OutOfOrder. (Without the wait, it returned OutOfOrder at
// once.)
func TestHandleHandsBackOnlyAfterRetryDelay(t *testing.T) {
	called := make(chan struct{})
	h := handlerFunc(func(context.Context, postgres.Message) (bool, error) {
		close(called)
		return false, postgres.ErrOutOfOrder
	})
	c, _ := newCore(t, h, consumer.Policy{HandBack: true, RetryDelay: time.Hour, MaxRetryDelay: time.Hour})
	c.Start(nil)
	ctx, cancel := context.WithCancel(context.Background())
	verdict := make(chan consumer.Verdict, 1)
	go func() { verdict <- c.Handle(ctx, delivery("k2", 2)) }()
	<-called
	cancel()
	if v := <-verdict; v.Outcome != consumer.Stopped || c.OutOfOrder() != 0 {
		t.Errorf("%v, %d handed back; want Stopped during RetryDelay, none handed back", v.Outcome, c.OutOfOrder())
	}
}
