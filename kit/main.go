// Command kit copies the outbox's product modules that a team names into
// the team's repository, under the team's module path, for the team to
// own, and later takes that copy to a newer version, keeping the team's
// own changes:
//
//	go -C kit run . -module example.org/team/outbox -into ../../team-repo/outbox -modules postgres,kafkabroker,outbox-relay
//	go -C kit run . upgrade -into ../../team-repo/outbox
//
// A copy holds the modules named and what they need, nothing else: a
// broker's module needs postgres; the relay process, outbox-relay, needs
// postgres and at least one broker's module, and its copy keeps only the
// brokers copied (each broker's files are named after it, nats*.go,
// rabbitmq*.go, kafka*.go; a test that needs a left-out broker is left out
// with it). Every import path, go.mod line and document that names a
// module of this repository (example.com/patterns/enterprise/outbox/…)
// names the team's instead. Left out: what is this repository's and not
// the product's (the lesson, the shop, the ladder, the benchmarks against
// other outboxes, the measured figures, and the tests of this repository's
// documents). Then it builds and vets each module where it copied it, and
// writes kit.json (the commit, the module path and the modules: what
// upgrade reads) and KIT.md there.
//
// upgrade makes the copy again at the commit kit.json names (the base)
// and at -from's commit (theirs), and merges theirs into the team's
// folder three ways, file by file, as git merge-file does: a file the team
// left alone takes upstream's; a file upstream left alone keeps the
// team's; a file both changed is merged, and where the changes overlap,
// marked as git marks a conflict. It says what upstream's changelog added.
//
// Both refuse, writing nothing, what they cannot do whole: a module path
// that is not one, an -into that exists and is not empty (a copy is made
// once, then owned), a module that is not a product module, a relay with
// no broker, an upgrade of a folder with no kit.json.
package main

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Source is the module path prefix of this repository's modules.
const Source = "example.com/patterns/enterprise/outbox/"

// Modules are the product modules the kit copies, each a folder of the
// repository with a go.mod of its own, in the order they build on one
// another.
var Modules = []string{"postgres", "natsbroker", "rabbitbroker", "kafkabroker", "outbox-relay"}

// relayBrokers are the broker modules the relay process may be copied
// with, and the name each broker's files in outbox-relay/ begin with (its
// -broker value).
var relayBrokers = map[string]string{"natsbroker": "nats", "rabbitbroker": "rabbitmq", "kafkabroker": "kafka"}

// leftOut are the paths, relative to the repository, that are this
// repository's and not the product's: a nested module of benchmarks, the
// figures the measuring targets print, the ladder (a lesson), and tests of
// the repository's own documents, which read the lesson's and the shop's.
var leftOut = map[string]bool{
	"postgres/peerbench":       true,
	"postgres/ladder":          true,
	"postgres/figures":         true,
	"postgres/figures_test.go": true,
	"postgres/docs_test.go":    true,
	"postgres/blocks_test.go":  true,
	"postgres/letter_test.go":  true,
	"natsbroker/figures":       true,
	"rabbitbroker/figures":     true,
	"kafkabroker/figures":      true,
}

// modulePath is what -module may be: a module path of lowercase
// letters, digits and . _ - ~, in elements separated by '/', the first
// with a dot (a domain), as go mod init takes one.
var modulePath = regexp.MustCompile(`^[a-z0-9][a-z0-9-]*(\.[a-z0-9-]+)+(/[a-zA-Z0-9._~-]+)*$`)

// ErrRefused is wrapped by the error of what the kit refuses before it
// writes anything.
var ErrRefused = errors.New("kit: refused")

// ErrConflicts is wrapped by Upgrade's error when changes of the team's
// and upstream's overlap: the files are written with conflict markers, for
// the team to resolve.
var ErrConflicts = errors.New("kit: conflicts to resolve")

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kit:", err)
		os.Exit(1)
	}
}

