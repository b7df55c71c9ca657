package main

// The relay as operators run it: a process of its own, built here, against
// a throwaway PostgreSQL (pgtest) and a JetStream server embedded in the
// test with its store in a temporary folder.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// The relay as a process: migrate provisions the schema and the stream;
// run serves /readyz once they check out, relays rows written while it
// runs, and on SIGTERM mid-traffic returns once what the broker accepted is
// marked, exiting 0; started again, it sends what was left. Every row
// written reaches the stream exactly once (its duplicate window drops the
// copy of a message in flight at the stop), the lag is back to zero, and
// the scheduled cleanup deletes the sent rows. (Caught: no relay to deploy
// at all.)
func TestRelayProcessStopsOnSIGTERMAndStartsAgainLosingNothing(t *testing.T) {
	e := newEnv(t)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	addr := freeAddr(t)
	// Consumers' keys older than the stream keeps its messages (a week),
	// which the cleanup forgets, and a recent one, which it keeps.
	if _, err := e.db.Exec(`INSERT INTO processed_messages (message_key, processed_at)
		VALUES ('old-1', now() - interval '8 days'), ('old-2', now() - interval '9 days'), ('recent', now())`); err != nil {
		t.Fatal(err)
	}
	relayArgs := []string{"run", "-http", addr, "-retention", "1ms", "-cleanup-every", "100ms", "-processed-retention", "169h"}
	first := e.start(relayArgs...)
	waitFor(t, "/readyz to answer 200", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })

	ctx := context.Background()
	var written atomic.Int64
	stop := make(chan struct{})
	produced := make(chan error, 1)
	go func() { // one order at a time, its event in its transaction, until stopped
		for {
			select {
			case <-stop:
				produced <- nil
				return
			default:
			}
			err := postgres.Transaction(ctx, e.db, func(ctx context.Context, tx *sql.Tx) error {
				_, err := e.outbox.Write(ctx, tx, postgres.Event{Type: "OrderPlaced",
					Payload: map[string]int64{"orderId": written.Load() + 1}, Aggregate: fmt.Sprintf("order/%d", written.Load()+1), Seq: 1})
				return err
			})
			if err != nil {
				produced <- err
				return
			}
			written.Add(1)
		}
	}()
	waitFor(t, "100 messages in the stream", func() bool { return e.streamMsgs() >= 100 })
	if _, body := get("http://" + addr + "/metrics"); !strings.Contains(body, "outbox_unsent") ||
		!strings.Contains(body, "outbox_relay_pass_duration_seconds_bucket") {
		t.Errorf("/metrics lacks the lag gauge or the pass histogram:\n%.2000s", body)
	}
	if err := first.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := first.wait(t); code != 0 {
		t.Fatalf("after SIGTERM the relay exited %d; it said:\n%s", code, first.stderr)
	}
	if !strings.Contains(first.stderr.String(), `"msg":"outbox-relay: stopped"`) {
		t.Errorf("the relay did not log its stop:\n%s", first.stderr)
	}
	atStop := written.Load()
	waitFor(t, "50 more rows written while no relay runs", func() bool { return written.Load() >= atStop+50 })

	second := e.start(relayArgs...)
	close(stop)
	if err := <-produced; err != nil {
		t.Fatal(err)
	}
	total := written.Load()
	waitFor(t, "every row in the stream", func() bool { return e.streamMsgs() >= uint64(total) })
	waitFor(t, "the cleanup to delete every sent row", func() bool { return e.count(`SELECT count(*) FROM outbox`) == 0 })
	if got := e.streamMsgs(); got != uint64(total) {
		t.Errorf("the stream holds %d messages for %d rows, want each once", got, total)
	}
	waitFor(t, "the two consumer keys older than the stream's week forgotten", func() bool {
		return e.count(`SELECT count(*) FROM processed_messages`) == 1
	})
	if n := e.count(`SELECT count(*) FROM processed_messages WHERE message_key = 'recent'`); n != 1 {
		t.Errorf("the recent consumer key was forgotten")
	}
	waitFor(t, "the second relay to log a cleanup", func() bool {
		return strings.Contains(second.stderr.String(), `"msg":"outbox-relay: cleanup"`)
	})
	t.Logf("%d rows written, %d while the relay was stopped at SIGTERM after %d; the stream holds %d", total, total-atStop, atStop, e.streamMsgs())
}

