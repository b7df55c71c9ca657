package main

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"example.com/patterns/enterprise/outbox/postgres"
)

// printer writes a command's results: a line a person reads, or, with
// -json, the value as one line of JSON.
type printer struct {
	out  io.Writer
	json bool
}

func newPrinter(out io.Writer, asJSON bool) printer { return printer{out, asJSON} }

func (p printer) print(v any, text string) error {
	if !p.json {
		_, err := fmt.Fprintln(p.out, text)
		return err
	}
	line, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(p.out, string(line))
	return err
}

// operation is a command that needs the database alone.
type operation func(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], db *sql.DB, args []string, p printer, log *slog.Logger) error

// operations are the operator's commands on the database alone, bounded in
// time; check, which also dials the broker, is one of them.
var operations = map[string]operation{
	"lag":    lag,
	"parked": parked,
	"unpark": unpark,
	"drop":   drop,
	"replay": replay,

	"forget-position": forgetPosition,
	"check":           check,
}

// commandTimeout bounds each operator command.
const commandTimeout = 30 * time.Second

func lag(ctx context.Context, _ config, outbox *postgres.Outbox[postgres.SQLTx], _ *sql.DB, _ []string, p printer, _ *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	l, err := outbox.ReadLag(ctx)
	if err != nil {
		return err
	}
	v := map[string]any{"table": outbox.Table(), "unsent": l.Unsent, "parked": l.Parked, "failing": l.Failing,
		"scheduled": l.Scheduled, "oldestWaitSeconds": l.Oldest.Seconds()}
	text := fmt.Sprintf("%s: %d unsent, %d parked, %d failing (%d or more failed attempts), %d scheduled for later; the oldest unsent waited %v",
		outbox.Table(), l.Unsent, l.Parked, l.Failing, postgres.FailingAfter, l.Scheduled, l.Oldest.Round(time.Millisecond))
	if b := l.Blocking; b != nil {
		v["blocking"] = map[string]any{"id": b.ID, "key": b.Key, "type": b.Type, "aggregate": b.Aggregate,
			"attempts": b.Attempts, "lastError": b.LastError}
		text += "\n" + blockingText(b)
	}
	return p.print(v, text)
}

// blockingText says which row holds the outbox up, and why: the first
// unsent row that failed at all, which is failing only past
// postgres.FailingAfter attempts.
func blockingText(b *postgres.BlockingRow) string {
	if b == nil {
		return ""
	}
	of := ""
	if b.Aggregate != "" {
		of = ", aggregate " + b.Aggregate
	}
	return fmt.Sprintf("first unsent row that failed: row %d (%s%s, key %s) after %d attempts: %s", b.ID, b.Type, of, b.Key, b.Attempts, b.LastError)
}

func parked(ctx context.Context, _ config, outbox *postgres.Outbox[postgres.SQLTx], _ *sql.DB, _ []string, p printer, _ *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	rows, err := outbox.ListParked(ctx, 0)
	if err != nil {
		return err
	}
	for _, r := range rows {
		v := map[string]any{"id": r.ID, "key": r.Key, "type": r.Type, "aggregate": r.Aggregate, "seq": r.Seq,
			"attempts": r.Attempts, "rejections": r.Rejections, "lastError": r.LastError, "parkedAt": r.ParkedAt}
		text := fmt.Sprintf("%d\t%s\t%s\trejections %d\tparked %s\t%s", r.ID, r.Key, r.Type, r.Rejections,
			r.ParkedAt.Format(time.RFC3339), r.LastError)
		if err := p.print(v, text); err != nil {
			return err
		}
	}
	if len(rows) == 0 && !p.json {
		return p.print(nil, "no parked rows")
	}
	return nil
}

// rowID is the command's argument, checked by parse.
func rowID(args []string) int64 {
	id, _ := strconv.ParseInt(args[0], 10, 64)
	return id
}

func unpark(ctx context.Context, _ config, outbox *postgres.Outbox[postgres.SQLTx], _ *sql.DB, args []string, p printer, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	id := rowID(args)
	if err := outbox.Unpark(ctx, id); err != nil {
		return err
	}
	log.Info("outbox-relay: parked row put back, to be published again", "table", outbox.Table(), "id", id)
	return p.print(map[string]any{"unparked": id}, fmt.Sprintf("row %d put back: the next pass publishes it", id))
}

func drop(ctx context.Context, _ config, outbox *postgres.Outbox[postgres.SQLTx], _ *sql.DB, args []string, p printer, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	r, err := outbox.DropParked(ctx, rowID(args))
	if err != nil {
		return err
	}
	log.Warn("outbox-relay: parked row dropped for good", "table", outbox.Table(), "id", r.ID, "key", r.Key,
		"type", r.Type, "aggregate", r.Aggregate, "seq", r.Seq, "rejections", r.Rejections, "reason", r.LastError)
	return p.print(map[string]any{"dropped": r.ID, "key": r.Key, "type": r.Type, "lastError": r.LastError},
		fmt.Sprintf("row %d (%s, key %s) dropped for good; it was parked for: %s", r.ID, r.Type, r.Key, r.LastError))
}

