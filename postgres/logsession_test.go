package postgres_test

// The log relay's session with the server: what it confirms and when, a
// transaction longer than the server's patience, and a connection that
// goes silent.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// A clean stop right after a burst of deliveries confirms them all: the
// next start sends none of them again. The status interval is an hour, so
// only the prompt report after a delivery and the report at the stop can
// move the slot. (Caught: 20 transactions delivered within 100 ms of the
// last report, reported only at the next interval, and a stop that
// reported nothing: 8 of 20 sent again.)
func TestLogRelayCleanStopSendsNothingAgain(t *testing.T) {
	broker := &recorder{}
	db, relay := newLogRelay(t, broker, postgres.LogRelayConfig{Unmarked: true, StatusInterval: time.Hour})
	stop := runLog(t, relay)
	at := committedAt(t, db, 20)
	waitUntil(t, "the 20 rows published", func() bool { return len(broker.Published()) == 20 })
	stop()
	more := committedAt(t, db, 1)
	runLog(t, relay)
	waitUntil(t, "the row committed while it was stopped", func() bool { return len(broker.Published()) >= 21 })
	var again []int64
	for _, id := range broker.IDs()[20:] {
		if _, delivered := at[id]; delivered {
			again = append(again, id)
		}
	}
	if len(again) > 0 {
		t.Errorf("after a clean stop the relay sent again %v, which it had delivered", again)
	}
	for id := range more {
		if !slices.Contains(broker.IDs(), id) {
			t.Errorf("row %d, committed while it was stopped, was not published", id)
		}
	}
}

