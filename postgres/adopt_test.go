package postgres_test

// What a team does to adopt the outbox without importing it: copy the
// files the README names into a module of its own, and build.

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
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
// writes: open the outbox, write a change and its event in one pgx.Tx, run
// the relay, apply a message once. The block builds as it is, in a module
// outside the repository that requires this one, inside a function that
// gives it the names it uses.
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
	dir := t.TempDir()
	src := `package adopting

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
)

func adopt(ctx context.Context, pool *pgxpool.Pool, broker postgres.MessageBroker, msg postgres.Message,
	id int64, plan string, seq int64) error {
` + block + `}
`
	teamModule(t, dir)
	if err := os.WriteFile(filepath.Join(dir, "adopting.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	goCmd(t, dir, "build", "./...")
}

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
