package postgres_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"example.com/patterns/enterprise/outbox/postgres"
)

// A team on pgx sends its own statement and the outbox's row in one batch,
// one round trip (Queue): committed, the row is there with its id and the
// relay publishes it; rolled back, neither is; an event Write refuses is
// refused by Queue before anything is queued, and the batch goes on
// without it. (Caught: the outbox's insert a round trip of its own on
// every order, with no way to send it beside the team's.)
func TestQueueSendsTheRowInTheTeamsRoundTrip(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	if _, err := db.Exec(`CREATE TABLE orders_q (id bigint PRIMARY KEY, total_cents bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	conn := connectTo(t, name)
	ob := pgxOutbox(t, newPool(t, name, 2))
	place := func(orderID int64, commit bool) int64 {
		t.Helper()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		b := &pgx.Batch{}
		b.Queue(`INSERT INTO orders_q (id, total_cents) VALUES ($1, 2500)`, orderID)
		if err := ob.Queue(ctx, b, postgres.Event{Type: "bad type", Payload: "{}"}, nil); !errors.Is(err, postgres.ErrInvalidEventType) {
			t.Errorf("Queue of a type with a space = %v; want ErrInvalidEventType", err)
		}
		var id int64
		if err := ob.Queue(ctx, b, postgres.Event{Type: "OrderPlaced", Payload: map[string]int64{"orderId": orderID}}, &id); err != nil {
			t.Fatal(err)
		}
		if b.Len() != 2 {
			t.Errorf("the batch holds %d statements; want the order's and the row's", b.Len())
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		return id
	}
	place(1, false)
	if n := count(t, db, `SELECT count(*) FROM outbox`) + count(t, db, `SELECT count(*) FROM orders_q`); n != 0 {
		t.Fatalf("%d rows after a rollback", n)
	}
	id := place(2, true)
	if id == 0 {
		t.Fatal("Queue set no id")
	}
	broker := &recorder{}
	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass = %d, %v; want the row", n, err)
	}
	if m := broker.Published()[0]; m.ID != id || m.Payload != `{"orderId":2}` {
		t.Errorf("published %+v; want row %d with order 2", m, id)
	}
}
