package postgres_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// blockDocs are the documents whose fenced blocks TestEveryBlockIsCheckedAgainstTheCode reads.
var blockDocs = append(append([]string{}, documents...), "../kit/README.md")

// markerTests are the tests behind the markers that other tests read: a
// block so marked is theirs to check.
var markerTests = map[string][]string{
	"<!-- quoted from ":  {"TestReadmeQuotesTheSchemaAsItIs"},
	"<!-- block: builds": {"TestReadmeBlockBuilds"},
	"<!-- env: ":         {"TestRelayProcessToATLSOnlyJetStream", "TestRelayProcessToRabbitMQOverAMQPS"},
	"<!-- grants: ":      {"TestReadmeGrantsBlockIsWhatGrantsPrints"},
	"<!-- walkthrough: ": {"TestLeastPrivilegeWalkthrough"},
}

// Every fenced block of the documents is made from the code or checked
// against it, so that a change that moves the code fails a test, not a
// reader. The line before a block says how, in an HTML comment at its end,
// or the block is of a kind this test checks itself:
//   - <!-- quoted from F -->, <!-- block: builds -->, <!-- env: … -->,
//     <!-- grants: … -->, <!-- walkthrough: … -->: the tests of markerTests
//     read those blocks;
//   - <!-- checked: TestA, TestB -->: each test exists, and its file reads
//     the document (names its file);
//   - <!-- output of F ExampleName -->: the block is the example's
//     // Output:, as go test checks it;
//   - <!-- log of F -->: each line "f.go:N: text" is what the t.Log at line
//     N of F prints;
//   - a block inside a figures block: each of its lines is in what the
//     block's make target printed;
//   - a shell block of make, outbox-relay or kit commands: each target,
//     variable, command and flag exists.
func TestEveryBlockIsCheckedAgainstTheCode(t *testing.T) {
	tests := definedTests(t)
	makefile := readFile(t, "../Makefile")
	relaySource := nonTestSources(t, "../outbox-relay")
	kitSource := nonTestSources(t, "../kit")
	checked := 0
	for _, doc := range blockDocs {
		lines := strings.Split(readFile(t, doc), "\n")
		inFigures := ""
		for i := 0; i < len(lines); i++ {
			if m := blockRE.FindStringSubmatch(lines[i] + "<!-- /figures -->"); m != nil && strings.HasPrefix(lines[i], "<!-- figures: make ") {
				inFigures = m[1]
			}
			if strings.HasPrefix(lines[i], "<!-- /figures -->") {
				inFigures = ""
			}
			if !strings.HasPrefix(lines[i], "```") {
				continue
			}
			lang := strings.TrimPrefix(lines[i], "```")
			start := i
			var block []string
			for i++; i < len(lines) && !strings.HasPrefix(lines[i], "```"); i++ {
				block = append(block, lines[i])
			}
			marker := "" // the HTML comment that ends the line before the block
			for j := start - 1; j >= 0; j-- {
				if strings.TrimSpace(lines[j]) != "" {
					if m := endingComment.FindString(strings.TrimSpace(lines[j])); m != "" {
						marker = m
					}
					break
				}
			}
			where := doc + ":" + strconv.Itoa(start+1)
			checked++
			switch {
			case markerOf(marker) != "":
				for _, name := range markerTests[markerOf(marker)] {
					if len(tests[name]) == 0 {
						t.Errorf("%s: its marker's test %s does not exist", where, name)
					}
				}
			case strings.HasPrefix(marker, "<!-- checked: "):
				for _, name := range strings.Split(strings.TrimSuffix(strings.TrimPrefix(marker, "<!-- checked: "), " -->"), ",") {
					name = strings.TrimSpace(name)
					reads := false
					for _, f := range tests[name] {
						reads = reads || strings.Contains(readFile(t, f), filepath.Base(doc))
					}
					if !reads {
						t.Errorf("%s: %s does not exist, or its file does not read %s", where, name, filepath.Base(doc))
					}
				}
			case strings.HasPrefix(marker, "<!-- output of "):
				file, example, _ := strings.Cut(strings.TrimSuffix(strings.TrimPrefix(marker, "<!-- output of "), " -->"), " ")
				if want := exampleOutput(t, "../"+file, example); strings.Join(block, "\n") != want {
					t.Errorf("%s: the block is not %s's output in %s:\n%s\nwant:\n%s", where, example, file, strings.Join(block, "\n"), want)
				}
			case strings.HasPrefix(marker, "<!-- log of "):
				file := "../" + strings.TrimSuffix(strings.TrimPrefix(marker, "<!-- log of "), " -->")
				checkLog(t, where, file, block)
			case inFigures != "":
				var printed strings.Builder
				for _, f := range targets[inFigures] {
					printed.WriteString(readFile(t, f))
				}
				for _, l := range block {
					if l = strings.TrimSpace(l); l != "" && l != "..." && !strings.Contains(printed.String(), l) {
						t.Errorf("%s: %q is not in what make %s printed", where, l, inFigures)
					}
				}
			case lang == "sh":
				checkCommands(t, where, block, makefile, relaySource, kitSource)
			default:
				t.Errorf("%s: a %q block that says nothing of what checks it (see this test's doc)", where, lang)
			}
		}
	}
	t.Logf("%d blocks in %d documents", checked, len(blockDocs))
}

// endingComment is an HTML comment at the end of a line.
var endingComment = regexp.MustCompile(`<!-- [^>]* -->$`)