// replay puts back the sent rows that -aggregate, -from and -to select, to
// be published again (in log mode by the next sweep), and says how many,
// and how many of them the broker drops as copies: without -new-keys it
// asks the broker its duplicate window, and refuses rows sent within it
// unless -allow-dropped.
func replay(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], _ *sql.DB, _ []string, p printer, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	r := c.replay
	if !r.NewKeys {
		b, err := dialBroker(ctx, c)
		if err == nil {
			r.DuplicateWindow, err = b.DuplicateWindow(ctx)
			b.Close()
		}
		if err != nil {
			return fmt.Errorf("replay with the old keys asks %s its duplicate window, and could not: %w (or replay -new-keys)", c.broker, err)
		}
	}
	res, err := outbox.Replay(ctx, r)
	if errors.Is(err, postgres.ErrInDuplicateWindow) {
		return fmt.Errorf("%w: -new-keys (a consumer that kept the old keys applies them again), or -allow-dropped", err)
	}
	if err != nil {
		return err
	}
	taken := res.Rows - res.Dropped
	log.Warn("outbox-relay: sent rows put back, to be published again", "table", outbox.Table(), "rows", res.Rows,
		"taken", taken, "dropped", res.Dropped, "window", r.DuplicateWindow.String(),
		"aggregate", r.Aggregate, "from", r.From, "to", r.To, "newKeys", r.NewKeys)
	text := fmt.Sprintf("%d rows put back (%s): the next pass publishes them; ", res.Rows, r)
	switch {
	case res.Dropped > 0:
		text += fmt.Sprintf("%s takes %d and drops %d as copies (sent within its duplicate window, %v, until %s)",
			c.broker, taken, res.Dropped, r.DuplicateWindow, res.Until.Format(time.RFC3339))
	case r.DuplicateWindow > 0 || r.NewKeys:
		text += fmt.Sprintf("%s takes all %d", c.broker, res.Rows)
	default:
		text += fmt.Sprintf("%s drops none: consumers drop by key what they applied", c.broker)
	}
	v := map[string]any{"replayed": res.Rows, "taken": taken, "dropped": res.Dropped, "duplicateWindowSeconds": r.DuplicateWindow.Seconds()}
	return p.print(v, text)
}

// forgetPosition forgets -consumer's position of -aggregate, in the
// consumer's database (-database), so that it applies the aggregate's
// events again from its first: with replay -new-keys, how a consumer that
// lost what those events did gets it back. Its keys of them are left: a
// replay with the old keys is still dropped as copies.
func forgetPosition(ctx context.Context, c config, _ *postgres.Outbox[postgres.SQLTx], db *sql.DB, _ []string, p printer, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	ob, err := postgres.OpenDB(db, postgres.Config{Table: c.table, Consumer: c.consumer})
	if err != nil {
		return fmt.Errorf("-consumer: %w", err)
	}
	forgot, err := ob.ForgetPosition(ctx, c.replay.Aggregate)
	if err != nil {
		return err
	}
	who := cmp.Or(c.consumer, `the default consumer ("")`)
	log.Warn("outbox-relay: a consumer's position forgotten", "consumer", c.consumer, "aggregate", c.replay.Aggregate, "forgot", forgot)
	text := fmt.Sprintf("%s: position of %q forgotten: it applies the aggregate's events again from its first (replay -new-keys sends them)", who, c.replay.Aggregate)
	if !forgot {
		text = fmt.Sprintf("%s: no position of %q: nothing to forget (is -consumer its name?)", who, c.replay.Aggregate)
	}
	return p.print(map[string]any{"consumer": c.consumer, "aggregate": c.replay.Aggregate, "forgot": forgot}, text)
}

// check checks what run needs, each part on a line of its own: the
// database answers, the schema is at its version, the role has the
// privileges the mode needs, and the broker answers with what the relay
// publishes to. It returns an error if any part failed.
func check(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], db *sql.DB, _ []string, p printer, _ *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	failed := 0
	report := func(what string, err error, ok string) error {
		v := map[string]any{"check": what, "ok": err == nil}
		text := "ok    " + what + ": " + ok
		if err != nil {
			failed++
			v["error"] = err.Error()
			text = "FAIL  " + what + ": " + err.Error()
		}
		return p.print(v, text)
	}
	var version string
	err := db.QueryRowContext(ctx, `SELECT current_setting('server_version')`).Scan(&version)
	if err := report("database", err, "PostgreSQL "+version); err != nil {
		return err
	}
	role, _ := part(c)
	schema, at := outbox.CheckSchema, fmt.Sprintf("table %s at version %d", outbox.Table(), postgres.SchemaVersion)
	if role == postgres.RoleConsumer || role == postgres.RoleConsumerMigrator {
		schema, at = outbox.CheckConsumerSchema, fmt.Sprintf("the consumer's tables at version %d", postgres.ConsumerSchemaVersion)
	}
	if err := report("schema", schema(ctx), at); err != nil {
		return err
	}
	if err := report("privileges", privileges(ctx, c, outbox, db), "the role has what the "+string(role)+" needs"); err != nil {
		return err
	}
	if c.relay.StandbyCount > 0 {
		if err := report("standbys", standbys(ctx, c, outbox), fmt.Sprintf("the primary has the standbys -standby-count %d wants", c.relay.StandbyCount)); err != nil {
			return err
		}
	}
	if role == postgres.RoleConsumer || role == postgres.RoleConsumerMigrator {
		// A consumer's database has no broker of its own: its consumer
		// reads one a relay publishes to, checked by that relay's check.
		if err := p.print(map[string]any{"check": "broker", "ok": true, "skipped": true},
			"--    broker: not checked: the "+string(role)+"'s part reaches no broker"); err != nil {
			return err
		}
	} else {
		b, err := dialBroker(ctx, c)
		if err == nil {
			defer b.Close()
			err = errors.Join(b.Check(ctx), b.CheckRetention(ctx, c.processedRetention))
		}
		if err := report("broker", err, c.broker+": reachable, and what the relay publishes to is as configured"); err != nil {
			return err
		}
	}
	if failed > 0 {
		return fmt.Errorf("check: %d part(s) failed", failed)
	}
	return nil
}

