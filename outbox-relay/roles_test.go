package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// grantRole makes a login role with the statements grants -json prints
// for args (with -grantee the role), and returns a connection string as it.
func (e *env) grantRole(suffix string, args ...string) (role, database string) {
	e.t.Helper()
	role = e.name + "_" + suffix
	code, out := e.runOnce(append([]string{"grants", "-json", "-grantee", role}, args...)...)
	v := jsonLines(e.t, out)
	if code != 0 || len(v) != 1 {
		e.t.Fatalf("grants %v exited %d:\n%s", args, code, out)
	}
	stmts := []string{"CREATE ROLE " + role + " LOGIN"}
	for _, s := range v[0]["statements"].([]any) {
		stmts = append(stmts, s.(string))
	}
	for _, s := range stmts {
		if _, err := e.db.Exec(s); err != nil {
			e.t.Fatalf("%s: %v", s, err)
		}
	}
	e.t.Cleanup(func() {
		for _, s := range []string{"REASSIGN OWNED BY " + role + " TO CURRENT_USER", "DROP OWNED BY " + role, "DROP ROLE " + role} {
			if _, err := e.db.Exec(s); err != nil {
				e.t.Errorf("%s: %v", s, err)
			}
		}
	})
	cfg := pgtest.Config
	return role, fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, role, e.name)
}

// A deployment in parts, each by a role with exactly what grants prints
// for it: the migrator's role migrates the database with no broker to
// reach; provision makes the stream with no database; the relay's role
// passes check, and a relay role that cannot read the migrations' record
// fails it, named (it used to print "privileges: ok"); the operator's role
// passes check -role operator and runs lag, parked and replay.
func TestEachPartRunsAsARoleWithWhatGrantsPrints(t *testing.T) {
	e := newEnv(t)
	if _, err := e.db.Exec(`REVOKE ALL ON SCHEMA public FROM PUBLIC`); err != nil {
		t.Fatal(err)
	}
	_, asMigrator := e.grantRole("migrator", "-role", "migrator", "-database", e.database)
	nowhere := "nats://" + freeAddr(t)
	code, out := e.runOnce("migrate-database", "-database", asMigrator, "-nats", nowhere)
	if code != 0 || !strings.Contains(out, "migrated: table outbox at schema version") {
		t.Fatalf("migrate-database as the migrator, no broker to reach, exited %d:\n%s", code, out)
	}
	code, out = e.runOnce("provision", "-database", "host=nowhere.invalid dbname=none")
	if code != 0 || !strings.Contains(out, "provisioned: nats: stream OUTBOX") {
		t.Fatalf("provision with no database to reach exited %d:\n%s", code, out)
	}

	relay, asRelay := e.grantRole("relay")
	if code, out := e.runOnce("check", "-database", asRelay); code != 0 || !strings.Contains(out, "ok    privileges: the role has what the relay needs") {
		t.Errorf("check as the relay's role exited %d:\n%s", code, out)
	}
	if _, err := e.db.Exec("REVOKE SELECT ON outbox_migrations FROM " + relay); err != nil {
		t.Fatal(err)
	}
	code, out = e.runOnce("check", "-database", asRelay)
	if code != 1 || !strings.Contains(out, "FAIL  privileges: postgres: the role lacks a privilege: "+relay+", as the outbox's relay, lacks SELECT on table outbox_migrations") {
		t.Errorf("check as a relay role that cannot read the migrations exited %d; want it named:\n%s", code, out)
	}

	_, asOperator := e.grantRole("operator", "-role", "operator")
	if code, out := e.runOnce("check", "-role", "operator", "-database", asOperator); code != 0 || !strings.Contains(out, "ok    privileges: the role has what the operator needs") {
		t.Errorf("check -role operator as the operator's role exited %d:\n%s", code, out)
	}
	code, out = e.runOnce("check", "-role", "operator", "-database", asRelay)
	if code != 1 || !strings.Contains(out, "lacks SELECT on table outbox_migrations") {
		t.Errorf("check -role operator as the relay's role exited %d; want what it lacks named:\n%s", code, out)
	}
	e.writeOrders(1)
	if _, err := e.db.Exec(`UPDATE outbox SET sent_at = now(), aggregate = 'order/1', seq = 1`); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"lag"}, {"parked"}, {"replay", "-aggregate", "order/1", "-new-keys"}} {
		if code, out := e.runOnce(append(args, "-database", asOperator)...); code != 0 {
			t.Errorf("%v as the operator's role exited %d:\n%s", args, code, out)
		}
	}
}

