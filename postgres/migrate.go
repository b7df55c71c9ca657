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

// The outbox's schema is a list of numbered migrations,
// migrations/NNNN_name.sql, applied by Migrate apart from the application's
// start-up and checked by CheckSchema at it. DDL takes locks that wait behind
// every open transaction on its table, and every statement after it waits
// behind the DDL: run at each start of a service, it queues the service's
// own writes.

//go:embed migrations/*.sql migrations/consumer/*.sql
var migrationFiles embed.FS

// consumerMigrations is the consumer's set: its tables alone, recorded in
// outbox_consumer_migrations, one set for every consumer and every outbox
// of the database.
var consumerMigrations = func() *MigrationSet {
	s, err := NewMigrationSet(migrationFiles, "migrations/consumer", "outbox_consumer_migrations", 7_468_327_002)
	if err != nil {
		panic(err) // a bug of this package
	}
	return s
}()

// ConsumerSchemaVersion is the number of the consumer's set's last
// migration: the version [Outbox.CheckConsumerSchema] wants.
var ConsumerSchemaVersion = consumerMigrations.Version()

// The outbox's migrations are recorded in outbox_migrations (an Outbox
// of another table, in <table>_migrations); the name carries the module's
// prefix so as not to meet a team's own schema_migrations.
// SchemaVersion is the number of the outbox's last migration: the version
// [Outbox.CheckSchema] wants the database at.
var SchemaVersion = defaultTables.migrations.Version()

// MigrationLockTimeout is how long a migration's statement waits for a lock
// before [Outbox.Migrate] gives up with an error. DDL waits behind every open
// transaction that touched its table, and every statement on the table
// waits behind the DDL, so a long wait would stall the service's own
// writes; a short one fails the migration instead, to be run again.
const MigrationLockTimeout = 2 * time.Second

// MigrationLockWait is how long [Outbox.Migrate] waits for another migrator of
// the outbox (another process running Migrate on the same database) before
// it gives up with an error wrapping [ErrMigratorBusy].
const MigrationLockWait = time.Minute

// migrationLockWait is MigrationLockWait, a variable that a test shortens.
var migrationLockWait = MigrationLockWait

// ErrMigratorBusy is wrapped by [Outbox.Migrate]'s error when another migrator
// held the migration lock longer than [MigrationLockWait].
var ErrMigratorBusy = errors.New("postgres: another migrator holds the migration lock")

// ErrSchemaVersion is wrapped by [Outbox.CheckSchema]'s error when the database's
// schema is not at [SchemaVersion].
var ErrSchemaVersion = errors.New("postgres: database schema is not at this package's version")

// Migrate brings o's tables to [SchemaVersion]: it applies, in order, each
// migration that <table>_migrations (outbox_migrations for the table outbox)
// does not record yet, each in a transaction of its own with its record, so
// that a migration is applied whole or not at all. It is idempotent: run
// again, it applies nothing, and on a database already at [SchemaVersion]
// it only reads the record (a role with SELECT on it may run it); run
// by two processes at once, the second waits for the first, up to
// [MigrationLockWait], and then applies nothing (past that it gives up
// with an error wrapping [ErrMigratorBusy], having applied nothing). Each
// statement waits at most [MigrationLockTimeout] for a lock; a migration
// that times out is rolled back and Migrate returns an error saying which,
// to be run again.
//
// It creates the outbox table, its indexes and its NOTIFY trigger, for a
// producer, and processed_messages and aggregate_positions, for a consumer
// ([Outbox.ApplyOnce]), as its first versions did; a producer leaves those
// empty. A consumer's database needs only those: [Outbox.MigrateConsumer]
// makes them alone. It touches no other table: a team's own tables have
// migrations of their own.
//
// Run it as a step of its own, before the services start: the shop's
// "migrate" command does. Services call [Outbox.CheckSchema] instead, which
// takes no lock.
func (o *Outbox[T]) Migrate(ctx context.Context) error {
	if err := o.usable(); err != nil {
		return err
	}
	return o.t.migrations.apply(ctx, o.db)
}

