package postgres_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// BenchmarkTheWrite is what a team pays on every order, on a durable server
// of the benchmark's own (fsync, full_page_writes and synchronous_commit
// on: each commit waits for the disk), through pgxpool, a relay running
// beside the producers and publishing to discard: orders placed a second
// by 1, 8 and 32 producers at once, and each order's p50 and p99. An op
// is one order. The ways:
//   - order: the order alone (BEGIN, INSERT, COMMIT);
//   - outbox: the order and its outbox row by Write, a round trip of its
//     own, and the NOTIFY at commit while the relay sleeps (migration 11);
//   - outbox-no-notify: the same on a table whose trigger is disabled, the
//     relay polling every 10 ms;
//   - queued: the row queued beside the order by Queue, one round trip for
//     both, and the NOTIFY;
//   - queued-no-notify: the same without the NOTIFY.
//
// The order's id is the client's, as it is when a team makes its ids (a
// UUID, a snowflake), so that its event can go in the same batch.
func BenchmarkTheWrite(b *testing.B) {
	srv, err := pgtest.Start("-c", "fsync=on", "-c", "full_page_writes=on", "-c", "synchronous_commit=on", "-c", "max_connections=200")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { srv.Remove() })
	ctx := context.Background()
	pools := map[bool]*pgxpool.Pool{} // by whether its outbox notifies
	for _, notify := range []bool{true, false} {
		admin, err := pgx.Connect(ctx, srv.ConnString())
		if err != nil {
			b.Fatal(err)
		}
		name := fmt.Sprintf("write_%t", notify)
		if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
			b.Fatal(err)
		}
		admin.Close(ctx)
		cfg, err := pgxpool.ParseConfig(srv.ConnString() + " dbname=" + name + " pool_max_conns=40")
		if err != nil {
			b.Fatal(err)
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(pool.Close)
		ob, err := postgres.Open(pool, postgres.Config{})
		if err != nil {
			b.Fatal(err)
		}
		if err := ob.Migrate(ctx); err != nil {
			b.Fatal(err)
		}
		stmts := []string{`CREATE TABLE bench_orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL)`}
		if !notify {
			stmts = append(stmts, `ALTER TABLE outbox DISABLE TRIGGER outbox_notify`)
		}
		for _, s := range stmts {
			if _, err := pool.Exec(ctx, s); err != nil {
				b.Fatal(err)
			}
		}
		pools[notify] = pool
		// A relay runs beside the producers, as in a deployment: with the
		// NOTIFY it says it is awake, and producers notify only while it
		// sleeps; without, it polls every 10 ms.
		relayCfg := postgres.RelayConfig{}
		if !notify {
			relayCfg.PollOnly, relayCfg.PollInterval = true, 10*time.Millisecond
		}
		relay, err := ob.NewRelay(discard{}, relayCfg)
		if err != nil {
			b.Fatal(err)
		}
		runCtx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- relay.Run(runCtx) }()
		b.Cleanup(func() { stop(); <-done })
	}
	ways := []struct {
		name   string
		notify bool
		place  func(ctx context.Context, ob *postgres.Outbox[postgres.PgxTx], tx pgx.Tx) error
	}{
		{"order", true, func(ctx context.Context, _ *postgres.Outbox[postgres.PgxTx], tx pgx.Tx) error {
			_, err := tx.Exec(ctx, insertOrder, nextOrder.Add(1))
			return err
		}},
		{"outbox", true, writeBoth},
		{"outbox-no-notify", false, writeBoth},
		{"queued", true, queueBoth},
		{"queued-no-notify", false, queueBoth},
	}
	for _, producers := range []int{1, 8, 32} {
		for _, w := range ways {
			b.Run(fmt.Sprintf("producers=%d/write=%s", producers, w.name), func(b *testing.B) {
				pool := pools[w.notify]
				ob, err := postgres.Open(pool, postgres.Config{})
				if err != nil {
					b.Fatal(err)
				}
				var next atomic.Int64
				latencies := make([][]time.Duration, producers)
				var wg sync.WaitGroup
				b.ResetTimer()
				start := time.Now()
				for p := range producers {
					wg.Go(func() {
						for next.Add(1) <= int64(b.N) {
							began := time.Now()
							err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.place(ctx, ob, tx) })
							if err != nil {
								b.Error(err)
								return
							}
							latencies[p] = append(latencies[p], time.Since(began))
						}
					})
				}
				wg.Wait()
				elapsed := time.Since(start)
				b.StopTimer()
				all := slices.Concat(latencies...)
				slices.Sort(all)
				if len(all) == 0 {
					return
				}
				b.ReportMetric(float64(len(all))/elapsed.Seconds(), "orders/s")
				b.ReportMetric(float64(all[len(all)/2].Microseconds()), "p50-µs")
				b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-µs")
			})
		}
	}
}

// writeBoth inserts the order, then its outbox row by Write: two round
// trips.
func writeBoth(ctx context.Context, ob *postgres.Outbox[postgres.PgxTx], tx pgx.Tx) error {
	id := nextOrder.Add(1)
	if _, err := tx.Exec(ctx, insertOrder, id); err != nil {
		return err
	}
	_, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int64{"orderId": id, "totalCents": 2500}})
	return err
}

// queueBoth sends the order and its outbox row in one batch: one round
// trip.
func queueBoth(ctx context.Context, ob *postgres.Outbox[postgres.PgxTx], tx pgx.Tx) error {
	id := nextOrder.Add(1)
	batch := &pgx.Batch{}
	batch.Queue(insertOrder, id)
	if err := ob.Queue(ctx, batch, postgres.Event{Type: "OrderPlaced", Payload: map[string]int64{"orderId": id, "totalCents": 2500}}, nil); err != nil {
		return err
	}
	return tx.SendBatch(ctx, batch).Close()
}

// nextOrder hands out the orders' ids, as a team's own ids would be.
var nextOrder atomic.Int64

// insertOrder is the order's own statement.
const insertOrder = `INSERT INTO bench_orders (id, total_cents) VALUES ($1, 2500)`
