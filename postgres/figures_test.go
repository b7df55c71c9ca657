package postgres_test

// Every measured figure in the repository's documents is printed by the make
// target named beside it. A figure is quoted inside a block
//
//	<!-- figures: make TARGET -->
//	...
//	<!-- /figures -->
//
// and each number in the block, as written (thousands separators aside),
// must be one that TARGET printed into its files under figures/ (its output
// and benchstat's comparisons), and the block must name the machine those
// files say they ran on. Outside such blocks no number may carry a unit of
// measurement (µs, ns/op, msg/s, buffers, %, ×): a figure no target prints
// fails here. Durations in ms and s are settings and test bounds all
// through the documents, so they are checked only inside blocks. Run again,
// a target rewrites its files; the blocks are then brought up to date by
// hand, and this test says where they are not.

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// documents are the repository's documents, from this folder.
var documents = []string{"../README.md", "README.md", "ADOPTING.md", "REFERENCE.md", "minimum/README.md", "ladder/README.md", "../natsbroker/README.md", "../natsbroker/REFERENCE.md", "../rabbitbroker/README.md", "../kafkabroker/README.md", "../shop/README.md", "../outbox-relay/README.md"}

// targets are the files each make target writes.
var targets = map[string][]string{
	"measure-postgres":     {"figures/measure-postgres.txt"},
	"measure-relays":       {"figures/measure-relays.txt", "figures/measure-relays.stat.txt"},
	"failover":             {"figures/failover.txt"},
	"soak-log-relay":       {"figures/soak-log-relay.txt"},
	"measure-hot":          {"figures/measure-hot.txt", "figures/measure-hot.stat.txt"},
	"measure-watermill":    {"figures/measure-watermill.txt", "figures/measure-watermill.stat.txt"},
	"bench-postgres":       {"figures/bench-postgres.txt", "figures/bench-postgres.stat.txt"},
	"measure-write":        {"figures/measure-write.txt", "figures/measure-write.stat.txt"},
	"measure-natsbroker":   {"../natsbroker/figures/measure-natsbroker.txt", "../natsbroker/figures/measure-natsbroker.stat.txt"},
	"knee":                 {"../natsbroker/figures/knee.txt", "../kafkabroker/figures/knee.txt"},
	"measure-kafkabroker":  {"../kafkabroker/figures/measure-kafkabroker.txt"},
	"measure-rabbitbroker": {"../rabbitbroker/figures/measure-rabbitbroker.txt", "../rabbitbroker/figures/measure-rabbitbroker.stat.txt"},
}

var (
	blockRE  = regexp.MustCompile(`(?s)<!-- figures: make ([a-z-]+) -->(.*?)<!-- /figures -->`)
	codeRE   = regexp.MustCompile("`[^`\n]*`|\\]\\([^)]*\\)")                 // code spans and link targets
	numberRE = regexp.MustCompile(`(?:^|[^0-9A-Za-z_.])(\d[\d,]*(?:\.\d+)?)`) // not in a word: p50 is no figure
	unitRE   = regexp.MustCompile(`\b\d[\d,]*(?:\.\d+)?\s?(?:µs|ns/op|B/op|allocs/op|msgs?/s|messages a second|buffers|%|×)`)
	cpuRE    = regexp.MustCompile(`(?m)^cpu: (.+)$`)
)

func TestEveryFigureIsPrintedByTheTargetBesideIt(t *testing.T) {
	printed := map[string]map[string]bool{} // target -> numbers it printed
	machine := map[string]string{}
	for target, files := range targets {
		printed[target] = map[string]bool{}
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatalf("make %s: %v", target, err)
			}
			for _, n := range numbers(string(b)) {
				printed[target][n] = true
			}
			if m := cpuRE.FindStringSubmatch(string(b)); m != nil {
				machine[target] = strings.TrimSpace(m[1])
			}
		}
		if machine[target] == "" {
			t.Errorf("make %s: its files name no cpu", target)
		}
	}
	blocks := 0
	for _, doc := range documents {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		for _, m := range blockRE.FindAllStringSubmatch(text, -1) {
			blocks++
			target, block := m[1], m[2]
			if printed[target] == nil {
				t.Errorf("%s: a figures block names make %s, which prints no figures", doc, target)
				continue
			}
			if !strings.Contains(block, machine[target]) {
				t.Errorf("%s: the block of make %s does not name the machine it ran on (%q)", doc, target, machine[target])
			}
			for _, n := range numbers(codeRE.ReplaceAllString(block, " ")) {
				if !printed[target][n] {
					t.Errorf("%s: %s is in the block of make %s, which did not print it", doc, n, target)
				}
			}
		}
		outside := codeRE.ReplaceAllString(blockRE.ReplaceAllString(text, " "), " ")
		for _, f := range unitRE.FindAllString(outside, -1) {
			t.Errorf("%s: the figure %q is outside any figures block: no target is named beside it", doc, f)
		}
	}
	if blocks == 0 {
		t.Error("no figures block in any document")
	}
	t.Logf("%d figures blocks in %d documents checked against %d targets", blocks, len(documents), len(targets))
}

// numbers are the numbers in text, without thousands separators.
func numbers(text string) []string {
	var ns []string
	for _, m := range numberRE.FindAllStringSubmatch(text, -1) {
		ns = append(ns, strings.ReplaceAll(strings.TrimRight(m[1], ","), ",", ""))
	}
	return ns
}

var quotedRE = regexp.MustCompile("(?s)(<!-- quoted from ([^ ]+) -->\n)?```sql\n(.*?)```")

// The README quotes the schema only through a block marked with the file it
// comes from, and such a block is a run of that file's lines, as they are:
// copying it gives what Migrate creates. A block that creates a table
// without the mark is a schema copied by hand.
func TestReadmeQuotesTheSchemaAsItIs(t *testing.T) {
	quoted := 0
	for _, doc := range []string{"README.md", "REFERENCE.md"} {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range quotedRE.FindAllStringSubmatch(string(b), -1) {
			file, block := m[2], m[3]
			if file == "" {
				if strings.Contains(block, "CREATE TABLE") {
					t.Errorf("%s: a block creates a table and names no file it is quoted from:\n%s", doc, block)
				}
				continue
			}
			quoted++
			src, err := os.ReadFile(file)
			if err != nil {
				t.Errorf("%s: %v", doc, err)
				continue
			}
			if !strings.Contains("\n"+string(src), "\n"+block) {
				t.Errorf("%s: the block quoted from %s is not a run of its lines:\n%s", doc, file, block)
			}
		}
	}
	if quoted == 0 {
		t.Error("README.md quotes no schema")
	}
}
