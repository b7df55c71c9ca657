// Command shop is the outbox end to end, to run by hand: an HTTP service
// that places orders in PostgreSQL, a relay that publishes the outbox to an
// embedded NATS JetStream (or to RabbitMQ, or Kafka), and the warehouse
// consuming from it.
//
// It has two commands, run one after the other, as a team runs migrations
// apart from its services:
//
//	shop migrate -store DIR [-nodes N]              applies the database's migrations and provisions the stream and the consumer
//	shop serve -store DIR [-nodes N] [-addr ADDR]   checks both, refuses to start if either is not as it expects, and serves
//
// -broker rabbitmq runs the shop on RabbitMQ instead (rabbitbroker): a node
// the shop starts as its child process (Debian's rabbitmq-server), its data
// in the store folder; migrate declares the exchange and the warehouse's
// quorum queue. RabbitMQ drops no copy itself: the warehouse drops each by
// its key.
//
// -broker kafka runs it on Kafka (kafkabroker): a Kafka-protocol cluster of
// -nodes brokers (franz-go's kfake: no Kafka server can be installed here)
// run as a process of its own, this binary as "shop kafka-cluster", its
// data in the store folder; migrate creates the topic outbox with a replica
// on each broker, and the warehouse, the consumer group warehouse, applies
// each partition's records in batches. Kafka drops no copy either, and
// keeps what was consumed, so POST /warehouse/replay hands it all again.
//
// -relay log runs the log relay (postgres.LogRelay, reading the server's
// log; migrate creates its slot) instead of the polling relay.
//
// -nodes 3 runs the embedded JetStream as a cluster of three, the stream
// and its consumer with three replicas; POST /broker/down then stops one
// node, the stream's leader, and the shop goes on through the other two.
//
// make shop runs both on a throwaway PostgreSQL. serve serves, on loopback:
//
//	POST /orders         {"totalCents":2500} places an order: 201 {"orderId":1}, from the database alone
//	GET  /orders/{id}    the order, whether its event was sent and whether the warehouse reserved it
//	GET  /outbox         how many messages wait (unsent, parked) and for how long
//	POST /broker/down    stops the JetStream server (one node of a cluster), the RabbitMQ node or the Kafka cluster; POST /broker/up starts it again on the same store
//
// Ctrl-C stops everything (make shop then removes the broker's store and the
// database server).
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

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/kafkabroker/kafkatest"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

func main() {
	if len(os.Args) >= 2 && os.Args[1] == "kafka-cluster" { // -broker kafka's cluster, a process of its own
		kafkaCluster(os.Args[2:])
		return
	}
	if len(os.Args) < 2 || (os.Args[1] != "migrate" && os.Args[1] != "serve") {
		fmt.Fprintln(os.Stderr, "usage: shop migrate -store DIR [-broker jetstream|rabbitmq|kafka] [-nodes N] [-relay polling|log] | shop serve -store DIR [-broker jetstream|rabbitmq|kafka] [-nodes N] [-addr ADDR] [-relay polling|log]")
		os.Exit(2)
	}
	cmd := os.Args[1]
	flags := flag.NewFlagSet(cmd, flag.ExitOnError)
	addr := flags.String("addr", "127.0.0.1:8080", "where serve's HTTP service listens")
	var s setup
	flags.StringVar(&s.store, "store", "", "the folder of the broker's store")
	flags.StringVar(&s.broker, "broker", "jetstream", "which broker: jetstream (embedded), rabbitmq (a node the shop starts), or kafka (a cluster the shop starts)")
	flags.IntVar(&s.nodes, "nodes", 1, "how many JetStream servers or Kafka brokers: 1, or 3 for a cluster (RabbitMQ: 1)")
	flags.StringVar(&s.relay, "relay", "polling", "which relay: polling, or log (reading the server's log)")
	flags.Parse(os.Args[2:])
	if err := s.check(); err != nil { // before anything is migrated or started
		fmt.Fprintln(os.Stderr, "shop:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	shutdown, err := setUpTracing(ctx, os.Stdout)
	if err == nil {
		err = run(ctx, cmd, *addr, os.Getenv("OUTBOX_POSTGRES_URL"), s)
		flush, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = errors.Join(err, shutdown(flush))
		cancel()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "shop:", err)
		os.Exit(1)
	}
}

// kafkaCluster runs -broker kafka's cluster, as "shop kafka-cluster -dir
// DIR -ports P,P,P", until it is sent SIGTERM; the shop starts it
// (kafkatest.Start) and stops it.
func kafkaCluster(args []string) {
	if err := kafkatest.Serve(args, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "shop:", err)
		os.Exit(1)
	}
}

