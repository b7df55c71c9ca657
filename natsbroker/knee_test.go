package natsbroker_test

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

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// kneeRates are the rates, in orders a second, that BenchmarkKnee offers
// in turn, each for kneeStep.
var kneeRates = []int{100, 200, 300, 400, 500, 600, 700, 800, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 8000}

const kneeStep = 3 * time.Second

// kneeClients is how many clients place BenchmarkKnee's orders.
const kneeClients = 32

// kneeBatch is the MaxBatch of BenchmarkKnee's batch consumer.
const kneeBatch = 64

// BenchmarkKnee offers orders at rising rates through the whole pipeline:
// 32 clients placing orders (OrderService, one transaction each), a relay
// publishing to JetStream, and the warehouse's side, as the shop runs it.
// Through one server and a cluster of three (stream and consumer
// replicated three times; neither syncs before its acks), with the polling
// relay (Run, woken by NOTIFY, as NewOutboxRelay makes it) and the log
// relay on one server (marking what it delivered, as the relay process
// runs it). The warehouse's side is, in turn:
//   - ack-only: a Consumer that acks each message on delivery and applies
//     nothing: the rate the producers and the relay reach together, the
//     ceiling the warehouse is measured against;
//   - one: a Consumer applying one message a transaction (ApplyOnce), the
//     article's way;
//   - batch: a Consumer applying what is delivered in one transaction, up
//     to kneeBatch messages (MaxBatch, ApplyBatch);
//   - four: four Consumers, one message a transaction each, sharing the
//     warehouse's JetStream consumer (one server, the polling relay).
//
// Two orders from each client warm it up. Each rate is offered for 3 s,
// on a schedule (an order due every 1/rate, whether or not the clients
// keep up), and then every order of the step is waited for before the
// next begins. Each sub-benchmark reports the rate the clients placed
// (placed/s), the rate the warehouse applied them (delivered, for
// ack-only), from the step's start to its last (applied/s), and the time
// from each order's commit to the warehouse's commit of its reservation
// (p50-ms, p99-ms). A configuration stops at the first rate the clients or
// the pipeline fall 10 % short of, or whose median delay is over a second.
// make knee runs it once, and plots it.
func BenchmarkKnee(b *testing.B) {
	once(b)
	type config struct{ broker, relay, consumer string }
	var configs []config
	for _, path := range []struct{ broker, relay string }{{"one", "poll"}, {"one", "log"}, {"cluster3", "poll"}} {
		for _, consumer := range []string{"ack-only", "one", "batch"} {
			configs = append(configs, config{path.broker, path.relay, consumer})
		}
	}
	configs = append(configs, config{"one", "poll", "four"})
	for _, cfg := range configs {
		b.Run(fmt.Sprintf("broker=%s/relay=%s/consumer=%s", cfg.broker, cfg.relay, cfg.consumer), func(b *testing.B) {
			p := newPipeline(b, startBenchBroker(b, cfg.broker), cfg.relay, cfg.consumer)
			for _, rate := range kneeRates {
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
					break
				}
			}
		})
	}
}

// once skips a measurement unless it runs once.
func once(b *testing.B) {
	if b.N != 1 {
		b.Skip("a measurement: run it with -benchtime 1x, as make knee does")
	}
}

// pipeline is BenchmarkKnee's shop: its clients, relay and consumer.
type pipeline struct {
	db        *sql.DB
	service   *shop.OrderService
	warehouse *shop.Warehouse // nil: ack-only, nothing applied

	mu        sync.Mutex
	committed map[int64]time.Time
	applied   map[int64]time.Time
	reserved  chan struct{} // a token for each order applied
}

func newPipeline(b *testing.B, url, relay, consumer string) *pipeline {
	db := newDatabase(b)
	db.SetMaxOpenConns(40)
	db.SetMaxIdleConns(40)
	p := &pipeline{db: db, service: shop.NewOrderService(db),
		committed: map[int64]time.Time{}, applied: map[int64]time.Time{}, reserved: make(chan struct{}, 1<<16)}
	pub := newPublisher(b, connect(b, url))
	switch relay {
	case "poll":
		goRun(b, newRelay(b, db, pub).Run)
	case "log":
		var name string
		if err := db.QueryRow(`SELECT current_database()`).Scan(&name); err != nil {
			b.Fatal(err)
		}
		ctx := context.Background()
		if err := tableOutbox(db).CreateLogSlot(ctx, name); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { // after the relay's stop: cleanups run last first
			if err := tableOutbox(db).DropLogSlot(ctx, name); err != nil {
				b.Error(err)
			}
		})
		ob, err := postgres.OpenDB(db, postgres.Config{})
		if err != nil {
			b.Fatal(err)
		}
		r, err := ob.NewLogRelay(fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable",
			pgtest.Config.Host, pgtest.Config.Port, pgtest.Config.User, name), pub, postgres.LogRelayConfig{Slot: name})
		if err != nil {
			b.Fatal(err)
		}
		goRun(b, r.Run)
	}
	if consumer != "ack-only" {
		p.warehouse = shop.NewWarehouse(db)
	}
	switch consumer {
	case "batch":
		js, err := jetstream.New(connect(b, url))
		if err != nil {
			b.Fatal(err)
		}
		cons, err := js.Consumer(context.Background(), natsbroker.Stream, "warehouse")
		if err != nil {
			b.Fatal(err)
		}
		goRun(b, newConsumer(b, cons, p, natsbroker.ConsumerOptions{MaxBatch: kneeBatch}).Run)
	case "four":
		for range 4 {
			runConsumer(b, connect(b, url), p)
		}
	default: // one, ack-only
		runConsumer(b, connect(b, url), p)
	}
	var wg sync.WaitGroup // warm up: every client's connection made, every statement prepared
	for range kneeClients {
		wg.Go(func() {
			for range 2 {
				if _, err := p.service.PlaceOrder(context.Background(), 2500); err != nil {
					b.Error(err)
				}
			}
		})
	}
	wg.Wait()
	for range 2 * kneeClients {
		<-p.reserved
	}
	var pgVersion string
	if err := db.QueryRow(`SHOW server_version`).Scan(&pgVersion); err != nil {
		b.Fatal(err)
	}
	b.Logf("PostgreSQL %s, nats-server %s", pgVersion, server.VERSION)
	return p
}

// Handle applies msg to the warehouse (or, ack-only, nothing) and notes
// when, for an OrderPlaced.
func (p *pipeline) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
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
func (p *pipeline) HandleBatch(ctx context.Context, msgs []postgres.Message) ([]bool, error) {
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
func (p *pipeline) note(msg postgres.Message) error {
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

// stepResult is what one rate gave.
type stepResult struct {
	placed, applied float64 // orders a second
	p50, p99        time.Duration
}

// step offers rate orders a second for kneeStep through kneeClients clients, waits
// for every order to be applied, and measures.
func (p *pipeline) step(b *testing.B, rate int) stepResult {
	n := int(float64(rate) * kneeStep.Seconds())
	due := make(chan struct{}, n)
	ids := make(chan int64, n)
	var wg sync.WaitGroup
	var failed error
	var failOnce sync.Once
	for range kneeClients {
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
