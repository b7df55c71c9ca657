package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// keyPaths is every key of a JSON object, nested ones as a.b, sorted; nil
// if doc is no JSON object.
func keyPaths(doc string) []string {
	var v map[string]any
	if json.Unmarshal([]byte(doc), &v) != nil {
		return nil
	}
	var out []string
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			out = append(out, prefix+k)
			if inner, ok := v.(map[string]any); ok {
				walk(prefix+k+".", inner)
			}
		}
	}
	walk("", v)
	slices.Sort(out)
	return out
}

// step is one command of a transcript and what it printed.
type step struct {
	method, path, body string
	grep               *regexp.Regexp // for /metrics | grep -E: the lines kept
	printed            []string
}

var curlRE = regexp.MustCompile(`^\$ curl (?:-s )?(?:-X (\w+) )?localhost:8080(\S*)(?: -d '([^']*)')?(?: \| grep -E ["'](.*)["'])?$`)

// transcripts are the console blocks of doc that talk to the shop, as
// steps; a command it cannot play (make shop, a comment, jq over the
// exporter's log) is passed over with what it printed.
func transcripts(t *testing.T, doc string) [][]step {
	t.Helper()
	b, err := os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]step
	for _, block := range regexp.MustCompile("(?s)```console\n(.*?)```").FindAllStringSubmatch(string(b), -1) {
		var steps []step
		playing := false
		for _, l := range strings.Split(strings.TrimSuffix(block[1], "\n"), "\n") {
			if strings.HasPrefix(l, "$ # ") && strings.Contains(l, "make shop") {
				// A restart on the same stores: the shop that starts again
				// starts its broker; here the broker is brought up
				// (TestShopResumesOnItsOwnData restarts the shop itself).
				steps = append(steps, step{method: "POST", path: "/broker/up", printed: []string{`{"broker":"up"}`}})
				playing = false
				continue
			}
			if strings.HasPrefix(l, "$ ") {
				m := curlRE.FindStringSubmatch(l)
				playing = m != nil
				if playing {
					s := step{method: m[1], path: m[2], body: m[3]}
					if s.method == "" {
						s.method = "GET"
						if s.body != "" {
							s.method = "POST"
						}
					}
					if m[4] != "" {
						s.grep = regexp.MustCompile(m[4])
					}
					steps = append(steps, s)
				}
				continue
			}
			if playing {
				steps[len(steps)-1].printed = append(steps[len(steps)-1].printed, l)
			}
		}
		if len(steps) > 0 {
			out = append(out, steps)
		}
	}
	return out
}

// labelsRE strips a metric line's value.
var labelsRE = regexp.MustCompile(`^(\S+)\s`)

// The console sessions of the shop's README and of natsbroker/REFERENCE.md
// are what the shop answers: each played against a shop of its own, each
// command's answer (a JSON object, or /metrics's lines) has what the
// transcript shows. Answers that change with state and time (an order's
// state, /outbox, metrics) are asked again until they match or a minute
// passes; an object with figures that vary (/outbox: ids, waits) matches
// by its fields, the rest exactly. (Caught: /outbox's first transcript
// lacked broker.duplicates, warehouse.since and the consumer's waiting.)
func TestReadmesTranscriptsAreWhatTheShopAnswers(t *testing.T) {
	var sessions [][]step
	for _, doc := range []string{"README.md", "../natsbroker/REFERENCE.md"} {
		sessions = append(sessions, transcripts(t, doc)...)
	}
	if len(sessions) != 4 {
		t.Fatalf("%d console sessions with the shop; want the README's three and the REFERENCE's one", len(sessions))
	}
	for i, session := range sessions {
		t.Run(fmt.Sprint("session", i+1), func(t *testing.T) { playSession(t, session) })
	}
}

// playSession plays one session against a shop of its own.
func playSession(t *testing.T, session []step) {
	base, _, _ := startShop(t)
	for _, s := range session {
		answer := func() string {
			req, err := http.NewRequest(s.method, base+s.path, strings.NewReader(s.body))
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err.Error()
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return strings.TrimSpace(string(b))
		}
		want := strings.Join(s.printed, "\n")
		matches := func(got string) bool {
			switch {
			case s.grep != nil: // the metrics' names and labels, not their values
				var names []string
				for _, l := range strings.Split(got, "\n") {
					if s.grep.MatchString(l) {
						names = append(names, labelsRE.FindString(l))
					}
				}
				var wantNames []string
				for _, l := range s.printed {
					wantNames = append(wantNames, labelsRE.FindString(l))
				}
				return slices.Equal(names, wantNames)
			case s.path == "/outbox":
				return slices.Equal(keyPaths(got), keyPaths(want))
			}
			return got == want
		}
		got := answer()
		if s.method == "GET" {
			waitFor(t, s.method+" "+s.path+" to answer as the transcript shows: "+want, func() bool { got = answer(); return matches(got) })
		} else if !matches(got) {
			t.Errorf("%s %s %s answered %s; the transcript shows %s", s.method, s.path, s.body, got, want)
		}
	}
}
