// Command outbox-relay is the outbox's relay as a process of its own, to
// deploy beside the services that write the outbox: it publishes the rows of
// one outbox table in PostgreSQL to NATS JetStream, and deletes them once
// they have been sent longer than their retention.
//
//	outbox-relay migrate   creates the outbox's tables (and, in log mode, its slot) and the stream, then exits
//	outbox-relay run       relays until SIGTERM or SIGINT, then returns once what the broker accepted is marked
//	outbox-relay parked    lists the parked rows, one line of JSON each
//	outbox-relay drop ID   deletes the parked row ID for good, and logs its key, type and last error
//
// Each flag may be given by its environment variable instead (the flag wins):
//
//	-database  OUTBOX_DATABASE_URL     the PostgreSQL connection string (pgx's: TLS, several hosts, …)
//	-nats      OUTBOX_NATS_URL         the JetStream servers, comma-separated
//	-mode      OUTBOX_MODE             polling (OutboxRelay, the default) or log (LogRelay: logical decoding)
//	-table     OUTBOX_TABLE            the outbox table (outbox)
//	-stream    OUTBOX_STREAM           the stream (OUTBOX), and -subject-prefix OUTBOX_SUBJECT_PREFIX (outbox.)
//	-replicas  OUTBOX_REPLICAS         the stream's replicas (1; 3 on a cluster of three)
//	-retention OUTBOX_RETENTION        how long a sent row is kept before cleanup deletes it (168h; 0 keeps them)
//	-cleanup-every OUTBOX_CLEANUP_EVERY how often cleanup runs (1m)
//	-processed-retention OUTBOX_PROCESSED_RETENTION  how long the consumers' keys in this database are kept
//	                                   (0, the default, leaves them to the consumers; else at least the stream's max age)
//	-http      OUTBOX_HTTP_ADDR        where /healthz, /readyz and /metrics are served (none if empty)
//	-slot      OUTBOX_SLOT             log mode: the replication slot, unique on the server (the table's name)
//	-sweep-every OUTBOX_SWEEP_EVERY    log mode: how often a polling pass publishes what the log cannot carry (1m; 0 never)
//
// /healthz answers 200 while the process runs; /readyz answers 200 only once
// the outbox's schema is at its version and the stream is as configured
// (checked, never changed: migrate provisions them), 503 with the reason
// until then. /metrics is the relay's OpenTelemetry instruments and the
// outbox's lag gauges, in Prometheus's format. Logs are JSON on standard
// error.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// config is the relay's configuration, as flags and the environment give
// it.
type config struct {
	database, nats, mode        string
	table, stream, prefix, http string
	slot                        string // log mode: the replication slot; empty means the table's name
	replicas                    int
	retention, cleanupEvery     time.Duration
	sweepEvery                  time.Duration // log mode: how often unsent rows older than it are swept; 0 never
	processedRetention          time.Duration
	standbys                    []string // polling mode: the standbys a pass waits for
}

func main() {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: outbox-relay migrate|run|parked|drop ID [flags]; outbox-relay run -h lists the flags")
		os.Exit(2)
	}
	cmd := os.Args[1]
	cfg, args, err := parse(cmd, os.Args[2:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-relay:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cmd, cfg, args, log); err != nil && !errors.Is(err, context.Canceled) {
		log.Error("outbox-relay: "+cmd+" failed", "err", err)
		os.Exit(1)
	}
}

