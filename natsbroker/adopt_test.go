package natsbroker_test

// What a team does to adopt the outbox: a module of its own that requires
// the outbox modules, and nothing of the lesson or the example.

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
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
	log.Fatal(postgres.NewOutboxRelay(db, natsbroker.NewPublisher(js)).Run(ctx))
}
`

// A program that imports only the outbox packages builds in a module
// outside the repository whose go.mod has replace directives for the two
// outbox modules alone, as a team's would before they are published; its
// build list holds neither the root teaching module nor the shop's.
// (Caught: natsbroker and postgres requiring the root module, which such
// a go.mod cannot resolve.)
func TestATeamImportsTheOutboxModulesAlone(t *testing.T) {
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
	for name, data := range map[string][]byte{"go.mod": []byte(mod), "go.sum": sum, "main.go": []byte(teamProgram)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("go.mod:\n%s", mod)
	goCmd(t, dir, "mod", "tidy")
	goCmd(t, dir, "build", "-o", os.DevNull, ".")
	list := goCmd(t, dir, "list", "-m", "all")
	for line := range strings.Lines(list) {
		if m := strings.Fields(line)[0]; m == "example.com/patterns/enterprise/outbox" || strings.HasSuffix(m, "/cmd/shop") {
			t.Errorf("the team's build list holds %s", line)
		}
	}
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
