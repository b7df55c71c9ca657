package natsbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// recorder is a Handler that hands every delivery to a warehouse and
// counts the deliveries and how many of them the warehouse applied.
type recorder struct {
	warehouse        *shop.Warehouse
	calls, applied   atomic.Int64
	duplicateApplied atomic.Int64 // copies applied as new: must stay zero
	mu               sync.Mutex
	seen             map[string]bool
}

func newRecorder(wh *shop.Warehouse) *recorder {
	return &recorder{warehouse: wh, seen: map[string]bool{}}
}

func (r *recorder) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	r.calls.Add(1)
	applied, err := r.warehouse.Handle(ctx, msg)
	if applied {
		r.applied.Add(1)
		r.mu.Lock()
		if r.seen[msg.Key] {
			r.duplicateApplied.Add(1)
		}
		r.seen[msg.Key] = true
		r.mu.Unlock()
	}
	return applied, err
}

// wantEachOrderReservedOnce checks that every order has exactly one
// reservation, and that there are orders of them.
func wantEachOrderReservedOnce(t *testing.T, db *sql.DB, orders int) {
	t.Helper()
	if n := count(t, db, `SELECT count(*) FROM orders`); n != orders {
		t.Errorf("%d orders, want %d", n, orders)
	}
	if n := count(t, db, `SELECT count(*) FROM reservations`); n != orders {
		t.Errorf("%d reservations, want %d", n, orders)
	}
	if n := count(t, db, `SELECT count(*) FROM orders o
		WHERE (SELECT count(*) FROM reservations r WHERE r.order_id = o.id) <> 1`); n != 0 {
		t.Errorf("%d orders without exactly one reservation, want 0", n)
	}
}

