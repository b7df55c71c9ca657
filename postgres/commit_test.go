package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// startCommitCutter starts a server of t's own whose durable commits wait
// for a synchronous standby that never comes (synchronous_standby_names =
// nobody; the rest commit locally): such a COMMIT has committed on the
// server and waits. cut ends the session that waits (pg_terminate_backend),
// and the client reads its connection closed (a pooler in front answers
// with a FATAL of its own, PgBouncer's 08P01). It returns the server's connection string, and cut, which waits for the
// COMMIT to wait first.
func startCommitCutter(t *testing.T) (connString string, cut func()) {
	t.Helper()
	srv, err := pgtest.Start("-c", "synchronous_standby_names=nobody", "-c", "synchronous_commit=local")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Remove() })
	cfg, err := pgx.ParseConfig(srv.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	admin := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { admin.Close() })
	if err := postgres.Migrate(context.Background(), admin); err != nil {
		t.Fatal(err)
	}
	return srv.ConnString(), func() {
		t.Helper()
		waitUntil(t, "a COMMIT waiting for its standby", func() bool {
			var n int64
			err := admin.QueryRow(`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&n)
			return err == nil && n > 0
		})
	}
}

// TestACommitCutAfterTheServerCommittedIsUnknown: a COMMIT the server
// carried out, whose session then ended (the server ends it without a word
// to the client, which reads its connection closed), is reported as an
// outcome unknown (ErrCommitUnknown) by Transaction, TransactionPgx,
// Commit and ApplyOnce on either driver, and what it wrote is there. (The
// same cut behind PgBouncer, which answers with a FATAL of its own, is
// TestBehindPgBouncerACommitCutAfterTheServerCommittedIsUnknown.)
func TestACommitCutAfterTheServerCommittedIsUnknown(t *testing.T) {
	ctx := context.Background()
	connString, cut := startCommitCutter(t)
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		t.Fatal(err)
	}
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { db.Close() })
	pool, err := pgxpool.New(ctx, connString)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	sob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	pob, err := postgres.Open(pool, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	event := postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": 1}}
	durable := `SET LOCAL synchronous_commit = on`
	for _, tc := range []struct {
		name   string
		commit func(key string) error
	}{
		{"Transaction", func(string) error {
			return postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, durable); err != nil {
					return err
				}
				_, err := sob.Write(ctx, tx, event)
				return err
			})
		}},
		{"TransactionPgx", func(string) error {
			return postgres.TransactionPgx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, durable); err != nil {
					return err
				}
				_, err := pob.Write(ctx, tx, event)
				return err
			})
		}},
		{"Commit", func(string) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, durable); err != nil {
				return err
			}
			if _, err := pob.Write(ctx, tx, event); err != nil {
				return err
			}
			return postgres.Commit(ctx, tx)
		}},
		{"ApplyOnce/database/sql", func(key string) error {
			_, err := sob.ApplyOnce(ctx, postgres.Message{Key: key, Type: "OrderPlaced"}, postgres.ApplyOptions{},
				func(context.Context, postgres.SQLTx) error { return nil })
			return err
		}},
		{"ApplyOnce/pgx", func(key string) error {
			_, err := pob.ApplyOnce(ctx, postgres.Message{Key: key, Type: "OrderPlaced"}, postgres.ApplyOptions{},
				func(context.Context, postgres.PgxTx) error { return nil })
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before, keys int
			if err := db.QueryRow(`SELECT count(*) FROM outbox`).Scan(&before); err != nil {
				t.Fatal(err)
			}
			key := "cut-" + tc.name
			done := make(chan error, 1)
			go func() { done <- tc.commit(key) }()
			cut()
			err := <-done
			t.Logf("%s: %v", tc.name, err)
			if !errors.Is(err, postgres.ErrCommitUnknown) {
				t.Fatalf("%s returned %v; want an error wrapping ErrCommitUnknown", tc.name, err)
			}
			var after int
			if err := db.QueryRow(`SELECT count(*) FROM outbox`).Scan(&after); err != nil {
				t.Fatal(err)
			}
			if err := db.QueryRow(`SELECT count(*) FROM processed_messages WHERE message_key = $1`, key).Scan(&keys); err != nil {
				t.Fatal(err)
			}
			if after-before+keys != 1 {
				t.Fatalf("%d rows written and %d keys recorded; want the one the COMMIT kept", after-before, keys)
			}
		})
	}
}

// TestBehindPgBouncerACommitCutAfterTheServerCommittedIsUnknown is the
// review's case, behind a real PgBouncer (Debian's) in transaction pooling:
// a COMMIT the server carried out, whose server connection then died,
// answered by PgBouncer with FATAL 08P01 "server conn crashed?". A shop's
// order, a relay pass and a consumer's apply each report it as an outcome
// unknown (ErrCommitUnknown), and each retry finds what the COMMIT kept:
// the order placed again with its idempotency key is the same order, with
// one event; the relay's next pass publishes nothing again; the message
// delivered again is a duplicate. The FATAL used to be read as a failure,
// nothing kept.
func TestBehindPgBouncerACommitCutAfterTheServerCommittedIsUnknown(t *testing.T) {
	ctx := context.Background()
	srv, err := pgtest.Start("-c", "synchronous_standby_names=nobody", "-c", "synchronous_commit=local")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Remove() })
	adminCfg, err := pgx.ParseConfig(srv.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	admin := stdlib.OpenDB(*adminCfg)
	t.Cleanup(func() { admin.Close() })
	if _, err := admin.Exec(`CREATE DATABASE cut`); err != nil {
		t.Fatal(err)
	}
	direct := adminCfg.Copy()
	direct.Database = "cut"
	check := stdlib.OpenDB(*direct)
	t.Cleanup(func() { check.Close() })
	if err := postgres.Migrate(ctx, check); err != nil {
		t.Fatal(err)
	}
	if err := shop.Migrate(ctx, check); err != nil {
		t.Fatal(err)
	}
	if _, err := check.Exec(`CREATE TABLE effects (key text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	// durable sets whether the database's commits wait for the standby
	// that never comes, for the sessions that PgBouncer opens from then on
	// (those it has are ended).
	durable := func(t *testing.T, on bool) {
		t.Helper()
		set := `ALTER DATABASE cut RESET synchronous_commit`
		if on {
			set = `ALTER DATABASE cut SET synchronous_commit = on`
		}
		if _, err := admin.Exec(set); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = 'cut' AND application_name = 'behind-pgbouncer'`); err != nil {
			t.Fatal(err)
		}
		// A backend told to end takes a moment to go; PgBouncer could hand
		// one still going to the next client, whose first statement would
		// fail before any COMMIT.
		waitUntil(t, "the sessions ended", func() bool {
			var n int
			err := admin.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = 'cut' AND application_name = 'behind-pgbouncer'`).Scan(&n)
			return err == nil && n == 0
		})
	}
	// cut ends the server session whose COMMIT waits for the standby.
	cut := func(t *testing.T) {
		t.Helper()
		waitUntil(t, "a COMMIT waiting for its standby", func() bool {
			var n int64
			err := admin.QueryRow(`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&n)
			return err == nil && n > 0
		})
	}
	count := func(query string, args ...any) int {
		t.Helper()
		var n int
		if err := check.QueryRow(query, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	unknown := func(t *testing.T, what string, f func() error) {
		t.Helper()
		durable(t, true)
		done := make(chan error, 1)
		go func() { done <- f() }()
		cut(t)
		err := <-done
		t.Logf("%s behind PgBouncer, its COMMIT cut: %v", what, err)
		if !errors.Is(err, postgres.ErrCommitUnknown) {
			t.Fatalf("%s: %v; want an error wrapping ErrCommitUnknown", what, err)
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "08P01" {
			t.Errorf("%s: %v; want PgBouncer's FATAL 08P01 in its chain", what, err)
		}
		durable(t, false)
	}

	port := pgtest.StartPgBouncer(t, srv.Dir, 5432, "postgres")
	pooled := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=cut sslmode=disable "+
		"default_query_exec_mode=simple_protocol application_name=behind-pgbouncer", port)
	pcfg, err := pgx.ParseConfig(pooled)
	if err != nil {
		t.Fatal(err)
	}
	db := stdlib.OpenDB(*pcfg)
	t.Cleanup(func() { db.Close() })
	pool, err := pgxpool.New(ctx, pooled)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	t.Run("shop", func(t *testing.T) {
		orders := shop.NewOrderService(db)
		var first int64
		unknown(t, "PlaceOrderWithKey", func() (err error) {
			first, err = orders.PlaceOrderWithKey(ctx, "retry-me", 2500)
			return err
		})
		again, err := orders.PlaceOrderWithKey(ctx, "retry-me", 2500)
		if err != nil {
			t.Fatal(err)
		}
		if n := count(`SELECT count(*) FROM orders`); n != 1 || first != 0 {
			t.Fatalf("%d orders (order %d, then %d on the retry); want the one the cut COMMIT kept", n, first, again)
		}
		if n := count(`SELECT count(*) FROM outbox`); n != 1 {
			t.Fatalf("%d events for one order", n)
		}
	})
	t.Run("relay", func(t *testing.T) {
		ob, err := postgres.OpenDB(db, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		broker := &recorder{}
		relay, err := ob.NewRelay(broker, postgres.RelayConfig{PollOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		unknown(t, "a relay pass", func() error {
			_, err := relay.PublishPending(ctx)
			return err
		})
		if n := count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
			t.Fatalf("%d rows unsent; want the row the cut COMMIT marked", n)
		}
		if n, err := relay.PublishPending(ctx); n != 0 || err != nil {
			t.Fatalf("the next pass: %d, %v; want nothing published again", n, err)
		}
		if got := len(broker.Published()); got != 1 {
			t.Fatalf("%d publishes; want the one before the cut", got)
		}
	})
	t.Run("consumer", func(t *testing.T) {
		ob, err := postgres.Open(pool, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		msg := postgres.Message{Key: "delivered-twice", Type: "OrderPlaced", Aggregate: "order/1", Seq: 1}
		apply := func(ctx context.Context, tx postgres.PgxTx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, msg.Key)
			return err
		}
		unknown(t, "ApplyOnce", func() error {
			_, err := ob.ApplyOnce(ctx, msg, postgres.ApplyOptions{}, apply)
			return err
		})
		applied, err := ob.ApplyOnce(ctx, msg, postgres.ApplyOptions{}, apply)
		if applied || err != nil {
			t.Fatalf("delivered again: applied %v, %v; want a duplicate", applied, err)
		}
		if n := count(`SELECT count(*) FROM effects`); n != 1 {
			t.Fatalf("%d effects; want the one the cut COMMIT kept", n)
		}
	})
}

// TestTheServersWordThatItEndedAnIdleTransactionIsAFailure: a COMMIT
// answered with the server's FATAL 25P03 (it ended the session idle in its
// transaction, and rolled it back) failed: never ErrCommitUnknown, though
// other FATALs (57P01, the server shutting down; 08006) may follow a
// commit and are unknown. The word reaches the driver over TCP, where the
// socket still holds it; on the tests' Unix socket the driver's write of
// the COMMIT fails first and reads nothing, so this reads the error as the
// driver would have returned it.
func TestTheServersWordThatItEndedAnIdleTransactionIsAFailure(t *testing.T) {
	for _, c := range []struct {
		severity, code string
		unknown        bool
	}{{"FATAL", "25P03", false}, {"FATAL", "57P01", true}, {"FATAL", "08006", true}, {"ERROR", "23505", false}} {
		err := postgres.CommitError(&pgconn.PgError{Severity: c.severity, Code: c.code, Message: "the server's word"})
		if errors.Is(err, postgres.ErrCommitUnknown) != c.unknown {
			t.Errorf("a COMMIT answered with %s %s: %v; want unknown %v", c.severity, c.code, err, c.unknown)
		}
	}
}
