package minimum

import (
	"context"
	"errors"
	"testing"
)

// Rung 1: a pass deletes the rows sent more than Retention ago, and never
// one still unsent, however old. (On rung 0 the table keeps every row for
// ever.)
func TestSentRowsPastTheirRetentionAreDeleted(t *testing.T) {
	ctx := context.Background()
	db := newDB(t)
	down := false
	b := &recorder{fail: func(context.Context, Message) error {
		if down {
			return errors.New("broker down")
		}
		return nil
	}}
	for range 3 {
		if _, err := PlaceOrder(ctx, db, 100); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := PublishPending(ctx, db, b); n != 3 || err != nil {
		t.Fatalf("pass = %d, %v; want 3 sent", n, err)
	}
	if _, err := db.Exec(`UPDATE outbox SET sent_at = now() - interval '8 days' WHERE id IN (1, 2)`); err != nil {
		t.Fatal(err)
	}
	down = true
	if _, err := PlaceOrder(ctx, db, 400); err != nil {
		t.Fatal(err)
	}
	PublishPending(ctx, db, b) // row 4 waits, unsent
	if got := count(t, db, `SELECT count(*) FROM outbox WHERE id IN (3, 4)`); got != 2 || count(t, db, `SELECT count(*) FROM outbox`) != 2 {
		t.Errorf("the outbox holds %d rows; want rows 3 (sent a moment ago) and 4 (unsent) alone", count(t, db, `SELECT count(*) FROM outbox`))
	}
}
