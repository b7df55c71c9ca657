package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// A team on pgx itself writes the outbox row in its pgx.Tx: rolled back,
// nothing is written; committed, the relay publishes it, aggregate and seq
// kept. Bad input is refused before any statement, and the transaction
// goes on. (Caught: InsertOutbox took only database/sql's transactions.)
func TestWriteInAPgxTransaction(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	conn := connectTo(t, name)
	ob := pgxOutbox(t, newPool(t, name, 2))

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.Write(ctx, tx, postgres.Event{Type: "ItemPicked", Payload: map[string]int{"item": 1}}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox`); n != 0 {
		t.Fatalf("%d rows after a rollback", n)
	}

	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.Write(ctx, tx, postgres.Event{Type: "Opened", Payload: "{}", Aggregate: "account/7"}); !errors.Is(err, postgres.ErrInvalidSeq) {
		t.Errorf("seq 0 = %v, want ErrInvalidSeq", err)
	}
	if _, err := ob.Write(ctx, tx, postgres.Event{Type: "bad type", Payload: "{}"}); !errors.Is(err, postgres.ErrInvalidEventType) {
		t.Errorf("a type with a space = %v, want ErrInvalidEventType", err)
	}
	id, err := ob.Write(ctx, tx, postgres.Event{Type: "Opened", Payload: []byte(`{"account":7}`), Aggregate: "account/7", Seq: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass = %d, %v; want the row", n, err)
	}
	m := broker.Published()[0]
	if m.ID != id || m.Aggregate != "account/7" || m.Seq != 1 || m.Type != "Opened" || m.Payload != `{"account":7}` {
		t.Errorf("published %+v; want row %d of account/7, seq 1, as written", m, id)
	}
}

// newPool is a pgxpool.Pool of at most maxConns connections to the
// database named, closed when tb ends.
func newPool(tb testing.TB, name string, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	return newPoolAs(tb, name, "", maxConns)
}

// newPoolAs is newPool whose connections have application_name app, unless
// it is empty.
func newPoolAs(tb testing.TB, name, app string, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig("")
	if err != nil {
		tb.Fatal(err)
	}
	cfg.ConnConfig = pgtest.Config.Copy()
	cfg.ConnConfig.Database = name
	if app != "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = app
	}
	cfg.MaxConns = maxConns
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// connectTo is a pgx connection to the database name of the shared server
// (its default database if name is empty), closed when tb ends.
func connectTo(tb testing.TB, name string) *pgx.Conn {
	tb.Helper()
	cfg := pgtest.Config.Copy()
	if name != "" {
		cfg.Database = name
	}
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// pgxOutbox is the table outbox on p.
func pgxOutbox(tb testing.TB, p *pgxpool.Pool) *postgres.Outbox[postgres.PgxTx] {
	tb.Helper()
	ob, err := postgres.Open(p, postgres.Config{})
	if err != nil {
		tb.Fatal(err)
	}
	return ob
}

// A team on pgxpool runs the relay on its pool: rows written in a pgx.Tx go
// in id order and are marked; Run, woken by NOTIFY on a connection it
// takes out of the pool, publishes a row written while it waits for an
// hour; a row the broker refuses for ever is parked; and a pool too small
// for Run is refused before anything is claimed. (Caught: a relay that took
// only a *sql.DB.)
func TestRelayOnAPgxPool(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	pool := newPool(t, name, 4)
	ob := pgxOutbox(t, pool)
	write := func(n int) {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		for i := range n {
			if _, err := ob.Write(ctx, tx, postgres.Event{Type: "ItemPicked", Payload: map[string]int{"item": i}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	write(3)
	broker := &recorder{}
	relay := newRelayOn(t, ob, broker)
	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("pass = %d, %v; want 3", n, err)
	}
	wantIDs(t, broker, 1, 2, 3)
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
		t.Errorf("%d rows unsent after the pass, want 0", n)
	}

	var passes atomic.Int32
	relay = newRelayOn(t, ob, broker, postgres.RelayConfig{
		PollInterval: time.Hour, // only a notification wakes it
		OnPass:       func(postgres.PassReport) { passes.Add(1) },
	})
	stop := runRelay(t, relay)
	// Run passes once as it starts and once as it listens: after both, only
	// a notification can publish the next row within the hour.
	waitUntil(t, "Run listening, and its two passes over", func() bool {
		return passes.Load() >= 2 && count(t, db, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND query = 'LISTEN `+postgres.NotifyChannel+`'`) == 1
	})
	write(1)
	waitUntil(t, "the row written while Run waited published", func() bool { return len(broker.Published()) == 4 })
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v", err)
	}

	write(1) // id 5, refused for ever
	refusing := newRelayOn(t, ob, brokerFunc(func(context.Context, postgres.Message) error {
		return fmt.Errorf("too large: %w", postgres.ErrRejected)
	}), postgres.RelayConfig{ParkAfter: 1})
	if n, err := refusing.PublishPending(ctx); n != 0 || err != nil {
		t.Fatalf("pass with a refusing broker = %d, %v; want 0, <nil> and the row parked", n, err)
	}
	if parked, err := ob.ListParked(ctx, 0); err != nil || len(parked) != 1 || parked[0].ID != 5 {
		t.Errorf("parked %v, %v; want row 5", parked, err)
	}

	// The flush a pass makes when the log is not flushed past its rows: a
	// transaction of three statements, sent by pgx as one simple query.
	var before, after string
	if err := db.QueryRow(`SELECT pg_current_wal_flush_lsn()::text`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if err := postgres.FlushWALPgx(ctx, pool); err != nil {
		t.Fatalf("the flush on pgx: %v", err)
	}
	if err := db.QueryRow(`SELECT pg_current_wal_flush_lsn()::text`).Scan(&after); err != nil || after == before {
		t.Errorf("the log flushed to %s before the flush and %s after it (%v): want it moved", before, after, err)
	}

	if small, err := pgxOutbox(t, newPool(t, name, 2)).NewRelay(broker, postgres.RelayConfig{}); small != nil || !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("NewRelay on a pool of 2 = %v, %v; want ErrInvalidConfig (Run needs 3)", small, err)
	}
	if ob, err := postgres.Open(nil, postgres.Config{}); ob != nil || !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("Open with no pool = %v, %v; want ErrInvalidConfig", ob, err)
	}
}
