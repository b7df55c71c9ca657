package main

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// watch reads the shop's /events until an event's state satisfies ok, for
// at most a minute, and returns that state.
func watch(t *testing.T, base, what string, ok func(state) bool) state {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", base+"/events", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		data, found := strings.CutPrefix(sc.Text(), "data: ")
		if !found {
			continue
		}
		var s state
		if err := json.Unmarshal([]byte(data), &s); err != nil {
			t.Fatal(err)
		}
		if ok(s) {
			return s
		}
	}
	t.Fatalf("no event showed %s within a minute (%v)", what, sc.Err())
	return state{}
}

// The page's controls that the browser test does not click: the next ack
// lost (the broker stores the message, the relay sends it again, JetStream
// drops the copy, the warehouse applies it once) and a cancellation (the
// order shown cancelled, its reservation released); and a bad cancellation
// answered plainly.
func TestLivePageLosesAnAckAndCancels(t *testing.T) {
	base, _, _ := startShop(t)
	call(t, "POST", base+"/broker/lose-next-ack", "", 200, `{"loseNextAck":true}`)
	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	s := watch(t, base, "the order reserved and its copy dropped", func(s state) bool {
		return len(s.Orders) == 1 && s.Orders[0].State == "reserved" && s.Broker.Duplicates >= 1
	})
	if s.Warehouse.Applied != 1 || s.Broker.Stored == nil || *s.Broker.Stored != 1 || s.Broker.LoseNext {
		t.Errorf("after the lost ack: applied %d, stored %v, lose next %v; want 1, 1, false", s.Warehouse.Applied, s.Broker.Stored, s.Broker.LoseNext)
	}
	call(t, "POST", base+"/orders/1/cancel", "", 200, `{"cancelled":true,"orderId":1}`)
	watch(t, base, "the order cancelled and released", func(s state) bool {
		return len(s.Orders) == 1 && s.Orders[0].State == "cancelled" && s.Warehouse.Applied == 2
	})
	call(t, "POST", base+"/orders/1/cancel", "", 409, `{"error":"order 1 is cancelled already"}`)
	call(t, "POST", base+"/orders/9/cancel", "", 404, `{"error":"no order 9"}`)
	call(t, "POST", base+"/orders/x/cancel", "", 400, `{"error":"order id must be a whole number"}`)
}

// The shop stopped with an event waiting in its outbox (the broker was
// down), and started again on the same database and broker store, as make
// shop SHOP_DATA=folder does: migrate finds everything provisioned, and the
// relay sends the event it left, which the warehouse reserves; the order
// before it is not applied twice.
func TestShopResumesOnItsOwnData(t *testing.T) {
	db, dbs := newDatabase(t)
	store := t.TempDir()
	start := func() (base string, stop func()) {
		t.Helper()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		out := &syncBuffer{}
		if err := migrate(ctx, dbs.shop, store, 1, out); err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- serve(ctx, ln, dbs, store, 1, out) }()
		base = "http://" + ln.Addr().String()
		waitFor(t, "the shop to listen", func() bool { return strings.Contains(out.String(), "shop: listening on "+base) })
		return base, func() {
			cancel()
			if err := <-served; err != nil {
				t.Errorf("serve: %v", err)
			}
		}
	}
	base, stop := start()
	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	waitFor(t, "order 1 reserved", func() bool {
		return get(t, base+"/orders/1") == `{"orderId":1,"totalCents":2500,"sent":true,"reserved":true}`
	})
	call(t, "POST", base+"/broker/down", "", 200, `{"broker":"down"}`)
	call(t, "POST", base+"/orders", `{"totalCents":4000}`, 201, `{"orderId":2}`)
	stop() // with order 2's event unsent

	base, stop = start()
	defer stop()
	waitFor(t, "order 2 reserved after the restart", func() bool {
		return get(t, base+"/orders/2") == `{"orderId":2,"totalCents":4000,"sent":true,"reserved":true}`
	})
	var reservations int
	if err := db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&reservations); err != nil || reservations != 2 {
		t.Errorf("reservations after the restart: %d, %v; want 2", reservations, err)
	}
}
