package postgres_test

import (
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Every test the documents name exists, and every test their tables name exists in the file the table
// links beside it where it links one: a table row's first cell names its
// tests, and a link to a _test.go file in it says where the tests named
// before the link live. (Caught: tests said to be in outbox_test.go that
// lived in loop_test.go, names_test.go and migrate_test.go, and names of
// tests that had been renamed.)
func TestEveryTestTheDocumentsNameExistsWhereTheySay(t *testing.T) {
	defined := map[string][]string{} // test name -> the files, from the repository's top, that define it
	testFunc := regexp.MustCompile(`(?m)^func (Test\w+)\(`)
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata" && !strings.HasSuffix(path, "ladder/testdata")) {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range testFunc.FindAllStringSubmatch(string(b), -1) {
			abs, err := filepath.Abs(path)
			if err != nil {
				return err
			}
			defined[m[1]] = append(defined[m[1]], abs)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	docs := []string{"../README.md", "README.md", "ADOPTING.md", "REFERENCE.md", "minimum/README.md", "ladder/README.md", "../kit/README.md", "../natsbroker/README.md", "../natsbroker/REFERENCE.md",
		"../rabbitbroker/README.md", "../kafkabroker/README.md", "../shop/README.md", "../outbox-relay/README.md"}
	named := regexp.MustCompile("`(Test[A-Z]\\w*)`")
	anyNamed := regexp.MustCompile("`(Test[A-Z]\\w*)(…?)[^`]*`")
	link := regexp.MustCompile(`\]\(([^)]*)\)`)
	checked := 0
	for _, doc := range docs {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		dir := filepath.Dir(doc)
		// Anywhere in the document, a test named in code, whole or cut
		// short with an ellipsis, is one a test file defines.
		for _, m := range anyNamed.FindAllStringSubmatch(string(b), -1) {
			checked++
			if m[2] == "" && len(defined[m[1]]) == 0 {
				t.Errorf("%s names %s, which no test file defines", doc, m[1])
			}
			if m[2] != "" && !slices.ContainsFunc(slices.Collect(maps.Keys(defined)), func(n string) bool { return strings.HasPrefix(n, m[1]) }) {
				t.Errorf("%s names %s…, and no test's name starts so", doc, m[1])
			}
		}
		var tableFiles []string // a table under a paragraph that ends "in [x_test.go](x_test.go), …:" is those files'
		para := ""              // the paragraph the line is in, or the one before the table
		for line := range strings.SplitSeq(string(b), "\n") {
			switch {
			case strings.TrimSpace(line) == "":
				para = ""
			case !strings.HasPrefix(line, "|"):
				para += " " + strings.TrimSpace(line)
				tableFiles = nil
				if strings.HasSuffix(para, ":") {
					for _, m := range link.FindAllStringSubmatch(para, -1) {
						if strings.HasSuffix(m[1], "_test.go") {
							abs, err := filepath.Abs(filepath.Join(dir, m[1]))
							if err != nil {
								t.Fatal(err)
							}
							tableFiles = append(tableFiles, abs)
						}
					}
				}
			}
			if !strings.HasPrefix(line, "| `Test") {
				continue
			}
			cell := strings.Split(line, "|")[1]
			pending := []string{} // the tests named since the last link
			for _, tok := range regexp.MustCompile("`Test[A-Z]\\w*`|\\]\\([^)]*\\)").FindAllString(cell, -1) {
				if m := named.FindStringSubmatch(tok); m != nil {
					checked++
					if len(defined[m[1]]) == 0 {
						t.Errorf("%s names %s, which no test file defines", doc, m[1])
					}
					pending = append(pending, m[1])
					continue
				}
				target := link.FindStringSubmatch(tok)[1]
				file, err := filepath.Abs(filepath.Join(dir, target))
				if err != nil {
					t.Fatal(err)
				}
				for _, name := range pending {
					if !strings.HasSuffix(target, "_test.go") {
						break // a link to a folder or a page says nothing of a file
					}
					if len(defined[name]) > 0 && !contains(defined[name], file) {
						t.Errorf("%s says %s is in %s; it is in %s", doc, name, file, strings.Join(defined[name], ", "))
					}
				}
				pending = pending[:0]
			}
			if len(tableFiles) > 0 {
				for _, name := range pending {
					in := false
					for _, f := range tableFiles {
						in = in || contains(defined[name], f)
					}
					if len(defined[name]) > 0 && !in {
						t.Errorf("%s says %s is in one of %s, the files its table is under; it is in %s",
							doc, name, strings.Join(tableFiles, ", "), strings.Join(defined[name], ", "))
					}
				}
			}
		}
	}
	t.Logf("%d test names in %d documents checked against %d tests", checked, len(docs), len(defined))
}

func contains(files []string, f string) bool {
	for _, g := range files {
		if g == f {
			return true
		}
	}
	return false
}

// No tracked file over 100 KB is junk: each is a figures file a make target
// wrote, or a picture a document of the repository shows. (Caught: a
// RabbitMQ crash dump of 295 KB committed beside the shop.)
func TestNoTrackedFileIsJunk(t *testing.T) {
	const limit = 100 << 10
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		t.Fatalf("git rev-parse: %v (the test reads the repository's tracked files)", err)
	}
	root := strings.TrimSpace(string(top))
	out, err := exec.Command("git", "-C", root, "ls-files", "-z").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	shown := map[string]bool{} // pictures the documents show, from the top
	image := regexp.MustCompile(`!\[[^\]]*\]\(([^)]+)\)`)
	files := strings.Split(strings.TrimRight(string(out), "\x00"), "\x00")
	for _, f := range files {
		if !strings.HasSuffix(f, ".md") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range image.FindAllStringSubmatch(string(b), -1) {
			shown[filepath.Join(filepath.Dir(f), m[1])] = true
		}
	}
	big := 0
	for _, f := range files {
		info, err := os.Stat(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		if info.Size() <= limit {
			continue
		}
		big++
		if !strings.Contains("/"+f, "/figures/") && !shown[f] {
			t.Errorf("%s is %d KB, neither a figures file nor a picture a document shows: junk?", f, info.Size()>>10)
		}
	}
	t.Logf("%d tracked files, %d over 100 KB, %d pictures shown", len(files), big, len(shown))
}

// Every link from one of the documents to a file of the repository leads
// to a file that is there, and a link to a place in a Markdown file
// (file.md#place) to a heading of that file, as GitHub names it (lower
// case, spaces as hyphens, other punctuation dropped), or to an
// <a id="place"> in it.
func TestEveryLinkBetweenTheDocumentsLeadsSomewhere(t *testing.T) {
	linkRE := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	anchors := map[string]map[string]bool{}
	anchorsOf := func(file string) map[string]bool {
		if a, ok := anchors[file]; ok {
			return a
		}
		a := map[string]bool{}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		inFence := false
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "```") {
				inFence = !inFence
			}
			if inFence {
				continue
			}
			if h, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " "); ok && strings.HasPrefix(line, "#") {
				a[slug(h)] = true
			}
			for _, m := range regexp.MustCompile(`<a id="([^"]+)"`).FindAllStringSubmatch(line, -1) {
				a[m[1]] = true
			}
		}
		anchors[file] = a
		return a
	}
	for _, doc := range documents {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range linkRE.FindAllStringSubmatch(string(b), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, place, _ := strings.Cut(target, "#")
			file := doc
			if path != "" {
				file = filepath.Join(filepath.Dir(doc), path)
				if _, err := os.Stat(file); err != nil {
					t.Errorf("%s links to %s, which is not there", doc, target)
					continue
				}
			}
			if place != "" && strings.HasSuffix(file, ".md") && !anchorsOf(file)[place] {
				t.Errorf("%s links to %s: %s has no heading or anchor %q", doc, target, file, place)
			}
		}
	}
}

