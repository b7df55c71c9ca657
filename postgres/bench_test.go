package postgres_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// `make bench-postgres` runs these on a throwaway server in interleaved
// rounds and compares the two sides of each pair with benchstat.

// BenchmarkPlaceOrder compares placing an order with the outbox (two inserts,
// one commit, the NOTIFY of the outbox's trigger) and the direct way (one
// insert, one commit, then a publish to discard), on the real server; and
// the outbox without its NOTIFY, on a database whose trigger is disabled.
func BenchmarkPlaceOrder(b *testing.B) {
	ctx := context.Background()
	db, quiet := newDatabase(b), newDatabase(b)
	if _, err := quiet.ExecContext(ctx, `ALTER TABLE outbox DISABLE TRIGGER outbox_notify`); err != nil {
		b.Fatal(err)
	}
	services := []struct {
		name       string
		placeOrder func(context.Context, int64) (int64, error)
	}{
		{"write=outbox", shop.NewOrderService(db).PlaceOrder},
		{"write=direct", shop.NewDirectOrderService(db, discard{}).PlaceOrder},
		{"write=outbox-without-notify", shop.NewOrderService(quiet).PlaceOrder},
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
			relay := newRelay(b, db, discard{}, postgres.RelayConfig{BatchSize: batch})
			drainInChunks(b, relay, func(chunk, done int) error {
				_, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload)
					SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500) FROM generate_series(1, $1) g`, chunk)
				return err
			})
		})
	}
}

// BenchmarkDeliverOrdered compares, per message, the whole-table relay
// with the relay that keeps order per aggregate, in passes of 100, over
// outbox rows written as a shop writes them: each order's OrderPlaced
// followed by its OrderCancelled (order/1 seq 1, order/1 seq 2, order/2 seq
// 1, ...), so that half the rows of a pass wait for the row before them.
func BenchmarkDeliverOrdered(b *testing.B) {
	for _, perAggregate := range []bool{false, true} {
		name := map[bool]string{false: "order=table", true: "order=aggregate"}[perAggregate]
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			db := newDatabase(b)
			relay := newRelay(b, db, discard{}, postgres.RelayConfig{WholeTable: !perAggregate})
			drainInChunks(b, relay, func(chunk, done int) error {
				_, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload, aggregate, seq)
					SELECT 'OrderPlaced', '{}', 'order/' || ($2::int + (g + 1) / 2), 2 - g % 2
					FROM generate_series(1, $1) g ORDER BY g`, chunk, done)
				return err
			})
		})
	}
}

// drainInChunks makes b.N messages in chunks of at most 1,000 with write
// (given the chunk's size and how many were made before it), with the timer
// stopped, and times the relay's passes that drain each chunk.
func drainInChunks(b *testing.B, relay *postgres.OutboxRelay, write func(chunk, done int) error) {
	b.Helper()
	b.ResetTimer()
	for done := 0; done < b.N; {
		chunk := min(1000, b.N-done)
		b.StopTimer()
		if err := write(chunk, done); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		for sent := 0; sent < chunk; {
			n, err := relay.PublishPending(context.Background())
			if err != nil || n == 0 {
				b.Fatalf("pass = %d, %v, with %d of %d rows still unsent", n, err, chunk-sent, chunk)
			}
			sent += n
		}
		done += chunk
	}
}

// discard is a broker that is always up and keeps nothing, so that a long
// benchmark does not grow a list in memory.
type discard struct{}

func (discard) Publish(context.Context, postgres.Message) error { return nil }

// The measurements below are benchmarks that run once (make
// measure-postgres runs them with -benchtime 1x) and report what
// REFERENCE.md quotes: the delay from commit to broker, a long drain, and
// the claim's cost on an outbox that kept its sent rows.