// A transaction that takes longer to publish than the server's
// wal_sender_timeout (30 rows at 100 ms each, a timeout of 1 s, on a server
// of the test's own) is delivered whole, each row once, and the next
// transaction after it: the relay reports to the server while it
// publishes. (Caught: a relay silent while it published, whose session the
// server ended at 1 s, the transaction sent again from its first row,
// timing out again, for ever.)
func TestLogRelayDeliversATransactionLongerThanTheServersTimeout(t *testing.T) {
	ctx := context.Background()
	srv := startOwnServer(t, "-c", "wal_sender_timeout=1s")
	db := srv.open(t)
	if err := postgres.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	relay := logRelayOn(t, db, srv.ConnString(), "outbox", slowBroker(broker, 100*time.Millisecond), unmarked)
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		for i := range 30 {
			if _, err := postgres.InsertOutbox(ctx, tx, "ItemPicked", map[string]int{"item": i + 1}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := postgres.InsertOutbox(ctx, tx, "PickingDone", map[string]int{"items": 30})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	runLog(t, relay)
	waitUntil(t, "both transactions delivered", func() bool {
		return slices.Contains(broker.IDs(), 31)
	})
	count := map[int64]int{}
	for _, id := range broker.IDs() {
		count[id]++
	}
	for id := int64(1); id <= 31; id++ {
		if count[id] != 1 {
			t.Errorf("row %d published %d times, want once", id, count[id])
		}
	}
}

// A connection that goes silent (the path frozen in a proxy: no data, no
// FIN, either way) is given up once the server has not answered a status
// update within ReplyTimeout, and the relay says so; it does not wait for
// TCP to give up. (Caught: a relay that waited on a dead connection for as
// long as TCP takes, about 15 minutes.)
func TestLogRelayGivesUpASilentConnection(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	p := startProxy(t)
	port := p.ln.Addr().(*net.TCPAddr).Port
	broker := &recorder{}
	logs := &logBuffer{}
	relay := logRelayOn(t, db, fmt.Sprintf("host=127.0.0.1 port=%d user=%s dbname=%s sslmode=disable", port, pgtest.Config.User, name), name, broker,
		postgres.LogRelayConfig{Unmarked: true, StatusInterval: 200 * time.Millisecond, ReplyTimeout: 500 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	runLog(t, relay)
	if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 100); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the first row published", func() bool { return len(broker.Published()) == 1 })
	p.freeze()
	waitUntil(t, "the relay to give up the silent connection", func() bool {
		return strings.Contains(logs.String(), "did not answer a status update within 500ms")
	})
	// The server's side of the frozen connection waits for its own
	// timeout: end it, so that the slot is free to drop.
	if _, err := db.Exec(`SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active`, name); err != nil {
		t.Fatal(err)
	}
}

// DropLogSlot drops a slot no relay reads, changes nothing when there is
// none, and refuses, keeping it, a slot a relay is reading.
func TestDropLogSlotDropsOnlyASlotNoRelayReads(t *testing.T) {
	ctx := context.Background()
	broker := &recorder{}
	db, relay := newLogRelay(t, broker, unmarked)
	stop := runLog(t, relay)
	waitUntil(t, "the relay reading its slot", func() bool {
		var active bool
		db.QueryRow(`SELECT active FROM pg_replication_slots WHERE slot_name = $1`, relay.Config().Slot).Scan(&active)
		return active
	})
	if err := postgres.DropLogSlot(ctx, db, relay.Config().Slot); !errors.Is(err, postgres.ErrSlotActive) {
		t.Errorf("DropLogSlot of the slot a relay reads = %v, want ErrSlotActive", err)
	}
	stop()
	waitUntil(t, "the slot free", func() bool {
		var active bool
		db.QueryRow(`SELECT active FROM pg_replication_slots WHERE slot_name = $1`, relay.Config().Slot).Scan(&active)
		return !active
	})
	for range 2 { // the second finds none, and changes nothing
		if err := postgres.DropLogSlot(ctx, db, relay.Config().Slot); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, relay.Config().Slot).Scan(&n); err != nil || n != 0 {
		t.Errorf("%d slots named %s left (%v), want none", n, relay.Config().Slot, err)
	}
}

// A log relay configured by pgx's own connection configuration (where TLS
// or a dialer would be set) streams as one made from a connection string.
func TestLogRelayFromAConnectionConfig(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	if err := postgres.CreateLogSlot(ctx, db, name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dropSlot(t, db, name) })
	cfg, err := pgconn.ParseConfig(logConnString(name))
	if err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	relay, err := sqlOutbox(t, db, postgres.Config{}).NewLogRelayConfig(cfg, broker, postgres.LogRelayConfig{Slot: name, Unmarked: true})
	if err != nil {
		t.Fatal(err)
	}
	runLog(t, relay)
	if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 100); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the row published", func() bool { return len(broker.Published()) == 1 })
	if cfg.RuntimeParams["replication"] != "" {
		t.Errorf("NewLogRelayConfig changed the caller's configuration: replication = %q", cfg.RuntimeParams["replication"])
	}
}

// Marking, what the log relay delivered is neither lag nor kept for
// ever: ReadLag counts no row once all are delivered, and DeleteSent
// removes them; a row not yet delivered (the broker refusing it) stays
// unsent and is never deleted. (Caught: the log relay marking nothing,
// "Unsent: 20" for ever after 20 rows were delivered, DeleteSent
// removing none.)
func TestLogRelayRowsDeliveredAreNotLagAndAreCleanedUp(t *testing.T) {
	ctx := context.Background()
	var refuseFrom, refused atomic.Int64 // ids from refuseFrom on are refused; 0: none
	broker := &recorder{}
	gate := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if from := refuseFrom.Load(); from != 0 && m.ID >= from {
			refused.Add(1)
			return fmt.Errorf("broker down: %w", postgres.ErrBrokerUnavailable)
		}
		return broker.Publish(ctx, m)
	})
	db, relay := newLogRelay(t, gate, postgres.LogRelayConfig{})
	runLog(t, relay)
	committedAt(t, db, 20)
	waitUntil(t, "the 20 rows published and marked", func() bool {
		lag, err := postgres.ReadLag(ctx, db)
		return err == nil && len(broker.Published()) == 20 && lag.Unsent == 0
	})
	refuseFrom.Store(21)
	committedAt(t, db, 1) // row 21, which the broker refuses
	waitUntil(t, "row 21 tried and refused", func() bool { return refused.Load() > 0 })
	if n, err := sqlOutbox(t, db, postgres.Config{}).DeleteSent(ctx, 0); n != 20 || err != nil {
		t.Errorf("DeleteSent = %d, %v; want the 20 delivered rows", n, err)
	}
	if lag, err := postgres.ReadLag(ctx, db); err != nil || lag.Unsent != 1 {
		t.Errorf("ReadLag = %+v, %v; want row 21 alone unsent", lag, err)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE id = 21`); n != 1 {
		t.Error("row 21, never delivered, was deleted")
	}
}

// Recovery after the slot is lost: the log relay delivered and marked 30
// rows, then stopped; 10 more were committed; the log they were in passed
// max_slot_wal_keep_size, and Run stops with ErrSlotLost. RecoverLogSlot
// makes the slot anew and publishes the 10 unmarked rows, none of the 30;
// the log relay then streams what comes after. Every committed row arrives.
// Then the slot is dropped (as on a promoted standby with none), Run stops
// with ErrNoSlot, and the same recovery delivers what was committed
// meanwhile. (Caught: nothing recovered it: the README's "republish from
// the table" was a sentence.)
func TestLogRelayRecoversALostSlot(t *testing.T) {
	ctx := context.Background()
	srv := startOwnServer(t, "-c", "max_slot_wal_keep_size=1MB")
	db := srv.open(t)
	if err := errors.Join(postgres.Migrate(ctx, db), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	relay := logRelayOn(t, db, srv.ConnString(), "outbox", broker, postgres.LogRelayConfig{MaxBackoff: time.Hour}) // Run returns at a lost slot
	stop := runLog(t, relay)
	all := committedAt(t, db, 30)
	waitUntil(t, "the 30 rows delivered and marked", func() bool { return count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0 })
	stop()
	missed := committedAt(t, db, 10)
	for range 4 { // past the limit: new segments, and a checkpoint that removes the old ones
		if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS filler (b text); INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 2000);
			SELECT pg_switch_wal(); CHECKPOINT`); err != nil {
			t.Fatal(err)
		}
	}
	if err := relay.Run(ctx); !errors.Is(err, postgres.ErrSlotLost) {
		t.Fatalf("Run on the lost slot = %v, want ErrSlotLost", err)
	}
	before := len(broker.Published())
	n, err := sqlOutbox(t, db, postgres.Config{}).RecoverLogSlot(ctx, broker)
	if err != nil || n != 10 {
		t.Fatalf("RecoverLogSlot = %d, %v; want the 10 rows the lost log held", n, err)
	}
	for _, id := range broker.IDs()[before:] {
		if _, old := missed[id]; !old {
			t.Errorf("recovery published row %d, which the log relay had delivered", id)
		}
	}
	stop = runLog(t, relay)
	after := committedAt(t, db, 5)
	waitUntil(t, "the rows committed after the recovery streamed", func() bool { return seenAll(broker, after) })
	stop()

	// No slot at all, as on a promoted standby.
	waitUntil(t, "the slot free", func() bool {
		return !errors.Is(postgres.DropLogSlot(ctx, db, "outbox"), postgres.ErrSlotActive)
	})
	meanwhile := committedAt(t, db, 3)
	if err := relay.Run(ctx); !errors.Is(err, postgres.ErrNoSlot) {
		t.Fatalf("Run without its slot = %v, want ErrNoSlot", err)
	}
	if _, err := sqlOutbox(t, db, postgres.Config{}).RecoverLogSlot(ctx, broker); err != nil {
		t.Fatal(err)
	}
	for _, rows := range []map[int64]string{all, missed, after, meanwhile} {
		if !seenAll(broker, rows) {
			t.Errorf("rows %v not all published", rows)
		}
	}
}

