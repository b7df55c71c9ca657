package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// jsonLines decodes each line of out that is a JSON object (the process's
// logs are on the same stream in these tests, and are objects too: the
// ones with a "msg" are left out).
func jsonLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var values []map[string]any
	for line := range strings.SplitSeq(out, "\n") {
		var v map[string]any
		if json.Unmarshal([]byte(line), &v) != nil || v["msg"] != nil {
			continue
		}
		values = append(values, v)
	}
	return values
}

// Every operator command, for a person and with -json: check before
// migrate fails on the schema and says so, exit 1; after it passes; lag
// counts the unsent and parked rows; parked lists the parked one; unpark
// puts it back (a second unpark is refused); drop deletes a parked row for
// good. (Caught: no unpark, no lag, no check, and no -json.)
func TestRelayProcessCommandsWithJSON(t *testing.T) {
	e := newEnv(t)
	code, out := e.runOnce("check")
	if code != 1 || !strings.Contains(out, "FAIL  schema") || !strings.Contains(out, "ok    database: PostgreSQL") ||
		!strings.Contains(out, "FAIL  broker") {
		t.Errorf("check before migrate exited %d, want 1 with the schema and the stream failing:\n%s", code, out)
	}
	code, out = e.runOnce("check", "-json")
	failed := map[string]bool{}
	for _, v := range jsonLines(t, out) {
		if v["ok"] == false {
			failed[fmt.Sprint(v["check"])] = true
		}
	}
	if code != 1 || !failed["schema"] || !failed["broker"] || failed["database"] || !failed["privileges"] ||
		!strings.Contains(out, "no table outbox_migrations, outbox, outbox_cleanup, outbox_awake in the search path") {
		t.Errorf("check -json before migrate exited %d, failed %v; want schema, privileges (no tables) and broker:\n%s", code, failed, out)
	}
	code, out = e.runOnce("migrate", "-json")
	if v := jsonLines(t, out); code != 0 || len(v) != 1 || v[0]["provisioned"] != "stream OUTBOX" {
		t.Fatalf("migrate -json exited %d:\n%s", code, out)
	}
	if code, out := e.runOnce("check"); code != 0 || strings.Contains(out, "FAIL") {
		t.Errorf("check after migrate exited %d:\n%s", code, out)
	}
	if code, out := e.runOnce("check", "-standbys", "s1"); !strings.Contains(out, "ok    privileges") {
		t.Errorf("check -standbys as the superuser exited %d, want the privileges ok:\n%s", code, out)
	}
	// A role of its own, with the outbox's tables and nothing more: check
	// says what -standbys and -mode log need that it lacks.
	role := e.name + "_relay"
	for _, stmt := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO " + role,
		"GRANT SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO " + role,
	} {
		if _, err := e.db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		e.db.Exec("DROP OWNED BY " + role)
		e.db.Exec("DROP ROLE " + role)
	})
	cfg := pgtest.Config
	asRole := fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, role, e.name)
	code, out = e.runOnce("check", "-database", asRole, "-standbys", "s1")
	if code != 1 || !strings.Contains(out, "FAIL  privileges: postgres: the role lacks a privilege: "+role+", as the outbox's relay, lacks membership of pg_read_all_stats") || !strings.Contains(out, "ok    schema") {
		t.Errorf("check -standbys as a role without pg_read_all_stats exited %d, want 1 naming it:\n%s", code, out)
	}
	code, out = e.runOnce("check", "-database", asRole, "-mode", "log")
	if code != 1 || !strings.Contains(out, "lacks the REPLICATION attribute") || !strings.Contains(out, "no replication slot outbox") {
		t.Errorf("check -mode log as a role that may not replicate, with no slot, exited %d, want 1 naming both:\n%s", code, out)
	}

	e.writeOrders(2)
	var parked int64
	if err := e.db.QueryRow(`INSERT INTO outbox (type, payload, rejections, last_error, parked_at)
		VALUES ('OrderPlaced', '{"orderId":3}', 5, 'payload over the stream''s limit', clock_timestamp())
		RETURNING id`).Scan(&parked); err != nil {
		t.Fatal(err)
	}
	code, out = e.runOnce("lag", "-json")
	if v := jsonLines(t, out); code != 0 || len(v) != 1 || v[0]["unsent"] != 2.0 || v[0]["parked"] != 1.0 {
		t.Errorf("lag -json exited %d, want 2 unsent and 1 parked:\n%s", code, out)
	}
	if code, out := e.runOnce("lag"); code != 0 || !strings.Contains(out, "outbox: 2 unsent, 1 parked") {
		t.Errorf("lag exited %d:\n%s", code, out)
	}
	// A row scheduled for tomorrow is no lag: lag counts it apart.
	if _, err := e.db.Exec(`INSERT INTO outbox (type, payload, deliver_at) VALUES ('Later', '{}', now() + interval '1 day')`); err != nil {
		t.Fatal(err)
	}
	code, out = e.runOnce("lag", "-json")
	if v := jsonLines(t, out); code != 0 || len(v) != 1 || v[0]["unsent"] != 2.0 || v[0]["scheduled"] != 1.0 {
		t.Errorf("lag -json with a row scheduled exited %d, want 2 unsent and 1 scheduled:\n%s", code, out)
	}
	if _, err := e.db.Exec(`DELETE FROM outbox WHERE type = 'Later'`); err != nil {
		t.Fatal(err)
	}
	code, out = e.runOnce("parked", "-json")
	if v := jsonLines(t, out); code != 0 || len(v) != 1 || v[0]["id"] != float64(parked) || v[0]["lastError"] != "payload over the stream's limit" {
		t.Errorf("parked -json exited %d, want row %d:\n%s", code, parked, out)
	}
	code, out = e.runOnce("unpark", "-json", fmt.Sprint(parked))
	if v := jsonLines(t, out); code != 0 || len(v) != 1 || v[0]["unparked"] != float64(parked) {
		t.Errorf("unpark -json exited %d:\n%s", code, out)
	}
	if n := e.count(fmt.Sprintf(`SELECT count(*) FROM outbox WHERE id = %d AND parked_at IS NULL AND sent_at IS NULL`, parked)); n != 1 {
		t.Errorf("row %d is not back among the unsent", parked)
	}
	if code, out := e.runOnce("unpark", fmt.Sprint(parked)); code != 1 || !strings.Contains(out, "no parked outbox row") {
		t.Errorf("a second unpark exited %d, want 1 and ErrNotParked:\n%s", code, out)
	}
	if code, out := e.runOnce("parked"); code != 0 || !strings.Contains(out, "no parked rows") {
		t.Errorf("parked with none exited %d:\n%s", code, out)
	}
	if _, err := e.db.Exec(`UPDATE outbox SET parked_at = clock_timestamp(), last_error = 'refused again' WHERE id = $1`, parked); err != nil {
		t.Fatal(err)
	}
	code, out = e.runOnce("drop", "-json", fmt.Sprint(parked))
	if v := jsonLines(t, out); code != 0 || len(v) != 1 || v[0]["dropped"] != float64(parked) || v[0]["lastError"] != "refused again" {
		t.Errorf("drop -json exited %d:\n%s", code, out)
	}
	if n := e.count(`SELECT count(*) FROM outbox`); n != 2 {
		t.Errorf("%d rows after the drop, want the 2 unsent", n)
	}

	// replay puts back the sent rows written from -from on: refused while
	// the stream would drop them as copies, unless -allow-dropped; and it
	// refuses, exit 1 and nothing written, a range with no sent row in it.
	var from time.Time
	if err := e.db.QueryRow(`UPDATE outbox SET sent_at = clock_timestamp() RETURNING created_at`).Scan(&from); err != nil {
		t.Fatal(err)
	}
	code, out = e.runOnce("replay", "-from", from.Format(time.RFC3339Nano))
	if code != 1 || !strings.Contains(out, "2 of its 2 rows were sent within the broker's duplicate window (2m0s)") || !strings.Contains(out, "-allow-dropped") {
		t.Errorf("replay -from of rows sent a moment ago exited %d, want 1, naming the stream's window:\n%s", code, out)
	}
	code, out = e.runOnce("replay", "-json", "-allow-dropped", "-from", from.Format(time.RFC3339Nano))
	if v := jsonLines(t, out); code != 0 || len(v) != 1 || v[0]["replayed"] != 2.0 || v[0]["dropped"] != 2.0 || v[0]["taken"] != 0.0 {
		t.Errorf("replay -json -allow-dropped -from exited %d, want 2 rows put back, both dropped:\n%s", code, out)
	}
	if n := e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 2 {
		t.Errorf("%d rows unsent after the replay, want 2", n)
	}
	if code, out := e.runOnce("replay", "-from", from.Format(time.RFC3339Nano)); code != 1 || !strings.Contains(out, "no sent row in it") {
		t.Errorf("a replay with nothing sent exited %d, want 1 and ErrNotKept:\n%s", code, out)
	}
}

