package kafkabroker_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// A publish that gets no answer (the cluster reads the produce request
// and never answers it) ends with its context, soon after, with an error
// wrapping ErrBrokerUnavailable that says the outcome is unknown, never
// ErrRejected: the relay publishes the row again. (Caught: a publish that
// waited for the client's own retries for ever, past the pass's budget.)
func TestAPublishThatGetsNoAnswerEndsWithItsContext(t *testing.T) {
	c := newCluster(t)
	topic := c.topic(1, nil)
	publisher := newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic})
	fake := c.faults()
	fake.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		return nil, nil, true // read, and never answered
	})
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	err := publisher.Publish(ctx, postgres.Message{ID: 1, Key: "k1", Type: "OrderPlaced", Payload: `{}`})
	if !errors.Is(err, postgres.ErrBrokerUnavailable) || errors.Is(err, postgres.ErrRejected) || !strings.Contains(err.Error(), "unknown") {
		t.Errorf("Publish with no answer = %v; want ErrBrokerUnavailable saying the outcome is unknown", err)
	}
	if ctx.Err() == nil {
		t.Errorf("Publish returned before its context ended: %v", err)
	}
}

// A broker of the three stopped in the middle of a drain: the relay runs
// on, its passes that met the broker failing and trying again, until the
// partitions it led have new leaders; every row is sent and every event is
// in the topic, none lost (copies may be, the relay's at least once).
func TestABrokerStoppedMidDrainLosesNothing(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(6, nil)
	db := newDatabase(t)
	orders := shop.NewOrderService(db)
	for i := 1; i <= 300; i++ {
		if _, err := orders.PlaceOrder(ctx, int64(i)); err != nil {
			t.Fatal(err)
		}
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := ob.NewRelay(newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic}),
		postgres.RelayConfig{BatchSize: 20, PollInterval: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, PassTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(runCtx) }()
	defer func() { stop(); <-done }()
	waitFor(t, "100 rows sent", func() bool { return count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`) >= 100 })
	if err := c.faults().RemoveNode(1); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "every row sent", func() bool { return count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0 })
	keys := map[string]bool{}
	for _, r := range c.records(topic, 300) {
		keys[header(r, kafkabroker.HeaderKey)] = true
	}
	var want []string
	rows, err := db.Query(`SELECT message_key::text FROM outbox`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		if !keys[k] {
			want = append(want, k)
		}
	}
	if len(want) > 0 {
		t.Errorf("%d rows marked sent are not in the topic: %v", len(want), want[:min(len(want), 5)])
	}
}

// A team's headers and a payload of bytes go through the relay and the
// topic to the consumer byte for byte: the headers by name, the payload
// as written, its content type said.
func TestTeamHeadersAndBytesGoByteForByte(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(1, nil)
	db := newDatabase(t)
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	payload := []byte{0x08, 0x96, 0x01, 0x00, 0xff, 0xfe, '"', '\\'}
	headers := map[string]string{"Tenant": "acme", "X-Request-Id": "req-7"}
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := ob.Write(ctx, tx, postgres.Event{Type: "PlanChanged", Payload: payload, ContentType: "application/x-protobuf",
			Headers: headers, Aggregate: "account/7", Seq: 1})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	relay, err := ob.NewRelay(newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic}), postgres.RelayConfig{})
	if err != nil {
		t.Fatal(err)
	}
	drain(t, relay)
	got := make(chan postgres.Message, 1)
	runConsumer(t, c, "reader", topic, handlerFunc(func(_ context.Context, m postgres.Message) (bool, error) {
		got <- m
		return true, nil
	}), nil)
	select {
	case m := <-got:
		if m.Payload != string(payload) || m.ContentType != "application/x-protobuf" || fmt.Sprint(m.Headers) != fmt.Sprint(headers) {
			t.Errorf("the consumer read payload %x, content type %q, headers %v; want %x, application/x-protobuf, %v",
				m.Payload, m.ContentType, m.Headers, payload, headers)
		}
	case <-time.After(time.Minute):
		t.Fatal("the consumer read nothing within a minute")
	}
}

// What Kafka cannot take is refused with an error that names it, and
// nothing after it is stored ahead of it: a topic name Kafka refuses, at
// NewPublisher and at Provision, before anything is sent; a message whose
// own header is one the publisher sets (outbox-key), a CloudEvents
// attribute (ce_id), an empty name, or a value that is not UTF-8: its
// PublishBatch stores what came before it (B1), refuses it with
// ErrRejected naming the header, and sends nothing after it (C1), so the
// next record in the topic is the one published next. (Outbox.Write
// refuses such headers already; this is a caller publishing by hand.)
func TestWhatKafkaCannotTakeIsRefusedNamingItWithNothingAheadOfIt(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	for _, name := range []string{"orders/eu", "", strings.Repeat("o", 250), ".."} {
		if _, err := kafkabroker.NewPublisher(c.client(), kafkabroker.PublisherOptions{Topic: name}); name != "" && // "": the default topic
			(!errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), "PublisherOptions.Topic")) {
			t.Errorf("NewPublisher to topic %.20q = %v; want ErrInvalidConfig naming PublisherOptions.Topic", name, err)
		}
		if err := kafkabroker.Provision(ctx, c.client(), name, 1, 1); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%q", name)) {
			t.Errorf("Provision %.20q = %v; want an error naming it", name, err)
		}
	}
	topic := c.topic(1, nil)
	p := newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic})
	bad := map[string]map[string]string{
		"outbox-key": {"outbox-key": "k9"}, "ce_id": {"ce_id": "forged"}, `""`: {"": "v"}, "Tenant": {"Tenant": "\xff\xfe"},
	}
	next := 1
	for name, headers := range bad {
		msgs := []postgres.Message{
			{ID: 1, Key: fmt.Sprintf("b%d", next), Type: "T", Payload: "{}", Aggregate: "b"},
			{ID: 2, Key: "a1", Type: "T", Payload: "{}", Aggregate: "a", Headers: headers},
			{ID: 3, Key: "c1", Type: "T", Payload: "{}", Aggregate: "c"},
		}
		n, err := p.PublishBatch(ctx, msgs)
		if n != 1 || !errors.Is(err, postgres.ErrRejected) || !strings.Contains(err.Error(), name) {
			t.Errorf("a header %s: PublishBatch = %d, %v; want 1 taken and ErrRejected naming %s", name, n, err, name)
		}
		if err := p.Publish(ctx, postgres.Message{ID: 4, Key: fmt.Sprintf("s%d", next), Type: "T", Payload: "{}", Aggregate: "s"}); err != nil {
			t.Fatal(err)
		}
		next++
	}
	var got []string
	for _, r := range c.records(topic, 2*len(bad)) {
		got = append(got, header(r, kafkabroker.HeaderKey))
	}
	if want := "b1 s1 b2 s2 b3 s3 b4 s4"; strings.Join(got, " ") != want {
		t.Errorf("the topic holds %s; want %s: what came before each refused message, then the next publish, nothing after it", strings.Join(got, " "), want)
	}
}
