package lessoncheck_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// breakIt is a row of the root README's "Break it yourself" table as an
// edit: in file, old becomes new (each once); drop is an import line
// removed too.
type breakIt struct {
	file, old, new, drop string
}

// The rows of the table, in its order, as edits a reader makes by hand.
var breakIts = []breakIt{
	{"outbox.go",
		"\t\tif err := r.broker.Publish(msg); err != nil {\n\t\t\treturn published, fmt.Errorf(\"publish message %d: %w\", msg.ID, err)\n\t\t}\n\t\tr.db.MarkSent(msg.ID)\n",
		"\t\tr.db.MarkSent(msg.ID)\n\t\tif err := r.broker.Publish(msg); err != nil {\n\t\t\treturn published, fmt.Errorf(\"publish message %d: %w\", msg.ID, err)\n\t\t}\n", ""},
	{"outbox.go",
		"\t\t\treturn published, fmt.Errorf(\"publish message %d: %w\", msg.ID, err)\n",
		"\t\t\tcontinue\n", "\t\"fmt\"\n"},
	{"database.go", "committed := false", "committed := true", ""},
}

// Each row of the root README's "Break it yourself" table, made as the
// row says in a copy of the root package: go test fails, the first
// failure it prints is the test the row names, and its first line is the
// row's. (Caught: a row whose named test came after nine others, and one
// whose run waited 40 s for deadlines.)
func TestBreakItRowsFailAsTheReadmeSays(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(readme), "## Break it yourself")
	table, _, _ = strings.Cut(table, "\n## ")
	rows := regexp.MustCompile("(?m)^\\| .* \\| `(Test\\w+)` \\| `(.*)` \\|$").FindAllStringSubmatch(table, -1)
	if !ok || len(rows) != len(breakIts) {
		t.Fatalf("the README's table has %d rows; this test knows %d", len(rows), len(breakIts))
	}
	for i, row := range rows {
		named, firstLine := row[1], row[2]
		dir := t.TempDir()
		files, err := filepath.Glob("../*.go")
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range append(files, "../go.mod") {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			if filepath.Base(f) == breakIts[i].file {
				src := string(b)
				if strings.Count(src, breakIts[i].old) != 1 || breakIts[i].drop != "" && strings.Count(src, breakIts[i].drop) != 1 {
					t.Fatalf("row %d: %s no longer holds what the row changes", i+1, breakIts[i].file)
				}
				src = strings.Replace(src, breakIts[i].old, breakIts[i].new, 1)
				if breakIts[i].drop != "" {
					src = strings.Replace(src, breakIts[i].drop, "", 1)
				}
				b = []byte(src)
			}
			if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		cmd := exec.Command("go", "test", "-count=1", ".")
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
		out, err := cmd.CombinedOutput()
		if err == nil {
			t.Errorf("row %d: go test passed with the change made", i+1)
			continue
		}
		m := regexp.MustCompile(`(?m)^--- FAIL: (\w+) .*\n\s+\S+\.go:\d+: (.*)$`).FindSubmatch(out)
		switch {
		case m == nil:
			t.Errorf("row %d: go test printed no failure:\n%s", i+1, out)
		case string(m[1]) != named || string(m[2]) != firstLine:
			t.Errorf("row %d: the first failure is %s: %s; the README names %s: %s", i+1, m[1], m[2], named, firstLine)
		default:
			t.Logf("row %d: %s first, %q", i+1, m[1], m[2])
		}
	}
}

// The README states the cost of stopping at the first failure,
// head-of-line blocking, beside the crash table, with the test that shows
// it, which exists. (Caught: the lesson said "stop at the first failure"
// and nothing of what it costs.)
func TestReadmeStatesHeadOfLineBlockingBesideTheCrashTable(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(readme), "## The crash table")
	section, _, _ = strings.Cut(section, "\n## ")
	const test = "TestMessageRefusedForEverBlocksEveryLaterMessage"
	if !strings.Contains(section, "**Head-of-line blocking.**") || !strings.Contains(section, test) {
		t.Errorf("the crash table's section does not state head-of-line blocking with %s", test)
	}
	src, err := os.ReadFile("../outbox_test.go")
	if err != nil || !strings.Contains(string(src), "func "+test+"(") {
		t.Errorf("outbox_test.go has no %s (%v)", test, err)
	}
}

