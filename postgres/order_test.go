package postgres_test

// Order per aggregate: an order's OrderCancelled must never reach the
// warehouse before its OrderPlaced, with four relays and a broker that
// refuses now and then. The producers' lock, the relay's claim and the
// consumer's check, each shown, and each test names what it catches.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// errFlaky is a refusal that may pass: neither unavailable nor rejected.
var errFlaky = errors.New("broker: no acknowledgement in time")

// Four clients each place 50 orders and cancel each one right after placing
// it, while four relays with PerAggregate drain the outbox and the broker
// refuses one message in twenty at random (a fixed seed, logged). For every
// order the broker accepted OrderPlaced before OrderCancelled, and the
// warehouse, fed in the broker's order, applies every message and ends with
// no reservation. (Caught: the whole-table relay, whose four relays'
// batches interleave, and whose refusals stop a batch while the other
// relays' batches go on.)
func TestCancellationNeverOvertakesItsOrder(t *testing.T) {
	const clients, perClient, seed = 4, 50, 21
	t.Logf("seed %d", seed)
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")

	accepted := &recorder{}
	var mu sync.Mutex
	random := rand.New(rand.NewPCG(seed, seed))
	var refusals int
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		mu.Lock()
		refuse := random.IntN(20) == 0
		if refuse {
			refusals++
		}
		mu.Unlock()
		if refuse {
			return errFlaky
		}
		return accepted.Publish(ctx, m)
	})
	for i := range 4 {
		relay := newRelay(t, open(t, name, fmt.Sprintf("relay-%d", i)), broker, postgres.RelayConfig{BatchSize: 3, PollInterval: 10 * time.Millisecond,
			RetryDelay: time.Millisecond, MaxRetryDelay: 10 * time.Millisecond})
		runRelay(t, relay)
	}

	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			service := shop.NewOrderService(db)
			for range perClient {
				id, err := service.PlaceOrder(ctx, 100)
				if err == nil {
					err = service.CancelOrder(ctx, id)
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	const events = 2 * clients * perClient
	waitUntil(t, "every event accepted", func() bool {
		lag, err := postgres.ReadLag(ctx, db)
		return err == nil && lag.Unsent == 0 && len(accepted.Published()) >= events
	})
	t.Logf("the broker refused %d publishes and accepted %d", refusals, len(accepted.Published()))

	placedAt := map[int64]int{} // order id -> index of its first accepted OrderPlaced
	var overtaken []string
	for i, m := range accepted.Published() {
		var order int64
		if _, err := fmt.Sscanf(m.Aggregate, "order/%d", &order); err != nil {
			t.Fatalf("message %d: aggregate %q", m.ID, m.Aggregate)
		}
		switch m.Type {
		case shop.OrderPlaced:
			if _, ok := placedAt[order]; !ok {
				placedAt[order] = i
			}
		case shop.OrderCancelled:
			if _, ok := placedAt[order]; !ok {
				overtaken = append(overtaken, m.Aggregate)
			}
		}
	}
	if len(overtaken) > 0 {
		t.Errorf("%d orders' OrderCancelled reached the broker before their OrderPlaced: %v", len(overtaken), overtaken[:min(5, len(overtaken))])
	}

	warehouse := shop.NewWarehouse(db)
	for _, m := range accepted.Published() {
		if _, err := warehouse.Handle(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	wantReservations(t, db) // every order was cancelled
}

// A message of aggregate A is refused twice, then accepted. No later message
// of A is published in between; the messages of B are. (Caught: the
// whole-table relay, which stops at A's first message and holds B back; and
// a claim without the earlier-row check, which publishes A's second message
// while its first is being retried.)
func TestRefusedMessageHoldsBackOnlyItsAggregate(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertEvents(t, db, "A", "B", "A", "B") // ids 1 to 4: A1, B1, A2, B2
	accepted := &recorder{}
	refusedA1 := 0
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.Aggregate == "A" && m.Seq == 1 && refusedA1 < 2 {
			refusedA1++
			return errFlaky
		}
		return accepted.Publish(ctx, m)
	})
	relay := newRelay(t, db, broker)
	for pass := 1; pass <= 6 && len(accepted.Published()) < 4; pass++ {
		retryNow(t, db) // A1's backoff passed
		n, err := relay.PublishPending(ctx)
		t.Logf("pass %d: published %d, error %v", pass, n, err)
	}
	var got []string
	for _, m := range accepted.Published() {
		got = append(got, fmt.Sprintf("%s%d", m.Aggregate, m.Seq))
	}
	if want := []string{"B1", "B2", "A1", "A2"}; !slices.Equal(got, want) {
		t.Errorf("the broker accepted %v, want %v: B flows while A1 is retried, and A2 waits for A1", got, want)
	}
}

// cancelWithoutLock is WRONG, and exists to show why the producers lock: it
// reads the order's event count with a plain SELECT, writes its event with
// the next seq, and only then updates the order. Two of them at once take
// the same seq, and commit out of id order.
func cancelWithoutLock(t *testing.T, tx *sql.Tx, orderID int64) int64 {
	t.Helper()
	ctx := context.Background()
	var events int64
	if err := tx.QueryRowContext(ctx, `SELECT events FROM orders WHERE id = $1`, orderID).Scan(&events); err != nil {
		t.Fatal(err)
	}
	id, err := postgres.InsertOutboxFor(ctx, tx, shop.OrderAggregate(orderID), events+1, shop.OrderCancelled,
		shop.Order{ID: orderID, TotalCents: 100})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// Without the lock, two changes of one order, A and B, take ids 2 and 3 and
// the same seq, B commits first, and the relay, keeping order per aggregate
// as well as it can, publishes 3 before 2: the warehouse then takes 2, whose
// seq it has applied, for a copy and drops it, and that change is lost for
// good. With CancelOrder's lock the second change waits for the first, finds
// the order cancelled, and writes nothing.
func TestProducersWithoutTheLockCommitOutOfIDOrder(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	id, err := shop.NewOrderService(db).PlaceOrder(ctx, 100) // row 1, seq 1
	if err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	relay := newRelay(t, db, broker)
	pass := func() {
		t.Helper()
		if _, err := relay.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	pass()

	a, b := begin(t, db), begin(t, db)
	rowA, rowB := cancelWithoutLock(t, a, id), cancelWithoutLock(t, b, id)
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	pass()
	if err := a.Commit(); err != nil {
		t.Fatal(err)
	}
	pass()
	msgs := broker.Published()
	t.Logf("without the lock: rows %d and %d, committed %d first; published ids %v, seqs %d, %d, %d",
		rowA, rowB, rowB, broker.IDs(), msgs[0].Seq, msgs[1].Seq, msgs[2].Seq)
	if !slices.Equal(broker.IDs(), []int64{1, 3, 2}) || msgs[1].Seq != msgs[2].Seq {
		t.Errorf("published ids %v, want [1 3 2], the last two with one seq", broker.IDs())
	}
	warehouse := shop.NewWarehouse(newDatabase(t))
	var applied []bool
	for _, m := range msgs {
		ok, err := warehouse.Handle(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		applied = append(applied, ok)
	}
	if !slices.Equal(applied, []bool{true, true, false}) {
		t.Errorf("the warehouse applied %v; want the third dropped, its seq taken", applied)
	}

	// With the lock: two CancelOrder at once, one event.
	db2 := newDatabase(t)
	service := shop.NewOrderService(db2)
	id2, err := service.PlaceOrder(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	results := make([]error, 2)
	for i := range results {
		wg.Go(func() { results[i] = service.CancelOrder(ctx, id2) })
	}
	wg.Wait()
	cancelled := 0
	for _, err := range results {
		switch {
		case err == nil:
			cancelled++
		case !errors.Is(err, shop.ErrOrderCancelled):
			t.Errorf("CancelOrder = %v, want nil or ErrOrderCancelled", err)
		}
	}
	var rows, maxSeq int
	if err := db2.QueryRowContext(ctx, `SELECT count(*), max(seq) FROM outbox`).Scan(&rows, &maxSeq); err != nil {
		t.Fatal(err)
	}
	if cancelled != 1 || rows != 2 || maxSeq != 2 {
		t.Errorf("two CancelOrder at once: %d succeeded, %d outbox rows, last seq %d; want 1, 2, 2", cancelled, rows, maxSeq)
	}
}

// The warehouse refuses an OrderCancelled that arrives before its
// OrderPlaced, changing nothing, and applies it once its predecessor has
// been applied; a duplicate of the predecessor is dropped, by its key, and
// once the key is forgotten by its seq. (Caught: a warehouse without the
// check, which releases nothing, then reserves, and keeps the cancelled
// order's stock; and one that refused a stale copy as out of order for
// ever.)
func TestWarehouseAppliesAnAggregateInSeqOrder(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	warehouse := shop.NewWarehouse(db)
	order := shop.Order{ID: 7, TotalCents: 700}
	placed := postgres.Message{Key: "k-placed", Aggregate: shop.OrderAggregate(7), Seq: 1,
		ID: 1, Type: shop.OrderPlaced, Payload: `{"orderId":7,"totalCents":700}`}
	cancelled := postgres.Message{Key: "k-cancelled", Aggregate: shop.OrderAggregate(7), Seq: 2,
		ID: 2, Type: shop.OrderCancelled, Payload: `{"orderId":7,"totalCents":700}`}

	if ok, err := warehouse.Handle(ctx, cancelled); ok || !errors.Is(err, postgres.ErrOutOfOrder) {
		t.Fatalf("the cancellation first = %v, %v; want refused with ErrOutOfOrder", ok, err)
	}
	var processed int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM processed_messages`).Scan(&processed); err != nil || processed != 0 {
		t.Errorf("after the refusal processed_messages holds %d (%v), want 0", processed, err)
	}
	if ok, err := warehouse.Handle(ctx, placed); !ok || err != nil {
		t.Fatalf("OrderPlaced = %v, %v", ok, err)
	}
	wantReservations(t, db, order)
	if ok, err := warehouse.Handle(ctx, placed); ok || err != nil {
		t.Errorf("a duplicate OrderPlaced = %v, %v; want dropped", ok, err)
	}
	if ok, err := warehouse.Handle(ctx, cancelled); !ok || err != nil {
		t.Fatalf("the cancellation after its order = %v, %v", ok, err)
	}
	wantReservations(t, db)

	// A copy of OrderPlaced that comes after its key was forgotten, or in a
	// replay of the stream, is at or below the position: a duplicate, not a
	// message that waits for ever for a predecessor it already had.
	if _, err := db.ExecContext(ctx, `DELETE FROM processed_messages`); err != nil {
		t.Fatal(err)
	}
	if ok, err := warehouse.Handle(ctx, placed); ok || err != nil {
		t.Errorf("a copy of OrderPlaced after its key was forgotten = %v, %v; want dropped as a duplicate", ok, err)
	}
	wantReservations(t, db)
}

// CancelOrder refuses an order that does not exist or is cancelled already,
// and writes nothing.
func TestCancelOrderRefusesWhatItCannotCancel(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	service := shop.NewOrderService(db)
	if err := service.CancelOrder(ctx, 99); !errors.Is(err, shop.ErrOrderNotFound) {
		t.Errorf("CancelOrder of no order = %v, want ErrOrderNotFound", err)
	}
	id, err := service.PlaceOrder(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if err := service.CancelOrder(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := service.CancelOrder(ctx, id); !errors.Is(err, shop.ErrOrderCancelled) {
		t.Errorf("CancelOrder twice = %v, want ErrOrderCancelled", err)
	}
	wantSent(t, db, false, false) // OrderPlaced and one OrderCancelled
}

// With PerAggregate a parked row still holds back the rest of its aggregate:
// A1 rejected and parked, A2 waits while B goes; once A1 is put back, A1
// then A2. (Caught: a claim that takes the rows behind a held row and
// skips parked rows in its run check, which published A2 while A1 was
// parked.)
func TestParkedRowHoldsBackItsAggregate(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertEvents(t, db, "A", "B", "A") // ids 1 to 3: A1, B1, A2
	accepted := &recorder{}
	rejecting := true // read and written by this goroutine only: the passes run here
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 1 && rejecting {
			return fmt.Errorf("too large: %w", postgres.ErrRejected)
		}
		return accepted.Publish(ctx, m)
	})
	relay := newRelay(t, db, broker, postgres.RelayConfig{ParkAfter: 1})
	for range 3 {
		if _, err := relay.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := accepted.IDs(); !slices.Equal(got, []int64{2}) {
		t.Fatalf("with A1 parked the broker accepted %v, want [2] (B1 alone)", got)
	}
	rejecting = false
	if err := postgres.Unpark(ctx, db, 1); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := relay.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := accepted.IDs(); !slices.Equal(got, []int64{2, 1, 3}) {
		t.Errorf("after Unpark the broker accepted %v, want [2 1 3]", got)
	}
}

// insertEvents writes one "Changed" event for each aggregate named, each in a
// transaction of its own, numbering each aggregate's events from 1.
func insertEvents(t *testing.T, db *sql.DB, aggregates ...string) {
	t.Helper()
	ctx := context.Background()
	seqs := map[string]int64{}
	for _, aggregate := range aggregates {
		seqs[aggregate]++
		seq := seqs[aggregate]
		if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			_, err := postgres.InsertOutboxFor(ctx, tx, aggregate, seq, "Changed", map[string]int64{"seq": seq})
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
}
