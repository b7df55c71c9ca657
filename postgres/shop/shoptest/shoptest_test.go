package shoptest_test

import (
	"context"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/postgres/shop/shoptest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// An event the warehouse applied while the delivery that applied it heard
// an error (here: applied past Ordered, straight to the warehouse) is
// counted when its copy comes, once, and the aggregate's next seq follows
// it. (Caught: an Ordered that counted only what a delivery saw applied:
// 159 of 160 in a cluster test whose every key the warehouse held, waiting
// five minutes for an event applied already.) A second copy counts nothing.
func TestOrderedCountsAnApplyItLearnsOfFromACopy(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Open(t, pgtest.NewBlankDatabase(t), "")
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := shop.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	w := shop.NewWarehouse(db)
	msg := func(key string, seq int64) postgres.Message {
		return postgres.Message{Key: key, Type: shop.OrderPlaced, Aggregate: "order/1", Seq: seq, Payload: `{"orderId": 1, "totalCents": 100}`}
	}
	placed := msg("00000000-0000-4000-8000-000000000001", 1)
	if applied, err := w.Handle(ctx, placed); !applied || err != nil {
		t.Fatalf("warehouse = %v, %v; want applied", applied, err)
	}
	h := shoptest.NewOrdered(w)
	for range 2 {
		if applied, err := h.Handle(ctx, placed); applied || err != nil {
			t.Fatalf("copy = %v, %v; want dropped", applied, err)
		}
	}
	other := postgres.Message{Key: "00000000-0000-4000-8000-000000000002", Type: "OrderNoted", Aggregate: "order/1", Seq: 2, Payload: `{}`}
	if applied, err := h.Handle(ctx, other); !applied || err != nil {
		t.Fatalf("seq 2 = %v, %v; want applied", applied, err)
	}
	if h.Applied() != 2 || h.Late() != 1 || len(h.Wrong()) != 0 {
		t.Errorf("applied %d, late %d, wrong %q; want 2, 1, none", h.Applied(), h.Late(), h.Wrong())
	}
}
