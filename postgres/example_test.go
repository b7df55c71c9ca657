package postgres_test

// These examples show how the pieces are wired in a service. They are
// compiled, not run (they have no output to check): the tests run the same
// calls on a real server.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver for database/sql

	"example.com/patterns/enterprise/outbox/postgres"
)

// A service's relay: Run until the process is told to stop, then return
// once the pass in progress has marked what the broker accepted.
func ExampleOutboxRelay_Run() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		log.Fatal(err)
	}
	var broker postgres.MessageBroker // natsbroker.NewPublisher's for JetStream, or your broker's client
	// As it comes: order per aggregate, batches, a message refused
	// DefaultParkAfter times set aside.
	relay, err := ob.NewRelay(broker, postgres.RelayConfig{Logger: slog.Default()})
	if err != nil {
		log.Fatal(err) // errors.Is(err, postgres.ErrInvalidConfig), the setting named
	}
	if err := relay.Run(ctx); !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

// The migration step of a deployment, run before the services start: it
// brings the schema to SchemaVersion, and run again it changes nothing.
func ExampleMigrate() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := postgres.Migrate(ctx, db); err != nil {
		log.Fatal(err) // a lock timeout says to run it again
	}
}

// A service's start-up: it checks the schema, and refuses to start on a
// database that the migration step has not brought to its version, rather
// than running DDL itself.
func ExampleCheckSchema() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if err := postgres.CheckSchema(context.Background(), db); err != nil {
		log.Fatal(err) // errors.Is(err, postgres.ErrSchemaVersion)
	}
}

// A gauge for the outbox, read every few seconds; alert on Oldest and on
// any parked row.
func ExampleReadLag() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	lag, err := postgres.ReadLag(context.Background(), db)
	if err != nil {
		log.Fatal(err)
	}
	if lag.Oldest > time.Minute || lag.Parked > 0 {
		log.Printf("outbox: %d waiting, the oldest for %v; %d parked", lag.Unsent, lag.Oldest, lag.Parked)
	}
}

// A team on pgx's pool makes the outbox once, at start-up: Open checks
// the Config there, so that a bad setting stops the service before it
// writes anything, and the migration step brings the schema up.
func ExampleOpen() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	ob, err := postgres.Open(pool, postgres.Config{Table: "billing_outbox"})
	if err != nil {
		log.Fatal(err) // errors.Is(err, postgres.ErrInvalidConfig), the setting named
	}
	if err := ob.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
}

// A team's own change and its event, in one pgx transaction: the row of
// the team's table and the outbox row commit together or not at all.
// Write takes the transaction, never the pool: passing the pool does not
// compile.
func ExampleOutbox_Write() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	ob, err := postgres.Open(pool, postgres.Config{})
	if err != nil {
		log.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO accounts (owner) VALUES ($1) RETURNING id`, "Ada").Scan(&id); err != nil {
			return err
		}
		_, err := ob.Write(ctx, tx, postgres.Event{Type: "AccountOpened", Payload: map[string]any{"accountId": id},
			Aggregate: fmt.Sprintf("account/%d", id), Seq: 1})
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
}

// A consumer's handler in a pgx transaction of its own: the key's record
// and the effect commit together, and a message delivered twice is applied
// once.
func ExampleOutbox_ApplyOnceIn() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("CONSUMER_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	ob, err := postgres.Open(pool, postgres.Config{})
	if err != nil {
		log.Fatal(err)
	}
	handle := func(ctx context.Context, msg postgres.Message) (applied bool, err error) {
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			fresh, err := ob.ApplyOnceIn(ctx, tx, msg, postgres.ApplyOptions{})
			if err != nil || !fresh {
				return err // !fresh: a duplicate, dropped
			}
			_, err = tx.Exec(ctx, `INSERT INTO welcome_mails (payload) VALUES ($1)`, msg.Payload)
			applied = err == nil
			return err
		})
		return applied, err
	}
	applied, err := handle(ctx, postgres.Message{Key: "5f0c…", Type: "AccountOpened", Payload: `{"accountId":7}`})
	log.Print(applied, err)
}

// A nightly cleanup: sent rows kept for a week, the consumer's processed
// keys for a month (longer than any message can take to arrive again),
// each in transactions of Config.CleanupBatch rows.
func ExampleOutbox_DeleteSent() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	ob, err := postgres.OpenDB(db, postgres.Config{CleanupBatch: 500})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	n, err := ob.DeleteSent(ctx, 7*24*time.Hour)
	if err != nil {
		log.Fatal(err)
	}
	m, err := ob.ForgetProcessed(ctx, 30*24*time.Hour)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("deleted %d sent outbox rows and %d processed keys", n, m)
}

// A team's own change and its event, in one transaction: the row of the
// team's table and the outbox row commit together or not at all. Any
// Executor does (*sql.Tx here; sqlc's DBTX, or a Tx of a library built on
// database/sql).
func ExampleInsertOutbox() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	err = postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		var id int64
		if err := tx.QueryRowContext(ctx, `INSERT INTO customers (name) VALUES ($1) RETURNING id`, "Ada").Scan(&id); err != nil {
			return err
		}
		_, err := postgres.InsertOutbox(ctx, tx, "CustomerRegistered", map[string]any{"customerId": id})
		return err
	})
	if errors.Is(err, postgres.ErrCommitUnknown) {
		log.Print("unknown whether the customer was registered: look before trying again")
	} else if err != nil {
		log.Fatal(err)
	}
}

// A consumer's handler: the effect and the key's record commit together, so
// a message delivered twice is applied once.
func ExampleApplyOnce() {
	db, err := sql.Open("pgx", os.Getenv("CONSUMER_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	handle := func(ctx context.Context, msg postgres.Message) (bool, error) {
		return postgres.ApplyOnce(ctx, db, msg, false, func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO welcome_mails (payload) VALUES ($1)`, msg.Payload)
			return err
		})
	}
	applied, err := handle(context.Background(), postgres.Message{Key: "5f0c…", Type: "CustomerRegistered", Payload: `{"customerId":7}`})
	log.Print(applied, err)
}