// BenchmarkLatency measures the time from PlaceOrder's return (the commit)
// to the broker's receiving the message, with Run woken by NOTIFY, with
// Run polling every second, and with Run polling every 10 ms on a table
// whose NOTIFY trigger is disabled (what many producers may choose: see
// BenchmarkTheWrite), one order at a time, each placed after a random
// pause (seeded, logged) so that orders do not line up with the polls.
func BenchmarkLatency(b *testing.B) {
	once(b)
	for _, tc := range []struct {
		name   string
		orders int
		pause  time.Duration // the longest pause before an order
		poll   time.Duration // 0: only a notification wakes it
		quiet  bool          // the table's NOTIFY trigger disabled
	}{
		{"wake=notify", 200, 10 * time.Millisecond, 0, false},
		{"wake=poll-1s", 30, time.Second, time.Second, false},
		{"wake=poll-10ms", 200, 10 * time.Millisecond, 10 * time.Millisecond, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			const seed = 18
			b.Logf("seed %d, PostgreSQL %s", seed, serverVersion(b))
			random := rand.New(rand.NewPCG(seed, seed))
			ctx := context.Background()
			for b.Loop() {
				db := newDatabase(b)
				if tc.quiet {
					if _, err := db.ExecContext(ctx, `ALTER TABLE outbox DISABLE TRIGGER outbox_notify`); err != nil {
						b.Fatal(err)
					}
				}
				received := make(chan int64, tc.orders)
				broker := brokerFunc(func(_ context.Context, m postgres.Message) error {
					received <- m.ID
					return nil
				})
				poll := time.Hour // only a notification wakes it
				if tc.poll > 0 {
					poll = tc.poll
				}
				relay := newRelay(b, db, broker, postgres.RelayConfig{PollInterval: poll, PollOnly: tc.poll > 0})
				runCtx, stop := context.WithCancel(ctx)
				done := make(chan error, 1)
				go func() { done <- relay.Run(runCtx) }()
				service := shop.NewOrderService(db)
				var delays []time.Duration
				for range tc.orders {
					time.Sleep(time.Duration(random.Int64N(int64(tc.pause))))
					if _, err := service.PlaceOrder(ctx, 2500); err != nil {
						b.Fatal(err)
					}
					committed := time.Now()
					select {
					case <-received:
						delays = append(delays, time.Since(committed))
					case <-time.After(time.Minute):
						b.Fatal("no message in a minute")
					}
				}
				stop()
				<-done
				slices.Sort(delays)
				b.ReportMetric(float64(delays[len(delays)/2].Microseconds())/1000, "p50-ms")
				if len(delays) >= 100 {
					b.ReportMetric(float64(delays[len(delays)*99/100].Microseconds())/1000, "p99-ms")
				} else { // too few samples for a 99th percentile: the slowest
					b.ReportMetric(float64(delays[len(delays)-1].Microseconds())/1000, "max-ms")
				}
			}
		})
	}
}

