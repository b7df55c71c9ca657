package natsbroker_test

// What a team does to adopt the outbox: a module of its own that requires
// the outbox modules, and nothing of the lesson or the example.

import (
	"fmt"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// teamProgram is a team's relay: its database, its JetStream, the outbox
// between them.
const teamProgram = `package main

import (
	"context"
	"database/sql"
	"log"
	"os"
	"os/signal"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	nc, err := nats.Connect(os.Getenv("NATS_URL"))
	if err != nil {
		log.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		log.Fatal(err)
	}
	publisher, err := natsbroker.NewPublisher(js, natsbroker.PublisherOptions{})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := ob.NewRelay(publisher, postgres.RelayConfig{})
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(relay.Run(ctx))
}
`

// A program that imports only the outbox packages builds in a module
// outside the repository whose go.mod has replace directives for the two
// outbox modules alone, as a team's would before they are published; its
// build list holds neither the root teaching module nor the shop's.
// (Caught: natsbroker and postgres requiring the root module, which such
// a go.mod cannot resolve.)
func TestATeamImportsTheOutboxModulesAlone(t *testing.T) {
	dir := teamModule(t, map[string][]byte{"main.go": []byte(teamProgram)})
	goCmd(t, dir, "build", "-o", os.DevNull, ".")
	list := goCmd(t, dir, "list", "-m", "all")
	for line := range strings.Lines(list) {
		if m := strings.Fields(line)[0]; m == "example.com/patterns/enterprise/outbox" || strings.HasSuffix(m, "/outbox/shop") {
			t.Errorf("the team's build list holds %s", line)
		}
	}
}

// teamModule writes files into a module of a team's own, outside the
// repository, whose go.mod requires the two outbox modules (replaced by
// this repository's folders, as before they are published), tidies it, and
// returns its folder.
func teamModule(t *testing.T, files map[string][]byte) string {
	t.Helper()
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	mod := "module example.org/team\n\ngo 1.26.0\n\n" +
		"require (\n\texample.com/patterns/enterprise/outbox/natsbroker v0.0.0\n\texample.com/patterns/enterprise/outbox/postgres v0.0.0\n)\n\n" +
		"replace (\n\texample.com/patterns/enterprise/outbox/natsbroker => " + filepath.Join(repo, "natsbroker") +
		"\n\texample.com/patterns/enterprise/outbox/postgres => " + filepath.Join(repo, "postgres") + "\n)\n"
	var sum []byte
	for _, f := range []string{"go.sum", "../postgres/go.sum"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		sum = append(sum, b...)
	}
	files["go.mod"], files["go.sum"] = []byte(mod), sum
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("go.mod:\n%s", mod)
	goCmd(t, dir, "mod", "tidy")
	return dir
}

// goCmd runs the go command with args in dir, with the module cache of the
// test's own build, returns its output, and fails t if it fails.
func goCmd(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go %s in %s: %v\n%s", strings.Join(args, " "), dir, err, out)
	}
	return string(out)
}

// A team on pgxpool alone, with no database/sql in its code, adopts the
// whole outbox through one Outbox: testdata/pgxteam, built in a module of
// its own, migrates a blank database, writes an order and its event in its
// own pgx.Tx, relays the event to JetStream, reads the lag, cleans up, and
// applies the event once in a pgx.Tx, its second delivery dropped.
// (Caught: pgx stopping at writing a row and the polling relay; the
// migrations, lag, cleanup and the consumer's records on *sql.DB alone.)
func TestATeamOnPgxpoolAloneRunsTheWholeOutbox(t *testing.T) {
	src, err := os.ReadFile("testdata/pgxteam/main.go")
	if err != nil {
		t.Fatal(err)
	}
	f, err := parser.ParseFile(token.NewFileSet(), "main.go", src, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	for _, imp := range f.Imports {
		if p, _ := strconv.Unquote(imp.Path.Value); p == "database/sql" || strings.HasSuffix(p, "/stdlib") {
			t.Fatalf("the pgx team's program imports %s", p)
		}
	}
	dir := teamModule(t, map[string][]byte{"main.go": src})
	bin := filepath.Join(t.TempDir(), "pgxteam")
	goCmd(t, dir, "build", "-o", bin, ".")

	b := startBroker(t, nil)
	cfg := pgtest.Config
	database := fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, pgtest.NewBlankDatabase(t))
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+database, "NATS_URL="+b.url())
	out, err := cmd.CombinedOutput()
	t.Logf("pgxteam:\n%s", out)
	if err != nil {
		t.Fatalf("pgxteam: %v", err)
	}
	want := "published 1\nunsent 0\ncleaned up 1\napplied OrderPlaced\napplied again false\nreservations 1\n"
	if string(out) != want {
		t.Errorf("pgxteam printed\n%s\nwant\n%s", out, want)
	}
}

// The broker folders hold their adapters only: no main package in the
// natsbroker or the rabbitbroker module, and neither requires the shop's
// or the relay process's module, which import them. (Caught: the shop, the
// relay process and the knee's plot under natsbroker/cmd.)
func TestTheBrokerModulesHoldAdaptersOnly(t *testing.T) {
	for _, dir := range []string{".", "../rabbitbroker"} {
		list := goCmd(t, dir, "list", "-f", "{{.ImportPath}} {{.Name}}", "./...")
		for line := range strings.Lines(list) {
			if path, name, _ := strings.Cut(strings.TrimSpace(line), " "); name == "main" {
				t.Errorf("%s is a main package in %s", path, dir)
			}
		}
		mods := goCmd(t, dir, "list", "-m", "all")
		for line := range strings.Lines(mods) {
			if m := strings.Fields(line)[0]; strings.HasSuffix(m, "/outbox/shop") || strings.HasSuffix(m, "/outbox/outbox-relay") {
				t.Errorf("%s's build list holds %s", dir, m)
			}
		}
		t.Logf("%s: %d packages, none a program", dir, strings.Count(list, "\n"))
	}
}