// seenAll reports whether broker got every row of rows.
func seenAll(broker *recorder, rows map[int64]string) bool {
	got := broker.IDs()
	for id := range rows {
		if !slices.Contains(got, id) {
			return false
		}
	}
	return true
}

// A message the broker can never take, in the middle of a transaction:
// marking, with ParkAfter 2, its second refusal parks it, the rest of
// its transaction and the transactions after it are delivered, and
// ListParked shows it. The transaction before it is not sent again, and
// the refused row is tried twice, not in a loop. (Caught: the transaction
// before it sent again and again, the row after it never delivered,
// nothing parked.)
func TestLogRelayParksWhatTheBrokerCanNeverTake(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	var tries atomic.Int64
	refuse2 := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 2 {
			tries.Add(1)
			return fmt.Errorf("payload over the broker's limit: %w", postgres.ErrRejected)
		}
		return broker.Publish(ctx, m)
	})
	relay := logRelayOn(t, db, logConnString(name), name, refuse2, postgres.LogRelayConfig{ParkAfter: 2})
	insert := func(n int) {
		t.Helper()
		if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			for range n {
				if _, err := postgres.InsertOutbox(ctx, tx, "ItemPicked", map[string]int{"item": 1}); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	insert(1) // row 1
	insert(2) // rows 2 and 3: the broker refuses 2
	insert(1) // row 4
	runLog(t, relay)
	waitUntil(t, "rows 1, 3 and 4 delivered", func() bool { return seenAll(broker, map[int64]string{1: "", 3: "", 4: ""}) })
	count := map[int64]int{}
	for _, id := range broker.IDs() {
		count[id]++
	}
	if count[1] != 1 || count[3] != 1 || count[4] != 1 {
		t.Errorf("publishes by id: %v; want 1, 3 and 4 once each", count)
	}
	if n := tries.Load(); n != 2 {
		t.Errorf("row 2 tried %d times, want 2: parked at its second refusal", n)
	}
	parked, err := postgres.ListParked(ctx, db, 0)
	if err != nil || len(parked) != 1 || parked[0].ID != 2 || parked[0].Rejections != 2 || !strings.Contains(parked[0].LastError, "over the broker's limit") {
		t.Errorf("ListParked = %+v, %v; want row 2 after 2 rejections, with the broker's error", parked, err)
	}
}

// batchRecorder is a BatchPublisher, safe for concurrent use, that keeps
// each PublishBatch call's messages, accepting them in order up to the
// first that refuse refuses. Publish fails the test's expectations: with
// a BatchPublisher the relay publishes batches (one message alone goes
// through Publish, which it records as a batch of one).
type batchRecorder struct {
	mu     sync.Mutex
	refuse func(postgres.Message) error // nil: accepts everything
	calls  [][]postgres.Message
}

func (b *batchRecorder) Publish(ctx context.Context, m postgres.Message) error {
	_, err := b.PublishBatch(ctx, []postgres.Message{m})
	return err
}

func (b *batchRecorder) PublishBatch(_ context.Context, msgs []postgres.Message) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls = append(b.calls, slices.Clone(msgs))
	for i, m := range msgs {
		if b.refuse != nil {
			if err := b.refuse(m); err != nil {
				return i, err
			}
		}
	}
	return len(msgs), nil
}

