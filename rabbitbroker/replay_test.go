package rabbitbroker_test

// Replay on demand, end to end: a consumer that lost its state asks for an
// aggregate's events again, and applies them.

import (
	"context"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

// Three orders go to the warehouse through RabbitMQ. The warehouse then
// loses its state (its reservations and its record of keys and positions).
// A replay of order/2 with its original keys reaches it (RabbitMQ keeps no
// record of keys) and it applies it: order 2's reservation is back, and no
// other. A second replay of order/2, now that the warehouse remembers the
// key, is a copy it drops. (Caught: the outbox before Replay, where only
// parked rows could be put back.)
func TestReplayOfAnAggregateReachesAConsumerThatLostItsState(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	service := shop.NewOrderService(db)
	for _, total := range []int64{100, 200, 300} {
		if _, err := service.PlaceOrder(ctx, total); err != nil {
			t.Fatal(err)
		}
	}
	relay := newRelay(t, db, newPublisher(t, node.URL(), top, maxMessageSize))
	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("pass = %d, %v; want the three orders", n, err)
	}
	c := newConsumer(t, dialer(node.URL()), top.Queue, shop.NewWarehouse(db), rabbitbroker.ConsumerOptions{})
	goRun(t, c.Run)
	waitFor(t, "three reservations", func() bool { return count(t, db, `SELECT count(*) FROM reservations`) == 3 })

	if _, err := db.Exec(`DELETE FROM reservations; DELETE FROM processed_messages; DELETE FROM aggregate_positions`); err != nil {
		t.Fatal(err)
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	replay := func() {
		t.Helper()
		if n, err := replayedRows(ob.Replay(ctx, postgres.Replay{Aggregate: shop.OrderAggregate(2)})); n != 1 || err != nil {
			t.Fatalf("Replay of order/2 = %d, %v; want its one event", n, err)
		}
		if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
			t.Fatalf("pass after the replay = %d, %v; want the one event", n, err)
		}
	}
	replay()
	waitFor(t, "order 2 reserved again", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations WHERE order_id = 2`) == 1
	})
	replay()
	waitFor(t, "the second replay dropped as a copy", func() bool { return c.Duplicates() == 1 })
	if n := count(t, db, `SELECT count(*) FROM reservations`); n != 1 {
		t.Errorf("%d reservations after two replays of order/2, want 1", n)
	}
}

// replayedRows is Replay's result as the rows it put back.
func replayedRows(r postgres.ReplayResult, err error) (int64, error) { return r.Rows, err }
