package postgres_test

// The log relay (LogRelay) on the real server: commit order, a lost
// connection and a stopped process that resume from the slot, a server
// killed with SIGKILL, the log a slot holds and its invalidation, and a
// broker that is down.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// logConnString is a connection string to the database name on the shared
// server, for a replication connection.
func logConnString(name string) string {
	return fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", pgtest.Config.Host, pgtest.Config.Port, pgtest.Config.User, name)
}

// newLogRelay is a database of t's own with the log relay's slot, named
// after the database and dropped when t ends, and a LogRelay on it.
func newLogRelay(t *testing.T, broker postgres.MessageBroker, cfg postgres.LogRelayConfig) (*sql.DB, *postgres.LogRelay) {
	t.Helper()
	name := newDatabaseName(t)
	db := open(t, name, "")
	return db, logRelayOn(t, db, logConnString(name), name, broker, cfg)
}

// logRelayOn creates the slot slot on db, dropped when t ends, and returns
// a LogRelay reading it through connString.
func logRelayOn(t *testing.T, db *sql.DB, connString, slot string, broker postgres.MessageBroker, cfg postgres.LogRelayConfig) *postgres.LogRelay {
	t.Helper()
	if err := postgres.CreateLogSlot(context.Background(), db, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dropSlot(t, db, slot) })
	return logRelayMarkingIn(t, db, connString, slot, broker, cfg)
}

// logRelayMarkingIn is a LogRelay of the table outbox reading slot through
// connString, which marks in db unless cfg.Unmarked, as cfg says, with a
// backoff of at most 200 ms unless cfg says otherwise.
func logRelayMarkingIn(t *testing.T, db *sql.DB, connString, slot string, broker postgres.MessageBroker, cfg postgres.LogRelayConfig) *postgres.LogRelay {
	t.Helper()
	cfg.Slot = slot
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 200 * time.Millisecond
	}
	relay, err := sqlOutbox(t, db, postgres.Config{}).NewLogRelay(connString, broker, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return relay
}

// unmarked is the log relay that marks nothing.
var unmarked = postgres.LogRelayConfig{Unmarked: true}

// dropSlot drops slot once no session reads it.
func dropSlot(t *testing.T, db *sql.DB, slot string) {
	waitUntil(t, "slot "+slot+" to be free", func() bool {
		var active bool
		err := db.QueryRow(`SELECT active FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&active)
		return errors.Is(err, sql.ErrNoRows) || err == nil && !active
	})
	if _, err := db.Exec(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot); err != nil {
		t.Error(err)
	}
}

// dropSlotOf is dropSlot for a benchmark.
func dropSlotOf(b *testing.B, db *sql.DB, slot string) {
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		var active bool
		err := db.QueryRow(`SELECT active FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&active)
		if errors.Is(err, sql.ErrNoRows) {
			return
		}
		if err == nil && !active {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("slot %s still read after a minute", slot)
		}
	}
	if _, err := db.Exec(`SELECT pg_drop_replication_slot($1)`, slot); err != nil {
		b.Fatal(err)
	}
}

// runLog runs relay.Run until the returned stop is called, and stop returns
// what Run returned.
func runLog(t *testing.T, relay *postgres.LogRelay) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() { cancel(); err = <-done })
		return err
	}
	t.Cleanup(func() { stop() })
	return stop
}

