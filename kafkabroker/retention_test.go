package kafkabroker_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/consumer"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// The consumer keeps its own records bounded (ConsumerOptions.Retention):
// Run refuses a Keep shorter than the topic's retention.ms, or any Keep on
// a topic that keeps its records for ever; with a Keep of the topic's
// retention (3 s) it deletes the keys of the first five messages once they
// are older, keeps the next five, and a copy of one of those, sent again by
// a relay inside the window, is still dropped by its key. (Caught: keys
// kept for ever, left for each consumer to delete on a schedule of its
// own.)
func TestTheConsumersRecordsStayBoundedByItsRetention(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	db := newDatabase(t)
	records, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	forever := c.topic(1, map[string]string{"retention.ms": "-1"})
	topic := c.topic(1, map[string]string{"retention.ms": "3000"})
	for _, refused := range []struct {
		topic string
		keep  time.Duration
	}{{forever, time.Hour}, {topic, time.Second}} {
		cons, err := kafkabroker.NewConsumer(shop.NewWarehouse(db), kafkabroker.ConsumerOptions{
			Retention: consumer.Retention{Forget: records, Keep: refused.keep}}, c.memberOptions("refused", refused.topic)...)
		if err != nil {
			t.Fatal(err)
		}
		if err := cons.Run(ctx); !errors.Is(err, consumer.ErrRetentionTooShort) {
			t.Errorf("Run with a Keep of %v on a topic of %s = %v; want ErrRetentionTooShort", refused.keep, refused.topic, err)
		}
	}
	_, cons := runConsumerWith(t, c, "bounded", topic, shop.NewWarehouse(db), kafkabroker.ConsumerOptions{
		Retention: consumer.Retention{Forget: records, Keep: 3 * time.Second, Every: 100 * time.Millisecond}})
	publisher, err := kafkabroker.NewPublisher(c.client(), kafkabroker.PublisherOptions{Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
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
	waitFor(t, "the first five applied", func() bool { return cons.Applied() == 5 })
	waitFor(t, "the first five keys forgotten", func() bool {
		return count(t, db, `SELECT count(*) FROM processed_messages`) == 0
	})
	publish(keys("b")...)
	waitFor(t, "the next five applied", func() bool { return cons.Applied() == 10 })
	publish("b1") // a copy, as a relay sends one again
	waitFor(t, "the copy dropped", func() bool { return cons.Duplicates() == 1 })
	if n := count(t, db, `SELECT count(*) FROM processed_messages`); n != 5 || cons.Applied() != 10 || cons.Forgotten() < 5 {
		t.Errorf("%d keys kept, %d applied, %d forgotten; want the 5 of the window, 10, at least 5", n, cons.Applied(), cons.Forgotten())
	}
	t.Logf("applied %d, copies dropped %d, keys forgotten %d, kept %d", cons.Applied(), cons.Duplicates(), cons.Forgotten(),
		count(t, db, `SELECT count(*) FROM processed_messages`))
}
