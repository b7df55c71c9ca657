package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// startOn runs the shop as s says on dbs: migrate first if migrating
// (what it prints copied to migrated), then serve, until stop.
func startOn(t *testing.T, dbs *pools, s setup, migrating bool, migrated io.Writer) (base string, stop func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	if migrating {
		if migrated == nil {
			migrated = io.Discard
		}
		if err := migrate(ctx, dbs.shop, s, io.MultiWriter(out, migrated)); err != nil {
			t.Fatal(err)
		}
	}
	served := make(chan error, 1)
	go func() { served <- serve(ctx, ln, dbs, s, out) }()
	base = "http://" + ln.Addr().String()
	waitFor(t, "the shop to listen", func() bool {
		select {
		case err := <-served:
			t.Fatalf("serve: %v", err)
		default:
		}
		return strings.Contains(out.String(), "shop: listening on "+base)
	})
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-served; err != nil {
				t.Errorf("serve: %v", err)
			}
		})
	}
	t.Cleanup(stop) // a test that fails midway stops the shop and its broker too
	return base, stop
}

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
	s := setup{store: t.TempDir(), broker: "jetstream", nodes: 1, relay: "polling"}
	start := func() (base string, stop func()) { return startOn(t, dbs, s, true, io.Discard) }
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

// The shop on a cluster of three, stopped and started again on its stores,
// as make shop SHOP_NODES=3 SHOP_DATA=dir runs it: the shop built, migrate
// and serve each a process of its own, serve stopped with SIGINT, three
// times. migrate, run again, waits for the cluster to elect its leaders, as
// serve does, and the shop goes on: each start's order is reserved.
// (Caught: migrate's CreateOrUpdateConsumer failing at once on the second
// start, "provision consumer warehouse: context deadline exceeded".)
func TestShopOnAClusterStartsAgainOnItsData(t *testing.T) {
	binary := filepath.Join(t.TempDir(), "shop")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cfg := pgtest.Config
	url := fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, pgtest.NewBlankDatabase(t))
	store := t.TempDir()
	command := func(args ...string) (*exec.Cmd, *syncBuffer) {
		cmd := exec.Command(binary, append(args, "-store", store, "-nodes", "3")...)
		cmd.Env = append(os.Environ(), "OUTBOX_POSTGRES_URL="+url, "OTEL_TRACES_EXPORTER=none")
		out := &syncBuffer{}
		cmd.Stdout, cmd.Stderr = out, out
		return cmd, out
	}
	for round := int64(1); round <= 3; round++ {
		migrate, out := command("migrate")
		if err := migrate.Run(); err != nil {
			t.Fatalf("start %d: shop migrate: %v\n%s", round, err, out)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		serve, out := command("serve", "-addr", addr)
		if err := serve.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan error, 1)
		go func() { exited <- serve.Wait() }()
		base := "http://" + addr
		waitFor(t, "the shop to listen", func() bool { return strings.Contains(out.String(), "shop: listening on "+base) })
		call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, fmt.Sprintf(`{"orderId":%d}`, round))
		waitFor(t, fmt.Sprintf("order %d reserved", round), func() bool {
			return get(t, fmt.Sprintf("%s/orders/%d", base, round)) == fmt.Sprintf(`{"orderId":%d,"totalCents":2500,"sent":true,"reserved":true}`, round)
		})
		serve.Process.Signal(os.Interrupt)
		select {
		case err := <-exited:
			if err != nil {
				t.Fatalf("start %d: shop serve after SIGINT: %v\n%s", round, err, out)
			}
		case <-time.After(time.Minute):
			serve.Process.Kill()
			t.Fatalf("start %d: shop serve did not stop within a minute of SIGINT", round)
		}
	}
}

// The page counts the sent rows up to sentCountCap and then says "more":
// a week of sent rows kept costs it no more than that. With 10,001 rows
// sent, the state says 10,000 and more.
func TestLivePageCountsSentRowsUpToItsCap(t *testing.T) {
	base, db, _ := startShop(t)
	if _, err := db.Exec(`INSERT INTO outbox (type, payload, sent_at)
		SELECT 'ItemPicked', '{}', clock_timestamp() FROM generate_series(1, $1)`, sentCountCap+1); err != nil {
		t.Fatal(err)
	}
	s := watch(t, base, "the sent rows counted to the cap", func(s state) bool { return s.Outbox.SentMore })
	if s.Outbox.Sent != sentCountCap {
		t.Errorf("sent %d and more, want %d and more", s.Outbox.Sent, sentCountCap)
	}
}
