package natsbroker_test

// The consumer where a message cannot apply yet, or ever, and where its
// buffer meets AckWait.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// deliveries is a Handler that hands each delivery to a warehouse and
// notes when it came and what the warehouse said, by key.
type deliveries struct {
	warehouse *shop.Warehouse
	delay     time.Duration                    // the fault: a handler this slow
	hang      func(postgres.Message, int) bool // the fault: if it says so for a delivery (its number, from 1), Handle waits for its deadline
	mu        sync.Mutex
	at        map[string][]time.Time
	errs      map[string][]error
}

func newDeliveries(wh *shop.Warehouse) *deliveries {
	return &deliveries{warehouse: wh, at: map[string][]time.Time{}, errs: map[string][]error{}}
}

func (d *deliveries) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	d.mu.Lock()
	d.at[msg.Key] = append(d.at[msg.Key], time.Now())
	n := len(d.at[msg.Key])
	d.mu.Unlock()
	time.Sleep(d.delay)
	if d.hang != nil && d.hang(msg, n) {
		<-ctx.Done()
		d.mu.Lock()
		d.errs[msg.Key] = append(d.errs[msg.Key], ctx.Err())
		d.mu.Unlock()
		return false, ctx.Err()
	}
	applied, err := d.warehouse.Handle(ctx, msg)
	d.mu.Lock()
	d.errs[msg.Key] = append(d.errs[msg.Key], err)
	d.mu.Unlock()
	return applied, err
}

func (d *deliveries) of(key string) ([]time.Time, []error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]time.Time(nil), d.at[key]...), append([]error(nil), d.errs[key]...)
}

// Two messages arrive before their predecessors. order/8's cancellation
// waits, asked for again RetryDelay later each time, and applies once its
// OrderPlaced came; order/9's predecessor never comes (terminated, or parked
// in the outbox), and after MaxOutOfOrder deliveries it is terminated with
// a reason, and a log line says so, instead of being asked for again for
// ever. A MaxOutOfOrder that could terminate a message whose predecessor is
// only late (fewer deliveries than twice AckWait lasts) makes Run fail.
// (Caught: ErrOutOfOrder terminated at once, which lost order/8's early
// cancellation; Nak without the delay, redelivered at once; and MaxDeliver
// unlimited with nothing to stop it, order/9 Nak'ed for ever.)
func TestMessageBeforeItsPredecessorWaitsBoundedly(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 500*time.Millisecond) // AckWait: MaxOutOfOrder × RetryDelay ≥ twice it
	pub := newPublisher(t, connect(t, b.url()))
	event := func(key, aggregate string, seq int64, typ string) postgres.Message {
		return postgres.Message{Key: key, Aggregate: aggregate, Seq: seq,
			ID: seq, Type: typ, Payload: `{"orderId":8,"totalCents":800}`}
	}
	const retry = 300 * time.Millisecond
	h := newDeliveries(shop.NewWarehouse(db))
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	var logs logBuffer
	c := newConsumer(t, cons, h, natsbroker.ConsumerOptions{RetryDelay: retry, MaxOutOfOrder: 5,
		Prefetch: 1, // a Handle deadline of AckWait / 2
		Logger:   slog.New(slog.NewTextHandler(&logs, nil))})
	// 0.9 s of deliveries against an AckWait of 0.5 s
	if _, err := natsbroker.NewConsumer(cons, h, natsbroker.ConsumerOptions{RetryDelay: retry, MaxOutOfOrder: 3}); !errors.Is(err, natsbroker.ErrOutOfOrderBound) || !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("NewConsumer with MaxOutOfOrder 3 = %v, want ErrOutOfOrderBound and ErrInvalidConfig", err)
	}
	goRun(t, c.Run)

	for _, m := range []postgres.Message{
		event("k8-cancelled", "order/8", 2, shop.OrderCancelled),
		event("k9-cancelled", "order/9", 2, shop.OrderCancelled),
	} {
		if err := pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "order/8's cancellation refused once", func() bool { _, errs := h.of("k8-cancelled"); return len(errs) >= 1 })
	if err := pub.Publish(ctx, event("k8-placed", "order/8", 1, shop.OrderPlaced)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "order/8's cancellation applied", func() bool {
		_, errs := h.of("k8-cancelled")
		return len(errs) > 0 && errs[len(errs)-1] == nil
	})
	waitFor(t, "order/9's cancellation terminated", func() bool {
		return len(logs.lines(`msg="message terminated: it can never be applied"`)) == 1
	})
	at, _ := h.of("k9-cancelled")
	if len(at) != 5 {
		t.Errorf("order/9's cancellation was delivered %d times, want MaxOutOfOrder, 5", len(at))
	}
	for i := 1; i < len(at); i++ {
		if gap := at[i].Sub(at[i-1]); gap < retry*3/4 {
			t.Errorf("delivery %d came %v after the one before, want no sooner than the retry delay, %v", i+1, gap, retry)
		}
	}
	if line := logs.lines("k9-cancelled"); len(line) != 1 || !strings.Contains(line[0], "after 5 deliveries") {
		t.Errorf("log: %q; want one line for k9-cancelled saying it was out of order after 5 deliveries", line)
	}
	// The log line comes before the termination is sent: wait for the
	// server to have it, and for nothing else to be left.
	waitFor(t, "the consumer to have nothing pending", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
}