// parse reads cmd's flags from args, each defaulting to its environment
// variable, and checks them.
func parse(cmd string, args []string) (config, []string, error) {
	env := func(name, def string) string {
		if v, ok := os.LookupEnv(name); ok {
			return v
		}
		return def
	}
	var c config
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.StringVar(&c.database, "database", env("OUTBOX_DATABASE_URL", ""), "PostgreSQL connection string (OUTBOX_DATABASE_URL)")
	fs.StringVar(&c.nats, "nats", env("OUTBOX_NATS_URL", nats.DefaultURL), "JetStream servers, comma-separated (OUTBOX_NATS_URL)")
	fs.StringVar(&c.mode, "mode", env("OUTBOX_MODE", "polling"), "polling or log (OUTBOX_MODE)")
	fs.StringVar(&c.table, "table", env("OUTBOX_TABLE", postgres.DefaultTable), "the outbox table (OUTBOX_TABLE)")
	fs.StringVar(&c.slot, "slot", env("OUTBOX_SLOT", ""), "log mode: the replication slot, unique on the server; empty means the table's name (OUTBOX_SLOT)")
	fs.StringVar(&c.stream, "stream", env("OUTBOX_STREAM", natsbroker.Stream), "the stream (OUTBOX_STREAM)")
	fs.StringVar(&c.prefix, "subject-prefix", env("OUTBOX_SUBJECT_PREFIX", natsbroker.SubjectPrefix), "the subjects' prefix (OUTBOX_SUBJECT_PREFIX)")
	fs.StringVar(&c.http, "http", env("OUTBOX_HTTP_ADDR", ""), "address of /healthz, /readyz and /metrics (OUTBOX_HTTP_ADDR)")
	replicas, retention, every := env("OUTBOX_REPLICAS", "1"), env("OUTBOX_RETENTION", "168h"), env("OUTBOX_CLEANUP_EVERY", "1m")
	processed := env("OUTBOX_PROCESSED_RETENTION", "0")
	sweep := env("OUTBOX_SWEEP_EVERY", "1m")
	fs.StringVar(&sweep, "sweep-every", sweep, "log mode: how often a polling pass publishes the unsent rows the log cannot carry (put back with unpark, or older than the slot), once the oldest waited that long; 0 never (OUTBOX_SWEEP_EVERY)")
	fs.StringVar(&processed, "processed-retention", processed, "how long consumers' keys in this database are kept; 0 leaves them (OUTBOX_PROCESSED_RETENTION)")
	fs.StringVar(&replicas, "replicas", replicas, "the stream's replicas (OUTBOX_REPLICAS)")
	fs.StringVar(&retention, "retention", retention, "how long sent rows are kept; 0 keeps them (OUTBOX_RETENTION)")
	fs.StringVar(&every, "cleanup-every", every, "how often cleanup runs (OUTBOX_CLEANUP_EVERY)")
	standbys := env("OUTBOX_STANDBYS", "")
	fs.StringVar(&standbys, "standbys", standbys, "polling mode: the standbys' application_names, comma-separated, that a pass waits for before it publishes (OUTBOX_STANDBYS)")
	if err := fs.Parse(args); err != nil {
		return c, nil, err
	}
	var errs []error
	var err error
	for name := range strings.SplitSeq(standbys, ",") {
		if name = strings.TrimSpace(name); name != "" {
			c.standbys = append(c.standbys, name)
		}
	}
	if len(c.standbys) > 0 && c.mode == "log" {
		errs = append(errs, errors.New("-standbys is for -mode polling: the log relay cannot wait for a standby (PostgreSQL 17 can, for it: synchronized_standby_slots)"))
	}
	if c.replicas, err = strconv.Atoi(replicas); err != nil || c.replicas < 1 {
		errs = append(errs, fmt.Errorf("-replicas %q: want 1 or more", replicas))
	}
	if c.retention, err = time.ParseDuration(retention); err != nil || c.retention < 0 {
		errs = append(errs, fmt.Errorf("-retention %q: want a duration, 0 or more", retention))
	}
	if c.processedRetention, err = time.ParseDuration(processed); err != nil || c.processedRetention < 0 {
		errs = append(errs, fmt.Errorf("-processed-retention %q: want a duration, 0 or more", processed))
	}
	if c.sweepEvery, err = time.ParseDuration(sweep); err != nil || c.sweepEvery < 0 {
		errs = append(errs, fmt.Errorf("-sweep-every %q: want a duration, 0 or more", sweep))
	}
	if c.cleanupEvery, err = time.ParseDuration(every); err != nil || c.cleanupEvery <= 0 {
		errs = append(errs, fmt.Errorf("-cleanup-every %q: want a positive duration", every))
	}
	if c.database == "" {
		errs = append(errs, errors.New("-database (OUTBOX_DATABASE_URL) is not set"))
	}
	if c.slot != "" && !slotName.MatchString(c.slot) {
		errs = append(errs, fmt.Errorf("-slot %q: want lowercase letters, digits and '_', at most 63 bytes", c.slot))
	}
	if c.mode != "polling" && c.mode != "log" {
		errs = append(errs, fmt.Errorf("-mode %q: want polling or log", c.mode))
	}
	switch cmd {
	case "migrate", "run", "parked":
		if fs.NArg() != 0 {
			errs = append(errs, fmt.Errorf("%s takes no argument, got %q", cmd, fs.Args()))
		}
	case "drop":
		if fs.NArg() != 1 {
			errs = append(errs, errors.New("drop takes the id of one parked row"))
		}
	default:
		errs = append(errs, fmt.Errorf("unknown command %q: want migrate, run, parked or drop", cmd))
	}
	return c, fs.Args(), errors.Join(errs...)
}

// slotName is what PostgreSQL allows in a replication slot's name.
var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