// MigrateConsumer brings the consumer's tables of o's database,
// processed_messages and aggregate_positions, to [ConsumerSchemaVersion]:
// a set of migrations of their own, recorded in
// outbox_consumer_migrations, which creates no outbox table. A consumer
// whose database holds no outbox runs it instead of [Outbox.Migrate], as
// a step of its own, and calls [Outbox.CheckConsumerSchema] at start-up.
// A database that is both runs both; the outbox's migrations make these
// tables too, and this set takes them as they are. Every consumer of the
// database keeps its records in them under its own name
// ([Config.Consumer]). It applies, waits and gives up as Migrate does,
// and on a database at its version only reads its record; its role needs
// USAGE and CREATE on the schema and nothing else ([RoleConsumerMigrator]).
func (o *Outbox[T]) MigrateConsumer(ctx context.Context) error {
	if err := o.usable(); err != nil {
		return err
	}
	return consumerMigrations.apply(ctx, o.db)
}

// CheckConsumerSchema reports, with an error wrapping [ErrSchemaVersion],
// a database whose consumer's tables are not at [ConsumerSchemaVersion]
// ([Outbox.MigrateConsumer]). It reads one table and takes no lock.
func (o *Outbox[T]) CheckConsumerSchema(ctx context.Context) error {
	if err := o.usable(); err != nil {
		return err
	}
	return consumerMigrations.check(ctx, o.db)
}

// CheckSchema reports, with an error wrapping [ErrSchemaVersion], a database
// whose outbox tables are not at [SchemaVersion]: one that [Outbox.Migrate]
// never ran on, one it has not yet brought to this version, or one migrated
// by a newer version of this package. It reads one table and takes no lock,
// so a service calls it at start-up and refuses to start on its error,
// instead of running DDL.
func (o *Outbox[T]) CheckSchema(ctx context.Context) error {
	if err := o.usable(); err != nil {
		return err
	}
	return o.t.migrations.check(ctx, o.db)
}

// A MigrationSet is the numbered SQL migrations of one component, files
// NNNN_name.sql whose numbers run from 1 without a gap, recorded in a table
// of their own: the outbox's ([Outbox.Migrate]), or a team's own tables', as the
// example shop's are. Its methods are safe for concurrent use.
type MigrationSet struct {
	table      string
	lock       int64 // advisory lock key: two Applies of a set wait for each other
	migrations []migration
}

type migration struct {
	version int
	name    string
	sql     string
}

// NewMigrationSet reads the files NNNN_name.sql of dir in fsys (an
// embed.FS, usually) into a MigrationSet recorded in table, a name of
// letters, digits and '_'. lock is the key of the advisory lock that makes
// two Applies of the set wait for each other: any number, other than every
// other set's in the database. It refuses, with an error naming the file,
// files whose numbers do not run from 1 without a gap, and a dir with none.
func NewMigrationSet(fsys fs.FS, dir, table string, lock int64) (*MigrationSet, error) {
	if !identifier(table) {
		return nil, fmt.Errorf("postgres: migration table %q is not a name of letters, digits and '_'", table)
	}
	migs, err := loadMigrations(fsys, dir)
	if err != nil {
		return nil, err
	}
	return &MigrationSet{table: table, lock: lock, migrations: migs}, nil
}

// loadMigrations reads the files NNNN_name.sql of dir in fsys, in order.
func loadMigrations(fsys fs.FS, dir string) ([]migration, error) {
	files, err := fs.Glob(fsys, dir+"/*.sql")
	if err != nil {
		return nil, fmt.Errorf("postgres: migrations in %s: %w", dir, err)
	}
	var migs []migration
	for i, f := range files { // Glob sorts by name, so by number
		base := path.Base(f)
		num, _, _ := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if err != nil || v != i+1 {
			return nil, fmt.Errorf("postgres: %s is not migration %d: files are NNNN_name.sql, numbered from 1 without a gap", f, i+1)
		}
		b, err := fs.ReadFile(fsys, f)
		if err != nil {
			return nil, fmt.Errorf("postgres: %w", err)
		}
		migs = append(migs, migration{version: v, name: strings.TrimSuffix(base, ".sql"), sql: string(b)})
	}
	if len(migs) == 0 {
		return nil, fmt.Errorf("postgres: no migrations NNNN_name.sql in %s", dir)
	}
	return migs, nil
}

