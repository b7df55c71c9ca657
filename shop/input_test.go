package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// badInputChangesNothing sends the shop every kind of bad input and checks
// each answer, and that neither the orders nor the outbox changed.
func badInputChangesNothing(t *testing.T, db *sql.DB, base string) {
	t.Helper()
	before := counts(t, db)
	const bad = `{"error":"body must be one JSON object {\"totalCents\": a whole number of cents}"}`
	for _, tc := range []struct {
		body, key string
		status    int
		want      string
	}{
		{`{"totalCents":0}`, "", 422, `{"error":"shop: order total must be a positive number of cents, got 0"}`},
		{`{"totalCents":-5}`, "", 422, `{"error":"shop: order total must be a positive number of cents, got -5"}`},
		{`{"total":5}`, "", 400, bad},                         // an unknown field
		{`{}`, "", 400, bad},                                  // no total
		{`{"totalCents":null}`, "", 400, bad},                 // no total either
		{`{"totalCents":"5"}`, "", 400, bad},                  // a string
		{`{"totalCents":1.5}`, "", 400, bad},                  // not whole
		{`{"totalCents":1e3}`, "", 400, bad},                  // a float's notation
		{`{"totalCents":99999999999999999999}`, "", 400, bad}, // over int64
		{`{"totalCents":1}}`, "", 400, bad},                   // trailing garbage
		{`{"totalCents":1}{}`, "", 400, bad},                  // a second object
		{`{"totalCents":1} x`, "", 400, bad},                  // a word after it
		{`[{"totalCents":1}]`, "", 400, bad},                  // an array
		{`totalCents=1`, "", 400, bad},                        // not JSON
		{``, "", 400, bad},                                    // nothing
		{`{"totalCents":1` + strings.Repeat(" ", 2000) + `}`, "", 413, `{"error":"body over 1024 bytes"}`},
		{`{"totalCents":1}`, strings.Repeat("k", 256), 400,
			`{"error":"shop: invalid idempotency key: \"` + strings.Repeat("k", 256) + `\""}`},
	} {
		req := newRequest(t, "POST", base+"/orders", tc.body)
		if tc.key != "" {
			req.Header.Set("Idempotency-Key", tc.key)
		}
		check(t, req, tc.status, tc.want)
	}
	call(t, "GET", base+"/orders/9", "", 404, `{"error":"no order 9"}`)
	call(t, "GET", base+"/orders/x", "", 400, `{"error":"order id must be a whole number"}`)
	call(t, "GET", base+"/orders/99999999999999999999", "", 400, `{"error":"order id must be a whole number"}`)
	if after := counts(t, db); after != before {
		t.Errorf("bad input changed the database: orders and outbox rows %v, then %v", before, after)
	}
}

// counts are the numbers of orders and outbox rows.
func counts(t *testing.T, db *sql.DB) [2]int {
	t.Helper()
	var c [2]int
	if err := db.QueryRow(`SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox)`).Scan(&c[0], &c[1]); err != nil {
		t.Fatal(err)
	}
	return c
}

// placer is an orderPlacer whose every order fails with err, after block
// (if not nil) returns.
type placer struct {
	err   error
	block func(ctx context.Context)
}

func (p placer) PlaceOrder(ctx context.Context, total int64) (int64, error) {
	return p.PlaceOrderWithKey(ctx, "", total)
}

func (p placer) PlaceOrderWithKey(ctx context.Context, _ string, _ int64) (int64, error) {
	if p.block != nil {
		p.block(ctx)
	}
	return 0, p.err
}

