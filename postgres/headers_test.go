package postgres_test

// A team's own headers and payloads that are not JSON: written by the
// producer, delivered byte for byte by both relays, on both drivers; and
// refused, naming what is wrong, before anything is written.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
)

// teamEvents are three events: JSON with headers of the team's, Protobuf
// bytes (not UTF-8: 0xff) with a header, and JSON with none.
var teamEvents = []postgres.Event{
	{Type: "PlanChanged", Payload: map[string]int{"accountId": 7}, Headers: map[string]string{"Tenant": "acme", "Schema-Version": "3", "X-Request-Id": "r-17"}},
	{Type: "PlanChanged", Payload: []byte{0x08, 0x96, 0x01, 0x00, 0xff}, ContentType: "application/x-protobuf",
		Headers: map[string]string{"Tenant": "globex"}},
	{Type: "PlanChanged", Payload: json.RawMessage(`{"accountId":9}`), ContentType: "application/json"},
}

// wantTeamEvents checks that msgs are teamEvents as delivered.
func wantTeamEvents(t *testing.T, msgs []postgres.Message) {
	t.Helper()
	if len(msgs) != 3 {
		t.Fatalf("%d messages delivered, want 3", len(msgs))
	}
	for i, m := range msgs {
		t.Logf("delivered: %q %q %v", m.Payload, m.ContentType, m.Headers)
		if m.Time.IsZero() || time.Since(m.Time) > time.Hour || time.Until(m.Time) > time.Minute {
			t.Errorf("message %d: Time %v, want its row's created_at, a moment ago", i+1, m.Time)
		}
		if !maps.Equal(m.Headers, teamEvents[i].Headers) {
			t.Errorf("message %d has headers %v, want %v", i+1, m.Headers, teamEvents[i].Headers)
		}
	}
	if msgs[0].Payload != `{"accountId":7}` || msgs[0].ContentType != "" {
		t.Errorf("message 1: %q %q, want the JSON as written and no content type", msgs[0].Payload, msgs[0].ContentType)
	}
	if msgs[1].Payload != "\x08\x96\x01\x00\xff" || msgs[1].ContentType != "application/x-protobuf" {
		t.Errorf("message 2: %q %q, want the bytes as written, application/x-protobuf", msgs[1].Payload, msgs[1].ContentType)
	}
	if msgs[2].Payload != `{"accountId":9}` || msgs[2].Headers != nil || msgs[2].ContentType != "" {
		t.Errorf("message 3: %q %q %v, want the JSON, no content type (JSON's) and no headers", msgs[2].Payload, msgs[2].ContentType, msgs[2].Headers)
	}
}

// The polling relay delivers the team's headers and a payload of bytes as
// written, through Outbox.Write on either driver. (Caught: today's outbox
// before migration 8, which had neither.)
func TestTeamHeadersAndBytesReachTheBrokerAsWritten(t *testing.T) {
	t.Run("pgx", func(t *testing.T) {
		name := newDatabaseName(t)
		pool := newPool(t, name, 4)
		ob := pgxOutbox(t, pool)
		for _, e := range teamEvents {
			writeEventPgx(t, pool, ob, e)
		}
		broker := &recorder{}
		if _, err := newRelayOn(t, ob, broker).PublishPending(context.Background()); err != nil {
			t.Fatal(err)
		}
		wantTeamEvents(t, broker.Published())
	})
	t.Run("database/sql", func(t *testing.T) {
		db := newDatabase(t)
		for _, e := range teamEvents {
			writeEvent(t, db, e)
		}
		broker := &recorder{}
		if _, err := newRelay(t, db, broker).PublishPending(context.Background()); err != nil {
			t.Fatal(err)
		}
		wantTeamEvents(t, broker.Published())
	})
}

// The log relay reads the same from the log: the headers' JSON, and the
// bytes in bytea's hex form. (Caught: a log relay that read only payload.)
func TestLogRelayDeliversTeamHeadersAndBytesAsWritten(t *testing.T) {
	name := newDatabaseName(t)
	logRelayDeliversTeamEvents(t, name, open(t, name, ""))
}

// logRelayDeliversTeamEvents writes teamEvents to db, the database name,
// and checks that a log relay delivers them as written.
func logRelayDeliversTeamEvents(t *testing.T, name string, db *sql.DB) {
	t.Helper()
	broker := &recorder{}
	relay := logRelayOn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{})
	for _, e := range teamEvents {
		writeEvent(t, db, e)
	}
	runLog(t, relay)
	waitUntil(t, "three messages delivered", func() bool { return len(broker.Published()) >= 3 })
	wantTeamEvents(t, broker.Published()[:3])
}

