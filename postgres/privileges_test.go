package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"crypto/rand"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// roleDatabase is a database of t's own whose schema public gives nothing
// to PUBLIC (as a least-privilege deployment's does), so that a role has
// what it is granted and nothing else: blank for a migrator, with the
// consumer's set alone for a consumer, with the outbox's set for the rest.
func roleDatabase(t *testing.T, role postgres.Role) (string, *sql.DB) {
	t.Helper()
	name := newBlankDatabase(t)
	admin := open(t, name, "")
	if _, err := admin.Exec(`REVOKE ALL ON SCHEMA public FROM PUBLIC`); err != nil {
		t.Fatal(err)
	}
	ob := sqlOutbox(t, admin, postgres.Config{})
	var err error
	switch role {
	case postgres.RoleMigrator, postgres.RoleConsumerMigrator:
	case postgres.RoleConsumer:
		err = ob.MigrateConsumer(context.Background())
	default:
		err = ob.Migrate(context.Background())
	}
	if err != nil {
		t.Fatal(err)
	}
	return name, admin
}

// asRole makes a login role in database name with exactly privs, granted
// by the statements GrantStatements writes, and returns its name and a
// pool connected as it; the role is dropped when t ends.
func asRole(t *testing.T, name string, admin *sql.DB, suffix string, privs []postgres.Privilege) (string, *sql.DB) {
	t.Helper()
	role := name + "_" + suffix
	stmts, err := postgres.GrantStatements(privs, "public", name, role)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %s", role, strings.Join(stmts, "; "))
	for _, s := range append([]string{`CREATE ROLE ` + role + ` LOGIN`}, stmts...) {
		if _, err := admin.Exec(s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	cfg := pgtest.Config.Copy()
	cfg.Database, cfg.User = name, role
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() {
		db.Close()
		for _, s := range []string{`REASSIGN OWNED BY ` + role + ` TO CURRENT_USER`, `DROP OWNED BY ` + role, `DROP ROLE ` + role} {
			if _, err := admin.Exec(s); err != nil {
				t.Errorf("%s: %v", s, err)
			}
		}
	})
	return role, db
}

// roleWork is what a role does, as the role (db), with admin to set up
// what it needs; it returns the first error.
type roleWork func(ctx context.Context, t *testing.T, name string, admin, db *sql.DB) error

// written writes one event of aggregate as admin and returns its id.
func written(ctx context.Context, t *testing.T, admin *sql.DB, aggregate string, seq int64) int64 {
	t.Helper()
	ob := sqlOutbox(t, admin, postgres.Config{})
	tx, err := admin.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	id, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": 1}, Aggregate: aggregate, Seq: seq})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return id
}

var roleWorks = map[postgres.Role]roleWork{
	postgres.RoleMigrator: func(ctx context.Context, t *testing.T, _ string, _, db *sql.DB) error {
		ob := sqlOutbox(t, db, postgres.Config{})
		return errors.Join(ob.Migrate(ctx), ob.Migrate(ctx), ob.CheckSchema(ctx))
	},
	postgres.RoleProducer: func(ctx context.Context, t *testing.T, _ string, _, db *sql.DB) error {
		ob := sqlOutbox(t, db, postgres.Config{})
		if err := ob.CheckSchema(ctx); err != nil {
			return err
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if _, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": 1}}); err != nil {
			return err
		}
		return tx.Commit()
	},
	postgres.RoleRelay: func(ctx context.Context, t *testing.T, name string, admin, db *sql.DB) error {
		if err := relayWork(ctx, t, name, admin, db); err != nil {
			return err
		}
		// What Run says to the producers: awake, then asleep.
		relay, err := sqlOutbox(t, db, postgres.Config{}).NewRelay(&recorder{}, postgres.RelayConfig{})
		if err != nil {
			t.Fatal(err)
		}
		return errors.Join(relay.SetAwake(ctx, true), relay.SetAwake(ctx, false))
	},
	postgres.RoleLogRelay: func(ctx context.Context, t *testing.T, name string, admin, db *sql.DB) error {
		if err := relayWork(ctx, t, name, admin, db); err != nil {
			return err
		}
		var user string
		if err := db.QueryRowContext(ctx, `SELECT current_user`).Scan(&user); err != nil {
			return err
		}
		conn, err := pgconn.Connect(ctx, fmt.Sprintf("%s replication=database", roleConnString(name, user)))
		if err != nil {
			return err
		}
		return conn.Close(ctx)
	},
	postgres.RoleConsumerMigrator: func(ctx context.Context, t *testing.T, _ string, _, db *sql.DB) error {
		ob := sqlOutbox(t, db, postgres.Config{})
		if err := errors.Join(ob.MigrateConsumer(ctx), ob.MigrateConsumer(ctx), ob.CheckConsumerSchema(ctx)); err != nil {
			return err
		}
		var outbox *string
		if err := db.QueryRowContext(ctx, `SELECT to_regclass('outbox')::text`).Scan(&outbox); err != nil || outbox != nil {
			return fmt.Errorf("the consumer's set made an outbox table (%v)", err)
		}
		return nil
	},
	postgres.RoleConsumer: func(ctx context.Context, t *testing.T, _ string, _, db *sql.DB) error {
		ob := sqlOutbox(t, db, postgres.Config{Consumer: "billing"})
		if err := ob.CheckConsumerSchema(ctx); err != nil {
			return err
		}
		agg := "order/" + rand.Text()
		msgs := []postgres.Message{
			{Key: rand.Text(), Type: "OrderPlaced", Payload: `{}`, Aggregate: agg, Seq: 1},
			{Key: rand.Text(), Type: "OrderPaid", Payload: `{}`, Aggregate: agg, Seq: 2},
			{Key: rand.Text(), Type: "OrderCancelled", Payload: `{}`, Aggregate: agg, Seq: 3},
		}
		none := func(context.Context, postgres.SQLTx) error { return nil }
		if _, err := ob.ApplyOnce(ctx, msgs[0], postgres.ApplyOptions{}, none); err != nil {
			return err
		}
		if again, err := ob.ApplyOnce(ctx, msgs[0], postgres.ApplyOptions{}, none); err != nil || again {
			return fmt.Errorf("a copy: applied %v, %v", again, err)
		}
		last := func(m postgres.Message) postgres.ApplyOptions { return postgres.ApplyOptions{Last: m.Seq == 3} }
		if _, err := ob.ApplyBatch(ctx, msgs[1:], last, func(context.Context, postgres.SQLTx, []postgres.Message) error { return nil }); err != nil {
			return err
		}
		if _, err := ob.ForgetProcessed(ctx, 0); err != nil {
			return err
		}
		if _, err := ob.ApplyOnce(ctx, postgres.Message{Key: rand.Text(), Type: "X", Payload: `{}`, Aggregate: "other", Seq: 1}, postgres.ApplyOptions{}, none); err != nil {
			return err
		}
		_, err := ob.ForgetPosition(ctx, "other")
		return err
	},
	postgres.RoleOperator: func(ctx context.Context, t *testing.T, _ string, admin, db *sql.DB) error {
		agg := "order/" + rand.Text()
		written(ctx, t, admin, agg, 1)
		parked := written(ctx, t, admin, "", 0)
		dropped := written(ctx, t, admin, "", 0)
		if _, err := admin.ExecContext(ctx, `UPDATE outbox SET sent_at = now() - interval '1 hour' WHERE aggregate = $1`, agg); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.ExecContext(ctx, `UPDATE outbox SET parked_at = now(), last_error = 'too large' WHERE id IN ($1, $2)`, parked, dropped); err != nil {
			t.Fatal(err)
		}
		ob := sqlOutbox(t, db, postgres.Config{})
		if err := ob.CheckSchema(ctx); err != nil {
			return err
		}
		if _, err := ob.ReadLag(ctx); err != nil {
			return err
		}
		if _, err := ob.ListParked(ctx, 0); err != nil {
			return err
		}
		if err := ob.Unpark(ctx, parked); err != nil {
			return err
		}
		if _, err := ob.DropParked(ctx, dropped); err != nil {
			return err
		}
		if n, err := replayedRows(ob.Replay(ctx, postgres.Replay{Aggregate: agg})); err != nil || n != 1 {
			return fmt.Errorf("replay: %d, %v", n, err)
		}
		if _, err := admin.ExecContext(ctx, `UPDATE outbox SET sent_at = now() - interval '1 hour'`); err != nil {
			t.Fatal(err)
		}
		_, err := ob.DeleteSent(ctx, time.Minute)
		return err
	},
}

// relayWork is a relay's: a pass that publishes a row, one that records a
// failure and parks, a scheduled row released, and a cleanup.
func relayWork(ctx context.Context, t *testing.T, _ string, admin, db *sql.DB) error {
	ob := sqlOutbox(t, db, postgres.Config{})
	if err := ob.CheckSchema(ctx); err != nil {
		return err
	}
	written(ctx, t, admin, "", 0)
	broker := &recorder{}
	relay, err := ob.NewRelay(broker, postgres.RelayConfig{ParkAfter: 1, PassTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := relay.PublishPending(ctx); err != nil || n != 1 {
		return fmt.Errorf("pass: %d, %v", n, err)
	}
	written(ctx, t, admin, "", 0)
	rejecting := brokerFunc(func(context.Context, postgres.Message) error { return postgres.ErrRejected })
	refused, err := ob.NewRelay(rejecting, postgres.RelayConfig{ParkAfter: 1, PassTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := refused.PublishPending(ctx); err != nil && !errors.Is(err, postgres.ErrRejected) {
		return fmt.Errorf("a refused row: %v", err)
	}
	var parked bool
	if err := admin.QueryRowContext(ctx, `SELECT bool_or(parked_at IS NOT NULL) FROM outbox`).Scan(&parked); err != nil || !parked {
		return fmt.Errorf("the refused row is not parked (%v)", err)
	}
	due := written(ctx, t, admin, "", 0)
	if _, err := admin.ExecContext(ctx, `UPDATE outbox SET deliver_at = now() - interval '1 second' WHERE id = $1`, due); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the first releases the scheduled row, the second publishes it
		if _, err := relay.PublishPending(ctx); err != nil {
			return err
		}
	}
	if _, err := admin.ExecContext(ctx, `UPDATE outbox SET sent_at = sent_at - interval '1 hour' WHERE sent_at IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	if n, err := ob.DeleteSent(ctx, time.Minute); err != nil || n != 2 {
		return fmt.Errorf("cleanup: %d, %v", n, err)
	}
	return nil
}

// roleConnString is a connection string to database name as user.
func roleConnString(name, user string) string {
	return fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", pgtest.Config.Host, pgtest.Config.Port, user, name)
}

// Each role does its part with exactly the privileges Privileges gives it,
// granted as GrantStatements writes them, and CheckPrivileges finds none
// missing; with any one of them left out, the role's work fails and
// CheckPrivileges names the one missing, so no privilege in the list is
// more than the part needs.
func TestEachRoleDoesItsPartWithExactlyItsGrants(t *testing.T) {
	for _, role := range postgres.Roles {
		t.Run(string(role), func(t *testing.T) {
			ctx := context.Background()
			work := roleWorks[role]
			privs, err := postgres.Privileges("", role)
			if err != nil {
				t.Fatal(err)
			}
			name, admin := roleDatabase(t, role)
			_, db := asRole(t, name, admin, "all", privs)
			if err := sqlOutbox(t, db, postgres.Config{}).CheckPrivileges(ctx, role); err != nil {
				t.Errorf("CheckPrivileges with every grant: %v", err)
			}
			if err := work(ctx, t, name, admin, db); err != nil {
				t.Fatalf("%s's work with exactly its grants: %v", role, err)
			}
			for i, p := range privs {
				name, admin := roleDatabase(t, role)
				less := append(append([]postgres.Privilege(nil), privs[:i]...), privs[i+1:]...)
				_, db := asRole(t, name, admin, fmt.Sprint("no", i), less)
				err := sqlOutbox(t, db, postgres.Config{}).CheckPrivileges(ctx, role)
				if !errors.Is(err, postgres.ErrPrivilege) || !strings.Contains(err.Error(), p.String()) {
					t.Errorf("without %s: CheckPrivileges = %v; want ErrPrivilege naming it", p, err)
				}
				if err := work(ctx, t, name, admin, db); err == nil {
					t.Errorf("without %s: %s's work succeeded: the privilege is more than it needs", p, role)
				} else {
					t.Logf("without %s: %v", p, err)
				}
			}
		})
	}
}

// The migrator needs what the relay's mode needs, and nothing more: a
// polling deployment's migrates with USAGE and CREATE on the schema alone,
// and its database holds no publication; a log relay's makes the
// publication and the slot with PrivilegePublication and
// PrivilegeReplication beside, and without either of them cannot.
// (Caught: CREATE on the database asked of every migrator, for a
// publication a polling relay never reads.)
func TestAMigratorNeedsThePublicationsGrantsOnlyForALogRelay(t *testing.T) {
	ctx := context.Background()
	privs, err := postgres.Privileges("", postgres.RoleMigrator)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range privs {
		if p.On == "DATABASE" || p.On == "ATTRIBUTE" {
			t.Errorf("the migrator's privileges hold %s; a polling deployment's needs none on the database", p)
		}
	}
	name, admin := roleDatabase(t, postgres.RoleMigrator)
	_, db := asRole(t, name, admin, "polling", privs)
	if err := sqlOutbox(t, db, postgres.Config{}).Migrate(ctx); err != nil {
		t.Fatalf("Migrate as a polling deployment's migrator: %v", err)
	}
	var publications int
	if err := admin.QueryRow(`SELECT count(*) FROM pg_publication`).Scan(&publications); err != nil || publications != 0 {
		t.Errorf("a polling deployment's database holds %d publications (%v); want none", publications, err)
	}
	logPrivs := append(append([]postgres.Privilege(nil), privs...), postgres.PrivilegePublication, postgres.PrivilegeReplication)
	work := func(name string, db *sql.DB) error {
		ob := sqlOutbox(t, db, postgres.Config{})
		if err := ob.Migrate(ctx); err != nil {
			return err
		}
		err := ob.CreateLogSlot(ctx, name)
		if err == nil {
			t.Cleanup(func() { dropSlot(t, admin, name) })
		}
		return err
	}
	for i := -1; i < len(logPrivs); i++ {
		less := logPrivs
		if i >= 0 {
			less = append(append([]postgres.Privilege(nil), logPrivs[:i]...), logPrivs[i+1:]...)
		}
		name, admin := roleDatabase(t, postgres.RoleMigrator)
		_, db := asRole(t, name, admin, fmt.Sprint("log", i+1), less)
		err := work(name, db)
		switch {
		case i < 0 && err != nil:
			t.Fatalf("a log relay's migrator with exactly its grants: %v", err)
		case i < 0:
			var n int
			if err := admin.QueryRow(`SELECT count(*) FROM pg_publication WHERE pubname = 'outbox_inserts'`).Scan(&n); err != nil || n != 1 {
				t.Errorf("the log relay's database holds %d publications outbox_inserts (%v); want 1", n, err)
			}
		case err == nil:
			t.Errorf("without %s: the log relay's migrator's work succeeded: the privilege is more than it needs", logPrivs[i])
		default:
			t.Logf("without %s: %v", logPrivs[i], err)
		}
	}
}

// A log relay whose role has exactly RoleLogRelay's privileges reads its
// slot, publishes what was written and marks it sent.
func TestLogRelayRunsWithExactlyItsGrants(t *testing.T) {
	ctx := context.Background()
	privs, err := postgres.Privileges("", postgres.RoleLogRelay)
	if err != nil {
		t.Fatal(err)
	}
	name, admin := roleDatabase(t, postgres.RoleRelay)
	role, db := asRole(t, name, admin, "log", privs)
	if err := postgres.CreateLogSlot(ctx, admin, name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dropSlot(t, admin, name) })
	broker := &recorder{}
	relay, err := sqlOutbox(t, db, postgres.Config{}).NewLogRelay(roleConnString(name, role), broker, postgres.LogRelayConfig{Slot: name, MaxBackoff: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	stop := runLog(t, relay)
	id := written(ctx, t, admin, "order/1", 1)
	waitUntil(t, "the row to be published and marked", func() bool {
		var sent bool
		err := admin.QueryRow(`SELECT sent_at IS NOT NULL FROM outbox WHERE id = $1`, id).Scan(&sent)
		return err == nil && sent
	})
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v", err)
	}
	if ids := broker.IDs(); len(ids) != 1 || ids[0] != id {
		t.Errorf("published %v; want [%d]", ids, id)
	}
}

// Migrate on a database already at its version needs nothing but to read
// the record: a relay's role, which may not create anything, runs it (as
// outbox-relay's migrate does before provisioning the broker) and it
// succeeds, where CREATE TABLE IF NOT EXISTS used to be refused for want
// of CREATE on the schema.
func TestMigrateAtItsVersionNeedsOnlyToReadTheRecord(t *testing.T) {
	ctx := context.Background()
	privs, err := postgres.Privileges("", postgres.RoleRelay)
	if err != nil {
		t.Fatal(err)
	}
	name, admin := roleDatabase(t, postgres.RoleRelay)
	_, db := asRole(t, name, admin, "relay", privs)
	if err := sqlOutbox(t, db, postgres.Config{}).Migrate(ctx); err != nil {
		t.Errorf("Migrate at its version, as the relay: %v", err)
	}
	if _, err := admin.Exec(`DELETE FROM outbox_migrations WHERE version = $1`, postgres.SchemaVersion); err != nil {
		t.Fatal(err)
	}
	err = sqlOutbox(t, db, postgres.Config{}).Migrate(ctx)
	if err == nil || !strings.Contains(err.Error(), "permission denied") {
		t.Errorf("Migrate a version behind, as the relay = %v; want it refused for the privilege it lacks", err)
	}
}
