package postgres_test

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// BenchmarkRelays puts the two relays side by side on one server, each in
// turn on a database of its own: 8 producers place orders as fast as they
// can for 5 s while the relay delivers to a broker that notes when each
// order's event arrives. relay=poll is OutboxRelay.Run, woken by NOTIFY, in
// passes of 100; relay=log is LogRelay. It reports the orders committed a
// second, the events delivered a second (from the first commit to the last
// arrival), the delay from each order's commit to its event's arrival
// (median, 99th percentile, slowest), the log written per order while the
// producers ran, and, at the end, the outbox's dead tuples and the size of
// its index of unsent rows; for relay=poll, its passes with rows while the
// producers ran and the share of them that made the server flush its log
// (PassReport.Flushed); for the log relay, the 99th percentile of the
// delay from each transaction's commit to the server's sending it
// (sender-p99-ms), both by the server's clock: the server's share of the
// tail, the rest being the relay's and the broker's. relay=log runs as
// the relay process deploys it, marking what it delivered;
// relay=log-delete deletes it instead (LogRelayConfig.DeleteDelivered);
// relay=log-unmarked marks nothing, to show what the marks cost. Each
// relay has delivered one order before the producers start, so that the
// figures are of a relay running, not of one connecting: the orders
// committed while it connects wait for it, as after any restart. make
// measure-relays runs it.
func BenchmarkRelays(b *testing.B) {
	once(b)
	for _, kind := range []string{"poll", "log", "log-delete", "log-unmarked"} {
		b.Run("relay="+kind, func(b *testing.B) {
			b.Logf("PostgreSQL %s, 8 producers for 5 s", serverVersion(b))
			for b.Loop() {
				measureRelay(b, kind)
			}
		})
	}
}

// arrivals is a broker that notes when each order's event arrived.
type arrivals struct {
	mu sync.Mutex
	at map[int64]time.Time // order id -> first arrival
}

func (a *arrivals) Publish(_ context.Context, m postgres.Message) error {
	var order struct {
		ID int64 `json:"orderId"`
	}
	if err := json.Unmarshal([]byte(m.Payload), &order); err != nil {
		return err
	}
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, seen := a.at[order.ID]; !seen {
		a.at[order.ID] = now
	}
	return nil
}

func (a *arrivals) arrived(id int64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	_, ok := a.at[id]
	return ok
}

func (a *arrivals) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.at)
}