// BenchmarkDrain drains 200,000 pending rows with one relay in passes of
// 100, and reports the drain rate of its first and its last tenth, then the
// time of an empty pass and what its claim reads, before and after VACUUM:
// with the module's mark (an UPDATE of sent_at), with and without
// the migrations' autovacuum settings for the outbox, and with the other common
// design, deleting each row once the broker accepted it. How soon autovacuum
// looks is the server's autovacuum_naptime, which make measure-postgres sets
// to 1 s.
func BenchmarkDrain(b *testing.B) {
	once(b)
	const rows, tenth = 200_000, 20_000
	ctx := context.Background()
	for _, tc := range []struct{ mark, vacuum string }{
		{"update", "schema"}, {"update", "default"}, {"delete", "schema"},
	} {
		mark := tc.mark
		b.Run("mark="+mark+"/autovacuum="+tc.vacuum, func(b *testing.B) {
			for b.Loop() {
				db := newDatabase(b)
				if tc.vacuum == "default" { // without the migrations' settings for the outbox
					if _, err := db.ExecContext(ctx, `ALTER TABLE outbox RESET (autovacuum_vacuum_scale_factor,
						autovacuum_vacuum_threshold, autovacuum_vacuum_cost_delay)`); err != nil {
						b.Fatal(err)
					}
				}
				if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload)
					SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500) FROM generate_series(1, $1) g`, rows); err != nil {
					b.Fatal(err)
				}
				if _, err := db.ExecContext(ctx, `VACUUM ANALYZE outbox`); err != nil {
					b.Fatal(err)
				}
				relay := newRelay(b, db, discard{})
				if mark == "delete" {
					postgres.SetMark(relay, `DELETE FROM outbox WHERE id = ANY($1)`)
				}
				var rates []float64
				for done := 0; done < rows; done += tenth {
					start := time.Now()
					for sent := 0; sent < tenth; {
						n, err := relay.PublishPending(ctx)
						if err != nil || n == 0 {
							b.Fatalf("pass = %d, %v", n, err)
						}
						sent += n
					}
					rates = append(rates, tenth/time.Since(start).Seconds())
				}
				b.Logf("mark=%s, autovacuum=%s: msg/s by tenth %.0f", mark, tc.vacuum, rates)
				b.ReportMetric(rates[0], "first-tenth-msg/s")
				b.ReportMetric(rates[len(rates)-1], "last-tenth-msg/s")
				b.ReportMetric(emptyPass(b, relay), "empty-pass-µs")
				b.ReportMetric(claimBuffers(b, db), "empty-claim-buffers")
				if _, err := db.ExecContext(ctx, `VACUUM outbox`); err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(emptyPass(b, relay), "vacuumed-empty-pass-µs")
				b.ReportMetric(claimBuffers(b, db), "vacuumed-claim-buffers")
			}
		})
	}
}

// BenchmarkClaimOverSentRows measures an empty pass on an outbox that keeps
// 200,000 rows marked sent, with autovacuum off for the table so that it
// changes nothing in between: as marked, after DeleteSent, and after VACUUM.
func BenchmarkClaimOverSentRows(b *testing.B) {
	once(b)
	const rows = 200_000
	ctx := context.Background()
	for b.Loop() {
		db := newDatabase(b)
		for _, q := range []string{
			`ALTER TABLE outbox SET (autovacuum_enabled = false)`,
			`INSERT INTO outbox (type, payload) SELECT 'OrderPlaced', '{}' FROM generate_series(1, 200000)`,
			`VACUUM ANALYZE outbox`,
			`UPDATE outbox SET sent_at = now()`, // the marks: 200,000 dead entries in outbox_unsent
		} {
			if _, err := db.ExecContext(ctx, q); err != nil {
				b.Fatal(err)
			}
		}
		relay := newRelay(b, db, discard{})
		b.ReportMetric(emptyPass(b, relay), "kept-empty-pass-µs")
		b.ReportMetric(claimBuffers(b, db), "kept-claim-buffers")
		start := time.Now()
		if n, err := sqlOutbox(b, db, postgres.Config{}).DeleteSent(ctx, 0); n != rows || err != nil {
			b.Fatalf("DeleteSent = %d, %v", n, err)
		}
		b.ReportMetric(float64(time.Since(start).Milliseconds()), "cleanup-ms")
		b.ReportMetric(emptyPass(b, relay), "cleaned-empty-pass-µs")
		b.ReportMetric(claimBuffers(b, db), "cleaned-claim-buffers")
		if _, err := db.ExecContext(ctx, `VACUUM outbox`); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(emptyPass(b, relay), "vacuumed-empty-pass-µs")
		b.ReportMetric(claimBuffers(b, db), "vacuumed-claim-buffers")
	}
}

// emptyPass is the median time of 51 passes that find nothing, in µs.
func emptyPass(b *testing.B, relay *postgres.OutboxRelay) float64 {
	b.Helper()
	var times []time.Duration
	for range 51 {
		start := time.Now()
		if n, err := relay.PublishPending(context.Background()); n != 0 || err != nil {
			b.Fatalf("empty pass = %d, %v", n, err)
		}
		times = append(times, time.Since(start))
	}
	slices.Sort(times)
	return float64(times[len(times)/2].Nanoseconds()) / 1000
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

// once skips a measurement unless it is run once (-benchtime 1x), as make
// measure-postgres does: each makes a database of 200,000 rows or takes half
// a minute, and b.Loop would repeat it.
func once(b *testing.B) {
	if f := flag.Lookup("test.benchtime"); f == nil || f.Value.String() != "1x" {
		b.Skip("a measurement: run it with -benchtime 1x, as make measure-postgres does")
	}
}

// serverVersion is the server's version, for the figures to say where they
// were measured.
func serverVersion(b *testing.B) string {
	var v string
	if err := open(b, pgtest.Config.Database, "").QueryRow(`SHOW server_version`).Scan(&v); err != nil {
		b.Fatal(err)
	}
	return v
}
