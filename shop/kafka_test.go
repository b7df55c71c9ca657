package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// The shop on Kafka (-broker kafka, make shop SHOP_BROKER=kafka), through
// the article's scenario, on a cluster the shop starts as a process of its
// own (kfake, three brokers): an order reserved; the cluster stopped by
// POST /broker/down, an order placed all the same, waiting in the outbox;
// the cluster back on its data, the order reserved. A lost ack: Kafka
// keeps both copies the relay sent, and the warehouse drops the second by
// its key. A replay: the topic keeps what was consumed, and hands the
// warehouse every record again, each dropped by its key: no reservation
// twice. Then the shop stopped and served again on the same store, without
// migrate: the cluster finds its topic, the group its offsets, and nothing
// is applied again.
func TestShopOnKafka(t *testing.T) {
	type outboxView = struct {
		Unsent    int
		Consumer  map[string]any
		Warehouse map[string]any
	}
	db, dbs := newDatabase(t)
	s := setup{store: t.TempDir(), broker: "kafka", nodes: 3, relay: "polling"}
	var migrated syncBuffer
	base, stop := startOn(t, dbs, s, true, &migrated)
	if want := "Kafka topic outbox (3 partitions, replicas: 3) provisioned"; !strings.Contains(migrated.String(), want) {
		t.Errorf("migrate said %q, want it to name %q", migrated.String(), want)
	}
	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	waitFor(t, "order 1 reserved", func() bool {
		return get(t, base+"/orders/1") == `{"orderId":1,"totalCents":2500,"sent":true,"reserved":true}`
	})
	watch(t, base, "Kafka up, its topic's count", func(s state) bool {
		return s.Broker.Name == "Kafka" && s.Broker.Up == "up" && s.Broker.Stored != nil && *s.Broker.Stored == 1
	})

	call(t, "POST", base+"/broker/down", "", 200, `{"broker":"down"}`)
	call(t, "POST", base+"/orders", `{"totalCents":4000}`, 201, `{"orderId":2}`)
	waitFor(t, "a relay pass that failed on the stopped cluster", func() bool {
		var attempts int
		db.QueryRow(`SELECT attempts FROM outbox WHERE id = 2`).Scan(&attempts)
		return attempts > 0
	})
	var view outboxView
	if got := get(t, base+"/outbox"); json.Unmarshal([]byte(got), &view) != nil || view.Unsent != 1 || view.Consumer["error"] == nil {
		t.Errorf("GET /outbox with the cluster down = %s, want 1 unsent, the broker unreachable", got)
	}
	call(t, "POST", base+"/broker/up", "", 200, `{"broker":"up"}`)
	waitFor(t, "order 2 reserved", func() bool {
		return get(t, base+"/orders/2") == `{"orderId":2,"totalCents":4000,"sent":true,"reserved":true}`
	})

	call(t, "POST", base+"/broker/lose-next-ack", "", 200, `{"loseNextAck":true}`)
	call(t, "POST", base+"/orders", `{"totalCents":700}`, 201, `{"orderId":3}`)
	waitFor(t, "order 3 reserved", func() bool {
		return get(t, base+"/orders/3") == `{"orderId":3,"totalCents":700,"sent":true,"reserved":true}`
	})
	// The topic keeps every copy a relay sent: order 3's lost ack made one,
	// and a publish cut short while the cluster was down may have made
	// more of order 2's (its outcome unknown, the row went again). The
	// warehouse drops each by its key, once the group has read them all.
	stored := settled(t, base, &view)
	if stored < 4 || view.Warehouse["duplicates"] != float64(stored-3) || view.Warehouse["applied"] != 3.0 {
		t.Errorf("%d stored, the warehouse applied %v and dropped %v; want at least 4 (order 3's event twice), 3 applied and the rest dropped",
			stored, view.Warehouse["applied"], view.Warehouse["duplicates"])
	}
	if got := watch(t, base, "the page's counts", func(s state) bool { return s.Warehouse.Applied == 3 }); got.Broker.Duplicates != 0 {
		t.Errorf("the page counts %d copies dropped by the broker; want 0: Kafka drops none", got.Broker.Duplicates)
	}
	call(t, "POST", base+"/warehouse/replay", "", 200, fmt.Sprintf(`{"duplicates":%d,"replayed":%d}`, stored, stored))
	var reservations int
	if err := db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&reservations); err != nil || reservations != 3 {
		t.Errorf("%d reservations (%v) after the replay; want 3", reservations, err)
	}
	if got := get(t, base+"/outbox"); json.Unmarshal([]byte(got), &view) != nil || view.Consumer["setAside"] != 0.0 {
		t.Errorf("GET /outbox at the end = %s, want nothing set aside", got)
	}
	stop()

	base, stop = startOn(t, dbs, s, false, nil) // serve alone: the cluster keeps its topic and the group its offsets
	defer stop()
	call(t, "POST", base+"/orders", `{"totalCents":900}`, 201, `{"orderId":4}`)
	waitFor(t, "order 4 reserved after the restart", func() bool {
		return get(t, base+"/orders/4") == `{"orderId":4,"totalCents":900,"sent":true,"reserved":true}`
	})
	if got := get(t, base+"/outbox"); json.Unmarshal([]byte(got), &view) != nil || view.Warehouse["applied"] != 1.0 || view.Warehouse["duplicates"] != 0.0 {
		t.Errorf("GET /outbox after the restart = %s, want order 4's event applied, nothing read again", got)
	}
}

// settled waits until the shop on Kafka has nothing unsent and the
// warehouse's group has committed past every record the topic holds, and
// returns how many it holds, with GET /outbox's answer then in view.
func settled(t *testing.T, base string, view *struct {
	Unsent    int
	Consumer  map[string]any
	Warehouse map[string]any
}) int {
	t.Helper()
	var stored int
	waitFor(t, "every record read by the warehouse's group", func() bool {
		s := watch(t, base, "the topic's count", func(s state) bool { return s.Broker.Stored != nil })
		stored = int(*s.Broker.Stored)
		return json.Unmarshal([]byte(get(t, base+"/outbox")), view) == nil && view.Unsent == 0 &&
			view.Consumer["pending"] == 0.0 && view.Warehouse["applied"].(float64)+view.Warehouse["duplicates"].(float64) == float64(stored)
	})
	return stored
}