func run(ctx context.Context, cmd string, c config, args []string, log *slog.Logger) error {
	names, err := natsbroker.NewNames(c.stream, c.prefix)
	if err != nil {
		return err
	}
	pgcfg, err := pgx.ParseConfig(c.database)
	if err != nil {
		return fmt.Errorf("-database: %w", err)
	}
	pgcfg.RuntimeParams["application_name"] = "outbox-relay"
	db := stdlib.OpenDB(*pgcfg)
	defer db.Close()
	outbox, err := postgres.OpenDB(db, postgres.Config{Table: c.table})
	if err != nil {
		return fmt.Errorf("-table: %w", err)
	}
	db.SetMaxOpenConns(4) // a pass's two, the listener, and one for cleanup and the gauges
	switch cmd {
	case "parked":
		parked, err := outbox.ListParked(ctx, 0)
		for _, p := range parked {
			line, _ := json.Marshal(map[string]any{"id": p.ID, "key": p.Key, "type": p.Type, "aggregate": p.Aggregate,
				"seq": p.Seq, "rejections": p.Rejections, "last_error": p.LastError, "parked_at": p.ParkedAt})
			fmt.Println(string(line))
		}
		return err
	case "drop":
		id, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil {
			return fmt.Errorf("drop %q: not a row id", args[0])
		}
		p, err := outbox.DropParked(ctx, id)
		if err != nil {
			return err
		}
		log.Warn("outbox-relay: parked row dropped for good", "table", outbox.Table(), "id", p.ID, "key", p.Key,
			"type", p.Type, "aggregate", p.Aggregate, "seq", p.Seq, "rejections", p.Rejections, "reason", p.LastError)
		return nil
	}

	nc, err := nats.Connect(c.nats, nats.Name("outbox-relay"), nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true))
	if err != nil {
		return fmt.Errorf("-nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(time.Minute))
	if err != nil {
		return err
	}
	stream := names.StreamConfig(0)
	stream.Replicas = c.replicas
	if cmd == "migrate" {
		return migrate(ctx, c, outbox, js, stream, log)
	}
	return relay(ctx, c, outbox, names, js, stream, log)
}

// migrate provisions what the relay checks: the outbox's tables, the log
// relay's slot in log mode, and the stream.
func migrate(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], js jetstream.JetStream,
	stream jetstream.StreamConfig, log *slog.Logger) error {
	if err := outbox.Migrate(ctx); err != nil {
		return err
	}
	if c.mode == "log" {
		if err := outbox.CreateLogSlot(ctx, c.slot); err != nil {
			return err
		}
	}
	if _, err := js.CreateOrUpdateStream(ctx, stream); err != nil {
		return fmt.Errorf("provision stream %s: %w", stream.Name, err)
	}
	log.Info("outbox-relay: migrated", "table", outbox.Table(), "schema_version", postgres.SchemaVersion, "stream", stream.Name)
	return nil
}

// relay serves the health endpoints, waits until the schema and the stream
// check out, then relays and cleans up until ctx ends.
func relay(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], names natsbroker.Names,
	js jetstream.JetStream, stream jetstream.StreamConfig, log *slog.Logger) error {
	reg := prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(reg), otelprom.WithoutScopeInfo())
	if err != nil {
		return err
	}
	meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp))
	defer meters.Shutdown(context.WithoutCancel(ctx))
	var notReady atomic.Pointer[string]
	waiting := "not checked yet"
	notReady.Store(&waiting)
	if c.http != "" {
		ln, err := net.Listen("tcp", c.http)
		if err != nil {
			return fmt.Errorf("-http: %w", err)
		}
		mux := http.NewServeMux()
		mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
		mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
			if why := notReady.Load(); why != nil {
				http.Error(w, "not ready: "+*why, http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ready")
		})
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln)
		defer srv.Close()
		log.Info("outbox-relay: serving /healthz, /readyz and /metrics", "addr", ln.Addr().String())
	}

	for {
		check, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := errors.Join(outbox.CheckSchema(check), natsbroker.CheckStream(check, js, stream))
		cancel()
		if err == nil {
			break
		}
		why := err.Error()
		notReady.Store(&why)
		log.Warn("outbox-relay: not ready; checking again in 2 s", "err", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
	lag, err := outbox.ObserveLag(meters)
	if err != nil {
		return err
	}
	defer lag.Unregister()
	notReady.Store(nil)
	log.Info("outbox-relay: ready", "table", outbox.Table(), "stream", stream.Name, "mode", c.mode)

	publisher := names.NewPublisher(js)
	done := make(chan error, 1)
	if c.mode == "log" {
		// Made from the Outbox, it marks what it delivered (so marked rows
		// are not lag, and are cleaned up) and parks what the broker refuses.
		r, err := outbox.NewLogRelay(c.database, publisher, postgres.LogRelayConfig{Logger: log, MeterProvider: meters, Slot: c.slot})
		if err != nil {
			return err
		}
		go func() { done <- runLog(ctx, r, log) }()
		if c.sweepEvery > 0 {
			go sweep(ctx, c.sweepEvery, outbox, publisher, log)
		}
	} else {
		r, err := outbox.NewRelay(publisher, postgres.RelayConfig{Logger: log, MeterProvider: meters, Standbys: c.standbys})
		if err != nil {
			return err
		}
		go func() { done <- r.Run(ctx) }()
	}
	if c.retention > 0 || c.processedRetention > 0 {
		go cleanup(ctx, c, outbox, js, stream.Name, log)
	}
	err = <-done
	log.Info("outbox-relay: stopped", "err", err)
	return err
}

// runLog runs the log relay until ctx ends; when its slot is lost, or
// missing (a promoted standby), it makes it anew and publishes what the
// relay may have missed (LogRelay.Recover), then streams on. A slot of
// another database (postgres.ErrSlotOfAnotherDatabase) is never taken: Run
// returns it, and so does runLog.
func runLog(ctx context.Context, r *postgres.LogRelay, log *slog.Logger) error {
	for {
		err := r.Run(ctx)
		if !errors.Is(err, postgres.ErrSlotLost) && !errors.Is(err, postgres.ErrNoSlot) {
			return err
		}
		log.Warn("outbox-relay: the log relay's slot is gone: making it anew, and publishing what it may have missed", "err", err)
		n, err := r.Recover(ctx)
		if err != nil {
			log.Error("outbox-relay: recovering the slot failed; trying again in 2 s", "err", err, "published", n)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(2 * time.Second):
			}
			continue
		}
		log.Info("outbox-relay: slot recovered", "slot", r.Config().Slot, "published", n)
	}
}

