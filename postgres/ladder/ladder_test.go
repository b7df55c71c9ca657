package ladder_test

import (
	"cmp"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// TestMain has pgtest find or start the server, and set
// OUTBOX_POSTGRES_URL for the rungs' own go test runs.
func TestMain(m *testing.M) { pgtest.Main(m) }

// maxChanged is the most lines a rung's diff may change: a rung reads in a
// few minutes.
const maxChanged = 60

// rung is one step of the ladder: its number, its name, its diff on the
// rung before and the file of its test.
type rung struct {
	n           int
	name, patch string
	test        string
}

// rungs are the ladder's rungs, from testdata, in order.
func rungs(t *testing.T) []rung {
	t.Helper()
	patches, err := filepath.Glob("testdata/*.patch")
	if err != nil {
		t.Fatal(err)
	}
	var rs []rung
	for _, p := range patches {
		base := strings.TrimSuffix(filepath.Base(p), ".patch")
		num, name, _ := strings.Cut(base, "-")
		n, err := strconv.Atoi(num)
		if err != nil {
			t.Fatalf("%s: a rung's file is N-name.patch", p)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		rs = append(rs, rung{n: n, name: name, patch: string(b), test: filepath.Join("testdata", base+"_test.go")})
	}
	slices.SortFunc(rs, func(a, b rung) int { return cmp.Compare(a.n, b.n) })
	for i, r := range rs {
		if r.n != i+1 {
			t.Fatalf("rung %d follows rung %d: the rungs are numbered from 1, with no gap", r.n, i)
		}
	}
	return rs
}

// Each rung is a diff of at most maxChanged lines that applies to the rung
// before (rung 0 is ../minimum/minimum.go); with it, its test and those of
// the rungs below pass; on the rung below, its test fails (an assertion,
// or a build where the rung adds what the test calls). Run with -v, it
// prints each rung's diff, and how its test fails below it.
func TestLadder(t *testing.T) {
	base, err := os.ReadFile("../minimum/minimum.go")
	if err != nil {
		t.Fatal(err)
	}
	code, tests := string(base), []string{"testdata/helpers_test.go"}
	for _, r := range rungs(t) {
		next, err := applyPatch(code, r.patch)
		if err != nil {
			t.Fatalf("rung %d (%s) does not apply to rung %d: %v", r.n, r.name, r.n-1, err)
		}
		below := code
		with := append(slices.Clone(tests), r.test)
		t.Run(fmt.Sprintf("%d-%s", r.n, r.name), func(t *testing.T) {
			if n := changed(r.patch); n > maxChanged {
				t.Errorf("the diff changes %d lines; a rung changes at most %d", n, maxChanged)
			}
			t.Logf("rung %d, %s, its diff on rung %d:\n%s", r.n, r.name, r.n-1, r.patch)
			if out, err := goTest(t, next, with); err != nil {
				t.Errorf("on rung %d, its tests and those below fail: %v\n%s", r.n, err, out)
			}
			out, err := goTest(t, below, with)
			if err == nil {
				t.Errorf("on rung %d, rung %d's test passes: it shows nothing the rung prevents", r.n-1, r.n)
			}
			t.Logf("on rung %d, rung %d's test fails: %s", r.n-1, r.n, firstFailure(out))
		})
		code, tests = next, with
	}
}

// changed is how many lines a unified diff adds or removes.
func changed(patch string) int {
	n := 0
	for _, l := range strings.Split(patch, "\n") {
		if (strings.HasPrefix(l, "+") || strings.HasPrefix(l, "-")) && !strings.HasPrefix(l, "+++") && !strings.HasPrefix(l, "---") {
			n++
		}
	}
	return n
}

var hunkRE = regexp.MustCompile(`^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@`)

// applyPatch applies a unified diff of one file to code, checking that
// every line it keeps or removes is there.
func applyPatch(code, patch string) (string, error) {
	old := strings.Split(code, "\n")
	var out []string
	at := 0 // the next line of old to copy
	lines := strings.Split(strings.TrimSuffix(patch, "\n"), "\n")
	for i := 0; i < len(lines); i++ {
		m := hunkRE.FindStringSubmatch(lines[i])
		if m == nil {
			continue
		}
		start, _ := strconv.Atoi(m[1])
		if m[2] == "0" {
			start++ // an empty old side counts from the line before
		}
		for ; at < start-1; at++ {
			out = append(out, old[at])
		}
		for i++; i < len(lines) && !strings.HasPrefix(lines[i], "@@"); i++ {
			l := lines[i]
			switch {
			case strings.HasPrefix(l, "+"):
				out = append(out, l[1:])
			case strings.HasPrefix(l, "-"), strings.HasPrefix(l, " "), l == "":
				text := ""
				if l != "" {
					text = l[1:]
				}
				if at >= len(old) || old[at] != text {
					return "", fmt.Errorf("line %d is %q; the diff expects %q", at+1, line(old, at), text)
				}
				if !strings.HasPrefix(l, "-") {
					out = append(out, old[at])
				}
				at++
			}
			// Any other line ("\ No newline at end of file") changes nothing.
		}
		i--
	}
	out = append(out, old[at:]...)
	return strings.Join(out, "\n"), nil
}

func line(lines []string, i int) string {
	if i < len(lines) {
		return lines[i]
	}
	return "(the end)"
}

// goTest runs go test on a package of code as minimum.go and the test
// files tests, in a folder of its own in this module (its name begins
// with "_", so ./... never sees it), removed after.
func goTest(t *testing.T, code string, tests []string) (string, error) {
	t.Helper()
	if err := os.MkdirAll("_build", 0o755); err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("_build", "rung")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.WriteFile(filepath.Join(dir, "minimum.go"), []byte(code), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, f := range tests {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("go", "test", "-count=1", ".")
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// firstFailure is the first line of go test's output that says why it
// failed.
func firstFailure(out string) string {
	for _, l := range strings.Split(out, "\n") {
		l = strings.TrimSpace(l)
		if strings.Contains(l, "_test.go:") || strings.Contains(l, "undefined") {
			return l
		}
	}
	return strings.TrimSpace(out)
}
