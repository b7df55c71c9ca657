package kafkabroker_test

import (
	"context"
	"fmt"
	"runtime/debug"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop/shoptest"
)

// once skips a measurement unless it runs once.
func once(b *testing.B) {
	if b.N != 1 {
		b.Skip("a measurement: run it with -benchtime 1x, as make knee does")
	}
}

// publishOnly hides PublishBatch: the relay publishes each message and
// waits for its acknowledgement before the next.
type publishOnly struct{ p *kafkabroker.Publisher }

func (p publishOnly) Publish(ctx context.Context, m postgres.Message) error {
	return p.p.Publish(ctx, m)
}

// BenchmarkDrain is the polling relay's drain rate to Kafka (franz-go's
// kfake, three brokers in the benchmark's process, a topic of six
// partitions with three replicas; acks=all from an idempotent producer),
// as natsbroker's BenchmarkDrain measures it on JetStream (shoptest.DrainRows),
// each waiting for each record's
// acknowledgement (ack=each) or publishing a pass's batch at once and
// waiting for them in order (ack=batch, PublishBatch); through a client
// with kgo's default ProducerLinger, 10 ms, which holds each partition's
// first record that long for more to join it, and with none.
func BenchmarkDrain(b *testing.B) {
	for _, linger := range []time.Duration{10 * time.Millisecond, 0} {
		for _, mode := range []string{"each", "batch"} {
			b.Run(fmt.Sprintf("broker=kfake3/linger=%v/ack=%s", linger, mode), func(b *testing.B) {
				drainTo(b, linger, mode)
			})
		}
	}
}

// drainTo is BenchmarkDrain's run, through a client whose ProducerLinger
// is linger.
func drainTo(b *testing.B, linger time.Duration, mode string) {
	c := newCluster(b)
	topic := c.topic(6, nil)
	db := newDatabase(b)
	pub, err := kafkabroker.NewPublisher(c.client(kgo.ProducerLinger(linger)), kafkabroker.PublisherOptions{Topic: topic})
	if err != nil {
		b.Fatal(err)
	}
	var broker postgres.MessageBroker = pub
	if mode == "each" {
		broker = publishOnly{pub}
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		b.Fatal(err)
	}
	relay, err := ob.NewRelay(broker, postgres.RelayConfig{})
	if err != nil {
		b.Fatal(err)
	}
	shoptest.DrainRows(b, db, relay, `INSERT INTO outbox (type, payload)
		SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500) FROM generate_series($1::int, $2::int) g`)
	if n := count(b, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
		b.Fatalf("%d rows unsent after the drain", n)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}

// BenchmarkKnee offers orders at rising rates through the whole pipeline
// on Kafka, as natsbroker's BenchmarkKnee does on JetStream, with the same
// harness (shoptest.Pipeline: 32 clients, each rate for 3 s on a
// schedule, stopping at the first rate the pipeline falls 10 % short of
// or whose median delay is over a second): the polling relay (Run, woken
// by NOTIFY; its client with no ProducerLinger, as BenchmarkDrain advises)
// publishing to a topic of six partitions on kfake's three
// brokers in the benchmark's process (three replicas, none syncing before
// its acks, as the JetStream run's), and one member of the warehouse's
// consumer group: ack-only (applies nothing: the ceiling), one (one
// message a transaction, ApplyOnce), batch (a partition's records from a
// poll in one transaction, up to shoptest.KneeBatch, ApplyBatch).
func BenchmarkKnee(b *testing.B) {
	once(b)
	for _, consumer := range []string{"ack-only", "one", "batch"} {
		b.Run(fmt.Sprintf("broker=kfake3/relay=poll/consumer=%s", consumer), func(b *testing.B) {
			c := newCluster(b)
			topic := c.topic(6, nil)
			db := newDatabase(b)
			db.SetMaxOpenConns(40)
			db.SetMaxIdleConns(40)
			p := shoptest.NewPipeline(db, consumer != "ack-only")
			ob, err := postgres.OpenDB(db, postgres.Config{})
			if err != nil {
				b.Fatal(err)
			}
			pub, err := kafkabroker.NewPublisher(c.client(kgo.ProducerLinger(0)), kafkabroker.PublisherOptions{Topic: topic})
			if err != nil {
				b.Fatal(err)
			}
			relay, err := ob.NewRelay(pub, postgres.RelayConfig{})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- relay.Run(ctx) }()
			b.Cleanup(func() { cancel(); <-done })
			opts := kafkabroker.ConsumerOptions{MaxPoll: 1000}
			if consumer == "batch" {
				opts.MaxBatch = shoptest.KneeBatch
			}
			runConsumerWith(b, c, "warehouse", topic, p, opts)
			p.WarmUp(b)
			var pgVersion string
			if err := db.QueryRow(`SHOW server_version`).Scan(&pgVersion); err != nil {
				b.Fatal(err)
			}
			b.Logf("PostgreSQL %s, franz-go %s (kgo, kfake)", pgVersion, franzVersion())
			p.Run(b)
		})
	}
}

// franzVersion is the franz-go module's version in this build.
func franzVersion() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, m := range info.Deps {
			if m.Path == "github.com/twmb/franz-go" {
				return m.Version
			}
		}
	}
	return "(unknown)"
}
