package postgres_test

import (
	"context"
	"strconv"
	"testing"

	"example.com/patterns/enterprise/outbox"
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

func (discard) Publish(context.Context, outbox.Message) error { return nil }
