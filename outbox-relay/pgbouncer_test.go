package main

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// startPgBouncer starts a PgBouncer of the test's own, in transaction
// pooling, in front of the test's PostgreSQL (pgtest.StartPgBouncer), and
// returns its port.
func startPgBouncer(t *testing.T) int {
	t.Helper()
	cfg := pgtest.Config
	return pgtest.StartPgBouncer(t, cfg.Host, cfg.Port, cfg.User)
}

// The relay with -poll-only behind a real PgBouncer in transaction
// pooling, with the producers behind it too (pgx's simple protocol, since
// PgBouncer 1.18 keeps no prepared statements across transactions):
// every row reaches the stream exactly once, in order, as without it, and
// (-cloudevents-source /shop) as a CloudEvent with its key as ce-id; a
// SIGTERM stops it cleanly. migrate goes to PostgreSQL itself: its
// advisory lock is a session's. (Caught: no flag for PollOnly, which the
// docs tell a team behind PgBouncer to set.)
func TestRelayProcessBehindPgBouncerInTransactionMode(t *testing.T) {
	e := newEnv(t)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	port := startPgBouncer(t)
	cfg := pgtest.Config
	pooled := fmt.Sprintf("host=127.0.0.1 port=%d user=%s dbname=%s sslmode=disable default_query_exec_mode=simple_protocol", port, cfg.User, e.name)
	pc, err := pgx.ParseConfig(pooled)
	if err != nil {
		t.Fatal(err)
	}
	producers := stdlib.OpenDB(*pc)
	t.Cleanup(func() { producers.Close() })
	ob, err := postgres.OpenDB(producers, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	write := func(from, n int) {
		t.Helper()
		for i := from; i < from+n; i++ {
			if err := postgres.Transaction(context.Background(), producers, func(ctx context.Context, tx *sql.Tx) error {
				_, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": i},
					Aggregate: fmt.Sprintf("order/%d", i%7), Seq: int64(i/7 + 1)})
				return err
			}); err != nil {
				t.Fatal(err)
			}
		}
	}
	write(0, 100)
	addr := freeAddr(t)
	p := e.start("run", "-database", pooled, "-poll-only", "-poll-interval", "50ms", "-http", addr, "-cloudevents-source", "/shop")
	waitFor(t, "/readyz 200 behind PgBouncer", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })
	write(100, 100)
	waitFor(t, "the 200 rows in the stream", func() bool { return e.streamMsgs() >= 200 })
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t); code != 0 {
		t.Fatalf("after SIGTERM the relay behind PgBouncer exited %d:\n%s", code, p.stderr)
	}
	if n := e.streamMsgs(); n != 200 {
		t.Errorf("the stream holds %d messages for 200 rows, want each once", n)
	}
	if n := e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
		t.Errorf("%d rows unsent", n)
	}
	// Each aggregate's events in the stream in their order.
	s, err := e.nats().js.Stream(context.Background(), natsbroker.Stream)
	if err != nil {
		t.Fatal(err)
	}
	last := map[string]int64{}
	for seq := uint64(1); seq <= 200; seq++ {
		m, err := s.GetMsg(context.Background(), seq)
		if err != nil {
			t.Fatal(err)
		}
		if m.Header.Get("ce-id") != m.Header.Get("Nats-Msg-Id") || m.Header.Get("ce-source") != "/shop" || m.Header.Get("ce-specversion") != "1.0" {
			t.Errorf("stream message %d is no CloudEvent of source /shop with its key as id (-cloudevents-source /shop): %v", seq, m.Header)
		}
		agg, n := m.Header.Get(natsbroker.HeaderAggregate), m.Header.Get(natsbroker.HeaderSeq)
		got, _ := strconv.ParseInt(n, 10, 64)
		if got != last[agg]+1 {
			t.Errorf("stream message %d: %s seq %d after %d", seq, agg, got, last[agg])
		}
		last[agg] = got
	}
	if strings.Contains(p.stderr.String(), `"level":"ERROR"`) {
		t.Errorf("the relay behind PgBouncer logged errors:\n%s", p.stderr)
	}
}