// slug is a heading's anchor as GitHub makes it.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// The README's one relay pass and its partial index say what the code
// does: the pass's WHERE is the claim's (ClaimQuery), its batch the
// default's, and the index the one the latest migration that makes
// outbox_unsent makes. (Caught: both predated migration 7, so a claim
// copied as printed missed the index and took scheduled rows before their
// time.)
func TestReadmesOnePassIsTheClaimAndItsIndex(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	space := regexp.MustCompile(`\s+`)
	flat := func(s string) string { return strings.TrimSpace(space.ReplaceAllString(s, " ")) }
	where := regexp.MustCompile(`(?m)^WHERE (sent_at IS NULL[^\n]*)$`).FindStringSubmatch(postgres.ClaimQuery)
	if where == nil {
		t.Fatalf("the claim has no WHERE sent_at IS NULL line:\n%s", postgres.ClaimQuery)
	}
	_, pass, _ := strings.Cut(string(readme), "**3. One relay pass**")
	_, pass, _ = strings.Cut(pass, "```sql\n")
	pass, _, _ = strings.Cut(pass, "```")
	if want := "WHERE " + flat(where[1]) + " ORDER BY id LIMIT " + strconv.Itoa(postgres.DefaultBatchSize); !strings.Contains(flat(pass), want) {
		t.Errorf("README's one pass does not say %q:\n%s", want, pass)
	}
	files, err := filepath.Glob("migrations/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(files)
	var index string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if m := regexp.MustCompile(`(?s)CREATE INDEX (?:IF NOT EXISTS )?(outbox_unsent ON outbox \(id\)\s+WHERE [^;]*);`).FindSubmatch(b); m != nil {
			index = flat(string(m[1]))
		}
	}
	if index == "" || !strings.Contains(flat(string(readme)), "`"+index+"`") {
		t.Errorf("README does not name the index as the migrations make it: `%s`", index)
	}
}