// proxy forwards TCP connections to the test's PostgreSQL, on its Unix
// socket, until it is cut: then it closes every connection and refuses new
// ones, until it is mended, on the same port.
type proxy struct {
	t      *testing.T
	addr   string
	target string

	mu    sync.Mutex
	ln    net.Listener
	conns []net.Conn
}

func newProxy(t *testing.T) *proxy {
	cfg := pgtest.Config
	p := &proxy{t: t, target: fmt.Sprintf("%s/.s.PGSQL.%d", cfg.Host, cfg.Port)}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p.addr = ln.Addr().String()
	p.serve(ln)
	t.Cleanup(p.cut)
	return p
}

func (p *proxy) serve(ln net.Listener) {
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("unix", p.target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			go func() { io.Copy(s, c); s.Close() }()
			go func() { io.Copy(c, s); c.Close() }()
		}
	}()
}

// cut closes the listener and every connection.
func (p *proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// mend listens again on the same port.
func (p *proxy) mend() {
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.t.Fatal(err)
	}
	p.serve(ln)
}

// /readyz follows the database and the broker: 200 while both answer, 503
// with the reason while the database is cut off or the JetStream server is
// down, 200 again once each is back, the changes logged; and /healthz
// fails while rows wait and no pass has succeeded for -stall-after, and
// mends once they go. (Caught: /readyz 200 for ever once ready, and
// /healthz 200 whatever the relay did.)
func TestRelayProcessReadinessFollowsTheDatabaseAndTheBroker(t *testing.T) {
	e := newEnv(t)
	store := t.TempDir()
	opts := &server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: store, NoSigs: true}
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("the JetStream server did not start")
	}
	t.Cleanup(func() { srv.Shutdown() })
	e.nats().url = srv.ClientURL()
	port := srv.Addr().(*net.TCPAddr).Port
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	db := newProxy(t)
	cfg := pgtest.Config
	through := fmt.Sprintf("host=127.0.0.1 port=%s user=%s dbname=%s sslmode=disable connect_timeout=5",
		strings.Split(db.addr, ":")[1], cfg.User, e.name)
	addr := freeAddr(t)
	p := e.start("run", "-database", through, "-http", addr, "-check-every", "50ms", "-stall-after", "1s", "-max-backoff", "200ms")
	readyz := func(want int, body string) func() bool {
		return func() bool {
			code, b := get("http://" + addr + "/readyz")
			return code == want && strings.Contains(b, body)
		}
	}
	waitFor(t, "/readyz 200", readyz(200, "ready"))

	db.cut()
	waitFor(t, "/readyz 503 with the database cut off", readyz(503, "not ready"))
	db.mend()
	waitFor(t, "/readyz 200 with the database back", readyz(200, "ready"))

	srv.Shutdown()
	waitFor(t, "/readyz 503 with the broker down", readyz(503, "NATS"))
	e.writeOrders(1)
	waitFor(t, "/healthz 503: a row waits and no pass succeeds", func() bool {
		code, b := get("http://" + addr + "/healthz")
		return code == 503 && strings.Contains(b, "stalled: 1 rows wait")
	})
	opts.Port = port
	if srv, err = server.NewServer(opts); err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("the JetStream server did not start again")
	}
	waitFor(t, "/readyz 200 with the broker back", readyz(200, "ready"))
	waitFor(t, "the row sent", func() bool { return e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0 })
	waitFor(t, "/healthz 200 again", func() bool { code, _ := get("http://" + addr + "/healthz"); return code == 200 })
	for _, want := range []string{`"msg":"outbox-relay: not ready"`, `"msg":"outbox-relay: ready again"`} {
		if !strings.Contains(p.stderr.String(), want) {
			t.Errorf("the relay did not log %s:\n%s", want, p.stderr)
		}
	}
}

