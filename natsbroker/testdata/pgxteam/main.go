// Command pgxteam is a team's service on pgxpool alone, with no
// database/sql anywhere: it migrates, places an order and writes its event
// in one pgx.Tx, relays the event to JetStream, reads the lag, cleans up,
// and applies the event once in a pgx.Tx, a second delivery dropped. It
// prints what each step did; TestATeamOnPgxpoolAloneRunsTheWholeOutbox
// builds and runs it.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "pgxteam:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := postgres.Open(pool, postgres.Config{})
	if err != nil {
		return err
	}
	if err := ob.Migrate(ctx); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL);
		CREATE TABLE reservations (order_id bigint PRIMARY KEY)`); err != nil {
		return err
	}

	// The order and its event, in one transaction of the team's.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total_cents) VALUES (1, 4200)`); err != nil {
			return err
		}
		_, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int64{"orderId": 1, "totalCents": 4200}})
		return err
	})
	if err != nil {
		return err
	}

	nc, err := nats.Connect(os.Getenv("NATS_URL"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	stream, err := js.CreateOrUpdateStream(ctx, natsbroker.StreamConfig(0))
	if err != nil {
		return err
	}
	publisher, err := natsbroker.NewPublisher(js, natsbroker.PublisherOptions{})
	if err != nil {
		return err
	}
	relay, err := ob.NewRelay(publisher, postgres.RelayConfig{})
	if err != nil {
		return err
	}
	n, err := relay.PublishPending(ctx)
	if err != nil {
		return err
	}
	fmt.Println("published", n)
	lag, err := ob.ReadLag(ctx)
	if err != nil {
		return err
	}
	fmt.Println("unsent", lag.Unsent)
	deleted, err := ob.DeleteSent(ctx, 0)
	if err != nil {
		return err
	}
	fmt.Println("cleaned up", deleted)

	cons, err := stream.CreateOrUpdateConsumer(ctx, natsbroker.ConsumerConfig("warehouse", 5*time.Second))
	if err != nil {
		return err
	}
	w := &warehouse{pool: pool, ob: ob, applied: make(chan postgres.Message, 1)}
	consumeCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	consumer, err := natsbroker.NewConsumer(cons, w, natsbroker.ConsumerOptions{})
	if err != nil {
		return err
	}
	go func() { done <- consumer.Run(consumeCtx) }()
	var msg postgres.Message
	select {
	case msg = <-w.applied:
	case err := <-done:
		return fmt.Errorf("the consumer stopped: %w", err)
	case <-ctx.Done():
		return fmt.Errorf("no message applied: %w", ctx.Err())
	}
	stop()
	<-done
	fmt.Println("applied", msg.Type)
	again, err := w.Handle(ctx, msg) // the same message delivered again
	if err != nil {
		return err
	}
	fmt.Println("applied again", again)
	var reserved int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM reservations`).Scan(&reserved); err != nil {
		return err
	}
	fmt.Println("reservations", reserved)
	return nil
}

// warehouse reserves stock for each order placed, once, in a pgx.Tx.
type warehouse struct {
	pool    *pgxpool.Pool
	ob      *postgres.Outbox[postgres.PgxTx]
	applied chan postgres.Message
}

func (w *warehouse) Handle(ctx context.Context, msg postgres.Message) (applied bool, err error) {
	err = pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		fresh, err := w.ob.ApplyOnceIn(ctx, tx, msg, postgres.ApplyOptions{})
		if err != nil || !fresh {
			return err // !fresh: a duplicate, dropped
		}
		var placed struct {
			OrderID int64 `json:"orderId"`
		}
		if err := json.Unmarshal([]byte(msg.Payload), &placed); err != nil {
			return fmt.Errorf("%w: %w", postgres.ErrMalformedMessage, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO reservations (order_id) VALUES ($1)`, placed.OrderID); err != nil {
			return err
		}
		applied = true
		return nil
	})
	if err != nil {
		return false, err
	}
	if applied {
		select {
		case w.applied <- msg:
		default:
		}
	}
	return applied, nil
}
