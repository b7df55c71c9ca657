package shoptest

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// KneeRates are the rates, in orders a second, that a knee offers in
// turn, each for KneeStep.
var KneeRates = []int{100, 200, 300, 400, 500, 600, 700, 800, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 8000}

// KneeStep is how long each rate is offered.
const KneeStep = 3 * time.Second

// KneeClients is how many clients place a knee's orders.
const KneeClients = 32

// KneeBatch is the MaxBatch of a knee's batch consumer.
const KneeBatch = 64

// Pipeline is a knee's shop, as the brokers' BenchmarkKnee run it: 32
// clients placing orders (OrderService, one transaction each), and the
// warehouse's side, a handler for the broker's consumer, which notes when
// each order was applied. The relay and the consumer between them are the
// benchmark's. Its methods are safe for concurrent use.
type Pipeline struct {
	service   *shop.OrderService
	warehouse *shop.Warehouse // nil: ack-only, nothing applied

	mu        sync.Mutex
	committed map[int64]time.Time
	applied   map[int64]time.Time
	reserved  chan struct{} // a token for each order applied
}

// NewPipeline returns the Pipeline of the shop in db, applying what it
// is handed to the warehouse, or, if not apply, nothing (ack-only: the
// rate the producers and the relay reach together).
func NewPipeline(db *sql.DB, apply bool) *Pipeline {
	p := &Pipeline{service: shop.NewOrderService(db),
		committed: map[int64]time.Time{}, applied: map[int64]time.Time{}, reserved: make(chan struct{}, 1<<16)}
	if apply {
		p.warehouse = shop.NewWarehouse(db)
	}
	return p
}

// Handle applies msg to the warehouse (or, ack-only, nothing) and notes
// when, for an OrderPlaced.
func (p *Pipeline) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	ok, err := true, error(nil)
	if p.warehouse != nil {
		ok, err = p.warehouse.Handle(ctx, msg)
	}
	if ok {
		err = errors.Join(err, p.note(msg))
	}
	return ok, err
}

// HandleBatch applies msgs to the warehouse in one transaction and notes
// when, for each OrderPlaced applied.
func (p *Pipeline) HandleBatch(ctx context.Context, msgs []postgres.Message) ([]bool, error) {
	if p.warehouse == nil {
		return nil, errors.New("an ack-only pipeline applies no batches")
	}
	applied, err := p.warehouse.HandleBatch(ctx, msgs)
	if err != nil {
		return nil, err
	}
	for i, m := range msgs {
		if applied[i] {
			if err := p.note(m); err != nil {
				return applied, err
			}
		}
	}
	return applied, nil
}

// note notes msg applied now, if it is an OrderPlaced.
func (p *Pipeline) note(msg postgres.Message) error {
	if msg.Type != shop.OrderPlaced {
		return nil
	}
	var order struct {
		OrderID int64 `json:"orderId"`
	}
	if err := json.Unmarshal([]byte(msg.Payload), &order); err != nil {
		return err
	}
	p.mu.Lock()
	p.applied[order.OrderID] = time.Now()
	p.mu.Unlock()
	p.reserved <- struct{}{}
	return nil
}

// WarmUp has each client place two orders, and waits until all are
// applied: every connection made, every statement prepared.
func (p *Pipeline) WarmUp(b *testing.B) {
	var wg sync.WaitGroup
	for range KneeClients {
		wg.Go(func() {
			for range 2 {
				if _, err := p.service.PlaceOrder(context.Background(), 2500); err != nil {
					b.Error(err)
				}
			}
		})
	}
	wg.Wait()
	for range 2 * KneeClients {
		select {
		case <-p.reserved:
		case <-time.After(2 * time.Minute):
			b.Fatal("the warm-up's orders not all applied within 2 min")
		}
	}
}

// Run offers each of KneeRates in turn, each a sub-benchmark reporting
// the rate the clients placed (placed/s), the rate the warehouse applied
// them (applied/s), from the step's start to its last, and the time from
// each order's commit to the warehouse's commit of its reservation (p50-ms,
// p99-ms); it stops at the first rate the clients or the pipeline fall 10 %
// short of, or whose median delay is over a second.
func (p *Pipeline) Run(b *testing.B) {
	for _, rate := range KneeRates {
		var short bool
		b.Run(fmt.Sprintf("rate=%d", rate), func(b *testing.B) {
			s := p.step(b, rate)
			b.ReportMetric(s.placed, "placed/s")
			b.ReportMetric(s.applied, "applied/s")
			b.ReportMetric(float64(s.p50.Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(s.p99.Microseconds())/1000, "p99-ms")
			short = s.placed < 0.9*float64(rate) || s.applied < 0.9*float64(rate) || s.p50 > time.Second
		})
		if short {
			return
		}
	}
}

// stepResult is what one rate gave.
type stepResult struct {
	placed, applied float64 // orders a second
	p50, p99        time.Duration
}

// step offers rate orders a second for KneeStep through KneeClients
// clients, on a schedule (an order due every 1/rate, whether or not the
// clients keep up), waits for every order to be applied, and measures.
func (p *Pipeline) step(b *testing.B, rate int) stepResult {
	n := int(float64(rate) * KneeStep.Seconds())
	due := make(chan struct{}, n)
	ids := make(chan int64, n)
	var wg sync.WaitGroup
	var failed error
	var failOnce sync.Once
	for range KneeClients {
		wg.Go(func() {
			for range due {
				id, err := p.service.PlaceOrder(context.Background(), 2500)
				if err != nil {
					failOnce.Do(func() { failed = err })
					continue
				}
				p.mu.Lock()
				p.committed[id] = time.Now()
				p.mu.Unlock()
				ids <- id
			}
		})
	}
	start := time.Now()
	for sent := 0; sent < n; time.Sleep(time.Millisecond) { // the schedule: an order due every 1/rate
		for ; sent < min(n, int(time.Since(start).Seconds()*float64(rate))+1); sent++ {
			due <- struct{}{}
		}
	}
	close(due)
	wg.Wait()
	placedIn := time.Since(start)
	close(ids)
	if failed != nil {
		b.Fatal(failed)
	}
	deadline := time.After(2 * time.Minute)
	for range n {
		select {
		case <-p.reserved:
		case <-deadline:
			b.Fatalf("rate %d: orders not all reserved within 2 min of the step", rate)
		}
	}
	appliedIn := time.Since(start)
	p.mu.Lock()
	defer p.mu.Unlock()
	var delays []time.Duration
	for id := range ids {
		delays = append(delays, p.applied[id].Sub(p.committed[id]))
	}
	slices.Sort(delays)
	return stepResult{
		placed:  float64(n) / placedIn.Seconds(),
		applied: float64(n) / appliedIn.Seconds(),
		p50:     delays[len(delays)/2],
		p99:     delays[len(delays)*99/100],
	}
}

// DrainRows makes b.N rows pass through relay, as the brokers'
// BenchmarkDrain measure it: insert writes the rows numbered $1 to $2, in
// chunks of 1,000 with the timer stopped, and the relay's passes run with
// it going until each chunk is sent.
func DrainRows(b *testing.B, db *sql.DB, relay *postgres.OutboxRelay, insert string) {
	ctx := context.Background()
	b.ResetTimer()
	for done := 0; done < b.N; {
		chunk := min(1000, b.N-done)
		b.StopTimer()
		if _, err := db.ExecContext(ctx, insert, done+1, done+chunk); err != nil {
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
}
