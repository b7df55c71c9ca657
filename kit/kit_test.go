package main

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The kit copies the product modules under a team's module path: nothing
// left naming this repository's modules but the mentions of the lesson,
// KIT.md with the version, each module building and vetting where it was
// copied, and their tests passing there: the roles and their grants, a
// replay inside the duplicate window, the README's list of files, through
// JetStream to a consumer, and the relay process's parts as roles and its
// least-privilege walkthrough (each test binary on a throwaway PostgreSQL
// of its own, or the one OUTBOX_POSTGRES_URL names).
func TestKitCopiesModulesThatBuildAndPassTheirTestsUnderATeamsPath(t *testing.T) {
	into := filepath.Join(t.TempDir(), "outbox")
	var out bytes.Buffer
	if err := run([]string{"-module", "example.org/team/outbox", "-into", into}, &out); err != nil {
		t.Fatalf("kit: %v\n%s", err, out.String())
	}
	t.Logf("kit said:\n%s", out.String())
	for _, m := range Modules {
		if !strings.Contains(out.String(), m+": builds and vets") {
			t.Errorf("kit did not say that %s builds and vets", m)
		}
	}
	// What README.md shows it saying, its folder as the README names it.
	readme, rerr := os.ReadFile("README.md")
	if rerr != nil {
		t.Fatal(rerr)
	}
	_, said, _ := strings.Cut(string(readme), "\n```\ncopied ")
	said, _, _ = strings.Cut("copied "+said, "```")
	if got := strings.ReplaceAll(out.String(), into, "../../team-repo/outbox"); got != said {
		t.Errorf("README.md shows the kit saying:\n%s\nit says:\n%s", said, got)
	}
	lesson := regexp.MustCompile(`example\.com/patterns/enterprise/outbox"`)
	err := filepath.WalkDir(into, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if n := bytes.Count(b, []byte(Source)); n > 0 {
			t.Errorf("%s names this repository's modules %d times", path, n)
		}
		if lesson.Match(b) && !strings.HasSuffix(path, "_test.go") {
			t.Errorf("%s names the lesson outside a test", path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, gone := range []string{"postgres/peerbench", "postgres/docs_test.go", "natsbroker/figures"} {
		if _, err := os.Stat(filepath.Join(into, gone)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s was copied (%v)", gone, err)
		}
	}
	note, err := os.ReadFile(filepath.Join(into, "KIT.md"))
	if err != nil || !strings.Contains(string(note), "Version "+latest(t)+" of the outbox's product modules") {
		t.Errorf("KIT.md = %q, %v; want the version", note, err)
	}
	for m, run := range map[string]string{
		"postgres":     "^(TestEachRoleDoesItsPartWithExactlyItsGrants|TestReplayInsideTheDuplicateWindowIsRefusedUnlessAllowed|TestWhatToCopyBuildsAlone|TestOneOutboxOnEitherDriver)$",
		"natsbroker":   "^(TestReplayOfAnAggregateReachesAConsumerThatLostItsState|TestATeamImportsTheOutboxModulesAlone)$",
		"outbox-relay": "^(TestEachPartRunsAsARoleWithWhatGrantsPrints|TestLeastPrivilegeWalkthrough|TestVersionSaysWhatItWasBuiltFrom)$",
	} {
		// As KIT.md tells the team to run them: in the module's folder,
		// through the copy's with-server.sh (a throwaway PostgreSQL).
		cmd := exec.Command("../postgres/with-server.sh", "go", "test", "-count=1", "-v", "-run", run, ".")
		cmd.Dir = filepath.Join(into, m)
		b, err := cmd.CombinedOutput()
		passed := regexp.MustCompile(`(?m)^--- PASS: (\S+)`).FindAllSubmatch(b, -1)
		if err != nil || len(passed) != strings.Count(run, "|")+1 {
			t.Errorf("go test -run %s in the copy of %s: %v, %d passed\n%s", run, m, err, len(passed), b)
			continue
		}
		for _, p := range passed {
			t.Logf("%s, copied: %s passed", m, p[1])
		}
	}
}

// The kit refuses, writing nothing, a module path that is not one, an
// -into that is not empty, and a -from that holds no product module.
func TestKitRefusesWritingNothing(t *testing.T) {
	full := t.TempDir()
	if err := os.WriteFile(filepath.Join(full, "keep.txt"), []byte("ours"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ from, into, module, says string }{
		{"..", filepath.Join(t.TempDir(), "a"), "Not A Path", "not a module path"},
		{"..", filepath.Join(t.TempDir(), "b"), "example.org/team/", "not a module path"},
		{"..", filepath.Join(t.TempDir(), "c"), "outbox", "not a module path"},
		{"..", full, "example.org/team/outbox", "is not empty"},
		{t.TempDir(), filepath.Join(t.TempDir(), "d"), "example.org/team/outbox", "holds no module postgres"},
		{"..", "", "example.org/team/outbox", "-into is not set"},
	} {
		err := Copy(c.from, c.into, c.module)
		if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("Copy(%q, %q, %q) = %v; want ErrRefused saying %q", c.from, c.into, c.module, err, c.says)
		}
		if c.into != full && c.into != "" {
			if _, err := os.Stat(c.into); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("Copy(…, %q, %q) refused and wrote %s", c.into, c.module, c.into)
			}
		}
	}
	if entries, _ := os.ReadDir(full); len(entries) != 1 {
		t.Errorf("a refused copy into a folder not empty left %d entries", len(entries))
	}
}

// latest is the version of the changelog's latest entry.
func latest(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../postgres/CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^## (\d+\.\d+\.\d+) `).FindSubmatch(b)
	if m == nil {
		t.Fatal("postgres/CHANGELOG.md names no version")
	}
	return string(m[1])
}

// Each module reports the version of the changelog's latest entry.
func TestEachModuleReportsTheChangelogsVersion(t *testing.T) {
	want := `const Version = "` + latest(t) + `"`
	for _, m := range []string{"postgres", "natsbroker", "rabbitbroker"} {
		b, err := os.ReadFile(filepath.Join("..", m, "version.go"))
		if err != nil || !strings.Contains(string(b), want) {
			t.Errorf("%s/version.go does not say %s (%v)", m, want, err)
		}
	}
}
