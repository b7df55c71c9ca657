package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// Report is what Upgrade did, file by file, and what upstream's changelog
// added. Its String is what kit upgrade prints.
type Report struct {
	From, To   Record   // the copy's record before and after
	Modules    []string // the modules upgraded
	Upstream   []string // files taken from upstream: the team left them alone
	Kept       []string // files only the team changed, kept as they are
	Merged     []string // files both changed, merged with no overlap
	Conflicts  []string // files both changed where the changes overlap, marked
	Added      []string // files upstream added
	Removed    []string // files upstream removed, which the team left alone
	Changelog  []string // the changelog's entries upstream added
	Unchanged  bool     // the copy was at the commit already
	conflictAt []string // what each conflict is, for String
}

func (r *Report) String() string {
	var b strings.Builder
	if r.Unchanged {
		fmt.Fprintf(&b, "%s is at commit %s already\n", strings.Join(r.Modules, ", "), short(r.To.Commit))
		return b.String()
	}
	fmt.Fprintf(&b, "upgraded %s from %s (%s) to %s (%s)\n", strings.Join(r.Modules, ", "),
		short(r.From.Commit), r.From.Version, short(r.To.Commit), r.To.Version)
	for _, l := range []struct {
		what  string
		files []string
	}{
		{"taken from upstream", r.Upstream}, {"added upstream", r.Added}, {"removed upstream", r.Removed},
		{"yours, kept", r.Kept}, {"merged", r.Merged},
	} {
		fmt.Fprintf(&b, "%d %s%s\n", len(l.files), l.what, list(l.files, l.what == "yours, kept" || l.what == "merged"))
	}
	fmt.Fprintf(&b, "%d in conflict%s\n", len(r.Conflicts), list(r.conflictAt, true))
	if len(r.Changelog) > 0 {
		b.WriteString("what upstream's changelog added:\n")
		for _, e := range r.Changelog {
			fmt.Fprintf(&b, "  %s\n", e)
		}
	}
	return b.String()
}

// list is files as ": a, b", if shown.
func list(files []string, shown bool) string {
	if !shown || len(files) == 0 {
		return ""
	}
	return ": " + strings.Join(files, ", ")
}

// short is a commit's first 12 hex digits.
func short(commit string) string { return commit[:min(12, len(commit))] }

// Upgrade takes the copy at into, made by Copy at the commit its kit.json
// names, to the commit the repository at from has checked out, keeping the
// team's own changes. It makes the copy again at both commits (the base and
// upstream's), and for each file: one the team left alone takes upstream's
// (added, changed or removed); one upstream left alone keeps the team's;
// one both changed is merged by git merge-file, which marks where the
// changes overlap, as git marks a conflict; go.sum takes both sides' lines.
// A file the team added is left alone. Then it writes the new kit.json and
// KIT.md. Its error wraps ErrConflicts if any file holds conflict markers,
// and ErrRefused, with nothing written, if into holds no copy or from no
// repository.
func Upgrade(from, into string) (*Report, error) {
	b, err := os.ReadFile(filepath.Join(into, "kit.json"))
	if err != nil {
		return nil, fmt.Errorf("%w: %s holds no kit.json: is it a copy the kit made? %w", ErrRefused, into, err)
	}
	var old Record
	if err := json.Unmarshal(b, &old); err != nil || old.Commit == "" || old.Module == "" || len(old.Modules) == 0 {
		return nil, fmt.Errorf("%w: %s/kit.json is not the kit's record (%v)", ErrRefused, into, err)
	}
	commit, err := git(from, "rev-parse", "HEAD")
	if err != nil {
		return nil, fmt.Errorf("%w: -from %s is no git checkout of the repository: %w", ErrRefused, from, err)
	}
	r := &Report{From: old, Modules: old.Modules}
	if commit == old.Commit {
		r.To, r.Unchanged = old, true
		return r, nil
	}
	work, err := os.MkdirTemp("", "kit-upgrade-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	base, theirs := filepath.Join(work, "base"), filepath.Join(work, "theirs")
	for _, side := range []struct {
		dir, commit string
		rec         *Record
	}{{base, old.Commit, &Record{}}, {theirs, commit, &r.To}} {
		tree, cleanup, err := archive(from, side.commit)
		if err != nil {
			return nil, fmt.Errorf("%w (is commit %s in -from's history?)", err, short(side.commit))
		}
		*side.rec = Record{Commit: side.commit, Module: old.Module, Modules: old.Modules}
		err = copyTree(tree, side.dir, side.rec)
		cleanup()
		if err != nil {
			return nil, err
		}
	}
	files := map[string]bool{}
	for _, dir := range []string{base, theirs} {
		err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			rel, err := filepath.Rel(dir, path)
			files[filepath.ToSlash(rel)] = true
			return err
		})
		if err != nil {
			return nil, err
		}
	}
	paths := make([]string, 0, len(files))
	for p := range files {
		if p != "kit.json" && p != "KIT.md" {
			paths = append(paths, p)
		}
	}
	slices.Sort(paths)
	for _, p := range paths {
		if err := r.mergeFile(p, filepath.Join(into, p), filepath.Join(base, p), filepath.Join(theirs, p)); err != nil {
			return r, err
		}
	}
	for _, name := range []string{"kit.json", "KIT.md"} {
		b, err := os.ReadFile(filepath.Join(theirs, name))
		if err != nil {
			return r, err
		}
		if err := os.WriteFile(filepath.Join(into, name), b, 0o644); err != nil {
			return r, err
		}
	}
	r.Changelog = added(filepath.Join(base, "postgres", "CHANGELOG.md"), filepath.Join(theirs, "postgres", "CHANGELOG.md"))
	if len(r.Conflicts) > 0 {
		return r, fmt.Errorf("%w: %s; resolve the marked lines (<<<<<<< yours, ======= , >>>>>>> upstream), then build and test",
			ErrConflicts, strings.Join(r.Conflicts, ", "))
	}
	return r, nil
}

