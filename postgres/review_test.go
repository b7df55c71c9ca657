package postgres_test

// The review's findings (issue 69): each test fails against the code the
// review read, and says how.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"github.com/jackc/pgx/v5/pgconn"
)

// lockWaiters is how many sessions of application app wait for a lock.
func lockWaiters(t *testing.T, db *sql.DB, app string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity
		WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitForLockWaiters waits until n sessions of application app wait for a
// lock, polling with a generous deadline.
func waitForLockWaiters(t *testing.T, db *sql.DB, app string, n int) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("%d sessions of %s waiting for a lock", n, app), func() bool { return lockWaiters(t, db, app) >= n })
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
		stops(t, newRelayOn(t, ob, &recorder{}, cfg))
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
		stops(t, newRelayOn(t, sqlOutbox(t, db, postgres.Config{}), &recorder{}, cfg))
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
	logRelayDeliversTeamEvents(t, name, db)
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

// TestTwoConsumersInOneDatabaseEachApplyEveryMessageOnce: a reservations
// consumer and a mailer, each an Outbox of its own name (Config.Consumer)
// on one database, each apply every message once, one at a time and in
// batches, and each drops a second delivery; forgetting one's keys leaves
// the other's. With one name for both, the second applied 0 of the
// messages (ApplyOnce said false, and the broker was told it was handled).
func TestTwoConsumersInOneDatabaseEachApplyEveryMessageOnce(t *testing.T) {
	ctx := context.Background()
	name := newBlankDatabase(t)
	db := open(t, name, "")
	msgs := []postgres.Message{
		{Key: "k1", Type: "OrderPlaced", Aggregate: "order/1", Seq: 1},
		{Key: "k2", Type: "OrderCancelled", Aggregate: "order/1", Seq: 2},
		{Key: "k3", Type: "OrderPlaced", Aggregate: "order/2", Seq: 1},
		{Key: "k4", Type: "PriceListChanged"},
	}
	consumer := func(name string) *postgres.Outbox[postgres.SQLTx] {
		t.Helper()
		ob, err := postgres.OpenDB(db, postgres.Config{Consumer: name})
		if err != nil {
			t.Fatal(err)
		}
		if ob.Consumer() != name {
			t.Fatalf("Consumer() = %q, want %q", ob.Consumer(), name)
		}
		return ob
	}
	if err := consumer("").Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	nothing := func(context.Context, postgres.SQLTx) error { return nil }
	for _, name := range []string{"reservations", "mailer"} {
		ob := consumer(name)
		for round, want := range []bool{true, false} {
			for _, m := range msgs {
				if applied, err := ob.ApplyOnce(ctx, m, postgres.ApplyOptions{}, nothing); applied != want || err != nil {
					t.Fatalf("%s, delivery %d of %s: applied %v, %v; want %v", name, round+1, m.Key, applied, err, want)
				}
			}
		}
		batch := consumer(name + "-batch")
		for round, want := range []bool{true, false} {
			applied, err := batch.ApplyBatch(ctx, msgs, nil, func(context.Context, postgres.SQLTx, []postgres.Message) error { return nil })
			if err != nil {
				t.Fatal(err)
			}
			for i, a := range applied {
				if a != want {
					t.Fatalf("%s-batch, delivery %d of %s: applied %v; want %v", name, round+1, msgs[i].Key, a, want)
				}
			}
		}
	}
	var keys, positions int
	if err := db.QueryRow(`SELECT (SELECT count(*) FROM processed_messages), (SELECT count(*) FROM aggregate_positions)`).Scan(&keys, &positions); err != nil {
		t.Fatal(err)
	}
	if keys != 16 || positions != 8 {
		t.Fatalf("%d keys and %d positions recorded; want 4 and 2 for each of the four consumers", keys, positions)
	}
	if n, err := consumer("mailer").ForgetProcessed(ctx, 0); n != 4 || err != nil {
		t.Fatalf("the mailer forgot %d records, %v; want its 4 keys (its positions are open)", n, err)
	}
	if applied, err := consumer("reservations").ApplyOnce(ctx, msgs[3], postgres.ApplyOptions{}, nothing); applied || err != nil {
		t.Fatalf("after the mailer forgot its keys, the reservations applied %s again: %v, %v", msgs[3].Key, applied, err)
	}
}

