package natsbroker_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
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
