package postgres

import (
	"context"
	"database/sql"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"
)

// An Outbox is one outbox table of a database and everything named after
// it, in one place: the table, its indexes (<table>_unsent,
// <table>_parked, <table>_unsent_by_aggregate, <table>_held), its NOTIFY trigger and
// function (<table>_notify), the channel they notify and Run listens on
// (<table>), the publication of its inserts for the log relay
// (<table>_inserts), the log relay's default slot (<table>), and the record
// of its migrations (<table>_migrations). So two outboxes can live in one
// database, a billing outbox beside another service's, each with its own
// relays, lag and cleanup. The consumer's tables, processed_messages and
// aggregate_positions, are not the outbox's and are shared.
//
// [DefaultOutbox] is the table outbox, which the package's functions
// (InsertOutbox, NewOutboxRelay, Migrate, ReadLag, …) use; an Outbox's
// methods of the same names do the same on its own table. An Outbox is
// immutable and safe for concurrent use. Create one with [NewOutbox].
type Outbox struct {
	table      string
	sql        statements
	migrations *MigrationSet
}

// statements are the package's statements with an outbox's names written
// in.
type statements struct {
	insertRow, insertTracedRow                     string
	claimRows, claimRuns, checkRuns, markSent      string
	recordFailure, readLag, deleteSent, listParked string
	unpark, dropParked                             string
}

// DefaultOutbox is the outbox table named outbox: the one the package's
// functions use.
var DefaultOutbox = func() *Outbox {
	o, err := NewOutbox("outbox")
	if err != nil {
		panic(err) // a bug of this package
	}
	return o
}()

// NewOutbox returns the Outbox of the table named table: a name of
// lowercase letters, digits and '_' that starts with a letter, at most 40
// bytes so that the names made from it fit PostgreSQL's 63, such as
// "billing_outbox". [Outbox.Migrate] creates it. Any other name is refused
// with an error.
func NewOutbox(table string) (*Outbox, error) {
	if !tableName.MatchString(table) {
		return nil, fmt.Errorf("postgres: outbox table %q: want lowercase letters, digits and '_', starting with a letter, at most 40 bytes", table)
	}
	o := &Outbox{table: table}
	o.sql = statements{
		insertRow: o.named(insertRow), insertTracedRow: o.named(insertTracedRow),
		claimRows: o.named(claimRows), claimRuns: o.named(claimRuns), checkRuns: o.named(checkRuns),
		markSent: o.named(markSent), recordFailure: o.named(recordFailure),
		readLag: o.named(readLag), deleteSent: o.named(deleteSent), listParked: o.named(listParked),
		unpark: o.named(unpark), dropParked: o.named(dropParked),
	}
	lock := int64(7_468_327_001) // the default outbox's, as before names were chosen
	if table != "outbox" {
		h := fnv.New64a()
		h.Write([]byte(table))
		lock = int64(h.Sum64() >> 1)
	}
	migs, err := loadMigrations(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	for i := range migs {
		migs[i].sql = o.named(migs[i].sql)
	}
	o.migrations = &MigrationSet{table: o.named("outbox_migrations"), lock: lock, migrations: migs}
	return o, nil
}

var tableName = regexp.MustCompile(`^[a-z][a-z0-9_]{0,39}$`)

// Table is the outbox's table; Channel the channel its trigger notifies at
// each commit that inserted rows, which Run listens on; Publication the
// publication of its inserts, which the log relay reads; Slot the log
// relay's default replication slot.
func (o *Outbox) Table() string       { return o.table }
func (o *Outbox) Channel() string     { return o.table }
func (o *Outbox) Publication() string { return o.table + "_inserts" }
func (o *Outbox) Slot() string        { return o.table }

// outboxName matches the names the package's SQL gives the default
// outbox's objects, each a whole word.
var outboxName = regexp.MustCompile(`\boutbox(_unsent_by_aggregate|_unsent|_parked|_held|_notify|_inserts|_migrations)?\b`)

// named is query with the default outbox's names replaced by o's: the
// table, its indexes, trigger, function, channel, publication and record
// of migrations. A name followed by a dot (the custom settings
// outbox.wal_flushed, the message prefix outbox.flush) is not one of them.
func (o *Outbox) named(query string) string {
	if o.table == "outbox" {
		return query
	}
	var b strings.Builder
	last := 0
	for _, m := range outboxName.FindAllStringIndex(query, -1) {
		if m[1] < len(query) && query[m[1]] == '.' {
			continue
		}
		b.WriteString(query[last:m[0]])
		b.WriteString(o.table + strings.TrimPrefix(query[m[0]:m[1]], "outbox"))
		last = m[1]
	}
	b.WriteString(query[last:])
	return b.String()
}

// Migrate is [Migrate] for o: it creates o's table and what is named after
// it, and the consumer's tables if they do not exist, recorded in
// <table>_migrations.
func (o *Outbox) Migrate(ctx context.Context, db *sql.DB) error { return o.migrations.Apply(ctx, db) }

// CheckSchema is [CheckSchema] for o.
func (o *Outbox) CheckSchema(ctx context.Context, db *sql.DB) error {
	return o.migrations.Check(ctx, db)
}

// Insert is [InsertOutbox] into o's table.
func (o *Outbox) Insert(ctx context.Context, tx Executor, eventType string, payload any) (int64, error) {
	return o.insert(ctx, sqlQueryRow(tx), sql.NullString{}, 0, eventType, payload)
}

// InsertPgx is [InsertOutboxPgx] into o's table.
func (o *Outbox) InsertPgx(ctx context.Context, tx PgxQuerier, eventType string, payload any) (int64, error) {
	return o.insert(ctx, pgxQueryRow(tx), sql.NullString{}, 0, eventType, payload)
}

// InsertFor is [InsertOutboxFor] into o's table.
func (o *Outbox) InsertFor(ctx context.Context, tx Executor, aggregate string, seq int64, eventType string, payload any) (int64, error) {
	return o.insert(ctx, sqlQueryRow(tx), sql.NullString{String: aggregate, Valid: true}, seq, eventType, payload)
}

// InsertForPgx is [InsertOutboxForPgx] into o's table.
func (o *Outbox) InsertForPgx(ctx context.Context, tx PgxQuerier, aggregate string, seq int64, eventType string, payload any) (int64, error) {
	return o.insert(ctx, pgxQueryRow(tx), sql.NullString{String: aggregate, Valid: true}, seq, eventType, payload)
}