// batches is each call's ids.
func (b *batchRecorder) batches() [][]int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out [][]int64
	for _, call := range b.calls {
		var ids []int64
		for _, m := range call {
			ids = append(ids, m.ID)
		}
		out = append(out, ids)
	}
	return out
}

// Through a BatchPublisher the log relay publishes a transaction's rows in
// batches, in order: 150 rows with no aggregate go as 100 and 50; rows of
// aggregates a, b, a, c go as [a b] and [a c], since a batch holds no
// aggregate twice (the broker may store a message after one it refused).
// A refused row in the middle of a batch is parked (ParkAfter 1), and the
// rows after it go on. (Caught: a log relay that never used PublishBatch,
// one message and one ack after another.)
func TestLogRelayPublishesATransactionInBatches(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &batchRecorder{refuse: func(m postgres.Message) error {
		if m.ID == 156 {
			return fmt.Errorf("payload over the broker's limit: %w", postgres.ErrRejected)
		}
		return nil
	}}
	relay := logRelayOn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{ParkAfter: 1})
	insert := func(rows func(ctx context.Context, tx *sql.Tx) error) {
		t.Helper()
		if err := postgres.Transaction(ctx, db, rows); err != nil {
			t.Fatal(err)
		}
	}
	insert(func(ctx context.Context, tx *sql.Tx) error { return insertItems(ctx, tx, 150) }) // rows 1-150
	insert(func(ctx context.Context, tx *sql.Tx) error { return insertABAC(ctx, tx) })       // rows 151-154
	insert(func(ctx context.Context, tx *sql.Tx) error { return insertItems(ctx, tx, 3) })   // rows 155-157: the broker refuses 156
	runLog(t, relay)
	waitUntil(t, "every row marked but 156, parked", func() bool {
		return count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL AND parked_at IS NULL`) == 0
	})
	var sizes []int
	var order []int64
	for _, call := range broker.batches() {
		sizes = append(sizes, len(call))
		order = append(order, call...)
	}
	if want := []int{100, 50, 2, 2, 3, 1}; !slices.Equal(sizes, want) {
		t.Errorf("batch sizes %v, want %v", sizes, want)
	}
	want := []int64{}
	for id := int64(1); id <= 157; id++ {
		want = append(want, id)
	}
	want = append(want, 157) // sent after the refused 156 in its batch, and again
	if !slices.Equal(order, want) {
		t.Errorf("published in the order %v, want 1 to 157 in order, and 157 again", order)
	}
	parked, err := postgres.ListParked(ctx, db, 0)
	if err != nil || len(parked) != 1 || parked[0].ID != 156 {
		t.Errorf("ListParked = %+v, %v; want row 156", parked, err)
	}
}

// Marking, the log relay marks beside the stream: while its marks
// cannot be written (the marks' database has no connection to give), it
// goes on publishing, and the server is never told of a transaction whose
// rows are not marked, so that a crash then cannot leave a delivered row
// counted as unsent for ever. Once the marks go through, the rows are
// marked and the slot moves on. (Caught: marks written in the stream, one
// a transaction, which a slow mark held up, and which under 8 producers
// delivered 570 transactions a second of the 2,358 committed; and a
// relay that tells the server before its marks are written.)
func TestLogRelayMarksBesideTheStream(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	marks := open(t, name, "marks")
	marks.SetMaxOpenConns(1)
	held, err := marks.Conn(ctx) // the marks' one connection: no mark can be written
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if err := postgres.CreateLogSlot(ctx, db, name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dropSlot(t, db, name) })
	// A mark waits for its connection, not for a deadline.
	relay := logRelayMarkingIn(t, marks, logConnString(name), name, broker, postgres.LogRelayConfig{PublishTimeout: time.Minute})
	stop := runLog(t, relay)
	rows := committedAt(t, db, 4)
	waitUntil(t, "the 4 rows published while no mark can be written", func() bool { return len(broker.Published()) == 4 })

	// Two status updates after the last delivery have reached the server.
	confirmed := func() (lsn string, replied time.Time) {
		t.Helper()
		err := db.QueryRow(`SELECT s.confirmed_flush_lsn::text, COALESCE(r.reply_time, 'epoch')
			FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
			WHERE s.slot_name = $1`, name).Scan(&lsn, &replied)
		if err != nil {
			t.Fatal(err)
		}
		return lsn, replied
	}
	for range 2 {
		since := time.Now()
		waitUntil(t, "a status update", func() bool { _, at := confirmed(); return at.After(since) })
	}
	ids := slices.Sorted(maps.Keys(rows))
	lsn, _ := confirmed()
	var past bool
	if err := db.QueryRow(`SELECT $1::pg_lsn >= $2::pg_lsn`, lsn, rows[ids[0]]).Scan(&past); err != nil {
		t.Fatal(err)
	}
	if past {
		t.Errorf("the slot confirmed %s, past the first transaction (%s), whose row is not marked", lsn, rows[ids[0]])
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`); n != 0 {
		t.Fatalf("%d rows marked with no connection to mark them", n)
	}

	held.Close()
	waitUntil(t, "the 4 rows marked and the slot past the third", func() bool {
		lsn, _ := confirmed()
		var past bool
		return count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0 &&
			db.QueryRow(`SELECT $1::pg_lsn >= $2::pg_lsn`, lsn, rows[ids[2]]).Scan(&past) == nil && past
	})
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
	if n := len(broker.Published()); n != 4 {
		t.Errorf("%d publishes, want 4", n)
	}
}