// 200 orders through a handler that takes 25 ms, with an AckWait of 2 s:
// no message is delivered again unless its handling failed. A buffer of 500
// (the client's default) keeps the last of them waiting longer than AckWait,
// and JetStream delivers them again while the first copy waits, each copy
// after an attempt that did not fail. A copy that follows a failed attempt
// is the consumer's own doing: a Handle that ran past its deadline (AckWait
// / (2 × Prefetch), 100 ms here, which a busy machine can exceed) is asked
// for again, as the Consumer's doc says. (Caught: the default pull batch,
// 277 deliveries for 200 messages, 77 of them after an attempt that
// succeeded.)
func TestPrefetchFitsWithinAckWait(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 2*time.Second)
	const orders = 200
	placeAndPublish(t, db, b.url(), orders)
	h := newDeliveries(shop.NewWarehouse(db))
	h.delay = 25 * time.Millisecond
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	goRun(t, newConsumer(t, cons, h, natsbroker.ConsumerOptions{}).Run)
	waitFor(t, "every order reserved", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations`) == orders
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	delivered, unasked := 0, 0
	for key, at := range h.at {
		delivered += len(at)
		errs := h.errs[key]
		for i := 1; i < len(at); i++ {
			// errs[i-1] may be missing if the copy came while the first
			// attempt still ran: that too is a copy nobody asked for.
			if i-1 >= len(errs) || errs[i-1] == nil {
				unasked++
				t.Errorf("%s delivered again (delivery %d) after an attempt that did not fail", key, i+1)
			}
		}
	}
	t.Logf("%d deliveries of %d messages, %d again after a failed attempt, %d unasked for", delivered, orders,
		delivered-orders-unasked, unasked)
}

// A Handle that hangs is cut at its deadline, a share of AckWait, so that
// the messages prefetched behind it are handled before AckWait runs out:
// 20 orders, AckWait 2 s, Prefetch 10, and the first delivery of the
// first message hangs until its context ends. Only that message goes
// twice; every other is delivered once. (Caught: each Handle given all of
// AckWait, which held the nine behind it until JetStream delivered them
// again.)
func TestAHungHandleLeavesTheRestOfThePrefetchInTime(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 2*time.Second)
	const orders = 20
	placeAndPublish(t, db, b.url(), orders)
	h := newDeliveries(shop.NewWarehouse(db))
	var first atomic.Value // the key of the first message delivered
	h.hang = func(m postgres.Message, n int) bool {
		first.CompareAndSwap(nil, m.Key)
		return n == 1 && first.Load() == m.Key
	}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	goRun(t, newConsumer(t, cons, h, natsbroker.ConsumerOptions{Prefetch: 10}).Run)
	waitFor(t, "every order reserved", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations`) == orders
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	for key, at := range h.at {
		if key != first.Load() && len(at) != 1 {
			t.Errorf("%s delivered %d times, behind a Handle that hung", key, len(at))
		}
	}
	if n := len(h.at[first.Load().(string)]); n != 2 {
		t.Errorf("the message whose Handle hung was delivered %d times, want 2", n)
	}
}

// placeAndPublish places n orders in db and publishes their events to the
// broker at url, all of them, before it returns.
func placeAndPublish(t *testing.T, db *sql.DB, url string, n int) {
	t.Helper()
	ctx := context.Background()
	service := shop.NewOrderService(db)
	for range n {
		if _, err := service.PlaceOrder(ctx, 100); err != nil {
			t.Fatal(err)
		}
	}
	relay := newRelay(t, db, newPublisher(t, connect(t, url)))
	for sent := 0; sent < n; {
		k, err := relay.PublishPending(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sent += k
	}
}

// logBuffer collects a logger's lines; safe for the consumer's goroutine.
type logBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// lines are the lines that hold s.
func (l *logBuffer) lines(s string) []string {
	l.mu.Lock()
	text := l.b.String()
	l.mu.Unlock()
	var found []string
	for line := range strings.Lines(text) {
		if strings.Contains(line, s) {
			found = append(found, strings.TrimSpace(line))
		}
	}
	return found
}

// hangOnce is a Handler whose first call hangs until its context ends (a
// half-open database connection), and whose later calls go to a warehouse.
type hangOnce struct {
	warehouse *shop.Warehouse
	calls     atomic.Int32
}

func (h *hangOnce) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	if h.calls.Add(1) == 1 {
		<-ctx.Done()
		return false, ctx.Err()
	}
	return h.warehouse.Handle(ctx, msg)
}