func measureRelay(b *testing.B, kind string) {
	ctx := context.Background()
	name := newDatabaseName(b)
	db := open(b, name, "")
	broker := &arrivals{at: map[int64]time.Time{}}
	var measuring atomic.Bool
	var passes, flushes atomic.Int64 // the polling relay's passes with rows, while the producers ran, and those that flushed
	var senderMu sync.Mutex
	var sender []time.Duration // the log relay's transactions, while the producers ran: from commit to the server's sending, by its clock
	runCtx, stopRelay := context.WithCancel(ctx)
	done := make(chan error, 1)
	switch kind {
	case "poll":
		relay := newRelay(b, open(b, name, "relay"), broker, postgres.RelayConfig{PollInterval: time.Second, OnPass: func(r postgres.PassReport) {
			if r.Claimed > 0 && measuring.Load() {
				passes.Add(1)
				if r.Flushed {
					flushes.Add(1)
				}
			}
		}})
		go func() { done <- relay.Run(runCtx) }()
	case "log", "log-delete", "log-unmarked":
		if err := postgres.CreateLogSlot(ctx, db, name); err != nil {
			b.Fatal(err)
		}
		// log marks in a database handle of its own, log-delete deletes;
		// log-unmarked marks nothing.
		ob := sqlOutbox(b, open(b, name, "relay"), postgres.Config{})
		relay, err := ob.NewLogRelay(logConnString(name), broker, postgres.LogRelayConfig{Slot: name,
			DeleteDelivered: kind == "log-delete", Unmarked: kind == "log-unmarked"})
		if err != nil {
			b.Fatal(err)
		}
		postgres.SetLogRelaySent(relay, func(commit, sent time.Time) {
			if measuring.Load() {
				senderMu.Lock()
				sender = append(sender, sent.Sub(commit))
				senderMu.Unlock()
			}
		})
		go func() { done <- relay.Run(runCtx) }()
	}
	// The producers' connections are open before the window, and stay
	// open (database/sql keeps 2 idle by default: the other 6 producers
	// would connect again after each order).
	const producers, window = 8, 5 * time.Second
	db.SetMaxIdleConns(producers)
	warm := make(chan int64, producers)
	var wg sync.WaitGroup
	for range producers {
		wg.Go(func() {
			id, err := shop.NewOrderService(db).PlaceOrder(ctx, 2500)
			if err != nil {
				b.Error(err)
			}
			warm <- id
		})
	}
	wg.Wait()
	close(warm)
	for id := range warm {
		for deadline := time.Now().Add(time.Minute); !broker.arrived(id); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				b.Fatalf("the %s relay delivered nothing in a minute", kind)
			}
		}
	}
	var walStart, walEnd string
	if err := db.QueryRow(`SELECT pg_current_wal_insert_lsn()::text`).Scan(&walStart); err != nil {
		b.Fatal(err)
	}

	var mu sync.Mutex
	committed := map[int64]time.Time{}
	var placed atomic.Int64
	start := time.Now()
	measuring.Store(true)
	for range producers {
		wg.Go(func() {
			service := shop.NewOrderService(db)
			for time.Since(start) < window {
				id, err := service.PlaceOrder(ctx, 2500)
				if err != nil {
					b.Error(err)
					return
				}
				now := time.Now()
				mu.Lock()
				committed[id] = now
				mu.Unlock()
				placed.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	measuring.Store(false)
	if err := db.QueryRow(`SELECT pg_current_wal_insert_lsn()::text`).Scan(&walEnd); err != nil {
		b.Fatal(err)
	}
	n := int(placed.Load())
	for deadline := time.Now().Add(3 * time.Minute); broker.count() < n+producers; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatalf("%d of %d events arrived in 3 minutes", broker.count()-producers, n)
		}
	}
	stopRelay()
	<-done

	var delays []time.Duration
	var last time.Time
	for id, c := range committed {
		a := broker.at[id]
		delays = append(delays, a.Sub(c))
		if a.After(last) {
			last = a
		}
	}
	slices.Sort(delays)
	var walBytes float64
	if err := db.QueryRow(`SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)`, walEnd, walStart).Scan(&walBytes); err != nil {
		b.Fatal(err)
	}
	// The statistics of dead tuples are sent by each backend shortly after
	// its transactions end: a moment for them to arrive.
	time.Sleep(2 * time.Second)
	var dead, indexBytes int64
	if err := db.QueryRow(`SELECT COALESCE((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox'), 0),
		pg_relation_size('outbox_unsent')`).Scan(&dead, &indexBytes); err != nil {
		b.Fatal(err)
	}
	if kind != "poll" {
		dropSlotOf(b, db, name)
	}
	b.ReportMetric(float64(n)/elapsed.Seconds(), "orders/s")
	b.ReportMetric(float64(n)/last.Sub(start).Seconds(), "delivered/s")
	b.ReportMetric(float64(delays[len(delays)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(delays[len(delays)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(delays[len(delays)-1].Microseconds())/1000, "max-ms")
	b.ReportMetric(walBytes/float64(n), "wal-B/order")
	if kind != "poll" {
		senderMu.Lock()
		sent := slices.Sorted(slices.Values(sender))
		senderMu.Unlock()
		if len(sent) == 0 {
			b.Fatal("the log relay reported no transaction sent while the producers ran")
		}
		b.ReportMetric(float64(sent[len(sent)*99/100].Microseconds())/1000, "sender-p99-ms")
	}
	if kind == "poll" {
		b.ReportMetric(float64(passes.Load()), "passes")
		b.ReportMetric(100*float64(flushes.Load())/float64(passes.Load()), "flushed-%")
	}
	b.ReportMetric(float64(dead), "dead-tuples")
	b.ReportMetric(float64(indexBytes)/1024, "unsent-index-kB")
}
