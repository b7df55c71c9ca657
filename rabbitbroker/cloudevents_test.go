package rabbitbroker_test

// CloudEvents on the wire: what the Publisher sends with a CloudEventsSource is
// read by the CloudEvents Go SDK as an event that validates.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

// delivery is an AMQP 0-9-1 delivery as a binding.Message of the SDK. The
// SDK binds CloudEvents to AMQP 1.0 only, which this RabbitMQ (3.10, from
// Debian) speaks through a plugin, and whose module the proxy here does not
// serve; so the test reads the binding's application properties from the
// 0-9-1 headers itself, as the SDK's AMQP binding reads them from 1.0's,
// and leaves the rest to the SDK: which header is which attribute, the
// types (a time), the event, and its validation.
type delivery struct{ d amqp.Delivery }

var ceSpecs = spec.WithPrefix(rabbitbroker.CloudEventsPrefix)

func (m delivery) ReadEncoding() binding.Encoding {
	if _, ok := m.d.Headers[ceSpecs.PrefixedSpecVersionName()]; ok {
		return binding.EncodingBinary
	}
	return binding.EncodingUnknown
}

func (m delivery) ReadStructured(context.Context, binding.StructuredWriter) error {
	return binding.ErrNotStructured
}

func (m delivery) ReadBinary(ctx context.Context, w binding.BinaryWriter) error {
	sv, _ := m.d.Headers[ceSpecs.PrefixedSpecVersionName()].(string)
	version := ceSpecs.Version(sv)
	if version == nil {
		return binding.ErrNotBinary
	}
	for k, v := range m.d.Headers {
		if !strings.HasPrefix(k, rabbitbroker.CloudEventsPrefix) {
			continue
		}
		var err error
		if attr := version.Attribute(k); attr != nil {
			err = w.SetAttribute(attr, v)
		} else {
			err = w.SetExtension(strings.TrimPrefix(k, rabbitbroker.CloudEventsPrefix), v)
		}
		if err != nil {
			return err
		}
	}
	if m.d.ContentType != "" {
		if err := w.SetAttribute(version.AttributeFromKind(spec.DataContentType), m.d.ContentType); err != nil {
			return err
		}
	}
	return w.SetData(bytes.NewReader(m.d.Body))
}

func (m delivery) Finish(error) error { return nil }

func (m delivery) GetAttribute(k spec.Kind) (spec.Attribute, any) {
	sv, _ := m.d.Headers[ceSpecs.PrefixedSpecVersionName()].(string)
	version := ceSpecs.Version(sv)
	if version == nil {
		return nil, nil
	}
	attr := version.AttributeFromKind(k)
	if attr == nil {
		return nil, nil
	}
	if k == spec.DataContentType {
		return attr, m.d.ContentType
	}
	return attr, m.d.Headers[attr.PrefixedName()]
}

func (m delivery) GetExtension(name string) any {
	return m.d.Headers[rabbitbroker.CloudEventsPrefix+name]
}

// Four events: the first confirmed by a Publisher as it comes (no
// CloudEvents: the default), the other three by one with
// CloudEventsSource "/shop": JSON of an aggregate, Protobuf bytes, JSON of
// none. Each delivered message is handed to the SDK: the first is no
// binary-mode event; each of the others becomes an event that validates,
// with the row's key as its id, its type, the source, the aggregate as its
// subject (none without one), the row's created_at as its time, its content
// type, and its payload as its data. A source that is no URI-reference is
// refused. (Caught: the Publisher before CloudEvents, which sent no
// cloudEvents: header.)
func TestCloudEventsAreReadByTheSDK(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	events := []postgres.Event{
		{Type: "OrderPlaced", Payload: map[string]int{"orderId": 1}, Aggregate: "order/1", Seq: 1},
		{Type: "OrderPlaced", Payload: map[string]int{"orderId": 7}, Aggregate: "order/7", Seq: 1},
		{Type: "PlanChanged", Payload: []byte{0x08, 0x96, 0x01, 0x00, 0xff}, ContentType: "application/x-protobuf"},
		{Type: "ItemPicked", Payload: json.RawMessage(`{"item":3}`)},
	}
	writeEvent(t, db, events[0])
	if n, err := newRelay(t, db, newPublisher(t, node.URL(), top, maxMessageSize)).PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("the default relay's pass = %d, %v; want the first event", n, err)
	}
	for _, e := range events[1:] {
		writeEvent(t, db, e)
	}
	for _, bad := range []string{"/shop two", "/shop\n", "%zz"} {
		if _, err := rabbitbroker.NewPublisher(dialer(node.URL()), rabbitbroker.PublisherOptions{CloudEventsSource: bad}); !errors.Is(err, postgres.ErrInvalidConfig) {
			t.Errorf("NewPublisher with CloudEventsSource %q = %v, want ErrInvalidConfig: no URI-reference", bad, err)
		}
	}
	pub := publisherOf(t, dialer(node.URL()), rabbitbroker.PublisherOptions{Exchange: top.Exchange, MaxMessageSize: maxMessageSize, CloudEventsSource: "/shop"})
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

	ch, closing := channel(t, node.URL())
	defer closing()
	deliveries, err := ch.Consume(top.Queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range events {
		var d amqp.Delivery
		select {
		case d = <-deliveries:
		case <-time.After(2 * time.Minute):
			t.Fatalf("%d of the queue's 4 messages delivered within 2m", i)
		}
		if i == 0 {
			if enc := (delivery{d}).ReadEncoding(); enc == binding.EncodingBinary {
				t.Errorf("message 1, from the default Publisher, reads as a binary-mode CloudEvent")
			}
			continue
		}
		ev, err := binding.ToEvent(ctx, delivery{d})
		if err != nil {
			t.Fatalf("message %d: the SDK made no event of it: %v", i+1, err)
		}
		t.Logf("message %d: id %s, type %s, source %s, subject %q, time %s, datacontenttype %s, data %q",
			i+1, ev.ID(), ev.Type(), ev.Source(), ev.Subject(), ev.Time().Format(time.RFC3339Nano), ev.DataContentType(), ev.Data())
		if err := ev.Validate(); err != nil {
			t.Errorf("message %d: the event does not validate: %v", i+1, err)
		}
		e := events[i]
		wantContent := e.ContentType
		if wantContent == "" {
			wantContent = "application/json"
		}
		if ev.ID() != rows[i].key || ev.Type() != e.Type || ev.Source() != "/shop" || ev.Subject() != e.Aggregate ||
			ev.DataContentType() != wantContent || ev.SpecVersion() != "1.0" {
			t.Errorf("message %d: id %s, type %s, source %s, subject %q, datacontenttype %s, specversion %s; want %s, %s, /shop, %q, %s, 1.0",
				i+1, ev.ID(), ev.Type(), ev.Source(), ev.Subject(), ev.DataContentType(), ev.SpecVersion(),
				rows[i].key, e.Type, e.Aggregate, wantContent)
		}
		if !ev.Time().Equal(rows[i].created) {
			t.Errorf("message %d: time %v, want the row's created_at %v", i+1, ev.Time(), rows[i].created)
		}
		if got := string(ev.Data()); got != string(d.Body) || (i == 2 && got != "\x08\x96\x01\x00\xff") {
			t.Errorf("message %d: data %q, want the payload as written", i+1, got)
		}
	}
}