// A Handle that hangs is cut at its deadline, AckWait / (2 × Prefetch),
// and the message is asked for again and applied. (Caught: Handle with no
// deadline, which hangs the consumer for good.)
func TestHandleThatHangsIsCutAtItsDeadline(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 2*time.Second)
	if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 2500); err != nil {
		t.Fatal(err)
	}
	if _, err := newRelay(t, db, newPublisher(t, connect(t, b.url()))).PublishPending(ctx); err != nil {
		t.Fatal(err)
	}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	h := &hangOnce{warehouse: shop.NewWarehouse(db)}
	goRun(t, newConsumer(t, cons, h, natsbroker.ConsumerOptions{RetryDelay: 10 * time.Millisecond}).Run)
	waitFor(t, "the order reserved after the hung Handle", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations`) == 1
	})
}

// scripted is a Handler whose answers for a key follow a script, one a
// delivery, and then apply; it counts what it was given.
type scripted struct {
	mu      sync.Mutex
	script  map[string][]error
	applied map[string]int
	seen    atomic.Int64
	block   chan struct{} // if not nil, every Handle waits on it
}

func (s *scripted) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	s.seen.Add(1)
	if s.block != nil {
		select {
		case <-s.block:
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if steps := s.script[msg.Key]; len(steps) > 0 {
		s.script[msg.Key] = steps[1:]
		return false, steps[0]
	}
	s.applied[msg.Key]++
	return true, nil
}

// The out-of-order bound counts the deliveries that found the message out
// of order only: a message whose handling failed 12 times for another
// reason (the handler's database down) and then once out of order is not
// terminated, with a MaxOutOfOrder of 11, and applies on its next delivery.
// (Caught: the bound on NumDelivered, every delivery, which terminated it
// at its first out-of-order attempt "after 13 deliveries".)
func TestOutOfOrderBoundCountsOutOfOrderDeliveriesOnly(t *testing.T) {
	ctx := context.Background()
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 500*time.Millisecond)
	pub := newPublisher(t, connect(t, b.url()))
	down := fmt.Errorf("warehouse database: connection refused")
	script := make([]error, 12)
	for i := range script {
		script[i] = down
	}
	script = append(script, fmt.Errorf("order/3 seq 2, but the last applied is 0: %w", postgres.ErrOutOfOrder))
	h := &scripted{script: map[string][]error{"k3-cancelled": script}, applied: map[string]int{}}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	var logs logBuffer
	goRun(t, newConsumer(t, cons, h, natsbroker.ConsumerOptions{RetryDelay: 100 * time.Millisecond, MaxRetryDelay: 100 * time.Millisecond,
		MaxOutOfOrder: 11, // the least for an AckWait of 0.5 s
		Logger:        slog.New(slog.NewTextHandler(&logs, nil))}).Run)
	if err := pub.Publish(ctx, postgres.Message{Key: "k3-cancelled", Aggregate: "order/3", Seq: 2, ID: 2,
		Type: shop.OrderCancelled, Payload: `{"orderId":3,"totalCents":300}`}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the message applied, or terminated", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.applied["k3-cancelled"] == 1 || len(logs.lines("terminated")) > 0
	})
	if line := logs.lines("message terminated"); len(line) != 0 {
		t.Errorf("the message was terminated: %v", line)
	}
}

// At a stop the consumer hands back what it had prefetched and not
// handled: a consumer that starts after it gets those messages at once,
// not after AckWait (two minutes here). Only the message whose handling
// the stop cut short waits for AckWait, as Run's doc says. (Caught: a stop
// that dropped the buffer: 9 messages held until AckWait ended; the
// iterator stopped, not drained, at the stop, which drops it too.)
func TestStopHandsBackWhatWasPrefetched(t *testing.T) {
	ctx := context.Background()
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 2*time.Minute)
	pub := newPublisher(t, connect(t, b.url()))
	for i := range int64(20) {
		if err := pub.Publish(ctx, postgres.Message{Key: fmt.Sprintf("k%d", i+1), ID: i + 1, Type: shop.OrderPlaced,
			Payload: `{"orderId":1,"totalCents":100}`}); err != nil {
			t.Fatal(err)
		}
	}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	blocked := &scripted{script: map[string][]error{}, applied: map[string]int{}, block: make(chan struct{})}
	stop := goRun(t, newConsumer(t, cons, blocked, natsbroker.ConsumerOptions{Prefetch: 10}).Run)
	waitFor(t, "the first message in Handle and the buffer full", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && blocked.seen.Load() == 1 && info.NumAckPending == 10
	})
	stop()
	next := &scripted{script: map[string][]error{}, applied: map[string]int{}}
	goRun(t, newConsumer(t, cons, next, natsbroker.ConsumerOptions{}).Run)
	waitFor(t, "every message but the one cut short applied by the next consumer", func() bool {
		next.mu.Lock()
		defer next.mu.Unlock()
		return len(next.applied) == 19
	})
}

// slowPredecessor is a Handler that fails one key's deliveries for a reason
// that passes (a lock timeout) until release is closed, and hands every
// other delivery, and that key's after release, to a warehouse.
type slowPredecessor struct {
	*deliveries
	key      string
	release  chan struct{}
	failures atomic.Int32
}

func (s *slowPredecessor) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	if msg.Key == s.key {
		select {
		case <-s.release:
		default:
			s.failures.Add(1)
			return false, errors.New("reserve: canceling statement due to lock timeout")
		}
	}
	return s.deliveries.Handle(ctx, msg)
}

// An OrderPlaced that fails for a reason that passes, again and again,
// keeps its OrderCancelled waiting, not terminated: the successor is
// delivered far more often than MaxOutOfOrder, and once the predecessor
// applies, it applies after it. Nothing is terminated; the predecessor's
// backoff doubles from RetryDelay to MaxRetryDelay, with one log line a
// step, not one a delivery; Waiting and OldestWaiting count both messages
// while they wait, and neither once they applied. (Caught: the successor
// Term'd after MaxOutOfOrder deliveries while its predecessor was only
// slow, and the cancellation lost; each failure retried at RetryDelay and
// logged.)
func TestSuccessorWaitsForAPredecessorThatFailsAndThenApplies(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 500*time.Millisecond)
	pub := newPublisher(t, connect(t, b.url()))
	h := &slowPredecessor{deliveries: newDeliveries(shop.NewWarehouse(db)), key: "k5-placed", release: make(chan struct{})}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	const maxOutOfOrder = 11 // the least for an AckWait of 0.5 s and a RetryDelay of 0.1 s
	var logs logBuffer
	c := newConsumer(t, cons, h, natsbroker.ConsumerOptions{RetryDelay: 100 * time.Millisecond, MaxRetryDelay: 400 * time.Millisecond,
		MaxOutOfOrder: maxOutOfOrder, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	goRun(t, c.Run)
	for _, m := range []postgres.Message{
		{Key: "k5-placed", Aggregate: "order/5", Seq: 1, ID: 1, Type: shop.OrderPlaced, Payload: `{"orderId":5,"totalCents":500}`},
		{Key: "k5-cancelled", Aggregate: "order/5", Seq: 2, ID: 2, Type: shop.OrderCancelled, Payload: `{"orderId":5,"totalCents":500}`},
	} {
		if err := pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the cancellation delivered more often than MaxOutOfOrder while its order fails", func() bool {
		at, _ := h.of("k5-cancelled")
		return len(at) > maxOutOfOrder+3 && h.failures.Load() >= 8
	})
	if n, oldest := c.Waiting(), c.OldestWaiting(); n != 2 || oldest <= 0 {
		t.Errorf("while both wait: Waiting = %d, OldestWaiting = %v; want 2 and more than zero", n, oldest)
	}
	close(h.release)
	waitFor(t, "the cancellation applied", func() bool {
		_, errs := h.of("k5-cancelled")
		return len(errs) > 0 && errs[len(errs)-1] == nil
	})
	placed, _ := h.of("k5-placed")
	cancelled, _ := h.of("k5-cancelled")
	if len(placed) != 1 || !placed[0].Before(cancelled[len(cancelled)-1]) {
		t.Errorf("the order applied at %v, its cancellation at %v; want the order once, before", placed, cancelled[len(cancelled)-1])
	}
	if n := count(t, db, `SELECT count(*) FROM reservations WHERE order_id = 5`); n != 0 {
		t.Errorf("%d reservations for the cancelled order, want 0", n)
	}
	if line := logs.lines("terminated"); len(line) != 0 {
		t.Errorf("terminated: %q", line)
	}
	if line := logs.lines(`msg="message failed; asking for it again" key=k5-placed`); len(line) != 3 {
		t.Errorf("the order's failures logged %d times, want once a step of its backoff (0.1 s, 0.2 s, 0.4 s): %q", len(line), line)
	}
	if line := logs.lines(`msg="message handled after failures that passed" key=k5-placed`); len(line) != 1 {
		t.Errorf("log: %q; want one line for the order handled after its failures", line)
	}
	if n := c.Waiting(); n != 0 {
		t.Errorf("after both applied: Waiting = %d, want 0", n)
	}
	waitFor(t, "the consumer to have nothing pending", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
	t.Logf("the order failed %d times; its cancellation was delivered %d times", h.failures.Load(), len(cancelled))
}
