package natsbroker_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop/shoptest"
)

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
			newPipeline(b, startBenchBroker(b, cfg.broker), cfg.relay, cfg.consumer).Run(b)
		})
	}
}

// once skips a measurement unless it runs once.
func once(b *testing.B) {
	if b.N != 1 {
		b.Skip("a measurement: run it with -benchtime 1x, as make knee does")
	}
}

// newPipeline is BenchmarkKnee's shop through the broker at url: its
// clients, the relay it names and the consumer it names.
func newPipeline(b *testing.B, url, relay, consumer string) *shoptest.Pipeline {
	db := newDatabase(b)
	db.SetMaxOpenConns(40)
	db.SetMaxIdleConns(40)
	p := shoptest.NewPipeline(db, consumer != "ack-only")
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
		goRun(b, newConsumer(b, cons, p, natsbroker.ConsumerOptions{MaxBatch: shoptest.KneeBatch}).Run)
	case "four":
		for range 4 {
			runConsumer(b, connect(b, url), p)
		}
	default: // one, ack-only
		runConsumer(b, connect(b, url), p)
	}
	p.WarmUp(b)
	var pgVersion string
	if err := db.QueryRow(`SHOW server_version`).Scan(&pgVersion); err != nil {
		b.Fatal(err)
	}
	b.Logf("PostgreSQL %s, nats-server %s", pgVersion, server.VERSION)
	return p
}
