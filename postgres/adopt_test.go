package postgres_test

// What a team does to adopt the outbox without importing it: copy the
// files the README names into a module of its own, and build.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// The README's "What to copy" names files and folders that build alone:
// copied, exactly those, into a fresh module outside the repository (with
// this module's go.mod and go.sum under another name), they compile, and
// they are every .go file of the package but its tests. (Caught: a list of
// five files that used telemetry.go, maintain.go and a package of the
// module's own.)
func TestWhatToCopyBuildsAlone(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, para, ok := strings.Cut(string(readme), "**What to copy:**")
	if !ok {
		t.Fatal(`README.md has no "**What to copy:**" paragraph`)
	}
	para, _, _ = strings.Cut(para, "\n\n")
	var named []string
	for _, m := range regexp.MustCompile(`\]\(([^)]+)\)`).FindAllStringSubmatch(para, -1) {
		named = append(named, strings.TrimSuffix(m[1], "/"))
	}
	t.Logf("the README says to copy: %s", strings.Join(named, " "))

	dir := t.TempDir()
	for _, name := range named {
		info, err := os.Stat(name)
		if err != nil {
			t.Fatalf("the README names %s: %v", name, err)
		}
		if info.IsDir() {
			err = os.CopyFS(filepath.Join(dir, name), os.DirFS(name))
		} else {
			var b []byte
			if b, err = os.ReadFile(name); err == nil {
				err = os.WriteFile(filepath.Join(dir, name), b, 0o644)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	mod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	mod = regexp.MustCompile(`(?m)^module .*$`).ReplaceAll(mod, []byte("module example.org/team/outbox"))
	sum, err := os.ReadFile("go.sum")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), mod, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644); err != nil {
		t.Fatal(err)
	}
	goCmd(t, dir, "build", "./...")

	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if !strings.HasSuffix(f, "_test.go") && !strings.Contains(para, "("+f+")") {
			t.Errorf("the README's list leaves out %s", f)
		}
	}
}

// goCmd runs the go command with args in dir, with the module cache of the
// test's own build, and fails t with its output if it fails.
func goCmd(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s in %s: %v\n%s", strings.Join(args, " "), dir, err, out)
	}
}

// The adopter's page, ADOPTING.md, shows the lines a team on pgxpool
// writes: open the outbox, write a change and its event in one pgx.Tx, its
// Seq read under the aggregate's row lock, run the relay, apply a message
// once. The block builds as it is, in a module outside the repository that
// requires this one, inside a function that gives it the names it uses,
// and runs there against a database of its own, twice: the relay publishes
// account/17's events 1 and 2, in order, each once, and the consumer
// applies its message once and drops it the second time. (Caught: a block
// whose Seq came from nowhere and whose Aggregate was a bare number.)
func TestAdoptingPageBuilds(t *testing.T) {
	page, err := os.ReadFile("ADOPTING.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, _ := strings.Cut(string(page), "## 2. What to write")
	_, block, _ = strings.Cut(block, "```go\n")
	block, _, ok := strings.Cut(block, "```")
	for _, want := range []string{"postgres.Open(pool,", "ob.Write(ctx, tx,", "postgres.Commit(ctx, tx)", "ob.NewRelay(", "ob.ApplyOnce(ctx, msg,"} {
		if !ok || !strings.Contains(block, want) {
			t.Fatalf("ADOPTING.md's block after \"2. What to write\" lacks %s:\n%s", want, block)
		}
	}
	if n := strings.Count(strings.TrimSpace(block), "\n") + 1; n > 40 {
		t.Errorf("the block is %d lines; the page promises a short one", n)
	}
	_, later, _ := strings.Cut(string(page), "## 5. CloudEvents, headers, bytes, later, and again")
	_, later, _ = strings.Cut(later, "```go\n")
	later, _, ok = strings.Cut(later, "```")
	if !ok || !strings.Contains(later, "ob.Replay(ctx,") || !strings.Contains(later, "DeliverAt:") {
		t.Fatalf("ADOPTING.md's block in section 5 lacks Replay or DeliverAt:\n%s", later)
	}
	dir := t.TempDir()
	src := `package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
)

func adopt(ctx context.Context, pool *pgxpool.Pool, broker postgres.MessageBroker, msg postgres.Message,
	id int64, plan string) error {
` + block + `}

func later(ctx context.Context, ob *postgres.Outbox[postgres.PgxTx], tx postgres.PgxTx, protoBytes []byte,
	reminder map[string]any, id, seq int64, nineOClock time.Time) error {
` + later + `	return nil
}
`
	teamModule(t, dir)
	if err := errors.Join(os.WriteFile(filepath.Join(dir, "adopting.go"), []byte(src), 0o644),
		os.WriteFile(filepath.Join(dir, "main.go"), []byte(adoptingMain), 0o644)); err != nil {
		t.Fatal(err)
	}
	goCmd(t, dir, "build", "./...")

	name := newBlankDatabase(t)
	cfg := pgtest.Config
	cmd := exec.Command("go", "run", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off",
		fmt.Sprintf("ADOPTING_DATABASE=host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, name))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the block, run: %v\n%s", err, out)
	}
	t.Logf("the block, run:\n%s", out)
	if !strings.Contains(string(out), "published: account/17 1, account/17 2; invoices: 1") {
		t.Errorf("the block, run twice, said:\n%s\nwant account/17's events 1 and 2 published and one invoice", out)
	}
	for _, want := range []string{"2 sent events put back\nlater: published ", "PlanChanged account/17 1 ", "PlanChanged account/17 2 ",
		"PlanChanged  0 acme", "; account/17 3 due at 09:00, unsent"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("section 5's block said:\n%s\nwant %q in it: account/17's 2 sent events put back and published again, the payload with its header, and event 3 scheduled", out, want)
		}
	}
}

