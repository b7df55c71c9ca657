package postgres

import (
	"context"
	"database/sql"
	"embed"

	"example.com/patterns/enterprise/outbox/postgres/internal/migrate"
)

// The outbox's schema is a list of numbered migrations,
// migrations/NNNN_name.sql, applied by Migrate apart from the application's
// start-up and checked by CheckSchema at it. DDL takes locks that wait behind
// every open transaction on its table, and every statement after it waits
// behind the DDL: run at each start of a service, it queues the service's
// own writes.

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migrations are the outbox's, recorded in outbox_migrations; the name
// carries the module's prefix so as not to meet a team's own
// schema_migrations.
var migrations = migrate.Load(migrationFiles, "migrations", "outbox_migrations", 7_468_327_001)

// SchemaVersion is the number of the outbox's last migration: the version
// [CheckSchema] wants the database at.
var SchemaVersion = migrations.Version()

// MigrationLockTimeout is how long a migration's statement waits for a lock
// before [Migrate] gives up with an error. DDL waits behind every open
// transaction that touched its table, and every statement on the table
// waits behind the DDL, so a long wait would stall the service's own
// writes; a short one fails the migration instead, to be run again.
const MigrationLockTimeout = migrate.LockTimeout

// MigrationLockWait is how long [Migrate] waits for another migrator of
// the outbox (another process running Migrate on the same database) before
// it gives up with an error wrapping [ErrMigratorBusy].
const MigrationLockWait = migrate.DefaultLockWait

// ErrMigratorBusy is wrapped by [Migrate]'s error when another migrator
// held the migration lock longer than [MigrationLockWait].
var ErrMigratorBusy = migrate.ErrMigratorBusy

// ErrSchemaVersion is wrapped by [CheckSchema]'s error when the database's
// schema is not at [SchemaVersion].
var ErrSchemaVersion = migrate.ErrSchemaVersion

// Migrate brings the outbox's tables in db to [SchemaVersion]: it applies,
// in order, each migration that the table outbox_migrations does not record
// yet, each in a transaction of its own with its record, so that a
// migration is applied whole or not at all. It is idempotent: run again, it
// applies nothing; run by two processes at once, the second waits for the
// first, up to [MigrationLockWait], and then applies nothing (past that it
// gives up with an error wrapping [ErrMigratorBusy], having applied
// nothing). Each statement waits at most
// [MigrationLockTimeout] for a lock; a migration that times out is rolled
// back and Migrate returns an error saying which, to be run again.
//
// It creates the outbox table, its indexes and its NOTIFY trigger, for a
// producer, and processed_messages and aggregate_positions, for a consumer
// ([ApplyOnce]); a service that is only one of the two leaves the other's
// tables empty. It touches no other table: a team's own tables have
// migrations of their own.
//
// Run it as a step of its own, before the services start: the shop's
// "migrate" command does. Services call [CheckSchema] instead, which takes
// no lock.
func Migrate(ctx context.Context, db *sql.DB) error {
	return migrations.Apply(ctx, db)
}

// CheckSchema reports, with an error wrapping [ErrSchemaVersion], a
// database whose outbox tables are not at [SchemaVersion]: one that
// [Migrate] never ran on, one it has not yet brought to this version, or one
// migrated by a newer version of this package. It reads one table and takes
// no lock, so a service calls it at start-up and refuses to start on its
// error, instead of running DDL.
func CheckSchema(ctx context.Context, db *sql.DB) error {
	return migrations.Check(ctx, db)
}
