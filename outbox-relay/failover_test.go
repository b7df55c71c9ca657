package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// The relay process through a failover, never restarted: two hosts in its
// -database with target_session_attrs=read-write, a synchronous standby
// it waits for by number (-standby-count 1, -publish-without-standbys),
// producers writing through the same two hosts. The primary killed:
// /readyz answers 503 while no host takes writes; the standby promoted:
// 200 again, and the process, still the same, publishes what the new
// primary holds. Every row the new primary holds reaches the stream, and
// every event the stream holds is one of them: nothing lost, no phantom.
func TestRelayProcessRunsThroughAFailover(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	primary, standby := startPrimaryAndStandby(t)
	conn := func(hosts ...string) string {
		return fmt.Sprintf("host=%s user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write connect_timeout=2", strings.Join(hosts, ","))
	}
	admin := stdlib.OpenDB(*mustParse(t, conn(primary.Dir)))
	for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = 'standby'`, `SELECT pg_reload_conf()`} {
		if _, err := admin.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the standby streaming, synchronous", func() bool {
		var state string
		return admin.QueryRow(`SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby'`).Scan(&state) == nil && state == "sync"
	})
	admin.Close()

	e.database = conn(primary.Dir, standby.Dir)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	addr := freeAddr(t)
	p := e.start("run", "-http", addr, "-standby-count", "1", "-publish-without-standbys", "-check-every", "50ms",
		"-poll-interval", "50ms", "-max-backoff", "200ms")
	readyz := func() int { code, _ := get("http://" + addr + "/readyz"); return code }
	waitFor(t, "/readyz 200", func() bool { return readyz() == 200 })

	both := stdlib.OpenDB(*mustParse(t, e.database))
	t.Cleanup(func() { both.Close() })
	ob, err := postgres.OpenDB(both, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var written atomic.Int64
	writeCtx, stopWriting := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 1; writeCtx.Err() == nil; i++ {
			err := postgres.Transaction(writeCtx, both, func(ctx context.Context, tx *sql.Tx) error {
				_, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": i}})
				return err
			})
			if err == nil {
				written.Add(1)
				continue
			}
			select { // no server takes writes: a client's pause
			case <-writeCtx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
	})
	t.Cleanup(func() { stopWriting(); wg.Wait() })
	waitFor(t, "100 events written", func() bool { return written.Load() >= 100 })

	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "/readyz 503 while no host takes writes", func() bool { return readyz() == 503 })
	_, body := get("http://" + addr + "/readyz")
	t.Logf("/readyz with the primary gone: %s", strings.TrimSpace(body))
	if err := standby.Ctl("promote"); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	waitFor(t, "/readyz 200 on the new primary", func() bool { return readyz() == 200 })
	t.Logf("/readyz 200 %v after the promotion", time.Since(promoted).Round(time.Millisecond))
	before := written.Load()
	waitFor(t, "100 more events written on the new primary", func() bool { return written.Load() >= before+100 })
	stopWriting()
	wg.Wait()

	newPrimary := stdlib.OpenDB(*mustParse(t, conn(standby.Dir)))
	t.Cleanup(func() { newPrimary.Close() })
	count := func(q string) (n int64) {
		if err := newPrimary.QueryRow(q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor(t, "every row of the new primary sent", func() bool { return count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0 })
	if p.cmd.ProcessState != nil {
		t.Fatalf("the relay process exited: %v", p.cmd.ProcessState)
	}
	rows := count(`SELECT count(*) FROM outbox`)
	waitFor(t, "the stream holding every row", func() bool { return int64(e.streamMsgs()) >= rows })
	if got := int64(e.streamMsgs()); got != rows {
		t.Errorf("the stream holds %d messages; the new primary %d rows: want one each", got, rows)
	}
	t.Logf("%d events acknowledged to the writer, %d rows on the new primary, %d in the stream", written.Load(), rows, e.streamMsgs())
	if rows < written.Load() {
		t.Errorf("%d events acknowledged, %d on the new primary, whose standby was synchronous: lost", written.Load(), rows)
	}
}

// The night setting that needs no choice, with the relay as operators run
// it: a primary and two standbys in a quorum (synchronous_standby_names =
// 'ANY 1 (p, s1, s2)' on every server), the relay waiting for one standby
// (-standby-count 1, and no -publish-without-standbys), producers writing
// through the three hosts. Twice in a row, under load: the primary killed,
// the standby that received the most promoted, the other pointed at it,
// the killed server rebuilt as a standby of the new primary. The process
// runs on, never restarted: every event acknowledged to a producer is on
// the last primary, every row of it reaches the stream once, and the
// stream holds nothing else: no phantom.
func TestRelayProcessRunsThroughTwoFailoversOnAQuorum(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	type node struct {
		name string
		srv  *pgtest.Server
	}
	first, err := pgtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { first.Remove() })
	conn := func(hosts ...string) string {
		return fmt.Sprintf("host=%s user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write connect_timeout=2", strings.Join(hosts, ","))
	}
	admin := stdlib.OpenDB(*mustParse(t, conn(first.Dir)))
	for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = 'ANY 1 (p, s1, s2)'`, `SELECT pg_reload_conf()`} {
		if _, err := admin.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	admin.Close()
	nodes := []*node{{"p", first}}
	for _, name := range []string{"s1", "s2"} {
		s, err := first.StartStandby(name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Remove() })
		nodes = append(nodes, &node{name, s})
	}
	streaming := func(primary *node, names ...string) {
		t.Helper()
		db := stdlib.OpenDB(*mustParse(t, conn(primary.srv.Dir)))
		defer db.Close()
		waitFor(t, strings.Join(names, " and ")+" streaming in the quorum", func() bool {
			var n int
			err := db.QueryRow(`SELECT count(*) FROM pg_stat_replication WHERE application_name = ANY($1) AND state = 'streaming' AND sync_state = 'quorum'`,
				names).Scan(&n)
			return err == nil && n == len(names)
		})
	}
	primary := nodes[0]
	streaming(primary, "s1", "s2")
	e.database = conn(first.Dir, nodes[1].srv.Dir, nodes[2].srv.Dir)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	addr := freeAddr(t)
	p := e.start("run", "-http", addr, "-standby-count", "1", "-check-every", "50ms", "-poll-interval", "50ms", "-max-backoff", "200ms")
	waitFor(t, "/readyz 200", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })

	all := stdlib.OpenDB(*mustParse(t, e.database))
	t.Cleanup(func() { all.Close() })
	ob, err := postgres.OpenDB(all, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var written atomic.Int64
	writeCtx, stopWriting := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for writeCtx.Err() == nil {
				err := postgres.Transaction(writeCtx, all, func(ctx context.Context, tx *sql.Tx) error {
					_, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int64{"orderId": written.Load()}})
					return err
				})
				if err == nil {
					written.Add(1)
					continue
				}
				select { // no server takes writes: a client's pause
				case <-writeCtx.Done():
				case <-time.After(20 * time.Millisecond):
				}
			}
		})
	}
	t.Cleanup(func() { stopWriting(); wg.Wait() })
	more := func(n int64) {
		t.Helper()
		want := written.Load() + n
		waitFor(t, fmt.Sprintf("%d more events written", n), func() bool { return written.Load() >= want })
	}
	more(100)
	for round := 1; round <= 2; round++ {
		var standbys []*node
		for _, n := range nodes {
			if n != primary {
				standbys = append(standbys, n)
			}
		}
		if err := primary.srv.Kill(); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		next, other := standbys[0], standbys[1]
		a, errA := next.srv.Received(ctx)
		b, errB := other.srv.Received(ctx)
		if err := errors.Join(errA, errB); err != nil {
			t.Fatal(err)
		}
		if b > a {
			next, other = other, next
		}
		if err := next.srv.Ctl("promote"); err != nil {
			t.Fatal(err)
		}
		if err := other.srv.Follow(ctx, next.srv, other.name); err != nil {
			t.Fatal(err)
		}
		streaming(next, other.name)
		more(100)
		t.Logf("quorum, the relay process: failover %d: %s promoted, %s following it; 100 events written on it %v after the kill",
			round, next.name, other.name, time.Since(killed).Round(time.Millisecond))
		if err := primary.srv.Rebuild(next.srv, primary.name); err != nil {
			t.Fatal(err)
		}
		streaming(next, other.name, primary.name)
		primary = next
	}
	stopWriting()
	wg.Wait()

	last := stdlib.OpenDB(*mustParse(t, conn(primary.srv.Dir)))
	t.Cleanup(func() { last.Close() })
	count := func(q string) (n int64) {
		if err := last.QueryRow(q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor(t, "every row of the last primary sent", func() bool { return count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0 })
	if p.cmd.ProcessState != nil {
		t.Fatalf("the relay process exited: %v", p.cmd.ProcessState)
	}
	rows := count(`SELECT count(*) FROM outbox`)
	waitFor(t, "the stream holding every row", func() bool { return int64(e.streamMsgs()) >= rows })
	t.Logf("quorum, the relay process, twice: %d events acknowledged, %d rows on the last primary, %d in the stream",
		written.Load(), rows, e.streamMsgs())
	if got := int64(e.streamMsgs()); got != rows {
		t.Errorf("the stream holds %d messages, the last primary %d rows: want one each, no phantom", got, rows)
	}
	if rows < written.Load() {
		t.Errorf("%d events acknowledged, %d on the last primary: lost, on a synchronous quorum", written.Load(), rows)
	}
}

// startPrimaryAndStandby starts a throwaway PostgreSQL of t's own and a
// streaming standby of it named standby, both removed when t ends.
func startPrimaryAndStandby(t *testing.T) (primary, standby *pgtest.Server) {
	t.Helper()
	primary, err := pgtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { primary.Remove() })
	if standby, err = primary.StartStandby("standby"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Remove() })
	return primary, standby
}

// mustParse is pgx's config of a connection string.
func mustParse(t *testing.T, conn string) *pgx.ConnConfig {
	t.Helper()
	cfg, err := pgx.ParseConfig(conn)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// Settings the servers cannot meet are named, and nothing is published
// ahead of them: -standby-count 2 with one standby streaming keeps /readyz
// at 503, saying so, and the relay publishes nothing; a -database whose
// hosts take no writes fails check's database line, naming why.
func TestRelayProcessNamesWhatItsServersLack(t *testing.T) {
	e := newEnv(t)
	primary, standby := startPrimaryAndStandby(t)
	e.database = fmt.Sprintf("host=%s user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write", primary.Dir)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	db := stdlib.OpenDB(*mustParse(t, e.database))
	t.Cleanup(func() { db.Close() })
	waitFor(t, "the standby streaming", func() bool {
		var n int
		return db.QueryRow(`SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'`).Scan(&n) == nil && n == 1
	})
	if _, err := db.Exec(`INSERT INTO outbox (type, payload) VALUES ('OrderPlaced', '{}')`); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	e.start("run", "-http", addr, "-standby-count", "2", "-check-every", "50ms")
	want := "the primary has 1 standbys streaming, and -standby-count wants 2"
	waitFor(t, "/readyz 503 naming the standbys", func() bool {
		code, body := get("http://" + addr + "/readyz")
		return code == 503 && strings.Contains(body, want)
	})
	if n := e.streamMsgs(); n != 0 {
		t.Errorf("the stream holds %d messages published ahead of the standbys", n)
	}
	if code, out := e.runOnce("check", "-standby-count", "2"); code != 1 || !strings.Contains(out, want) {
		t.Errorf("check -standby-count 2 exited %d; want it named:\n%s", code, out)
	}
	code, out := e.runOnce("check", "-database", fmt.Sprintf("host=%s user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write", standby.Dir))
	if code != 1 || !strings.Contains(out, "FAIL  database") || !strings.Contains(out, "read only connection") {
		t.Errorf("check with a host that takes no writes exited %d; want the database line failing, naming why:\n%s", code, out)
	}
}
