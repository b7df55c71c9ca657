package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// walkthrough is the blocks of ADOPTING.md marked <!-- walkthrough: … -->,
// in order, as one script.
func walkthrough(t *testing.T) string {
	t.Helper()
	page, err := os.ReadFile("../postgres/ADOPTING.md")
	if err != nil {
		t.Fatal(err)
	}
	var script []string
	for _, part := range strings.Split(string(page), "<!-- walkthrough: ")[1:] {
		name, rest, _ := strings.Cut(part, " -->\n```sh\n")
		block, _, ok := strings.Cut(rest, "```")
		if !ok {
			t.Fatalf("walkthrough block %q has no end", name)
		}
		script = append(script, "# "+name+"\n"+block)
	}
	if len(script) < 4 {
		t.Fatalf("ADOPTING.md has %d walkthrough blocks, want the four of its least-privilege deployment", len(script))
	}
	return strings.Join(script, "")
}

// ADOPTING.md's least-privilege deployment, its blocks run as they are by
// sh, with psql and outbox-relay on the PATH, the owner's parts as a role
// that owns the database and may make roles and databases, not a
// superuser: the migrator makes the tables it owns, each role gets what
// grants prints, the stream is provisioned with no database, every check
// passes, the relay runs as shop_relay, and a consumer's database gets the
// consumer's tables alone. An event written as shop_app then reaches the
// stream through that relay.
func TestLeastPrivilegeWalkthrough(t *testing.T) {
	e := newEnv(t)
	script := walkthrough(t)
	cfg := pgtest.Config
	// The owner: not a superuser, a role that may make roles and
	// databases, and owns the database.
	owner := e.name + "_owner"
	for _, s := range []string{"CREATE ROLE " + owner + " LOGIN CREATEROLE CREATEDB", "ALTER DATABASE " + e.name + " OWNER TO " + owner} {
		if _, err := e.db.Exec(s); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("sh", "-e", "-c", script)
	cmd.Env = append(os.Environ(),
		"PATH="+filepath.Dir(e.binary)+string(os.PathListSeparator)+os.Getenv("PATH"),
		"PGHOST="+cfg.Host, fmt.Sprintf("PGPORT=%d", cfg.Port), "PGUSER="+owner, "PGDATABASE="+e.name, "PGSSLMODE=disable",
		"OUTBOX_DATABASE_URL=dbname="+e.name, "OUTBOX_NATS_URL="+e.nats().url)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// A file, not a pipe: the relay the script leaves running holds its
	// output open, and a pipe would keep Run waiting for it.
	out, err := os.Create(filepath.Join(t.TempDir(), "walkthrough.out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	t.Cleanup(func() {
		if cmd.Process != nil {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // the relay it left running
		}
		admin := pgtest.Open(t, cfg.Database, "")
		for _, db := range []*sql.DB{e.db, pgtest.Open(t, "warehouse", "")} {
			for _, role := range []string{"shop_migrator", "shop_app", "shop_relay", "shop_operator", "warehouse_migrator", "warehouse"} {
				db.Exec("DROP OWNED BY " + role)
			}
			db.Close()
		}
		admin.Exec("DROP DATABASE IF EXISTS warehouse WITH (FORCE)")
		admin.Exec("ALTER DATABASE " + e.name + " OWNER TO " + cfg.User)
		for _, role := range []string{"shop_migrator", "shop_app", "shop_relay", "shop_operator", "warehouse_migrator", "warehouse", owner} {
			if _, err := admin.Exec("DROP ROLE IF EXISTS " + role); err != nil {
				t.Errorf("drop role %s: %v", role, err)
			}
		}
	})
	runErr := cmd.Run()
	b, err := os.ReadFile(out.Name())
	if err != nil {
		t.Fatal(err)
	}
	said := string(b)
	if runErr != nil {
		t.Fatalf("the walkthrough failed: %v\n%s", runErr, said)
	}
	t.Logf("the walkthrough said:\n%s", said)
	for _, want := range []string{
		"migrated: table outbox at schema version",
		"provisioned: nats: stream OUTBOX",
		"ok    privileges: the role has what the relay needs",
		"ok    privileges: the role has what the operator needs",
		"migrated: the consumer's tables at version 1",
		"ok    privileges: the role has what the consumer needs",
	} {
		if !strings.Contains(said, want) {
			t.Errorf("the walkthrough did not say %q", want)
		}
	}
	if n := e.count(`SELECT count(*) FROM pg_tables WHERE tablename = 'outbox' AND tableowner = 'shop_migrator'`); n != 1 {
		t.Errorf("the outbox is not the migrator's")
	}

	// The service, as shop_app, writes an event; the relay, as shop_relay,
	// publishes it.
	appCfg := cfg.Copy()
	appCfg.Database, appCfg.User = e.name, "shop_app"
	app := stdlib.OpenDB(*appCfg)
	defer app.Close()
	ob, err := postgres.OpenDB(app, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ob.CheckSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if err := postgres.Transaction(ctx, app, func(ctx context.Context, tx *sql.Tx) error {
		_, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": 1}, Aggregate: "order/1", Seq: 1})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the event in the stream, through the relay run as shop_relay", func() bool { return e.streamMsgs() == 1 })
	waitFor(t, "the row marked sent", func() bool { return e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`) == 1 })
	warehouse := pgtest.Open(t, "warehouse", "")
	var outboxes int
	if err := warehouse.QueryRow(`SELECT count(*) FROM pg_tables WHERE tablename = 'outbox'`).Scan(&outboxes); err != nil || outboxes != 0 {
		t.Errorf("the consumer's database holds %d outbox tables (%v)", outboxes, err)
	}
}