// The trap of the polling relay cannot happen: transaction A takes id 1 and
// commits after B, which took id 2; the log relay publishes 2, then 1, as
// they committed. (The polling relay, on the same rows once both committed,
// publishes them in id order: 1, then 2.)
func TestLogRelayPublishesInCommitOrder(t *testing.T) {
	ctx := context.Background()
	broker := &recorder{}
	db, relay := newLogRelay(t, broker, unmarked)
	a := begin(t, db)
	idA := insertOrderAndRow(t, a, 100)
	b := begin(t, db)
	idB := insertOrderAndRow(t, b, 200)
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := a.Commit(); err != nil {
		t.Fatal(err)
	}
	stop := runLog(t, relay)
	waitUntil(t, "both rows published", func() bool { return len(broker.Published()) == 2 })
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
	if got, want := broker.IDs(), []int64{idB, idA}; !slices.Equal(got, want) {
		t.Errorf("the log relay published %v, want %v: commit order", got, want)
	}
	polled := &recorder{}
	if _, err := newRelay(t, db, polled).PublishPending(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("log relay (commit order): %v; polling relay (id order): %v", broker.IDs(), polled.IDs())
	for _, m := range broker.Published() {
		if m.Key == "" || m.Type != "OrderPlaced" || !strings.Contains(m.Payload, `"totalCents"`) {
			t.Errorf("published %+v, want the row's key, type and payload", m)
		}
	}
}

// stalling is a recorder whose Publish calls hook before it records, and
// fails with hook's error.
type stalling struct {
	recorder
	hook   func(n int) error // n: how many it recorded before
	failMu sync.Mutex
	failed int
}

func (s *stalling) Publish(ctx context.Context, m postgres.Message) error {
	if err := s.hook(len(s.Published())); err != nil {
		s.failMu.Lock()
		s.failed++
		s.failMu.Unlock()
		return err
	}
	return s.recorder.Publish(ctx, m)
}

// failures is how many publishes failed.
func (s *stalling) failures() int {
	s.failMu.Lock()
	defer s.failMu.Unlock()
	return s.failed
}

// committedAt places orders one transaction each and returns, for each row
// id, a log position at or after its commit.
func committedAt(t *testing.T, db *sql.DB, n int) map[int64]string {
	t.Helper()
	at := map[int64]string{}
	service := shop.NewOrderService(db)
	for range n {
		id, err := service.PlaceOrder(context.Background(), 500)
		if err != nil {
			t.Fatal(err)
		}
		var lsn string
		if err := db.QueryRow(`SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
			t.Fatal(err)
		}
		at[id] = lsn // the row's id is its order's: each order writes one row
	}
	return at
}

// wantEachOnceButTheTail checks that every row was published, and that no
// row was published twice whose commit the slot had confirmed (at or before
// confirmed) when the relay was cut off: what goes again is the unconfirmed
// tail only.
func wantEachOnceButTheTail(t *testing.T, db *sql.DB, broker *recorder, at map[int64]string, confirmed string) {
	t.Helper()
	seen := map[int64]int{}
	for _, id := range broker.IDs() {
		seen[id]++
	}
	again := 0
	for id, lsn := range at {
		if seen[id] == 0 {
			t.Errorf("row %d was never published", id)
		}
		if seen[id] > 1 {
			again++
			var before bool
			if err := db.QueryRow(`SELECT $1::pg_lsn <= $2::pg_lsn`, lsn, confirmed).Scan(&before); err != nil {
				t.Fatal(err)
			}
			if before {
				t.Errorf("row %d, committed by %s, was confirmed (%s) and still published again", id, lsn, confirmed)
			}
		}
	}
	t.Logf("%d rows published, %d of them again (the unconfirmed tail; confirmed up to %s)", len(at), again, confirmed)
}

// A relay whose replication connection the server terminates in the middle
// of the stream connects again and resumes from the slot; a relay whose
// process is stopped (its context cancelled) and started again does the
// same. Nothing is lost, and what goes twice is only what the slot had not
// confirmed. (Caught: a relay that confirms each transaction when it reads
// its commit, before the broker accepted it: the row whose publish failed
// is never sent again.)
func TestLogRelayResumesFromTheSlotAfterAKillAndAStop(t *testing.T) {
	ctx := context.Background()
	broker := &stalling{}
	db, relay := newLogRelay(t, broker, unmarked)
	var slot string
	if err := db.QueryRow(`SELECT current_database()`).Scan(&slot); err != nil {
		t.Fatal(err)
	}
	confirmed := func() string {
		var lsn sql.NullString
		if err := db.QueryRow(`SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&lsn); err != nil {
			t.Fatal(err)
		}
		return lsn.String
	}
	var cut string
	killed := make(chan struct{})
	broker.hook = func(n int) error {
		if n == 9 { // a slow 10th publish: the relay tells the server of the 9th before it, of the 10th after
			time.Sleep(2 * 100 * time.Millisecond)
		}
		if n == 10 && cut == "" { // the 11th publish: the relay's connection goes, and this publish fails
			time.Sleep(2 * 100 * time.Millisecond) // for the server to have read what the relay told it
			cut = confirmed()
			if _, err := db.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'outbox-log-relay'
				AND datname = current_database()`); err != nil {
				t.Error(err)
			}
			close(killed)
			return fmt.Errorf("broker: connection reset: %w", postgres.ErrBrokerUnavailable)
		}
		return nil
	}
	at := committedAt(t, db, 20)
	stop := runLog(t, relay)
	<-killed
	waitUntil(t, "all 20 rows published after the kill", func() bool { return allSeen(broker, at) })
	wantEachOnceButTheTail(t, db, &broker.recorder, at, cut)

	// The process stops, more orders are placed, and a new relay resumes.
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
	cut = confirmed()
	more := committedAt(t, db, 10)
	first := len(broker.Published())
	runLog(t, relay)
	waitUntil(t, "the 10 rows placed while it was stopped", func() bool { return allSeen(broker, more) })
	after := &recorder{}
	for _, m := range broker.Published()[first:] {
		after.Publish(ctx, m)
	}
	wantEachOnceButTheTail(t, db, after, more, cut)
	for id := range at { // nothing confirmed before the stop went again
		if slices.Contains(after.IDs(), id) {
			var before bool
			if err := db.QueryRow(`SELECT $1::pg_lsn <= $2::pg_lsn`, at[id], cut).Scan(&before); err != nil || before {
				t.Errorf("row %d, confirmed before the stop, was published again after it", id)
			}
		}
	}
}

// allSeen reports whether the broker got every row of at.
func allSeen(broker *stalling, at map[int64]string) bool {
	got := broker.IDs()
	for id := range at {
		if !slices.Contains(got, id) {
			return false
		}
	}
	return true
}

// A broker that is down: the relay confirms nothing it has not delivered
// (the slot's position stays before the first transaction's commit), keeps no transaction open on the
// server (its session has no backend_xid), and once the broker is back
// every row goes, in commit order.
func TestLogRelayConfirmsNothingWhileTheBrokerIsDown(t *testing.T) {
	var down sync.Mutex
	isDown := true
	broker := &stalling{hook: func(int) error {
		down.Lock()
		defer down.Unlock()
		if isDown {
			return fmt.Errorf("broker: no route to host: %w", postgres.ErrBrokerUnavailable)
		}
		return nil
	}}
	db, relay := newLogRelay(t, broker, unmarked)
	before := slotPosition(t, db)
	at := committedAt(t, db, 5)
	runLog(t, relay)
	waitUntil(t, "the relay to have tried and failed twice", func() bool {
		var n int
		db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-log-relay' AND datname = current_database()`).Scan(&n)
		return n == 1 && broker.failures() >= 2
	})
	// The server's keepalives may move the slot within the log before the
	// first transaction's commit, which holds nothing to deliver; never to
	// that commit, which would skip the transaction.
	first := slices.Min(slices.Collect(maps.Keys(at)))
	var skipped bool
	got := slotPosition(t, db)
	if err := db.QueryRow(`SELECT $1::pg_lsn >= $2::pg_lsn`, got, at[first]).Scan(&skipped); err != nil || skipped {
		t.Errorf("the slot moved from %s to %s, at or past the first transaction's commit (%s), with nothing delivered", before, got, at[first])
	}
	var xid sql.NullString
	if err := db.QueryRow(`SELECT backend_xid::text FROM pg_stat_activity WHERE application_name = 'outbox-log-relay' AND datname = current_database()`).Scan(&xid); err != nil && !errors.Is(err, sql.ErrNoRows) {
		t.Fatal(err)
	}
	if xid.Valid {
		t.Errorf("the relay's session holds transaction %s", xid.String)
	}
	down.Lock()
	isDown = false
	down.Unlock()
	waitUntil(t, "the 5 rows once the broker is back", func() bool { return allSeen(broker, at) })
	if got := broker.IDs(); !slices.IsSorted(got) { // these committed one after the other
		t.Errorf("published %v, want commit order", got)
	}
}