// A second log-mode relay on the slot another reads stands by: its /readyz
// answers 200 and says it is a standby, its log says so at INFO and logs
// nothing at ERROR, and it takes over once the first stops. A
// -processed-retention shorter than the stream keeps its messages is
// refused at start. (Caught: a standby answered "ready" while it logged
// "slot is active" at ERROR; a short retention was only logged at each
// cleanup.)
func TestRelayProcessStandsByBehindAnotherOnTheSlot(t *testing.T) {
	e := newEnv(t)
	if code, out := e.runOnce("migrate", "-mode", "log"); code != 0 {
		t.Fatalf("migrate -mode log exited %d:\n%s", code, out)
	}
	t.Cleanup(func() { // after the relays' processes are gone: their sessions end a moment later
		waitFor(t, "the slot dropped", func() bool {
			return !errors.Is(e.outbox.DropLogSlot(context.Background(), "outbox"), postgres.ErrSlotActive)
		})
	})
	if code, out := e.runOnce("run", "-processed-retention", "1h"); code != 1 || !strings.Contains(out, "-processed-retention 1h0m0s: shorter than stream OUTBOX keeps its messages") {
		t.Errorf("run -processed-retention 1h exited %d, want 1 and the refusal:\n%s", code, out)
	}
	first, second := freeAddr(t), freeAddr(t)
	active := e.start("run", "-mode", "log", "-http", first)
	waitFor(t, "the first relay ready", func() bool { code, b := get("http://" + first + "/readyz"); return code == 200 && b == "ready\n" })
	e.writeOrders(1)
	waitFor(t, "the first relay to deliver", func() bool { return e.streamMsgs() == 1 })
	standby := e.start("run", "-mode", "log", "-http", second)
	waitFor(t, "the second relay to say it stands by", func() bool {
		code, b := get("http://" + second + "/readyz")
		return code == 200 && strings.Contains(b, "standby")
	})
	if err := active.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := active.wait(t); code != 0 {
		t.Fatalf("the first relay exited %d:\n%s", code, active.stderr)
	}
	e.writeOrders(1)
	waitFor(t, "the standby to take over and deliver", func() bool { return e.streamMsgs() == 2 })
	waitFor(t, "its /readyz to drop the standby", func() bool { code, b := get("http://" + second + "/readyz"); return code == 200 && b == "ready\n" })
	if err := standby.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	standby.wait(t)
	log := standby.stderr.String()
	if !strings.Contains(log, `"level":"INFO","msg":"outbox: log relay standing by`) || strings.Contains(log, `"level":"ERROR"`) {
		t.Errorf("the standby's log, want standing by at INFO and nothing at ERROR:\n%s", log)
	}
}
