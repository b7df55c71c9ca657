package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// markReports keeps what the marks report, for OnPass.
type markReports struct {
	mu  sync.Mutex
	got []postgres.PassReport
}

func (r *markReports) add(p postgres.PassReport) {
	r.mu.Lock()
	r.got = append(r.got, p)
	r.mu.Unlock()
}

func (r *markReports) last() postgres.PassReport {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.got[len(r.got)-1]
}

// The log relay can hear of a row before other sessions see it: the server
// writes the commit to the log before it makes it visible. Here the row's
// transaction is still open when the mark runs, as at that moment: the
// mark finds nothing, the position does not move past the row, and the row
// waits for the next mark, which, once the row is visible, marks it; only
// then does the position move. (Caught: a mark that matched fewer rows
// than it was given and moved the position all the same, leaving the row
// unsent for ever: 101 of 400 delivered rows with the relay process.)
func TestLogMarkTriesAgainARowNotVisibleYet(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	var visible int64
	if err := db.QueryRow(`INSERT INTO outbox (type, payload) VALUES ('OrderPlaced', '{}') RETURNING id`).Scan(&visible); err != nil {
		t.Fatal(err)
	}
	tx := begin(t, db)
	var id int64
	if err := tx.QueryRow(`INSERT INTO outbox (type, payload) VALUES ('OrderPlaced', '{}') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	var reports markReports
	m := postgres.NewMarks(db, time.Minute, nil, reports.add)

	m.Delivered(ctx, "outbox", []int64{visible, id}, 100)
	m.Wait()
	if m.MarkedTo() != 0 || m.Idle() {
		t.Fatalf("after a mark that found row %d not yet visible: marked to %d, idle %v; want 0, not idle", id, m.MarkedTo(), m.Idle())
	}
	if r := reports.last(); r.Marked != 1 || r.Err != nil {
		t.Errorf("the first mark reported %+v; want 1 marked, no error (a row not visible yet is tried again)", r)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`); n != 1 {
		t.Errorf("%d rows marked, want 1 (the visible one)", n)
	}

	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	m.Retry(ctx)
	m.Wait()
	if m.MarkedTo() != 100 || !m.Idle() {
		t.Fatalf("after the row became visible: marked to %d, idle %v; want 100, idle", m.MarkedTo(), m.Idle())
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
		t.Errorf("%d delivered rows still unsent", n)
	}
}

