package rabbitbroker_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
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

// A consumer with MaxBatch applies what its workers hold in batches, one
// transaction each, acked with one multiple ack on one worker and one ack
// each on several; a message that can never apply (a payload that is not
// an order) fails only its own batch, which is then handled one message at
// a time: the good ones applied, the bad one dead-lettered. Once the
// consumer stops, the queue is empty: every message was settled, none left
// unacked to come back. (Caught: a multiple ack on several workers, which
// acked another worker's message before it applied; a failed batch acked
// as a whole, which lost its good messages.)
func TestBatchConsumerAppliesInBatchesAndGivesUpOnlyOnTheBadMessage(t *testing.T) {
	for _, workers := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d workers", workers), func(t *testing.T) {
			ctx := context.Background()
			db := newDatabase(t)
			top := declare(t, node.URL(), 3)
			pub := newPublisher(t, node.URL(), top, 0)
			const good = 40
			for i, j := 1, 0; i <= good+1; i++ {
				// Seven aggregates, each spread over several batches.
				m := postgres.Message{ID: int64(i), Type: shop.OrderPlaced, Key: fmt.Sprintf("k%d", i),
					Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":100}`, i), Aggregate: fmt.Sprintf("order/%d", j%7), Seq: int64(j/7 + 1)}
				if i != 5 {
					j++
				} else {
					// JSON, and no order: it can never apply (of no aggregate,
					// so that no successor waits for it)
					m.Payload, m.Aggregate, m.Seq = `[1]`, "", 0
				}
				if err := pub.Publish(ctx, m); err != nil {
					t.Fatal(err)
				}
			}
			h := &batching{warehouse: shop.NewWarehouse(db), alone: map[string]int{}}
			c := newConsumer(t, dialer(node.URL()), top.Queue, h, rabbitbroker.ConsumerOptions{MaxBatch: 10, Prefetch: 50, Concurrency: workers})
			stop := goRun(t, c.Run)
			waitFor(t, "every good order reserved and the bad one dead-lettered", func() bool {
				return count(t, db, `SELECT count(*) FROM reservations`) == good &&
					queued(t, node.URL(), top.DeadLetterQueue()) == 1
			})
			stop()
			if n := queued(t, node.URL(), top.Queue); n != 0 {
				t.Errorf("%d messages back in the queue once the consumer stopped, want 0: all acked", n)
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			t.Logf("batches %v; handled alone %v", h.batches, h.alone)
			if h.alone["k5"] != 1 {
				t.Errorf("the bad message was handled alone %d times, want once (then dead-lettered)", h.alone["k5"])
			}
			if c.Applied() != good || c.DeadLettered() != 1 || c.SetAside() != 1 || c.Duplicates() != 0 {
				t.Errorf("applied %d, dead-lettered %d, duplicates %d; want %d, 1, 0", c.Applied(), c.DeadLettered(), c.Duplicates(), good)
			}
			inBatches := 0
			for _, n := range h.batches {
				inBatches += n
			}
			if inBatches != good+1 || len(h.batches) >= good {
				t.Errorf("%d batches held %d messages, want %d messages in fewer than %d batches", len(h.batches), inBatches, good+1, good)
			}
		})
	}
}
