package natsbroker_test

// CloudEvents on the wire: what the Publisher sends with a CloudEventsSource is
// read, by the CloudEvents Go SDK and its JetStream binding (a client no
// one here wrote), as an event that validates.

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	cenats "github.com/cloudevents/sdk-go/protocol/nats_jetstream/v2"
	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// Four events: the first relayed by a Publisher as it comes (no
// CloudEvents: the default), the other three by one with
// CloudEventsSource "/shop": JSON of an aggregate, Protobuf bytes, JSON of
// none. Each delivered message is handed to the SDK: the first is no
// binary-mode event; each of the others becomes an event that validates,
// with the row's key as its id, its type, the source, the aggregate as its
// subject (none without one), the row's created_at as its time, its content
// type (application/json for JSON), and its payload as its data. A source
// that is no URI-reference is refused and changes nothing. (Caught: the
// Publisher before CloudEvents, which sent no ce- header.)
func TestCloudEventsAreReadByTheSDK(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 0)
	events := []postgres.Event{
		{Type: "OrderPlaced", Payload: map[string]int{"orderId": 1}, Aggregate: "order/1", Seq: 1},
		{Type: "OrderPlaced", Payload: map[string]int{"orderId": 7}, Aggregate: "order/7", Seq: 1},
		{Type: "PlanChanged", Payload: []byte{0x08, 0x96, 0x01, 0x00, 0xff}, ContentType: "application/x-protobuf"},
		{Type: "ItemPicked", Payload: json.RawMessage(`{"item":3}`)},
	}
	writeEvent(t, db, events[0])
	if n, err := newRelay(t, db, newPublisher(t, connect(t, b.url()))).PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("the default relay's pass = %d, %v; want the first event", n, err)
	}
	for _, e := range events[1:] {
		writeEvent(t, db, e)
	}
	for _, bad := range []string{"/shop two", "/shop\n", "%zz"} {
		if _, err := natsbroker.NewPublisher(js, natsbroker.PublisherOptions{CloudEventsSource: bad}); !errors.Is(err, postgres.ErrInvalidConfig) {
			t.Errorf("NewPublisher with CloudEventsSource %q = %v, want ErrInvalidConfig: no URI-reference", bad, err)
		}
	}
	pub := newPublisher(t, connect(t, b.url()), natsbroker.PublisherOptions{CloudEventsSource: "/shop"})
	if n, err := newRelay(t, db, pub).PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("the CloudEvents relay's pass = %d, %v; want the other three", n, err)
	}
	type row struct {
		key     string
		created time.Time
	}
	var rows []row
	q, err := db.Query(`SELECT message_key, created_at FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for q.Next() {
		var r row
		if err := q.Scan(&r.key, &r.created); err != nil {
			t.Fatal(err)
		}
		rows = append(rows, r)
	}
	q.Close()

	cons, err := js.Consumer(ctx, "OUTBOX", "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(4, jetstream.FetchMaxWait(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	var delivered []jetstream.Msg
	for m := range batch.Messages() {
		delivered = append(delivered, m)
		if err := m.Ack(); err != nil {
			t.Fatal(err)
		}
	}
	if len(delivered) != 4 {
		t.Fatalf("%d messages delivered, want 4 (%v)", len(delivered), batch.Error())
	}
	for i, d := range delivered {
		msg := cenats.NewMessage(&nats.Msg{Subject: d.Subject(), Header: nats.Header(d.Headers()), Data: d.Data()})
		if i == 0 {
			if enc := msg.ReadEncoding(); enc == binding.EncodingBinary {
				t.Errorf("message 1, from the default Publisher, reads as a binary-mode CloudEvent")
			}
			for k := range d.Headers() {
				if strings.HasPrefix(k, "ce-") {
					t.Errorf("message 1, from the default Publisher, has the header %s", k)
				}
			}
			continue
		}
		ev, err := binding.ToEvent(ctx, msg)
		if err != nil {
			t.Fatalf("message %d: the SDK made no event of it: %v", i+1, err)
		}
		t.Logf("message %d: id %s, type %s, source %s, subject %q, time %s, datacontenttype %s, data %q",
			i+1, ev.ID(), ev.Type(), ev.Source(), ev.Subject(), ev.Time().Format(time.RFC3339Nano), ev.DataContentType(), ev.Data())
		if err := ev.Validate(); err != nil {
			t.Errorf("message %d: the event does not validate: %v", i+1, err)
		}
		e := events[i]
		wantType, wantContent := e.Type, e.ContentType
		if wantContent == "" {
			wantContent = "application/json"
		}
		if ev.ID() != rows[i].key || ev.Type() != wantType || ev.Source() != "/shop" || ev.Subject() != e.Aggregate ||
			ev.DataContentType() != wantContent || ev.SpecVersion() != "1.0" {
			t.Errorf("message %d: id %s, type %s, source %s, subject %q, datacontenttype %s, specversion %s; want %s, %s, /shop, %q, %s, 1.0",
				i+1, ev.ID(), ev.Type(), ev.Source(), ev.Subject(), ev.DataContentType(), ev.SpecVersion(),
				rows[i].key, wantType, e.Aggregate, wantContent)
		}
		if !ev.Time().Equal(rows[i].created) {
			t.Errorf("message %d: time %v, want the row's created_at %v", i+1, ev.Time(), rows[i].created)
		}
		if got := string(ev.Data()); got != string(d.Data()) || (i == 2 && got != "\x08\x96\x01\x00\xff") {
			t.Errorf("message %d: data %q, want the payload as written", i+1, got)
		}
	}
}