// identifier reports whether s is a name of letters, digits and '_' that
// does not start with a digit, at most 63 bytes: one PostgreSQL takes as it
// is, unquoted.
func identifier(s string) bool {
	if s == "" || len(s) > 63 || s[0] >= '0' && s[0] <= '9' {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// Version is the number of the set's last migration.
func (s *MigrationSet) Version() int { return s.migrations[len(s.migrations)-1].version }

// Apply applies, in order, each migration of s that its table does not
// record yet, each in a transaction of its own with its record, so that a
// migration is applied whole or not at all. Run again, it applies nothing,
// and on a database already at the set's version it only reads the
// record, so a role that may read it and nothing more may run it;
// run by two processes at once, the second waits for the first, up to
// [MigrationLockWait], and then applies nothing (past that it gives up with
// an error wrapping [ErrMigratorBusy], having applied nothing). Each
// statement waits at most [MigrationLockTimeout] for a lock; a migration
// that times out is rolled back and Apply returns an error saying which,
// to be run again.
func (s *MigrationSet) Apply(ctx context.Context, db *sql.DB) error {
	if db == nil {
		return errors.New("postgres: Apply: no database")
	}
	return s.apply(ctx, sqlPool{db})
}

func (s *MigrationSet) apply(ctx context.Context, db pool) error {
	// A database already at the version needs nothing, and is left
	// without a statement that needs a privilege beyond reading the
	// record: CREATE TABLE IF NOT EXISTS needs CREATE on the schema even
	// when the table exists, and a role that may only read (a relay's,
	// provisioning its broker) runs Migrate too.
	if s.check(ctx, db) == nil {
		return nil
	}
	for _, m := range s.migrations {
		err := s.applyOne(ctx, db, m)
		switch {
		case errors.Is(err, ErrMigratorBusy):
			return fmt.Errorf("migration %s: %w longer than %v (its table %s); nothing was applied by this run: run it again",
				m.name, ErrMigratorBusy, migrationLockWait, s.table)
		case sqlState(err) == "55P03": // lock_not_available
			return fmt.Errorf("migration %s waited longer than %v for a lock, and is rolled back; run it again: %w",
				m.name, MigrationLockTimeout, err)
		case err != nil:
			return fmt.Errorf("migration %s: %w", m.name, err)
		}
	}
	return nil
}

func (s *MigrationSet) applyOne(ctx context.Context, db pool, m migration) error {
	tx, err := db.begin(ctx)
	if err != nil {
		return err
	}
	defer tx.rollback()
	// Another migrator of the set is waited for, up to LockWait; then each
	// statement waits at most LockTimeout for a lock of the tables.
	if err := tx.exec(ctx, `SET LOCAL lock_timeout = `+strconv.FormatInt(migrationLockWait.Milliseconds(), 10)); err != nil {
		return err
	}
	if err := tx.exec(ctx, `SELECT pg_advisory_xact_lock(`+strconv.FormatInt(s.lock, 10)+`)`); err != nil {
		if sqlState(err) == "55P03" {
			return fmt.Errorf("%w: %w", ErrMigratorBusy, err)
		}
		return err
	}
	for _, stmt := range []string{
		`SET LOCAL lock_timeout = ` + strconv.FormatInt(MigrationLockTimeout.Milliseconds(), 10),
		`CREATE TABLE IF NOT EXISTS ` + s.table + ` (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)`,
	} {
		if err := tx.exec(ctx, stmt); err != nil {
			return err
		}
	}
	var done bool
	if err := tx.queryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+s.table+` WHERE version = $1)`,
		m.version).Scan(&done); err != nil {
		return err
	}
	if done {
		return nil
	}
	if err := tx.exec(ctx, m.sql); err != nil {
		return err
	}
	if err := tx.exec(ctx, `INSERT INTO `+s.table+` (version, name) VALUES ($1, $2)`,
		m.version, m.name); err != nil {
		return err
	}
	if err := tx.commit(ctx); err != nil {
		if errors.Is(err, ErrCommitUnknown) {
			return fmt.Errorf("look in %s before running it again: %w", s.table, err)
		}
		return err
	}
	return nil
}

// Check reports, with an error wrapping [ErrSchemaVersion], a database
// whose table records a version other than the set's, or none. It reads one
// table and takes no lock.
func (s *MigrationSet) Check(ctx context.Context, db *sql.DB) error {
	if db == nil {
		return errors.New("postgres: Check: no database")
	}
	return s.check(ctx, sqlPool{db})
}

func (s *MigrationSet) check(ctx context.Context, db stmts) error {
	var version sql.NullInt64
	err := db.queryRow(ctx, `SELECT max(version) FROM `+s.table).Scan(&version)
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