// TestConsumerNamesAreChecked: Open and OpenDB refuse a consumer's name
// that is not letters, digits, '_', '-' and '.', or is longer than 63
// bytes, naming it.
func TestConsumerNamesAreChecked(t *testing.T) {
	db := open(t, newBlankDatabase(t), "")
	for _, name := range []string{"two words", "mailer;", strings.Repeat("m", 64), "ünicode"} {
		_, err := postgres.OpenDB(db, postgres.Config{Consumer: name})
		if !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), "Consumer") {
			t.Errorf("Consumer %q: %v; want ErrInvalidConfig naming Config.Consumer", name, err)
		}
	}
}

// TestAReplayWithNewKeysAppliesAgainOnceThePositionIsForgotten: a consumer
// that applied A1 and A2 drops a replay of A with new keys (its position of
// A is at 2, and it drops any Seq at or below it, whatever the key), as
// Replay.NewKeys now says; once ForgetPosition forgot the position, the
// next such replay is applied, A1 then A2, and a copy of it is dropped. The
// doc used to promise that new keys alone had consumers apply the rows
// again.
func TestAReplayWithNewKeysAppliesAgainOnceThePositionIsForgotten(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertEvents(t, db, "A", "A")
	broker := &recorder{}
	ob := sqlOutbox(t, db, postgres.Config{Consumer: "projections"})
	relay := newRelayOn(t, ob, broker)
	applied := 0
	deliver := func() (fresh []bool) {
		t.Helper()
		before := len(broker.Published())
		drain(t, relay)
		for _, m := range broker.Published()[before:] {
			ok, err := ob.ApplyOnce(ctx, m, postgres.ApplyOptions{}, func(context.Context, postgres.SQLTx) error { applied++; return nil })
			if err != nil {
				t.Fatal(err)
			}
			fresh = append(fresh, ok)
		}
		return fresh
	}
	replay := func() {
		t.Helper()
		if n, err := replayedRows(ob.Replay(ctx, postgres.Replay{Aggregate: "A", NewKeys: true})); n != 2 || err != nil {
			t.Fatalf("replay: %d, %v; want A1 and A2 put back", n, err)
		}
	}
	if got := deliver(); !slices.Equal(got, []bool{true, true}) {
		t.Fatalf("first delivery: applied %v", got)
	}
	replay()
	if got := deliver(); !slices.Equal(got, []bool{false, false}) {
		t.Fatalf("a replay with new keys, the position kept: applied %v; want both dropped (positions)", got)
	}
	if forgot, err := ob.ForgetPosition(ctx, "A"); !forgot || err != nil {
		t.Fatalf("ForgetPosition: %v, %v", forgot, err)
	}
	replay()
	if got := deliver(); !slices.Equal(got, []bool{true, true}) {
		t.Fatalf("a replay with new keys, the position forgotten: applied %v; want both", got)
	}
	if applied != 4 {
		t.Fatalf("applied %d times; want A1 and A2 twice", applied)
	}
	if forgot, err := ob.ForgetPosition(ctx, "B"); forgot || err != nil {
		t.Fatalf("ForgetPosition of an aggregate never seen: %v, %v; want false", forgot, err)
	}
}