// The relay answers the server's requests for a reply at once, not only at
// its own interval: the interval is set from wal_sender_timeout as the
// session starts, and an operator may lower the timeout while it runs.
// With an interval of 30 s (half the default timeout), the timeout lowered
// to 2 s and the server's configuration reloaded: the server asks for a
// reply every second, and the same session (one walsender process)
// answers five of them. (Caught: the request ignored, which the server
// ended the session for after 2 s.)
func TestLogRelayAnswersTheServersRequestForAReply(t *testing.T) {
	ctx := context.Background()
	srv := startOwnServer(t)
	db := srv.open(t)
	if err := postgres.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	relay := logRelayOn(t, db, srv.ConnString(), "outbox", &recorder{}, postgres.LogRelayConfig{Unmarked: true, StatusInterval: time.Hour, ReplyTimeout: time.Hour})
	runLog(t, relay)
	walsender := func() (pid int, replied time.Time) {
		t.Helper()
		err := db.QueryRow(`SELECT COALESCE(r.pid, 0), COALESCE(r.reply_time, 'epoch')
			FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
			WHERE s.slot_name = 'outbox'`).Scan(&pid, &replied)
		if err != nil {
			t.Fatal(err)
		}
		return pid, replied
	}
	var pid int
	waitUntil(t, "the relay streaming", func() bool { pid, _ = walsender(); return pid != 0 })
	for _, q := range []string{`ALTER SYSTEM SET wal_sender_timeout = '2s'`, `SELECT pg_reload_conf()`} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	_, last := walsender()
	for i := range 5 {
		waitUntil(t, fmt.Sprintf("answer %d to the server", i+1), func() bool {
			now, replied := walsender()
			if now != pid {
				t.Fatalf("the walsender changed from %d to %d: the server ended the session for want of a reply", pid, now)
			}
			if replied.After(last) {
				last = replied
				return true
			}
			return false
		})
	}
}

