// Package migrate applies numbered SQL migrations to a PostgreSQL database
// and checks a database's version, for the outbox package and for the
// example built on it, each with a set of its own.
package migrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strconv"
	"strings"
	"time"
)

// ErrSchemaVersion is wrapped by [Set.Check]'s error when the database's
// schema is not at the set's version.
var ErrSchemaVersion = errors.New("postgres: database schema is not at this package's version")

// LockTimeout is how long a migration's statement waits for a lock before
// [Set.Apply] gives up with an error.
const LockTimeout = 2 * time.Second

// DefaultLockWait is how long [Set.Apply] waits for another Apply of the
// same set (another process migrating the same database) to end before it
// gives up with an error wrapping ErrMigratorBusy.
const DefaultLockWait = time.Minute

// LockWait is DefaultLockWait, a variable so that a test can shorten it.
var LockWait = DefaultLockWait

// ErrMigratorBusy is wrapped by [Set.Apply]'s error when another migrator
// of the same set held its lock longer than LockWait.
var ErrMigratorBusy = errors.New("postgres: another migrator holds the migration lock")

// A Set is the numbered migrations of one package, NNNN_name.sql, recorded
// in a table of their own.
type Set struct {
	table      string
	lock       int64 // advisory lock key: two Applies of a set wait for each other
	migrations []migration
}

type migration struct {
	version int
	name    string
	sql     string
}

// Load reads the files NNNN_name.sql of dir in fsys, whose versions must run
// from 1 without a gap, into a Set recorded in table. It panics on files
// that break the rule: they are embedded in the program, so that is a bug.
func Load(fsys fs.FS, dir, table string, lock int64) *Set {
	files, err := fs.Glob(fsys, dir+"/*.sql")
	if err != nil {
		panic(err)
	}
	s := &Set{table: table, lock: lock}
	for i, f := range files { // Glob sorts by name, so by number
		base := path.Base(f)
		num, _, _ := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if err != nil || v != i+1 {
			panic("migrate: " + f + " is not migration " + strconv.Itoa(i+1))
		}
		b, err := fs.ReadFile(fsys, f)
		if err != nil {
			panic(err)
		}
		s.migrations = append(s.migrations, migration{version: v, name: strings.TrimSuffix(base, ".sql"), sql: string(b)})
	}
	if len(s.migrations) == 0 {
		panic("migrate: no migrations in " + dir)
	}
	return s
}

// Version is the number of the set's last migration.
func (s *Set) Version() int { return s.migrations[len(s.migrations)-1].version }

// Apply applies, in order, each migration of s that its table does not
// record yet, each in a transaction of its own with its record, each
// statement waiting at most LockTimeout for a lock.
func (s *Set) Apply(ctx context.Context, db *sql.DB) error {
	for _, m := range s.migrations {
		err := s.apply(ctx, db, m)
		switch {
		case errors.Is(err, ErrMigratorBusy):
			return fmt.Errorf("migration %s: %w longer than %v (its table %s); nothing was applied by this run: run it again",
				m.name, ErrMigratorBusy, LockWait, s.table)
		case sqlState(err) == "55P03": // lock_not_available
			return fmt.Errorf("migration %s waited longer than %v for a lock, and is rolled back; run it again: %w",
				m.name, LockTimeout, err)
		case err != nil:
			return fmt.Errorf("migration %s: %w", m.name, err)
		}
	}
	return nil
}

func (s *Set) apply(ctx context.Context, db *sql.DB, m migration) error {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	defer tx.Rollback()
	// Another migrator of the set is waited for, up to LockWait; then each
	// statement waits at most LockTimeout for a lock of the tables.
	if _, err := tx.ExecContext(ctx, `SET LOCAL lock_timeout = `+strconv.FormatInt(LockWait.Milliseconds(), 10)); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+strconv.FormatInt(s.lock, 10)+`)`); err != nil {
		if sqlState(err) == "55P03" {
			return fmt.Errorf("%w: %w", ErrMigratorBusy, err)
		}
		return err
	}
	for _, stmt := range []string{
		`SET LOCAL lock_timeout = ` + strconv.FormatInt(LockTimeout.Milliseconds(), 10),
		`CREATE TABLE IF NOT EXISTS ` + s.table + ` (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)`,
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	var done bool
	if err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM `+s.table+` WHERE version = $1)`,
		m.version).Scan(&done); err != nil {
		return err
	}
	if done {
		return nil
	}
	if _, err := tx.ExecContext(ctx, m.sql); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+s.table+` (version, name) VALUES ($1, $2)`,
		m.version, m.name); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		if sqlState(err) == "" {
			return fmt.Errorf("commit of unknown outcome: look in %s before running it again: %w", s.table, err)
		}
		return err
	}
	return nil
}

// Check reports, with an error wrapping ErrSchemaVersion, a database whose
// table records a version other than the set's, or none. It reads one
// table and takes no lock.
func (s *Set) Check(ctx context.Context, db *sql.DB) error {
	var version sql.NullInt64
	err := db.QueryRowContext(ctx, `SELECT max(version) FROM `+s.table).Scan(&version)
	switch want := int64(s.Version()); {
	case sqlState(err) == "42P01": // undefined_table
		return fmt.Errorf("%w: %s: no migration was ever applied, want version %d: run migrate first", ErrSchemaVersion, s.table, want)
	case err != nil:
		return fmt.Errorf("check schema version in %s: %w", s.table, err)
	case version.Int64 < want:
		return fmt.Errorf("%w: %s: it is at version %d, want %d: run migrate first", ErrSchemaVersion, s.table, version.Int64, want)
	case version.Int64 > want:
		return fmt.Errorf("%w: %s: it is at version %d, newer than this program's %d", ErrSchemaVersion, s.table, version.Int64, want)
	}
	return nil
}

// sqlState is the SQLSTATE code of the server's error in err's chain, or "".
func sqlState(err error) string {
	var server interface{ SQLState() string }
	if errors.As(err, &server) {
		return server.SQLState()
	}
	return ""
}