// TestDeliveriesUnderDifferentKeysOfOneSeqApplyOnce: a message of A, Seq 2,
// delivered under two keys at once (a replay with new keys meeting the
// original, say), is applied once, by ApplyOnce and by ApplyBatch. The
// first delivery has read and locked A's position and waits to record its
// key (a third transaction holds it); the second then waits for the
// position's row lock, taken as the position is read, and finds it moved.
// (The review's surviving mutations: the position read without FOR UPDATE,
// in lockPosition or lockPositions. The second delivery then read the
// position as it was, and its UPDATE waited only for the first's
// transaction and moved the position again: applied twice. lockPosition's
// INSERT ... ON CONFLICT waits for a transaction that has updated the
// row, so only this window, between the first's read and its update, tells
// the mutation apart.)
func TestDeliveriesUnderDifferentKeysOfOneSeqApplyOnce(t *testing.T) {
	ctx := context.Background()
	name := newBlankDatabase(t)
	check := open(t, name, "")
	ob, err := postgres.OpenDB(open(t, name, "deliveries"), postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, via := range []string{"ApplyOnce", "ApplyBatch"} {
		t.Run(via, func(t *testing.T) {
			aggregate := "account/" + via
			var mu sync.Mutex
			applied := map[string]int{}
			deliver := func(key string, seq int64) (bool, error) {
				m := postgres.Message{Key: key, Type: "Moved", Aggregate: aggregate, Seq: seq}
				effect := func() {
					mu.Lock()
					defer mu.Unlock()
					applied[m.Key]++
				}
				if via == "ApplyOnce" {
					return ob.ApplyOnce(ctx, m, postgres.ApplyOptions{}, func(context.Context, postgres.SQLTx) error { effect(); return nil })
				}
				got, err := ob.ApplyBatch(ctx, []postgres.Message{m}, nil, func(context.Context, postgres.SQLTx, []postgres.Message) error {
					effect()
					return nil
				})
				return len(got) == 1 && got[0], err
			}
			if ok, err := deliver(via+"-1", 1); !ok || err != nil {
				t.Fatalf("Seq 1: %v, %v", ok, err)
			}
			hold, err := check.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer hold.Rollback()
			if _, err := hold.Exec(`INSERT INTO processed_messages (message_key) VALUES ($1)`, via+"-2"); err != nil {
				t.Fatal(err)
			}
			type result struct {
				applied bool
				err     error
			}
			firstDone, secondDone := make(chan result, 1), make(chan result, 1)
			go func() {
				ok, err := deliver(via+"-2", 2)
				firstDone <- result{ok, err}
			}()
			waitForLockWaiters(t, check, "deliveries", 1) // the first, at its key
			go func() {
				ok, err := deliver(via+"-2-again", 2)
				secondDone <- result{ok, err}
			}()
			var second result
			secondIn := false
			waitUntil(t, "the second delivery waiting at the position (or done)", func() bool {
				select {
				case second = <-secondDone:
					secondIn = true
					return true
				default:
					return lockWaiters(t, check, "deliveries") >= 2
				}
			})
			if err := hold.Rollback(); err != nil {
				t.Fatal(err)
			}
			if r := <-firstDone; r.err != nil {
				t.Fatalf("the first delivery of Seq 2: %v", r.err)
			}
			if !secondIn {
				second = <-secondDone
			}
			if r := second; r.applied || r.err != nil || applied[via+"-2"] != 1 {
				t.Fatalf("the second delivery of Seq 2, under another key: %v, %v (the first applied %d times); want a duplicate", r.applied, r.err, applied[via+"-2"])
			}
			if applied[via+"-2"]+applied[via+"-2-again"] != 1 {
				t.Fatalf("applied %v; Seq 2 once", applied)
			}
		})
	}
}

// TestDueScheduledRowsGoOutInTheOrderOfTheirTimes: seven rows of no
// aggregate, each due a millisecond after the one before, all due by the
// first pass, go out in that order through passes of three, the release
// taking the earliest first. (The review's surviving mutation: the release
// ordered the latest first, which no test saw with fewer due rows than a
// batch; it sends 5, 6, 7, 2, 3, 4, 1.)
func TestDueScheduledRowsGoOutInTheOrderOfTheirTimes(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	at := time.Now().Add(time.Second)
	var ids []int64
	for i := range 7 {
		ids = append(ids, writeEvent(t, db, postgres.Event{Type: "Reminded", Payload: map[string]int{"n": i},
			DeliverAt: at.Add(time.Duration(i) * time.Millisecond)}))
	}
	waitUntil(t, "the seven rows due", func() bool {
		var due int
		err := db.QueryRow(`SELECT count(*) FROM outbox WHERE deliver_at <= now()`).Scan(&due)
		return err == nil && due == 7
	})
	broker := &recorder{}
	relay := newRelay(t, db, broker, postgres.RelayConfig{BatchSize: 3, PollOnly: true})
	for range 10 {
		if _, err := relay.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var got []int64
	for _, m := range broker.Published() {
		got = append(got, m.ID)
	}
	if !slices.Equal(got, ids) {
		t.Fatalf("published %v; want %v, the order of their times", got, ids)
	}
}

// TestReplayRefusesWhatCleanupCutWhateverTheTableStillHolds: X1 parked (an
// old row not sent), X2 sent and deleted by DeleteSent, X3 written and sent
// after: a replay from X1's time, and a replay of X, are refused
// (ErrNotKept), since X2 is gone; a replay from X3's time puts X3 back.
// The guard used to compare From with the oldest row the table holds (X1),
// and the aggregate's first seq (1, X1's): both replays returned (1, nil),
// X3 alone, and said nothing of X2.
func TestReplayRefusesWhatCleanupCutWhateverTheTableStillHolds(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	ob := sqlOutbox(t, db, postgres.Config{})
	insertEvents(t, db, "X", "X")
	if _, err := db.Exec(`UPDATE outbox SET parked_at = now() WHERE id = 1; UPDATE outbox SET sent_at = now() WHERE id = 2`); err != nil {
		t.Fatal(err)
	}
	if n, err := ob.DeleteSent(ctx, 0); n != 1 || err != nil {
		t.Fatalf("DeleteSent: %d, %v; want X2 deleted", n, err)
	}
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := postgres.InsertOutboxFor(ctx, tx, "X", 3, "Changed", map[string]int{"seq": 3})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var x1, x3 time.Time
	if err := db.QueryRow(`UPDATE outbox SET sent_at = now() WHERE seq = 3 RETURNING (SELECT created_at FROM outbox WHERE id = 1), created_at`).Scan(&x1, &x3); err != nil {
		t.Fatal(err)
	}
	for _, r := range []postgres.Replay{{From: x1}, {Aggregate: "X"}, {Aggregate: "X", From: x1}} {
		n, err := replayedRows(ob.Replay(ctx, r))
		t.Logf("%s: %d, %v", r, n, err)
		if n != 0 || !errors.Is(err, postgres.ErrNotKept) {
			t.Errorf("Replay of %s: %d, %v; want ErrNotKept, X2 being gone", r, n, err)
		}
	}
	if n, err := replayedRows(ob.Replay(ctx, postgres.Replay{From: x3})); n != 1 || err != nil {
		t.Fatalf("Replay from X3's time: %d, %v; want X3 put back", n, err)
	}
}

// TestMigrationsKeepWhatCameBefore: on a database at the schema before
// migrations, with a key a consumer recorded and rows written, Migrate
// makes the key the default consumer's (ApplyOnce drops its message) and
// records that cleanup may have cut anything written before it, so a
// range replay from before the migration is refused (ErrNotKept).
func TestMigrationsKeepWhatCameBefore(t *testing.T) {
	ctx := context.Background()
	db := atTheSchemaBeforeMigrations(t)
	place(t, db, 100)
	if _, err := db.Exec(`INSERT INTO processed_messages (message_key) VALUES ('applied-before'); UPDATE outbox SET sent_at = now()`); err != nil {
		t.Fatal(err)
	}
	var written time.Time
	if err := db.QueryRow(`SELECT created_at FROM outbox`).Scan(&written); err != nil {
		t.Fatal(err)
	}
	if err := postgres.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	ob := sqlOutbox(t, db, postgres.Config{})
	if applied, err := ob.ApplyOnce(ctx, postgres.Message{Key: "applied-before", Type: "OrderPlaced"}, postgres.ApplyOptions{},
		func(context.Context, postgres.SQLTx) error { return nil }); applied || err != nil {
		t.Fatalf("a key recorded before migration 9: applied %v, %v; want a copy", applied, err)
	}
	if n, err := replayedRows(ob.Replay(ctx, postgres.Replay{From: written})); n != 0 || !errors.Is(err, postgres.ErrNotKept) {
		t.Fatalf("a replay of rows written before migration 10: %d, %v; want ErrNotKept", n, err)
	}
}

// TestLogRelayHoldsAnAggregateBehindItsParkedRow: the broker refuses A1
// for ever, in a transaction with A2 and B1, and A3 and B2 follow. The log
// relay parks A1 and delivers B1 and B2, but leaves A2 and A3 unsent
// behind A1. A1 put back and the relay restarted, its new session leaves
// A4 unsent too (A1 is still to go) and delivers B3; a polling pass sends
// A1 to A4, and the log relay A5 as it comes: A in its order, each once.
// (The log relay used to deliver A2 and A3 at once, ahead of A1, which a
// consumer then took for out of order.)
func TestLogRelayHoldsAnAggregateBehindItsParkedRow(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	var refusing atomic.Bool
	refusing.Store(true)
	refuseA1 := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.Aggregate == "A" && m.Seq == 1 && refusing.Load() {
			return fmt.Errorf("payload over the broker's limit: %w", postgres.ErrRejected)
		}
		return broker.Publish(ctx, m)
	})
	relay := logRelayOn(t, db, logConnString(name), name, refuseA1, postgres.LogRelayConfig{ParkAfter: 1})
	write := func(rows ...any) map[string]int64 {
		t.Helper()
		ids := map[string]int64{}
		if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			for i := 0; i < len(rows); i += 2 {
				a, seq := rows[i].(string), int64(rows[i+1].(int))
				id, err := postgres.InsertOutboxFor(ctx, tx, a, seq, "Changed", map[string]int64{"seq": seq})
				if err != nil {
					return err
				}
				ids[fmt.Sprint(a, seq)] = id
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return ids
	}
	ids := write("A", 1, "A", 2, "B", 1)
	maps.Copy(ids, write("A", 3))
	maps.Copy(ids, write("B", 2))
	stop := runLog(t, relay)
	waitUntil(t, "B1 and B2 delivered", func() bool { return seenAll(broker, map[int64]string{ids["B1"]: "", ids["B2"]: ""}) })
	for _, m := range broker.Published() {
		if m.Aggregate == "A" {
			t.Fatalf("delivered A%d while A1 is parked", m.Seq)
		}
	}
	var parked, unsent int
	if err := db.QueryRow(`SELECT count(*) FILTER (WHERE parked_at IS NOT NULL), count(*) FILTER (WHERE parked_at IS NULL)
		FROM outbox WHERE aggregate = 'A' AND sent_at IS NULL`).Scan(&parked, &unsent); err != nil {
		t.Fatal(err)
	}
	if parked != 1 || unsent != 2 {
		t.Fatalf("A: %d rows parked and %d unsent; want A1 parked, A2 and A3 left unsent behind it", parked, unsent)
	}
	// Put back, and the log relay restarted before a polling pass: the
	// new session holds A back from the start, behind A1 still unsent.
	refusing.Store(false)
	if err := postgres.Unpark(ctx, db, ids["A1"]); err != nil {
		t.Fatal(err)
	}
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Fatalf("the log relay's Run: %v", err)
	}
	runLog(t, relay)
	maps.Copy(ids, write("A", 4))
	maps.Copy(ids, write("B", 3))
	waitUntil(t, "B3 delivered by the second session", func() bool { return seenAll(broker, map[int64]string{ids["B3"]: ""}) })
	for _, m := range broker.Published() {
		if m.Aggregate == "A" {
			t.Fatalf("the second session delivered A%d while A1, put back, waits for a polling pass", m.Seq)
		}
	}
	drain(t, newRelay(t, db, broker, postgres.RelayConfig{PollOnly: true})) // outbox-relay's sweep
	maps.Copy(ids, write("A", 5))
	waitUntil(t, "A5 delivered by the log relay", func() bool { return seenAll(broker, map[int64]string{ids["A5"]: ""}) })
	var seqs []int64
	for _, m := range broker.Published() {
		if m.Aggregate == "A" {
			seqs = append(seqs, m.Seq)
		}
	}
	if !slices.Equal(seqs, []int64{1, 2, 3, 4, 5}) {
		t.Fatalf("A delivered as %v; want 1 to 5, each once", seqs)
	}
}