// sequenceRecorder offers the log relay Publish and PublishSequence alone,
// recording each call as batchRecorder does.
type sequenceRecorder struct{ b *batchRecorder }

func (s sequenceRecorder) Publish(ctx context.Context, m postgres.Message) error {
	return s.b.Publish(ctx, m)
}

func (s sequenceRecorder) PublishSequence(ctx context.Context, msgs []postgres.Message) (int, error) {
	return s.b.PublishBatch(ctx, msgs)
}

// Through a SequencePublisher, which stores nothing after a message it did
// not store, the log relay sends a transaction's rows in batches of up to
// 100 whatever their aggregates: 150 rows as 100 and 50, rows of
// aggregates a, b, a, c as one batch of four. (Caught: a log relay that
// sends a SequencePublisher one message at a time, as it does a broker with
// Publish alone: 154 calls of one.)
func TestLogRelaySendsASequencePublisherWholeTransactions(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &batchRecorder{}
	relay := logRelayOn(t, db, logConnString(name), name, sequenceRecorder{broker}, postgres.LogRelayConfig{})
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error { return insertItems(ctx, tx, 150) }); err != nil {
		t.Fatal(err) // rows 1-150
	}
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error { return insertABAC(ctx, tx) }); err != nil {
		t.Fatal(err) // rows 151-154
	}
	stop := runLog(t, relay)
	waitUntil(t, "every row marked", func() bool {
		return count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0
	})
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v", err)
	}
	var sizes []int
	for _, call := range broker.batches() {
		sizes = append(sizes, len(call))
	}
	if want := []int{100, 50, 4}; !slices.Equal(sizes, want) {
		t.Errorf("batch sizes %v, want %v", sizes, want)
	}
}

