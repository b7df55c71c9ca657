// Package pgtest gives the tests of the outbox and of its example a
// database of their own on the server OUTBOX_POSTGRES_URL names, which
// `make postgres` starts and removes.
package pgtest

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// Server is the connection OUTBOX_POSTGRES_URL names, or nil when it is not
// set; ServerErr is why it could not be read.
var Server, ServerErr = func() (*pgx.ConnConfig, error) {
	url := os.Getenv("OUTBOX_POSTGRES_URL")
	if url == "" {
		return nil, nil
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("OUTBOX_POSTGRES_URL: %w", err)
	}
	return cfg, nil
}()

// NoServer is what a test run without a server prints, once.
const NoServer = "OUTBOX_POSTGRES_URL is not set, so every test skips; `make postgres` in the repository's root runs them on a throwaway server"

var databases atomic.Int64

// NewBlankDatabase creates an empty database for tb alone, to be dropped
// when tb ends, and returns its name. Without a server, tb skips.
func NewBlankDatabase(tb testing.TB) string {
	tb.Helper()
	if Server == nil {
		tb.Skip("no server: run make postgres")
	}
	ctx := context.Background()
	admin := Open(tb, Server.Database, "")
	name := fmt.Sprintf("outbox_test_%d_%d", os.Getpid(), databases.Add(1))
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if _, err := admin.ExecContext(ctx, "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
			tb.Error(err)
		}
	})
	return name
}

// Open returns a connection pool to the database named, whose connections
// show app as their application_name in pg_stat_activity; it is closed when
// tb ends.
func Open(tb testing.TB, database, app string) *sql.DB {
	cfg := Server.Copy()
	cfg.Database = database
	if app != "" {
		cfg.RuntimeParams["application_name"] = app
	}
	db := stdlib.OpenDB(*cfg)
	tb.Cleanup(func() { db.Close() })
	return db
}
