package postgres_test

// The review's findings (issue 69): each test fails against the code the
// review read, and says how.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"github.com/jackc/pgx/v5/pgconn"
)

// waitForLockWaiters waits until n sessions of application app wait for a
// lock, polling with a generous deadline.
func waitForLockWaiters(t *testing.T, db *sql.DB, app string, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting int
		if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions of %s wait for a lock after 30 s; want %d", waiting, app, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestApplyBatchesOverTheSameKeysInOppositeOrdersNeverDeadlock: two
// batches of the same two keys, given in opposite orders, both wait behind
// a third transaction that holds the first key; when it lets go, each key
// is applied once and neither batch fails. Recorded in the batch's order,
// the second batch held the other key while it waited, and the two then
// deadlocked (40P01) whenever the first won the race for the held key:
// about half the rounds.
func TestApplyBatchesOverTheSameKeysInOppositeOrdersNeverDeadlock(t *testing.T) {
	ctx := context.Background()
	name := newBlankDatabase(t)
	ob, err := postgres.OpenDB(open(t, name, "batch"), postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	check := open(t, name, "")
	for round := range 20 {
		first, second := fmt.Sprintf("r%d-a", round), fmt.Sprintf("r%d-b", round)
		hold, err := check.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := hold.Exec(`INSERT INTO processed_messages (message_key) VALUES ($1)`, first); err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		applied := map[string]int{}
		errs := make(chan error, 2)
		for _, keys := range [][]string{{first, second}, {second, first}} {
			go func() {
				msgs := []postgres.Message{{Key: keys[0], Type: "Noted"}, {Key: keys[1], Type: "Noted"}}
				_, err := ob.ApplyBatch(ctx, msgs, nil, func(_ context.Context, _ postgres.SQLTx, msgs []postgres.Message) error {
					mu.Lock()
					defer mu.Unlock()
					for _, m := range msgs {
						applied[m.Key]++
					}
					return nil
				})
				errs <- err
			}()
		}
		waitForLockWaiters(t, check, "batch", 2)
		if err := hold.Rollback(); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if err := <-errs; err != nil {
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && pgErr.Code == "40P01" {
					t.Fatalf("round %d: a batch deadlocked on its own keys: %v", round, err)
				}
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if applied[first] != 1 || applied[second] != 1 {
			t.Fatalf("round %d: applied %v; want each key once", round, applied)
		}
	}
}

// TestOpenLeavesNoGoroutine: a thousand Opens of one pool leave no
// goroutine behind. Each used to make the *sql.DB the log relay marks
// through, which runs a goroutine until it is closed, and never closed it:
// a goroutine a call. The handle is now made where it is used (a log
// relay's Run, a slot's creation) and closed there.
func TestOpenLeavesNoGoroutine(t *testing.T) {
	p := newPool(t, newBlankDatabase(t), 2)
	before := runtime.NumGoroutine()
	for range 1000 {
		if _, err := postgres.Open(p, postgres.Config{}); err != nil {
			t.Fatal(err)
		}
	}
	if after := runtime.NumGoroutine(); after-before > 50 {
		t.Fatalf("%d goroutines after 1,000 Opens, %d before", after, before)
	}
}

// TestPassStopsWhileItWaitsForAConnection: a pass that waits for a
// connection of a pool whose every connection is taken returns at its
// caller's stop, with the stop's error, on both drivers. It used to wait
// under the transaction's context, which the caller cannot cancel, and
// returned at twice PassTimeout (here a minute) with that context's
// deadline.
func TestPassStopsWhileItWaitsForAConnection(t *testing.T) {
	ctx := context.Background()
	name := newBlankDatabase(t)
	if err := postgres.Migrate(ctx, open(t, name, "")); err != nil {
		t.Fatal(err)
	}
	cfg := postgres.RelayConfig{PassTimeout: 30 * time.Second, PollOnly: true}
	stops := func(t *testing.T, relay *postgres.OutboxRelay) {
		t.Helper()
		stop, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan error, 1)
		go func() {
			_, err := relay.PublishPending(stop)
			done <- err
		}()
		time.AfterFunc(100*time.Millisecond, cancel)
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("the pass returned %v; want its stop's error, context.Canceled", err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("the pass did not return within 20 s of its stop")
		}
	}
	t.Run("pgx", func(t *testing.T) {
		p := newPool(t, name, 2)
		for range 2 {
			held, err := p.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer held.Release()
		}
		ob, err := postgres.Open(p, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		relay, err := ob.NewRelay(&recorder{}, cfg)
		if err != nil {
			t.Fatal(err)
		}
		stops(t, relay)
	})
	t.Run("database/sql", func(t *testing.T) {
		db := open(t, name, "")
		db.SetMaxOpenConns(2)
		for range 2 {
			held, err := db.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer held.Close()
		}
		ob, err := postgres.OpenDB(db, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		relay, err := ob.NewRelay(&recorder{}, cfg)
		if err != nil {
			t.Fatal(err)
		}
		stops(t, relay)
	})
}

// TestLogRelayReadsRowsWhateverTheDatabasesSettings: on a database whose
// settings change pgoutput's text form (bytea_output = escape, DateStyle
// SQL, DMY), the log relay delivers the bytes and the time as written: it
// pins the settings it decodes by. It used to fail every session on the
// bytes ("not in bytea's hex form") and never deliver a row.
func TestLogRelayReadsRowsWhateverTheDatabasesSettings(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	for _, set := range []string{`bytea_output = 'escape'`, `DateStyle = 'SQL, DMY'`} {
		if _, err := db.Exec(`ALTER DATABASE ` + name + ` SET ` + set); err != nil {
			t.Fatal(err)
		}
	}
	broker := &recorder{}
	relay := logRelayOn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{})
	for _, e := range teamEvents {
		writeEvent(t, db, e)
	}
	runLog(t, relay)
	waitUntil(t, "three messages delivered", func() bool { return len(broker.Published()) >= 3 })
	wantTeamEvents(t, broker.Published()[:3])
}

// TestLogRelayParksARowItCannotRead: a row the log relay cannot read (its
// headers are not an object of strings, written past the check migration 8
// adds) is parked, with the reason, and the rows after it are delivered. It
// used to fail every session, and nothing after it was ever delivered.
func TestLogRelayParksARowItCannotRead(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	relay := logRelayOn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{})
	if _, err := db.Exec(`ALTER TABLE outbox DROP CONSTRAINT outbox_headers_strings`); err != nil {
		t.Fatal(err)
	}
	var bad int64
	if err := db.QueryRow(`INSERT INTO outbox (type, payload, headers) VALUES ('Noted', '{}', '{"n": 1}') RETURNING id`).Scan(&bad); err != nil {
		t.Fatal(err)
	}
	good := writeEvent(t, db, postgres.Event{Type: "Noted", Payload: map[string]int{"n": 2}})
	runLog(t, relay)
	waitUntil(t, "the readable row delivered", func() bool { return len(broker.Published()) >= 1 })
	if got := broker.Published(); len(got) != 1 || got[0].ID != good {
		t.Fatalf("delivered %+v; want row %d alone", got, good)
	}
	var parked bool
	var lastError string
	if err := db.QueryRow(`SELECT parked_at IS NOT NULL, COALESCE(last_error, '') FROM outbox WHERE id = $1`, bad).Scan(&parked, &lastError); err != nil {
		t.Fatal(err)
	}
	if !parked || !strings.Contains(lastError, "headers") {
		t.Fatalf("row %d: parked %v, last error %q; want it parked, the error naming its headers", bad, parked, lastError)
	}
}