// TestLogRelayHoldsAnAggregateBehindItsScheduledRow: C1 is scheduled for an
// hour from now; C2 and D1 follow. The log relay delivers D1 and leaves C2
// unsent behind C1, and a session that begins with C1 in the table (a
// restart) holds C back too: C3 is left unsent. (The log relay used to
// deliver C2 and C3 as they came, an hour ahead of C1.)
func TestLogRelayHoldsAnAggregateBehindItsScheduledRow(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	relay := logRelayOn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{})
	writeEvent(t, db, postgres.Event{Type: "Reminded", Payload: map[string]int{"n": 1}, Aggregate: "C", Seq: 1, DeliverAt: time.Now().Add(time.Hour)})
	writeEvent(t, db, postgres.Event{Type: "Reminded", Payload: map[string]int{"n": 2}, Aggregate: "C", Seq: 2})
	d1 := writeEvent(t, db, postgres.Event{Type: "Noted", Payload: map[string]int{"n": 1}, Aggregate: "D", Seq: 1})
	stop := runLog(t, relay)
	waitUntil(t, "D1 delivered", func() bool { return seenAll(broker, map[int64]string{d1: ""}) })
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Fatalf("the log relay's Run: %v", err)
	}
	writeEvent(t, db, postgres.Event{Type: "Reminded", Payload: map[string]int{"n": 3}, Aggregate: "C", Seq: 3})
	d2 := writeEvent(t, db, postgres.Event{Type: "Noted", Payload: map[string]int{"n": 2}, Aggregate: "D", Seq: 2})
	runLog(t, relay)
	waitUntil(t, "D2 delivered by a second session", func() bool { return seenAll(broker, map[int64]string{d2: ""}) })
	for _, m := range broker.Published() {
		if m.Aggregate == "C" {
			t.Fatalf("delivered C%d while C1 waits for its time", m.Seq)
		}
	}
	var unsent int
	if err := db.QueryRow(`SELECT count(*) FROM outbox WHERE aggregate = 'C' AND sent_at IS NULL`).Scan(&unsent); err != nil {
		t.Fatal(err)
	}
	if unsent != 3 {
		t.Fatalf("%d rows of C unsent; want C1 scheduled, C2 and C3 behind it", unsent)
	}
}