// slotPosition is the confirmed position of the database's one slot.
func slotPosition(t *testing.T, db *sql.DB) string {
	t.Helper()
	var lsn sql.NullString
	if err := db.QueryRow(`SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE database = current_database()`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	return lsn.String
}

// The server killed with SIGKILL while four producers place orders and the
// relay streams, and started again: the slot and its position survive, the
// relay connects again on its own, every order whose PlaceOrder returned
// (before the kill or after the restart) has its event published, and no
// event is published for an order the database does not hold.
func TestLogRelayAfterTheServerIsKilled(t *testing.T) {
	ctx := context.Background()
	srv := startOwnServer(t, "-c wal_level=logical")
	db := srv.open(t)
	if err := errors.Join(postgres.Migrate(ctx, db), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	relay := logRelayOn(t, db, "host="+srv.dir+" user=postgres dbname=postgres sslmode=disable", "outbox", broker, unmarked)
	runLog(t, relay)

	var mu sync.Mutex
	acknowledged := map[int64]bool{} // the orders whose PlaceOrder returned nil
	produce := func(stopAtError bool, n int) {
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				service := shop.NewOrderService(db)
				for range n {
					id, err := service.PlaceOrder(ctx, 500)
					if err != nil {
						if !stopAtError {
							t.Error(err)
						}
						return // the kill: this order's outcome is unknown
					}
					mu.Lock()
					acknowledged[id] = true
					mu.Unlock()
				}
			})
		}
		wg.Wait()
	}
	producing := make(chan struct{})
	go func() { defer close(producing); produce(true, 1000) }()
	waitUntil(t, "20 events published under load", func() bool { return len(broker.Published()) >= 20 })

	pidFile, err := os.ReadFile(filepath.Join(srv.dir, "data", "postmaster.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.SplitN(string(pidFile), "\n", 2)[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-producing // each producer stopped at its first error
	// Its backends notice the postmaster's death and exit; the server starts
	// again once they have. A container whose first process reaps no
	// orphan keeps the killed postmaster as a zombie, whose pid the lock
	// file still names, and the server would take it for one that runs:
	// nothing of it runs, so its lock file goes.
	waitUntil(t, "the killed server to start again", func() bool {
		if stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil && strings.Contains(string(stat), ") Z ") {
			os.Remove(filepath.Join(srv.dir, "data", "postmaster.pid"))
		}
		return srv.tryCtl("start") == nil
	})
	before := len(acknowledged)
	produce(false, 5)
	var rows int
	if err := db.QueryRow(`SELECT count(*) FROM orders`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "every order the database holds published", func() bool {
		seen := map[int64]bool{}
		for _, m := range broker.Published() {
			seen[orderOf(t, m)] = true
		}
		return len(seen) >= rows
	})
	published := map[int64]bool{}
	for _, m := range broker.Published() {
		published[orderOf(t, m)] = true
	}
	for id := range acknowledged {
		if !published[id] {
			t.Errorf("order %d was acknowledged and its event never published", id)
		}
	}
	for id := range published {
		var exists bool
		if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM orders WHERE id = $1)`, id).Scan(&exists); err != nil || !exists {
			t.Errorf("an event for order %d, which the database does not hold (%v)", id, err)
		}
	}
	t.Logf("%d orders acknowledged before the kill, %d after; %d in the database; %d publishes of %d events",
		before, len(acknowledged)-before, rows, len(broker.Published()), len(published))
}

// orderOf is the order a message is about.
func orderOf(t *testing.T, m postgres.Message) int64 {
	t.Helper()
	var order struct {
		ID int64 `json:"orderId"`
	}
	if err := json.Unmarshal([]byte(m.Payload), &order); err != nil {
		t.Fatal(err)
	}
	return order.ID
}

// While the relay is away its slot holds the log it has not read, and the
// amount grows with every write; with max_slot_wal_keep_size the server
// invalidates the slot once it holds more, and the relay says so and stops
// with ErrSlotLost instead of retrying for ever.
func TestLogRelaySlotHoldsTheLogAndIsLostPastItsLimit(t *testing.T) {
	ctx := context.Background()
	srv := startOwnServer(t, "-c wal_level=logical", "-c max_slot_wal_keep_size=1MB")
	db := srv.open(t)
	if err := errors.Join(postgres.Migrate(ctx, db), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	// A relay that retried would not return.
	relay := logRelayOn(t, db, "host="+srv.dir+" user=postgres dbname=postgres sslmode=disable", "outbox", broker,
		postgres.LogRelayConfig{Unmarked: true, MaxBackoff: time.Hour})
	held := func() (bytes int64, status string) {
		t.Helper()
		if err := db.QueryRow(`SELECT COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint, COALESCE(wal_status, '')
			FROM pg_replication_slots WHERE slot_name = 'outbox'`).Scan(&bytes, &status); err != nil {
			t.Fatal(err)
		}
		return bytes, status
	}
	first, _ := held()
	committedAt(t, db, 50)
	second, status := held()
	if second <= first {
		t.Errorf("the slot holds %d bytes after 50 orders, %d before: want more", second, first)
	}
	t.Logf("the slot holds %d bytes of log before the orders, %d after (%s)", first, second, status)
	for range 4 { // past the limit: new segments, and a checkpoint that removes the old ones
		if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS filler (b text); INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 2000);
			SELECT pg_switch_wal(); CHECKPOINT`); err != nil {
			t.Fatal(err)
		}
	}
	if _, status = held(); status != "lost" {
		t.Fatalf("wal_status = %q after the log passed max_slot_wal_keep_size, want lost", status)
	}
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	select {
	case err := <-done:
		if !errors.Is(err, postgres.ErrSlotLost) {
			t.Errorf("Run on an invalidated slot = %v, want ErrSlotLost", err)
		}
		t.Logf("Run said: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("Run on an invalidated slot did not return in a minute")
	}
	if n := len(broker.Published()); n != 0 {
		t.Errorf("published %d messages from a lost slot", n)
	}
}

