// Command kit copies the outbox's product modules (postgres, natsbroker,
// rabbitbroker, kafkabroker and the relay process, outbox-relay) into a team's
// repository, under the team's module path, for the team to own:
//
//	go -C kit run . -module example.org/team/outbox -into ../../team-repo/outbox
//
// Every import path, go.mod line and document that names a module of this
// repository (example.com/patterns/enterprise/outbox/…) names the team's
// instead (example.org/team/outbox/…); the modules keep their layout, their
// replace lines between one another, their tests, testdata, migrations and
// documents. Left out: what is this repository's and not the product's
// (the lesson, the shop, the benchmarks against other outboxes in
// postgres/peerbench, the measured figures, and the tests of this
// repository's documents). Then it builds and vets each module where it
// copied it, and writes KIT.md there: the version copied, and what the
// team now owns.
//
// It refuses, writing nothing, a module path that is not one, and an -into
// that exists and is not empty: a copy is made once, then owned.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
)

// Source is the module path prefix of this repository's modules.
const Source = "example.com/patterns/enterprise/outbox/"

// Modules are the product modules the kit copies, each a folder of the
// repository with a go.mod of its own, in the order they build on one
// another.
var Modules = []string{"postgres", "natsbroker", "rabbitbroker", "kafkabroker", "outbox-relay"}

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

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kit:", err)
		os.Exit(1)
	}
}

// run parses args and copies.
func run(args []string, out io.Writer) error {
	flags := flag.NewFlagSet("kit", flag.ContinueOnError)
	module := flags.String("module", "", "the team's module path the copies go under, such as example.org/team/outbox")
	into := flags.String("into", "", "the folder to copy into: new, or empty")
	from := flags.String("from", "..", "this repository's root")
	check := flags.Bool("check", true, "build and vet each module once copied")
	if err := flags.Parse(args); err != nil {
		return err
	}
	if err := Copy(*from, *into, *module); err != nil {
		return err
	}
	fmt.Fprintf(out, "copied %s into %s under %s\n", strings.Join(Modules, ", "), *into, *module)
	if *check {
		for _, m := range Modules {
			dir := filepath.Join(*into, m)
			for _, args := range [][]string{{"build", "./..."}, {"vet", "./..."}} {
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

// ErrRefused is wrapped by Copy's error for what it refuses before writing
// anything.
var ErrRefused = errors.New("kit: refused")

// Copy copies the product modules of the repository at from into into,
// under module, every mention of a module of the repository rewritten, and
// writes KIT.md there. It refuses, with an error wrapping ErrRefused and
// writing nothing, a module that is not a module path, a from that holds
// no product module, and an into that exists and is not empty.
func Copy(from, into, module string) error {
	if !modulePath.MatchString(module) || strings.HasSuffix(module, "/") {
		return fmt.Errorf("%w: -module %q is not a module path such as example.org/team/outbox", ErrRefused, module)
	}
	if into == "" {
		return fmt.Errorf("%w: -into is not set", ErrRefused)
	}
	if entries, err := os.ReadDir(into); err == nil && len(entries) > 0 {
		return fmt.Errorf("%w: -into %s is not empty: a copy is made once, into a folder of its own", ErrRefused, into)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: -into %s: %w", ErrRefused, into, err)
	}
	for _, m := range Modules {
		if _, err := os.Stat(filepath.Join(from, m, "go.mod")); err != nil {
			return fmt.Errorf("%w: -from %s holds no module %s: %w", ErrRefused, from, m, err)
		}
	}
	version, err := readVersion(from)
	if err != nil {
		return err
	}
	for _, m := range Modules {
		if err := copyModule(from, into, m, module); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(into, "KIT.md"), []byte(kitNote(version, module)), 0o644)
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

// readVersion is the version the postgres module reports.
func readVersion(from string) (string, error) {
	b, err := os.ReadFile(filepath.Join(from, "postgres", "version.go"))
	if err != nil {
		return "", fmt.Errorf("%w: the version: %w", ErrRefused, err)
	}
	m := regexp.MustCompile(`const Version = "([^"]+)"`).FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("%w: postgres/version.go names no Version", ErrRefused)
	}
	return string(m[1]), nil
}

// kitNote is KIT.md: what was copied, and what the team owns.
func kitNote(version, module string) string {
	return fmt.Sprintf(`# The outbox, copied by the kit

Version %[1]s of the outbox's product modules (postgres/CHANGELOG.md), copied under %[2]s:
%[3]s. Each module reports it (`+"`postgres.Version`, `natsbroker.Version`, `rabbitbroker.Version`, `outbox-relay version`"+`).

What you own from here on: the code, its tests (in each module's folder,
../postgres/with-server.sh go test ./... runs them on a throwaway PostgreSQL), the documents, and the schema: the numbered migrations in postgres/migrations/ and
postgres/migrations/consumer/, which your databases record by number. Keep those numbers: a
migration released is never changed or renumbered; a change of yours is a migration after the
last. Taking a later version is a copy of its own, compared with yours by hand.
`, version, module, strings.Join(Modules, ", "))
}