// run parses args and copies, or upgrades.
func run(args []string, out io.Writer) error {
	upgrade := len(args) > 0 && args[0] == "upgrade"
	if upgrade {
		args = args[1:]
	}
	flags := flag.NewFlagSet("kit", flag.ContinueOnError)
	module := flags.String("module", "", "the team's module path the copies go under, such as example.org/team/outbox")
	modules := flags.String("modules", strings.Join(Modules, ","), "the modules to copy, comma-separated; what they need comes with them")
	into := flags.String("into", "", "the folder to copy into: new, or empty (upgrade: the copy)")
	from := flags.String("from", "..", "this repository's root, a git checkout")
	check := flags.Bool("check", true, "build and vet each module once copied")
	if err := flags.Parse(args); err != nil {
		return err
	}
	var copied []string
	if upgrade {
		r, err := Upgrade(*from, *into)
		if r != nil {
			fmt.Fprint(out, r)
		}
		if err != nil {
			return err
		}
		copied = r.Modules
	} else {
		rec, err := Copy(*from, *into, *module, strings.Split(*modules, ",")...)
		if err != nil {
			return err
		}
		copied = rec.Modules
		fmt.Fprintf(out, "copied %s into %s under %s\n", strings.Join(copied, ", "), *into, *module)
	}
	if *check {
		for _, m := range copied {
			dir := filepath.Join(*into, m)
			for _, args := range [][]string{{"build", "-o", os.DevNull, "./..."}, {"vet", "./..."}} {
				cmd := exec.Command("go", args...)
				cmd.Dir = dir
				if b, err := cmd.CombinedOutput(); err != nil {
					return fmt.Errorf("go %s in %s: %w\n%s", strings.Join(args, " "), dir, err, b)
				}
			}
			fmt.Fprintf(out, "%s: builds and vets\n", m)
		}
	}
	return nil
}

// Record is kit.json: what a copy was made of, for upgrade.
type Record struct {
	Commit  string   `json:"commit"`  // the repository's commit copied
	Version string   `json:"version"` // the version its changelog names
	Module  string   `json:"module"`  // the team's module path
	Modules []string `json:"modules"` // the modules copied, with what they needed
}

// Copy copies the modules named (all if none) of the repository checked
// out at from, with the modules they need, into into under module, every
// mention of a module of the repository rewritten, and writes kit.json and
// KIT.md there. It copies the commit from has checked out, as git archive
// gives it: a change not committed is not copied. It refuses, with an error
// wrapping ErrRefused and writing nothing, a module that is not a module
// path, a name that is not a product module, a relay with no broker, a from
// that is no git checkout of the repository, and an into that exists and
// is not empty.
func Copy(from, into, module string, modules ...string) (Record, error) {
	if !modulePath.MatchString(module) || strings.HasSuffix(module, "/") {
		return Record{}, fmt.Errorf("%w: -module %q is not a module path such as example.org/team/outbox", ErrRefused, module)
	}
	if err := empty(into); err != nil {
		return Record{}, err
	}
	modules, err := closure(modules)
	if err != nil {
		return Record{}, err
	}
	commit, err := git(from, "rev-parse", "HEAD")
	if err != nil {
		return Record{}, fmt.Errorf("%w: -from %s is no git checkout of the repository: %w", ErrRefused, from, err)
	}
	tree, cleanup, err := archive(from, commit)
	if err != nil {
		return Record{}, err
	}
	defer cleanup()
	rec := Record{Commit: commit, Module: module, Modules: modules}
	if err := copyTree(tree, into, &rec); err != nil {
		os.RemoveAll(into)
		return Record{}, err
	}
	return rec, nil
}

// empty refuses an into that is not set, or exists and is not empty.
func empty(into string) error {
	if into == "" {
		return fmt.Errorf("%w: -into is not set", ErrRefused)
	}
	if entries, err := os.ReadDir(into); err == nil && len(entries) > 0 {
		return fmt.Errorf("%w: -into %s is not empty: a copy is made once, into a folder of its own", ErrRefused, into)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: -into %s: %w", ErrRefused, into, err)
	}
	return nil
}

