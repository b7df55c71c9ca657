package postgres_test

// These examples show how the pieces are wired in a service. They are
// compiled, not run (they have no output to check): the tests run the same
// calls on a real server.

import (
	"context"
	"database/sql"
	"errors"
	"log"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver for database/sql

	"example.com/patterns/enterprise/outbox"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
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

	broker := shop.AdaptBroker(&outbox.InMemoryBroker{}) // a real broker client in a service
	relay := postgres.NewOutboxRelay(db, broker)
	relay.ParkAfter = 5 // set a message aside after 5 rejections
	relay.Logger = slog.Default()
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

// A nightly cleanup: sent rows kept for a week, the consumer's processed
// keys for a month (longer than any message can take to arrive again).
func ExampleDeleteSent() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	n, err := postgres.DeleteSent(ctx, db, 7*24*time.Hour, 0)
	if err != nil {
		log.Fatal(err)
	}
	m, err := shop.NewWarehouse(db).ForgetProcessed(ctx, 30*24*time.Hour, 0)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("deleted %d sent outbox rows and %d processed keys", n, m)
}

// An HTTP handler that makes POST /orders safe to retry: the client's
// Idempotency-Key names the request, and a retry after a lost response, or
// after a commit of unknown outcome, returns the first order.
func ExampleOrderService_PlaceOrderWithKey() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	service := shop.NewOrderService(db)
	http.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		total, err := strconv.ParseInt(r.FormValue("totalCents"), 10, 64)
		if err != nil {
			http.Error(w, "totalCents must be a number of cents", http.StatusBadRequest)
			return
		}
		id, err := service.PlaceOrderWithKey(r.Context(), r.Header.Get("Idempotency-Key"), total)
		switch {
		case errors.Is(err, outbox.ErrInvalidTotal), errors.Is(err, shop.ErrInvalidIdempotencyKey):
			http.Error(w, err.Error(), http.StatusUnprocessableEntity)
		case errors.Is(err, shop.ErrIdempotencyKeyReused):
			http.Error(w, err.Error(), http.StatusConflict)
		case errors.Is(err, postgres.ErrCommitUnknown):
			http.Error(w, "unknown outcome: retry with the same Idempotency-Key", http.StatusServiceUnavailable)
		case err != nil:
			http.Error(w, "try again", http.StatusServiceUnavailable)
		default:
			w.Header().Set("Location", "/orders/"+strconv.FormatInt(id, 10))
			w.WriteHeader(http.StatusCreated)
		}
	})
}