// setup is how the shop runs: its flags.
type setup struct {
	store  string // the folder of the broker's store
	broker string // jetstream, rabbitmq or kafka
	nodes  int    // the broker's servers: 1, or 3 for a JetStream or Kafka cluster
	relay  string // polling or log
}

// check refuses a setup the shop cannot run.
func (s setup) check() error {
	switch {
	case s.relay != "polling" && s.relay != "log":
		return fmt.Errorf("-relay %q: want polling or log", s.relay)
	case s.broker != "jetstream" && s.broker != "rabbitmq" && s.broker != "kafka":
		return fmt.Errorf("-broker %q: want jetstream, rabbitmq or kafka", s.broker)
	case s.broker == "rabbitmq" && s.nodes != 1:
		return fmt.Errorf("-nodes %d: the shop runs one RabbitMQ node", s.nodes)
	case s.nodes != 1 && s.nodes != 3:
		return fmt.Errorf("-nodes %d: want 1, or 3 for a cluster", s.nodes)
	}
	return nil
}

func run(ctx context.Context, cmd, addr, databaseURL string, s setup) error {
	if databaseURL == "" {
		return errors.New("OUTBOX_POSTGRES_URL is not set: run make shop")
	}
	if s.store == "" {
		return errors.New("-store is not set: name the folder of the broker's store")
	}
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return fmt.Errorf("OUTBOX_POSTGRES_URL: %w", err)
	}
	dbs := openPools(cfg)
	defer dbs.Close()
	if cmd == "migrate" {
		return migrate(ctx, dbs.shop, s, os.Stdout)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return serve(ctx, ln, dbs, s, os.Stdout)
}

// pools are the shop's connection pools to its database, one for each of
// its parts, each with its own application_name, so that an operator tells
// them apart in pg_stat_activity: shop (HTTP requests), outbox-relay (a
// pass, its flush of the server's log, and the listener) and warehouse.
// Together they open at most maxConns connections; none is kept longer
// than half an hour, or idle longer than five minutes.
type pools struct {
	shop, relay, warehouse *sql.DB
	cfg                    *pgx.ConnConfig // what they were opened with: the log relay's connection too
}

// maxConns is the most connections the shop opens to the database.
const maxConns = 20

func openPools(cfg *pgx.ConnConfig) *pools {
	open := func(app string, max int) *sql.DB {
		c := cfg.Copy()
		c.RuntimeParams["application_name"] = app
		db := stdlib.OpenDB(*c)
		db.SetMaxOpenConns(max)
		db.SetMaxIdleConns(max)
		db.SetConnMaxLifetime(30 * time.Minute)
		db.SetConnMaxIdleTime(5 * time.Minute)
		return db
	}
	return &pools{shop: open("shop", maxConns-5), relay: open("outbox-relay", 3), warehouse: open("warehouse", 2), cfg: cfg}
}

// Close closes the three pools.
func (p *pools) Close() {
	p.shop.Close()
	p.relay.Close()
	p.warehouse.Close()
}

// migrate is the step before serve: it brings the database's outbox tables
// to postgres.SchemaVersion and the shop's to shop.SchemaVersion, and
// provisions the broker whose store is in s.store: JetStream's stream and
// the warehouse's durable consumer, or RabbitMQ's exchange and the
// warehouse's queue.
func migrate(ctx context.Context, db *sql.DB, s setup, out io.Writer) error {
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		return err
	}
	// The shop is both: the outbox's set, and the consumer's (the
	// warehouse's keys and positions).
	if err := ob.Migrate(ctx); err != nil {
		return err
	}
	if err := ob.MigrateConsumer(ctx); err != nil {
		return err
	}
	if s.relay == "log" { // the log relay's slot, before any order it must see
		if err := ob.CreateLogSlot(ctx, ob.Slot()); err != nil {
			return err
		}
	}
	if err := shop.Migrate(ctx, db); err != nil {
		return err
	}
	broker, err := startMessageBroker(s.broker, s.store, s.nodes)
	if err != nil {
		return err
	}
	defer broker.Stop()
	provisioned, err := broker.Provision(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "shop: database at outbox schema version %d and shop schema version %d, %s %s provisioned\n",
		postgres.SchemaVersion, shop.SchemaVersion, broker.Name(), provisioned)
	return nil
}

// refused says whether err is JetStream's answer that no retry mends: an
// API error other than the ones a cluster gives while it elects its
// leaders (no suitable peers yet, 10005; JetStream not yet available,
// 10008).
func refused(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode != 10005 && apiErr.ErrorCode != 10008
}

