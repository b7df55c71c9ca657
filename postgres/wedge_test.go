package postgres_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// What once left the log relay stopped for good, session after session.

// insertRow inserts an outbox row of aggregate with headers (raw JSON, or
// "" for none) in tx, and returns its id.
func insertRow(t *testing.T, tx *sql.Tx, aggregate string, seq int64, headers string) int64 {
	t.Helper()
	var id int64
	if err := tx.QueryRow(`INSERT INTO outbox (type, payload, aggregate, seq, headers) VALUES ('Noted', '{}', $1, $2, NULLIF($3, '')::jsonb) RETURNING id`,
		aggregate, seq, headers).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// A transaction holds a row the relay cannot read (U, of cart/X) and a
// readable one (R, of cart/Y) that the broker refuses once, for a reason
// that passes. The first session parks U, then fails on R before the
// server hears it is past the transaction; the next reads U again, finds
// it parked by the session before, and passes over it, holding cart/X
// back: R goes, X2 (cart/X's next row, in a later transaction) is left
// for a polling pass, and Z after it goes. (Caught: the park matched no
// row the second time, and every session failed on U: R never delivered,
// the slot never moving, 45 failed sessions in 8 s.)
func TestLogRelayGoesOnPastARowParkedBeforeItsSessionFailed(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	var refused atomic.Bool
	refuseROnce := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.Aggregate == "cart/Y" && !refused.Swap(true) {
			return fmt.Errorf("the broker is down for a moment: %w", postgres.ErrBrokerUnavailable)
		}
		return broker.Publish(ctx, m)
	})
	var failed atomic.Int64
	relay := logRelayOn(t, db, logConnString(name), name, refuseROnce, postgres.LogRelayConfig{
		OnPass: func(r postgres.PassReport) {
			if r.Err != nil && r.Claimed == 0 && r.Published == 0 && r.Marked == 0 {
				failed.Add(1)
			}
		},
	})
	if _, err := db.Exec(`ALTER TABLE outbox DROP CONSTRAINT outbox_headers_strings`); err != nil {
		t.Fatal(err)
	}
	tx := begin(t, db)
	u := insertRow(t, tx, "cart/X", 1, `{"n": 1}`)
	r := insertRow(t, tx, "cart/Y", 1, "")
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	later := func(aggregate string) int64 {
		tx := begin(t, db)
		id := insertRow(t, tx, aggregate, 2, "")
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		return id
	}
	x2, z := later("cart/X"), later("cart/Z")
	runLog(t, relay)
	waitUntil(t, "Z delivered and marked", func() bool {
		return count(t, db, fmt.Sprintf(`SELECT count(*) FROM outbox WHERE id = %d AND sent_at IS NOT NULL`, z)) == 1
	})
	ids := broker.IDs()
	if !refused.Load() || !slices.Contains(ids, r) || slices.Contains(ids, x2) || slices.Contains(ids, u) {
		t.Errorf("delivered %v; want R (%d) after its refusal, and neither U (%d) nor X2 (%d)", ids, r, u, x2)
	}
	if n := count(t, db, fmt.Sprintf(`SELECT count(*) FROM outbox WHERE id = %d AND parked_at IS NOT NULL`, u)); n != 1 {
		t.Errorf("U not parked")
	}
	if n := count(t, db, fmt.Sprintf(`SELECT count(*) FROM outbox WHERE id = %d AND sent_at IS NULL AND parked_at IS NULL`, x2)); n != 1 {
		t.Errorf("X2 not left unsent, for a polling pass after U")
	}
	t.Logf("sessions failed: %d (the broker's one refusal)", failed.Load())
}

