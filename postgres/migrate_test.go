package postgres_test

// The schema's migrations: applied once each, in order, recorded; checked at
// start-up without a lock; from the schema before they were numbered, with
// orders being placed; and a migration that meets a lock gives up whole.

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// Migrate records every migration, 1 to SchemaVersion without a gap, and
// run again applies nothing and changes nothing; CheckSchema then agrees.
func TestMigrateRecordsEachMigrationOnceAndRunsAgainAsANoOp(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100)
	if err := postgres.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	if got, want := versions(t, db), upTo(postgres.SchemaVersion); !slices.Equal(got, want) {
		t.Errorf("recorded migrations %v, want %v", got, want)
	}
	if err := postgres.CheckSchema(ctx, db); err != nil {
		t.Errorf("CheckSchema = %v, want nil", err)
	}
	wantOrders(t, db, shop.Order{ID: 1, TotalCents: 100})
}

// CheckSchema refuses a database that Migrate never ran on, one a version
// behind, and one a version ahead, each with ErrSchemaVersion.
func TestCheckSchemaRefusesADatabaseNotAtItsVersion(t *testing.T) {
	ctx := context.Background()
	blank := open(t, newBlankDatabase(t), "")
	if err := postgres.CheckSchema(ctx, blank); !errors.Is(err, postgres.ErrSchemaVersion) {
		t.Errorf("CheckSchema of a blank database = %v, want ErrSchemaVersion", err)
	}
	for _, change := range []string{
		`DELETE FROM outbox_migrations WHERE version = (SELECT max(version) FROM outbox_migrations)`,
		`INSERT INTO outbox_migrations (version, name) VALUES (1000, '1000_from_the_future')`,
	} {
		db := newDatabase(t)
		if _, err := db.Exec(change); err != nil {
			t.Fatal(err)
		}
		if err := postgres.CheckSchema(ctx, db); !errors.Is(err, postgres.ErrSchemaVersion) {
			t.Errorf("CheckSchema after %q = %v, want ErrSchemaVersion", change, err)
		}
	}
}

// A database made by the CreateTables of the versions before migrations (the
// schema of migration 1, with no record of it) is brought to SchemaVersion
// while four producers place orders: every order placed before, during and
// after has its one event, and the relay publishes each once, but the two
// the relay of those versions had sent already. (The producers write no
// trace context, so their insert is the one those versions made; the relay
// of this version starts once the schema is at its version, as CheckSchema
// makes a service do.)
func TestMigrateFromTheSchemaBeforeMigrationsLosesNoRow(t *testing.T) {
	ctx := context.Background()
	db := atTheSchemaBeforeMigrations(t)
	place(t, db, 100, 200, 300)
	if _, err := db.Exec(`UPDATE outbox SET sent_at = now() WHERE id IN (1, 2)`); err != nil { // sent by the old relay
		t.Fatal(err)
	}
	broker := &recorder{}
	relay := newRelay(t, db, broker)

	var placed atomic.Int64
	placed.Store(3)
	stop := make(chan struct{})
	var producers sync.WaitGroup
	service := shop.NewOrderService(db)
	for range 4 {
		producers.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := service.PlaceOrder(ctx, 500); err != nil {
					t.Error(err)
					return
				}
				placed.Add(1)
			}
		})
	}
	waitUntil(t, "20 orders placed before the migration", func() bool { return placed.Load() >= 20 })
	err := postgres.Migrate(ctx, db)
	close(stop)
	producers.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if err := postgres.CheckSchema(ctx, db); err != nil {
		t.Fatal(err)
	}
	for {
		n, err := relay.PublishPending(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
	}
	seen := map[int64]int{}
	for _, m := range broker.Published() {
		seen[m.ID]++
	}
	if int64(len(seen)) != placed.Load()-2 || len(broker.Published()) != len(seen) || seen[1]+seen[2] != 0 {
		t.Errorf("the broker got %d messages of %d ids; want the %d orders' events not sent before, each once",
			len(broker.Published()), len(seen), placed.Load()-2)
	}
	t.Logf("%d orders placed around the migration, each event published once", placed.Load())
}

