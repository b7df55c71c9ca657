package minimum

import (
	"context"
	"errors"
	"testing"
	"time"
)

// Rung 4: OldestUnsent says how long the oldest unsent row has waited:
// zero while the relay keeps up, ten minutes for a row written ten minutes
// ago and never sent, zero again once it is. (On rung 3 nothing says it:
// the test does not build.)
func TestOldestUnsentShowsARelayThatSendsNothing(t *testing.T) {
	ctx := context.Background()
	db := newDB(t)
	down := true
	b := &recorder{fail: func(context.Context, Message) error {
		if down {
			return errors.New("broker down")
		}
		return nil
	}}
	if d, err := OldestUnsent(ctx, db); d != 0 || err != nil {
		t.Fatalf("OldestUnsent of an empty outbox = %v, %v; want 0", d, err)
	}
	if _, err := PlaceOrder(ctx, db, 100); err != nil {
		t.Fatal(err)
	}
	PublishPending(ctx, db, b)
	if _, err := db.Exec(`UPDATE outbox SET created_at = now() - interval '10 minutes'`); err != nil {
		t.Fatal(err)
	}
	if d, err := OldestUnsent(ctx, db); d < 10*time.Minute || err != nil {
		t.Errorf("OldestUnsent with a row unsent for ten minutes = %v, %v", d, err)
	}
	down = false
	PublishPending(ctx, db, b)
	if d, err := OldestUnsent(ctx, db); d != 0 || err != nil {
		t.Errorf("OldestUnsent once the row was sent = %v, %v; want 0", d, err)
	}
}