// RecoverSlot, with no slot: Run makes it and publishes the rows written
// before it, but the broker is down, and the recovery fails. It is tried
// again, whole, after the backoff, and not a session on the new slot
// first: once the broker is back the three rows go. The failed recovery
// dropped the slot it made, so a relay started meanwhile would find none
// and recover too. (Caught: the next session streamed from the new slot,
// succeeded, and the rows before it were never published.)
func TestLogRelayTriesAFailedRecoveryAgain(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	before := committedAt(t, db, 3)
	broker := &recorder{}
	broker.SetDown(true)
	recoveryFailed := make(chan struct{})
	var once sync.Once
	relay := logRelayMarkingIn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{
		RecoverSlot: true,
		OnPass: func(r postgres.PassReport) {
			if r.Err != nil && strings.Contains(r.Err.Error(), "recover the slot") {
				once.Do(func() { close(recoveryFailed) })
			}
		},
	})
	t.Cleanup(func() { dropSlot(t, db, name) })
	runLog(t, relay)
	select {
	case <-recoveryFailed:
	case <-time.After(generous):
		t.Fatalf("no recovery failed within %v", generous)
	}
	if n := count(t, db, fmt.Sprintf(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = '%s'`, name)); n != 0 {
		t.Errorf("the failed recovery left its slot: a relay started on it would never publish the rows before it")
	}
	broker.SetDown(false)
	waitUntil(t, "the rows written before the slot published", func() bool { return seenAll(broker, before) })
}

// Parking finds a row by its id and its key, as the marks do: a row the
// log carried (key K1) whose id the table now gives a row of another key
// (K2, as a failover hands ids out again) is not parked, for a refusal nor
// for being unreadable; the relay passes over it, logged at Warn, and the
// row holding the id is left as it is, to be published. (Caught: a park by
// id alone set aside the other key's row.)
func TestLogRelayParksARowByItsIDAndKey(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	refuseFirst := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.Aggregate == "cart/A" {
			return fmt.Errorf("over the broker's limit: %w", postgres.ErrRejected)
		}
		return broker.Publish(ctx, m)
	})
	var logs logBuffer
	relay := logRelayOn(t, db, logConnString(name), name, refuseFirst, postgres.LogRelayConfig{
		ParkAfter: 1, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if _, err := db.Exec(`ALTER TABLE outbox DROP CONSTRAINT outbox_headers_strings`); err != nil {
		t.Fatal(err)
	}
	tx := begin(t, db)
	refusedID := insertRow(t, tx, "cart/A", 1, "")
	unreadableID := insertRow(t, tx, "cart/U", 1, `{"n": 1}`)
	last := insertRow(t, tx, "cart/B", 1, "")
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	// The log holds the rows as written; the table now gives their ids to
	// rows of other keys.
	if _, err := db.Exec(`UPDATE outbox SET message_key = gen_random_uuid() WHERE id IN ($1, $2)`, refusedID, unreadableID); err != nil {
		t.Fatal(err)
	}
	runLog(t, relay)
	waitUntil(t, "the last row delivered", func() bool { return slices.Contains(broker.IDs(), last) })
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL OR rejections > 0`); n != 0 {
		t.Errorf("%d rows of other keys parked or counted refused; want none", n)
	}
	if c := strings.Count(logs.String(), "another row holds its id"); c != 2 {
		t.Errorf("%d log lines say another row holds the id; want 2:\n%s", c, logs.String())
	}
}

// A row the relay cannot read, parked in the session that reads it, holds
// its aggregate back at once: the aggregate's next row, in a later
// transaction of the same session, is left for a polling pass, as behind a
// row parked for the broker's refusals. (Without the hold, X2 went ahead
// of X1; a session started after the park holds it from the table.)
func TestLogRelayHoldsBackTheAggregateOfARowItCannotRead(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	relay := logRelayOn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{})
	if _, err := db.Exec(`ALTER TABLE outbox DROP CONSTRAINT outbox_headers_strings`); err != nil {
		t.Fatal(err)
	}
	runLog(t, relay)
	commit := func(aggregate string, seq int64, headers string) int64 {
		tx := begin(t, db)
		id := insertRow(t, tx, aggregate, seq, headers)
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		return id
	}
	x1 := commit("cart/X", 1, `{"n": 1}`)
	x2 := commit("cart/X", 2, "")
	z := commit("cart/Z", 1, "")
	waitUntil(t, "Z delivered", func() bool { return slices.Contains(broker.IDs(), z) })
	if ids := broker.IDs(); slices.Contains(ids, x2) || slices.Contains(ids, x1) {
		t.Errorf("delivered %v; want neither X1 (%d, parked) nor X2 (%d, behind it)", ids, x1, x2)
	}
}