// A commit whose outcome is unknown gets a 503 with Retry-After, and a body
// that says the outcome is unknown and whether the same request may be sent
// again: with an Idempotency-Key it may, without one it may place a second
// order. (Caught: a bare 500, which tells a client nothing it can act on.)
func TestUnknownCommitTellsTheClientHowToRetry(t *testing.T) {
	unknown := fmt.Errorf("commit: %w: %w", postgres.ErrCommitUnknown, errors.New("connection reset"))
	srv := httptest.NewServer(newHandler(nil, nil, placer{err: unknown}, nil, nil))
	defer srv.Close()
	const outcome = `"error":"the database did not answer the commit: whether the order was placed is unknown"`
	for _, tc := range []struct{ key, retry string }{
		{"order-1", `"retry":"send the same request again with the same Idempotency-Key: it places the order at most once"`},
		{"", `"retry":"this request had no Idempotency-Key, so sending it again may place a second order; send orders with one"`},
	} {
		req := newRequest(t, "POST", srv.URL+"/orders", `{"totalCents":100}`)
		if tc.key != "" {
			req.Header.Set("Idempotency-Key", tc.key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" ||
			!strings.Contains(string(body), outcome) || !strings.Contains(string(body), tc.retry) {
			t.Errorf("key %q: %d, Retry-After %q, %s; want 503, 1, and a body that says {%s, %s}",
				tc.key, resp.StatusCode, resp.Header.Get("Retry-After"), body, outcome, tc.retry)
		}
	}
}

// A database that does not answer gets the client a 503 once the request's
// deadline has passed, saying nothing was placed. (Caught: no deadline, a
// request that waits as long as the database.)
func TestDatabaseThatDoesNotAnswerGetsA503AtTheDeadline(t *testing.T) {
	t.Parallel()
	giveUp := make(chan struct{})
	hang := placer{block: func(ctx context.Context) {
		select {
		case <-ctx.Done(): // the request's deadline
		case <-giveUp: // the test's: the handler has none
		}
	}}
	hang.err = context.DeadlineExceeded // what the driver returns at the deadline
	srv := httptest.NewServer(newHandler(nil, nil, hang, nil, nil))
	defer srv.Close()
	defer close(giveUp) // before Close, which waits for the handler
	client := &http.Client{Timeout: 4 * requestTimeout}
	resp, err := client.Post(srv.URL+"/orders", "application/json", strings.NewReader(`{"totalCents":100}`))
	if err != nil {
		t.Fatalf("no answer within %v: %v", 4*requestTimeout, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if want := `{"error":"the database did not answer within 5s; the order was not placed"}`; resp.StatusCode != 503 || strings.TrimSpace(string(body)) != want {
		t.Errorf("POST /orders to a database that hangs = %d %s, want 503 %s", resp.StatusCode, body, want)
	}
}

// The server closes a connection whose request header never ends, and has
// limits on reading, writing (longer than a request's database work) and
// idling; the pool has limits too. (Caught: a server with only
// ReadHeaderTimeout, and a pool without limits.)
func TestServerAndPoolHaveLimits(t *testing.T) {
	t.Parallel()
	srv := newServer(http.NotFoundHandler())
	if srv.ReadHeaderTimeout <= 0 || srv.ReadTimeout <= 0 || srv.IdleTimeout <= 0 || srv.WriteTimeout <= requestTimeout {
		t.Errorf("server limits: header %v, read %v, write %v, idle %v; want each set, write longer than %v",
			srv.ReadHeaderTimeout, srv.ReadTimeout, srv.WriteTimeout, srv.IdleTimeout, requestTimeout)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	defer srv.Close()
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	io.WriteString(conn, "POST /orders HTTP/1.1\r\nHost: shop\r\n") // and never the blank line
	conn.SetReadDeadline(time.Now().Add(4 * srv.ReadHeaderTimeout))
	if _, err := io.ReadAll(conn); err != nil {
		t.Errorf("a request header that never ends: %v; want the server to close the connection", err)
	}

	cfg, err := pgx.ParseConfig("host=/nonexistent")
	if err != nil {
		t.Fatal(err)
	}
	dbs := openPools(cfg)
	defer dbs.Close()
	total := 0
	for _, db := range []*sql.DB{dbs.shop, dbs.relay, dbs.warehouse} {
		if max := db.Stats().MaxOpenConnections; max <= 0 {
			t.Errorf("a pool without a limit on its connections")
		} else {
			total += max
		}
	}
	if total != maxConns || dbs.relay.Stats().MaxOpenConnections < 3 {
		t.Errorf("the pools open %d connections in all, the relay's %d; want %d, and at least 3 for the relay (a pass, its flush, the listener)",
			total, dbs.relay.Stats().MaxOpenConnections, maxConns)
	}
}

// serve refuses to start, and runs no DDL, on a database that migrate has
// not brought to the schema's version, and on a broker store where migrate
// has not provisioned the stream (JetStream) or the queue (RabbitMQ); each
// error says to run migrate.
func TestServeRefusesWhatMigrateHasNotProvisioned(t *testing.T) {
	db, dbs := newDatabase(t)
	ctx := context.Background()
	serveOnce := func(store string, broker ...string) error {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		s := setup{store: store, broker: "jetstream", nodes: 1, relay: "polling"}
		if len(broker) > 0 {
			s.broker = broker[0]
		}
		return serve(ctx, ln, dbs, s, io.Discard)
	}
	if err := serveOnce(t.TempDir()); !errors.Is(err, postgres.ErrSchemaVersion) {
		t.Errorf("serve on a blank database = %v, want ErrSchemaVersion", err)
	}
	var tables int
	if err := db.QueryRow(`SELECT count(*) FROM pg_tables WHERE schemaname = 'public'`).Scan(&tables); err != nil || tables != 0 {
		t.Errorf("tables after serve refused: %d, %v; want 0", tables, err)
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(ob.Migrate(ctx), ob.MigrateConsumer(ctx), shop.Migrate(ctx, db)); err != nil {
		t.Fatal(err)
	}
	if err := serveOnce(t.TempDir()); err == nil || !strings.Contains(err.Error(), "run shop migrate first") {
		t.Errorf("serve on a store without the stream = %v, want an error saying to run migrate", err)
	}
	if err := serveOnce(t.TempDir(), "rabbitmq"); err == nil || !strings.Contains(err.Error(), "run shop migrate first") {
		t.Errorf("serve on a RabbitMQ node without the queue = %v, want an error saying to run migrate", err)
	}
}

// The shop's flags are checked before anything is migrated or started: a
// relay, a broker or a number of nodes it cannot run is refused, saying
// which.
func TestSetupRefusesWhatTheShopCannotRun(t *testing.T) {
	for _, s := range []setup{
		{broker: "jetstream", nodes: 1, relay: "polling"},
		{broker: "jetstream", nodes: 3, relay: "log"},
		{broker: "rabbitmq", nodes: 1, relay: "log"},
	} {
		if err := s.check(); err != nil {
			t.Errorf("%+v refused: %v", s, err)
		}
	}
	for _, c := range []struct {
		s    setup
		want string
	}{
		{setup{broker: "jetstream", nodes: 1, relay: "cdc"}, `-relay "cdc": want polling or log`},
		{setup{broker: "pulsar", nodes: 1, relay: "polling"}, `-broker "pulsar": want jetstream, rabbitmq or kafka`},
		{setup{broker: "kafka", nodes: 2, relay: "polling"}, `-nodes 2: want 1, or 3 for a cluster`},
		{setup{broker: "rabbitmq", nodes: 3, relay: "polling"}, `-nodes 3: the shop runs one RabbitMQ node`},
		{setup{broker: "jetstream", nodes: 2, relay: "polling"}, `-nodes 2: want 1, or 3 for a cluster`},
	} {
		if err := c.s.check(); err == nil || err.Error() != c.want {
			t.Errorf("%+v: %v, want %q", c.s, err, c.want)
		}
	}
}

// slowBroker is a broker whose Down and Up take a while, as stopping or
// starting a RabbitMQ node does.
type slowBroker struct {
	messageBroker // nil: the handlers below call Down and Up only
	takes         time.Duration
}

func (b slowBroker) Down() string { time.Sleep(b.takes); return "down" }
func (b slowBroker) Up() error    { time.Sleep(b.takes); return nil }

// POST /broker/down and /broker/up answer however long the broker takes to
// stop or start, beyond the server's WriteTimeout. (Caught under load: a
// RabbitMQ node that took more than 10 s to start, and the client's
// request ended in EOF; the same through the tracing wrapper, whose
// response writer did not unwrap, so the handler's deadline was not set.)
func TestBrokerSwitchAnswersPastTheWriteTimeout(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := newServer(traced(newHandler(nil, nil, placer{}, slowBroker{takes: 600 * time.Millisecond}, nil))) // as serve wraps it
	srv.WriteTimeout = 200 * time.Millisecond                                                                // the broker takes three times that
	go srv.Serve(ln)
	defer srv.Close()
	base := "http://" + ln.Addr().String()
	call(t, "POST", base+"/broker/down", "", 200, `{"broker":"down"}`)
	call(t, "POST", base+"/broker/up", "", 200, `{"broker":"up"}`)
}