// Run on a slot that does not exist stops with ErrNoSlot.
func TestLogRelayWithoutItsSlotStops(t *testing.T) {
	name := newDatabaseName(t)
	relay := logRelayMarkingIn(t, open(t, name, ""), logConnString(name), "no_such_slot", &recorder{}, unmarked)
	if err := relay.Run(context.Background()); !errors.Is(err, postgres.ErrNoSlot) {
		t.Errorf("Run = %v, want ErrNoSlot", err)
	}
}

// A log relay that cannot run as configured is refused when it is made,
// with an error wrapping ErrInvalidConfig that names the setting, and
// nothing connects: a connection string pgx cannot parse, no broker, a slot
// or publication name PostgreSQL would not take, a negative duration,
// ParkAfter with NeverPark or Unmarked. The zero LogRelayConfig is the
// Outbox's slot and publication, marks and parking; a LogRelay no
// NewLogRelay made refuses to run, and one that marks nothing to recover.
// (Caught: settings read from fields when Run started, and a NewLogRelay
// that marked and parked nothing.)
func TestLogRelayConfigurationIsCheckedWhenTheRelayIsMade(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	ob := sqlOutbox(t, db, postgres.Config{Table: "billing_outbox"})
	good := "host=/nonexistent user=postgres dbname=postgres"
	for _, c := range []struct {
		name   string
		conn   string
		broker postgres.MessageBroker
		cfg    postgres.LogRelayConfig
		says   string
	}{
		{"a connection string pgx cannot parse", "host='", &recorder{}, postgres.LogRelayConfig{}, "connection string"},
		{"no broker", good, nil, postgres.LogRelayConfig{}, "no broker"},
		{"a slot PostgreSQL refuses", good, &recorder{}, postgres.LogRelayConfig{Slot: "Billing-Slot"}, "LogRelayConfig.Slot"},
		{"a publication PostgreSQL refuses", good, &recorder{}, postgres.LogRelayConfig{Publication: "a b"}, "LogRelayConfig.Publication"},
		{"a negative timeout", good, &recorder{}, postgres.LogRelayConfig{ReplyTimeout: -time.Second}, "negative duration"},
		{"a negative ParkAfter", good, &recorder{}, postgres.LogRelayConfig{ParkAfter: -1}, "LogRelayConfig.ParkAfter -1"},
		{"ParkAfter with NeverPark", good, &recorder{}, postgres.LogRelayConfig{ParkAfter: 2, NeverPark: true}, "LogRelayConfig.ParkAfter 2"},
		{"ParkAfter unmarked", good, &recorder{}, postgres.LogRelayConfig{ParkAfter: 2, Unmarked: true}, "parking needs the marks"},
		{"DeleteDelivered unmarked", good, &recorder{}, postgres.LogRelayConfig{DeleteDelivered: true, Unmarked: true}, "the deletes are the marks"},
	} {
		r, err := ob.NewLogRelay(c.conn, c.broker, c.cfg)
		if r != nil || !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: NewLogRelay = %v, %v; want ErrInvalidConfig saying %q", c.name, r, err, c.says)
		}
		t.Logf("%s: %v", c.name, err)
	}
	r, err := ob.NewLogRelay(good, &recorder{}, postgres.LogRelayConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Config(); got.Slot != "billing_outbox" || got.Publication != "billing_outbox_inserts" || got.Unmarked || got.NeverPark ||
		got.ParkAfter != postgres.DefaultParkAfter || got.PublishTimeout != postgres.DefaultPassTimeout || got.MaxBackoff != postgres.DefaultMaxBackoff {
		t.Errorf("the zero LogRelayConfig became %+v; want the Outbox's names, marks and every default", got)
	}
	if got := must2(t)(ob.NewLogRelay(good, &recorder{}, postgres.LogRelayConfig{Unmarked: true})).Config(); !got.NeverPark || got.ParkAfter != 0 {
		t.Errorf("Unmarked: %+v, want it never to park", got)
	}
	unmarkedRelay := must2(t)(ob.NewLogRelay(good, &recorder{}, postgres.LogRelayConfig{Unmarked: true}))
	if _, err := unmarkedRelay.Recover(ctx); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("Recover of a relay that marks nothing = %v, want ErrInvalidConfig", err)
	}
	var zero postgres.LogRelay
	if err := zero.Run(ctx); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("a zero LogRelay's Run = %v, want ErrInvalidConfig", err)
	}
}

