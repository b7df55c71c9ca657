package minimum

import (
	"context"
	"database/sql"
	"testing"
)

// Rung 3: two producers' outboxes both have a row 1: the shop's
// OrderPlaced and the catalog's PriceChanged. A consumer of both applies
// each once, telling them apart by key, and still drops a copy. (On rung 2
// it dropped the catalog's event as a copy of the shop's: both had id 1.)
func TestTwoProducersRowsOfOneIDAreBothApplied(t *testing.T) {
	ctx := context.Background()
	shop, catalog, warehouse := newDB(t), newDB(t), newDB(t)
	b := &recorder{}
	if _, err := PlaceOrder(ctx, shop, 100); err != nil {
		t.Fatal(err)
	}
	if _, err := catalog.Exec(`INSERT INTO outbox (type, payload) VALUES ('PriceChanged', '{"sku":"A1"}')`); err != nil {
		t.Fatal(err)
	}
	for _, producer := range []*sql.DB{shop, catalog} {
		if _, err := PublishPending(ctx, producer, b); err != nil {
			t.Fatal(err)
		}
	}
	nothing := func(*sql.Tx) error { return nil }
	msgs := b.published()
	applied := 0
	for _, m := range append(msgs, msgs[0]) { // and a copy of the first
		ok, err := Consume(ctx, warehouse, m, nothing)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			applied++
		}
	}
	if applied != 2 {
		t.Errorf("applied %d of the two producers' events and a copy; want both events, and the copy dropped", applied)
	}
}