// Before migrate, run is alive but not ready, and says why; once migrate
// has run it becomes ready. The operator's commands: parked lists a parked
// row, drop deletes it and logs its key and the reason it was parked, a
// second drop fails; a bad flag is refused before anything starts.
func TestRelayProcessReadinessAndOperatorCommands(t *testing.T) {
	e := newEnv(t)
	// Before its first check ends (a database that accepts the connection
	// and never answers holds it for the check's 10 s), /readyz is 503.
	// (Caught: /readyz 200 until the first check said otherwise.)
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	go func() {
		for {
			conn, err := silent.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { conn.Close() })
		}
	}()
	early := freeAddr(t)
	hung := e.start("run", "-http", early, "-database", "host=127.0.0.1 port="+fmt.Sprint(silent.Addr().(*net.TCPAddr).Port)+" user=nobody sslmode=disable")
	waitFor(t, "/healthz to answer while the first check hangs", func() bool { code, _ := get("http://" + early + "/healthz"); return code == 200 })
	if code, body := get("http://" + early + "/readyz"); code != 503 || !strings.Contains(body, "not checked yet") {
		t.Errorf("/readyz before the first check ended = %d %q, want 503 not checked yet", code, body)
	}
	hung.cmd.Process.Kill()

	addr := freeAddr(t)
	e.start("run", "-http", addr)
	waitFor(t, "/healthz to answer", func() bool { code, _ := get("http://" + addr + "/healthz"); return code == 200 })
	waitFor(t, "/readyz to say why it is not ready", func() bool {
		code, body := get("http://" + addr + "/readyz")
		if code != 503 {
			t.Fatalf("/readyz before migrate = %d %q, want 503", code, body)
		}
		return strings.Contains(body, "outbox_migrations")
	})
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	waitFor(t, "/readyz to answer 200 after migrate", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })

	var id int64
	var key string
	if err := e.db.QueryRow(`INSERT INTO outbox (type, payload, rejections, last_error, parked_at)
		VALUES ('OrderPlaced', '{"orderId":1}', 5, 'payload over the stream''s limit', clock_timestamp())
		RETURNING id, message_key`).Scan(&id, &key); err != nil {
		t.Fatal(err)
	}
	if code, out := e.runOnce("parked"); code != 0 || !strings.Contains(out, key) {
		t.Errorf("parked exited %d and said %q; want the parked row's key %s", code, out, key)
	}
	code, out := e.runOnce("drop", fmt.Sprint(id))
	if code != 0 || !strings.Contains(out, key) || !strings.Contains(out, `payload over the stream's limit`) {
		t.Errorf("drop exited %d and said %q; want its key and its reason", code, out)
	}
	if n := e.count(`SELECT count(*) FROM outbox`); n != 0 {
		t.Errorf("%d rows left after the drop", n)
	}
	if code, out := e.runOnce("drop", fmt.Sprint(id)); code != 1 || !strings.Contains(out, "no parked outbox row") {
		t.Errorf("a second drop exited %d and said %q; want 1 and ErrNotParked", code, out)
	}
	for _, bad := range [][]string{{"run", "-retention", "-1s"}, {"run", "-mode", "push"}, {"run", "-table", "Bad Name"}, {"run", "-mode", "log", "-standbys", "s1"}, {"drop"}} {
		code, out := e.runOnce(bad...)
		if code == 0 {
			t.Errorf("outbox-relay %v exited 0; want a refusal", bad)
		}
		t.Logf("outbox-relay %v: exit %d: %s", bad, code, strings.TrimSpace(out))
	}
}