// markerOf is the key of markerTests that marker begins with, or "".
func markerOf(marker string) string {
	for k := range markerTests {
		if strings.HasPrefix(marker, k) {
			return k
		}
	}
	return ""
}

func readFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// definedTests are the repository's test functions, by name: the files
// that define each.
func definedTests(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	re := regexp.MustCompile(`(?m)^func (Test\w+)\(`)
	err := filepath.WalkDir("..", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || strings.HasPrefix(d.Name(), "_")) {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, "_test.go") {
			for _, m := range re.FindAllStringSubmatch(readFile(t, path), -1) {
				out[m[1]] = append(out[m[1]], path)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// nonTestSources are the non-test Go files of dir, joined.
func nonTestSources(t *testing.T, dir string) string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, f := range files {
		if !strings.HasSuffix(f, "_test.go") {
			b.WriteString(readFile(t, f))
		}
	}
	return b.String()
}

// exampleOutput is the // Output: of example in file, as its lines.
func exampleOutput(t *testing.T, file, example string) string {
	t.Helper()
	src := readFile(t, file)
	_, body, ok := strings.Cut(src, "\nfunc "+example+"() {\n")
	body, _, _ = strings.Cut(body, "\n}\n")
	_, out, found := strings.Cut(body, "// Output:\n")
	if !ok || !found {
		t.Fatalf("%s has no %s with an // Output:", file, example)
	}
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		l = strings.TrimSpace(l)
		if !strings.HasPrefix(l, "//") {
			break
		}
		l = strings.TrimPrefix(l, "//")
		lines = append(lines, strings.TrimPrefix(l, " "))
	}
	return strings.Join(lines, "\n")
}

// checkLog checks that each line "f.go:N: text" of block is what the
// t.Log or t.Logf at line N of file prints: its format, each verb any text.
func checkLog(t *testing.T, where, file string, block []string) {
	t.Helper()
	src := strings.Split(readFile(t, file), "\n")
	lineRE := regexp.MustCompile(`^\s*(\w+\.go):(\d+): (.*)$`)
	formatRE := regexp.MustCompile(`t\.Logf?\("((?:[^"\\]|\\.)*)"`)
	for _, l := range block {
		m := lineRE.FindStringSubmatch(l)
		if m == nil || m[1] != filepath.Base(file) {
			t.Errorf("%s: %q is no line of %s's log", where, l, filepath.Base(file))
			continue
		}
		n, _ := strconv.Atoi(m[2])
		f := formatRE.FindStringSubmatch(lineOf(src, n-1))
		if f == nil {
			t.Errorf("%s: line %d of %s is no t.Log: %q", where, n, file, lineOf(src, n-1))
			continue
		}
		pattern := "^" + regexp.MustCompile(`%[-+# 0-9.]*[a-zA-Z]`).ReplaceAllString(regexp.QuoteMeta(f[1]), ".*") + "$"
		if !regexp.MustCompile(pattern).MatchString(m[3]) {
			t.Errorf("%s: %q is not what line %d of %s prints (%q)", where, m[3], n, file, f[1])
		}
	}
}

func lineOf(lines []string, i int) string {
	if i >= 0 && i < len(lines) {
		return lines[i]
	}
	return ""
}

// checkCommands checks a shell block's commands: make's targets and
// variables, outbox-relay's commands and flags, the kit's flags.
func checkCommands(t *testing.T, where string, block []string, makefile, relay, kit string) {
	t.Helper()
	var commands []string
	for _, l := range block {
		cmd, _, _ := strings.Cut(l, "#")
		commands = append(commands, strings.Split(cmd, ";")...)
	}
	for _, l := range commands {
		fields := strings.Fields(l)
		if len(fields) == 0 {
			continue
		}
		switch {
		case fields[0] == "make":
			for _, f := range fields[1:] {
				f = strings.Trim(f, "[]")
				if name, _, isVar := strings.Cut(f, "="); isVar {
					if !strings.Contains(makefile, name) {
						t.Errorf("%s: make's variable %s is not in the Makefile", where, name)
					}
				} else if f != "" && !regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(f)+`:`).MatchString(makefile) {
					t.Errorf("%s: make %s: no such target", where, f)
				}
			}
		case fields[0] == "outbox-relay" || strings.HasSuffix(fields[0], "=shop_migrator") || strings.HasPrefix(fields[0], "PGUSER="):
			if strings.HasPrefix(fields[0], "PGUSER=") {
				fields = fields[1:]
			}
			if len(fields) < 2 || !strings.Contains(relay, "|"+fields[1]) && !strings.Contains(relay, " "+fields[1]+"|") {
				t.Errorf("%s: %q: outbox-relay has no such command", where, l)
			}
			for _, f := range fields[2:] {
				if name, ok := strings.CutPrefix(f, "-"); ok && !strings.Contains(relay, `"`+strings.SplitN(name, "=", 2)[0]+`"`) {
					t.Errorf("%s: %q: outbox-relay has no flag -%s", where, l, name)
				}
			}
		case fields[0] == "go" && len(fields) > 2 && fields[1] == "-C" && fields[2] == "kit":
			for _, f := range fields[3:] {
				if name, ok := strings.CutPrefix(f, "-"); ok && !strings.Contains(kit, `"`+name+`"`) {
					t.Errorf("%s: the kit has no flag -%s", where, name)
				}
			}
		default:
			t.Errorf("%s: %q: a command this test cannot check; mark the block with what checks it", where, l)
		}
	}
}
