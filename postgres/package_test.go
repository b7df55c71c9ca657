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
	"time"

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

// A relay that cannot run as configured is refused when it is made, with
// an error wrapping ErrInvalidConfig that names the setting, and nothing is
// claimed: another driver than pgx's, no broker, a negative budget, batch,
// ParkAfter, poll interval or backoff, a batch over MaxBatchSize,
// ParkAfter with NeverPark, an empty standby name, a pool of two for a
// relay that listens (Run takes a third), and a pool of one even for a
// polling relay (a pass needs two: its transaction and the flush of the
// server's log). The zero RelayConfig is the defaults, each filled in; no
// connection is made to tell. A relay no NewRelay made refuses to pass or
// run. (Caught: a panic on another driver; a pool of one whose every
// flushing pass failed at its budget, "flush the server's log …: context
// deadline exceeded"; configuration read from fields at the first pass.)
func TestRelayConfigurationIsCheckedWhenTheRelayIsMade(t *testing.T) {
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
		name   string
		db     *sql.DB
		broker postgres.MessageBroker
		cfg    postgres.RelayConfig
		says   string // the error names this
	}{
		{"another driver", other, broker, postgres.RelayConfig{}, "postgres_test.fakeDriver"},
		{"no broker", pool(0), nil, postgres.RelayConfig{}, "no broker"},
		{"a negative budget", pool(0), broker, postgres.RelayConfig{PassTimeout: -time.Second}, "RelayConfig.PassTimeout -1s"},
		{"a negative batch", pool(0), broker, postgres.RelayConfig{BatchSize: -1}, "RelayConfig.BatchSize -1"},
		{"a batch too large", pool(0), broker, postgres.RelayConfig{BatchSize: postgres.MaxBatchSize + 1}, "RelayConfig.BatchSize 10001"},
		{"a negative ParkAfter", pool(0), broker, postgres.RelayConfig{ParkAfter: -1}, "RelayConfig.ParkAfter -1"},
		{"ParkAfter with NeverPark", pool(0), broker, postgres.RelayConfig{ParkAfter: 2, NeverPark: true}, "RelayConfig.ParkAfter 2 with NeverPark"},
		{"an empty standby", pool(0), broker, postgres.RelayConfig{Standbys: []string{"a", ""}}, "RelayConfig.Standbys"},
		{"a negative poll interval", pool(0), broker, postgres.RelayConfig{PollInterval: -time.Second}, "RelayConfig.PollInterval -1s"},
		{"a negative backoff", pool(0), broker, postgres.RelayConfig{MaxBackoff: -time.Second}, "RelayConfig.MaxBackoff -1s"},
		{"a negative retry delay", pool(0), broker, postgres.RelayConfig{RetryDelay: -time.Second}, "RelayConfig.RetryDelay -1s"},
		{"a negative longest retry delay", pool(0), broker, postgres.RelayConfig{MaxRetryDelay: -time.Second}, "RelayConfig.MaxRetryDelay -1s"},
		{"a retry delay over the longest", pool(0), broker, postgres.RelayConfig{RetryDelay: time.Hour}, "RelayConfig.MaxRetryDelay 5m0s is below RetryDelay 1h0m0s"},
		{"a pool of two for Run", pool(2), broker, postgres.RelayConfig{}, "needs 3"},
		{"a pool of one, polling", pool(1), broker, postgres.RelayConfig{PollOnly: true}, "allows 1 open connections"},
	} {
		r, err := postgres.NewOutboxRelay(c.db, c.broker, c.cfg)
		if r != nil || !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: NewOutboxRelay = %v, %v; want ErrInvalidConfig saying %q", c.name, r, err, c.says)
		}
		t.Logf("%s: %v", c.name, err)
	}
	for _, c := range []struct {
		max int
		cfg postgres.RelayConfig
	}{{0, postgres.RelayConfig{}}, {3, postgres.RelayConfig{}}, {2, postgres.RelayConfig{PollOnly: true}}} {
		r, err := postgres.NewOutboxRelay(pool(c.max), broker, c.cfg)
		if err != nil {
			t.Errorf("%+v on a pool of %d: %v", c.cfg, c.max, err)
			continue
		}
		got := r.Config()
		if got.BatchSize != postgres.DefaultBatchSize || got.PassTimeout != postgres.DefaultPassTimeout || got.ParkAfter != postgres.DefaultParkAfter ||
			got.PollInterval != postgres.DefaultPollInterval || got.MaxBackoff != postgres.DefaultMaxBackoff || got.WholeTable || got.NeverPark ||
			got.RetryDelay != postgres.DefaultRetryDelay || got.MaxRetryDelay != postgres.DefaultMaxRetryDelay {
			t.Errorf("the zero RelayConfig became %+v; want every default", got)
		}
	}
	if got := newRelay(t, pool(0), broker, postgres.RelayConfig{NeverPark: true}).Config(); got.ParkAfter != 0 {
		t.Errorf("NeverPark: ParkAfter %d, want 0", got.ParkAfter)
	}
	var zero postgres.OutboxRelay
	if n, err := zero.PublishPending(ctx); n != 0 || !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("a zero OutboxRelay's pass = %d, %v; want ErrInvalidConfig", n, err)
	}
	if err := zero.Run(ctx); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("a zero OutboxRelay's Run = %v; want ErrInvalidConfig", err)
	}
}
