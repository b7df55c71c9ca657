package postgres

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strconv"
	"strings"
	"time"
)

// The schema is a list of numbered migrations, migrations/NNNN_name.sql,
// applied by Migrate apart from the application's start-up and checked by
// CheckSchema at it. DDL takes locks that wait behind every open
// transaction on its table, and every statement after it waits behind the
// DDL: run at each start of a service, it queues the service's own writes.

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migration is one numbered file of migrations/.
type migration struct {
	version int
	name    string
	sql     string
}

// migrations are the embedded files in version order; the numbers run from
// 1 without a gap, which a test checks.
var migrations = func() []migration {
	files, err := fs.Glob(migrationFiles, "migrations/*.sql")
	if err != nil {
		panic(err)
	}
	var ms []migration
	for _, f := range files { // Glob sorts by name, so by number
		base := path.Base(f)
		num, _, _ := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if err != nil {
			panic("postgres: migration file without a number: " + base)
		}
		b, err := migrationFiles.ReadFile(f)
		if err != nil {
			panic(err)
		}
		ms = append(ms, migration{version: v, name: strings.TrimSuffix(base, ".sql"), sql: string(b)})
	}
	return ms
}()

// SchemaVersion is the number of the last migration this package has: the
// version [CheckSchema] wants the database at.
var SchemaVersion = migrations[len(migrations)-1].version

// MigrationLockTimeout is how long a migration's statement waits for a lock
// before [Migrate] gives up with an error. DDL waits behind every open
// transaction that touched its table, and every statement on the table
// waits behind the DDL, so a long wait would stall the service's own
// writes; a short one fails the migration instead, to be run again.
const MigrationLockTimeout = 2 * time.Second

// ErrSchemaVersion is wrapped by [CheckSchema]'s error when the database's
// schema is not at [SchemaVersion].
var ErrSchemaVersion = errors.New("postgres: database schema is not at this package's version")

// migrationsTable records each migration applied: its version, its name and
// when. The name carries the module's prefix so as not to meet a team's own
// schema_migrations.
const migrationsTable = `CREATE TABLE IF NOT EXISTS outbox_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)`

// migrationLock is the key of the advisory lock that keeps two Migrates of
// one database from running a migration at the same time.
const migrationLock = 7_468_327_001

// Migrate brings the schema of db to [SchemaVersion]: it applies, in order,
// each migration that the table outbox_migrations does not record yet,
// each in a transaction of its own with its record, so that a migration is
// applied whole or not at all. It is idempotent: run again, it applies
// nothing; run by two processes at once, the second waits for the first
// and then applies nothing. Each statement waits at most
// [MigrationLockTimeout] for a lock; a migration that times out is rolled
// back and Migrate returns an error saying which, to be run again.
//
// Run it as a step of its own, before the services start: the shop's
// "migrate" command does. Services call [CheckSchema] instead, which takes
// no lock.
func Migrate(ctx context.Context, db *sql.DB) error {
	for _, m := range migrations {
		err := apply(ctx, db, m)
		switch {
		case sqlState(err) == "55P03": // lock_not_available
			return fmt.Errorf("migration %s waited longer than %v for a lock, and is rolled back; run it again: %w",
				m.name, MigrationLockTimeout, err)
		case err != nil:
			return fmt.Errorf("migration %s: %w", m.name, err)
		}
	}
	return nil
}

// apply applies m in a transaction of its own, unless it is recorded.
func apply(ctx context.Context, db *sql.DB, m migration) error {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	defer tx.Rollback()
	for _, stmt := range []string{
		`SET LOCAL lock_timeout = ` + strconv.FormatInt(MigrationLockTimeout.Milliseconds(), 10),
		`SELECT pg_advisory_xact_lock(` + strconv.FormatInt(migrationLock, 10) + `)`,
		migrationsTable,
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	var done bool
	if err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM outbox_migrations WHERE version = $1)`,
		m.version).Scan(&done); err != nil {
		return err
	}
	if done {
		return nil
	}
	if _, err := tx.ExecContext(ctx, m.sql); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO outbox_migrations (version, name) VALUES ($1, $2)`,
		m.version, m.name); err != nil {
		return err
	}
	return commit(tx)
}

// CheckSchema reports, with an error wrapping [ErrSchemaVersion], a
// database whose schema is not at [SchemaVersion]: one that [Migrate] never
// ran on, one it has not yet brought to this version, or one migrated by a
// newer version of this package. It reads one table and takes no lock, so a
// service calls it at start-up and refuses to start on its error, instead
// of running DDL.
func CheckSchema(ctx context.Context, db *sql.DB) error {
	var version sql.NullInt64
	err := db.QueryRowContext(ctx, `SELECT max(version) FROM outbox_migrations`).Scan(&version)
	switch {
	case sqlState(err) == "42P01": // undefined_table
		return fmt.Errorf("%w: no migration was ever applied, want version %d: run migrate first", ErrSchemaVersion, SchemaVersion)
	case err != nil:
		return fmt.Errorf("check schema version: %w", err)
	case version.Int64 < int64(SchemaVersion):
		return fmt.Errorf("%w: it is at version %d, want %d: run migrate first", ErrSchemaVersion, version.Int64, SchemaVersion)
	case version.Int64 > int64(SchemaVersion):
		return fmt.Errorf("%w: it is at version %d, newer than this program's %d", ErrSchemaVersion, version.Int64, SchemaVersion)
	}
	return nil
}