// adoptingMain runs ADOPTING.md's block (adopt) twice against the database
// ADOPTING_DATABASE names, the relay publishing to a broker that keeps
// what it is given, and the consumer handed the same message each time.
const adoptingMain = `package main

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
)

type broker struct {
	mu   sync.Mutex
	msgs []postgres.Message
}

func (b *broker) Publish(_ context.Context, m postgres.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.msgs = append(b.msgs, m)
	return nil
}

func (b *broker) published() []postgres.Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]postgres.Message(nil), b.msgs...)
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("ADOPTING_DATABASE"))
	if err != nil {
		fail(err)
	}
	defer pool.Close()
	ob, err := postgres.Open(pool, postgres.Config{})
	if err != nil {
		fail(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		fail(err)
	}
	if _, err := pool.Exec(ctx, ` + "`" + `
		CREATE TABLE accounts (id bigint PRIMARY KEY, plan text NOT NULL, events bigint NOT NULL DEFAULT 0);
		CREATE TABLE invoices (account bigint NOT NULL, plan text NOT NULL);
		INSERT INTO accounts (id, plan) VALUES (17, 'free')` + "`" + `); err != nil {
		fail(err)
	}
	b := &broker{}
	msg := postgres.Message{Key: "delivered-once", Type: "PlanChanged", Payload: "{}", Aggregate: "account/17", Seq: 1}
	for _, plan := range []string{"pro", "max"} {
		if err := adopt(ctx, pool, b, msg, 17, plan); err != nil {
			fail(err)
		}
	}
	for len(b.published()) < 2 {
		select {
		case <-ctx.Done():
			fail(fmt.Errorf("published %d of 2 events", len(b.published())))
		case <-time.After(10 * time.Millisecond):
		}
	}
	// The relay marks a row sent after the broker took it: wait for both
	// marks, as section 5's replay asks for sent rows.
	for sent := 0; sent < 2; {
		if err := pool.QueryRow(ctx, ` + "`SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`" + `).Scan(&sent); err != nil {
			fail(err)
		}
		select {
		case <-ctx.Done():
			fail(fmt.Errorf("%d of 2 published events marked sent", sent))
		case <-time.After(10 * time.Millisecond):
		}
	}
	var invoices int
	if err := pool.QueryRow(ctx, ` + "`SELECT count(*) FROM invoices`" + `).Scan(&invoices); err != nil {
		fail(err)
	}
	fmt.Print("published: ")
	for i, m := range b.published() {
		if i > 0 {
			fmt.Print(", ")
		}
		fmt.Print(m.Aggregate, " ", m.Seq)
	}
	fmt.Printf("; invoices: %d\n", invoices)

	// Section 5's block: a Protobuf payload with a header, a reminder for
	// 9:00 tomorrow as account/17's next event, and a replay of its sent
	// events.
	tx, err := pool.Begin(ctx)
	if err != nil {
		fail(err)
	}
	var seq int64
	if err := tx.QueryRow(ctx, ` + "`UPDATE accounts SET events = events + 1 WHERE id = 17 RETURNING events`" + `).Scan(&seq); err != nil {
		fail(err)
	}
	nine := time.Date(time.Now().Year()+1, 1, 1, 9, 0, 0, 0, time.UTC)
	if err := later(ctx, ob, tx, []byte{0x08, 0x11}, map[string]any{"accountId": 17}, 17, seq, nine); err != nil {
		fail(err)
	}
	if err := postgres.Commit(ctx, tx); err != nil {
		fail(err)
	}
	// The relays section 2 started publish what it put back, and the
	// payload with its header; the reminder waits for its time.
	for len(b.published()) < 5 {
		select {
		case <-ctx.Done():
			fail(fmt.Errorf("published %d of 5 events", len(b.published())))
		case <-time.After(10 * time.Millisecond):
		}
	}
	var due time.Time
	if err := pool.QueryRow(ctx, ` + "`SELECT deliver_at FROM outbox WHERE aggregate = 'account/17' AND seq = 3 AND sent_at IS NULL`" + `).Scan(&due); err != nil {
		fail(err)
	}
	fmt.Print("later: published ")
	for i, m := range b.published()[2:] {
		if i > 0 {
			fmt.Print(", ")
		}
		fmt.Print(m.Type, " ", m.Aggregate, " ", m.Seq, " ", m.Headers["Tenant"])
	}
	fmt.Printf("; account/17 3 due at %s, unsent\n", due.UTC().Format("15:04"))
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}
`

// teamModule makes dir a team's module, example.org/team/app, that requires
// this one through a replace line, with this module's go.sum, as a team's
// module outside the repository would.
func teamModule(t *testing.T, dir string) {
	t.Helper()
	here, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	mod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	mod = regexp.MustCompile(`(?m)^module .*$`).ReplaceAll(mod, []byte("module example.org/team/app"))
	mod = append(mod, []byte("\nrequire example.com/patterns/enterprise/outbox/postgres v0.0.0\n\nreplace example.com/patterns/enterprise/outbox/postgres => "+here+"\n")...)
	sum, err := os.ReadFile("go.sum")
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(os.WriteFile(filepath.Join(dir, "go.mod"), mod, 0o644), os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644)); err != nil {
		t.Fatal(err)
	}
}