// TestHeadersAreReservedByTheirExactNames: the brokers' own headers, and
// the namespaces NATS and CloudEvents keep, are reserved in any case; a
// team's X- headers are not, and Write takes them. (Every x- header used to
// be reserved, so a team's X-Request-Id was refused.)
func TestHeadersAreReservedByTheirExactNames(t *testing.T) {
	for name, want := range map[string]bool{
		"X-Request-Id": false, "x-tenant": false, "X-Correlation-Id": false, "Outbox-Tenant": false, "Tenant": false,
		"x-death": true, "X-Delivery-Count": true, "x-first-death-queue": true, "x-opt-sequence-number": true,
		"Outbox-Id": true, "outbox-seq": true, "Nats-Msg-Id": true, "nats-anything": true,
		"ce-id": true, "ce_type": true, "cloudEvents_source": true, "cloudEvents:id": true,
		"Content-Type": true, "traceparent": true, "TraceState": true,
	} {
		if got := postgres.ReservedHeader(name); got != want {
			t.Errorf("ReservedHeader(%q) = %v, want %v", name, got, want)
		}
	}
	db := newDatabase(t)
	id := writeEvent(t, db, postgres.Event{Type: "Noted", Payload: map[string]int{"n": 1}, Headers: map[string]string{"X-Request-Id": "r-17"}})
	broker := &recorder{}
	if n, err := newRelay(t, db, broker).PublishPending(context.Background()); n != 1 || err != nil {
		t.Fatalf("pass: %d, %v", n, err)
	}
	if m := broker.Published()[0]; m.ID != id || m.Headers["X-Request-Id"] != "r-17" {
		t.Fatalf("published %+v; want row %d with X-Request-Id r-17", m, id)
	}
}