// Each bad header, content type or payload is refused by Write with the
// error that names it, and nothing is written: the transaction commits
// empty.
func TestHeadersAndContentTypesNoBrokerCanCarryAreRefused(t *testing.T) {
	db := newDatabase(t)
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	many := map[string]string{}
	for i := range postgres.MaxHeaders + 1 {
		many[strings.Repeat("h", i+1)] = "v"
	}
	for _, tc := range []struct {
		name string
		e    postgres.Event
		want error
		says string
	}{
		{"a space in a name", postgres.Event{Headers: map[string]string{"Bad Name": "v"}}, postgres.ErrInvalidHeader, `"Bad Name"`},
		{"a colon in a name", postgres.Event{Headers: map[string]string{"a:b": "v"}}, postgres.ErrInvalidHeader, `"a:b"`},
		{"an empty name", postgres.Event{Headers: map[string]string{"": "v"}}, postgres.ErrInvalidHeader, `""`},
		{"a name too long", postgres.Event{Headers: map[string]string{strings.Repeat("n", postgres.MaxHeaderNameLen+1): "v"}}, postgres.ErrInvalidHeader, "nnnn"},
		{"the outbox's own", postgres.Event{Headers: map[string]string{"Outbox-Id": "1"}}, postgres.ErrInvalidHeader, "Outbox-Id"},
		{"JetStream's own", postgres.Event{Headers: map[string]string{"nats-msg-id": "k"}}, postgres.ErrInvalidHeader, "nats-msg-id"},
		{"RabbitMQ's", postgres.Event{Headers: map[string]string{"x-delivery-count": "1"}}, postgres.ErrInvalidHeader, "x-delivery-count"},
		{"CloudEvents'", postgres.Event{Headers: map[string]string{"ce-id": "k"}}, postgres.ErrInvalidHeader, "ce-id"},
		{"the trace's", postgres.Event{Headers: map[string]string{"traceparent": "x"}}, postgres.ErrInvalidHeader, "traceparent"},
		{"a line break in a value", postgres.Event{Headers: map[string]string{"Tenant": "a\r\nOutbox-Id: 9"}}, postgres.ErrInvalidHeader, "Tenant"},
		{"a value not UTF-8", postgres.Event{Headers: map[string]string{"Tenant": "\xff"}}, postgres.ErrInvalidHeader, "Tenant"},
		{"a value too long", postgres.Event{Headers: map[string]string{"Tenant": strings.Repeat("v", postgres.MaxHeaderValueLen+1)}}, postgres.ErrInvalidHeader, "Tenant"},
		{"too many", postgres.Event{Headers: many}, postgres.ErrInvalidHeader, "17 headers"},
		{"not a media type", postgres.Event{ContentType: "protobuf bytes", Payload: []byte{1}}, postgres.ErrInvalidContentType, "protobuf bytes"},
		{"bytes that are a map", postgres.Event{ContentType: "application/avro", Payload: map[string]int{"a": 1}}, postgres.ErrInvalidPayload, "application/avro"},
		{"JSON that is not", postgres.Event{ContentType: "application/json", Payload: []byte{0xff}}, postgres.ErrInvalidPayload, "not valid JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := tc.e
			e.Type = "PlanChanged"
			if e.Payload == nil {
				e.Payload = map[string]int{"accountId": 7}
			}
			err := postgres.Transaction(context.Background(), db, func(ctx context.Context, tx *sql.Tx) error {
				_, err := ob.Write(ctx, tx, e)
				if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) {
					t.Errorf("Write = %v, want %v naming %s", err, tc.want, tc.says)
				}
				return nil // commit: whatever Write wrote would stay
			})
			if err != nil {
				t.Fatal(err)
			}
			var n int
			if err := db.QueryRow(`SELECT count(*) FROM outbox`).Scan(&n); err != nil || n != 0 {
				t.Fatalf("%d rows after the refusal (%v), want 0", n, err)
			}
		})
	}
}

// writeEventPgx writes e through ob.Write in a pgx transaction of its own.
func writeEventPgx(t *testing.T, pool *pgxpool.Pool, ob *postgres.Outbox[postgres.PgxTx], e postgres.Event) int64 {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	id, err := ob.Write(ctx, tx, e)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return id
}

// The table itself refuses a row, written by hand, that no relay could
// read: a header that is not a string, headers that are not an object, a
// row with both a JSON payload and bytes, or with neither. (Caught:
// migration 8 without its checks, where such a row stopped every pass.)
func TestTheTableRefusesRowsNoRelayCouldRead(t *testing.T) {
	db := newDatabase(t)
	for _, insert := range []string{
		`INSERT INTO outbox (type, payload, headers) VALUES ('A', '{}', '{"Tenant": 1}')`,
		`INSERT INTO outbox (type, payload, headers) VALUES ('A', '{}', '["Tenant"]')`,
		`INSERT INTO outbox (type, payload, body) VALUES ('A', '{}', '\x01')`,
		`INSERT INTO outbox (type) VALUES ('A')`,
	} {
		_, err := db.Exec(insert)
		t.Logf("%s: %v", insert, err)
		if err == nil || !strings.Contains(err.Error(), "23514") {
			t.Errorf("%s = %v, want a check violation (23514)", insert, err)
		}
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM outbox`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows after the refusals (%v), want 0", n, err)
	}
}
