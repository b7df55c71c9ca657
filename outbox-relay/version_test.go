package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// outbox-relay version says the version the changelog's latest entry
// names, for the relay and each module it was built with (each broker's),
// the schema versions it wants, and the commit it was built from.
func TestVersionSaysWhatItWasBuiltFrom(t *testing.T) {
	changelog, err := os.ReadFile("../postgres/CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^## (\d+\.\d+\.\d+) `).FindSubmatch(changelog)
	if m == nil {
		t.Fatal("CHANGELOG.md names no version")
	}
	latest := string(m[1])
	// The commit is recorded where git can tell it (this machine's GOFLAGS
	// may turn that off: -buildvcs=true turns it back on).
	rev, gitErr := exec.Command("git", "rev-parse", "HEAD").Output()
	binary := filepath.Join(t.TempDir(), "outbox-relay")
	build := []string{"build", "-o", binary}
	if gitErr == nil {
		build = append(build, "-buildvcs=true")
	}
	if out, err := exec.Command("go", append(build, ".")...).CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(binary, "version").Output()
	if err != nil {
		t.Fatal(err)
	}
	got := string(out)
	t.Logf("outbox-relay version: %s", got)
	wants := []string{"outbox-relay " + latest + ":", "postgres " + latest + " (outbox schema 11, consumer schema 1)"}
	for _, k := range brokerKinds {
		wants = append(wants, k.module+" "+latest)
	}
	if len(brokerKinds) == 0 {
		t.Error("no broker is registered")
	}
	for _, want := range wants {
		if !strings.Contains(got, want) {
			t.Errorf("version says %q; want %q in it", got, want)
		}
	}
	if gitErr == nil {
		if want := "commit " + strings.TrimSpace(string(rev)); !strings.Contains(got, want) {
			t.Errorf("version says %q; want %q in it", got, want)
		}
	}
}
