package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
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
// -into that is not empty, a -from that is no checkout of the repository,
// a module that is not a product module, a relay with no broker, and an
// upgrade of a folder it did not make.
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
		{t.TempDir(), filepath.Join(t.TempDir(), "d"), "example.org/team/outbox", "is no git checkout"},
		{"..", "", "example.org/team/outbox", "-into is not set"},
	} {
		_, err := Copy(c.from, c.into, c.module)
		if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("Copy(%q, %q, %q) = %v; want ErrRefused saying %q", c.from, c.into, c.module, err, c.says)
		}
		if c.into != full && c.into != "" {
			if _, err := os.Stat(c.into); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("Copy(…, %q, %q) refused and wrote %s", c.into, c.module, c.into)
			}
		}
	}
	for _, c := range []struct {
		modules []string
		says    string
	}{
		{[]string{"outbox-relay"}, "outbox-relay publishes to a broker"},
		{[]string{"postgres", "sqsbroker"}, `"sqsbroker" is not a product module`},
		{[]string{""}, `"" is not a product module`},
	} {
		into := filepath.Join(t.TempDir(), "e")
		_, err := Copy("..", into, "example.org/team/outbox", c.modules...)
		if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("Copy of %q = %v; want ErrRefused saying %q", c.modules, err, c.says)
		}
		if _, err := os.Stat(into); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("Copy of %q refused and wrote %s", c.modules, into)
		}
	}
	if _, err := Upgrade("..", t.TempDir()); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "holds no kit.json") {
		t.Errorf("Upgrade of a folder the kit did not make = %v; want ErrRefused", err)
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

// A team that publishes to Kafka alone names kafkabroker and outbox-relay:
// the kit copies them and postgres (what they need), nothing else. The
// relay's copy keeps no file, test, go.mod line or go.sum line of NATS or
// RabbitMQ, builds, vets, and passes its own tests there: its settings,
// the process to a Kafka cluster over TLS with SASL, and its version,
// which names kafkabroker alone. (Caught: a kit that copied all five
// modules, and a relay that could not build without every broker.)
func TestKitCopiesTheModulesATeamNamesAndNothingElse(t *testing.T) {
	into := filepath.Join(t.TempDir(), "outbox")
	var out bytes.Buffer
	if err := run([]string{"-module", "example.org/team/outbox", "-into", into, "-modules", "kafkabroker,outbox-relay"}, &out); err != nil {
		t.Fatalf("kit: %v\n%s", err, out.String())
	}
	t.Logf("kit said:\n%s", out.String())
	// What README.md shows it saying, its folder as the README names it.
	if said, got := readmeBlock(t, "copied "), strings.ReplaceAll(out.String(), into, "../../team-repo/outbox"); got != said {
		t.Errorf("README.md shows the kit saying:\n%s\nit says:\n%s", said, got)
	}
	entries, err := os.ReadDir(into)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if got, want := strings.Join(names, " "), "KIT.md kafkabroker kit.json outbox-relay postgres"; got != want {
		t.Errorf("the copy holds %s; want %s", got, want)
	}
	relay := filepath.Join(into, "outbox-relay")
	err = filepath.WalkDir(relay, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || strings.HasSuffix(path, ".md") {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, gone := range []string{"natsbroker", "rabbitbroker", "nats-io", "amqp091"} {
			if bytes.Contains(b, []byte(gone)) {
				t.Errorf("%s names %s, a broker left out", path, gone)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, kept := range []string{"kafka.go", "kafka_test.go", "config_test.go", "env_test.go", "version_test.go"} {
		if _, err := os.Stat(filepath.Join(relay, kept)); err != nil {
			t.Errorf("the relay's %s was not copied: %v", kept, err)
		}
	}
	for m, run := range map[string]string{
		"outbox-relay": "",
		"kafkabroker":  "^(TestCheckTopicSaysWhetherAcksAllKeepsARecord|TestOnlyTheRecordOverTheLimitIsRefused)$",
		"postgres":     "^(TestEachRoleDoesItsPartWithExactlyItsGrants|TestWhatToCopyBuildsAlone)$",
	} {
		args := []string{"go", "test", "-count=1", "-v"}
		if run != "" {
			args = append(args, "-run", run)
		}
		cmd := exec.Command("../postgres/with-server.sh", append(args, ".")...)
		cmd.Dir = filepath.Join(into, m)
		b, err := cmd.CombinedOutput()
		passed := regexp.MustCompile(`(?m)^--- PASS: (\S+)`).FindAllSubmatch(b, -1)
		failed := regexp.MustCompile(`(?m)^--- (FAIL|SKIP)`).Match(b)
		if err != nil || failed || len(passed) == 0 || (run != "" && len(passed) != strings.Count(run, "|")+1) {
			t.Errorf("go test %s in the copy of %s: %v, %d passed\n%s", run, m, err, len(passed), b)
			continue
		}
		for _, p := range passed {
			t.Logf("%s, copied: %s passed", m, p[1])
		}
	}
	if b, err := exec.Command("go", "-C", relay, "run", ".", "version").Output(); err != nil ||
		!strings.Contains(string(b), "kafkabroker") || strings.Contains(string(b), "natsbroker") {
		t.Errorf("the copy's outbox-relay version = %q, %v; want kafkabroker named alone", b, err)
	}
}

// older is a commit of this repository before the relay's brokers had
// files of their own: what a team's copy was made at, for the upgrade's
// test.
const older = "a8eee1e676adaf0c12c56cec29ba51946c11d0a7"

// A copy made at an older commit, then changed by its team, is taken to
// today's commit by kit upgrade: the team's change is kept, upstream's
// changes are in (files moved, added and removed), kit.json names the new
// commit, upgrade says what the changelog added, and the copy builds,
// vets and passes its tests. (Caught: upgrades compared by hand.)
func TestKitUpgradeTakesACopyToTodayKeepingTheTeamsChange(t *testing.T) {
	head, err := git("..", "rev-parse", "HEAD")
	if err != nil {
		t.Fatal(err)
	}
	old, err := git("..", "rev-parse", "--verify", older+"^{commit}")
	if err != nil {
		t.Fatalf("the older commit is not in this clone's history (a shallow clone? git fetch --unshallow): %v", err)
	}
	// A checkout of the older commit, as the team had when it copied.
	checkout := filepath.Join(t.TempDir(), "repo")
	if _, err := git("..", "worktree", "add", "--detach", checkout, old); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { git("..", "worktree", "remove", "--force", checkout) })
	into := filepath.Join(t.TempDir(), "outbox")
	rec, err := Copy(checkout, into, "example.org/team/outbox")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Commit != old {
		t.Fatalf("the copy records commit %s; want %s", rec.Commit, old)
	}
	// The team's change: a line of its own at the end of the relay's
	// config.go, a file upstream changed since.
	const ours = "\n// Team: our own note, kept through upgrades.\n"
	config := filepath.Join(into, "outbox-relay", "config.go")
	b, err := os.ReadFile(config)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(config, append(b, ours...), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := git(checkout, "checkout", "--detach", head); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := run([]string{"upgrade", "-into", into, "-from", checkout}, &out); err != nil {
		t.Fatalf("kit upgrade: %v\n%s", err, out.String())
	}
	t.Logf("kit upgrade said:\n%s", out.String())
	for _, want := range []string{"upgraded postgres, natsbroker, rabbitbroker, kafkabroker, outbox-relay from " + short(old),
		"merged: outbox-relay/config.go", "added upstream", "0 in conflict", "what upstream's changelog added:", "outbox-relay: builds and vets"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("kit upgrade did not say %q", want)
		}
	}
	if b, err := os.ReadFile(config); err != nil || !strings.HasSuffix(string(b), ours) || !strings.Contains(string(b), "c.brokers") {
		t.Errorf("config.go after the upgrade lost the team's line or upstream's change (%v):\n…%s", err, b[max(0, len(b)-300):])
	}
	if _, err := os.Stat(filepath.Join(into, "outbox-relay", "nats.go")); err != nil {
		t.Errorf("upstream's new nats.go is not in the copy: %v", err)
	}
	var after Record
	if b, err := os.ReadFile(filepath.Join(into, "kit.json")); err != nil || json.Unmarshal(b, &after) != nil || after.Commit != head {
		t.Errorf("kit.json after the upgrade = %s (%v); want commit %s", b, err, head)
	}
	// README.md's block, each count any count and … anything, line by line
	// in order.
	said := strings.Split(strings.TrimSuffix(readmeBlock(t, "upgraded "), "\n"), "\n")
	lines := strings.Split(out.String(), "\n")
	for _, l := range said {
		pattern := regexp.QuoteMeta(l)
		pattern = regexp.MustCompile(`\d+`).ReplaceAllString(pattern, `\d+`)
		pattern = "^" + strings.ReplaceAll(pattern, "…", ".*") + "$"
		i := slices.IndexFunc(lines, regexp.MustCompile(pattern).MatchString)
		if i < 0 {
			t.Errorf("README.md shows the upgrade saying %q; it said no such line after the last matched", l)
			break
		}
		lines = lines[i+1:]
	}
	// Upgraded again, nothing to do.
	out.Reset()
	if err := run([]string{"upgrade", "-into", into, "-from", checkout, "-check=false"}, &out); err != nil || !strings.Contains(out.String(), "at commit "+short(head)+" already") {
		t.Errorf("a second upgrade said %q, %v; want nothing to do", out.String(), err)
	}
	cmd := exec.Command("../postgres/with-server.sh", "go", "test", "-count=1", "-v", "-run",
		"^(TestEverySettingIsCheckedBeforeAnythingConnects|TestVersionSaysWhatItWasBuiltFrom|TestEachPartRunsAsARoleWithWhatGrantsPrints)$", ".")
	cmd.Dir = filepath.Join(into, "outbox-relay")
	b, err = cmd.CombinedOutput()
	if n := len(regexp.MustCompile(`(?m)^--- PASS`).FindAll(b, -1)); err != nil || n != 3 {
		t.Errorf("the upgraded copy's tests: %v, %d of 3 passed\n%s", err, n, b)
	}
}

// Where the team's change and upstream's overlap, the file holds both,
// marked as git marks a conflict, and Upgrade's report names it; where they
// do not, the file is merged; go.sum takes upstream's new lines and drops
// those upstream dropped, keeping the team's own.
func TestAMergeMarksWhereTheTeamsAndUpstreamsChangesOverlap(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	var r Report
	base := "a\nb\nc\nd\ne\nf\n"
	ours := write("ours.go", "a\nB ours\nc\nd\ne\nf\n")
	if err := r.mergeFile("x.go", ours, write("base.go", base), write("theirs.go", "a\nB theirs\nc\nd\ne\nF\n")); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(ours)
	want := "a\n<<<<<<< yours\nB ours\n=======\nB theirs\n>>>>>>> upstream\nc\nd\ne\nF\n"
	if string(got) != want || !slices.Equal(r.Conflicts, []string{"x.go"}) {
		t.Errorf("merged:\n%s\nconflicts %v; want\n%s\nand x.go", got, r.Conflicts, want)
	}
	ours = write("ours2.go", "a\nB ours\nc\nd\ne\nf\n")
	if err := r.mergeFile("y.go", ours, write("base2.go", base), write("theirs2.go", "a\nb\nc\nd\ne\nF\n")); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(ours); string(got) != "a\nB ours\nc\nd\ne\nF\n" || !slices.Equal(r.Merged, []string{"y.go"}) {
		t.Errorf("merged %q, %v; want both changes and y.go merged", got, r.Merged)
	}
	sum := sumMerge([]byte("m1 h1\nm2 h2\nteam h\n"), []byte("m1 h1\nm2 h2\n"), []byte("m2 h2\nm3 h3\n"))
	if string(sum) != "m2 h2\nm3 h3\nteam h\n" {
		t.Errorf("go.sum merged to %q", sum)
	}
	if !strings.Contains(r.String(), "1 in conflict: x.go (1 overlapping changes, marked)") {
		t.Errorf("the report says:\n%s", r.String())
	}
}

// readmeBlock is README.md's fenced block that begins with start.
func readmeBlock(t *testing.T, start string) string {
	t.Helper()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, ok := strings.Cut(string(readme), "\n```\n"+start)
	block, _, ok2 := strings.Cut(start+block, "```")
	if !ok || !ok2 {
		t.Fatalf("README.md has no block that begins %q", start)
	}
	return block
}