// A migration whose statement waits for a lock longer than
// MigrationLockTimeout gives up, rolled back whole: here migration 2, whose
// ALTER TABLE meets a transaction that read aggregate_positions. Migration 1
// stays recorded, 2 does not, and once the lock is gone Migrate completes.
func TestMigrationThatMeetsALockGivesUpWhole(t *testing.T) {
	ctx := context.Background()
	db := atTheSchemaBeforeMigrations(t)
	reader := begin(t, db)
	if _, err := reader.Exec(`SELECT count(*) FROM aggregate_positions`); err != nil {
		t.Fatal(err)
	}
	err := postgres.Migrate(ctx, db)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" { // lock_not_available
		t.Fatalf("Migrate behind a reader = %v, want a lock timeout", err)
	}
	t.Logf("Migrate said: %v", err)
	if got := versions(t, db); !slices.Equal(got, []int{1}) {
		t.Errorf("recorded migrations %v, want [1]", got)
	}
	var columns int
	if err := db.QueryRow(`SELECT count(*) FROM information_schema.columns
		WHERE table_name = 'aggregate_positions' AND column_name IN ('applied_at', 'closed')`).Scan(&columns); err != nil || columns != 0 {
		t.Errorf("migration 2's columns: %d, %v; want none", columns, err)
	}
	reader.Rollback()
	if err := postgres.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	if err := postgres.CheckSchema(ctx, db); err != nil {
		t.Error(err)
	}
}

// atTheSchemaBeforeMigrations is a new database as the CreateTables of the
// versions before migrations left it: migration 1's schema, and no record
// of it.
func atTheSchemaBeforeMigrations(t *testing.T) *sql.DB {
	t.Helper()
	db := open(t, newBlankDatabase(t), "")
	old, err := os.ReadFile("testdata/schema-before-migrations.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(string(old)); err != nil {
		t.Fatal(err)
	}
	return db
}

// versions are the migrations db records, in order.
func versions(t *testing.T, db *sql.DB) []int {
	t.Helper()
	rows, err := db.Query(`SELECT version FROM outbox_migrations ORDER BY version`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var vs []int
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			t.Fatal(err)
		}
		vs = append(vs, v)
	}
	return vs
}

// upTo is 1, 2, ..., n.
func upTo(n int) []int {
	vs := make([]int, n)
	for i := range vs {
		vs[i] = i + 1
	}
	return vs
}

// A second migrator waits for the first as Migrate's doc says: behind
// another holder of the migration lock for longer than
// MigrationLockTimeout (the server's own clock says how long it waited),
// Migrate goes on once the lock is free and applies everything. With the
// wait shortened, it gives up with ErrMigratorBusy, having applied nothing.
// (Caught: the lock taken under the statements' lock_timeout of 2 s, which
// failed with 55P03 behind a migrator that took 3 s.)
func TestMigrateWaitsForAnotherMigrator(t *testing.T) {
	ctx := context.Background()
	name := newBlankDatabase(t)
	db := open(t, name, "")
	other := begin(t, open(t, name, "other-migrator"))
	if _, err := other.Exec(`SELECT pg_advisory_xact_lock(7468327001)`); err != nil { // the outbox set's lock
		t.Fatal(err)
	}

	restore := postgres.SetMigrationLockWait(300 * time.Millisecond)
	err := postgres.Migrate(ctx, open(t, name, "impatient-migrator"))
	restore()
	if !errors.Is(err, postgres.ErrMigratorBusy) {
		t.Fatalf("Migrate behind another migrator, with a wait of 300 ms = %v; want ErrMigratorBusy", err)
	}
	t.Logf("it said: %v", err)
	var tables int
	if err := db.QueryRow(`SELECT count(*) FROM pg_tables WHERE tablename IN ('outbox', 'outbox_migrations')`).Scan(&tables); err != nil || tables != 0 {
		t.Errorf("%d of the outbox's tables exist (%v), want none", tables, err)
	}

	done := make(chan error, 1)
	go func() { done <- postgres.Migrate(ctx, open(t, name, "waiting-migrator")) }()
	waitUntil(t, "Migrate waiting for the lock longer than MigrationLockTimeout", func() bool {
		select {
		case err := <-done:
			t.Fatalf("Migrate returned %v while the other migrator held the lock", err)
		default:
		}
		var waited bool
		err := db.QueryRow(`SELECT coalesce(bool_or(clock_timestamp() - a.query_start > $1 * interval '1 millisecond'), false)
			FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid
			WHERE a.application_name = 'waiting-migrator' AND l.locktype = 'advisory' AND NOT l.granted`,
			(postgres.MigrationLockTimeout + time.Second).Milliseconds()).Scan(&waited)
		if err != nil {
			t.Fatal(err)
		}
		return waited
	})
	if err := other.Rollback(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Migrate after the other migrator = %v", err)
		}
	case <-time.After(generous):
		t.Fatalf("Migrate did not return within %v of the lock's release", generous)
	}
	if got := versions(t, db); !slices.Equal(got, upTo(postgres.SchemaVersion)) {
		t.Errorf("recorded migrations %v, want all %d", got, postgres.SchemaVersion)
	}
}

