package natsbroker_test

// Replay on demand, end to end: a consumer that lost its state asks for an
// aggregate's events again, and applies them.

import (
	"context"
	"errors"
	"testing"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// Three orders go to the warehouse through JetStream. The warehouse then
// loses its state (its reservations and its record of keys and positions).
// A replay of order/2 with its original keys, inside the stream's duplicate
// window, is refused (ErrInDuplicateWindow), and nothing is put back;
// allowed, it says the stream drops its one row, and it does: nothing is
// stored and nothing applied. A replay with new keys is stored, and the warehouse
// applies it: order 2's reservation is back, and no other. (Caught: the
// outbox before Replay, where only parked rows could be put back.)
func TestReplayOfAnAggregateReachesAConsumerThatLostItsState(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, stream := setUp(t, connect(t, b.url()), 0, 0)
	service := shop.NewOrderService(db)
	for _, total := range []int64{100, 200, 300} {
		if _, err := service.PlaceOrder(ctx, total); err != nil {
			t.Fatal(err)
		}
	}
	relay := newRelay(t, db, newPublisher(t, connect(t, b.url())))
	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("pass = %d, %v; want the three orders", n, err)
	}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	goRun(t, newConsumer(t, cons, shop.NewWarehouse(db), natsbroker.ConsumerOptions{}).Run)
	waitFor(t, "three reservations", func() bool { return count(t, db, `SELECT count(*) FROM reservations`) == 3 })

	if _, err := db.Exec(`DELETE FROM reservations; DELETE FROM processed_messages; DELETE FROM aggregate_positions`); err != nil {
		t.Fatal(err)
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	stored := func() uint64 {
		t.Helper()
		info, err := stream.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Msgs
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	window := info.Config.Duplicates
	r := postgres.Replay{Aggregate: shop.OrderAggregate(2), DuplicateWindow: window}
	if res, err := ob.Replay(ctx, r); res.Rows != 0 || !errors.Is(err, postgres.ErrInDuplicateWindow) {
		t.Fatalf("Replay of order/2 inside the stream's %v window = %+v, %v; want it refused with ErrInDuplicateWindow", window, res, err)
	}
	if n, err := relay.PublishPending(ctx); n != 0 || err != nil {
		t.Fatalf("pass after a refused replay = %d, %v; want nothing put back", n, err)
	}
	r.AllowDropped = true
	res, err := ob.Replay(ctx, r)
	if res.Rows != 1 || res.Dropped != 1 || err != nil {
		t.Fatalf("Replay of order/2 allowing it dropped = %+v, %v; want one row, dropped", res, err)
	}
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass after the replay = %d, %v; want the one event", n, err)
	}
	if got := stored(); got != 3 {
		t.Fatalf("the stream holds %d messages after a replay with the old keys, want 3: a duplicate within its window", got)
	}
	if n, err := replayedRows(ob.Replay(ctx, postgres.Replay{Aggregate: shop.OrderAggregate(2), NewKeys: true})); n != 1 || err != nil {
		t.Fatalf("Replay of order/2 with new keys = %d, %v; want its one event", n, err)
	}
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass after the replay = %d, %v; want the one event", n, err)
	}
	waitFor(t, "order 2 reserved again", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations WHERE order_id = 2`) == 1
	})
	if got := stored(); got != 4 {
		t.Errorf("the stream holds %d messages, want 4: the replay with new keys stored", got)
	}
	if n := count(t, db, `SELECT count(*) FROM reservations`); n != 1 {
		t.Errorf("%d reservations after the replay of order/2, want 1", n)
	}
}

// replayedRows is Replay's result as the rows it put back.
func replayedRows(r postgres.ReplayResult, err error) (int64, error) { return r.Rows, err }
