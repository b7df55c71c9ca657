package postgres_test

// A failover: a primary and a streaming standby, producers placing orders
// through the example's services, the polling relay and a dual write
// running, the primary killed with SIGKILL and the standby promoted. The
// test starts its own two servers, so that killing one touches no other
// test's. make failover runs it alone and keeps what it printed.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// ordersSeen is a broker that keeps each order's events by order: what a
// consumer would be told of.
type ordersSeen struct {
	mu   sync.Mutex
	msgs []postgres.Message
}

func (o *ordersSeen) Publish(_ context.Context, m postgres.Message) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.msgs = append(o.msgs, m)
	return nil
}

func (o *ordersSeen) orders(t *testing.T) []shop.Order {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []shop.Order
	for _, m := range o.msgs {
		var order shop.Order
		if err := json.Unmarshal([]byte(m.Payload), &order); err != nil {
			t.Fatal(err)
		}
		out = append(out, order)
	}
	return out
}

// tally is what a failover did to one way of telling the warehouse:
// orders acknowledged to their clients and lost, events for orders the
// new primary does not have (phantoms, and of those, the ones whose id a
// real order of the new primary has), and orders of the new primary that
// no event names (orphans).
type tally struct {
	acknowledged, lost, phantom, sameID, orphan int
}

func (c tally) String() string {
	return fmt.Sprintf("%d acknowledged, %d lost, %d phantom (%d sharing an id with a real order), %d orphan",
		c.acknowledged, c.lost, c.phantom, c.sameID, c.orphan)
}

// tallyOf compares what clients were told (acked: total -> id) and what a
// broker got (events) with the orders the new primary holds (id -> total),
// of which the ones whose total has the parity odd are the clients'.
// Totals are unique, so an order is known by its total whatever its id.
func tallyOf(acked map[int64]int64, events []shop.Order, held map[int64]int64, odd int64) tally {
	c := tally{acknowledged: len(acked)}
	heldTotals := map[int64]bool{}
	for _, total := range held {
		heldTotals[total] = true
	}
	for total := range acked {
		if !heldTotals[total] {
			c.lost++
		}
	}
	told := map[int64]bool{}
	for _, e := range events {
		told[e.TotalCents] = true
		if !heldTotals[e.TotalCents] {
			c.phantom++
			if _, ok := held[e.ID]; ok {
				c.sameID++
			}
		}
	}
	for _, total := range held {
		if total%2 == odd && !told[total] {
			c.orphan++
		}
	}
	return c
}

// The primary killed and the standby promoted in the middle of traffic:
// four clients place orders through OrderService and one through
// DirectOrderService, the polling relay delivers (waiting for one standby,
// StandbyCount, and publishing once the new primary has none,
// PublishWithoutStandbys), all on a connection string that names both
// servers and takes the one that accepts writes; the relay runs through
// the promotion, neither restarted nor reconfigured. Synchronous: the standby is in
// synchronous_standby_names. Asynchronous: its replication is frozen for a
// second before the kill, so the primary has committed what the standby
// never got. Either way the outbox loses no acknowledged order that the
// standby had, publishes no event for an order the new primary lacks, and
// every order of the new primary is delivered and reserved by the
// warehouse; asynchronous, the orders acknowledged during the freeze are
// lost, and the dual write publishes their events: phantoms, whose ids the
// new primary hands out again. The third run is the second with a relay
// that does not wait for the standby (no Standbys): it publishes the
// events of orders the standby never had, as the dual write does, and
// the warehouse, taking the phantom for the real order that reuses its id,
// drops the real one's event. The last two runs are two failovers in a row
// on a quorum of standbys (quorumFailover), the polling relay and the log
// relay.
func TestFailover(t *testing.T) {
	for _, mode := range []string{"synchronous", "asynchronous", "asynchronous-unguarded", "synchronous-log", "asynchronous-log"} {
		t.Run(mode, func(t *testing.T) { failover(t, mode) })
	}
	t.Run("quorum", func(t *testing.T) { quorumFailover(t, false) })
	t.Run("quorum-log", func(t *testing.T) { quorumFailover(t, true) })
}