// closure is the modules named with those they need, in Modules' order:
// postgres for every other module, and a broker for the relay.
func closure(named []string) ([]string, error) {
	if len(named) == 0 {
		named = Modules
	}
	want := map[string]bool{}
	for _, m := range named {
		m = strings.TrimSpace(m)
		if !slices.Contains(Modules, m) {
			return nil, fmt.Errorf("%w: -modules: %q is not a product module (%s)", ErrRefused, m, strings.Join(Modules, ", "))
		}
		want[m] = true
	}
	if want["outbox-relay"] && !want["natsbroker"] && !want["rabbitbroker"] && !want["kafkabroker"] {
		return nil, fmt.Errorf("%w: -modules: outbox-relay publishes to a broker: name natsbroker, rabbitbroker or kafkabroker with it", ErrRefused)
	}
	want["postgres"] = true
	var modules []string
	for _, m := range Modules {
		if want[m] {
			modules = append(modules, m)
		}
	}
	return modules, nil
}

// copyTree copies rec's modules of the repository tree into into,
// rewritten under rec.Module, and writes kit.json and KIT.md.
func copyTree(tree, into string, rec *Record) error {
	version, err := readVersion(tree)
	if err != nil {
		return err
	}
	rec.Version = version
	for _, m := range Modules {
		if _, err := os.Stat(filepath.Join(tree, m, "go.mod")); err != nil {
			return fmt.Errorf("%w: the repository at %s holds no module %s: %w", ErrRefused, rec.Commit, m, err)
		}
	}
	for _, m := range rec.Modules {
		if err := copyModule(tree, into, m, rec.Module); err != nil {
			return err
		}
	}
	if slices.Contains(rec.Modules, "outbox-relay") {
		if err := pruneRelay(filepath.Join(into, "outbox-relay"), rec); err != nil {
			return err
		}
	}
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(into, "kit.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(into, "KIT.md"), []byte(kitNote(*rec)), 0o644)
}

// copyModule copies the module m of from into into/m, rewritten.
func copyModule(from, into, m, module string) error {
	root := filepath.Join(from, m)
	return filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(from, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if leftOut[rel] {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if d.IsDir() {
			if path != root {
				if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
					return filepath.SkipDir // a module of its own
				}
			}
			return os.MkdirAll(filepath.Join(into, rel), 0o755)
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		b = bytes.ReplaceAll(b, []byte(Source), []byte(module+"/"))
		return os.WriteFile(filepath.Join(into, rel), b, info.Mode().Perm())
	})
}

// pruneRelay takes out of the relay's copy at dir the brokers not copied:
// each broker's files (named after it), every file that imports its
// module or a module only its files import (its SDK), and every file that
// uses what those files declared, until none is left; then its lines in
// go.mod, and go mod tidy.
func pruneRelay(dir string, rec *Record) error {
	var gone []string // the left-out brokers' modules
	for m := range relayBrokers {
		if !slices.Contains(rec.Modules, m) {
			gone = append(gone, m)
		}
	}
	if len(gone) == 0 {
		return nil
	}
	slices.Sort(gone)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	files := map[string]*ast.File{}
	fset := token.NewFileSet()
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, e.Name()), nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		files[e.Name()] = f
	}
	drop := map[string]bool{}
	for name := range files {
		for _, m := range gone {
			if b := relayBrokers[m]; strings.HasPrefix(name, b+".") || strings.HasPrefix(name, b+"_") {
				drop[name] = true
			}
		}
	}
	// Files that import a left-out broker's module, or a repository only
	// the left-out brokers' own (non-test) files import: its SDK.
	goneImports := map[string]bool{}
	keptImports := map[string]bool{}
	for name, f := range files {
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if !drop[name] && !strings.HasSuffix(name, "_test.go") {
				keptImports[repoOf(p)] = true
			}
		}
	}
	for name, f := range files {
		if !drop[name] || strings.HasSuffix(name, "_test.go") {
			continue
		}
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if strings.Contains(strings.Split(p, "/")[0], ".") && !strings.HasPrefix(p, rec.Module+"/") && !keptImports[repoOf(p)] {
				goneImports[repoOf(p)] = true
			}
		}
	}
	for name, f := range files {
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			local := slices.ContainsFunc(gone, func(m string) bool {
				return p == rec.Module+"/"+m || strings.HasPrefix(p, rec.Module+"/"+m+"/")
			})
			if local || (!strings.HasPrefix(p, rec.Module+"/") && goneImports[repoOf(p)]) {
				drop[name] = true
			}
		}
	}
	// Then whatever uses a name the dropped files declared, until nothing
	// more goes.
	for changed := true; changed; {
		changed = false
		names, methods := declared(files, drop)
		for name, f := range files {
			if !drop[name] && uses(f, names, methods) {
				drop[name], changed = true, true
			}
		}
	}
	for name := range drop {
		if !strings.HasSuffix(name, "_test.go") && !isBrokerFile(name, gone) {
			return fmt.Errorf("kit: outbox-relay/%s needs a broker left out (%s): copy it with its broker", name, strings.Join(gone, ", "))
		}
		if err := os.Remove(filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return err
	}
	var kept []string
	for _, line := range strings.Split(string(gomod), "\n") {
		if !slices.ContainsFunc(gone, func(m string) bool { return strings.Contains(line, rec.Module+"/"+m+" ") }) {
			kept = append(kept, line)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(strings.Join(kept, "\n")), 0o644); err != nil {
		return err
	}
	tidy := exec.Command("go", "mod", "tidy")
	tidy.Dir = dir
	if b, err := tidy.CombinedOutput(); err != nil {
		return fmt.Errorf("kit: go mod tidy in outbox-relay's copy: %w\n%s", err, b)
	}
	return nil
}

// isBrokerFile says whether name is one of the gone brokers' own files.
func isBrokerFile(name string, gone []string) bool {
	for _, m := range gone {
		if b := relayBrokers[m]; strings.HasPrefix(name, b+".") || strings.HasPrefix(name, b+"_") {
			return true
		}
	}
	return false
}

// repoOf is the repository an import path is of (host/owner/name), the
// unit a broker's SDK comes in; a path of the standard library or of
// fewer elements is itself.
func repoOf(p string) string {
	parts := strings.Split(p, "/")
	if len(parts) > 3 && strings.Contains(parts[0], ".") {
		return strings.Join(parts[:3], "/")
	}
	return p
}

// declared are the package-level names the dropped files declare (their
// funcs, types, vars and consts, but init), and the methods they add to
// types that other files declare.
func declared(files map[string]*ast.File, drop map[string]bool) (names, methods map[string]bool) {
	names, methods = map[string]bool{}, map[string]bool{}
	types := map[string]bool{} // declared in the dropped files
	for name, f := range files {
		if !drop[name] {
			continue
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil && d.Name.Name != "init" {
					names[d.Name.Name] = true
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						names[s.Name.Name], types[s.Name.Name] = true, true
					case *ast.ValueSpec:
						for _, n := range s.Names {
							names[n.Name] = true
						}
					}
				}
			}
		}
	}
	for name, f := range files {
		if !drop[name] {
			continue
		}
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok && fd.Recv != nil && !types[receiver(fd)] {
				methods[fd.Name.Name] = true
			}
		}
	}
	return names, methods
}

