package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// TestShopOverHTTP drives the shop's wiring, serve, over loopback HTTP
// through the article's scenario: an order placed and reserved; bad input
// refused; the broker taken down, an order placed all the same, which waits
// in the outbox; the broker back, the order reserved. Then Ctrl-C (the
// context's end) stops everything.
func TestShopOverHTTP(t *testing.T) {
	db, dbs := newDatabase(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var out syncBuffer
	store := t.TempDir()
	if err := migrate(ctx, dbs.shop, setup{store: store, broker: "jetstream", nodes: 1, relay: "polling"}, &out); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() {
		served <- serve(ctx, ln, dbs, setup{store: store, broker: "jetstream", nodes: 1, relay: "polling"}, &out)
	}()
	base := "http://" + ln.Addr().String()
	waitFor(t, "the shop to say it listens", func() bool { return strings.Contains(out.String(), "shop: listening on "+base) })

	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	waitFor(t, "order 1 reserved", func() bool {
		return get(t, base+"/orders/1") == `{"orderId":1,"totalCents":2500,"sent":true,"reserved":true}`
	})
	badInputChangesNothing(t, db, base)
	waitFor(t, "the shop's parts named apart in pg_stat_activity", func() bool {
		var named int
		db.QueryRow(`SELECT count(DISTINCT application_name) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name IN ('shop', 'outbox-relay', 'warehouse')`).Scan(&named)
		return named == 3
	})

	call(t, "POST", base+"/broker/down", "", 200, `{"broker":"down"}`)
	call(t, "POST", base+"/orders", `{"totalCents":4000}`, 201, `{"orderId":2}`)
	waitFor(t, "a relay pass that failed on the stopped broker", func() bool {
		var attempts int
		db.QueryRow(`SELECT attempts FROM outbox WHERE id = 2`).Scan(&attempts)
		return attempts > 0
	})
	if got := get(t, base+"/orders/2"); got != `{"orderId":2,"totalCents":4000,"sent":false,"reserved":false}` {
		t.Errorf("order 2 while the broker is down = %s, want it unsent and not reserved", got)
	}
	var view struct {
		Unsent, Parked, Failing int
		Scheduled               *int
		Blocking                *struct {
			ID        int64
			Attempts  int
			LastError string
		}
		Consumer map[string]any
	}
	asked := time.Now()
	got := get(t, base+"/outbox")
	t.Logf("GET /outbox with the broker down answered in %v", time.Since(asked))
	if json.Unmarshal([]byte(got), &view) != nil || view.Unsent != 1 || view.Parked != 0 ||
		view.Scheduled == nil || *view.Scheduled != 0 || view.Blocking == nil || view.Blocking.ID != 2 || view.Blocking.Attempts == 0 ||
		!strings.Contains(view.Blocking.LastError, "message broker unavailable") || view.Consumer["error"] == nil {
		t.Errorf("GET /outbox while the broker is down = %s, want 1 unsent, 0 parked, 0 scheduled, row 2 blocking with the broker's error, the consumer unreachable", got)
	}
	call(t, "POST", base+"/broker/up", "", 200, `{"broker":"up"}`)
	waitFor(t, "order 2 reserved", func() bool {
		return get(t, base+"/orders/2") == `{"orderId":2,"totalCents":4000,"sent":true,"reserved":true}`
	})
	for range 2 { // a retry with the same key gets the first order
		postWithKey(t, base+"/orders", "order-3", `{"totalCents":700}`, 201, `{"orderId":3}`)
	}
	waitFor(t, "order 3 reserved", func() bool {
		return get(t, base+"/orders/3") == `{"orderId":3,"totalCents":700,"sent":true,"reserved":true}`
	})
	if got := get(t, base+"/outbox"); json.Unmarshal([]byte(got), &view) != nil || view.Blocking != nil || view.Consumer["pending"] != 0.0 || view.Consumer["waiting"] != 0.0 {
		t.Errorf("GET /outbox once the broker is back = %s, want nothing blocking, nothing pending for the consumer, none waiting", got)
	}

	// An operator's view of a row the broker can never take: parked after
	// ParkAfter rejections, listed, put back. The row after it of the same
	// aggregate waits behind it, and /outbox names the parked row as the
	// one that blocks.
	var row int64
	if err := db.QueryRow(`INSERT INTO outbox (type, payload, aggregate, seq) VALUES ('Order Placed', '{}', 'order/99', 1) RETURNING id`).Scan(&row); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO outbox (type, payload, aggregate, seq) VALUES ('OrderShipped', '{}', 'order/99', 2)`); err != nil {
		t.Fatal(err)
	}
	listed := fmt.Sprintf(`[{"id":%d,`, row)
	waitFor(t, "the unroutable row parked", func() bool { return strings.HasPrefix(get(t, base+"/outbox/parked"), listed) })
	var blocked struct {
		Blocking *struct {
			ID      int64
			Parked  bool
			Waiting int64
		}
	}
	if got := get(t, base+"/outbox"); json.Unmarshal([]byte(got), &blocked) != nil || blocked.Blocking == nil ||
		blocked.Blocking.ID != row || !blocked.Blocking.Parked || blocked.Blocking.Waiting != 1 {
		t.Errorf("GET /outbox with order/99's first event parked = %s, want it named as blocking, parked, 1 row waiting", got)
	}
	if got := get(t, base+"/outbox/parked"); !strings.Contains(got, `"type":"Order Placed","aggregate":"order/99","seq":1,"attempts":5,"rejections":5,"lastError":"message`) ||
		!strings.Contains(got, "makes no valid subject") {
		t.Errorf("GET /outbox/parked = %s, want the row after 5 rejections, saying its type makes no valid subject", got)
	}
	call(t, "POST", fmt.Sprintf("%s/outbox/parked/%d/unpark", base, row), "", 200, fmt.Sprintf(`{"unparked":%d}`, row))
	call(t, "POST", base+"/outbox/parked/999/unpark", "", 404, `{"error":"no parked outbox row 999"}`)
	call(t, "POST", base+"/outbox/parked/x/unpark", "", 400, `{"error":"outbox row id must be a whole number"}`)
	waitFor(t, "the row parked again", func() bool { return strings.HasPrefix(get(t, base+"/outbox/parked"), listed) })

	postWithKey(t, base+"/orders", "order-3", `{"totalCents":800}`, 422, `{"error":"shop: idempotency key already used for another order: key \"order-3\" placed order 3 of 700 cents, not 800"}`)

	cancel()
	if err := <-served; err != nil {
		t.Errorf("serve = %v, want nil after the context ended", err)
	}
	if !strings.HasSuffix(out.String(), "shop: stopped\n") {
		t.Errorf("shop's output does not end with its stop:\n%s", out.String())
	}
	if _, err := http.Get(base + "/outbox"); err == nil {
		t.Error("the shop still answers after it stopped")
	}
}

// call makes a request and checks its status and body.
func call(t *testing.T, method, url, body string, status int, want string) {
	t.Helper()
	check(t, newRequest(t, method, url, body), status, want)
}

// postWithKey is call of POST with an Idempotency-Key header.
func postWithKey(t *testing.T, url, key, body string, status int, want string) {
	t.Helper()
	req := newRequest(t, "POST", url, body)
	req.Header.Set("Idempotency-Key", key)
	check(t, req, status, want)
}

func newRequest(t *testing.T, method, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

func check(t *testing.T, req *http.Request, status int, want string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status || strings.TrimSpace(string(got)) != want {
		t.Errorf("%s %s = %d %s, want %d %s", req.Method, req.URL, resp.StatusCode, got, status, want)
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return strings.TrimSpace(string(b))
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting after 60 s for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// syncBuffer is a bytes.Buffer that serve's goroutines may write while the
// test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestMain finds the server OUTBOX_POSTGRES_URL names (make natsbroker
// sets it), or starts a throwaway one (pgtest.Main).
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "kafka-cluster" { // -broker kafka's cluster: this binary is its process
		kafkaCluster(os.Args[2:])
		os.Exit(0)
	}
	pgtest.Main(m)
}

// newDatabase creates a database of its own for t on the tests' server,
// dropped when t ends, and opens it for the test and as the shop's pools.
func newDatabase(t *testing.T) (*sql.DB, *pools) {
	t.Helper()
	cfg := pgtest.Config.Copy()
	admin := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { admin.Close() })
	name := fmt.Sprintf("shop_test_%d", os.Getpid())
	if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec("DROP DATABASE " + name + " WITH (FORCE)"); err != nil {
			t.Error(err)
		}
	})
	cfg.Database = name
	db := stdlib.OpenDB(*cfg)
	dbs := openPools(cfg)
	t.Cleanup(func() { db.Close(); dbs.Close() })
	return db, dbs
}

// The shop on a cluster of three (-nodes 3): POST /broker/down stops one
// node, the stream's leader, and orders go on being reserved through the
// other two; POST /broker/up brings it back. (Caught: a stream of one
// replica, which stops with its node.)
func TestShopOnAClusterGoesOnWithANodeDown(t *testing.T) {
	_, dbs := newDatabase(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out syncBuffer
	store := t.TempDir()
	if err := migrate(ctx, dbs.shop, setup{store: store, broker: "jetstream", nodes: 3, relay: "polling"}, &out); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() {
		served <- serve(ctx, ln, dbs, setup{store: store, broker: "jetstream", nodes: 3, relay: "polling"}, &out)
	}()
	base := "http://" + ln.Addr().String()
	waitFor(t, "the shop to say it listens", func() bool {
		select {
		case err := <-served:
			t.Fatalf("serve = %v before it listened:\n%s", err, out.String())
		default:
		}
		return strings.Contains(out.String(), "shop: listening on "+base)
	})
	reserved := func(id int) {
		t.Helper()
		call(t, "POST", base+"/orders", `{"totalCents":100}`, 201, fmt.Sprintf(`{"orderId":%d}`, id))
		waitFor(t, fmt.Sprintf("order %d reserved", id), func() bool {
			return get(t, fmt.Sprintf("%s/orders/%d", base, id)) == fmt.Sprintf(`{"orderId":%d,"totalCents":100,"sent":true,"reserved":true}`, id)
		})
	}
	reserved(1)
	down := newRequest(t, "POST", base+"/broker/down", "")
	r, err := http.DefaultClient.Do(down)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if !strings.Contains(string(body), "down, 2 of 3 up") {
		t.Fatalf("POST /broker/down = %s, want one node down, 2 of 3 up", body)
	}
	t.Logf("POST /broker/down: %s", strings.TrimSpace(string(body)))
	reserved(2)
	call(t, "POST", base+"/broker/up", "", 200, `{"broker":"up"}`)
	reserved(3)
	cancel()
	if err := <-served; err != nil {
		t.Errorf("serve = %v, want nil after the context ended", err)
	}
}

// The shop with the log relay (-relay log, make shop SHOP_RELAY=log):
// migrate creates its slot; an order is reserved; with the broker down an
// order waits, unsent, and once it is back it is reserved and /orders
// says it was sent (the log relay marks what it delivered); the live
// view's relay counts the log relay's deliveries as its passes.
func TestShopOverHTTPWithTheLogRelay(t *testing.T) {
	base, _, _ := startShopWith(t, "log")
	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	waitFor(t, "order 1 reserved, and marked sent", func() bool {
		return get(t, base+"/orders/1") == `{"orderId":1,"totalCents":2500,"sent":true,"reserved":true}`
	})
	call(t, "POST", base+"/broker/down", "", 200, `{"broker":"down"}`)
	call(t, "POST", base+"/orders", `{"totalCents":4000}`, 201, `{"orderId":2}`)
	if got := get(t, base+"/orders/2"); got != `{"orderId":2,"totalCents":4000,"sent":false,"reserved":false}` {
		t.Errorf("order 2 with the broker down = %s, want it unsent", got)
	}
	call(t, "POST", base+"/broker/up", "", 200, `{"broker":"up"}`)
	waitFor(t, "order 2 reserved, and marked sent", func() bool {
		return get(t, base+"/orders/2") == `{"orderId":2,"totalCents":4000,"sent":true,"reserved":true}`
	})
}

// The consumer's duplicate, where a person sees it: POST /warehouse/replay
// delivers the whole stream again to the warehouse, as a consumer reset to
// the start or a copy past the broker's duplicate window would, and the
// warehouse drops each copy by its key: no reservation twice, the copies
// counted in the answer, in /outbox and in /metrics. (The lost ack the
// page offers is dropped by JetStream's duplicate window before any
// consumer sees it.)
func TestWarehouseDropsEveryCopyOfAReplay(t *testing.T) {
	base, db, _ := startShop(t)
	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	call(t, "POST", base+"/orders", `{"totalCents":4000}`, 201, `{"orderId":2}`)
	waitFor(t, "both orders reserved", func() bool {
		return get(t, base+"/orders/2") == `{"orderId":2,"totalCents":4000,"sent":true,"reserved":true}` &&
			get(t, base+"/orders/1") == `{"orderId":1,"totalCents":2500,"sent":true,"reserved":true}`
	})
	call(t, "POST", base+"/warehouse/replay", "", 200, `{"duplicates":2,"replayed":2}`)
	var reservations int
	if err := db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&reservations); err != nil || reservations != 2 {
		t.Errorf("%d reservations (%v) after the replay, want 2", reservations, err)
	}
	var view struct{ Warehouse map[string]any }
	if got := get(t, base+"/outbox"); json.Unmarshal([]byte(got), &view) != nil || view.Warehouse["duplicates"] != 2.0 || view.Warehouse["applied"] != 2.0 {
		t.Errorf("GET /outbox after the replay = %s, want the warehouse's 2 applied and 2 duplicates", got)
	}
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `outbox_result="duplicate"`) {
		t.Errorf("/metrics counts no duplicate:\n%.2000s", body)
	}
}

// The shop's log in natsbroker/REFERENCE.md begins with the line migrate
// prints: its schema versions are today's, not those of the run before a
// migration was added.
func TestTheShopsLogInTheReferenceIsAtTodaysSchema(t *testing.T) {
	doc, err := os.ReadFile("../natsbroker/REFERENCE.md")
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("shop: database at outbox schema version %d and shop schema version %d,",
		postgres.SchemaVersion, shop.SchemaVersion)
	var found int
	for line := range strings.Lines(string(doc)) {
		if strings.HasPrefix(line, "shop: database at ") {
			found++
			if !strings.HasPrefix(line, want) {
				t.Errorf("natsbroker/REFERENCE.md shows %q; migrate prints %q today: run the shop again and copy its log", strings.TrimSpace(line), want)
			}
		}
	}
	if found == 0 {
		t.Error("natsbroker/REFERENCE.md shows no line of migrate's; the test looks for the shop's log there")
	}
	// The relay's failures there end with the error the code words today.
	for line := range strings.Lines(string(doc)) {
		if strings.Contains(line, `msg="outbox: relay pass failed"`) && !strings.Contains(line, postgres.ErrBrokerUnavailable.Error()) {
			t.Errorf("natsbroker/REFERENCE.md shows a failed pass without %q, as the relay words it today:\n%s", postgres.ErrBrokerUnavailable, line)
		}
	}
}

// The article's duplicate, as the shop shows it on JetStream: the next ack
// lost, the relay sends the order's event again; JetStream drops the copy
// by its key within its duplicate window, before the warehouse sees it, and
// /outbox says so (the broker's duplicates 1, the warehouse's 0, since the
// process started). (Caught: "duplicates":0 and nothing to say where the
// copy went.)
func TestALostAckIsDroppedByJetStreamAndOutboxSaysSo(t *testing.T) {
	base, _, _ := startShop(t)
	call(t, "POST", base+"/broker/lose-next-ack", "", 200, `{"loseNextAck":true}`)
	call(t, "POST", base+"/orders", `{"totalCents":1500}`, 201, `{"orderId":1}`)
	var view struct {
		Broker    map[string]int64
		Warehouse map[string]any
	}
	waitFor(t, "the copy dropped by JetStream, and the order reserved", func() bool {
		return json.Unmarshal([]byte(get(t, base+"/outbox")), &view) == nil && view.Broker["duplicates"] == 1 &&
			get(t, base+"/orders/1") == `{"orderId":1,"totalCents":1500,"sent":true,"reserved":true}`
	})
	if view.Warehouse["applied"] != 1.0 || view.Warehouse["duplicates"] != 0.0 || view.Warehouse["since"] == nil {
		t.Errorf("GET /outbox after a lost ack: warehouse %v; want 1 applied, 0 duplicates, and since when", view.Warehouse)
	}
}
