package minimum

import (
	"context"
	"fmt"
	"testing"
)

// Rung 6: the broker refuses order 1's OrderPlaced for ever (ErrRejected).
// Order 2 goes at the first pass; order 1's event is parked at its
// ParkAfter-th refusal, and its OrderCancelled waits behind it, unsent and
// not parked, so that the order's events never go out of order. (On rung 5
// nothing tells "never" from "later": the test does not build; the first
// refusal stopped every pass, and order 2 was never sent.)
func TestAMessageThatCanNeverPassIsSetAside(t *testing.T) {
	ctx := context.Background()
	db := newDB(t)
	b := &recorder{fail: func(_ context.Context, m Message) error {
		if m.Aggregate == "order/1" && m.Seq == 1 {
			return fmt.Errorf("payload over the broker's limit: %w", ErrRejected)
		}
		return nil
	}}
	for _, total := range []int64{100, 200} {
		if _, err := PlaceOrder(ctx, db, total); err != nil {
			t.Fatal(err)
		}
	}
	if err := CancelOrder(ctx, db, 1); err != nil {
		t.Fatal(err)
	}
	for range ParkAfter + 1 {
		PublishPending(ctx, db, b)
	}
	if got := b.published(); len(got) != 1 || got[0].Aggregate != "order/2" {
		t.Errorf("published %v; want order 2's event alone", got)
	}
	if n := count(t, db, fmt.Sprintf(`SELECT count(*) FROM outbox WHERE id = 1 AND parked_at IS NOT NULL AND rejections = %d`, ParkAfter)); n != 1 {
		t.Error("order 1's OrderPlaced not parked at its ParkAfter-th refusal")
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE aggregate = 'order/1' AND seq = 2 AND sent_at IS NULL AND parked_at IS NULL`); n != 1 {
		t.Error("order 1's OrderCancelled did not wait behind it")
	}
}