// must2 is a log relay, or tb failed with its error.
func must2(tb testing.TB) func(*postgres.LogRelay, error) *postgres.LogRelay {
	return func(r *postgres.LogRelay, err error) *postgres.LogRelay {
		tb.Helper()
		if err != nil {
			tb.Fatal(err)
		}
		return r
	}
}

// A log relay with RecoverSlot that finds no slot (a standby promoted
// under it: PostgreSQL 15 keeps logical slots on the primary only) makes
// it by itself, publishes the rows not marked sent, and streams what
// comes after, in one Run; without RecoverSlot, Run returns ErrNoSlot.
// Unmarked with RecoverSlot is refused.
func TestLogRelayWithRecoverSlotMakesItsSlotByItself(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	place(t, db, 100, 200)
	broker := &recorder{}
	without := logRelayMarkingIn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{})
	if err := without.Run(ctx); !errors.Is(err, postgres.ErrNoSlot) {
		t.Fatalf("Run with no slot = %v; want ErrNoSlot", err)
	}
	t.Cleanup(func() { dropSlot(t, db, name) })
	relay := logRelayMarkingIn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{RecoverSlot: true})
	stop := runLog(t, relay)
	waitUntil(t, "the two rows written before the slot published and marked", func() bool {
		return count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0 && len(broker.Published()) == 2
	})
	place(t, db, 300)
	waitUntil(t, "the row written after the slot streamed", func() bool { return len(broker.Published()) == 3 })
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v; want it to have run on until stopped", err)
	}
	if ids := broker.IDs(); !slices.Equal(ids, []int64{1, 2, 3}) {
		t.Errorf("published %v; want [1 2 3]", ids)
	}
	if _, err := sqlOutbox(t, db, postgres.Config{}).NewLogRelay(logConnString(name), broker, postgres.LogRelayConfig{RecoverSlot: true, Unmarked: true}); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("RecoverSlot with Unmarked = %v; want ErrInvalidConfig", err)
	}
}

