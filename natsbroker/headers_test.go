package natsbroker_test

// A team's own headers and a payload of bytes, from the outbox to the
// consumer's handler through JetStream.

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"maps"
	"slices"
	"sync"
	"testing"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// collecting is a Handler that keeps what it is handed.
type collecting struct {
	mu   sync.Mutex
	msgs []postgres.Message
}

func (c *collecting) Handle(_ context.Context, m postgres.Message) (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.msgs = append(c.msgs, m)
	return true, nil
}

func (c *collecting) handled() []postgres.Message {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]postgres.Message(nil), c.msgs...)
}

// Three events written through Outbox.Write: JSON with two headers of the
// team's, Protobuf bytes (not UTF-8) with one, JSON with none. The relay
// publishes them to JetStream and the Consumer hands each to its handler
// with the headers, the content type and the payload as written, and no
// header of the outbox's or JetStream's among the team's. (Caught: the
// Publisher and decode before Event.Headers, which carried none.)
func TestTeamHeadersAndBytesReachTheConsumer(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 0)
	events := []postgres.Event{
		{Type: "PlanChanged", Payload: map[string]int{"accountId": 7}, Headers: map[string]string{"Tenant": "acme", "schema-version": "3", "X-Request-Id": "r-17"}},
		{Type: "PlanChanged", Payload: []byte{0x08, 0x96, 0x01, 0x00, 0xff}, ContentType: "application/x-protobuf",
			Headers: map[string]string{"Tenant": "globex"}},
		{Type: "PlanChanged", Payload: json.RawMessage(`{"accountId":9}`)},
	}
	for _, e := range events {
		writeEvent(t, db, e)
	}
	if n, err := newRelay(t, db, newPublisher(t, connect(t, b.url()))).PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("pass = %d, %v; want the three", n, err)
	}
	cons, err := js.Consumer(ctx, natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	h := &collecting{}
	goRun(t, newConsumer(t, cons, h, natsbroker.ConsumerOptions{}).Run)
	waitFor(t, "three messages handled", func() bool { return len(h.handled()) >= 3 })
	got := h.handled()[:3]
	slices.SortFunc(got, func(a, b postgres.Message) int { return cmp.Compare(a.ID, b.ID) }) // rows 1 to 3, however handled
	for i, m := range got {
		t.Logf("handled: %q %q %v", m.Payload, m.ContentType, m.Headers)
		if !maps.Equal(m.Headers, events[i].Headers) {
			t.Errorf("message %d: headers %v, want %v", i+1, m.Headers, events[i].Headers)
		}
	}
	if got[0].Payload != `{"accountId":7}` || got[0].ContentType != "" {
		t.Errorf("message 1: %q %q, want the JSON and no content type", got[0].Payload, got[0].ContentType)
	}
	if got[1].Payload != "\x08\x96\x01\x00\xff" || got[1].ContentType != "application/x-protobuf" {
		t.Errorf("message 2: %q %q, want the bytes as written, application/x-protobuf", got[1].Payload, got[1].ContentType)
	}
	if got[2].Payload != `{"accountId":9}` || got[2].Headers != nil {
		t.Errorf("message 3: %q %v, want the JSON and no headers", got[2].Payload, got[2].Headers)
	}
}

// writeEvent writes e through Outbox.Write in a transaction of its own and
// returns the row's id and key.
func writeEvent(t *testing.T, db *sql.DB, e postgres.Event) (id int64, key string) {
	t.Helper()
	ctx := context.Background()
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		id, err = ob.Write(ctx, tx, e)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(`SELECT message_key FROM outbox WHERE id = $1`, id).Scan(&key); err != nil {
		t.Fatal(err)
	}
	return id, key
}
