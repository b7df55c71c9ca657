package rabbitbroker_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/consumer"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

// The consumer keeps its own records bounded (ConsumerOptions.Retention):
// with a Keep of 2 s it deletes the keys of the first five messages once
// they are older, keeps the next five, and a copy of one of those, sent
// again by a relay inside the Keep, is still dropped by its key. (Caught:
// keys kept for ever, left for each consumer to delete on a schedule of
// its own.)
func TestTheConsumersRecordsStayBoundedByItsRetention(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	records, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, dialer(node.URL()), top.Queue, shop.NewWarehouse(db), rabbitbroker.ConsumerOptions{
		Retention: consumer.Retention{Forget: records, Keep: 2 * time.Second, Every: 100 * time.Millisecond}})
	goRun(t, c.Run)
	publisher := newPublisher(t, node.URL(), top, 0)
	publish := func(keys ...string) {
		t.Helper()
		for i, k := range keys {
			msg := postgres.Message{Key: k, ID: int64(i + 1), Type: "CustomerRegistered", Payload: `{}`}
			if err := publisher.Publish(ctx, msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	keys := func(prefix string) []string {
		var ks []string
		for i := 1; i <= 5; i++ {
			ks = append(ks, fmt.Sprintf("%s%d", prefix, i))
		}
		return ks
	}
	publish(keys("a")...)
	waitFor(t, "the first five applied", func() bool { return c.Applied() == 5 })
	waitFor(t, "the first five keys forgotten", func() bool {
		return count(t, db, `SELECT count(*) FROM processed_messages`) == 0
	})
	publish(keys("b")...)
	waitFor(t, "the next five applied", func() bool { return c.Applied() == 10 })
	publish("b1") // a copy, as a relay sends one again
	waitFor(t, "the copy dropped", func() bool { return c.Duplicates() == 1 })
	if n := count(t, db, `SELECT count(*) FROM processed_messages`); n != 5 || c.Applied() != 10 || c.Forgotten() < 5 {
		t.Errorf("%d keys kept, %d applied, %d forgotten; want the 5 of the window, 10, at least 5", n, c.Applied(), c.Forgotten())
	}
	t.Logf("applied %d, copies dropped %d, keys forgotten %d, kept %d", c.Applied(), c.Duplicates(), c.Forgotten(),
		count(t, db, `SELECT count(*) FROM processed_messages`))
}
