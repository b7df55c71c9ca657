package rabbitbroker_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/postgres/shop/shoptest"
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
			db := newDatabase(b)
			top := declare(b, node.URL(), 0)
			var broker postgres.MessageBroker = newPublisher(b, node.URL(), top, 0)
			if mode == "each" {
				broker = publishOnly{broker}
			}
			relay := newRelay(b, db, broker)
			shoptest.DrainRows(b, db, relay, `INSERT INTO outbox (type, payload, aggregate, seq)
				SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500), 'order/' || g, 1 FROM generate_series($1::int, $2::int) g`)
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
		})
	}
}

// publishOnly offers the relay Publish alone.
type publishOnly struct{ postgres.MessageBroker }

// BenchmarkLatency is the time from an order's commit (PlaceOrder's return)
// to its reservation (the warehouse's commit, as the consumer's handler
// returns), end to end, at a steady rate: 8 clients place 100, 300 or
// 1,000 orders a second together for 3 s, Run is woken by each commit's
// NOTIFY and publishes with confirms in flight to the shared node, and a
// Consumer feeds the warehouse, one message at a time, four aggregates at
// once (Concurrency, with a prefetch of 40), or one worker applying up to 32
// messages a transaction (MaxBatch, Warehouse.HandleBatch). It reports the rate at which
// orders were placed; how busy the machine's CPUs were meanwhile, all its
// processes (PostgreSQL, the node, this binary); and the median and the
// p99 from commit to delivery (the handler's first call) and to
// reservation. It runs once whatever b.N.
func BenchmarkLatency(b *testing.B) {
	for _, rate := range []int{100, 300, 1000} {
		for _, workers := range []int{1, 4} {
			b.Run(fmt.Sprintf("rate=%d/concurrency=%d", rate, workers), func(b *testing.B) { latency(b, rate, workers, 1) })
		}
		b.Run(fmt.Sprintf("rate=%d/batch=%d", rate, latencyBatch), func(b *testing.B) { latency(b, rate, 1, latencyBatch) })
	}
}

// latencyBatch is the MaxBatch of BenchmarkLatency's batch consumer: one
// worker applying what it holds, up to 32 messages, in one transaction
// (Warehouse.HandleBatch), acked with one multiple ack.
const latencyBatch = 32

// latency is BenchmarkLatency at rate orders a second, the consumer with
// workers workers, each handing the warehouse up to maxBatch messages at
// once.
func latency(b *testing.B, rate, workers, maxBatch int) {
	const clients, seconds = 8, 3
	orders := rate * seconds
	db := newDatabase(b)
	db.SetMaxIdleConns(clients + 4)
	top := declare(b, node.URL(), 0)
	relay := newRelay(b, db, newPublisher(b, node.URL(), top, 0))
	goRun(b, relay.Run)
	l := &latencies{committed: map[int64]time.Time{}, delivered: map[int64]time.Time{}, applied: map[int64]time.Time{}, w: shop.NewWarehouse(db)}
	c := newConsumer(b, dialer(node.URL()), top.Queue, l, rabbitbroker.ConsumerOptions{Concurrency: workers, Prefetch: 40, MaxBatch: maxBatch})
	goRun(b, c.Run)
	service := shop.NewOrderService(db)
	// One order through the whole pipeline first, outside the measure: the
	// relay listening, the consumer consuming, every connection made.
	if _, err := service.PlaceOrder(context.Background(), 100); err != nil {
		b.Fatal(err)
	}
	waitFor(b, "the first order reserved", func() bool { return c.Applied() == 1 })
	clear(l.committed)
	clear(l.delivered)
	clear(l.applied)
	b.ResetTimer()
	busy0, total0 := cpuTimes(b)
	// The orders fall due one every 1/rate, evenly, whichever client is
	// free takes the next: a steady rate, not the clients' bursts together.
	due := make(chan struct{}, orders)
	start := time.Now()
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for range due {
				id, err := service.PlaceOrder(context.Background(), 2500)
				if err != nil {
					b.Error(err)
					continue
				}
				l.commit(id, time.Now())
			}
		})
	}
	for sent := 0; sent < orders; time.Sleep(time.Millisecond) {
		for ; sent < min(orders, int(time.Since(start).Seconds()*float64(rate))+1); sent++ {
			due <- struct{}{}
		}
	}
	close(due)
	wg.Wait()
	placed := time.Since(start)
	waitFor(b, "every order reserved", func() bool { return c.Applied() >= int64(orders)+1 })
	b.StopTimer()
	busy1, total1 := cpuTimes(b)
	cpu := 100 * float64(busy1-busy0) / float64(max(total1-total0, 1))
	delivered, delays := l.delays(l.delivered), l.delays(l.applied)
	if len(delivered) != len(delays) {
		b.Fatalf("%d orders delivered, %d applied: want every one of them both", len(delivered), len(delays))
	}
	p50, p99 := delays[len(delays)/2], delays[len(delays)*99/100]
	d50, d99 := delivered[len(delivered)/2], delivered[len(delivered)*99/100]
	b.ReportMetric(float64(len(delays))/placed.Seconds(), "orders/s")
	b.ReportMetric(cpu, "cpu-busy-%")
	b.ReportMetric(float64(d50.Microseconds())/1000, "delivered-p50-ms")
	b.ReportMetric(float64(d99.Microseconds())/1000, "delivered-p99-ms")
	b.ReportMetric(float64(p50.Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(p99.Microseconds())/1000, "p99-ms")
	b.Logf("%d orders offered at %d a second (%.0f a second placed), the machine's CPUs %.0f%% busy: commit to delivery median %v, p99 %v; commit to reservation median %v, p99 %v, max %v",
		len(delays), rate, float64(len(delays))/placed.Seconds(), cpu, d50, d99, p50, p99, delays[len(delays)-1])
}