// receiver is the name of fd's receiver's type.
func receiver(fd *ast.FuncDecl) string {
	t := fd.Recv.List[0].Type
	if s, ok := t.(*ast.StarExpr); ok {
		t = s.X
	}
	if id, ok := t.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

// uses says whether f names one of names, or calls one of methods.
func uses(f *ast.File, names, methods map[string]bool) bool {
	found := false
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.SelectorExpr:
			if methods[n.Sel.Name] {
				found = true
			}
			ast.Inspect(n.X, func(x ast.Node) bool {
				if id, ok := x.(*ast.Ident); ok && names[id.Name] {
					found = true
				}
				return !found
			})
			return false // n.Sel is a field or a method, not a package-level name
		case *ast.Ident:
			if names[n.Name] {
				found = true
			}
		}
		return !found
	})
	return found
}

// readVersion is the version the postgres module of tree reports.
func readVersion(tree string) (string, error) {
	b, err := os.ReadFile(filepath.Join(tree, "postgres", "version.go"))
	if err != nil {
		return "", fmt.Errorf("%w: the version: %w", ErrRefused, err)
	}
	m := regexp.MustCompile(`const Version = "([^"]+)"`).FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("%w: postgres/version.go names no Version", ErrRefused)
	}
	return string(m[1]), nil
}