// A log relay with a StandbyCount publishes a transaction only once that
// many standbys have flushed past its commit: on a server with none, its
// session ends with ErrStandbyBehind, saying none streams, and nothing is
// published; with PublishWithoutStandbys it publishes, logged at Warn.
// (The failover's log relay runs wait for a real standby: TestFailover.)
func TestLogRelayWaitsForStandbysByNumber(t *testing.T) {
	broker := &recorder{}
	behind := make(chan error, 1)
	report := func(r postgres.PassReport) {
		if errors.Is(r.Err, postgres.ErrStandbyBehind) {
			select {
			case behind <- r.Err:
			default:
			}
		}
	}
	db, relay := newLogRelay(t, broker, postgres.LogRelayConfig{StandbyCount: 1, PublishTimeout: 300 * time.Millisecond, OnPass: report})
	stop := runLog(t, relay)
	place(t, db, 100)
	select {
	case err := <-behind:
		if !strings.Contains(err.Error(), "(0 streaming from this primary)") {
			t.Errorf("the session ended with %v; want it to say no standby streams", err)
		}
	case <-time.After(generous):
		t.Fatalf("no session ended with ErrStandbyBehind within %v", generous)
	}
	stop()
	if n := len(broker.Published()); n != 0 {
		t.Fatalf("published %d messages with no standby to have them", n)
	}
	var logs logBuffer
	without := logRelayMarkingIn(t, db, logConnStringOf(t, db), slotOf(t, db), broker,
		postgres.LogRelayConfig{StandbyCount: 1, PublishWithoutStandbys: true, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	runLog(t, without)
	waitUntil(t, "the row published without a standby", func() bool { return len(broker.Published()) == 1 })
	if !strings.Contains(logs.String(), "PublishWithoutStandbys") {
		t.Errorf("publishing without a standby was not logged: %s", logs.String())
	}
	if _, err := sqlOutbox(t, db, postgres.Config{}).NewLogRelay(logConnStringOf(t, db), broker, postgres.LogRelayConfig{StandbyCount: 1, Unmarked: true}); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("StandbyCount with Unmarked = %v; want ErrInvalidConfig", err)
	}
}

// logConnStringOf is logConnString of db's database, and slotOf its slot,
// named after it by newLogRelay.
func logConnStringOf(t *testing.T, db *sql.DB) string { return logConnString(slotOf(t, db)) }

func slotOf(t *testing.T, db *sql.DB) string {
	t.Helper()
	var name string
	if err := db.QueryRow(`SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}