// insertItems writes n ItemPicked rows with no aggregate in tx.
func insertItems(ctx context.Context, tx *sql.Tx, n int) error {
	for range n {
		if _, err := postgres.InsertOutbox(ctx, tx, "ItemPicked", map[string]int{"item": 1}); err != nil {
			return err
		}
	}
	return nil
}

// insertABAC writes in tx four rows, of aggregates a, b, a and c.
func insertABAC(ctx context.Context, tx *sql.Tx) error {
	for _, agg := range []struct {
		name string
		seq  int64
	}{{"a", 1}, {"b", 1}, {"a", 2}, {"c", 1}} {
		if _, err := postgres.InsertOutboxFor(ctx, tx, agg.name, agg.seq, "ItemPicked", map[string]int{"item": 1}); err != nil {
			return err
		}
	}
	return nil
}

// Slot names are the server's, not a database's: a second service whose
// outbox table has the first's name, on another database of the same
// server, meets the first's slot. Each step that would take it is refused
// with ErrSlotOfAnotherDatabase, naming the database it belongs to:
// CreateLogSlot, DropLogSlot, Recover, and Run (not ErrSlotLost, which the
// relay process answers by dropping the slot and making its own); the
// first database's slot is still there, and still its. Named apart
// (LogRelay's Slot), the second service's relay streams its own rows.
// (Caught: CreateLogSlot said nil, Run said ErrSlotLost, and recovery
// dropped the other service's slot.)
func TestSlotOfAnotherDatabaseIsNeverTaken(t *testing.T) {
	ctx := context.Background()
	first, second := newDatabaseName(t), newDatabaseName(t)
	dbFirst, dbSecond := open(t, first, ""), open(t, second, "")
	slot := first // the two services' shared name: their outbox table's
	if err := postgres.CreateLogSlot(ctx, dbFirst, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dropSlot(t, dbFirst, slot) })
	broker := &recorder{}
	relay := logRelayMarkingIn(t, dbSecond, logConnString(second), slot, broker, postgres.LogRelayConfig{MaxBackoff: time.Hour})
	_, recovered := relay.Recover(ctx)
	for what, err := range map[string]error{
		"CreateLogSlot": postgres.CreateLogSlot(ctx, dbSecond, slot),
		"DropLogSlot":   postgres.DropLogSlot(ctx, dbSecond, slot),
		"Recover":       recovered,
		"Run":           relay.Run(ctx),
	} {
		if !errors.Is(err, postgres.ErrSlotOfAnotherDatabase) || errors.Is(err, postgres.ErrSlotLost) || !strings.Contains(err.Error(), first) {
			t.Errorf("%s on the second database = %v; want ErrSlotOfAnotherDatabase naming %s", what, err, first)
		}
		t.Logf("%s: %v", what, err)
	}
	var database string
	if err := dbFirst.QueryRow(`SELECT database FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&database); err != nil || database != first {
		t.Fatalf("the first database's slot: %q, %v; want it kept, %s's", database, err, first)
	}

	own := second + "_own"
	relay = logRelayOn(t, dbSecond, logConnString(second), own, broker, unmarked)
	stop := runLog(t, relay)
	rows := committedAt(t, dbSecond, 3)
	waitUntil(t, "the second service's rows streamed from its own slot", func() bool { return seenAll(broker, rows) })
	stop()
}
