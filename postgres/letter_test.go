package postgres_test

// True to the letter: sentences a team copies that the code once
// contradicted, checked against the documents as they are.

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// paragraphs is every paragraph of the documents (and of CHANGELOG.md), by
// document.
func paragraphs(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, doc := range append(documents, "CHANGELOG.md") {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		out[doc] = strings.Split(string(b), "\n\n")
	}
	return out
}

// A paragraph that names the ce- attributes and says CloudEvents go out on
// RabbitMQ names the headers they go out as there, cloudEvents:, and no document promises that any
// CloudEvents SDK reads them: the Go SDK binds AMQP 1.0 only. (Caught:
// "ce-id … on either broker … read with any CloudEvents SDK".)
func TestCloudEventsOnRabbitMQAreNamedAsTheyGo(t *testing.T) {
	for doc, paras := range paragraphs(t) {
		for _, p := range paras {
			if strings.Contains(p, "any CloudEvents SDK") {
				t.Errorf("%s promises any CloudEvents SDK reads the events:\n%s", doc, p)
			}
			if strings.Contains(p, "CloudEvent") && strings.Contains(p, "`ce-") && (strings.Contains(p, "either broker") || strings.Contains(p, "RabbitMQ")) &&
				!strings.Contains(p, "cloudEvents:") && !strings.Contains(p, "cloudEvents_") {
				t.Errorf("%s says CloudEvents go out on RabbitMQ without naming its headers (cloudEvents:):\n%s", doc, p)
			}
		}
	}
}

// A sentence that says JetStream drops copies by their id says within what
// window: a copy published after it reaches consumers. (Caught: "JetStream
// drops such copies by Nats-Msg-Id", with no window.)
func TestJetStreamsDropsSayTheirWindow(t *testing.T) {
	drops := regexp.MustCompile(`JetStream drops[^.]*(cop(y|ies)|duplicate|Nats-Msg-Id)`)
	for doc, paras := range paragraphs(t) {
		for _, p := range paras {
			for _, m := range drops.FindAllStringIndex(p, -1) {
				sentence := p[m[0]:]
				if end := strings.IndexAny(sentence, ".;|("); end >= 0 {
					sentence = sentence[:end]
				}
				if !strings.Contains(sentence, "window") {
					t.Errorf("%s: %q says nothing of the duplicate window", doc, sentence)
				}
			}
		}
	}
}

// The claim's locks name a plain CREATE INDEX, which holds the claim up as
// it holds up writes, and warn that migration 7 builds two indexes without
// CONCURRENTLY; the changelog says so of migration 7 too. (Caught: a list
// without CREATE INDEX, and no warning outside the migration's file.)
func TestTheClaimsLocksNameCreateIndexAndMigrationSeven(t *testing.T) {
	ref, err := os.ReadFile("REFERENCE.md")
	if err != nil {
		t.Fatal(err)
	}
	_, locks, ok := strings.Cut(string(ref), "The claim waits for no row, only for a lock on the whole table.")
	locks, _, _ = strings.Cut(locks, "\n\n")
	for _, want := range []string{"`CREATE INDEX`", "`CREATE INDEX CONCURRENTLY`", "7, which drops and\nmakes again `outbox_unsent` and `outbox_held`"} {
		if !ok || !strings.Contains(locks, want) {
			t.Errorf("REFERENCE.md's claim locks do not say %q:\n%s", want, locks)
		}
	}
	changelog, err := os.ReadFile("CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile("(?m)^\\| 7 \\|[^\\n]*without `CONCURRENTLY`").Match(changelog) {
		t.Error("CHANGELOG.md's row for migration 7 does not warn that it builds indexes without CONCURRENTLY")
	}
}

// Two sentences a team copied that the code contradicted: the pass's
// budget, which frees a vanished relay's rows at most three budgets after
// its last statement began (not at the budget), as the adopter's page and
// the reference both say; and no document of the modules names
// NewOutboxRelay, which exists only in this package's tests (the relay is
// made by Outbox.NewRelay). (Caught: "a budget the server enforces
// (PassTimeout, 5 s)", and REFERENCE.md's NewOutboxRelay.)
func TestThePassBudgetAndTheRelaysMakerAreSaidAsTheCodeHasThem(t *testing.T) {
	for doc, paras := range paragraphs(t) {
		for _, p := range paras {
			if strings.Contains(p, "budget the server enforces") {
				t.Errorf("%s says the server enforces the budget itself:\n%s", doc, p)
			}
			if strings.Contains(p, "NewOutboxRelay") && !strings.HasPrefix(doc, "../README.md") {
				t.Errorf("%s names NewOutboxRelay, which only the tests have:\n%s", doc, p)
			}
		}
	}
	for _, doc := range []string{"ADOPTING.md", "REFERENCE.md"} {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(strings.Join(strings.Fields(string(b)), " "), "free at most three budgets") {
			t.Errorf("%s does not say a vanished relay's rows are free at most three budgets after its last statement", doc)
		}
	}
}