// sweep publishes, with a polling pass, the unsent rows the log relay
// cannot carry, since the log holds only inserts it has not yet confirmed:
// rows put back with unpark (Outbox.Unpark), and rows committed before the
// slot existed. Every every, once the oldest unsent row has waited longer
// than every (the log relay marks what it delivers within a moment, so a
// row that old is one it missed, or it is behind), it runs passes until one
// is not full. A row the log relay also sends goes twice, as at least once
// allows: consumers drop the copy by its key.
func sweep(ctx context.Context, every time.Duration, outbox *postgres.Outbox[postgres.SQLTx],
	publisher postgres.MessageBroker, log *slog.Logger) {
	// PollOnly: the sweep only passes, on the pool's connections.
	relay, err := outbox.NewRelay(publisher, postgres.RelayConfig{Logger: log, PollOnly: true})
	if err != nil {
		log.Error("outbox-relay: sweep: no relay", "err", err)
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		read, cancel := context.WithTimeout(ctx, 10*time.Second)
		lag, err := outbox.ReadLag(read)
		cancel()
		if err != nil {
			log.Warn("outbox-relay: sweep: reading the lag failed", "err", err)
			continue
		}
		if lag.Unsent == 0 || lag.Oldest < every {
			continue
		}
		total := 0
		for {
			n, err := relay.PublishPending(ctx)
			total += n
			if err != nil {
				log.Warn("outbox-relay: sweep: a polling pass failed", "err", err, "published", total)
				break
			}
			if n < relay.Config().BatchSize {
				break
			}
		}
		log.Info("outbox-relay: swept unsent rows the log relay had not delivered", "published", total,
			"oldest_waited", lag.Oldest, "unsent", lag.Unsent)
	}
}

// cleanup deletes the rows sent longer than the retention ago and, if
// asked, the consumers' keys older than processedRetention (never shorter
// than the stream keeps its messages: natsbroker.ForgetProcessed refuses
// it), every cleanupEvery, until ctx ends.
func cleanup(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], js jetstream.JetStream, stream string, log *slog.Logger) {
	t := time.NewTicker(c.cleanupEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if c.retention > 0 {
			n, err := outbox.DeleteSent(ctx, c.retention)
			switch {
			case err != nil && ctx.Err() == nil:
				log.Error("outbox-relay: cleanup failed", "err", err, "deleted", n)
			case n > 0:
				log.Info("outbox-relay: cleanup", "deleted", n, "retention", c.retention.String())
			}
		}
		if c.processedRetention > 0 {
			n, err := natsbroker.ForgetProcessed(ctx, js, stream, outbox, c.processedRetention)
			switch {
			case err != nil && ctx.Err() == nil:
				log.Error("outbox-relay: forgetting processed keys failed", "err", err, "forgotten", n)
			case n > 0:
				log.Info("outbox-relay: processed keys forgotten", "forgotten", n, "retention", c.processedRetention.String())
			}
		}
	}
}
