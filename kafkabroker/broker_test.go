package kafkabroker_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// newPublisher is a Publisher to topic over a client of its own.
func newPublisher(t testing.TB, c *cluster, opts kafkabroker.PublisherOptions) *kafkabroker.Publisher {
	t.Helper()
	p, err := kafkabroker.NewPublisher(c.client(), opts)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// drain runs relay passes until none publishes anything.
func drain(t testing.TB, relay *postgres.OutboxRelay) {
	t.Helper()
	for {
		n, err := relay.PublishPending(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			return
		}
	}
}

// The shop's orders through Kafka end to end: 60 orders placed, every
// third cancelled, so that an order's two events must keep their order;
// the polling relay publishes them through the Publisher (acks=all, the
// aggregate as the record's key) to a topic of six partitions; two
// consumers of one group, each a warehouse, apply them. Every order is
// reserved, every cancelled one released, each event's key recorded once,
// none set aside as out of order.
func TestEveryOrderReachesTheWarehouseOnceInOrder(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(6, nil)
	db := newDatabase(t)
	orders := shop.NewOrderService(db)
	for i := 1; i <= 60; i++ {
		id, err := orders.PlaceOrder(ctx, int64(100*i))
		if err != nil {
			t.Fatal(err)
		}
		if i%3 == 0 {
			if err := orders.CancelOrder(ctx, id); err != nil {
				t.Fatal(err)
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
	drain(t, relay)
	var logs logBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	for range 2 {
		runConsumer(t, c, "warehouse", topic, shop.NewWarehouse(db), log)
	}
	waitFor(t, "every event applied", func() bool { return count(t, db, `SELECT count(*) FROM processed_messages`) == 80 })
	if n := count(t, db, `SELECT count(*) FROM reservations`); n != 40 {
		t.Errorf("%d reservations; want the 40 orders not cancelled", n)
	}
	if strings.Contains(logs.String(), "set aside") {
		t.Errorf("messages set aside:\n%s", logs.String())
	}
}

// A record the topic refuses (over its max.message.bytes) is an
// ErrRejected for the relay, and no later event of its aggregate is stored
// ahead of it: A1 refused, A2 not in the topic, B1 stored; the limit
// raised, A1 then A2, in that order in A's partition. (The case a real
// Kafka 4.3.1 showed another client: rows 2 and 3 of a key stored while
// row 1 was refused, and a retry made the order 2, 3, 1.)
func TestARefusedRecordHasNothingOfItsAggregateStoredAheadOfIt(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(6, map[string]string{"max.message.bytes": "2000"})
	db := newDatabase(t)
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	write := func(aggregate string, seq int64, note string) {
		err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			_, err := ob.Write(ctx, tx, postgres.Event{Type: "ItemAdded", Payload: map[string]string{"note": note}, Aggregate: aggregate, Seq: seq})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	var noise strings.Builder // incompressible: the topic's limit is on the compressed batch
	for noise.Len() < 8000 {
		noise.WriteString(rand.Text())
	}
	write("cart/A", 1, noise.String())
	write("cart/A", 2, "small")
	write("cart/B", 1, "small")
	relay, err := ob.NewRelay(newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic}), postgres.RelayConfig{NeverPark: true})
	if err != nil {
		t.Fatal(err)
	}
	n, err := relay.PublishPending(ctx)
	if !errors.Is(err, postgres.ErrRejected) {
		t.Fatalf("pass = %d, %v; want A1 refused (ErrRejected)", n, err)
	}
	for again := 0; again < 3; again++ { // what the relay would try next, A's rows waiting
		if _, err := db.Exec(`UPDATE outbox SET retry_at = NULL`); err != nil {
			t.Fatal(err)
		}
		relay.PublishPending(ctx)
	}
	stored := func(n int) []string {
		var got []string
		for _, r := range c.records(topic, n) {
			got = append(got, fmt.Sprintf("%s/%s", r.Key, header(r, kafkabroker.HeaderSeq)))
		}
		return got
	}
	if got := stored(1); len(got) != 1 || got[0] != "cart/B/1" {
		t.Fatalf("the topic holds %v; want B1 alone, nothing of A ahead of A1", got)
	}
	c.setTopicConfig(topic, "max.message.bytes", "100000")
	if _, err := db.Exec(`UPDATE outbox SET retry_at = NULL`); err != nil {
		t.Fatal(err)
	}
	drain(t, relay)
	var ofA []string
	for _, s := range stored(3) {
		if strings.HasPrefix(s, "cart/A/") {
			ofA = append(ofA, s)
		}
	}
	if strings.Join(ofA, " ") != "cart/A/1 cart/A/2" {
		t.Errorf("A's records in its partition: %v; want A1 then A2", ofA)
	}
}

// header is a record's header's value.
func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// A rebalance loses nothing and applies nothing twice: two members of one
// group apply 200 events of a topic of six partitions; after 50 are
// applied one member stops and leaves, and the other takes its partitions
// over from their committed offsets: every event applied, its key
// recorded once, and what the first handled without committing comes
// again and is dropped by its key.
func TestARebalanceLosesNothingAndAppliesNothingTwice(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(6, nil)
	db := newDatabase(t)
	publisher := newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic})
	var msgs []postgres.Message
	for i := 1; i <= 200; i++ {
		msgs = append(msgs, postgres.Message{ID: int64(i), Key: fmt.Sprintf("00000000-0000-4000-8000-%012d", i), Type: shop.OrderPlaced,
			Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":%d}`, i, 100*i), Aggregate: shop.OrderAggregate(int64(i)), Seq: 1, Time: time.Now()})
	}
	if n, err := publisher.PublishBatch(ctx, msgs); n != 200 || err != nil {
		t.Fatalf("PublishBatch = %d, %v", n, err)
	}
	first := runConsumer(t, c, "warehouse", topic, shop.NewWarehouse(db), nil)
	runConsumer(t, c, "warehouse", topic, shop.NewWarehouse(db), nil)
	waitFor(t, "50 applied", func() bool { return count(t, db, `SELECT count(*) FROM reservations`) >= 50 })
	first()
	waitFor(t, "all 200 applied", func() bool { return count(t, db, `SELECT count(*) FROM reservations`) == 200 })
	if n := count(t, db, `SELECT count(*) FROM processed_messages`); n != 200 {
		t.Errorf("%d keys recorded; want 200, each once", n)
	}
}

// The records carry what a consumer of another team needs: the aggregate
// as the key, the message's key, id, type, aggregate and seq as headers,
// its time as the record's timestamp, the team's headers, and with a
// CloudEvents source the Kafka binding's ce_ attributes; a Consumer reads
// the message back whole.
func TestRecordsCarryTheMessageAndItsCloudEvent(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(1, nil)
	at := time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC)
	msg := postgres.Message{ID: 7, Key: "6f1c2b0e-0000-4000-8000-000000000007", Type: "OrderPlaced", Payload: `{"orderId":7}`,
		Aggregate: "order/7", Seq: 2, Time: at, Headers: map[string]string{"Tenant": "acme"}}
	if err := newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic, CloudEventsSource: "/shop"}).Publish(ctx, msg); err != nil {
		t.Fatal(err)
	}
	r := c.records(topic, 1)[0]
	want := map[string]string{kafkabroker.HeaderKey: msg.Key, kafkabroker.HeaderID: "7", kafkabroker.HeaderType: "OrderPlaced",
		kafkabroker.HeaderAggregate: "order/7", kafkabroker.HeaderSeq: "2", "Tenant": "acme", "content-type": "application/json",
		"ce_specversion": "1.0", "ce_id": msg.Key, "ce_type": "OrderPlaced", "ce_source": "/shop", "ce_subject": "order/7",
		"ce_time": "2026-12-07T09:00:00Z"}
	for k, v := range want {
		if got := header(r, k); got != v {
			t.Errorf("header %s = %q; want %q", k, got, v)
		}
	}
	if string(r.Key) != "order/7" || !r.Timestamp.Equal(at) || string(r.Value) != msg.Payload {
		t.Errorf("record key %q, time %v, value %q; want the aggregate, the row's time, the payload", r.Key, r.Timestamp, r.Value)
	}
	got := make(chan postgres.Message, 1)
	runConsumer(t, c, "reader", topic, handlerFunc(func(_ context.Context, m postgres.Message) (bool, error) {
		got <- m
		return true, nil
	}), nil)
	select {
	case m := <-got:
		if m.Key != msg.Key || m.ID != 7 || m.Type != msg.Type || m.Aggregate != msg.Aggregate || m.Seq != 2 || m.Payload != msg.Payload ||
			m.Headers["Tenant"] != "acme" || len(m.Headers) != 1 || !m.Time.Equal(at) {
			t.Errorf("the consumer read %+v; want the message back", m)
		}
	case <-time.After(time.Minute):
		t.Fatal("the consumer read nothing within a minute")
	}
}

