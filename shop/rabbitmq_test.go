package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// The shop on RabbitMQ (-broker rabbitmq, make shop SHOP_BROKER=rabbitmq),
// through the article's scenario, on a node the shop starts: an order
// reserved; the node stopped by POST /broker/down, an order placed all the
// same, waiting in the outbox; the node back, the order reserved. A lost
// ack: RabbitMQ keeps both copies the relay sent, and the warehouse drops
// the second by its key. A replay is refused: the queue keeps nothing once
// acknowledged. Then the shop stopped and served again on the same store,
// without migrate: the node finds its queue. (Caught: a node named after
// its port, whose data a second start does not find: serve refused, "run
// shop migrate first".)
func TestShopOnRabbitMQ(t *testing.T) {
	db, dbs := newDatabase(t)
	s := setup{store: t.TempDir(), broker: "rabbitmq", nodes: 1, relay: "polling"}
	var migrated syncBuffer
	base, stop := startOn(t, dbs, s, true, &migrated)
	if want := "RabbitMQ exchange outbox and quorum queue warehouse (dead letters: warehouse.dead) provisioned"; !strings.Contains(migrated.String(), want) {
		t.Errorf("migrate said %q, want it to name %q", migrated.String(), want)
	}
	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	waitFor(t, "order 1 reserved", func() bool {
		return get(t, base+"/orders/1") == `{"orderId":1,"totalCents":2500,"sent":true,"reserved":true}`
	})
	watch(t, base, "RabbitMQ up, its queue's count", func(s state) bool {
		return s.Broker.Name == "RabbitMQ" && s.Broker.Up == "up" && s.Broker.Stored != nil
	})

	call(t, "POST", base+"/broker/down", "", 200, `{"broker":"down"}`)
	call(t, "POST", base+"/orders", `{"totalCents":4000}`, 201, `{"orderId":2}`)
	waitFor(t, "a relay pass that failed on the stopped node", func() bool {
		var attempts int
		db.QueryRow(`SELECT attempts FROM outbox WHERE id = 2`).Scan(&attempts)
		return attempts > 0
	})
	var view struct {
		Unsent    int
		Consumer  map[string]any
		Warehouse map[string]any
	}
	if got := get(t, base+"/outbox"); json.Unmarshal([]byte(got), &view) != nil || view.Unsent != 1 || view.Consumer["error"] == nil {
		t.Errorf("GET /outbox with the node down = %s, want 1 unsent, the broker unreachable", got)
	}
	call(t, "POST", base+"/broker/up", "", 200, `{"broker":"up"}`)
	waitFor(t, "order 2 reserved", func() bool {
		return get(t, base+"/orders/2") == `{"orderId":2,"totalCents":4000,"sent":true,"reserved":true}`
	})

	call(t, "POST", base+"/broker/lose-next-ack", "", 200, `{"loseNextAck":true}`)
	call(t, "POST", base+"/orders", `{"totalCents":700}`, 201, `{"orderId":3}`)
	waitFor(t, "the copy of order 3's event dropped by the warehouse", func() bool {
		return json.Unmarshal([]byte(get(t, base+"/outbox")), &view) == nil && view.Warehouse["duplicates"] == 1.0
	})
	var reservations int
	if err := db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&reservations); err != nil || reservations != 3 || view.Warehouse["applied"] != 3.0 {
		t.Errorf("%d reservations (%v), %v applied; want 3 of each", reservations, err, view.Warehouse["applied"])
	}
	if got := watch(t, base, "the copy dropped by the warehouse", func(s state) bool { return s.Warehouse.Duplicates == 1 }); got.Broker.Duplicates != 0 {
		t.Errorf("the page counts %d copies dropped by the broker, want 0: RabbitMQ drops none", got.Broker.Duplicates)
	}
	call(t, "POST", base+"/warehouse/replay", "", 409,
		`{"error":"RabbitMQ: the broker keeps no message once the warehouse acknowledged it: there is nothing to replay"}`)
	if got := get(t, base+"/outbox"); json.Unmarshal([]byte(got), &view) != nil || view.Consumer["pending"] != 0.0 ||
		view.Consumer["consumers"] != 1.0 || view.Consumer["deadLetters"] != 0.0 {
		t.Errorf("GET /outbox at the end = %s, want nothing pending, one consumer, no dead letters", got)
	}
	stop()

	base, stop = startOn(t, dbs, s, false, nil) // serve alone: the node keeps its queue in the store
	defer stop()
	call(t, "POST", base+"/orders", `{"totalCents":900}`, 201, `{"orderId":4}`)
	waitFor(t, "order 4 reserved after the restart", func() bool {
		return get(t, base+"/orders/4") == `{"orderId":4,"totalCents":900,"sent":true,"reserved":true}`
	})
}
