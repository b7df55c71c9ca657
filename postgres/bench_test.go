package postgres_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"os"
	"strconv"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// `make bench-postgres` runs these on a throwaway server in interleaved
// rounds and compares the two sides of each pair with benchstat.

// BenchmarkPlaceOrder compares placing an order with the outbox (two inserts,
// one commit) and the direct way (one insert, one commit, then a publish to
// the in-memory broker), on the real server.
func BenchmarkPlaceOrder(b *testing.B) {
	ctx := context.Background()
	db := newDatabase(b)
	services := []struct {
		name       string
		placeOrder func(context.Context, int64) (int64, error)
	}{
		{"write=outbox", postgres.NewOrderService(db).PlaceOrder},
		{"write=direct", postgres.NewDirectOrderService(db, discard{}).PlaceOrder},
	}
	for _, s := range services {
		b.Run(s.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := s.placeOrder(ctx, 2500); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkDeliver measures what the relay costs per message (an op is one
// message), in passes that claim 1 or 100 rows. Rows are written in chunks with the timer stopped, then
// drained by passes; the table keeps the rows sent by earlier chunks, as a
// real outbox does until its cleanup.
func BenchmarkDeliver(b *testing.B) {
	for _, batch := range []int{1, 100} {
		b.Run("batch="+strconv.Itoa(batch), func(b *testing.B) {
			ctx := context.Background()
			db := newDatabase(b)
			relay := postgres.NewOutboxRelay(db, discard{})
			relay.BatchSize = batch
			b.ResetTimer()
			for done := 0; done < b.N; {
				chunk := min(1000, b.N-done)
				b.StopTimer()
				if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload)
					SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500) FROM generate_series(1, $1) g`, chunk); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				for sent := 0; sent < chunk; {
					n, err := relay.PublishPending(ctx)
					if err != nil || n == 0 {
						b.Fatalf("pass = %d, %v, with %d of %d rows still unsent", n, err, chunk-sent, chunk)
					}
					sent += n
				}
				done += chunk
			}
		})
	}
}

// discard is a broker that is always up and keeps nothing, so that a long
// benchmark does not grow a list in memory.
type discard struct{}

func (discard) Publish(context.Context, postgres.Message) error { return nil }

// BenchmarkDrain drains 200,000 pending rows with one relay in passes of
// 100, once (run it with -benchtime 1x), and reports the drain rate of its
// first and its last tenth, then what an empty pass's claim reads, before and
// after VACUUM.
func BenchmarkDrain(b *testing.B) {
	const rows, tenth = 200_000, 20_000
	ctx := context.Background()
	for b.Loop() {
		db := newDatabase(b)
		if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload)
			SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500) FROM generate_series(1, $1) g`, rows); err != nil {
			b.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, `VACUUM ANALYZE outbox`); err != nil {
			b.Fatal(err)
		}
		if s := os.Getenv("DRAIN_TABLE_OPTS"); s != "" {
			if _, err := db.ExecContext(ctx, `ALTER TABLE outbox SET (`+s+`)`); err != nil {
				b.Fatal(err)
			}
		}
		relay := postgres.NewOutboxRelay(db, discard{})
		var rates []float64
		for done := 0; done < rows; {
			start := time.Now()
			for sent := 0; sent < tenth; {
				n, err := relay.PublishPending(ctx)
				if err != nil || n == 0 {
					b.Fatalf("pass = %d, %v", n, err)
				}
				sent += n
			}
			rates = append(rates, tenth/time.Since(start).Seconds())
			done += tenth
		}
		b.Logf("rates %.0f", rates)
		b.ReportMetric(rates[0], "first-tenth-msg/s")
		b.ReportMetric(rates[len(rates)-1], "last-tenth-msg/s")
		b.ReportMetric(claimBuffers(b, db), "empty-claim-buffers")
		if _, err := db.ExecContext(ctx, `VACUUM outbox`); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(claimBuffers(b, db), "vacuumed-claim-buffers")
	}
}

// claimBuffers is how many shared buffers the relay's claim reads, as
// EXPLAIN (ANALYZE, BUFFERS) counts them, in a transaction rolled back.
func claimBuffers(b *testing.B, db *sql.DB) float64 {
	b.Helper()
	tx, err := db.Begin()
	if err != nil {
		b.Fatal(err)
	}
	defer tx.Rollback()
	var plan string
	if err := tx.QueryRow(`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ` + postgres.ClaimQuery).Scan(&plan); err != nil {
		b.Fatal(err)
	}
	var parsed []struct {
		Plan struct {
			Hit  float64 `json:"Shared Hit Blocks"`
			Read float64 `json:"Shared Read Blocks"`
		}
	}
	if err := json.Unmarshal([]byte(plan), &parsed); err != nil || len(parsed) != 1 {
		b.Fatalf("EXPLAIN: %v: %s", err, plan)
	}
	return parsed[0].Plan.Hit + parsed[0].Plan.Read
}
