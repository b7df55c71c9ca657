package shop

import (
	"context"
	"database/sql"
	"embed"

	"example.com/patterns/enterprise/outbox/postgres"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migrations are the example's own, recorded in shop_migrations, apart
// from the outbox's.
var migrations = func() *postgres.MigrationSet {
	s, err := postgres.NewMigrationSet(migrationFiles, "migrations", "shop_migrations", 7_468_327_002)
	if err != nil {
		panic(err) // the files are embedded: a bug of this package
	}
	return s
}()

// SchemaVersion is the number of the example's last migration: the version
// [CheckSchema] wants the database at.
var SchemaVersion = migrations.Version()

// Migrate brings the example's tables (orders, reservations) in db to
// [SchemaVersion], as [postgres.Outbox.Migrate] does the outbox's: each migration
// once, in order, in a transaction of its own with its record in
// shop_migrations, each statement waiting at most
// [postgres.MigrationLockTimeout] for a lock. Run both, before the services
// start.
func Migrate(ctx context.Context, db *sql.DB) error {
	return migrations.Apply(ctx, db)
}

// CheckSchema is [postgres.Outbox.CheckSchema] for the example's tables: an error
// wrapping [postgres.ErrSchemaVersion] if they are not at [SchemaVersion].
func CheckSchema(ctx context.Context, db *sql.DB) error {
	return migrations.Check(ctx, db)
}
