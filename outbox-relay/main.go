// Command outbox-relay is the outbox's relay as a process of its own, to
// deploy beside the services that write the outbox: it publishes the rows of
// one outbox table in PostgreSQL to NATS JetStream, RabbitMQ or Kafka, and
// deletes them once they have been sent longer than their retention.
//
//	outbox-relay migrate    migrate-database and provision, for a role that may do both
//	outbox-relay migrate-database  creates the outbox's tables (in log mode, its slot), and connects to no broker
//	outbox-relay provision  creates the broker's stream, or exchanges and queues, and connects to no database
//	outbox-relay migrate-consumer  creates a consumer's tables alone, in a consumer's database: no outbox table
//	outbox-relay version    prints its version, the modules' and the schemas' it wants
//	outbox-relay grants     prints the SQL that gives -grantee what -role needs, and nothing more
//	outbox-relay run        relays until SIGTERM or SIGINT, then returns once what the broker accepted is marked
//	outbox-relay check      checks the database, the schema, the role's privileges and the broker; exits 1 if any fails
//	outbox-relay lag        prints how far the relays are behind
//	outbox-relay parked     lists the parked rows
//	outbox-relay unpark ID  puts the parked row ID back, to be published again
//	outbox-relay drop ID    deletes the parked row ID for good, and logs its key, type and last error
//	outbox-relay replay     puts back the sent rows of -aggregate, or written from -from to -to, to be published again,
//	                        saying what the broker takes and drops as copies
//	outbox-relay forget-position  in a consumer's database, has -consumer apply -aggregate again from its first event
//
// Every flag may be given by its environment variable instead (the flag
// wins): outbox-relay run -h lists them, each with its variable. Every value
// is checked before anything connects, and a bad one is refused with the
// flag's name. -json prints each command's result as JSON, one value a
// line. Secrets (the NATS password or token, the RabbitMQ and Kafka passwords) are read
// from a file (-nats-password-file, …) or the environment
// (OUTBOX_NATS_PASSWORD, …), never from a flag's value, and never printed;
// PostgreSQL's password comes from PGPASSWORD or a .pgpass file, as pgx
// reads them.
//
// /healthz answers 503 when rows wait and no pass succeeded for -stall-after;
// /readyz answers 200 only while the database answers, the outbox's schema is
// at its version, the role has the privileges the relay needs and the
// broker's stream, or exchange and queues, are as
// configured (checked every -check-every, never changed: migrate provisions
// them), 503 with the reason otherwise; a log relay that stands by (its slot
// read by another) answers 200 and says so. /metrics is the relay's
// OpenTelemetry instruments and the outbox's lag gauges, in Prometheus's
// format. Logs are JSON on standard error.
//
// The first SIGTERM or SIGINT stops the relay, which marks what the broker
// accepted and exits 0; a second one, or -grace passing first, ends the
// process at once, exit code 1, saying what it left: rows published and not
// yet marked are published again by the next relay, and consumers drop the
// copies by key.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
)

const usage = "usage: outbox-relay version|migrate|migrate-database|migrate-consumer|provision|grants|run|check|lag|parked|unpark ID|drop ID|replay|forget-position [flags]; outbox-relay run -h lists the flags"

func main() {
	os.Exit(cli(os.Args[1:], os.Stdout, os.Stderr))
}

