package main

import (
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// keyPaths is every key of a JSON object, nested ones as a.b, sorted.
func keyPaths(t *testing.T, doc string) []string {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal([]byte(doc), &v); err != nil {
		t.Fatalf("%v: %s", err, doc)
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

// The README's two transcripts of GET /outbox (an order unsent while the
// broker is down; a lost ack, dropped by JetStream) have the fields the
// shop prints in those states, no more and no fewer. (Caught: the first
// lacked broker.duplicates, warehouse.since and the consumer's waiting.)
func TestReadmesOutboxTranscriptsHaveTheFieldsTheShopPrints(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	quoted := regexp.MustCompile(`(?m)^\$ curl localhost:8080/outbox\n(\{.*\})$`).FindAllStringSubmatch(string(readme), -1)
	if len(quoted) != 2 {
		t.Fatalf("README has %d transcripts of GET /outbox; want 2", len(quoted))
	}
	base, _, _ := startShop(t)
	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	waitFor(t, "order 1 reserved", func() bool {
		return get(t, base+"/orders/1") == `{"orderId":1,"totalCents":2500,"sent":true,"reserved":true}`
	})
	call(t, "POST", base+"/broker/down", "", 200, `{"broker":"down"}`)
	call(t, "POST", base+"/orders", `{"totalCents":4000}`, 201, `{"orderId":2}`)
	var down string
	waitFor(t, "order 2 blocking and failing, the consumer unreachable", func() bool {
		down = get(t, base+"/outbox")
		return strings.Contains(down, `"blocking":{`) && strings.Contains(down, `"consumer":{"error"`) && strings.Contains(down, `"failing":1`)
	})
	t.Logf("GET /outbox with the broker down: %s", down)
	if got, want := keyPaths(t, quoted[0][1]), keyPaths(t, down); !slices.Equal(got, want) {
		t.Errorf("README's /outbox with the broker down has fields %v; the shop prints %v:\n%s", got, want, down)
	}
	call(t, "POST", base+"/broker/up", "", 200, `{"broker":"up"}`)
	waitFor(t, "order 2 reserved", func() bool {
		return get(t, base+"/orders/2") == `{"orderId":2,"totalCents":4000,"sent":true,"reserved":true}`
	})
	call(t, "POST", base+"/broker/lose-next-ack", "", 200, `{"loseNextAck":true}`)
	call(t, "POST", base+"/orders", `{"totalCents":1500}`, 201, `{"orderId":3}`)
	var lost string
	waitFor(t, "the copy dropped by JetStream, and nothing unsent", func() bool {
		lost = get(t, base+"/outbox")
		return strings.Contains(lost, `"broker":{"duplicates":1}`) && strings.Contains(lost, `"unsent":0`) && strings.Contains(lost, `"blocking":null`)
	})
	t.Logf("GET /outbox after a lost ack: %s", lost)
	if got, want := keyPaths(t, quoted[1][1]), keyPaths(t, lost); !slices.Equal(got, want) {
		t.Errorf("README's /outbox after a lost ack has fields %v; the shop prints %v:\n%s", got, want, lost)
	}
}
