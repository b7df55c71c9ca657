package minimum

import (
	"context"
	"testing"
	"time"
)

// PassTimeoutOfRung2 is rung 2's PassTimeout, named apart so that this
// test builds on rung 1 too, and fails there for what it shows.
const PassTimeoutOfRung2 = 5 * time.Second

// Rung 2: a broker that never answers holds a pass for PassTimeout at
// most. The pass returns an error, both rows wait unsent (row 1's mark went
// with the transaction: it is sent again, at least once), and no session is
// left idle in its transaction, holding rows and the table's vacuum. (On
// rung 1 the pass never returns.)
func TestAHungBrokerHoldsAPassForItsTimeoutAtMost(t *testing.T) {
	db := newDB(t)
	for range 2 {
		if _, err := PlaceOrder(context.Background(), db, 100); err != nil {
			t.Fatal(err)
		}
	}
	hung := &recorder{fail: func(ctx context.Context, m Message) error {
		if m.ID == 2 {
			<-ctx.Done() // no answer, ever
			return ctx.Err()
		}
		return nil
	}}
	done := make(chan error, 1)
	go func() {
		_, err := PublishPending(context.Background(), db, hung)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Error("the pass returned no error; want the broker's timeout")
		}
	case <-time.After(6 * PassTimeoutOfRung2):
		t.Fatalf("the pass did not return within %v: a hung broker holds it, its transaction and its rows", 6*PassTimeoutOfRung2)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 2 {
		t.Errorf("%d rows unsent; want both", n)
	}
	if n := count(t, db, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'`); n != 0 {
		t.Errorf("%d sessions idle in a transaction after the pass", n)
	}
}