// The learner's fourth step answers "what changes on a real database"
// beside postgres/minimum: its README holds the trap and the table of what
// each part of the lesson becomes, and minimum.go says in its own comments
// what it leaves out. (Caught: both sat in the middle of a 779-line
// REFERENCE.md no step linked to, and the minimum claimed id order.)
func TestLearnersStepFourAnswersWhatChangesOnARealDatabase(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, step, _ := strings.Cut(string(readme), "4. **The same on a real PostgreSQL.**")
	step, _, _ = strings.Cut(step, "\n5. ")
	if !strings.Contains(step, "(postgres/minimum/README.md#what-changes-on-a-real-database)") {
		t.Errorf("step 4 does not link what changes on a real database:\n%s", step)
	}
	beside, err := os.ReadFile("../postgres/minimum/README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"## What changes on a real database", "## The trap", "## From the teaching package to this one"} {
		if !strings.Contains(string(beside), want+"\n") {
			t.Errorf("postgres/minimum/README.md has no %q", want)
		}
	}
	src, err := os.ReadFile("../postgres/minimum/minimum.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"What it leaves out", "7 then goes at the next", "never deletes what it sent"} {
		if !strings.Contains(string(src), want) {
			t.Errorf("minimum.go does not say %q", want)
		}
	}
}

// The learner's fifth step gives the shop's session as the shop's README
// prints it: every command of the step is a line of that session, in its
// order. (Caught: two different curl sessions for one demo.)
func TestStepFiveIsTheShopsSession(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, step, _ := strings.Cut(string(readme), "5. **A shop to curl.**")
	step, _, _ = strings.Cut(step, "\n\n")
	shop, err := os.ReadFile("../shop/README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, session, _ := strings.Cut(string(shop), "```console\n")
	session, _, _ = strings.Cut(session, "```")
	var lines []string
	for line := range strings.SplitSeq(session, "\n") {
		if cmd, ok := strings.CutPrefix(line, "$ "); ok {
			lines = append(lines, cmd)
		}
	}
	commands := regexp.MustCompile("`(curl [^`]*localhost[^`]*)`").FindAllStringSubmatch(strings.ReplaceAll(step, "\n   ", " "), -1)
	if len(commands) != len(lines) {
		t.Fatalf("step 5 gives %d commands, the shop's session %d:\nstep: %q\nsession: %q", len(commands), len(lines), commands, lines)
	}
	for i, c := range commands {
		if c[1] != lines[i] {
			t.Errorf("step 5's command %d is %q; the shop's session has %q", i+1, c[1], lines[i])
		}
	}
}

// The adopter's page, which the lesson's next steps link, says what
// changes on MySQL and on Kafka. (Caught: neither appeared in any
// document, and a team had to guess.)
func TestAdoptersPageSaysWhatChangesOnMySQLAndKafka(t *testing.T) {
	page, err := os.ReadFile("../postgres/ADOPTING.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(page), "\n## 6. On MySQL or Kafka: what changes\n")
	for _, want := range []string{"**MySQL (InnoDB) in place of PostgreSQL.**", "**Kafka in place of JetStream or RabbitMQ.**", "SKIP LOCKED", "acks=all"} {
		if !ok || !strings.Contains(section, want) {
			t.Errorf("ADOPTING.md's MySQL and Kafka section does not say %q", want)
		}
	}
	readme, err := os.ReadFile("../README.md")
	if err != nil || !strings.Contains(string(readme), "(postgres/ADOPTING.md)") {
		t.Errorf("the README does not link the adopter's page (%v)", err)
	}
}