// cli runs the command args names, writing results to out and logs to
// errOut, and returns the exit code: 0 done, 1 failed, 2 refused (a bad
// flag or command).
func cli(args []string, out, errOut io.Writer) int {
	log := slog.New(slog.NewJSONHandler(errOut, nil))
	if len(args) < 1 {
		fmt.Fprintln(errOut, usage)
		return 2
	}
	cmd := args[0]
	switch cmd {
	case "-h", "-help", "--help", "help": // asked for, not a mistake
		fmt.Fprintln(out, usage)
		return 0
	case "version", "-version", "--version":
		fmt.Fprintln(out, version())
		return 0
	}
	cfg, rest, err := parse(cmd, args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(errOut, "outbox-relay:", err)
		return 2
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(signals)
	done := make(chan error, 1)
	go func() { done <- runCommand(ctx, cmd, cfg, rest, out, log) }()

	var grace <-chan time.Time
	for {
		select {
		case err := <-done:
			if err != nil && !errors.Is(err, context.Canceled) {
				log.Error("outbox-relay: "+cmd+" failed", "err", err)
				return 1
			}
			return 0
		case sig := <-signals:
			if grace == nil {
				log.Info("outbox-relay: stopping: marking what the broker accepted; a second signal exits at once",
					"signal", sig.String(), "grace", cfg.grace.String())
				cancel()
				grace = time.After(cfg.grace)
				continue
			}
			log.Warn("outbox-relay: second signal: exiting at once; rows published and not yet marked go again with the next relay, and consumers drop the copies by key",
				"signal", sig.String())
			return 1
		case <-grace:
			log.Warn("outbox-relay: grace period over: exiting at once; rows published and not yet marked go again with the next relay, and consumers drop the copies by key",
				"grace", cfg.grace.String())
			return 1
		}
	}
}

// version is the relay's version and the modules' it was built from, with
// the schema versions it wants, Go's, and the commit if the build recorded
// one: what an operator pastes into a report.
func version() string {
	v := fmt.Sprintf("outbox-relay %s: postgres %s (outbox schema %d, consumer schema %d)",
		postgres.Version, postgres.Version, postgres.SchemaVersion, postgres.ConsumerSchemaVersion)
	for _, k := range brokerKinds {
		v += fmt.Sprintf(", %s %s", k.module, k.version)
	}
	if info, ok := debug.ReadBuildInfo(); ok {
		v += "; " + info.GoVersion
		settings := map[string]string{}
		for _, s := range info.Settings {
			settings[s.Key] = s.Value
		}
		if rev := settings["vcs.revision"]; rev != "" {
			v += ", commit " + rev
			if settings["vcs.modified"] == "true" {
				v += " (modified)"
			}
		}
	}
	return v
}

// runCommand is run; a test makes it one that does not stop, to see the
// second signal end the process.
var runCommand = run

// run opens the database (connecting only when a command needs it) and
// runs cmd.
func run(ctx context.Context, cmd string, c config, args []string, out io.Writer, log *slog.Logger) error {
	switch cmd {
	case "grants": // no connection
		return grants(c, newPrinter(out, c.json))
	case "provision": // the broker alone
		b, err := connect(ctx, c, log)
		if err != nil {
			return err
		}
		defer b.Close()
		return provision(ctx, c, b, newPrinter(out, c.json), log)
	}
	pgcfg, err := pgx.ParseConfig(c.database)
	if err != nil {
		return fmt.Errorf("-database: %w", err)
	}
	pgcfg.RuntimeParams["application_name"] = "outbox-relay"
	db := stdlib.OpenDB(*pgcfg)
	defer db.Close()
	db.SetMaxOpenConns(4) // a pass's two, the listener, and one for cleanup and the gauges
	outbox, err := postgres.OpenDB(db, postgres.Config{Table: c.table})
	if err != nil {
		return fmt.Errorf("-table: %w", err)
	}
	// The relay's settings, checked by the package as it makes the relays,
	// before any connection.
	if _, err := outbox.NewRelay(noBroker{}, c.relay); err != nil {
		return fmt.Errorf("relay settings: %w", err)
	}
	if _, err := outbox.NewLogRelayConfig(pgcfg.Config.Copy(), noBroker{}, c.log); err != nil {
		return fmt.Errorf("log relay settings: %w", err)
	}
	if r, ok := operations[cmd]; ok {
		return r(ctx, c, outbox, db, args, newPrinter(out, c.json), log)
	}
	switch cmd { // the database alone
	case "migrate-database":
		return migrateDatabase(ctx, c, outbox, newPrinter(out, c.json), log)
	case "migrate-consumer":
		if err := outbox.MigrateConsumer(ctx); err != nil {
			return err
		}
		log.Info("outbox-relay: consumer's tables migrated", "schema_version", postgres.ConsumerSchemaVersion)
		return newPrinter(out, c.json).print(map[string]any{"consumerSchemaVersion": postgres.ConsumerSchemaVersion},
			fmt.Sprintf("migrated: the consumer's tables at version %d", postgres.ConsumerSchemaVersion))
	}
	b, err := connect(ctx, c, log)
	if err != nil {
		return err
	}
	defer b.Close()
	if cmd == "migrate" {
		return migrate(ctx, c, outbox, b, newPrinter(out, c.json), log)
	}
	return relay(ctx, c, pgcfg, outbox, b, log)
}

// noBroker is the broker the relays' settings are checked with.
type noBroker struct{}

func (noBroker) Publish(context.Context, postgres.Message) error {
	return postgres.ErrBrokerUnavailable
}

// connect dials the broker until it answers or ctx ends; a certificate
// or a credential it refused ends the command at once, naming the flag.
func connect(ctx context.Context, c config, log *slog.Logger) (broker, error) {
	for {
		b, err := dialBroker(ctx, c)
		if err == nil {
			return b, nil
		}
		if isRefused(err) {
			return nil, err
		}
		log.Warn("outbox-relay: the broker does not answer; trying again in 2 s", "broker", c.broker, "err", err)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
}

// migrate is migrate-database and provision, for a deployment whose one
// role may do both.
func migrate(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], b broker, p printer, log *slog.Logger) error {
	if err := migrateDatabase(ctx, c, outbox, printer{out: io.Discard}, log); err != nil {
		return err
	}
	made, err := b.Provision(ctx)
	if err != nil {
		return err
	}
	log.Info("outbox-relay: migrated", "table", outbox.Table(), "schema_version", postgres.SchemaVersion, "broker", c.broker, "provisioned", made)
	return p.print(map[string]any{"table": outbox.Table(), "schemaVersion": postgres.SchemaVersion, "broker": c.broker, "provisioned": made},
		fmt.Sprintf("migrated: table %s at schema version %d; %s: %s", outbox.Table(), postgres.SchemaVersion, c.broker, made))
}

// migrateDatabase brings the outbox's tables to the package's version and,
// in log mode, creates the log relay's slot: what the migrator's role does
// (grants -role migrator, and the REPLICATION attribute for the slot).
func migrateDatabase(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], p printer, log *slog.Logger) error {
	if err := outbox.Migrate(ctx); err != nil {
		return err
	}
	slot := ""
	if c.mode == "log" {
		if err := outbox.CreateLogSlot(ctx, c.log.Slot); err != nil {
			return err
		}
		slot = cmp.Or(c.log.Slot, outbox.Slot())
	}
	log.Info("outbox-relay: database migrated", "table", outbox.Table(), "schema_version", postgres.SchemaVersion, "slot", slot)
	text := fmt.Sprintf("migrated: table %s at schema version %d", outbox.Table(), postgres.SchemaVersion)
	if slot != "" {
		text += "; slot " + slot
	}
	return p.print(map[string]any{"table": outbox.Table(), "schemaVersion": postgres.SchemaVersion, "slot": slot}, text)
}

// provision makes the broker's stream, or its exchanges and queues, as the
// relay checks them, connecting to no database: a role of the broker's
// that may configure runs it.
func provision(ctx context.Context, c config, b broker, p printer, log *slog.Logger) error {
	made, err := b.Provision(ctx)
	if err != nil {
		return err
	}
	log.Info("outbox-relay: broker provisioned", "broker", c.broker, "provisioned", made)
	return p.print(map[string]any{"broker": c.broker, "provisioned": made}, fmt.Sprintf("provisioned: %s: %s", c.broker, made))
}