// A consumer's database, in parts: migrate-consumer as a role with what
// grants -role consumer-migrator prints makes the consumer's tables and no
// outbox table; check -role consumer, as a role with what grants -role
// consumer prints, passes, and fails as the migrator's role, named. It
// checks no broker: given -broker kafka and no cluster, it passes, saying
// so. (Caught: it dialled the broker, and failed in a Kafka consumer's
// database unless given Kafka's settings.)
func TestAConsumersDatabaseIsMigratedAndCheckedByRolesOfItsOwn(t *testing.T) {
	e := newEnv(t)
	if _, err := e.db.Exec(`REVOKE ALL ON SCHEMA public FROM PUBLIC`); err != nil {
		t.Fatal(err)
	}
	_, asMigrator := e.grantRole("cmigrator", "-role", "consumer-migrator")
	code, out := e.runOnce("migrate-consumer", "-database", asMigrator)
	if code != 0 || !strings.Contains(out, "migrated: the consumer's tables at version 1") {
		t.Fatalf("migrate-consumer as the consumer's migrator exited %d:\n%s", code, out)
	}
	if n := e.count(`SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'outbox%' AND tablename <> 'outbox_consumer_migrations'`); n != 0 {
		t.Errorf("migrate-consumer made %d outbox tables", n)
	}
	if code, out := e.runOnce("provision"); code != 0 {
		t.Fatalf("provision exited %d:\n%s", code, out)
	}
	_, asConsumer := e.grantRole("consumer", "-role", "consumer")
	if code, out := e.runOnce("check", "-role", "consumer", "-database", asConsumer, "-broker", "kafka", "-kafka", "127.0.0.1:1"); code != 0 ||
		!strings.Contains(out, "ok    privileges: the role has what the consumer needs") ||
		!strings.Contains(out, "ok    schema: the consumer's tables at version 1") || !strings.Contains(out, "broker: not checked") {
		t.Errorf("check -role consumer as the consumer's role exited %d:\n%s", code, out)
	}
	bare := e.name + "_bare"
	for _, s := range []string{"CREATE ROLE " + bare + " LOGIN", "GRANT USAGE ON SCHEMA public TO " + bare} {
		if _, err := e.db.Exec(s); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { e.db.Exec("DROP OWNED BY " + bare); e.db.Exec("DROP ROLE " + bare) })
	code, out = e.runOnce("check", "-role", "consumer", "-database", strings.Replace(asConsumer, "user="+e.name+"_consumer", "user="+bare, 1))
	if code != 1 || !strings.Contains(out, "INSERT on table processed_messages, to record") {
		t.Errorf("check -role consumer as a role with no grant on its tables exited %d; want what it lacks named:\n%s", code, out)
	}
}

// The README's grants blocks are what grants prints for the flags their
// marker gives.
func TestReadmeGrantsBlockIsWhatGrantsPrints(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := 0
	for _, part := range strings.Split(string(readme), "<!-- grants: ")[1:] {
		flags, rest, _ := strings.Cut(part, " -->\n```sql\n")
		block, _, ok := strings.Cut(rest, "```")
		if !ok {
			t.Fatalf("grants block %q has no end", flags)
		}
		var out strings.Builder
		if code := cli(append([]string{"grants"}, strings.Fields(flags)...), &out, io.Discard); code != 0 {
			t.Fatalf("grants %s exited %d", flags, code)
		}
		if out.String() != block {
			t.Errorf("README's block for grants %s:\n%s\ngrants prints:\n%s", flags, block, out.String())
		}
		blocks++
	}
	if blocks == 0 {
		t.Fatal("no grants block in the README")
	}
}

// check tries a publish as the broker's user, storing nothing: a user that
// may use JetStream's API and not publish under the stream's subjects is
// named by the broker's line, the permission the server refused in it.
func TestCheckTriesAPublishAsTheBrokersUser(t *testing.T) {
	e := newEnv(t)
	srv := startJetStream(t, server.Options{Users: []*server.User{
		{Username: "relay", Password: "relay-pw"},
		{Username: "reader", Password: "reader-pw", Permissions: &server.Permissions{
			Publish: &server.SubjectPermission{Allow: []string{"$JS.API.>", "_INBOX.>"}},
		}},
	}})
	e.nats().url = srv.ClientURL()
	e.environ = append(e.environ, "OUTBOX_NATS_PASSWORD=relay-pw")
	if code, out := e.runOnce("migrate", "-nats-user", "relay"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	if code, out := e.runOnce("check", "-nats-user", "relay"); code != 0 || !strings.Contains(out, "ok    broker") {
		t.Errorf("check as a user that may publish exited %d:\n%s", code, out)
	}
	e.environ = append(e.environ, "OUTBOX_NATS_PASSWORD=reader-pw")
	code, out := e.runOnce("check", "-nats-user", "reader")
	if code != 1 || !strings.Contains(out, "FAIL  broker: natsbroker: a publish to the subject does not reach a stream: outbox.OutboxRelayCheck") ||
		!strings.Contains(strings.ToLower(out), "permissions violation") {
		t.Errorf("check as a user that may not publish exited %d; want the broker's line naming the permission:\n%s", code, out)
	}
}