// The README's diagram of the pattern names what the code has: each
// Name( in it is a function or method of the root package.
func TestReadmesDiagramNamesWhatTheCodeHas(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, diagram, _ := strings.Cut(string(readme), "```mermaid\n")
	diagram, _, ok := strings.Cut(diagram, "```")
	if !ok {
		t.Fatal("README.md has no mermaid block")
	}
	files, err := filepath.Glob("../*.go")
	if err != nil {
		t.Fatal(err)
	}
	var code strings.Builder
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		code.Write(b)
	}
	names := regexp.MustCompile(`\b([A-Z]\w*)\(`).FindAllStringSubmatch(diagram, -1)
	for _, m := range names {
		if !regexp.MustCompile(`func (\([^)]*\) )?` + m[1] + `\(`).MatchString(code.String()) {
			t.Errorf("README.md's diagram names %s(, which the root package does not define", m[1])
		}
	}
	if len(names) < 5 {
		t.Errorf("the diagram names %d calls; want the pattern's", len(names))
	}
}

// ADOPTING.md's go.mod lines name modules of this repository, each
// replaced by its own folder.
func TestAdoptingsRequireLinesNameTheModules(t *testing.T) {
	page, err := os.ReadFile("ADOPTING.md")
	if err != nil {
		t.Fatal(err)
	}
	lines := regexp.MustCompile(`(?m)^(require|replace) (\S+)(?: v0\.0\.0| => \.\./outbox/(\S+))$`).FindAllStringSubmatch(string(page), -1)
	if len(lines) < 4 {
		t.Fatalf("ADOPTING.md has %d require and replace lines; want two of each", len(lines))
	}
	for _, m := range lines {
		folder := strings.TrimPrefix(m[2], "example.com/patterns/enterprise/outbox/")
		mod, err := os.ReadFile(filepath.Join("..", folder, "go.mod"))
		if err != nil || !strings.HasPrefix(string(mod), "module "+m[2]+"\n") {
			t.Errorf("ADOPTING.md names module %s: no folder %s holds it", m[2], folder)
		}
		if m[1] == "replace" && m[3] != folder {
			t.Errorf("ADOPTING.md replaces %s with ../outbox/%s; want ../outbox/%s", m[2], m[3], folder)
		}
	}
}
