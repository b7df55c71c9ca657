package postgres_test

// The outbox package is only the outbox: what it imports and what its
// documentation shows, checked from its source.

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"

	"example.com/patterns/enterprise/outbox/postgres"
)

const module = "example.com/patterns/enterprise/outbox/postgres"

// The package and every package of this module it imports, whatever the
// depth, import neither the root teaching package nor the example.
func TestOutboxImportsNeitherTheLessonNorTheExample(t *testing.T) {
	forbidden := map[string]bool{
		"example.com/patterns/enterprise/outbox": true, // the lesson
		module + "/shop":                         true, // the example
	}
	seen := map[string]bool{}
	var walk func(path string)
	walk = func(path string) {
		if seen[path] {
			return
		}
		seen[path] = true
		for _, imp := range imports(t, strings.TrimPrefix(strings.TrimPrefix(path, module), "/")) {
			if forbidden[imp] {
				t.Errorf("%s imports %s", path, imp)
			}
			if imp == module || strings.HasPrefix(imp, module+"/") {
				walk(imp)
			}
		}
	}
	walk(module)
	t.Logf("packages of the module it builds on: %d", len(seen))
}

// The package's documentation, as go doc -all shows it, names nothing of
// orders or stock: no order type, table or service, no warehouse, no
// reservation.
func TestOutboxDocumentationNamesNothingOfTheExample(t *testing.T) {
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range sources(t, ".") {
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	pkg, err := doc.NewFromFiles(fset, files, module)
	if err != nil {
		t.Fatal(err)
	}
	var text strings.Builder
	text.WriteString(pkg.Doc)
	values := func(vs []*doc.Value) {
		for _, v := range vs {
			text.WriteString(v.Doc + " " + strings.Join(v.Names, " ") + " ")
		}
	}
	funcs := func(fs []*doc.Func) {
		for _, f := range fs {
			text.WriteString(f.Name + " " + f.Doc + " ")
		}
	}
	values(pkg.Consts)
	values(pkg.Vars)
	funcs(pkg.Funcs)
	for _, typ := range pkg.Types {
		text.WriteString(typ.Name + " " + typ.Doc + " ")
		values(typ.Consts)
		values(typ.Vars)
		funcs(typ.Funcs)
		funcs(typ.Methods)
		for _, spec := range typ.Decl.Specs { // fields and their comments
			ast.Inspect(spec, func(n ast.Node) bool {
				if c, ok := n.(*ast.Comment); ok {
					text.WriteString(c.Text + " ")
				}
				if f, ok := n.(*ast.Field); ok {
					for _, name := range f.Names {
						text.WriteString(name.Name + " ")
					}
					text.WriteString(f.Doc.Text() + f.Comment.Text())
				}
				return true
			})
		}
	}
	example := regexp.MustCompile(`\b(?:Order\w*|PlaceOrder\w*|CancelOrder\w*|DirectOrder\w*)\b|\borders\b|order/|[Ww]arehouse|\bstock\b|[Rr]eservation`)
	if found := example.FindAllString(text.String(), -1); len(found) > 0 {
		t.Errorf("the outbox package's documentation names the example: %q", found)
	}
	t.Logf("%d bytes of documentation read, %d types, %d functions", text.Len(), len(pkg.Types), len(pkg.Funcs))
}

// sources are the package's Go files in dir, without its tests.
func sources(t *testing.T, dir string) []string {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var src []string
	for _, n := range names {
		if !strings.HasSuffix(n, "_test.go") {
			src = append(src, n)
		}
	}
	if len(src) == 0 {
		t.Fatalf("no Go files in %s", dir)
	}
	return src
}

// imports are the import paths of the package in dir, without its tests.
func imports(t *testing.T, dir string) []string {
	t.Helper()
	if dir == "" {
		dir = "."
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, name := range sources(t, dir) {
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			paths = append(paths, p)
		}
	}
	return paths
}

// fakeDriver is a database/sql driver that is not pgx's, registered once
// per test binary, as database/sql's own fake driver is, so that
// go test -count=N runs the test that uses it N times.
type fakeDriver struct{}

func init() { sql.Register("outbox-fake", fakeDriver{}) }

func (fakeDriver) Open(string) (driver.Conn, error) {
	return nil, errors.New("fake driver: no connection")
}

// A relay configured so that it cannot run is refused before it claims
// anything, with an error wrapping ErrInvalidConfig that names the setting:
// another driver than pgx's, no broker, a budget or batch of zero, a
// negative ParkAfter, a pool of one connection (a pass needs two: its
// transaction and the flush of the server's log) and, for Run, a pool of
// two (it listens on a third). NewOutboxRelay's own settings pass, and no
// connection is made to tell. (Caught: a panic on another driver; a pool
// of one whose every flushing pass failed at its budget, "flush the
// server's log …: context deadline exceeded".)
func TestRelayConfigurationIsValidatedBeforeAnyClaim(t *testing.T) {
	ctx := context.Background()
	other, err := sql.Open("outbox-fake", "")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	pool := func(max int) *sql.DB {
		db, err := sql.Open("pgx", "host=/nonexistent")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		db.SetMaxOpenConns(max)
		return db
	}
	broker := &recorder{}
	for _, c := range []struct {
		name  string
		relay func() *postgres.OutboxRelay
		run   bool   // Run alone refuses it
		says  string // the error names this
	}{
		{"another driver", func() *postgres.OutboxRelay { return postgres.NewOutboxRelay(other, broker) }, false, "postgres_test.fakeDriver"},
		{"no broker", func() *postgres.OutboxRelay { return postgres.NewOutboxRelay(pool(0), nil) }, false, "no broker"},
		{"a budget of zero", func() *postgres.OutboxRelay {
			r := postgres.NewOutboxRelay(pool(0), broker)
			r.PassTimeout = 0
			return r
		}, false, "PassTimeout is 0s"},
		{"a batch of zero", func() *postgres.OutboxRelay {
			r := postgres.NewOutboxRelay(pool(0), broker)
			r.BatchSize = 0
			return r
		}, false, "BatchSize is 0"},
		{"a negative ParkAfter", func() *postgres.OutboxRelay {
			r := postgres.NewOutboxRelay(pool(0), broker)
			r.ParkAfter = -1
			return r
		}, false, "ParkAfter is -1"},
		{"a pool of one", func() *postgres.OutboxRelay { return postgres.NewOutboxRelay(pool(1), broker) }, false, "allows 1 open connections"},
		{"a pool of two, for Run", func() *postgres.OutboxRelay { return postgres.NewOutboxRelay(pool(2), broker) }, true, "needs 3"},
		{"no poll interval, for Run", func() *postgres.OutboxRelay {
			r := postgres.NewOutboxRelay(pool(0), broker)
			r.PollInterval = 0
			return r
		}, true, "PollInterval is 0s"},
	} {
		if !c.run {
			n, err := c.relay().PublishPending(ctx)
			if n != 0 || !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), c.says) {
				t.Errorf("%s: PublishPending = %d, %v; want ErrInvalidConfig saying %q", c.name, n, err, c.says)
			}
		}
		err := c.relay().Run(ctx)
		if !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: Run = %v; want ErrInvalidConfig saying %q", c.name, err, c.says)
		}
		t.Logf("%s: %v", c.name, err)
	}
	for _, max := range []int{0, 3} {
		if err := postgres.NewOutboxRelay(pool(max), broker).Validate(); err != nil {
			t.Errorf("NewOutboxRelay's own settings on a pool of %d: %v", max, err)
		}
	}
	polling := postgres.NewOutboxRelay(pool(2), broker)
	polling.PollOnly = true
	if err := polling.Validate(); err != nil {
		t.Errorf("a polling relay on a pool of two: %v", err)
	}
}
