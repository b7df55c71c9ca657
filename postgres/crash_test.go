package postgres_test

// A crash of the server itself: producers that commit asynchronously, a WAL
// writer that waits 10 s between flushes, an immediate stop, recovery. The
// test starts a server of its own for it, so that stopping it touches no
// other test's.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// Orders placed with synchronous_commit = off are visible, and their rows
// claimable, before their commits are flushed. The relay makes the server
// flush them before it publishes, so after an immediate stop (the server's
// processes killed, its unflushed log lost) every event the broker holds is
// of an order the recovered database has. The WAL writer is slowed to 10 s
// and the background writer and autovacuum are off, so that nothing else
// flushes the log in the test's second. (Caught: the relay without its
// flush, whose events named 5 orders the crash erased.)
func TestAsyncCommitProducersGetNoEventForAnOrderACrashErased(t *testing.T) {
	ctx := context.Background()
	const orders = 5
	srv, db := startLazyServer(t)
	service := shop.NewOrderService(db)
	for range orders {
		if _, err := service.PlaceOrder(ctx, 2500); err != nil {
			t.Fatal(err)
		}
	}
	broker := &recorder{}
	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != orders || err != nil {
		t.Fatalf("pass = %d, %v; want %d", n, err, orders)
	}
	db.Close()

	srv.ctl(t, "-m", "immediate", "stop")
	srv.ctl(t, "start")
	db = srv.open(t)
	var kept int
	if err := db.QueryRow(`SELECT count(*) FROM orders`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	t.Logf("after the crash: %d of %d orders, %d events in the broker", kept, orders, len(broker.Published()))
	for _, m := range broker.Published() {
		var order shop.Order
		if err := json.Unmarshal([]byte(m.Payload), &order); err != nil {
			t.Fatal(err)
		}
		var exists bool
		if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM orders WHERE id = $1)`, order.ID).Scan(&exists); err != nil {
			t.Fatal(err)
		}
		if !exists {
			t.Errorf("the broker holds %s of order %d, which the crash erased", m.Type, order.ID)
		}
	}
}

// startLazyServer starts a server of t's own whose commits do not wait for
// the disk (synchronous_commit = off) and whose log nothing else flushes
// in a test's second (the WAL writer slowed to 10 s, the background writer
// and autovacuum off), with the outbox's and the example's tables, durable,
// and the log at a new segment, so that the test's few kilobytes fill no
// page of it (a full page would nudge the WAL writer).
func startLazyServer(t *testing.T) (*ownServer, *sql.DB) {
	t.Helper()
	ctx := context.Background()
	srv := startOwnServer(t, "-c", "synchronous_commit=off", "-c", "wal_writer_delay=10000",
		"-c", "bgwriter_lru_maxpages=0", "-c", "autovacuum=off")
	db := srv.open(t)
	if err := errors.Join(postgres.Migrate(ctx, db), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CHECKPOINT; SELECT pg_switch_wal()`); err != nil {
		t.Fatal(err)
	}
	return srv, db
}

// ownServer is a PostgreSQL server of one test's own (pgtest.Start),
// removed when the test ends.
type ownServer struct {
	*pgtest.Server
	dir string
}

// startOwnServer starts a server with postgres options opts, as
// pgtest.Main starts the one the other tests share.
func startOwnServer(t *testing.T, opts ...string) *ownServer {
	t.Helper()
	srv, err := pgtest.Start(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The folder goes even when the server is gone already (a test
		// that killed it): the stop's error is reported, not fatal.
		if err := srv.Remove(); err != nil {
			t.Log(err)
		}
	})
	return &ownServer{Server: srv, dir: srv.Dir}
}

// ctl runs pg_ctl with args and then -w (wait); start also gets the
// server's options.
func (s *ownServer) ctl(t *testing.T, args ...string) {
	t.Helper()
	if err := s.Ctl(args...); err != nil {
		t.Fatal(err)
	}
}

// tryCtl is ctl, returning its failure.
func (s *ownServer) tryCtl(args ...string) error { return s.Ctl(args...) }

// open opens the server's postgres database, closed when t ends.
func (s *ownServer) open(t *testing.T) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(s.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { db.Close() })
	return db
}

