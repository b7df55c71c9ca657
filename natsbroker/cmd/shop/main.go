// Command shop is the outbox end to end, to run by hand: an HTTP service
// that places orders in PostgreSQL, a relay that publishes the outbox to an
// embedded NATS JetStream, and the warehouse consuming from it.
//
// make shop starts it on a throwaway PostgreSQL. It serves, on loopback:
//
//	POST /orders         {"totalCents":2500} places an order: 201 {"orderId":1}, from the database alone
//	GET  /orders/{id}    the order, whether its event was sent and whether the warehouse reserved it
//	GET  /outbox         how many messages wait (unsent, parked) and for how long
//	POST /broker/down    stops the JetStream server; POST /broker/up starts it again on the same store
//
// Ctrl-C stops everything, and removes the broker's store (make shop
// removes the database server).
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "where the HTTP service listens")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *addr, os.Getenv("OUTBOX_POSTGRES_URL")); err != nil {
		fmt.Fprintln(os.Stderr, "shop:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, addr, databaseURL string) error {
	if databaseURL == "" {
		return errors.New("OUTBOX_POSTGRES_URL is not set: run make shop")
	}
	db, err := sql.Open("pgx", databaseURL)
	if err != nil {
		return err
	}
	defer db.Close()
	store, err := os.MkdirTemp("", "shop-jetstream-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(store)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return serve(ctx, ln, db, store, os.Stdout)
}

// serve is the application root: it wires the shop, the relay, the broker
// and the warehouse, serves HTTP on ln until ctx ends, then stops them all.
func serve(ctx context.Context, ln net.Listener, db *sql.DB, store string, out io.Writer) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	logger := slog.New(slog.NewTextHandler(out, nil))
	if err := postgres.Migrate(ctx, db); err != nil {
		return err
	}

	broker, err := startBroker(store)
	if err != nil {
		return err
	}
	defer broker.Down()
	nc, err := nats.Connect(broker.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
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
	cons, err := stream.CreateOrUpdateConsumer(ctx, natsbroker.ConsumerConfig("warehouse", 0))
	if err != nil {
		return err
	}
	publisher, err := natsbroker.NewPublisher(nc)
	if err != nil {
		return err
	}

	relay := postgres.NewOutboxRelay(db, publisher)
	relay.ParkAfter = 5
	relay.MaxBackoff = 2 * time.Second
	relay.Logger = logger
	warehouse := natsbroker.NewConsumer(cons, postgres.NewWarehouse(db))
	warehouse.Logger = logger
	srv := &http.Server{
		Handler:           newHandler(db, postgres.NewOrderService(db), broker),
		ReadHeaderTimeout: 5 * time.Second,
	}

	var wg sync.WaitGroup
	errs := make(chan error, 3)
	wg.Go(func() { errs <- fmt.Errorf("relay: %w", relay.Run(ctx)) })
	wg.Go(func() { errs <- fmt.Errorf("warehouse: %w", warehouse.Run(ctx)) })
	wg.Go(func() { errs <- srv.Serve(ln) })
	fmt.Fprintf(out, "shop: listening on http://%s, broker on %s; Ctrl-C stops it\n", ln.Addr(), broker.URL())

	var first error
	select {
	case <-ctx.Done():
	case first = <-errs: // one part stopped on its own: stop the rest
	}
	cancel()
	shutdown, done := context.WithTimeout(context.Background(), 5*time.Second)
	defer done()
	srv.Shutdown(shutdown)
	wg.Wait()
	fmt.Fprintln(out, "shop: stopped")
	if errors.Is(first, context.Canceled) || errors.Is(first, http.ErrServerClosed) {
		return nil
	}
	return first
}