// 1. End to end: orders placed by four clients at once, three relays
// publishing to one JetStream in batches, two consumers sharing the
// warehouse's durable consumer: every order reserved exactly once, and the
// stream holds one message per order.
func TestEveryOrderReservedOnceEndToEnd(t *testing.T) {
	db := newDatabase(t)
	b := startBroker(t, nil)
	_, stream := setUp(t, connect(t, b.url()), 0, 0)
	for range 3 {
		relay := newRelay(t, db, newPublisher(t, connect(t, b.url())), postgres.RelayConfig{BatchSize: 20, PollInterval: 50 * time.Millisecond}) // each order an aggregate of its own: the relays publish in batches
		goRun(t, relay.Run)
	}
	rec := newRecorder(shop.NewWarehouse(db))
	for range 2 {
		runConsumer(t, connect(t, b.url()), rec)
	}

	const clients, each = 4, 50
	service := shop.NewOrderService(db)
	var wg sync.WaitGroup
	errs := make(chan error, clients*each)
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				if _, err := service.PlaceOrder(context.Background(), int64(100*(c+1)+i)); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	waitFor(t, "every order reserved and every row marked", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations`) >= clients*each &&
			count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0
	})
	wantEachOrderReservedOnce(t, db, clients*each)
	if n := streamMessages(t, stream); n != clients*each {
		t.Errorf("stream holds %d messages, want %d", n, clients*each)
	}
	if n := rec.duplicateApplied.Load(); n != 0 {
		t.Errorf("%d copies applied as new messages, want 0", n)
	}
}

// 2. The lost acknowledgement, for real: the server stores a batch of three
// messages, and a proxy drops the first one's ack on its way to the relay.
// The pass waits for that ack until its budget runs out and marks nothing,
// not even the two after it whose acks came: the relay marks only what was
// acknowledged before the first failure. The next pass publishes all three
// again, JetStream answers that each is a duplicate, the rows are marked,
// and the stream holds one copy of each.
func TestLostAckIsSentAgainAndStoredOnce(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	_, stream := setUp(t, connect(t, b.url()), 0, 0)
	proxy := newAckDropper(t, strings.TrimPrefix(b.url(), "nats://"))
	pub := newPublisher(t, connect(t, proxy.url()))
	relay := newRelay(t, db, pub, postgres.RelayConfig{PassTimeout: time.Second}) // each order an aggregate of its own: the relay publishes its batch at once
	for _, total := range []int64{2500, 4000, 700} {
		if _, err := shop.NewOrderService(db).PlaceOrder(ctx, total); err != nil {
			t.Fatal(err)
		}
	}

	proxy.dropNextAck()
	if n, err := relay.PublishPending(ctx); n != 0 || !errors.Is(err, postgres.ErrBrokerUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("pass whose ack was lost = %d, %v; want 0 and no ack before the pass's budget ran out", n, err)
	}
	if d := proxy.dropped.Load(); d != 1 {
		t.Fatalf("proxy dropped %d acks, want 1", d)
	}
	if n := streamMessages(t, stream); n != 3 {
		t.Fatalf("stream holds %d messages after the lost ack, want 3 (stored, only an ack was lost)", n)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 3 {
		t.Fatalf("%d rows unsent after the lost ack, want 3", n)
	}

	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("pass after the lost ack = %d, %v; want 3, <nil>", n, err)
	}
	if d := pub.Duplicates(); d != 3 {
		t.Errorf("publisher counted %d duplicate acks, want 3", d)
	}
	if n := streamMessages(t, stream); n != 3 {
		t.Errorf("stream holds %d messages after the re-send, want 3", n)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
		t.Errorf("%d rows unsent after the re-send, want 0", n)
	}
}

// 3. Outside the window: a copy published after the stream's duplicate
// window is stored again and delivered, and the warehouse drops it by its
// key.
func TestResendAfterTheWindowReachesTheConsumerWhichDropsIt(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	const window = 500 * time.Millisecond
	_, stream := setUp(t, connect(t, b.url()), window, 0)
	pub := newPublisher(t, connect(t, b.url()))
	relay := newRelay(t, db, pub)
	rec := newRecorder(shop.NewWarehouse(db))
	runConsumer(t, connect(t, b.url()), rec)
	if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 2500); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("first pass = %d, %v; want 1, <nil>", n, err)
	}
	waitFor(t, "the order reserved", func() bool { return rec.applied.Load() == 1 })

	// Publish the row again, as a relay does after a lost claim or an
	// unknown commit, until a copy comes after the window: within it, the
	// stream drops each copy and the publisher counts a duplicate.
	waitFor(t, "a copy published after the duplicate window", func() bool {
		before := pub.Duplicates()
		if _, err := db.ExecContext(ctx, `UPDATE outbox SET sent_at = NULL`); err != nil {
			t.Fatal(err)
		}
		if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
			t.Fatalf("pass = %d, %v; want 1, <nil>", n, err)
		}
		return pub.Duplicates() == before
	})
	if n := streamMessages(t, stream); n != 2 {
		t.Fatalf("stream holds %d messages, want 2 (the copy after the window is stored)", n)
	}
	waitFor(t, "the copy delivered", func() bool { return rec.calls.Load() == 2 })
	if a := rec.applied.Load(); a != 1 {
		t.Errorf("warehouse applied %d of 2 deliveries, want 1", a)
	}
	wantEachOrderReservedOnce(t, db, 1)
}

// 4. The broker goes down in the middle of the shop's day: two relays that
// publish to it, and back off while it is down, and a consumer. Orders
// placed while it is down wait in the outbox; the server starts again on
// the same store, the relays resume, every order is reserved once, nothing
// is parked (a broker that is down is not a rejection), and a copy of a
// message stored before the restart is still dropped as a duplicate.
func TestBrokerRestartMidDrainLosesNothingAndStillDropsCopies(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	_, stream := setUp(t, connect(t, b.url()), 0, 0)
	var pubs []*natsbroker.Publisher
	for range 2 {
		pub := newPublisher(t, connect(t, b.url()))
		pubs = append(pubs, pub)
		relay := newRelay(t, db, pub, postgres.RelayConfig{BatchSize: 10, PassTimeout: time.Second, ParkAfter: 1, PollInterval: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond}) // a broker that is down must never park a row
		goRun(t, relay.Run)
	}
	duplicates := func() (n int64) {
		for _, p := range pubs {
			n += p.Duplicates()
		}
		return n
	}
	rec := newRecorder(shop.NewWarehouse(db))
	runConsumer(t, connect(t, b.url()), rec)
	service := shop.NewOrderService(db)
	place := func(n int) {
		for i := range n {
			if _, err := service.PlaceOrder(ctx, int64(1000+i)); err != nil {
				t.Fatal(err)
			}
		}
	}

	place(30)
	waitFor(t, "the first 30 orders reserved", func() bool { return rec.applied.Load() == 30 })
	b.stop()
	place(30)
	waitFor(t, "a relay's failed publish to the stopped broker", func() bool {
		return count(t, db, `SELECT count(*) FROM outbox WHERE attempts > 0`) > 0
	})
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n == 0 {
		t.Fatal("every row marked sent while the broker was down")
	}
	b.start()
	waitFor(t, "all 60 orders reserved and every row marked", func() bool {
		return rec.applied.Load() == 60 && count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0
	})
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL`); n != 0 {
		t.Errorf("%d rows parked, want 0", n)
	}
	wantEachOrderReservedOnce(t, db, 60)

	// Row 1 was stored before the restart; the server rebuilt its record of
	// ids from the store, so a copy is dropped.
	before := duplicates()
	if _, err := db.ExecContext(ctx, `UPDATE outbox SET sent_at = NULL WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "row 1 marked sent again", func() bool {
		return count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0
	})
	if d := duplicates() - before; d != 1 {
		t.Errorf("re-send of a message stored before the restart: %d duplicate acks, want 1", d)
	}
	if n := streamMessages(t, stream); n != 60 {
		t.Errorf("stream holds %d messages, want 60", n)
	}
}

// dying is a Handler whose consumer process dies: on the first delivery
// before the warehouse's commit, on the second after it and before the ack.
// It dies by closing the consumer's connection, so the ack cannot leave.
type dying struct {
	warehouse *shop.Warehouse
	conn      atomic.Pointer[nats.Conn]
	calls     atomic.Int64
	handled   atomic.Int64 // deliveries whose Handle has returned
	applied   []bool       // of each delivery that reached the warehouse
	mu        sync.Mutex
}

func (d *dying) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	defer d.handled.Add(1)
	call := d.calls.Add(1)
	if call == 1 {
		d.conn.Load().Close()
		return false, errors.New("consumer died before its commit")
	}
	// Without the Handle deadline (AckWait / (2 × Prefetch), 50 ms here):
	// on a loaded machine a slow commit would time out and be asked for
	// again, deliveries this test does not count on; the deaths are its
	// subject.
	applied, err := d.warehouse.Handle(context.WithoutCancel(ctx), msg)
	d.mu.Lock()
	d.applied = append(d.applied, applied)
	d.mu.Unlock()
	if call == 2 {
		d.conn.Load().Close()
	}
	return applied, err
}

// 5. The consumer dies before its commit, and then after its commit and
// before its ack: the message is delivered again each time (AckWait), and
// applied once.
func TestConsumerThatDiesBeforeItsAckGetsTheMessageAgainAndAppliesItOnce(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	_, stream := setUp(t, connect(t, b.url()), 0, time.Second)
	relay := newRelay(t, db, newPublisher(t, connect(t, b.url())))
	if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 2500); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass = %d, %v; want 1, <nil>", n, err)
	}

	h := &dying{warehouse: shop.NewWarehouse(db)}
	for life := int64(1); life <= 3; life++ {
		nc := connect(t, b.url())
		h.conn.Store(nc)
		stop, done := runConsumerDone(t, nc, h)
		if life < 3 {
			select { // it dies of its closed connection, on its own
			case <-done:
			case <-time.After(60 * time.Second):
				t.Fatalf("life %d: consumer still running 60 s after its connection closed", life)
			}
			if err := stop(); err == nil || errors.Is(err, context.Canceled) {
				t.Errorf("life %d: Run = %v, want the error of a closed connection", life, err)
			}
		}
	}
	waitFor(t, "the third delivery handled", func() bool { return h.handled.Load() == 3 })
	cons, err := stream.Consumer(ctx, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the third delivery acked", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	if calls := h.calls.Load(); calls != 3 || len(h.applied) != 2 || !h.applied[0] || h.applied[1] {
		t.Errorf("%d deliveries, warehouse applied %v; want 3 deliveries, [true false]", calls, h.applied)
	}
	wantEachOrderReservedOnce(t, db, 1)
}

// 6. A message that can never be stored: a payload over the server's
// limit is a rejection, and with ParkAfter the relay parks it and the rows
// after it flow. A subject that no stream takes, a closed connection and a
// stopped server are not rejections: the broker is at fault, not the
// message.
func TestRefusedPayloadIsParkedAndLaterRowsFlow(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, func(o *server.Options) { o.MaxPayload = 16 << 10 })
	js, _ := setUp(t, connect(t, b.url()), 0, 0)
	pub := newPublisher(t, connect(t, b.url()))
	relay := newRelay(t, db, pub, postgres.RelayConfig{ParkAfter: 1})
	rec := newRecorder(shop.NewWarehouse(db))
	runConsumer(t, connect(t, b.url()), rec)

	if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload)
		VALUES ('OrderPlaced', json_build_object('orderId', 0, 'totalCents', 1, 'note', repeat('x', 32768)))`); err != nil {
		t.Fatal(err)
	}
	for _, total := range []int64{2500, 4000} {
		if _, err := shop.NewOrderService(db).PlaceOrder(ctx, total); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := relay.PublishPending(ctx); n != 2 || err != nil {
		t.Fatalf("pass = %d, %v; want 2, <nil> (row 1 parked, rows 2 and 3 sent)", n, err)
	}
	parked, err := tableOutbox(db).ListParked(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].ID != 1 || !strings.Contains(parked[0].LastError, "maximum payload") {
		t.Fatalf("parked = %+v, want row 1 with the server's maximum payload error", parked)
	}
	waitFor(t, "both orders reserved", func() bool { return rec.applied.Load() == 2 })
	wantEachOrderReservedOnce(t, db, 2)

	msg := postgres.Message{ID: 9, Type: shop.OrderPlaced, Payload: `{}`, Key: "k9"}
	if err := js.DeleteStream(ctx, natsbroker.Stream); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(ctx, msg); !errors.Is(err, postgres.ErrBrokerUnavailable) || errors.Is(err, postgres.ErrRejected) {
		t.Errorf("Publish with no stream for the subject = %v, want ErrBrokerUnavailable and not ErrRejected", err)
	}
	closed := connect(t, b.url())
	closedPub := newPublisher(t, closed)
	closed.Close()
	if _, err := closedPub.PublishBatch(ctx, []postgres.Message{msg}); !errors.Is(err, postgres.ErrBrokerUnavailable) {
		t.Errorf("PublishBatch on a closed connection = %v, want ErrBrokerUnavailable", err)
	}
	b.stop()
	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	if err := pub.Publish(short, msg); !errors.Is(err, postgres.ErrBrokerUnavailable) || errors.Is(err, postgres.ErrRejected) {
		t.Errorf("Publish to a stopped server = %v, want ErrBrokerUnavailable and not ErrRejected", err)
	}
}

// A row parked for a payload over the server's max_payload goes once the
// limit is raised and the row unparked, with the same publisher and no
// restart: the client learned the limit when it connected and kept it,
// so the publisher asks the server again before it refuses a message,
// and reconnects to learn the new limit. While the limit stands, the
// message is refused, parked, and named by ReadLag with its error.
// (Caught: after raising max_payload the unparked row was refused and
// parked again until the relays restarted.)
func TestARowParkedForMaxPayloadGoesOnceTheLimitIsRaised(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, func(o *server.Options) { o.MaxPayload = 16 << 10 })
	_, stream := setUp(t, connect(t, b.url()), 0, 0)
	nc := connect(t, b.url())
	relay := newRelay(t, db, newPublisher(t, nc), postgres.RelayConfig{ParkAfter: 2, RetryDelay: time.Millisecond, MaxRetryDelay: time.Millisecond})
	if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload)
		VALUES ('OrderPlaced', json_build_object('orderId', 1, 'totalCents', 1, 'note', repeat('x', 32768)))`); err != nil {
		t.Fatal(err)
	}
	ob := tableOutbox(db)
	for attempt := 1; attempt <= 2; attempt++ {
		// The second refusal parks the row, and the pass goes on.
		if n, err := relay.PublishPending(ctx); n != 0 || attempt == 1 && !errors.Is(err, postgres.ErrRejected) || attempt == 2 && err != nil {
			t.Fatalf("pass %d under the limit = %d, %v; want the row refused", attempt, n, err)
		}
		if attempt == 1 {
			lag, err := ob.ReadLag(ctx)
			if err != nil || lag.Blocking == nil || lag.Blocking.Attempts != 1 || !strings.Contains(lag.Blocking.LastError, "32814 bytes") {
				t.Fatalf("ReadLag after a refusal = %+v, %v; want the row named, with its error", lag.Blocking, err)
			}
		}
		waitFor(t, "the row's next attempt", func() bool {
			return count(t, db, `SELECT count(*) FROM outbox WHERE retry_at IS NULL OR retry_at <= now()`) == 1
		})
	}
	parked, err := ob.ListParked(ctx, 0)
	if err != nil || len(parked) != 1 {
		t.Fatalf("parked = %+v, %v; want the row", parked, err)
	}

	opts := b.opts.Clone()
	opts.MaxPayload = 64 << 10
	if err := b.srv.ReloadOptions(opts); err != nil {
		t.Fatal(err)
	}
	if err := ob.Unpark(ctx, parked[0].ID); err != nil {
		t.Fatal(err)
	}
	n, err := relay.PublishPending(ctx)
	if n != 0 || !errors.Is(err, postgres.ErrBrokerUnavailable) || errors.Is(err, postgres.ErrRejected) || !strings.Contains(err.Error(), "the server now takes 65536") {
		t.Fatalf("pass once the limit was raised = %d, %v; want the row held, to go again once the client reconnected", n, err)
	}
	waitFor(t, "the row sent", func() bool {
		if nc.MaxPayload() < 64<<10 {
			return false
		}
		n, _ := relay.PublishPending(ctx)
		return n == 1
	})
	if info, err := stream.Info(ctx); err != nil || info.State.Msgs != 1 {
		t.Fatalf("the stream holds %v (%v); want the row", info.State.Msgs, err)
	}
	if got := count(t, db, `SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL OR rejections > 0`); got != 0 {
		t.Errorf("%d rows parked or counted refused once sent", got)
	}
}

// flaky is a Handler whose first delivery of each message fails for a
// reason that may pass (a database that is briefly down), and hands the
// later ones to the warehouse.
type flaky struct {
	warehouse *shop.Warehouse
	mu        sync.Mutex
	calls     map[string]int // deliveries by key
	applied   atomic.Int64
}

func (f *flaky) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	f.mu.Lock()
	f.calls[msg.Key]++
	first := f.calls[msg.Key] == 1
	f.mu.Unlock()
	if first && msg.Payload != `[1]` {
		return false, errors.New("warehouse database briefly unreachable")
	}
	applied, err := f.warehouse.Handle(ctx, msg)
	if applied {
		f.applied.Add(1)
	}
	return applied, err
}

// The consumer asks again, after its RetryDelay, for a message whose
// handling failed for a reason that may pass, and terminates one that can
// never be applied: JetStream reports the termination and delivers it no
// more, and the messages after it are applied.
func TestConsumerRetriesWhatMayPassAndTerminatesWhatCannot(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	nc := connect(t, b.url())
	setUp(t, nc, 0, 0)
	terminated := make(chan *nats.Msg, 1)
	sub, err := nc.ChanSubscribe("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED."+natsbroker.Stream+".warehouse", terminated)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	pub := newPublisher(t, connect(t, b.url()))
	bad := postgres.Message{ID: 1, Type: shop.OrderPlaced, Payload: `[1]`, Key: "bad"}
	good := postgres.Message{ID: 2, Type: shop.OrderPlaced, Payload: `{"orderId":7,"totalCents":2500}`, Key: "good"}
	for _, m := range []postgres.Message{bad, good} {
		if err := pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	h := &flaky{warehouse: shop.NewWarehouse(db), calls: map[string]int{}}
	runConsumer(t, connect(t, b.url()), h)

	select {
	case <-terminated:
	case <-time.After(60 * time.Second):
		t.Fatal("no termination advisory within 60 s for the message that can never be applied")
	}
	waitFor(t, "the good message applied after its retry", func() bool { return h.applied.Load() == 1 })
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.calls["bad"] != 1 || h.calls["good"] != 2 {
		t.Errorf("deliveries = %v, want bad once (terminated) and good twice (failed, then applied)", h.calls)
	}
	if n := count(t, db, `SELECT count(*) FROM reservations WHERE order_id = 7`); n != 1 {
		t.Errorf("%d reservations of order 7, want 1", n)
	}
}