type handlerFunc func(context.Context, postgres.Message) (bool, error)

func (f handlerFunc) Handle(ctx context.Context, m postgres.Message) (bool, error) { return f(ctx, m) }

// A Publisher is refused a client that cannot say "taken" honestly (acks
// of the leader alone, or no idempotence), and a Consumer one that would
// commit by itself, let partitions move mid-poll, or is in no group.
func TestClientsThatCannotKeepThePromiseAreRefused(t *testing.T) {
	c := newCluster(t)
	for name, opt := range map[string]kgo.Opt{
		"leader acks":    kgo.RequiredAcks(kgo.LeaderAck()),
		"no idempotence": kgo.DisableIdempotentWrite(),
	} {
		var opts []kgo.Opt
		if name == "leader acks" {
			opts = append(opts, kgo.DisableIdempotentWrite())
		}
		if _, err := kafkabroker.NewPublisher(c.client(append(opts, opt)...), kafkabroker.PublisherOptions{}); !errors.Is(err, postgres.ErrInvalidConfig) {
			t.Errorf("NewPublisher with %s = %v; want ErrInvalidConfig", name, err)
		}
	}
	if _, err := kafkabroker.NewPublisher(c.client(), kafkabroker.PublisherOptions{Topic: "no spaces"}); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("NewPublisher to a bad topic name = %v; want ErrInvalidConfig", err)
	}
	h := handlerFunc(func(context.Context, postgres.Message) (bool, error) { return true, nil })
	for name, opts := range map[string][]kgo.Opt{
		"no group": {kgo.SeedBrokers(c.seeds...), kgo.ConsumeTopics("t")},
		"no topic": {kgo.SeedBrokers(c.seeds...), kgo.ConsumerGroup("g")},
		"no seeds": {kgo.SeedBrokers(), kgo.ConsumerGroup("g"), kgo.ConsumeTopics("t")},
	} {
		if _, err := kafkabroker.NewConsumer(h, kafkabroker.ConsumerOptions{}, opts...); !errors.Is(err, postgres.ErrInvalidConfig) {
			t.Errorf("NewConsumer with %s = %v; want ErrInvalidConfig", name, err)
		}
	}
}
