package postgres_test

// The outbox package is only the outbox: what it imports and what its
// documentation shows, checked from its source.

import (
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

// NewOutboxRelay refuses, at construction, a pool of another driver, with
// a panic that names it; pgx's pool it takes.
func TestNewOutboxRelayRefusesAnotherDriver(t *testing.T) {
	other, err := sql.Open("outbox-fake", "")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	func() {
		defer func() {
			msg, _ := recover().(string)
			if !strings.Contains(msg, "pgx's stdlib driver") || !strings.Contains(msg, "postgres_test.fakeDriver") {
				t.Errorf("NewOutboxRelay on another driver panicked with %q, want one naming pgx's driver and the one it got", msg)
			}
			t.Logf("it said: %s", msg)
		}()
		postgres.NewOutboxRelay(other, nil)
	}()
	pgx, err := sql.Open("pgx", "host=/nonexistent")
	if err != nil {
		t.Fatal(err)
	}
	defer pgx.Close()
	postgres.NewOutboxRelay(pgx, nil) // does not panic: no connection is made
}
