package natsbroker_test

import (
	"context"
	"database/sql"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/postgres/shop/shoptest"
)

// The benchmarks behind the figures in REFERENCE.md; make measure-natsbroker
// runs them on a throwaway PostgreSQL with an embedded JetStream whose
// store is on disk.

// BenchmarkDrain is the relay's drain rate to JetStream, per message, in
// passes of 100 rows, through three brokers: one server (broker=one), one
// server that syncs its store to disk before each ack (broker=one-always,
// sync_interval: always), and a cluster of three with the stream and its
// consumer replicated three times (broker=cluster3, an ack once two of the
// three stored it), and the same whose servers sync before each ack
// (broker=cluster3-always, as the shop's cluster runs). With ack=each the
// relay, keeping order per aggregate, waits for each message's ack before it
// publishes the next (the Publisher with Publish alone); with ack=batch it
// publishes the pass's batch asynchronously and then waits for the acks
// (PublishBatch, which only a relay with PerAggregate may use); with
// ack=sequence the relay keeps the whole table's order and publishes the
// pass's batch as one fast batch (PublishSequence). Rows are written in
// chunks of 1,000 with the timer stopped.
func BenchmarkDrain(b *testing.B) {
	for _, broker := range []string{"one", "one-always", "cluster3", "cluster3-always"} {
		for _, mode := range []string{"each", "batch", "sequence"} {
			b.Run("broker="+broker+"/ack="+mode, func(b *testing.B) {
				drain(b, startBenchBroker(b, broker), mode)
			})
		}
	}
}

// startBenchBroker starts the broker a benchmark names, with the stream and
// the warehouse's consumer set up, and returns its URL: one server (one),
// one that syncs before each ack (one-always), a cluster of three with
// three replicas (cluster3), and the same syncing (cluster3-always).
func startBenchBroker(b *testing.B, name string) (url string) {
	switch name {
	case "one", "one-always":
		var edit func(*server.Options)
		if name == "one-always" {
			edit = func(o *server.Options) { o.SyncAlways = true }
		}
		br := startBroker(b, edit)
		setUp(b, connect(b, br.url()), 0, 0)
		return br.url()
	case "cluster3", "cluster3-always":
		var edit func(*server.Options)
		if name == "cluster3-always" {
			edit = func(o *server.Options) { o.SyncAlways = true }
		}
		c := startClusterWith(b, 3, edit)
		setUpReplicated(b, c)
		return c.url()
	}
	b.Fatalf("no broker %q", name)
	return ""
}

// drain is BenchmarkDrain's loop, through the broker at url.
func drain(b *testing.B, url, mode string) {
	db := newDatabase(b)
	pub := newPublisher(b, connect(b, url))
	var relay *postgres.OutboxRelay
	switch mode {
	case "each":
		relay = newRelay(b, db, publishOnly{pub})
	case "batch":
		relay = newRelay(b, db, batchOnly{pub})
	case "sequence":
		relay = newRelay(b, db, pub, postgres.RelayConfig{WholeTable: true}) // the whole table's order, which only a sequence keeps
	}
	drainRows(b, db, relay, "NULL")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}

// drainRows makes b.N rows pass through relay (shoptest.DrainRows), each
// with traceparent as its trace context (an SQL literal, or NULL).
func drainRows(b *testing.B, db *sql.DB, relay *postgres.OutboxRelay, traceparent string) {
	shoptest.DrainRows(b, db, relay, `INSERT INTO outbox (type, payload, traceparent)
		SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500), `+traceparent+` FROM generate_series($1::int, $2::int) g`)
}

// BenchmarkLatency is the time from an order's commit (PlaceOrder's
// return) to its reservation (the warehouse's commit, as the consumer's
// handler returns), end to end: Run woken by NOTIFY, publishing to
// JetStream, and a consumer feeding the warehouse. 300 orders, one at a
// time, each after a random pause of up to 20 ms (seeded, logged) so that
// orders do not line up with anything. It reports the median and the 99th
// percentile; it runs once whatever b.N.
func BenchmarkLatency(b *testing.B) {
	const orders = 300
	db := newDatabase(b)
	br := startBroker(b, nil)
	setUp(b, connect(b, br.url()), 0, 0)
	relay := newRelay(b, db, newPublisher(b, connect(b, br.url())))
	goRun(b, relay.Run)
	applied := make(chan time.Time, orders)
	runConsumer(b, connect(b, br.url()), timed{shop.NewWarehouse(db), applied})
	service := shop.NewOrderService(db)
	const seed = 18
	var pgVersion string
	if err := db.QueryRow(`SHOW server_version`).Scan(&pgVersion); err != nil {
		b.Fatal(err)
	}
	b.Logf("seed %d, PostgreSQL %s, nats-server %s", seed, pgVersion, server.VERSION)
	rng := rand.New(rand.NewPCG(seed, 0))

	b.ResetTimer()
	var delays []time.Duration
	for range orders {
		time.Sleep(time.Duration(rng.Int64N(int64(20 * time.Millisecond))))
		if _, err := service.PlaceOrder(context.Background(), 2500); err != nil {
			b.Fatal(err)
		}
		committed := time.Now()
		select {
		case at := <-applied:
			delays = append(delays, at.Sub(committed))
		case <-time.After(30 * time.Second):
			b.Fatal("order not reserved within 30 s")
		}
	}
	b.StopTimer()
	slices.Sort(delays)
	p50, p99 := delays[len(delays)/2], delays[len(delays)*99/100]
	b.ReportMetric(float64(p50.Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(p99.Microseconds())/1000, "p99-ms")
	b.Logf("commit to reservation, %d orders: median %v, 99th percentile %v, max %v", orders, p50, p99, delays[len(delays)-1])
}

// timed hands messages to a warehouse and sends the time of each
// application on applied.
type timed struct {
	w       *shop.Warehouse
	applied chan<- time.Time
}

func (t timed) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	ok, err := t.w.Handle(ctx, msg)
	if ok {
		t.applied <- time.Now()
	}
	return ok, err
}

// BenchmarkRelayTracing is the cost of tracing on the relay's drain, per
// message, in passes of 100 rows to a broker that accepts everything at once
// (so the relay's and the database's share alone): trace=none, no tracer
// provider and rows written outside any trace; trace=stored, no provider and
// rows that carry a trace context, which the relay passes on; trace=sdk,
// the OpenTelemetry SDK sampling every span, batched to an exporter that
// drops them, and rows that carry a trace context: a span for each pass and
// each publish. Rows are written in chunks of 1,000 with the timer stopped.
func BenchmarkRelayTracing(b *testing.B) {
	for _, mode := range []string{"none", "stored", "sdk"} {
		b.Run("trace="+mode, func(b *testing.B) {
			ctx := context.Background()
			db := newDatabase(b)
			var cfg postgres.RelayConfig
			if mode == "sdk" {
				tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(dropSpans{}))
				b.Cleanup(func() { tp.Shutdown(ctx) })
				cfg.TracerProvider = tp
			}
			relay := newRelay(b, db, acceptAll{}, cfg)
			trace := "NULL"
			if mode != "none" {
				trace = `'00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'`
			}
			drainRows(b, db, relay, trace)
		})
	}
}

// acceptAll is a broker that accepts every message and keeps nothing.
type acceptAll struct{}

func (acceptAll) Publish(context.Context, postgres.Message) error { return nil }

// dropSpans is a span exporter that drops what it is given.
type dropSpans struct{}

func (dropSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (dropSpans) Shutdown(context.Context) error                             { return nil }