// part is the role whose privileges grants prints and check checks
// (-role, or the relay -mode runs), and what the flags add to it:
// pg_read_all_stats with -standbys and the consumers' tables with
// -processed-retention, for a relay; in log mode, CREATE on the database
// and REPLICATION for the migrator, which makes the publication and the
// slot.
func part(c config) (postgres.Role, []postgres.Privilege) {
	role := postgres.Role(c.role)
	if role == "" {
		role = postgres.RoleRelay
		if c.mode == "log" {
			role = postgres.RoleLogRelay
		}
	}
	var extra []postgres.Privilege
	switch role {
	case postgres.RoleMigrator:
		if c.mode == "log" {
			extra = append(extra, postgres.PrivilegePublication, postgres.PrivilegeReplication)
		}
	case postgres.RoleRelay, postgres.RoleLogRelay:
		if len(c.relay.Standbys) > 0 || c.relay.StandbyCount > 0 {
			extra = append(extra, postgres.PrivilegeReadAllStats)
		}
		if c.processedRetention > 0 {
			consumer, _ := postgres.Privileges(c.table, postgres.RoleConsumer)
			for _, p := range consumer {
				if p.On == "TABLE" && p.Object != "outbox_consumer_migrations" && (p.Privilege == "DELETE" || p.Privilege == "SELECT") {
					p.For += " (-processed-retention)"
					extra = append(extra, p)
				}
			}
		}
	}
	return role, extra
}

// privileges checks the privileges of the role check is for, and in log
// mode that the slot exists.
func privileges(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], db *sql.DB) error {
	role, extra := part(c)
	errs := []error{outbox.CheckPrivileges(ctx, role, extra...)}
	if role == postgres.RoleLogRelay {
		slot := cmp.Or(c.log.Slot, outbox.Slot())
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()`, slot).Scan(&n); err != nil {
			errs = append(errs, err)
		} else if n == 0 {
			errs = append(errs, fmt.Errorf("-mode log: no replication slot %s in this database: run migrate-database -mode log", slot))
		}
	}
	return errors.Join(errs...)
}

// grants prints the statements that give -grantee what -role needs of the
// outbox's tables in -schema, and nothing more, each privilege first as a
// comment with what needs it: SQL for the migrator, or the tables' owner,
// to run once migrate-database has made them. It connects to nothing; the
// migrator's privilege on the database names -database's dbname.
func grants(c config, p printer) error {
	role, extra := part(c)
	privs, err := postgres.Privileges(c.table, role)
	if err != nil {
		return fmt.Errorf("-table: %w", err)
	}
	privs = append(privs, extra...)
	database := ""
	if c.database != "" {
		cfg, err := pgx.ParseConfig(c.database)
		if err != nil {
			return fmt.Errorf("-database: %w", err)
		}
		database = cfg.Database
	}
	if role == postgres.RoleMigrator && c.mode == "log" && database == "" {
		return errors.New("grants -role migrator -mode log: -database names the database it creates the publication in")
	}
	stmts, err := postgres.GrantStatements(privs, c.schema, database, c.grantee)
	if err != nil {
		return err
	}
	if p.json {
		return p.print(map[string]any{"role": role, "grantee": c.grantee, "statements": stmts}, "")
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- %s, the outbox's %s (table %s.%s): what it needs, and nothing more.\n", c.grantee, role, c.schema, cmp.Or(c.table, postgres.DefaultTable))
	for _, pr := range privs {
		fmt.Fprintf(&b, "--   %s: %s\n", pr, pr.For)
	}
	if role == postgres.RoleMigrator {
		b.WriteString("-- The migrator owns what it creates: run every migration as this role.\n")
	}
	for _, s := range stmts {
		b.WriteString(s + ";\n")
	}
	return p.print(nil, strings.TrimSuffix(b.String(), "\n"))
}