// A consumer on a database tuned for speed (synchronous_commit = off, the
// WAL writer slowed to 10 s): five messages applied by the warehouse, each
// acked after ApplyOnce returned, then an immediate stop of the server:
// after recovery all five keys and reservations are there, since the broker
// will never deliver an acked message again. (Caught: ApplyOnce committing
// with the session's setting: 0 of 5 left after the crash.)
func TestAppliedMessagesSurviveACrashWhateverTheSessionsCommitSetting(t *testing.T) {
	ctx := context.Background()
	srv, db := startLazyServer(t)
	warehouse := shop.NewWarehouse(db)
	for i := range int64(5) {
		msg := postgres.Message{ID: i + 1, Key: fmt.Sprintf("7f1e9c2a-0000-4000-8000-00000000000%d", i+1), Type: shop.OrderPlaced,
			Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":100}`, i+1), Aggregate: shop.OrderAggregate(i + 1), Seq: 1}
		if applied, err := warehouse.Handle(ctx, msg); !applied || err != nil {
			t.Fatalf("message %d: applied %v, %v", i+1, applied, err)
		}
	}
	db.Close()
	srv.ctl(t, "-m", "immediate", "stop")
	srv.ctl(t, "start")
	db = srv.open(t)
	var keys, reservations int
	if err := db.QueryRow(`SELECT (SELECT count(*) FROM processed_messages), (SELECT count(*) FROM reservations)`).Scan(&keys, &reservations); err != nil {
		t.Fatal(err)
	}
	t.Logf("after the crash: %d of 5 keys, %d of 5 reservations", keys, reservations)
	if keys != 5 || reservations != 5 {
		t.Errorf("after the crash %d keys and %d reservations of 5 acked messages remain, want all 5", keys, reservations)
	}
}

// Where every producer commits synchronously, the relay seldom makes the
// server flush its log: a synchronous commit is flushed before anyone sees
// its rows, and what was not flushed as a claim began is the log of
// producers still in their transactions, whose commits flush it a moment
// later. On a server of its own (autovacuum off, so that nothing else
// writes to the log): 20 rounds of an order placed and a pass, of which at
// most 2 may flush (the background writer's snapshot of running
// transactions, every 15 s, writes to the log without flushing it); then
// four producers placing 400 orders while Run delivers them, where at most
// a quarter of the passes with rows may flush (measured with eight, in
// make measure-relays: a few in a hundred at most). (Caught: a relay that
// flushed whenever another transaction had written as its claim began, in
// most passes under load: 64% with eight producers; it now looks again,
// five times in 3.75 ms, before it flushes.)
func TestSynchronousProducersSeldomCostTheRelayAFlush(t *testing.T) {
	ctx := context.Background()
	srv := startOwnServer(t, "-c", "autovacuum=off")
	db := srv.open(t)
	db.SetMaxIdleConns(8)
	if err := errors.Join(postgres.Migrate(ctx, db), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	var passes, flushes atomic.Int64 // passes with rows
	relay := newRelay(t, db, broker, postgres.RelayConfig{OnPass: func(r postgres.PassReport) {
		if r.Claimed > 0 {
			passes.Add(1)
			if r.Flushed {
				flushes.Add(1)
			}
		}
	}})
	service := shop.NewOrderService(db)
	const rounds = 20
	for range rounds {
		if _, err := service.PlaceOrder(ctx, 2500); err != nil {
			t.Fatal(err)
		}
		if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
			t.Fatalf("pass = %d, %v; want its order", n, err)
		}
	}
	t.Logf("one producer, a pass after each order: %d of %d passes made the server flush", flushes.Load(), rounds)
	if n := flushes.Load(); n > 2 {
		t.Errorf("%d of %d passes made the server flush its log, after synchronous commits only", n, rounds)
	}

	passes.Store(0)
	flushes.Store(0)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(runCtx) }()
	const producers, each = 4, 100
	var wg sync.WaitGroup
	for range producers {
		wg.Go(func() {
			for range each {
				if _, err := service.PlaceOrder(ctx, 2500); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	waitUntil(t, "every order's event published", func() bool { return len(broker.Published()) == rounds+producers*each })
	stop()
	<-done
	t.Logf("%d producers: %d of %d passes with rows made the server flush", producers, flushes.Load(), passes.Load())
	if f, p := flushes.Load(), passes.Load(); 4*f > p {
		t.Errorf("%d of %d passes made the server flush its log, after synchronous commits only", f, p)
	}
}

// The flush is checked, not trusted: a relay whose pool sends its second
// connection, the one that commits the flush, to another server (a pooler
// or a load balancer that mixes servers) finds its own server's log still
// not flushed, says so, and publishes nothing. Its server is the lazy one:
// orders committed asynchronously, their log not flushed by anyone in the
// test's second. (Caught: the flush's check taken out, which published 5
// events for orders a crash could erase.)
func TestFlushOnAnotherServerIsNotTakenForOne(t *testing.T) {
	ctx := context.Background()
	srv, db := startLazyServer(t)
	service := shop.NewOrderService(db)
	for range 5 {
		if _, err := service.PlaceOrder(ctx, 2500); err != nil {
			t.Fatal(err)
		}
	}
	lazy, err := pgx.ParseConfig(srv.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	other := pgtest.Config.Copy() // the server the other tests share
	var opened atomic.Int64
	mixed := stdlib.OpenDB(*lazy, stdlib.OptionBeforeConnect(func(_ context.Context, cfg *pgx.ConnConfig) error {
		if opened.Add(1) > 1 { // the pass's connection is the first; the flush's the second
			cfg.Config = other.Config
		}
		return nil
	}))
	defer mixed.Close()
	broker := &recorder{}
	n, err := newRelay(t, mixed, broker).PublishPending(ctx)
	if n != 0 || err == nil || !strings.Contains(err.Error(), "still not flushed") {
		t.Errorf("pass = %d, %v; want nothing published, and the log not flushed", n, err)
	}
	if len(broker.Published()) != 0 {
		t.Errorf("%d events published before the server flushed their orders", len(broker.Published()))
	}
}