// -mode log runs the log relay: migrate creates its slot, run streams the
// rows committed after it, marks them, and cleans them up, its sweep
// delivers what the log cannot, and SIGTERM stops it cleanly.
func TestRelayProcessInLogMode(t *testing.T) {
	e := newEnv(t)
	// A row committed before the slot existed, which the log never
	// carries: the sweep publishes it once it has waited longer than
	// -sweep-every. (Caught: in log mode nothing ran a polling pass, and
	// such a row, or one put back with unpark, waited for ever.)
	ctx := context.Background()
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	if err := postgres.Transaction(ctx, e.db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := e.outbox.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": 99}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if code, out := e.runOnce("migrate", "-mode", "log"); code != 0 {
		t.Fatalf("migrate -mode log exited %d:\n%s", code, out)
	}
	t.Cleanup(func() { // after the relays' processes are gone: their sessions end a moment later
		waitFor(t, "the slot dropped", func() bool {
			return !errors.Is(e.outbox.DropLogSlot(context.Background(), "outbox"), postgres.ErrSlotActive)
		})
	})
	addr := freeAddr(t)
	p := e.start("run", "-mode", "log", "-http", addr, "-retention", "1ms", "-cleanup-every", "100ms", "-sweep-every", "200ms")
	waitFor(t, "/readyz to answer 200", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })
	for i := range 20 {
		if err := postgres.Transaction(ctx, e.db, func(ctx context.Context, tx *sql.Tx) error {
			_, err := e.outbox.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": i + 1}})
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the 20 streamed and the one before the slot swept", func() bool { return e.streamMsgs() == 21 })
	waitFor(t, "the process to log its sweep", func() bool {
		return strings.Contains(p.stderr.String(), `"msg":"outbox-relay: swept unsent rows the log relay had not delivered","published":1`)
	})
	// A row written for an hour on, which the log relay passes over: once
	// its time has come (moved a minute into the past, rather than
	// waited for), a sweep releases it and publishes it.
	if err := postgres.Transaction(ctx, e.db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := e.outbox.Write(ctx, tx, postgres.Event{Type: "ReminderDue", Payload: map[string]int{"orderId": 7},
			DeliverAt: time.Now().Add(time.Hour)})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(`UPDATE outbox SET deliver_at = now() - interval '1 minute' WHERE deliver_at IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the scheduled row swept once its time came", func() bool { return e.streamMsgs() == 22 })
	waitFor(t, "the delivered rows marked and cleaned up", func() bool { return e.count(`SELECT count(*) FROM outbox`) == 0 })
	if _, body := get("http://" + addr + "/metrics"); !strings.Contains(body, `outbox_relay="log"`) ||
		!strings.Contains(body, "messaging_client_sent_messages_total") {
		t.Errorf("/metrics lacks the log relay's sent messages:\n%.3000s", body)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t); code != 0 {
		t.Fatalf("after SIGTERM the log relay exited %d:\n%s", code, p.stderr)
	}

	// The slot gone, as on a promoted standby: run makes it anew and
	// publishes what was committed meanwhile.
	waitFor(t, "the slot free", func() bool {
		return !errors.Is(e.outbox.DropLogSlot(ctx, "outbox"), postgres.ErrSlotActive)
	})
	for i := range 5 {
		if err := postgres.Transaction(ctx, e.db, func(ctx context.Context, tx *sql.Tx) error {
			_, err := e.outbox.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": 21 + i}})
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	again := e.start("run", "-mode", "log")
	waitFor(t, "the 5 rows committed without a slot in the stream", func() bool { return e.streamMsgs() == 27 })
	waitFor(t, "the relay to log its recovery", func() bool {
		return strings.Contains(again.stderr.String(), `"msg":"outbox-relay: slot recovered"`)
	})

	// A second service, its outbox table named as this one's, on another
	// database of the server: the slot "outbox" is this database's, and
	// the second service's migrate and run say so and stop, taking
	// nothing; with a -slot of its own it migrates. (Caught: run took the
	// other database's slot for lost, dropped it and made its own.)
	name := pgtest.NewBlankDatabase(t)
	cfg := pgtest.Config
	other := fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, name)
	for _, cmd := range []string{"migrate", "run"} {
		code, out := e.runOnce(cmd, "-mode", "log", "-database", other)
		if code == 0 || !strings.Contains(out, "belongs to another database") {
			t.Errorf("%s -mode log on a second database exited %d, want a failure naming the other database's slot:\n%s", cmd, code, out)
		}
	}
	var database string
	if err := e.db.QueryRow(`SELECT database FROM pg_replication_slots WHERE slot_name = 'outbox'`).Scan(&database); err != nil || database == name {
		t.Errorf("the first service's slot: database %q, %v; want it kept, the first's", database, err)
	}
	own := name + "_slot"
	if code, out := e.runOnce("migrate", "-mode", "log", "-database", other, "-slot", own); code != 0 {
		t.Errorf("migrate -mode log -slot %s exited %d:\n%s", own, code, out)
	}
	otherDB, err := postgres.OpenDB(pgtest.Open(t, name, ""), postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := otherDB.DropLogSlot(ctx, own); err != nil {
		t.Error(err)
	}
}