// A mark that fails (here it waits out its timeout on a table another
// session holds locked) leaves the position where it was and its rows
// pending; the next mark, once the lock is gone, marks them, and only then
// does the position move. (Caught: a failed mark that moved the position,
// so that the slot confirmed past rows never marked.)
func TestLogMarkThatFailsIsTriedAgainBeforeThePositionMoves(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	var id int64
	if err := db.QueryRow(`INSERT INTO outbox (type, payload) VALUES ('OrderPlaced', '{}') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	locker := begin(t, db)
	if _, err := locker.Exec(`LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var logs logBuffer
	var reports markReports
	m := postgres.NewMarks(db, 200*time.Millisecond, slog.New(slog.NewTextHandler(&logs, nil)), reports.add)
	m.Delivered(ctx, "outbox", []int64{id}, 200)
	m.Wait()
	if m.MarkedTo() != 0 || m.Idle() || reports.last().Err == nil {
		t.Fatalf("after a failed mark: marked to %d, idle %v, reported %+v; want 0, not idle, the error", m.MarkedTo(), m.Idle(), reports.last())
	}
	if !strings.Contains(logs.String(), "tries again before the slot moves past them") {
		t.Errorf("the failed mark was not logged as one to be tried again: %s", logs.String())
	}
	if err := locker.Rollback(); err != nil {
		t.Fatal(err)
	}
	m.Retry(ctx)
	m.Wait()
	if m.MarkedTo() != 200 || !m.Idle() || reports.last().Marked != 1 || reports.last().Err != nil {
		t.Fatalf("after the lock was gone: marked to %d, idle %v, reported %+v; want 200, idle, 1 marked", m.MarkedTo(), m.Idle(), reports.last())
	}
}

// A delivered row that no mark can find (deleted meanwhile) is given up on
// after MarkRetries marks: logged, reported as ErrNotMarked, and the
// position moves past it, so that one missing row does not hold the slot,
// and the log, for ever.
func TestLogMarkGivesUpOnARowItNeverFinds(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	var logs logBuffer
	var reports markReports
	m := postgres.NewMarks(db, time.Minute, slog.New(slog.NewTextHandler(&logs, nil)), reports.add)
	const gone = 987654
	m.Delivered(ctx, "outbox", []int64{gone}, 300)
	m.Wait()
	for i := 1; i < postgres.MarkRetries; i++ {
		if m.MarkedTo() != 0 || m.Idle() {
			t.Fatalf("after %d marks missed the row: marked to %d, idle %v; want 0, not idle", i, m.MarkedTo(), m.Idle())
		}
		m.Retry(ctx)
		m.Wait()
	}
	if m.MarkedTo() != 300 || !m.Idle() {
		t.Fatalf("after %d marks missed the row: marked to %d, idle %v; want 300, idle", postgres.MarkRetries, m.MarkedTo(), m.Idle())
	}
	if err := reports.last().Err; !errors.Is(err, postgres.ErrNotMarked) || !strings.Contains(err.Error(), "outbox 987654") {
		t.Errorf("the last mark reported %v; want ErrNotMarked naming outbox 987654", err)
	}
	if !strings.Contains(logs.String(), "gave up marking delivered rows") {
		t.Errorf("giving up was not logged: %s", logs.String())
	}
}

// A delivered row whose id another row holds, of another key (a row lost
// with a failover to a standby that lacked it, its id handed out again),
// is not marked: the row holding the id keeps unsent, to be published; the
// mark gives up on the delivered row at once, at Warn, reported as
// ErrNotMarked, and the position moves on. (Caught: a mark by id alone
// marked the new primary's rows sent that no relay published: 34 orders of
// a failover never told.)
func TestLogMarkLeavesARowOfAnotherKeyHoldingTheID(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100)
	var key string
	if err := db.QueryRow(`SELECT message_key::text FROM outbox WHERE id = 1`).Scan(&key); err != nil {
		t.Fatal(err)
	}
	var logs logBuffer
	var reports markReports
	m := postgres.NewMarks(db, time.Minute, slog.New(slog.NewTextHandler(&logs, nil)), reports.add)
	m.DeliveredWithKeys(ctx, "outbox", []int64{1}, []string{"3f9a2c1e-0000-4000-8000-000000000001"}, 300)
	m.Wait()
	if m.MarkedTo() != 300 || !m.Idle() {
		t.Fatalf("after one mark: marked to %d, idle %v; want 300, idle", m.MarkedTo(), m.Idle())
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE id = 1 AND sent_at IS NULL`); n != 1 {
		t.Errorf("the row holding the id was marked sent; want it left unsent")
	}
	if err := reports.last().Err; !errors.Is(err, postgres.ErrNotMarked) || !strings.Contains(err.Error(), "another row holding each id") {
		t.Errorf("the mark reported %v; want ErrNotMarked saying another row holds the id", err)
	}
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "no longer has") {
		t.Errorf("not logged at Warn: %s", logs.String())
	}
	m.DeliveredWithKeys(ctx, "outbox", []int64{1}, []string{key}, 400)
	m.Wait()
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE id = 1 AND sent_at IS NOT NULL`); n != 1 || m.MarkedTo() != 400 {
		t.Errorf("the row delivered with its own key: marked %d, to %d; want it marked", n, m.MarkedTo())
	}
}