// latencies is a Handler that hands messages to a warehouse and records,
// by order id, when each order was committed, when its event first reached
// the consumer's handler, and when it was applied.
type latencies struct {
	w                             *shop.Warehouse
	mu                            sync.Mutex
	committed, delivered, applied map[int64]time.Time
}

func (l *latencies) commit(id int64, at time.Time) {
	l.mu.Lock()
	l.committed[id] = at
	l.mu.Unlock()
}

func (l *latencies) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	var o shop.Order
	read := json.Unmarshal([]byte(msg.Payload), &o) == nil
	if read {
		l.mu.Lock()
		if _, seen := l.delivered[o.ID]; !seen {
			l.delivered[o.ID] = time.Now()
		}
		l.mu.Unlock()
	}
	ok, err := l.w.Handle(ctx, msg)
	if ok && read {
		l.mu.Lock()
		l.applied[o.ID] = time.Now()
		l.mu.Unlock()
	}
	return ok, err
}

// HandleBatch is Handle for a batch, applied in one transaction: each
// order's delivery is noted before it, its reservation after its commit.
func (l *latencies) HandleBatch(ctx context.Context, msgs []postgres.Message) ([]bool, error) {
	ids := make([]int64, len(msgs))
	l.mu.Lock()
	for i, msg := range msgs {
		var o shop.Order
		if json.Unmarshal([]byte(msg.Payload), &o) != nil {
			ids[i] = -1
			continue
		}
		ids[i] = o.ID
		if _, seen := l.delivered[o.ID]; !seen {
			l.delivered[o.ID] = time.Now()
		}
	}
	l.mu.Unlock()
	applied, err := l.w.HandleBatch(ctx, msgs)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	l.mu.Lock()
	for i, ok := range applied {
		if ok && ids[i] >= 0 {
			l.applied[ids[i]] = now
		}
	}
	l.mu.Unlock()
	return applied, nil
}

// delays are the orders' times from commit to the moment of at (delivered
// or applied), sorted.
func (l *latencies) delays(at map[int64]time.Time) []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	var d []time.Duration
	for id, t := range at {
		if c, ok := l.committed[id]; ok {
			d = append(d, t.Sub(c))
		}
	}
	slices.Sort(d)
	return d
}

// cpuTimes are the machine's CPU time spent busy, and in all, since boot,
// in clock ticks, from the first line of /proc/stat (Linux's, as the node
// is): user, nice, system, idle, iowait, irq, softirq, steal.
func cpuTimes(b *testing.B) (busy, total uint64) {
	text, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	line, _, _ := strings.Cut(string(text), "\n")
	fields := strings.Fields(line)
	if len(fields) < 9 || fields[0] != "cpu" {
		b.Fatalf("/proc/stat begins %q, not with the line cpu", line)
	}
	for i, f := range fields[1:9] {
		v, err := strconv.ParseUint(f, 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		total += v
		if i != 3 && i != 4 { // idle and iowait
			busy += v
		}
	}
	return busy, total
}
