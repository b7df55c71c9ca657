package rabbitbroker_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

// BenchmarkDrain is the relay's drain rate to RabbitMQ (the shared node, a
// quorum queue), passes of 100 rows with PerAggregate, each order an
// aggregate of its own: ack=each waits for each message's confirm before it
// publishes the next (the Publisher with Publish alone); ack=batch publishes
// the pass's batch with confirms in flight, then waits for them
// (PublishBatch). Rows are written in chunks of 1,000 with the timer
// stopped, as natsbroker's BenchmarkDrain writes them.
func BenchmarkDrain(b *testing.B) {
	for _, mode := range []string{"each", "batch"} {
		b.Run("broker=rabbitmq/ack="+mode, func(b *testing.B) {
			ctx := context.Background()
			db := newDatabase(b)
			top := declare(b, node.URL(), 0)
			var broker postgres.MessageBroker = newPublisher(b, node.URL(), top, 0)
			if mode == "each" {
				broker = publishOnly{broker}
			}
			relay := postgres.NewOutboxRelay(db, broker)
			relay.PerAggregate = true
			b.ResetTimer()
			for done := 0; done < b.N; {
				chunk := min(1000, b.N-done)
				b.StopTimer()
				if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload, aggregate, seq)
					SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500), 'order/' || g, 1 FROM generate_series($1::int, $2::int) g`, done+1, done+chunk); err != nil {
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
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
		})
	}
}

// publishOnly offers the relay Publish alone.
type publishOnly struct{ postgres.MessageBroker }

// BenchmarkLatency is the time from an order's commit (PlaceOrder's return)
// to its reservation (the warehouse's commit, as the consumer's handler
// returns), end to end, at a steady rate: 8 clients place 300 or 1,000
// orders a second together for 3 s, Run is woken by each commit's NOTIFY
// and publishes with confirms in flight to the shared node, and a Consumer
// feeds the warehouse, one message at a time or four aggregates at once
// (Concurrency, with a prefetch of 40). It reports the rate at which orders
// were placed, the median and the p99; it runs once whatever b.N.
func BenchmarkLatency(b *testing.B) {
	for _, rate := range []int{300, 1000} {
		for _, workers := range []int{1, 4} {
			b.Run(fmt.Sprintf("rate=%d/concurrency=%d", rate, workers), func(b *testing.B) { latency(b, rate, workers) })
		}
	}
}

// latency is BenchmarkLatency at rate orders a second, the consumer with
// workers workers.
func latency(b *testing.B, rate, workers int) {
	const clients, seconds = 8, 3
	orders := clients * (rate * seconds / clients)
	db := newDatabase(b)
	db.SetMaxIdleConns(clients + 4)
	top := declare(b, node.URL(), 0)
	relay := postgres.NewOutboxRelay(db, newPublisher(b, node.URL(), top, 0))
	relay.PerAggregate = true
	goRun(b, relay.Run)
	l := &latencies{committed: map[int64]time.Time{}, applied: map[int64]time.Time{}, w: shop.NewWarehouse(db)}
	c := rabbitbroker.NewConsumer(dialer(node.URL()), top.Queue, l)
	c.Concurrency, c.Prefetch = workers, 40
	goRun(b, c.Run)
	service := shop.NewOrderService(db)
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			tick := time.NewTicker(time.Second * clients / time.Duration(rate))
			defer tick.Stop()
			for range orders / clients {
				<-tick.C
				id, err := service.PlaceOrder(context.Background(), 2500)
				if err != nil {
					b.Error(err)
					return
				}
				l.commit(id, time.Now())
			}
		})
	}
	wg.Wait()
	placed := time.Since(start)
	waitFor(b, "every order reserved", func() bool { return c.Applied() >= int64(orders) })
	b.StopTimer()
	delays := l.delays()
	slices.Sort(delays)
	p50, p99 := delays[len(delays)/2], delays[len(delays)*99/100]
	b.ReportMetric(float64(len(delays))/placed.Seconds(), "orders/s")
	b.ReportMetric(float64(p50.Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(p99.Microseconds())/1000, "p99-ms")
	b.Logf("commit to reservation, %d orders offered at %d a second (%.0f a second placed): median %v, p99 %v, max %v",
		len(delays), rate, float64(len(delays))/placed.Seconds(), p50, p99, delays[len(delays)-1])
}

// latencies is a Handler that hands messages to a warehouse and records,
// by order id, when each order was committed and when it was applied.
type latencies struct {
	w                  *shop.Warehouse
	mu                 sync.Mutex
	committed, applied map[int64]time.Time
}

func (l *latencies) commit(id int64, at time.Time) {
	l.mu.Lock()
	l.committed[id] = at
	l.mu.Unlock()
}

func (l *latencies) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	ok, err := l.w.Handle(ctx, msg)
	if ok {
		var o shop.Order
		if json.Unmarshal([]byte(msg.Payload), &o) == nil {
			l.mu.Lock()
			l.applied[o.ID] = time.Now()
			l.mu.Unlock()
		}
	}
	return ok, err
}

// delays are the orders' times from commit to application.
func (l *latencies) delays() []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	var d []time.Duration
	for id, at := range l.applied {
		if c, ok := l.committed[id]; ok {
			d = append(d, at.Sub(c))
		}
	}
	return d
}