// End to end on the real stream: eight clients place 400 orders at once
// while the log relay delivers and marks them. Every row is published and
// every row is marked: ReadLag counts none unsent. With DeleteDelivered,
// every row is deleted: the table is empty, and Replay has nothing to put
// back. (Caught: marks that matched
// fewer rows than they were given, a commit heard of before other sessions
// saw it, and moved on: with the relay process, 101 of 400 delivered rows
// stayed unsent for ever.)
func TestLogRelayMarksEveryRowItDeliversUnderConcurrentClients(t *testing.T) {
	for _, del := range []bool{false, true} {
		t.Run(map[bool]string{false: "marked", true: "deleted"}[del], func(t *testing.T) {
			ctx := context.Background()
			name := newDatabaseName(t)
			db := open(t, name, "")
			broker := &recorder{}
			var logs logBuffer
			relay := logRelayOn(t, open(t, name, "marks"), logConnString(name), name, broker, postgres.LogRelayConfig{
				DeleteDelivered: del,
				Logger:          slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
			stop := runLog(t, relay)
			const clients, each = 8, 50
			service := shop.NewOrderService(db)
			var wg sync.WaitGroup
			for range clients {
				wg.Go(func() {
					for range each {
						if _, err := service.PlaceOrder(ctx, 500); err != nil {
							t.Error(err)
							return
						}
					}
				})
			}
			wg.Wait()
			waitUntil(t, "every row published and marked", func() bool {
				lag, err := postgres.ReadLag(ctx, db)
				if err != nil || lag.Unsent != 0 || len(broker.Published()) < clients*each {
					return false
				}
				return !del || count(t, db, `SELECT count(*) FROM outbox`) == 0
			})
			if err := stop(); !errors.Is(err, context.Canceled) {
				t.Errorf("Run = %v, want context.Canceled", err)
			}
			keys := map[string]bool{}
			for _, m := range broker.Published() {
				keys[m.Key] = true
			}
			if len(keys) != clients*each {
				t.Errorf("%d keys published, want %d", len(keys), clients*each)
			}
			if strings.Contains(logs.String(), "gave up") {
				t.Errorf("the marks gave up on rows: %s", logs.String())
			}
			if del { // nothing kept to put back
				n, err := replayedRows(sqlOutbox(t, db, postgres.Config{}).Replay(ctx, postgres.Replay{From: time.Now().Add(-time.Hour)}))
				if !errors.Is(err, postgres.ErrNotKept) {
					t.Errorf("Replay after the relay deleted what it delivered = %d, %v; want ErrNotKept", n, err)
				}
			}
			t.Logf("marks that found a row not yet visible and tried again: %d", strings.Count(logs.String(), "found fewer rows than it delivered"))
		})
	}
}

// The log relay's mark sets sent_at of the rows it is given that are still
// unsent, and leaves as they are a row parked meanwhile (its sent_at stays
// NULL: a parked row was never published) and a row marked already (its
// sent_at stays the first). A row that does not exist is named, not
// marked.
func TestLogMarkLeavesParkedAndSentRowsAsTheyAre(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	unsentParkedAndSent(t, db, 1)
	var marked int
	var unseen string
	if err := db.QueryRowContext(ctx, postgres.LogMarkQuery, []int64{1, 2, 3, 99}, []string{"", "", "", ""}).Scan(&marked, &unseen, new(string)); err != nil || marked != 1 || unseen != "99" {
		t.Fatalf("mark = %d, %q, %v; want 1, \"99\", <nil>", marked, unseen, err)
	}
	if got, want := rowStates(t, db, 1), "1:sent now, 2:parked, 3:sent before"; got != want {
		t.Errorf("rows after the mark: %s, want %s", got, want)
	}
}

// unsentParkedAndSent writes the rows first (unsent), first+1 (parked,
// never sent) and first+2 (sent in 2000).
func unsentParkedAndSent(t *testing.T, db *sql.DB, first int64) {
	t.Helper()
	if _, err := db.Exec(`INSERT INTO outbox (id, type, payload, parked_at, sent_at) OVERRIDING SYSTEM VALUE VALUES
		($1, 'OrderPlaced', '{}', NULL, NULL),
		($1 + 1, 'OrderPlaced', '{}', now(), NULL),
		($1 + 2, 'OrderPlaced', '{}', NULL, '2000-01-01 00:00:00+00')`, first); err != nil {
		t.Fatal(err)
	}
}

// rowStates is what is left of the rows unsentParkedAndSent wrote from
// first: each id there still is, and unsent, parked (and unsent), sent
// before, or sent now.
func rowStates(t *testing.T, db *sql.DB, first int64) string {
	t.Helper()
	var got string
	if err := db.QueryRow(`SELECT string_agg(id || ':' || CASE
			WHEN parked_at IS NOT NULL AND sent_at IS NULL THEN 'parked'
			WHEN sent_at IS NULL THEN 'unsent'
			WHEN sent_at = '2000-01-01 00:00:00+00' THEN 'sent before'
			ELSE 'sent now' END, ', ' ORDER BY id) FROM outbox WHERE id BETWEEN $1 AND $1 + 2`, first).Scan(&got); err != nil {
		t.Fatal(err)
	}
	return got
}

// xidOf is the 32 bits of the transaction of tx (or, with tx nil, of one
// that commits at once) that pgoutput's BEGIN carries, and a row that
// transaction wrote.
func xidOf(t *testing.T, db *sql.DB, tx *sql.Tx) (id int64, xid uint32) {
	t.Helper()
	const insert = `INSERT INTO outbox (type, payload) VALUES ('OrderPlaced', '{}')
		RETURNING id, pg_current_xact_id()::text::bigint & 4294967295`
	var err error
	if tx != nil {
		err = tx.QueryRow(insert).Scan(&id, &xid)
	} else {
		err = db.QueryRow(insert).Scan(&id, &xid)
	}
	if err != nil {
		t.Fatal(err)
	}
	return id, xid
}

// The mark of a relay with DeleteDelivered deletes the unsent rows it is
// given, leaves a parked row and a row sent already as they are, names a
// row its snapshot does not hold whose transaction it does not see yet, and
// passes over a row that is gone (1098) though its transaction is seen: gone is
// done, for a relay that deletes. (Caught: the delete in logMark's shape,
// which names every missing row, so that a transaction the server sends
// again after a restart is tried MarkRetries times and reported as
// ErrNotMarked.)
func TestLogDeleteTellsARowGoneFromOneNotVisibleYet(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	unsentParkedAndSent(t, db, 1001)
	_, committed := xidOf(t, db, nil)
	tx := begin(t, db)
	notYet, open := xidOf(t, db, tx)
	t.Logf("a committed transaction %d, an open one %d writing row %d", committed, open, notYet)
	ids := []int64{1001, 1002, 1003, 1098, notYet}
	xids := []int64{int64(committed), int64(committed), int64(committed), int64(committed), int64(open)}
	var deleted int
	var unseen string
	if err := db.QueryRowContext(ctx, postgres.LogDeleteQuery, ids, xids, make([]string, len(ids))).Scan(&deleted, &unseen, new(string)); err != nil ||
		deleted != 1 || unseen != strconv.FormatInt(notYet, 10) {
		t.Fatalf("delete = %d, %q, %v; want 1, %q (row 1098 gone, its transaction seen), <nil>", deleted, unseen, err, strconv.FormatInt(notYet, 10))
	}
	if got, want := rowStates(t, db, 1001), "1002:parked, 1003:sent before"; got != want {
		t.Errorf("rows after the delete: %s, want %s", got, want)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, postgres.LogDeleteQuery, []int64{notYet}, []int64{int64(open)}, []string{""}).Scan(&deleted, &unseen, new(string)); err != nil ||
		deleted != 1 || unseen != "" {
		t.Errorf("delete once its transaction committed = %d, %q, %v; want 1, \"\", <nil>", deleted, unseen, err)
	}
}

// The marks of a relay with DeleteDelivered: a delivered row is deleted and
// the position moves; the same transaction sent again (after a restart the
// server sends what it was not told of) moves it at once, with no error and
// no retry; a row not visible yet waits, as a marked one does, and the
// position moves once it is deleted.
func TestLogDeleteMarksPassOverRowsTheyDeletedBefore(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	var logs logBuffer
	var reports markReports
	m := postgres.NewDeletingMarks(db, time.Minute, slog.New(slog.NewTextHandler(&logs, nil)), reports.add)
	id, xid := xidOf(t, db, nil)

	m.DeliveredBy(ctx, "outbox", []int64{id}, xid, 100)
	m.Wait()
	if m.MarkedTo() != 100 || !m.Idle() || reports.last().Marked != 1 || reports.last().Err != nil {
		t.Fatalf("after the first delivery: marked to %d, idle %v, reported %+v; want 100, idle, 1 deleted", m.MarkedTo(), m.Idle(), reports.last())
	}
	m.DeliveredBy(ctx, "outbox", []int64{id}, xid, 200)
	m.Wait()
	if m.MarkedTo() != 200 || !m.Idle() || reports.last().Marked != 0 || reports.last().Err != nil {
		t.Fatalf("after the same row delivered again: marked to %d, idle %v, reported %+v; want 200, idle, none deleted, no error",
			m.MarkedTo(), m.Idle(), reports.last())
	}

	tx := begin(t, db)
	later, open := xidOf(t, db, tx)
	m.DeliveredBy(ctx, "outbox", []int64{later}, open, 300)
	m.Wait()
	if m.MarkedTo() != 200 || m.Idle() {
		t.Fatalf("after a mark that found row %d not yet visible: marked to %d, idle %v; want 200, not idle", later, m.MarkedTo(), m.Idle())
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	m.Retry(ctx)
	m.Wait()
	if m.MarkedTo() != 300 || !m.Idle() || reports.last().Marked != 1 {
		t.Fatalf("after the row became visible: marked to %d, idle %v, reported %+v; want 300, idle, 1 deleted", m.MarkedTo(), m.Idle(), reports.last())
	}
	if n := count(t, db, `SELECT count(*) FROM outbox`); n != 0 {
		t.Errorf("%d delivered rows still in the table", n)
	}
	if strings.Contains(logs.String(), "gave up") {
		t.Errorf("the marks gave up on a row: %s", logs.String())
	}
}

// The 64-bit xid a deleting mark makes of pgoutput's 32 bits is the latest
// below the snapshot's xmax: in its epoch, or in the one before when the
// low bits are above xmax's, as after the counter passed 2^32. (Caught: the
// low bits put in xmax's epoch, past xmax for a transaction of the epoch
// before, which no snapshot sees: its missing rows tried again for ever.)
func TestLogDeleteTakesAnXidInTheRightEpoch(t *testing.T) {
	db := newDatabase(t)
	const epoch = int64(1) << 32
	for _, c := range []struct {
		name      string
		xmax, xid int64
		want      int64
	}{
		{"the first epoch", 1000, 999, 999},
		{"xmax's epoch", 3*epoch + 1000, 990, 3*epoch + 990},
		{"the epoch before", 3*epoch + 5, epoch - 10, 3*epoch - 10},
		{"just below xmax, the counter just wrapped", epoch + 3, 2, epoch + 2},
	} {
		var got int64
		if err := db.QueryRow(postgres.FullXidQuery, c.xmax, c.xid).Scan(&got); err != nil || got != c.want {
			t.Errorf("%s: xmax %d, xid %d: %d, %v; want %d", c.name, c.xmax, c.xid, got, err, c.want)
		}
	}
}

// A log relay with DeleteDelivered that is sent again transactions whose
// rows it deleted (as after a restart, when the server had not heard of
// them) publishes them again and moves on at once: no mark finds a row
// missing, none is given up on, and its slot moves past them all (waited
// for before the stop: a stop in the middle of the last transaction's
// marks sends it again next time, by design). Here a second slot, made before the orders, sends them again once a
// first relay deleted every row: what a restart sends, every time. (Caught:
// marks that name every missing row, which try each such row MarkRetries
// times, about 16 s, hold the slot meanwhile, and end in ErrNotMarked.)
func TestLogRelayThatDeletesMovesOnOverTransactionsSentAgain(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	first := &recorder{}
	firstRelay := logRelayOn(t, db, logConnString(name), name, first, postgres.LogRelayConfig{DeleteDelivered: true})
	again := &recorder{}
	var logs logBuffer
	var reports markReports
	slot := name + "_again"
	againRelay := logRelayOn(t, open(t, name, "again"), logConnString(name), slot, again, postgres.LogRelayConfig{DeleteDelivered: true,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})), OnPass: reports.add})

	const orders = 20
	at := committedAt(t, db, orders-1)
	var before string // the log's end before the last order: a slot past it has passed every order
	if err := db.QueryRow(`SELECT pg_current_wal_insert_lsn()::text`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	for id, lsn := range committedAt(t, db, 1) {
		at[id] = lsn
	}

	stop := runLog(t, firstRelay)
	waitUntil(t, "every row published and deleted by the first relay", func() bool {
		return len(first.Published()) >= orders && count(t, db, `SELECT count(*) FROM outbox`) == 0
	})
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Errorf("the first relay's Run = %v, want context.Canceled", err)
	}

	stop = runLog(t, againRelay)
	waitUntil(t, "every order sent again", func() bool { return len(again.Published()) >= orders })
	// The server hears of the last order once its marks are done: a stop
	// before then sends that transaction again next time, as it should,
	// so the slot's move is waited for, not taken after the stop.
	waitUntil(t, "the slot past the last order", func() bool {
		var past bool
		err := db.QueryRow(`SELECT confirmed_flush_lsn > $1::pg_lsn FROM pg_replication_slots WHERE slot_name = $2`, before, slot).Scan(&past)
		return err == nil && past
	})
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Errorf("the second relay's Run = %v, want context.Canceled", err)
	}
	reports.mu.Lock()
	for _, r := range reports.got {
		if r.Err != nil {
			t.Errorf("the relay reported %v", r.Err)
		}
	}
	reports.mu.Unlock()
	for _, says := range []string{"found fewer rows", "gave up"} {
		if strings.Contains(logs.String(), says) {
			t.Errorf("the marks of rows deleted before logged %q: %s", says, logs.String())
		}
	}
	for id := range at {
		if !slices.Contains(again.IDs(), id) {
			t.Errorf("order %d was not sent again", id)
		}
	}
}
