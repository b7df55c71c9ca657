package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"time"

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
	"check":  check,
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
	return p.print(map[string]any{"table": outbox.Table(), "unsent": l.Unsent, "parked": l.Parked, "failing": l.Failing,
		"scheduled": l.Scheduled, "oldestWaitSeconds": l.Oldest.Seconds()},
		fmt.Sprintf("%s: %d unsent, %d parked, %d failing, %d scheduled for later; the oldest unsent waited %v",
			outbox.Table(), l.Unsent, l.Parked, l.Failing, l.Scheduled, l.Oldest.Round(time.Millisecond)))
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
// be published again (in log mode by the next sweep), and logs how many.
func replay(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], _ *sql.DB, _ []string, p printer, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	n, err := outbox.Replay(ctx, c.replay)
	if err != nil {
		return err
	}
	log.Warn("outbox-relay: sent rows put back, to be published again", "table", outbox.Table(), "rows", n,
		"aggregate", c.replay.Aggregate, "from", c.replay.From, "to", c.replay.To, "newKeys", c.replay.NewKeys)
	return p.print(map[string]any{"replayed": n}, fmt.Sprintf("%d rows put back (%s): the next pass publishes them", n, c.replay))
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
	if err := report("schema", outbox.CheckSchema(ctx), fmt.Sprintf("table %s at version %d", outbox.Table(), postgres.SchemaVersion)); err != nil {
		return err
	}
	if err := report("privileges", privileges(ctx, c, outbox, db), "the role may do what -mode "+c.mode+" needs"); err != nil {
		return err
	}
	b, err := dialBroker(ctx, c)
	if err == nil {
		defer b.Close()
		err = errors.Join(b.Check(ctx), b.CheckRetention(ctx, c.processedRetention))
	}
	if err := report("broker", err, c.broker+": reachable, and what the relay publishes to is as configured"); err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("check: %d part(s) failed", failed)
	}
	return nil
}

// privileges checks what the mode needs beyond the outbox's tables: in log
// mode a role that may replicate, and a slot; with -standbys, the
// pg_read_all_stats role, to read the standbys' positions.
func privileges(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], db *sql.DB) error {
	var super, replicate, stats bool
	if err := db.QueryRowContext(ctx, `SELECT rolsuper, rolreplication, pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
		FROM pg_roles WHERE rolname = current_user`).Scan(&super, &replicate, &stats); err != nil {
		return err
	}
	var errs []error
	if c.mode == "log" {
		if !super && !replicate {
			errs = append(errs, errors.New("-mode log: the role may not replicate (ALTER ROLE … REPLICATION)"))
		}
		slot := c.log.Slot
		if slot == "" {
			slot = outbox.Slot()
		}
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()`, slot).Scan(&n); err != nil {
			errs = append(errs, err)
		} else if n == 0 {
			errs = append(errs, fmt.Errorf("-mode log: no replication slot %s in this database: run migrate -mode log", slot))
		}
	}
	if len(c.relay.Standbys) > 0 && !super && !stats {
		errs = append(errs, errors.New("-standbys: the role is not in pg_read_all_stats, so it cannot read the standbys' positions (GRANT pg_read_all_stats TO …)"))
	}
	return errors.Join(errs...)
}
