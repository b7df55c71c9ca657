package main

import (
	"encoding/json"
	"testing"

	"example.com/patterns/enterprise/outbox"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// The example's order and event are the lesson's: package shop declares
// them again so that the outbox's module needs nothing of the root
// teaching package, and this program, which may import both, checks that
// they agree: the same event type, the same JSON for the same order, and a
// payload of one read as the other.
func TestTheShopsContractIsTheLessons(t *testing.T) {
	if shop.OrderPlaced != outbox.OrderPlaced {
		t.Errorf("shop.OrderPlaced = %q, the lesson's %q", shop.OrderPlaced, outbox.OrderPlaced)
	}
	ours, err := json.Marshal(shop.Order{ID: 7, TotalCents: 2500})
	if err != nil {
		t.Fatal(err)
	}
	lessons, err := json.Marshal(outbox.Order{ID: 7, TotalCents: 2500})
	if err != nil {
		t.Fatal(err)
	}
	if string(ours) != string(lessons) {
		t.Errorf("shop.Order as JSON = %s, the lesson's %s", ours, lessons)
	}
	var back outbox.Order
	if err := json.Unmarshal(ours, &back); err != nil || back != (outbox.Order{ID: 7, TotalCents: 2500}) {
		t.Errorf("the shop's payload read as the lesson's Order = %+v, %v", back, err)
	}
}
