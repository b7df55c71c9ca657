package minimum

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
)

// Rung 5: an order's events carry their number among its events. The
// broker delivers the order's OrderCancelled before its OrderPlaced (a
// redelivery, another partition): the warehouse refuses it with
// ErrOutOfOrder, applying nothing, applies OrderPlaced, then the cancel
// when it comes again. (On rung 4 nothing tells the two apart: the test
// does not build.)
func TestAnEventBeforeItsPredecessorWaitsForIt(t *testing.T) {
	ctx := context.Background()
	shop, warehouse := newDB(t), newDB(t)
	b := &recorder{}
	id, err := PlaceOrder(ctx, shop, 100)
	if err != nil {
		t.Fatal(err)
	}
	if err := CancelOrder(ctx, shop, id); err != nil {
		t.Fatal(err)
	}
	if n, err := PublishPending(ctx, shop, b); n != 2 || err != nil {
		t.Fatalf("pass = %d, %v; want both events", n, err)
	}
	var applied []string
	apply := func(m Message) func(*sql.Tx) error {
		return func(*sql.Tx) error { applied = append(applied, fmt.Sprint(m.Type, " ", m.Seq)); return nil }
	}
	placed, cancelled := b.published()[0], b.published()[1]
	if ok, err := Consume(ctx, warehouse, cancelled, apply(cancelled)); ok || !errors.Is(err, ErrOutOfOrder) {
		t.Errorf("the cancel first: applied %v, %v; want ErrOutOfOrder", ok, err)
	}
	for _, m := range []Message{placed, cancelled} {
		if ok, err := Consume(ctx, warehouse, m, apply(m)); !ok || err != nil {
			t.Errorf("%s %d: applied %v, %v", m.Type, m.Seq, ok, err)
		}
	}
	if fmt.Sprint(applied) != "[OrderPlaced 1 OrderCancelled 2]" {
		t.Errorf("applied %v; want the order placed, then cancelled", applied)
	}
}
