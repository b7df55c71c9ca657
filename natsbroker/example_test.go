package natsbroker_test

// These examples show how the pieces are wired in a service. They are
// compiled, not run (they have no output to check): the tests run the same
// calls on a real server, and the shop program (shop/) wires them all.

import (
	"context"
	"database/sql"
	"errors"
	"log"
	"os"
	"os/signal"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver for database/sql
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// The relay of a service, publishing the outbox to JetStream until the
// process is told to stop. The schema and the stream were provisioned apart,
// before the service started (the shop's migrate command does both); the
// service only checks them, and refuses to start if either is not as it
// expects.
func ExamplePublisher() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	nc, err := nats.Connect(os.Getenv("NATS_URL"), nats.MaxReconnects(-1)) // every node's URL, comma-separated
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if err := ob.CheckSchema(ctx); err != nil {
		log.Fatal(err)
	}
	// The stream as the migration step provisioned it, on a cluster of
	// three: an ack means two of the three servers hold the message, which
	// survives any one of them shut down or killed (see the README on what
	// it does not survive, and on sync_interval).
	stream := natsbroker.StreamConfig(natsbroker.DefaultDuplicateWindow)
	stream.Replicas = 3
	if err := natsbroker.CheckStream(ctx, js, stream); err != nil {
		log.Fatal(err)
	}

	publisher, err := natsbroker.NewPublisher(js, natsbroker.PublisherOptions{}) // or CloudEventsSource: "/shop"
	if err != nil {
		log.Fatal(err)
	}
	relay, err := ob.NewRelay(publisher, postgres.RelayConfig{})
	if err != nil {
		log.Fatal(err)
	}
	// As it comes: each aggregate in order, each pass's batch through
	// PublishBatch, a message refused five times parked.
	if err := relay.Run(ctx); !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

// The warehouse of a service, consuming the stream through a durable
// consumer, provisioned apart, until the process is told to stop.
func ExampleConsumer() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	db, err := sql.Open("pgx", os.Getenv("WAREHOUSE_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	nc, err := nats.Connect(os.Getenv("NATS_URL"), nats.MaxReconnects(-1))
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		log.Fatal(err)
	}

	warehouse, err := natsbroker.NewConsumer(cons, shop.NewWarehouse(db), natsbroker.ConsumerOptions{})
	if err != nil {
		log.Fatal(err)
	}
	if err := warehouse.Run(ctx); !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}
