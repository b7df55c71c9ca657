package natsbroker_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/consumer"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// The consumer's retention follows the stream's: with a stream that keeps
// messages 3 s, ForgetProcessed refuses a retention of 1 s, and with 3 s it
// forgets only a key older than anything the stream holds. A new consumer
// then replays the stream from its start, and the warehouse applies none of
// it again. (Caught: a ForgetProcessed without the check, which forgot the
// key of a message the stream still held, and the replay applied it again.)
func TestReplayAfterCleanupAppliesNothingTwice(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := createStream(t, b.url(), func(cfg *jetstream.StreamConfig) {
		cfg.Duplicates, cfg.MaxAge = time.Second, 3*time.Second
	})
	warehouse := shop.NewWarehouse(db)
	// A message without an aggregate, so that only its key can tell a copy.
	msg := postgres.Message{Key: "k-stored", ID: 1, Type: "CustomerRegistered", Payload: `{}`}
	if err := publisherOf(t, natsbroker.DefaultNames, js).Publish(ctx, msg); err != nil {
		t.Fatal(err)
	}
	replay := func(name string) (applied int64) {
		t.Helper()
		cons, err := js.CreateOrUpdateConsumer(ctx, natsbroker.Stream, natsbroker.ConsumerConfig(name, 0))
		if err != nil {
			t.Fatal(err)
		}
		rec := newRecorder(warehouse)
		stop := goRun(t, newConsumer(t, cons, rec, natsbroker.ConsumerOptions{}).Run)
		waitFor(t, "consumer "+name+" through the stream", func() bool {
			info, err := cons.Info(ctx)
			return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && rec.calls.Load() > 0
		})
		stop()
		return rec.applied.Load()
	}
	if n := replay("first"); n != 1 {
		t.Fatalf("the first consumer applied %d messages, want 1", n)
	}
	// The stored message's key is 2 s old, younger than the stream's 3 s;
	// another key is older than anything the stream can hold.
	if _, err := db.Exec(`UPDATE processed_messages SET processed_at = now() - interval '2 seconds';
		INSERT INTO processed_messages (message_key, processed_at) VALUES ('k-gone', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	records, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := natsbroker.ForgetProcessed(ctx, js, natsbroker.Stream, records, time.Second); !errors.Is(err, natsbroker.ErrRetentionTooShort) {
		t.Fatalf("ForgetProcessed with 1 s against a stream of 3 s = %v, want ErrRetentionTooShort", err)
	}
	if n, err := natsbroker.ForgetProcessed(ctx, js, natsbroker.Stream, records, 3*time.Second); n != 1 || err != nil {
		t.Fatalf("ForgetProcessed with 3 s = %d, %v; want 1 (k-gone), <nil>", n, err)
	}
	if n := replay("replay"); n != 0 {
		t.Errorf("a replay of the stream after cleanup applied %d messages again, want 0", n)
	}
}

// The consumer keeps its own records bounded (ConsumerOptions.Retention):
// Run refuses, deleting nothing, a Keep shorter than the stream keeps its
// messages; with a Keep of the stream's MaxAge (3 s) it deletes the keys
// of the first five messages once they are older, keeps the next five,
// and a copy of one of those, delivered inside the window, is still
// dropped by its key. (Caught: keys kept for ever, left for each consumer
// to delete on a schedule of its own.)
func TestTheConsumersRecordsStayBoundedByItsRetention(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, stream := createStream(t, b.url(), func(cfg *jetstream.StreamConfig) {
		cfg.Duplicates, cfg.MaxAge = 100*time.Millisecond, 3*time.Second
	})
	records, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO processed_messages (message_key, processed_at) VALUES ('k-old', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, natsbroker.Stream, natsbroker.ConsumerConfig("bounded", 0))
	if err != nil {
		t.Fatal(err)
	}
	short := newConsumer(t, cons, newRecorder(shop.NewWarehouse(db)), natsbroker.ConsumerOptions{JetStream: js,
		Retention: consumer.Retention{Forget: records, Keep: time.Second}})
	if err := short.Run(ctx); !errors.Is(err, consumer.ErrRetentionTooShort) {
		t.Fatalf("Run with a Keep of 1 s on a stream that keeps 3 s = %v; want ErrRetentionTooShort", err)
	}
	if n := count(t, db, `SELECT count(*) FROM processed_messages`); n != 1 {
		t.Fatalf("the refused Run left %d keys; want the 1 it found", n)
	}
	rec := newRecorder(shop.NewWarehouse(db))
	c := newConsumer(t, cons, rec, natsbroker.ConsumerOptions{JetStream: js,
		Retention: consumer.Retention{Forget: records, Keep: 3 * time.Second, Every: 100 * time.Millisecond}})
	goRun(t, c.Run)
	publisher := publisherOf(t, natsbroker.DefaultNames, js)
	publish := func(prefix string, from int) {
		t.Helper()
		for i := from; i < from+5; i++ {
			msg := postgres.Message{Key: fmt.Sprintf("%s%d", prefix, i), ID: int64(i), Type: "CustomerRegistered", Payload: `{}`}
			if err := publisher.Publish(ctx, msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	publish("a", 1)
	waitFor(t, "the first five applied", func() bool { return c.Applied() == 5 })
	waitFor(t, "the first five keys, and the old one, forgotten", func() bool {
		return count(t, db, `SELECT count(*) FROM processed_messages`) == 0
	})
	publish("b", 6)
	waitFor(t, "the next five applied", func() bool { return c.Applied() == 10 })
	// A copy of b6, past the stream's duplicate window (100 ms) and inside
	// the retention: the stream takes it, and the consumer drops it.
	before := streamMessages(t, stream)
	waitFor(t, "the stream to take a copy of b6", func() bool {
		if err := publisher.Publish(ctx, postgres.Message{Key: "b6", ID: 6, Type: "CustomerRegistered", Payload: `{}`}); err != nil {
			t.Fatal(err)
		}
		return streamMessages(t, stream) > before
	})
	waitFor(t, "the copy dropped", func() bool { return c.Duplicates() == 1 })
	if n := count(t, db, `SELECT count(*) FROM processed_messages`); n != 5 || c.Applied() != 10 || rec.duplicateApplied.Load() != 0 {
		t.Errorf("%d keys kept, %d applied, %d applied twice; want the 5 of the window, 10, none", n, c.Applied(), rec.duplicateApplied.Load())
	}
	if c.Forgotten() < 6 {
		t.Errorf("Forgotten = %d; want the 6 keys deleted", c.Forgotten())
	}
	t.Logf("applied %d, copies dropped %d, keys forgotten %d, kept %d", c.Applied(), c.Duplicates(), c.Forgotten(),
		count(t, db, `SELECT count(*) FROM processed_messages`))
}
