package main

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// applier is a consumer that applies each message once, as the consumer
// "warehouse" of the test's database, and keeps what it applied.
type applier struct {
	outbox *postgres.Outbox[postgres.SQLTx]
	mu     sync.Mutex
	got    []postgres.Message
}

func (a *applier) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	applied, err := a.outbox.ApplyOnce(ctx, msg, postgres.ApplyOptions{}, func(context.Context, postgres.SQLTx) error { return nil })
	if applied {
		a.mu.Lock()
		a.got = append(a.got, msg)
		a.mu.Unlock()
	}
	return applied, err
}

func (a *applier) applied() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.got)
}

// A replay against the real JetStream, inside its duplicate window: with
// the old keys it is refused, naming the window and the way out; allowed,
// it says the stream drops both rows, and the stream does (it stores
// nothing more, the relay marks them sent again). With new keys it says
// the stream takes both, and it stores them; but the consumer, whose
// position of the aggregate is past them, drops them as stale, until
// forget-position has it apply the aggregate again: then a third replay
// reaches it, each event applied once. (Caught: "2 rows put back" for a
// replay the stream dropped, and no command for a consumer's position.)
func TestReplayInsideJetStreamsWindowSaysWhatItTakesAndDrops(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	for seq := int64(1); seq <= 2; seq++ {
		err := postgres.Transaction(ctx, e.db, func(ctx context.Context, tx *sql.Tx) error {
			_, err := e.outbox.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int64{"seq": seq}, Aggregate: "order/1", Seq: seq})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	e.start("run", "-poll-interval", "50ms")
	sent := func(n int64) func() bool {
		return func() bool { return e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`) == n }
	}
	waitFor(t, "both rows sent", sent(2))

	ob, err := postgres.OpenDB(e.db, postgres.Config{Consumer: "warehouse"})
	if err != nil {
		t.Fatal(err)
	}
	warehouse := &applier{outbox: ob}
	c, err := e.nats().js.CreateOrUpdateConsumer(ctx, natsbroker.Stream, natsbroker.ConsumerConfig("warehouse", 0))
	if err != nil {
		t.Fatal(err)
	}
	consumer, err := natsbroker.NewConsumer(c, warehouse, natsbroker.ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- consumer.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-done })
	waitFor(t, "both events applied", func() bool { return warehouse.applied() == 2 })

	code, out := e.runOnce("replay", "-aggregate", "order/1")
	if code != 1 || !strings.Contains(out, "2 of its 2 rows were sent within the broker's duplicate window (2m0s)") ||
		!strings.Contains(out, "-new-keys") || !strings.Contains(out, "-allow-dropped") {
		t.Fatalf("replay inside the window exited %d; want 1, naming the window and the flags:\n%s", code, out)
	}
	if n := e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
		t.Fatalf("a refused replay put back %d rows", n)
	}
	code, out = e.runOnce("replay", "-aggregate", "order/1", "-allow-dropped")
	if code != 0 || !strings.Contains(out, "2 rows put back") || !strings.Contains(out, "nats takes 0 and drops 2 as copies") {
		t.Fatalf("replay -allow-dropped exited %d; want it to say the stream drops both:\n%s", code, out)
	}
	waitFor(t, "both rows sent again", sent(2))
	if n := e.streamMsgs(); n != 2 {
		t.Errorf("the stream holds %d messages after the replay it was said to drop; want 2", n)
	}

	code, out = e.runOnce("replay", "-aggregate", "order/1", "-new-keys")
	if code != 0 || !strings.Contains(out, "nats takes all 2") {
		t.Fatalf("replay -new-keys exited %d; want it to say the stream takes both:\n%s", code, out)
	}
	waitFor(t, "the replay with new keys stored", func() bool { return e.streamMsgs() == 4 })
	waitFor(t, "the consumer to have had them", func() bool {
		info, err := c.Info(ctx)
		return err == nil && info.AckFloor.Stream == 4
	})
	if n := warehouse.applied(); n != 2 {
		t.Fatalf("the consumer, its position past them, applied %d; want the first 2 alone", n)
	}

	code, out = e.runOnce("forget-position", "-consumer", "warehouse", "-aggregate", "order/1")
	if code != 0 || !strings.Contains(out, `warehouse: position of "order/1" forgotten`) {
		t.Fatalf("forget-position exited %d:\n%s", code, out)
	}
	if code, out := e.runOnce("replay", "-aggregate", "order/1", "-new-keys"); code != 0 {
		t.Fatalf("replay -new-keys after forget-position exited %d:\n%s", code, out)
	}
	waitFor(t, "the aggregate applied again", func() bool { return warehouse.applied() == 4 })
	if code, out := e.runOnce("forget-position", "-consumer", "nobody", "-aggregate", "order/1"); code != 0 || !strings.Contains(out, "nothing to forget") {
		t.Errorf("forget-position of a consumer with no position exited %d:\n%s", code, out)
	}
	warehouse.mu.Lock()
	defer warehouse.mu.Unlock()
	for i, m := range warehouse.got {
		if want := int64(i%2 + 1); m.Seq != want {
			t.Errorf("applied #%d is seq %d; want %d", i, m.Seq, want)
		}
	}
}

// A row the broker refuses (a payload over the server's max_payload) is
// named, with its attempts and error, by lag and by /readyz, which still
// answers 200: the relay is ready, and says what holds the rows up. lag's
// count of failing rows says from how many attempts a row is failing, so
// that it does not read "0 failing" beside a row named after 3. (Caught:
// lag said "1 failing" and not which row or why; then "0 failing" above
// "failing: row 7 … after 3 attempts".)
func TestLagAndReadyzNameTheFailingRow(t *testing.T) {
	e := newEnv(t)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	var id int64
	if err := e.db.QueryRow(`INSERT INTO outbox (type, payload, aggregate, seq)
		VALUES ('OrderPlaced', json_build_object('note', repeat('x', 2 << 20)), 'order/9', 1) RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	e.start("run", "-http", addr, "-park-after", "1000", "-retry-delay", "10ms", "-max-retry-delay", "10ms", "-check-every", "50ms")
	want := fmt.Sprintf("first unsent row that failed: row %d (OrderPlaced, aggregate order/9, key ", id)
	waitFor(t, "/readyz to name the row", func() bool {
		code, body := get("http://" + addr + "/readyz")
		return code == 200 && strings.Contains(body, want) && strings.Contains(body, "over the server's max_payload")
	})
	code, out := e.runOnce("lag")
	threshold := fmt.Sprintf("failing (%d or more failed attempts)", postgres.FailingAfter)
	if code != 0 || !strings.Contains(out, want) || !strings.Contains(out, "attempts: message ") || !strings.Contains(out, threshold) {
		t.Errorf("lag exited %d; want the row named with its attempts and error, and the count with its threshold:\n%s", code, out)
	}
	code, out = e.runOnce("lag", "-json")
	if v := jsonLines(t, out); code != 0 || len(v) != 1 || v[0]["blocking"] == nil {
		t.Errorf("lag -json exited %d; want the blocking row:\n%s", code, out)
	}
}