// whileStarting calls f until it succeeds, fails for good (final), or 30 s
// have passed: a cluster that starts again from its stores elects its
// leaders, the meta leader first and then the stream's and the
// consumer's, and answers for each only once it has one.
func whileStarting(ctx context.Context, f func() error, final func(error) bool) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := f()
		if err == nil || final(err) || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// newServer is the shop's HTTP server for h, with a limit on each phase of a
// request: its header, its whole reading, the writing of the answer (longer
// than a request's database work), and a kept-alive connection's idle time.
func newServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      2 * requestTimeout,
		IdleTimeout:       time.Minute,
	}
}

// serve is the application root: it wires the shop, the relay, the broker
// and the warehouse, serves HTTP on ln until ctx ends, then stops them all.
// Spans go to otel's global tracer provider (setUpTracing's); metrics to a
// meter provider of serve's own, at GET /metrics.
func serve(ctx context.Context, ln net.Listener, dbs *pools, s setup, out io.Writer) error {
	db := dbs.shop
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	logger := slog.New(slog.NewTextHandler(out, nil))
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		return err
	}
	if err := errors.Join(ob.CheckSchema(ctx), ob.CheckConsumerSchema(ctx), shop.CheckSchema(ctx, db)); err != nil {
		return err
	}

	broker, err := startMessageBroker(s.broker, s.store, s.nodes)
	if err != nil {
		return err
	}
	defer broker.Stop()
	if err := broker.Check(ctx); err != nil {
		return err
	}
	lossy, publisher := newLossyPublisher(broker.Publisher())
	m, err := newMetrics()
	if err != nil {
		return err
	}
	defer m.provider.Shutdown(context.Background())
	lag, err := ob.ObserveLag(m.provider)
	if err != nil {
		return err
	}
	defer lag.Unregister()

	// The zero RelayConfig's settings are a team's: order per aggregate,
	// each pass's batch through PublishBatch, a message refused five times
	// parked.
	var view *live // made below; the relay tells it of each pass once it runs
	relayOutbox, err := postgres.OpenDB(dbs.relay, postgres.Config{})
	if err != nil {
		return err
	}
	relay, err := relayOutbox.NewRelay(publisher, postgres.RelayConfig{
		MaxBackoff: 2 * time.Second,                                    // a demo: back quickly after /broker/up
		RetryDelay: 100 * time.Millisecond, MaxRetryDelay: time.Second, // and a row the broker refuses parked in seconds
		Logger:        logger,
		MeterProvider: m.provider,
		OnPass:        func(r postgres.PassReport) { view.onPass(r) },
	})
	if err != nil {
		return err
	}
	var runs interface{ Run(context.Context) error } = relay
	if s.relay == "log" { // -relay log: the other relay, reading the server's log
		// It marks what it delivered in dbs.relay, and parks what the
		// broker refuses, as the polling relay does.
		logRelay, err := relayOutbox.NewLogRelayConfig(&dbs.cfg.Config, publisher, postgres.LogRelayConfig{
			MaxBackoff: 2 * time.Second, Logger: logger, MeterProvider: m.provider,
			OnPass: func(r postgres.PassReport) { view.onPass(r) },
		})
		if err != nil {
			return err
		}
		runs = logRelay
	}
	counted := &countingHandler{handler: shop.NewWarehouse(dbs.warehouse), since: time.Now()}
	warehouse, err := broker.Warehouse(counted, logger, m.provider)
	if err != nil {
		return err
	}
	errs := make(chan error, 3)
	orders := shop.NewOrderService(db)
	runner := &relayRunner{relay: runs, ctx: ctx, errs: errs}
	view = &live{db: db, outbox: ob, orders: orders, broker: broker, lossy: lossy, warehouse: counted, relay: runner,
		meters: m.provider, stopped: ctx.Done()}
	view.state = &snapshot[state]{period: statePeriod, read: view.read, now: time.Now}
	routes := http.NewServeMux()
	routes.Handle("GET /metrics", m.handler)
	view.routes(routes)
	routes.Handle("/", traced(newHandler(db, ob, orders, broker, counted)))
	srv := newServer(routes)

	var wg sync.WaitGroup
	runner.Start()
	defer runner.Stop()
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
	runner.Stop()
	wg.Wait()
	fmt.Fprintln(out, "shop: stopped")
	if errors.Is(first, context.Canceled) || errors.Is(first, http.ErrServerClosed) {
		return nil
	}
	return first
}