func failover(t *testing.T, mode string) {
	logMode := strings.HasSuffix(mode, "-log")
	mode = strings.TrimSuffix(mode, "-log")
	label := mode // as the figures name the run
	if logMode {
		label += ", the log relay"
	}
	ctx := context.Background()
	primary := startOwnServer(t)
	db := primary.open(t)
	if err := errors.Join(postgres.Migrate(ctx, db), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	standby, err := primary.StartStandby("standby")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Remove() })
	guarded := mode != "asynchronous-unguarded"
	if mode == "synchronous" {
		for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = 'standby'`, `SELECT pg_reload_conf()`} {
			if _, err := db.Exec(q); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := map[string]string{"synchronous": "sync", "asynchronous": "async", "asynchronous-unguarded": "async"}[mode]
	waitUntil(t, "the standby streaming, "+want, func() bool {
		var state string
		err := db.QueryRow(`SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby' AND state = 'streaming'`).Scan(&state)
		return err == nil && state == want
	})
	db.Close()

	// Every client on both servers, taking the one that accepts writes.
	cfg, err := pgx.ParseConfig(fmt.Sprintf("host=%s,%s user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write connect_timeout=5",
		primary.Dir, standby.Dir))
	if err != nil {
		t.Fatal(err)
	}
	both := func() *sql.DB {
		d := stdlib.OpenDB(*cfg)
		d.SetMaxIdleConns(8)
		t.Cleanup(func() { d.Close() })
		return d
	}
	outboxBroker, dualBroker := &ordersSeen{}, &ordersSeen{}
	relayDB := both()
	relayCfg := postgres.RelayConfig{MaxBackoff: 200 * time.Millisecond}
	if guarded {
		// By number, not by name: after the promotion the new primary has
		// no standby, and the relay goes on publishing from it, logged,
		// with no setting changed and no restart.
		relayCfg.StandbyCount, relayCfg.PublishWithoutStandbys = 1, true
	}
	run := newRelay(t, relayDB, outboxBroker, relayCfg).Run
	if logMode {
		// The log relay, in place of the polling one, waiting for the
		// standby as the polling one does: its slot on the primary, where
		// PostgreSQL 15 keeps it; after the promotion it finds none on the
		// new primary, makes it, publishes what is not marked sent (what
		// it delivered and the new primary holds unmarked goes again: a
		// copy, dropped by key), and streams on (RecoverSlot).
		if err := postgres.CreateLogSlot(ctx, relayDB, "failover"); err != nil {
			t.Fatal(err)
		}
		logRelay, err := sqlOutbox(t, relayDB, postgres.Config{}).NewLogRelayConfig(&cfg.Config, outboxBroker,
			postgres.LogRelayConfig{Slot: "failover", RecoverSlot: true, MaxBackoff: 200 * time.Millisecond,
				StandbyCount: 1, PublishWithoutStandbys: true})
		if err != nil {
			t.Fatal(err)
		}
		run = logRelay.Run
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- run(relayCtx) }()

	// Clients: each order's total is unique, so that it is known by its
	// total whatever id a server gave it; the outbox's are even, the dual
	// write's odd.
	var total atomic.Int64
	total.Store(1000)
	even := func() int64 { return 2 * total.Add(1) }
	odd := func() int64 { return 2*total.Add(1) + 1 }
	var mu sync.Mutex
	outboxAcked, dualAcked := map[int64]int64{}, map[int64]int64{}
	var failures atomic.Int64
	clientsCtx, stopClients := context.WithCancel(ctx)
	var wg sync.WaitGroup
	client := func(place func(context.Context, int64) (int64, error), next func() int64, acked map[int64]int64) {
		for clientsCtx.Err() == nil {
			tc := next()
			id, err := place(clientsCtx, tc)
			if err != nil { // the server gone, or the answer lost: not acknowledged
				failures.Add(1)
				select {
				case <-clientsCtx.Done():
				case <-time.After(20 * time.Millisecond): // a client's pause before it tries again
				}
				continue
			}
			mu.Lock()
			acked[tc] = id
			mu.Unlock()
		}
	}
	orders := shop.NewOrderService(both())
	for range 4 {
		wg.Go(func() { client(orders.PlaceOrder, even, outboxAcked) })
	}
	direct := shop.NewDirectOrderService(both(), dualBroker)
	wg.Go(func() { client(direct.PlaceOrder, odd, dualAcked) })
	placed := func(n int) {
		t.Helper()
		waitUntil(t, fmt.Sprintf("%d more orders acknowledged", n), func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(outboxAcked) >= n
		})
	}
	placed(300)

	sdb := (&ownServer{Server: standby, dir: standby.Dir}).open(t)
	if mode != "synchronous" {
		var receiver int
		if err := sdb.QueryRow(`SELECT pid FROM pg_stat_wal_receiver`).Scan(&receiver); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(receiver, syscall.SIGSTOP); err != nil { // replication frozen
			t.Fatal(err)
		}
		mu.Lock()
		before := len(outboxAcked)
		mu.Unlock()
		placed(before + 300) // acknowledged by the primary alone
		if err := primary.Kill(); err != nil {
			t.Fatal(err)
		}
		syscall.Kill(receiver, syscall.SIGCONT) // it finds its primary gone
	} else if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	if err := standby.Ctl("promote"); err != nil {
		t.Fatal(err)
	}
	// The relay runs on, as it is: its pool reaches the new primary, and
	// it waits for the standbys that primary has (none).
	mu.Lock()
	before := len(outboxAcked)
	mu.Unlock()
	placed(before + 300) // on the new primary
	t.Logf("%s: the new primary took orders %v after the kill", label, time.Since(killed).Round(time.Millisecond))
	stopClients()
	wg.Wait()

	waitUntil(t, "every row of the new primary delivered", func() bool {
		var unsent int
		return sdb.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&unsent) == nil && unsent == 0
	})
	t.Logf("%s: every row of the new primary delivered %v after the kill, by the relay started before it", label, time.Since(killed).Round(time.Millisecond))
	stopRelay()
	if err := <-relayDone; !errors.Is(err, context.Canceled) {
		t.Errorf("relay, run through the promotion: %v", err)
	}

	held := map[int64]int64{}
	rows, err := sdb.Query(`SELECT id, total_cents FROM orders`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, tc int64
		if err := rows.Scan(&id, &tc); err != nil {
			t.Fatal(err)
		}
		held[id] = tc
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	outboxTally := tallyOf(outboxAcked, outboxBroker.orders(t), held, 0)
	dualTally := tallyOf(dualAcked, dualBroker.orders(t), held, 1)

	// The warehouse applies every event the outbox published, in order.
	warehouseDB := newDatabase(t)
	warehouse := shop.NewWarehouse(warehouseDB)
	outboxBroker.mu.Lock()
	for _, m := range outboxBroker.msgs {
		if _, err := warehouse.Handle(ctx, m); err != nil {
			t.Errorf("warehouse: %v", err)
		}
	}
	outboxBroker.mu.Unlock()
	unreserved := 0
	for id, tc := range held {
		if tc%2 != 0 {
			continue // the dual write's
		}
		var n int
		if err := warehouseDB.QueryRow(`SELECT count(*) FROM reservations WHERE order_id = $1 AND total_cents = $2`, id, tc).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			unreserved++
		}
	}
	t.Logf("failover %s: outbox: %v, %d of the new primary's orders not reserved by the warehouse", label, outboxTally, unreserved)
	t.Logf("failover %s: dual write: %v", label, dualTally)
	t.Logf("failover %s: %d attempts failed while the servers changed", label, failures.Load())

	if !guarded {
		if outboxTally.phantom == 0 {
			t.Errorf("the relay without Standbys: %v; want the phantoms it is there to prevent", outboxTally)
		}
		return
	}
	if outboxTally.phantom != 0 || outboxTally.orphan != 0 || unreserved != 0 {
		t.Errorf("the outbox: %v, %d unreserved; want no phantom, no orphan, every order reserved", outboxTally, unreserved)
	}
	if mode == "synchronous" && (outboxTally.lost != 0 || dualTally.lost != 0) {
		t.Errorf("with a synchronous standby, acknowledged orders were lost: outbox %v, dual write %v", outboxTally, dualTally)
	}
	if mode == "asynchronous" && outboxTally.lost == 0 {
		t.Errorf("asynchronous, with replication frozen, the outbox lost %d orders: the failover lost nothing, so it showed nothing", outboxTally.lost)
	}
}

