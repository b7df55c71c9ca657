package postgres_test

// Two failovers in a row, on a quorum of standbys: the setting that needs
// no choice at night. make failover runs it with TestFailover.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// quorumNames is the quorum every server of the run is given, primary or
// standby: a commit waits for any one of the others.
const quorumNames = "ANY 1 (p, s1, s2)"

// node is one server of the quorum run and the name it streams by.
type node struct {
	name string
	srv  *pgtest.Server
}

// quorumFailover: a primary (p) and two standbys (s1, s2) in a quorum,
// synchronous_standby_names = 'ANY 1 (p, s1, s2)'; four clients placing
// orders through OrderService on a connection string of the three
// servers; one relay (polling, or the log relay) that waits for one
// standby (StandbyCount 1, and no PublishWithoutStandbys: it never
// publishes from a primary no standby follows). Then twice in a row, under
// load: the primary killed; the standby that received the most promoted,
// as failover tooling does; the other standby pointed at it (its
// primary_conninfo, reloaded); the killed server rebuilt as a standby of
// the new primary. The relay and the clients run on, neither restarted nor
// reconfigured. No acknowledged order is lost, no event is published for
// an order the last primary lacks, and the warehouse reserves every order
// it holds.
func quorumFailover(t *testing.T, logMode bool) {
	label := "quorum"
	if logMode {
		label += ", the log relay"
	}
	ctx := context.Background()
	first := startOwnServer(t)
	db := first.open(t)
	if err := errors.Join(postgres.Migrate(ctx, db), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	// The quorum before the base backups, so that every standby has it
	// when it is promoted.
	for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = '` + quorumNames + `'`, `SELECT pg_reload_conf()`} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	nodes := []*node{{name: "p", srv: first.Server}}
	for _, name := range []string{"s1", "s2"} {
		s, err := first.StartStandby(name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Remove() })
		nodes = append(nodes, &node{name: name, srv: s})
	}
	primary := nodes[0]
	streaming(t, db, "s1", "s2")
	db.Close()

	var hosts []string
	for _, n := range nodes {
		hosts = append(hosts, n.srv.Dir)
	}
	cfg, err := pgx.ParseConfig(fmt.Sprintf("host=%s user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write connect_timeout=5",
		strings.Join(hosts, ",")))
	if err != nil {
		t.Fatal(err)
	}
	all := func() *sql.DB {
		d := stdlib.OpenDB(*cfg)
		d.SetMaxIdleConns(8)
		t.Cleanup(func() { d.Close() })
		return d
	}
	seen := &ordersSeen{}
	relayDB := all()
	run := newRelay(t, relayDB, seen, postgres.RelayConfig{MaxBackoff: 200 * time.Millisecond, StandbyCount: 1}).Run
	if logMode {
		if err := postgres.CreateLogSlot(ctx, relayDB, "quorum"); err != nil {
			t.Fatal(err)
		}
		logRelay, err := sqlOutbox(t, relayDB, postgres.Config{}).NewLogRelayConfig(&cfg.Config, seen,
			postgres.LogRelayConfig{Slot: "quorum", RecoverSlot: true, MaxBackoff: 200 * time.Millisecond, StandbyCount: 1})
		if err != nil {
			t.Fatal(err)
		}
		run = logRelay.Run
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- run(relayCtx) }()

	var total atomic.Int64
	total.Store(1000)
	var mu sync.Mutex
	acked := map[int64]int64{} // total -> id
	var failures atomic.Int64
	clientsCtx, stopClients := context.WithCancel(ctx)
	var wg sync.WaitGroup
	orders := shop.NewOrderService(all())
	for range 4 {
		wg.Go(func() {
			for clientsCtx.Err() == nil {
				tc := 2 * total.Add(1)
				id, err := orders.PlaceOrder(clientsCtx, tc)
				if err != nil { // the server gone, or the answer lost: not acknowledged
					failures.Add(1)
					select {
					case <-clientsCtx.Done():
					case <-time.After(20 * time.Millisecond):
					}
					continue
				}
				mu.Lock()
				acked[tc] = id
				mu.Unlock()
			}
		})
	}
	placed := func(more int) {
		t.Helper()
		mu.Lock()
		want := len(acked) + more
		mu.Unlock()
		waitUntil(t, fmt.Sprintf("%d more orders acknowledged", more), func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(acked) >= want
		})
	}
	placed(300)

	for round := 1; round <= 2; round++ {
		var standbys []*node
		for _, n := range nodes {
			if n != primary {
				standbys = append(standbys, n)
			}
		}
		if err := primary.srv.Kill(); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		// The standby that received the most becomes the primary: it holds
		// every commit that any standby acknowledged.
		next, other := standbys[0], standbys[1]
		a, errA := next.srv.Received(ctx)
		b, errB := other.srv.Received(ctx)
		if err := errors.Join(errA, errB); err != nil {
			t.Fatal(err)
		}
		if b > a {
			next, other = other, next
		}
		if err := next.srv.Ctl("promote"); err != nil {
			t.Fatal(err)
		}
		if err := other.srv.Follow(ctx, next.srv, other.name); err != nil {
			t.Fatal(err)
		}
		newDB := (&ownServer{Server: next.srv, dir: next.srv.Dir}).open(t)
		streaming(t, newDB, other.name)
		t.Logf("%s: failover %d: %s promoted, %s following it, %v after the kill", label, round, next.name, other.name,
			time.Since(killed).Round(time.Millisecond))
		placed(300) // on the new primary, the relay and the clients as they were
		t.Logf("%s: failover %d: the new primary took 300 orders %v after the kill", label, round, time.Since(killed).Round(time.Millisecond))
		if err := primary.srv.Rebuild(next.srv, primary.name); err != nil {
			t.Fatal(err)
		}
		streaming(t, newDB, other.name, primary.name)
		primary = next
	}
	stopClients()
	wg.Wait()

	last := (&ownServer{Server: primary.srv, dir: primary.srv.Dir}).open(t)
	waitUntil(t, "every row of the last primary delivered", func() bool {
		var unsent int
		return last.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&unsent) == nil && unsent == 0
	})
	stopRelay()
	if err := <-relayDone; !errors.Is(err, context.Canceled) {
		t.Errorf("relay, run through both failovers: %v; want it to have run until stopped", err)
	}
	held := map[int64]int64{}
	rows, err := last.Query(`SELECT id, total_cents FROM orders`)
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
	mu.Lock()
	outcome := tallyOf(acked, seen.orders(t), held, 0)
	mu.Unlock()
	warehouseDB := newDatabase(t)
	warehouse := shop.NewWarehouse(warehouseDB)
	seen.mu.Lock()
	for _, m := range seen.msgs {
		if _, err := warehouse.Handle(ctx, m); err != nil {
			t.Errorf("warehouse: %v", err)
		}
	}
	seen.mu.Unlock()
	unreserved := 0
	for id, tc := range held {
		var n int
		if err := warehouseDB.QueryRow(`SELECT count(*) FROM reservations WHERE order_id = $1 AND total_cents = $2`, id, tc).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			unreserved++
		}
	}
	t.Logf("failover %s, twice: outbox: %v, %d of the last primary's orders not reserved by the warehouse", label, outcome, unreserved)
	t.Logf("failover %s, twice: %d attempts failed while the servers changed", label, failures.Load())
	if outcome.lost != 0 || outcome.phantom != 0 || outcome.orphan != 0 || unreserved != 0 {
		t.Errorf("on a quorum, twice: %v, %d unreserved; want nothing lost, no phantom, no orphan, every order reserved", outcome, unreserved)
	}
}

// streaming waits until the primary db has each of names streaming as a
// quorum standby.
func streaming(t *testing.T, db *sql.DB, names ...string) {
	t.Helper()
	waitUntil(t, strings.Join(names, " and ")+" streaming, in the quorum", func() bool {
		var n int
		err := db.QueryRow(`SELECT count(*) FROM pg_stat_replication WHERE application_name = ANY($1) AND state = 'streaming' AND sync_state = 'quorum'`,
			names).Scan(&n)
		return err == nil && n == len(names)
	})
}