// mergeFile merges the file p three ways: ours (the team's, in place),
// base (the copy as made) and theirs (upstream's, as copied now).
func (r *Report) mergeFile(p, ours, base, theirs string) error {
	o, oErr := os.ReadFile(ours)
	b, bErr := os.ReadFile(base)
	t, tErr := os.ReadFile(theirs)
	has := func(err error) bool { return err == nil }
	for _, err := range []error{oErr, bErr, tErr} {
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	switch {
	case has(tErr) && has(oErr) && bytes.Equal(o, t):
		return nil // the same on both sides
	case !has(tErr) && !has(oErr):
		return nil // removed on both
	case has(bErr) && has(oErr) && bytes.Equal(o, b): // the team left it alone
		if !has(tErr) {
			r.Removed = append(r.Removed, p)
			return os.Remove(ours)
		}
		r.Upstream = append(r.Upstream, p)
		return writeLike(ours, theirs, t)
	case !has(bErr) && !has(oErr): // added upstream
		r.Added = append(r.Added, p)
		if err := os.MkdirAll(filepath.Dir(ours), 0o755); err != nil {
			return err
		}
		return writeLike(ours, theirs, t)
	case has(bErr) && has(tErr) && bytes.Equal(b, t): // upstream left it alone
		r.Kept = append(r.Kept, p)
		return nil
	case !has(tErr): // removed upstream, changed or removed by the team
		if has(oErr) {
			r.Conflicts = append(r.Conflicts, p)
			r.conflictAt = append(r.conflictAt, p+" (removed upstream, changed by you: kept yours)")
		}
		return nil
	case !has(oErr): // removed by the team, changed upstream
		r.Conflicts = append(r.Conflicts, p)
		r.conflictAt = append(r.conflictAt, p+" (changed upstream, removed by you: upstream's is "+p+".upstream)")
		return writeLike(ours+".upstream", theirs, t)
	case filepath.Base(p) == "go.sum":
		r.Merged = append(r.Merged, p)
		return os.WriteFile(ours, sumMerge(o, b, t), 0o644)
	}
	if !has(bErr) { // added on both sides, differently: merged from nothing
		base = filepath.Join(filepath.Dir(theirs), ".kit-empty")
		if err := os.WriteFile(base, nil, 0o644); err != nil {
			return err
		}
		defer os.Remove(base)
	}
	cmd := exec.Command("git", "merge-file", "-L", "yours", "-L", "as copied", "-L", "upstream", ours, base, theirs)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err == nil:
		r.Merged = append(r.Merged, p)
	case errors.As(err, &exit) && exit.ExitCode() > 0 && exit.ExitCode() < 128:
		r.Conflicts = append(r.Conflicts, p)
		r.conflictAt = append(r.conflictAt, fmt.Sprintf("%s (%d overlapping changes, marked)", p, exit.ExitCode()))
	default:
		return fmt.Errorf("git merge-file %s: %w: %s", p, err, out)
	}
	return nil
}

// writeLike writes b to path with the mode of like.
func writeLike(path, like string, b []byte) error {
	mode := fs.FileMode(0o644)
	if info, err := os.Stat(like); err == nil {
		mode = info.Mode().Perm()
	}
	if err := os.WriteFile(path, b, mode); err != nil {
		return err
	}
	return os.Chmod(path, mode)
}

// sumMerge merges go.sum files as the sets of lines they are: the team's
// lines, less those upstream removed, with those upstream added.
func sumMerge(ours, base, theirs []byte) []byte {
	lines := func(b []byte) map[string]bool {
		m := map[string]bool{}
		for _, l := range strings.Split(string(b), "\n") {
			if l != "" {
				m[l] = true
			}
		}
		return m
	}
	o, b, t := lines(ours), lines(base), lines(theirs)
	var out []string
	for l := range o {
		if !b[l] || t[l] {
			out = append(out, l)
		}
	}
	for l := range t {
		if !b[l] && !o[l] {
			out = append(out, l)
		}
	}
	slices.Sort(out)
	return []byte(strings.Join(out, "\n") + "\n")
}

// added are the changelog's entries (its "- " lines, joined with the lines
// that go on) that theirs has and base has not.
func added(base, theirs string) []string {
	entries := func(path string) []string {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil
		}
		var es []string
		for _, l := range strings.Split(string(b), "\n") {
			switch {
			case strings.HasPrefix(l, "- "):
				es = append(es, l)
			case strings.HasPrefix(l, "  ") && len(es) > 0:
				es[len(es)-1] += " " + strings.TrimSpace(l)
			}
		}
		return es
	}
	old := entries(base)
	var out []string
	for _, e := range entries(theirs) {
		if !slices.Contains(old, e) {
			out = append(out, e)
		}
	}
	return out
}