// A pass whose standby is not there (never attached, or gone) publishes
// nothing within its budget and says why, with ErrStandbyBehind; the row
// waits. An empty name is refused before any claim.
func TestRelayWaitsForItsStandbysAndSaysSo(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 2500)
	broker := &recorder{}
	relay := newRelay(t, db, broker, postgres.RelayConfig{Standbys: []string{"standby"}, PassTimeout: 300 * time.Millisecond})
	n, err := relay.PublishPending(ctx)
	if n != 0 || !errors.Is(err, postgres.ErrStandbyBehind) {
		t.Errorf("pass = %d, %v; want nothing and ErrStandbyBehind", n, err)
	}
	if len(broker.Published()) != 0 {
		t.Errorf("published %d messages before the standby had them", len(broker.Published()))
	}
	if lag, err := postgres.ReadLag(ctx, db); err != nil || lag.Unsent != 1 {
		t.Errorf("ReadLag = %+v, %v; want the row unsent", lag, err)
	}
	if _, err := postgres.NewOutboxRelay(db, broker, postgres.RelayConfig{Standbys: []string{""}}); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("NewOutboxRelay with an empty standby name = %v, want ErrInvalidConfig", err)
	}
}

// A relay whose role cannot read its standbys' positions (no
// pg_read_all_stats: pg_stat_replication shows it flush_lsn NULL) fails its
// first pass with ErrStandbysUnreadable, naming the grant, rather than
// blaming a standby for being behind; Run stops on it, as on any failure
// no retry mends; granted the role, the pass goes on to wait for the
// standby as usual. (Caught: every pass failed with ErrStandbyBehind, for
// ever, blaming the standby for a missing grant.)
func TestRelayWhoseRoleCannotReadItsStandbysSaysWhichGrant(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	place(t, db, 2500)
	role := name + "_relay"
	for _, stmt := range []string{
		`CREATE ROLE ` + role + ` LOGIN`,
		`GRANT SELECT, UPDATE ON outbox TO ` + role,
	} {
		if _, err := db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	cfg := pgtest.Config.Copy()
	cfg.Database, cfg.User = name, role
	asRole := stdlib.OpenDB(*cfg)
	t.Cleanup(func() {
		asRole.Close()
		db.Exec(`DROP OWNED BY ` + role)
		if _, err := db.Exec(`DROP ROLE ` + role); err != nil {
			t.Error(err)
		}
	})
	broker := &recorder{}
	relay := newRelay(t, asRole, broker, postgres.RelayConfig{Standbys: []string{"standby"}, PassTimeout: 300 * time.Millisecond, PollInterval: time.Hour})
	n, err := relay.PublishPending(ctx)
	if n != 0 || !errors.Is(err, postgres.ErrStandbysUnreadable) || errors.Is(err, postgres.ErrStandbyBehind) || !strings.Contains(err.Error(), "pg_read_all_stats") {
		t.Fatalf("pass = %d, %v; want nothing and ErrStandbysUnreadable naming pg_read_all_stats", n, err)
	}
	if err := relay.Run(ctx); !errors.Is(err, postgres.ErrStandbysUnreadable) {
		t.Errorf("Run = %v; want it stopped with ErrStandbysUnreadable", err)
	}
	if _, err := db.Exec(`GRANT pg_read_all_stats TO ` + role); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.PublishPending(ctx); n != 0 || !errors.Is(err, postgres.ErrStandbyBehind) {
		t.Errorf("pass once granted = %d, %v; want nothing and ErrStandbyBehind (no standby is connected)", n, err)
	}
	if len(broker.Published()) != 0 {
		t.Errorf("published %d messages with no standby to have them", len(broker.Published()))
	}
}

// A relay that waits for standbys by number counts the ones streaming from
// the primary it is on, whichever they are, and not the log relay's
// walsender, nor a WAL archiver (pg_receivewal --synchronous, which
// flushes and never replays: caught counted, with no standby a failover
// could promote): one standby attached, StandbyCount 1 publishes and 2 waits,
// saying that 1 streams; with none attached, StandbyCount 1 waits, saying
// that none streams, unless PublishWithoutStandbys, which publishes and
// says so at Warn. Bad combinations are refused when the relay is made.
func TestRelayWaitsForStandbysByNumberOnThePrimaryItIsOn(t *testing.T) {
	ctx := context.Background()
	primary := startOwnServer(t)
	db := primary.open(t)
	if err := errors.Join(postgres.Migrate(ctx, db), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	if err := postgres.CreateLogSlot(ctx, db, "counted_not"); err != nil {
		t.Fatal(err)
	}
	logRelay, err := sqlOutbox(t, db, postgres.Config{}).NewLogRelay(fmt.Sprintf("host=%s user=postgres dbname=postgres sslmode=disable", primary.Dir),
		&recorder{}, postgres.LogRelayConfig{Slot: "counted_not", Unmarked: true})
	if err != nil {
		t.Fatal(err)
	}
	runLog(t, logRelay)
	waitUntil(t, "the log relay's walsender streaming", func() bool {
		var n int
		return db.QueryRow(`SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'`).Scan(&n) == nil && n == 1
	})

	var warned logBuffer
	logger := slog.New(slog.NewTextHandler(&warned, nil))
	broker := &recorder{}
	pass := func(cfg postgres.RelayConfig) (int, error) {
		t.Helper()
		cfg.PassTimeout, cfg.Logger = 300*time.Millisecond, logger
		return newRelay(t, db, broker, cfg).PublishPending(ctx)
	}
	place(t, db, 100)
	if n, err := pass(postgres.RelayConfig{StandbyCount: 1}); n != 0 || !errors.Is(err, postgres.ErrStandbyBehind) || !strings.Contains(err.Error(), "(0 streaming from this primary)") {
		t.Fatalf("StandbyCount 1 with no standby (the log relay's walsender is none) = %d, %v; want nothing and ErrStandbyBehind saying none streams", n, err)
	}
	if n, err := pass(postgres.RelayConfig{StandbyCount: 1, PublishWithoutStandbys: true}); n != 1 || err != nil || !strings.Contains(warned.String(), "PublishWithoutStandbys") {
		t.Fatalf("StandbyCount 1, PublishWithoutStandbys, no standby = %d, %v (logged %q); want the row published and a warning", n, err, warned.String())
	}

	// A WAL archiver streams and flushes the log, and replays nothing: no
	// failover can promote it, so it is no standby to count.
	stopArchiver, err := primary.StartReceiveWAL("archiver")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopArchiver)
	waitUntil(t, "the archiver streaming", func() bool {
		var n int
		return db.QueryRow(`SELECT count(*) FROM pg_stat_replication WHERE application_name = 'archiver' AND state = 'streaming' AND flush_lsn IS NOT NULL`).Scan(&n) == nil && n == 1
	})
	place(t, db, 150)
	if n, err := pass(postgres.RelayConfig{StandbyCount: 1}); n != 0 || !errors.Is(err, postgres.ErrStandbyBehind) || !strings.Contains(err.Error(), "(0 streaming from this primary)") {
		t.Fatalf("StandbyCount 1 with a WAL archiver alone = %d, %v; want nothing and ErrStandbyBehind saying no standby streams", n, err)
	}

	standby, err := primary.StartStandby("any_name")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Remove() })
	waitUntil(t, "the standby streaming", func() bool {
		var n int
		return db.QueryRow(`SELECT count(*) FROM pg_stat_replication WHERE application_name = 'any_name' AND state = 'streaming'`).Scan(&n) == nil && n == 1
	})
	place(t, db, 200)
	if n, err := pass(postgres.RelayConfig{StandbyCount: 2, PublishWithoutStandbys: true}); n != 0 || !errors.Is(err, postgres.ErrStandbyBehind) || !strings.Contains(err.Error(), "(1 streaming from this primary)") {
		t.Fatalf("StandbyCount 2 with one standby = %d, %v; want nothing and ErrStandbyBehind saying 1 streams", n, err)
	}
	if n, err := pass(postgres.RelayConfig{StandbyCount: 1}); n != 2 || err != nil {
		t.Fatalf("StandbyCount 1 with one standby = %d, %v; want both rows published", n, err)
	}
	for _, cfg := range []postgres.RelayConfig{{StandbyCount: -1}, {StandbyCount: 1, Standbys: []string{"s"}}, {PublishWithoutStandbys: true}} {
		if _, err := sqlOutbox(t, db, postgres.Config{}).NewRelay(broker, cfg); !errors.Is(err, postgres.ErrInvalidConfig) {
			t.Errorf("NewRelay(%+v) = %v; want ErrInvalidConfig", cfg, err)
		}
	}
}
