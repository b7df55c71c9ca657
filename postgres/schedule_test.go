package postgres_test

// A time to deliver: an event written now that must go out later waits in
// the outbox, out of the claim's way, and holds back its aggregate alone.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// TestAScheduledEventWaitsForItsTimeWhileTheRestFlow runs on both drivers.
// A1 is written for an hour from now, then A2 and B1 without a time: passes
// publish B1 and neither A1 nor A2, which waits behind it; ReadLag counts
// A1 as scheduled, not as lag. Once A1's time has come (the test moves it
// into the past, rather than waiting), ReadLag counts it as lag from that
// time, a pass releases it, and the passes after publish A1, then A2: the
// aggregate's order. A time already passed is written as no time at all,
// and goes with the next pass. (Caught: today's relay before this change,
// which had no time to deliver.)
func TestAScheduledEventWaitsForItsTimeWhileTheRestFlow(t *testing.T) {
	t.Run("pgx", func(t *testing.T) {
		name := newDatabaseName(t)
		ob, err := postgres.Open(newPool(t, name, 4), postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		waitsForItsTime(t, ob, open(t, name, ""))
	})
	t.Run("database/sql", func(t *testing.T) {
		db := newDatabase(t)
		ob, err := postgres.OpenDB(db, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		waitsForItsTime(t, ob, db)
	})
}

func waitsForItsTime[T any](t *testing.T, ob *postgres.Outbox[T], db *sql.DB) {
	ctx := context.Background()
	later := time.Now().Add(time.Hour)
	writeEvent(t, db, postgres.Event{Type: "A", Payload: 1, Aggregate: "a", Seq: 1, DeliverAt: later})
	writeEvent(t, db, postgres.Event{Type: "A", Payload: 2, Aggregate: "a", Seq: 2})
	writeEvent(t, db, postgres.Event{Type: "B", Payload: 3, Aggregate: "b", Seq: 1})
	broker := &recorder{}
	relay := newRelayOn(t, ob, broker)

	for range 3 {
		n, err := relay.PublishPending(ctx)
		t.Logf("pass: published %d, error %v", n, err)
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := broker.IDs(); !slices.Equal(got, []int64{3}) {
		t.Fatalf("before A1's time the passes published %v, want [3] (B1 alone)", got)
	}
	lag, err := ob.ReadLag(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("before its time: %+v", lag)
	if lag.Scheduled != 1 || lag.Unsent != 1 {
		t.Fatalf("before A1's time ReadLag says %+v, want 1 scheduled (A1) and 1 unsent (A2)", lag)
	}

	// A1's time comes: a minute ago.
	if _, err := db.Exec(`UPDATE outbox SET deliver_at = now() - interval '1 minute' WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	if lag, err = ob.ReadLag(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("after its time, before a pass: %+v", lag)
	if lag.Scheduled != 0 || lag.Unsent != 2 || lag.Oldest < time.Minute {
		t.Fatalf("after A1's time ReadLag says %+v, want 2 unsent, the oldest a minute or more", lag)
	}
	for range 3 {
		n, err := relay.PublishPending(ctx)
		t.Logf("pass: published %d, error %v", n, err)
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := broker.IDs(); !slices.Equal(got, []int64{3, 1, 2}) {
		t.Fatalf("the passes published %v, want [3 1 2]: A1 at its time, then A2 behind it", got)
	}

	// A time already passed is none.
	id := writeEvent(t, db, postgres.Event{Type: "C", Payload: 4, DeliverAt: time.Now().Add(-time.Hour)})
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("a pass after an event for an hour ago published %d (want 1), error %v", n, err)
	}
	if got := broker.IDs(); got[len(got)-1] != id {
		t.Fatalf("published %v, want %d last", got, id)
	}
}

// The claim never walks the rows that wait for the future: they are not in
// outbox_unsent, the index it reads, however many there are, and the
// release finds what is due by time. 5,000 rows of as many aggregates
// scheduled for tomorrow leave that index at its two pages (the metapage
// and one leaf); the claim with order per aggregate, release included,
// reads a handful of buffers to find the one unsent row written after them
// (EXPLAIN ANALYZE), where a release or a walk that visited each scheduled
// row would read scores (a scan of the table) or thousands (of an index);
// and a pass takes that row alone. (Caught: a
// claim that filtered on deliver_at in the walk of outbox_unsent; a
// release without outbox_scheduled, which scanned the table: 78 buffers.)
func TestRowsScheduledForLaterCostTheClaimNothing(t *testing.T) {
	db := newDatabase(t)
	if _, err := db.Exec(`INSERT INTO outbox (type, payload, aggregate, seq, deliver_at)
		SELECT 'Later', '{}', 'a' || g, 1, now() + interval '1 day' FROM generate_series(1, 5000) g`); err != nil {
		t.Fatal(err)
	}
	insertPending(t, db, 1)
	if _, err := db.Exec(`VACUUM ANALYZE outbox`); err != nil {
		t.Fatal(err)
	}
	var pages int64
	if err := db.QueryRow(`SELECT pg_relation_size('outbox_unsent') / current_setting('block_size')::int`).Scan(&pages); err != nil {
		t.Fatal(err)
	}
	t.Logf("outbox_unsent with 5,000 rows scheduled and 1 unsent: %d pages", pages)
	if pages > 2 {
		t.Fatalf("outbox_unsent has %d pages: the scheduled rows are in it", pages)
	}
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	var plan string
	err = tx.QueryRow(`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ` + postgres.ClaimRunsQuery).Scan(&plan)
	tx.Rollback()
	if err != nil {
		t.Fatal(err)
	}
	// The release is a WITH that no one reads: its buffers are not in the
	// top node's, but in its own.
	var explained []struct{ Plan planNode }
	if err := json.Unmarshal([]byte(plan), &explained); err != nil || len(explained) != 1 {
		t.Fatalf("the claim's plan: %v", err)
	}
	top := explained[0].Plan
	buffers := top.Hit + top.Read
	for _, p := range top.Plans {
		if strings.HasPrefix(p.Subplan, "CTE ") {
			buffers += p.Hit + p.Read
		}
	}
	t.Logf("the claim with order per aggregate, its release included, read %d buffers", buffers)
	if buffers > 40 {
		t.Fatalf("the claim read %d buffers with 5,000 rows scheduled and 1 unsent: it visits the scheduled rows\n%s", buffers, plan)
	}
	broker := &recorder{}
	relay := newRelay(t, db, broker)
	if n, err := relay.PublishPending(context.Background()); n != 1 || err != nil {
		t.Fatalf("the pass published %d (want 1, the unsent row), error %v", n, err)
	}
	var due int64
	if err := db.QueryRow(`SELECT count(*) FROM outbox WHERE deliver_at IS NOT NULL`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	if due != 5000 {
		t.Fatalf("%d rows still scheduled after a pass, want 5000: one was released before its time", due)
	}
}

// Run publishes a scheduled event soon after its time: the pass that
// releases it commits a notification, as an insert does, and Run passes
// again at once, however long its poll. Run passes twice as it starts (its
// first pass, and one once it listens); then A's time comes and B is
// written, whose notification wakes a pass that publishes B and releases
// A; only the release's notification can wake the pass that publishes A.
// (Caught: a release that notified no one, leaving A to the next poll, an
// hour away.)
func TestRunPublishesAReleasedEventAtOnce(t *testing.T) {
	db := newDatabase(t)
	writeEvent(t, db, postgres.Event{Type: "A", Payload: 1, DeliverAt: time.Now().Add(time.Hour)})
	broker := &recorder{}
	passes := make(chan postgres.PassReport, 100)
	relay := newRelay(t, db, broker, postgres.RelayConfig{PollInterval: time.Hour,
		OnPass: func(p postgres.PassReport) { passes <- p }})
	runRelay(t, relay)
	for i := range 2 {
		select {
		case p := <-passes:
			t.Logf("pass %d as Run starts: %+v", i+1, p)
		case <-time.After(generous):
			t.Fatalf("Run made %d passes as it started, want 2", i)
		}
	}
	if _, err := db.Exec(`UPDATE outbox SET deliver_at = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	insertPending(t, db, 1)
	waitUntil(t, "both events published", func() bool { return len(broker.IDs()) == 2 })
	if got := broker.IDs(); !slices.Equal(got, []int64{2, 1}) {
		t.Fatalf("Run published %v, want [2 1]: B, then A once released", got)
	}
}

// A time to deliver that RFC 3339 cannot write is refused before any
// statement, naming it, and nothing is written.
func TestAnOutOfRangeTimeToDeliverIsRefused(t *testing.T) {
	db := newDatabase(t)
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	_, err = ob.Write(context.Background(), tx, postgres.Event{Type: "A", Payload: 1,
		DeliverAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)})
	t.Logf("the error: %v", err)
	if !errors.Is(err, postgres.ErrInvalidDeliverAt) {
		t.Fatalf("Write with a time in the year 10000: %v, want ErrInvalidDeliverAt", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM outbox`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows after the refusal (%v), want 0", n, err)
	}
}

// writeEvent writes e through Outbox.Write in a transaction of its own and
// returns its id.
func writeEvent(t *testing.T, db *sql.DB, e postgres.Event) int64 {
	t.Helper()
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	id, err := ob.Write(context.Background(), tx, e)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return id
}

// The log relay passes over a row written with a time to deliver: the log
// carries it at its commit, too soon. It delivers the rows around it, marks
// them, and leaves this one scheduled; once its time has come, a polling
// pass releases it and the next publishes it. (Caught: a log relay that
// read no deliver_at and published the row at once.)
func TestLogRelayLeavesAScheduledRowToItsTime(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	relay := logRelayOn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{})
	writeEvent(t, db, postgres.Event{Type: "A", Payload: 1})
	writeEvent(t, db, postgres.Event{Type: "A", Payload: 2, DeliverAt: time.Now().Add(time.Hour)})
	writeEvent(t, db, postgres.Event{Type: "A", Payload: 3})
	runLog(t, relay)
	waitUntil(t, "rows 1 and 3 marked", func() bool {
		var n int
		db.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`).Scan(&n)
		return n == 2
	})
	if got := broker.IDs(); !slices.Equal(got, []int64{1, 3}) {
		t.Fatalf("the log relay published %v, want [1 3]: row 2 waits for its time", got)
	}
	if _, err := db.Exec(`UPDATE outbox SET deliver_at = now() - interval '1 second' WHERE id = 2`); err != nil {
		t.Fatal(err)
	}
	polled := &recorder{}
	relayPolling := newRelay(t, db, polled)
	for range 2 {
		if _, err := relayPolling.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := polled.IDs(); !slices.Equal(got, []int64{2}) {
		t.Fatalf("the polling passes published %v, want [2]", got)
	}
	if got := broker.IDs(); !slices.Equal(got, []int64{1, 3}) {
		t.Fatalf("the log relay published %v, want [1 3]: the release is no insert", got)
	}
}
