package rabbitbroker_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/postgres/shop/shoptest"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

// flaky is a Handler that fails the first failures deliveries of each
// message it is told to fail, with an error that may pass (a database that
// is down), and records the order in which it handled messages.
type flaky struct {
	handler  rabbitbroker.Handler
	failures int
	mu       sync.Mutex
	tries    map[string]int
	handled  []string // keys, in the order handled without error
}

func (f *flaky) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	f.mu.Lock()
	f.tries[msg.Key]++
	fail := f.tries[msg.Key] <= f.failures && msg.Key == "k2"
	f.mu.Unlock()
	if fail {
		return false, errors.New("warehouse database: connection refused")
	}
	if msg.Key == "k7" {
		return false, fmt.Errorf("order 7: product discontinued: %w", postgres.ErrPermanent)
	}
	applied, err := f.handler.Handle(ctx, msg)
	if err == nil {
		f.mu.Lock()
		f.handled = append(f.handled, msg.Key)
		f.mu.Unlock()
	}
	return applied, err
}

// What a Consumer does with each kind of failure, on a queue whose
// delivery limit is 3: a message whose database is down for its first
// four tries is tried again in place (the messages behind it wait, so the
// order holds) and applied, without being dead-lettered though four is past
// the limit: tries in place spend no delivery; a payload that can never be
// read, or that the handler says can never apply (wrapping
// postgres.ErrPermanent), is dead-lettered at once, one delivery; a message whose predecessor
// never comes is handed back, spending a delivery each time, and RabbitMQ
// dead-letters it when it comes back a fourth time, past the limit. Nothing is retried for ever. (Caught: a
// Consumer that handed a failed message back at once: k2 was dead-lettered
// too.)
func TestConsumerRetriesInPlaceAndDeadLettersWhatCannotApply(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 3)
	pub := newPublisher(t, node.URL(), top, 0)
	for _, m := range []postgres.Message{
		{ID: 1, Key: "k1", Type: shop.OrderPlaced, Payload: `{"orderId":1,"totalCents":100}`, Aggregate: "order/1", Seq: 1},
		{ID: 2, Key: "k2", Type: shop.OrderPlaced, Payload: `{"orderId":2,"totalCents":200}`, Aggregate: "order/2", Seq: 1},
		{ID: 3, Key: "k3", Type: shop.OrderPlaced, Payload: `{"orderId":3,"totalCents":300}`, Aggregate: "order/3", Seq: 1},
		{ID: 4, Key: "k4", Type: shop.OrderPlaced, Payload: `not json`, Aggregate: "order/4", Seq: 1},
		{ID: 5, Key: "k5", Type: shop.OrderCancelled, Payload: `{"orderId":5,"totalCents":500}`, Aggregate: "order/5", Seq: 2},
		{ID: 6, Key: "k6", Type: shop.OrderPlaced, Payload: `{"orderId":6,"totalCents":600}`, Aggregate: "order/6", Seq: 1},
		{ID: 7, Key: "k7", Type: shop.OrderPlaced, Payload: `{"orderId":7,"totalCents":700}`, Aggregate: "order/7", Seq: 1},
	} {
		if err := pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	h := &flaky{handler: shop.NewWarehouse(db), failures: 4, tries: map[string]int{}}
	c := newConsumer(t, dialer(node.URL()), top.Queue, h, rabbitbroker.ConsumerOptions{RetryDelay: 10 * time.Millisecond, MaxRetryDelay: 10 * time.Millisecond})
	goRun(t, c.Run)
	waitFor(t, "k4, k5 and k7 dead-lettered", func() bool { return queued(t, node.URL(), top.DeadLetterQueue()) >= 3 })
	waitFor(t, "the queue empty", func() bool { return queued(t, node.URL(), top.Queue) == 0 })
	if n := queued(t, node.URL(), top.DeadLetterQueue()); n != 3 {
		t.Errorf("%d messages dead-lettered, want 3: k4, k5 and k7", n)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if got := h.handled; len(got) != 4 || got[0] != "k1" || got[1] != "k2" || got[2] != "k3" || got[3] != "k6" {
		t.Errorf("handled %v, want [k1 k2 k3 k6]: k2 in its place", got)
	}
	if h.tries["k2"] != 5 || h.tries["k4"] != 1 || h.tries["k5"] != 4 || h.tries["k7"] != 1 {
		t.Errorf("tries k2 %d, k4 %d, k5 %d, k7 %d; want 5 (in place), 1 (dead-lettered at once), 4 (handed back 3 times, the limit, then dead-lettered), 1 (permanent)", h.tries["k2"], h.tries["k4"], h.tries["k5"], h.tries["k7"])
	}
	if c.Applied() != 4 || c.DeadLettered() != 2 {
		t.Errorf("applied %d, dead-lettered by the consumer %d; want 4 and 2 (k4, k7)", c.Applied(), c.DeadLettered())
	}
}

// A node restarted mid-drain: two relays and a consumer on a node of the
// test's own; once 30 orders are reserved the node is stopped and started
// again on its store, and 30 more orders are placed while it comes back.
// Every order is reserved once, nothing is parked: the quorum queue kept
// what it confirmed, the Publishers dialled again, the Consumer connected
// again and dropped the copies of what it had applied but not acked.
func TestNodeRestartedMidDrainLosesNothing(t *testing.T) {
	own := startNode(t)
	db := newDatabase(t)
	top := declare(t, own.URL(), 0)
	for range 2 {
		relay := newRelay(t, db, newPublisher(t, own.URL(), top, 0), postgres.RelayConfig{BatchSize: 10, PollInterval: 50 * time.Millisecond})
		goRun(t, relay.Run)
	}
	c := newConsumer(t, dialer(own.URL()), top.Queue, shop.NewWarehouse(db), rabbitbroker.ConsumerOptions{RetryDelay: 100 * time.Millisecond})
	goRun(t, c.Run)
	service := shop.NewOrderService(db)
	place := func(from, to int) {
		for i := from; i < to; i++ {
			if _, err := service.PlaceOrder(context.Background(), int64(100+i)); err != nil {
				t.Error(err)
			}
		}
	}
	place(0, 30)
	waitFor(t, "30 orders reserved", func() bool { return count(t, db, `SELECT count(*) FROM reservations`) >= 30 })
	done := make(chan error, 1)
	go func() { done <- own.Restart() }()
	place(30, 60)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitFor(t, "60 orders reserved and every row marked", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations`) >= 60 &&
			count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0
	})
	wantEachOrderReservedOnce(t, db, 60)
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL`); n != 0 {
		t.Errorf("%d rows parked, want 0", n)
	}
	t.Logf("applied %d, copies dropped %d", c.Applied(), c.Duplicates())
}

// The consumer's database down and back, for longer than the queue's
// delivery limit would allow if failures spent deliveries: the warehouse
// keeps its tables in a database of its own, which stops taking
// connections (and loses the ones it had) once 10 of 20 orders are
// reserved, while the relay goes on publishing, on a queue whose delivery
// limit is 3, and stays down until the consumer has failed 30 times. The
// consumer tries the message at the head in place, backing off (RetryDelay
// doubling up to MaxRetryDelay), and says so (Waiting, OldestWaiting);
// once the database is back, every order is reserved once, in order,
// nothing handed back or dead-lettered, and nothing waits. (Caught: a
// consumer that handed the head back after MaxAttempts tries, which spent
// the queue's deliveries: with the timings scaled down, 5 of 7 orders
// reserved and 2 dead-lettered.)
func TestConsumerWhoseDatabaseGoesDownAppliesEverythingOnceItIsBack(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	warehouseName := pgtest.NewBlankDatabase(t)
	wdb := pgtest.Open(t, warehouseName, "")
	if err := errors.Join(tableOutbox(wdb).Migrate(ctx), shop.Migrate(ctx, wdb)); err != nil {
		t.Fatal(err)
	}
	admin := pgtest.Open(t, pgtest.Config.Database, "")
	setDown := func(down bool) {
		t.Helper()
		if _, err := admin.Exec(fmt.Sprintf(`ALTER DATABASE %s ALLOW_CONNECTIONS %v`, warehouseName, !down)); err != nil {
			t.Fatal(err)
		}
		if down {
			if _, err := admin.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1`, warehouseName); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Cleanup(func() { setDown(false) })
	top := declare(t, node.URL(), 3)
	relay := newRelay(t, db, newPublisher(t, node.URL(), top, 0), postgres.RelayConfig{PollInterval: 20 * time.Millisecond})
	goRun(t, relay.Run)
	h := &counting{handler: shoptest.NewOrdered(shop.NewWarehouse(wdb))}
	c := newConsumer(t, dialer(node.URL()), top.Queue, h, rabbitbroker.ConsumerOptions{RetryDelay: 5 * time.Millisecond, MaxRetryDelay: 40 * time.Millisecond})
	goRun(t, c.Run)
	service := shop.NewOrderService(db)
	place := func(n int) {
		for range n {
			if _, err := service.PlaceOrder(ctx, 1000); err != nil {
				t.Fatal(err)
			}
		}
	}
	ordered := h.handler.(*shoptest.Ordered)
	place(10)
	waitFor(t, "10 orders reserved", func() bool { return ordered.Applied() == 10 })
	setDown(true)
	place(10)
	failedBefore := h.failed.Load()
	waitFor(t, "30 failures while the database is down", func() bool { return h.failed.Load()-failedBefore >= 30 })
	if c.Waiting() != 1 || c.OldestWaiting() <= 0 {
		t.Errorf("while the database is down: %d waiting, the oldest for %v; want 1, for a while", c.Waiting(), c.OldestWaiting())
	}
	setDown(false)
	waitFor(t, "20 orders reserved", func() bool { return ordered.Applied() == 20 })
	if n := count(t, wdb, `SELECT count(*) FROM reservations`); n != 20 {
		t.Errorf("%d reservations, want 20", n)
	}
	if wrong := ordered.Wrong(); len(wrong) > 0 {
		t.Errorf("applied out of order or twice: %v", wrong)
	}
	if n := queued(t, node.URL(), top.DeadLetterQueue()); n != 0 || c.DeadLettered() != 0 || c.HandedBack() != 0 {
		t.Errorf("%d dead-lettered by the queue, %d by the consumer, %d handed back; want 0, 0 and 0", n, c.DeadLettered(), c.HandedBack())
	}
	if c.Waiting() != 0 || c.OldestWaiting() != 0 {
		t.Errorf("once the database is back: %d waiting, the oldest for %v; want none", c.Waiting(), c.OldestWaiting())
	}
	t.Logf("%d failures while the database was down", h.failed.Load()-failedBefore)
}

// counting is a Handler that counts the failures of the one it wraps.
type counting struct {
	handler rabbitbroker.Handler
	failed  atomic.Int64
}

func (h *counting) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	applied, err := h.handler.Handle(ctx, msg)
	if err != nil {
		h.failed.Add(1)
	}
	return applied, err
}

// hangsOnce is a Handler whose first call for each message hangs until its
// context ends, as a handler stuck on a lock or a lost connection would.
type hangsOnce struct {
	handler rabbitbroker.Handler
	mu      sync.Mutex
	calls   map[string]int
}

func (h *hangsOnce) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	h.mu.Lock()
	h.calls[msg.Key]++
	first := h.calls[msg.Key] == 1
	h.mu.Unlock()
	if first {
		<-ctx.Done()
		return false, ctx.Err()
	}
	return h.handler.Handle(ctx, msg)
}

// A Handle that hangs is cut at HandleTimeout and tried again in place: both
// messages are applied, in order, each on its second call, and nothing is
// handed back. (Caught: a Handle given Run's context alone: the consumer
// hung on the first message, and the test gave up after two minutes.)
func TestHandleThatHangsIsCutAndTriedAgain(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	pub := newPublisher(t, node.URL(), top, 0)
	for i := range 2 {
		m := postgres.Message{ID: int64(i + 1), Key: fmt.Sprint("k", i+1), Type: shop.OrderPlaced,
			Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":100}`, i+1), Aggregate: "order/1", Seq: int64(i + 1)}
		if err := pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	h := &hangsOnce{handler: shoptest.NewOrdered(shop.NewWarehouse(db)), calls: map[string]int{}}
	c := newConsumer(t, dialer(node.URL()), top.Queue, h, rabbitbroker.ConsumerOptions{RetryDelay: 10 * time.Millisecond, HandleTimeout: 100 * time.Millisecond})
	goRun(t, c.Run)
	waitFor(t, "both applied", func() bool { return c.Applied() == 2 })
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.calls["k1"] != 2 || h.calls["k2"] != 2 || c.HandedBack() != 0 {
		t.Errorf("calls %v, handed back %d; want each message called twice, none handed back", h.calls, c.HandedBack())
	}
	if wrong := h.handler.(*shoptest.Ordered).Wrong(); len(wrong) > 0 {
		t.Errorf("applied out of order: %v", wrong)
	}
}

// stuckUntilStop is a Handler that says it started, then waits for its
// context to end, as a Handle on a database that does not answer.
type stuckUntilStop struct{ started chan struct{} }

func (s *stuckUntilStop) Handle(ctx context.Context, _ postgres.Message) (bool, error) {
	close(s.started)
	<-ctx.Done()
	return false, ctx.Err()
}

// A stop that cuts a Handle short neither acks nor dead-letters the
// message: the channel closes with it unacked, RabbitMQ delivers it again,
// and the next consumer applies it. (Caught: a consumer that acked the
// delivery its stop cut short: the order lost.)
func TestStopMidHandleHandsTheMessageBack(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	if err := newPublisher(t, node.URL(), top, 0).Publish(ctx, postgres.Message{ID: 1, Key: "k1", Type: shop.OrderPlaced,
		Payload: `{"orderId":1,"totalCents":100}`, Aggregate: "order/1", Seq: 1}); err != nil {
		t.Fatal(err)
	}
	stuck := &stuckUntilStop{started: make(chan struct{})}
	first := newConsumer(t, dialer(node.URL()), top.Queue, stuck, rabbitbroker.ConsumerOptions{HandleTimeout: time.Hour}) // only the stop ends it
	stop := goRun(t, first.Run)
	<-stuck.started
	stop()
	if first.Applied() != 0 || first.DeadLettered() != 0 {
		t.Fatalf("the stopped consumer applied %d, dead-lettered %d; want neither", first.Applied(), first.DeadLettered())
	}
	next := newConsumer(t, dialer(node.URL()), top.Queue, shop.NewWarehouse(db), rabbitbroker.ConsumerOptions{})
	goRun(t, next.Run)
	waitFor(t, "the message applied by the next consumer", func() bool { return next.Applied() == 1 })
	if n := count(t, db, `SELECT count(*) FROM reservations WHERE order_id = 1`); n != 1 {
		t.Errorf("%d reservations for order 1, want 1", n)
	}
}

// NewConsumer checks its options when it makes the Consumer and refuses a
// bad one with an error wrapping postgres.ErrInvalidConfig that names it;
// the zero options are every default. (The options used to be fields set
// after NewConsumer, read when Run began, a negative one taken for zero.)
func TestNewConsumerChecksItsOptions(t *testing.T) {
	dial := func() (*amqp.Connection, error) { return nil, errors.New("not dialled") }
	h := &collecting{}
	for _, tc := range []struct {
		dial  func() (*amqp.Connection, error)
		queue string
		h     rabbitbroker.Handler
		opts  rabbitbroker.ConsumerOptions
		want  string
	}{
		{nil, "q", h, rabbitbroker.ConsumerOptions{}, "no dial"},
		{dial, "", h, rabbitbroker.ConsumerOptions{}, "no queue"},
		{dial, "q", nil, rabbitbroker.ConsumerOptions{}, "no handler"},
		{dial, "q", h, rabbitbroker.ConsumerOptions{HandleTimeout: -time.Second}, "HandleTimeout -1s"},
		{dial, "q", h, rabbitbroker.ConsumerOptions{Concurrency: -4}, "Concurrency -4"},
		{dial, "q", h, rabbitbroker.ConsumerOptions{RetryDelay: time.Minute, MaxRetryDelay: time.Second}, "MaxRetryDelay 1s is below RetryDelay 1m0s"},
	} {
		c, err := rabbitbroker.NewConsumer(tc.dial, tc.queue, tc.h, tc.opts)
		if c != nil || !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewConsumer(%+v) = %v, %v; want ErrInvalidConfig saying %q", tc.opts, c, err, tc.want)
		}
	}
	if _, err := rabbitbroker.NewConsumer(dial, "q", h, rabbitbroker.ConsumerOptions{}); err != nil {
		t.Errorf("the zero options: %v", err)
	}
}
