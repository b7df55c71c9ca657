package rabbitbroker_test

// These examples show how the pieces are wired in a service. They are
// compiled, not run (they have no output to check): the tests run the same
// calls on real nodes.

import (
	"context"
	"database/sql"
	"errors"
	"log"
	"os"
	"os/signal"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver for database/sql
	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

// Provisioning, once, apart from the services: the exchange, the quorum
// queue with its delivery limit and single active consumer, and the
// dead-letter queue.
func ExampleTopology_Declare() {
	conn, err := amqp.Dial(os.Getenv("AMQP_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	if err := rabbitbroker.DefaultTopology.Declare(ch); err != nil {
		log.Fatal(err)
	}
}

// The relay of a service, publishing the outbox to RabbitMQ with confirms
// in flight until the process is told to stop.
func ExampleNewPublisher() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	dial := func() (*amqp.Connection, error) { return amqp.Dial(os.Getenv("AMQP_URL")) }
	pub, err := rabbitbroker.NewPublisher(dial, rabbitbroker.PublisherOptions{}) // DefaultTopology's exchange, the server's default max_message_size
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	// As it comes: batches of different aggregates, each aggregate in order.
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := ob.NewRelay(pub, postgres.RelayConfig{})
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

// The warehouse's consumer: each message applied once (the copies RabbitMQ
// delivers dropped by key), four aggregates at a time, each in order.
func ExampleConsumer() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	dial := func() (*amqp.Connection, error) { return amqp.Dial(os.Getenv("AMQP_URL")) }
	c, err := rabbitbroker.NewConsumer(dial, rabbitbroker.DefaultTopology.Queue, shop.NewWarehouse(db),
		rabbitbroker.ConsumerOptions{Concurrency: 4, Prefetch: 20})
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}