// NewMigrationSet refuses, with an error and no panic, what a team's files
// or names get wrong: a gap in the numbers, a file not numbered, no file,
// a table name that is not a plain identifier. A good set's Version is its
// last number.
func TestNewMigrationSetRefusesBadFilesAndNames(t *testing.T) {
	file := &fstest.MapFile{Data: []byte(`CREATE TABLE IF NOT EXISTS accounts (id bigint PRIMARY KEY)`)}
	for _, c := range []struct {
		name  string
		fsys  fstest.MapFS
		table string
	}{
		{"a gap", fstest.MapFS{"m/0001_a.sql": file, "m/0003_c.sql": file}, "accounts_migrations"},
		{"not numbered", fstest.MapFS{"m/first.sql": file}, "accounts_migrations"},
		{"no file", fstest.MapFS{"m/README": file}, "accounts_migrations"},
		{"a table with a space", fstest.MapFS{"m/0001_a.sql": file}, "accounts migrations"},
		{"a table with a quote", fstest.MapFS{"m/0001_a.sql": file}, `x"; DROP TABLE outbox; --`},
	} {
		if s, err := postgres.NewMigrationSet(c.fsys, "m", c.table, 1); s != nil || err == nil {
			t.Errorf("%s: NewMigrationSet = %v, %v; want an error", c.name, s, err)
		} else {
			t.Logf("%s: %v", c.name, err)
		}
	}
	s, err := postgres.NewMigrationSet(fstest.MapFS{"m/0001_a.sql": file, "m/0002_b.sql": file}, "m", "accounts_migrations", 1)
	if err != nil || s.Version() != 2 {
		t.Fatalf("NewMigrationSet of two files = %v, %v; want version 2", s, err)
	}
}

// The consumer's set makes the consumer's tables alone in a blank
// database, and in one whose tables predate the outbox's migration 9 (the
// schema before migrations) brings them to the same shape, keeping what
// they hold as the default consumer's; the outbox's set run after it, or
// before it, finds nothing to change. CheckConsumerSchema wants the set.
func TestConsumerSetMakesTheConsumersTablesAloneAndTakesOldOnesAsTheyAre(t *testing.T) {
	ctx := context.Background()
	blank := sqlOutbox(t, open(t, newBlankDatabase(t), ""), postgres.Config{Consumer: "billing"})
	if err := blank.CheckConsumerSchema(ctx); !errors.Is(err, postgres.ErrSchemaVersion) {
		t.Errorf("CheckConsumerSchema before MigrateConsumer = %v; want ErrSchemaVersion", err)
	}
	if err := errors.Join(blank.MigrateConsumer(ctx), blank.MigrateConsumer(ctx), blank.CheckConsumerSchema(ctx)); err != nil {
		t.Fatal(err)
	}
	if err := blank.CheckSchema(ctx); !errors.Is(err, postgres.ErrSchemaVersion) {
		t.Errorf("CheckSchema of a consumer's database = %v; want ErrSchemaVersion (no outbox there)", err)
	}
	msg := postgres.Message{Key: "k1", Type: "OrderPlaced", Aggregate: "order/1", Seq: 1}
	none := func(context.Context, postgres.SQLTx) error { return nil }
	if applied, err := blank.ApplyOnce(ctx, msg, postgres.ApplyOptions{}, none); !applied || err != nil {
		t.Fatalf("ApplyOnce in a consumer's database: %v, %v", applied, err)
	}

	db := atTheSchemaBeforeMigrations(t)
	if _, err := db.Exec(`INSERT INTO processed_messages (message_key) VALUES ('applied-before')`); err != nil {
		t.Fatal(err)
	}
	old := sqlOutbox(t, db, postgres.Config{})
	if err := old.MigrateConsumer(ctx); err != nil {
		t.Fatal(err)
	}
	if applied, err := old.ApplyOnce(ctx, postgres.Message{Key: "applied-before", Type: "OrderPlaced"}, postgres.ApplyOptions{}, none); applied || err != nil {
		t.Errorf("a key kept before the consumer's set: applied %v, %v; want a copy", applied, err)
	}
	if err := errors.Join(old.Migrate(ctx), old.CheckSchema(ctx), old.CheckConsumerSchema(ctx)); err != nil {
		t.Fatal(err)
	}
	var pk string
	if err := db.QueryRow(`SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'processed_messages_pkey'`).Scan(&pk); err != nil || pk != "PRIMARY KEY (consumer, message_key)" {
		t.Errorf("processed_messages' key = %q, %v", pk, err)
	}
}
