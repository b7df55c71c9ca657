package kafkabroker_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// batchCounter is a warehouse that counts the batches it is handed.
type batchCounter struct {
	*shop.Warehouse
	mu    sync.Mutex
	sizes []int
}

func (b *batchCounter) HandleBatch(ctx context.Context, msgs []postgres.Message) ([]bool, error) {
	b.mu.Lock()
	b.sizes = append(b.sizes, len(msgs))
	b.mu.Unlock()
	return b.Warehouse.HandleBatch(ctx, msgs)
}

// With MaxBatch, a partition's records taken in a row from a poll are
// applied in one HandleBatch (postgres.Outbox.ApplyBatch: one transaction
// for them all). A record in the middle that is no outbox message makes
// its batch fail, having written nothing; its records are then handled
// one at a time: that record is set aside, the rest applied, each once and
// in order, and the group's offset goes past them all.
func TestBatchesApplyInOneTransactionAndOneBadRecordHoldsNoneUp(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(1, nil)
	db := newDatabase(t)
	orders := shop.NewOrderService(db)
	place := func(n int) {
		for i := 1; i <= n; i++ {
			id, err := orders.PlaceOrder(ctx, int64(100*i))
			if err != nil {
				t.Fatal(err)
			}
			if i%4 == 0 {
				if err := orders.CancelOrder(ctx, id); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := ob.NewRelay(newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic}), postgres.RelayConfig{})
	if err != nil {
		t.Fatal(err)
	}
	place(20)
	drain(t, relay)
	if err := c.client().ProduceSync(ctx, &kgo.Record{Topic: topic, Key: []byte("order/x"), Value: []byte("no headers")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	place(20)
	drain(t, relay)

	var logs logBuffer
	h := &batchCounter{Warehouse: shop.NewWarehouse(db)}
	_, consumer := runConsumerWith(t, c, "batches", topic, h, kafkabroker.ConsumerOptions{MaxBatch: 25, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	waitFor(t, "every event applied", func() bool { return count(t, db, `SELECT count(*) FROM processed_messages`) == 50 })
	waitFor(t, "the bad record set aside", func() bool { return consumer.SetAside() == 1 })
	if n := count(t, db, `SELECT count(*) FROM reservations`); n != 30 {
		t.Errorf("%d reservations; want the 30 orders not cancelled", n)
	}
	h.mu.Lock()
	sizes := append([]int(nil), h.sizes...)
	h.mu.Unlock()
	big := 0
	for _, n := range sizes {
		if n > 1 {
			big++
		}
	}
	t.Logf("batches handed to HandleBatch: %v; applied %d, set aside %d", sizes, consumer.Applied(), consumer.SetAside())
	if big == 0 || consumer.Applied() != 50 || consumer.Duplicates() != 0 {
		t.Errorf("batches %v, applied %d, duplicates %d; want some batch of more than one record, 50 applied, no copy", sizes, consumer.Applied(), consumer.Duplicates())
	}
	if lines := strings.Count(logs.String(), `msg="message set aside: it can never be applied"`); lines != 1 || !strings.Contains(logs.String(), "offset=25") {
		t.Errorf("the log's set-aside lines (%d) do not name the bad record at offset 25:\n%s", lines, logs.String())
	}
}