// git runs git in dir, and returns what it printed, trimmed.
func git(dir string, args ...string) (string, error) {
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	b, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(string(b)), nil
}

// archive writes the tree of commit of the repository at repo into a
// temporary folder, as git archive gives it, and returns the folder and
// what removes it.
func archive(repo, commit string) (string, func(), error) {
	dir, err := os.MkdirTemp("", "kit-")
	if err != nil {
		return "", nil, err
	}
	cleanup := func() { os.RemoveAll(dir) }
	top, err := git(repo, "rev-parse", "--show-toplevel")
	if err != nil {
		cleanup()
		return "", nil, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	cmd := exec.Command("git", "archive", "--format=tar", commit)
	cmd.Dir = top // in a subfolder, git archive gives the subfolder alone
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		cleanup()
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		cleanup()
		return "", nil, err
	}
	untarErr := untar(stdout, dir)
	io.Copy(io.Discard, stdout)
	if err := cmd.Wait(); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("%w: git archive %s: %w: %s", ErrRefused, commit, err, strings.TrimSpace(stderr.String()))
	}
	if untarErr != nil {
		cleanup()
		return "", nil, untarErr
	}
	return dir, cleanup, nil
}

// untar writes the regular files and folders of the tar stream r under
// dir.
func untar(r io.Reader, dir string) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := path.Clean(h.Name)
		if !fs.ValidPath(name) {
			return fmt.Errorf("kit: git archive holds %q", h.Name)
		}
		target := filepath.Join(dir, filepath.FromSlash(name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
				return err
			}
			b, err := io.ReadAll(tr)
			if err != nil {
				return err
			}
			if err := os.WriteFile(target, b, fs.FileMode(h.Mode).Perm()); err != nil {
				return err
			}
		}
	}
}

// kitNote is KIT.md: what was copied, and what the team owns.
func kitNote(rec Record) string {
	return fmt.Sprintf(`# The outbox, copied by the kit

Version %[1]s of the outbox's product modules (postgres/CHANGELOG.md), commit %[4]s, copied
under %[2]s: %[3]s. Each module reports the version (`+"`postgres.Version`, …, `outbox-relay version`"+`);
kit.json records what was copied, for the kit's upgrade.

What you own from here on: the code, its tests (in each module's folder,
../postgres/with-server.sh go test ./... runs them on a throwaway PostgreSQL), the documents, and the schema: the numbered migrations in postgres/migrations/ and
postgres/migrations/consumer/, which your databases record by number. Keep those numbers: a
migration released is never changed or renumbered; a change of yours is a migration after the
last. To take a later version, run the kit's upgrade on this folder (go -C kit run . upgrade
-into this folder, in a checkout of the newer version): it keeps your changes, merges upstream's,
and marks where the two overlap, as git does.
`, rec.Version, rec.Module, strings.Join(rec.Modules, ", "), rec.Commit)
}
