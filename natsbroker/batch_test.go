package natsbroker_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// batching is a BatchHandler over a warehouse that notes each batch's size
// and each message handled on its own.
type batching struct {
	warehouse *shop.Warehouse
	mu        sync.Mutex
	batches   []int
	alone     map[string]int // Handle's calls, by key
}

func (b *batching) HandleBatch(ctx context.Context, msgs []postgres.Message) ([]bool, error) {
	b.mu.Lock()
	b.batches = append(b.batches, len(msgs))
	b.mu.Unlock()
	return b.warehouse.HandleBatch(ctx, msgs)
}

func (b *batching) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	b.mu.Lock()
	b.alone[msg.Key]++
	b.mu.Unlock()
	return b.warehouse.Handle(ctx, msg)
}

// A consumer with MaxBatch applies what is delivered in batches, one
// transaction each, and a message that can never apply (a payload that is
// not an order) fails only its own: its batch is handled again one message
// at a time, the good ones applied, the bad one terminated. Every message
// is delivered once: nothing acked late, nothing asked for again.
// (Caught: a failed batch acked as a whole, which lost its good messages;
// and one nak'ed as a whole, which delivered them again and again.)
func TestBatchConsumerAppliesInBatchesAndGivesUpOnlyOnTheBadMessage(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 0)
	pub := newPublisher(t, connect(t, b.url()))
	const good = 40
	for i := 1; i <= good+1; i++ {
		m := postgres.Message{ID: int64(i), Type: shop.OrderPlaced, Key: fmt.Sprintf("k%d", i),
			Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":100}`, i)}
		if i == 5 {
			m.Payload = `[1]` // JSON, and no order: it can never apply
		}
		if err := pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	h := &batching{warehouse: shop.NewWarehouse(db), alone: map[string]int{}}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	logs := &logBuffer{}
	c := newConsumer(t, cons, h, natsbroker.ConsumerOptions{MaxBatch: 10, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	goRun(t, c.Run)

	waitFor(t, "every good order reserved and the bad one terminated", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations`) == good &&
			len(logs.lines(`msg="message terminated: it can never be applied"`)) == 1
	})
	waitFor(t, "nothing pending on the JetStream consumer", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	t.Logf("batches %v; handled alone %v; redelivered %d", h.batches, h.alone, info.NumRedelivered)
	if info.NumRedelivered != 0 {
		t.Errorf("%d messages delivered again, want none", info.NumRedelivered)
	}
	if h.alone["k5"] != 1 {
		t.Errorf("the bad message was handled alone %d times, want once (then terminated)", h.alone["k5"])
	}
	if c.Applied() != good || c.Duplicates() != 0 || c.SetAside() != 1 {
		t.Errorf("counted %d applied, %d copies, %d set aside; want %d, 0, 1", c.Applied(), c.Duplicates(), c.SetAside(), good)
	}
	inBatches := 0
	for _, n := range h.batches {
		inBatches += n
	}
	if inBatches != good+1 || len(h.batches) >= good {
		t.Errorf("%d batches held %d messages, want %d messages in fewer than %d batches", len(h.batches), inBatches, good+1, good)
	}
	if n := count(t, db, `SELECT count(*) FROM processed_messages`); n != good {
		t.Errorf("%d messages recorded as applied, want %d", n, good)
	}
}

// Without a BatchHandler, or with MaxBatch 1, the consumer handles one
// message at a time, the article's way, and prefetch is left as set.
func TestConsumerWithoutABatchHandlerHandlesOneAtATime(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 0)
	placeAndPublish(t, db, b.url(), 12)
	h := &batching{warehouse: shop.NewWarehouse(db), alone: map[string]int{}}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	goRun(t, newConsumer(t, cons, h, natsbroker.ConsumerOptions{}).Run) // MaxBatch zero: one at a time
	waitFor(t, "every order reserved", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations`) == 12
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.batches) != 0 || len(h.alone) != 12 {
		t.Errorf("batches %v, handled alone %d; want no batch, 12 alone", h.batches, len(h.alone))
	}
}
