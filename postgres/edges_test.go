package postgres_test

// The API's edges a team meets first: a payload that is JSON already, an
// aggregate's seq below 1, the consumer's record in a transaction the
// caller has, and a migration behind another.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres"
)

// A payload that is JSON text already, as []byte or json.RawMessage, is
// stored and published byte for byte as given; JSON text that is not
// valid is refused with ErrInvalidPayload, and the caller's transaction,
// rolled back on it, writes nothing. (Caught: json.Marshal of a []byte,
// which stores it as a base64 string.)
func TestRawJSONPayloadIsStoredAsGiven(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	given := []string{`{"customerId": 7,  "tags":["a"]}`, `[1, 2.50, "x"]`}
	err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := postgres.InsertOutbox(ctx, tx, "CustomerRegistered", []byte(given[0])); err != nil {
			return err
		}
		_, err := postgres.InsertOutbox(ctx, tx, "CustomerTagged", json.RawMessage(given[1]))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != 2 || err != nil {
		t.Fatalf("pass = %d, %v; want 2", n, err)
	}
	for i, m := range broker.Published() {
		if m.Payload != given[i] {
			t.Errorf("message %d's payload = %s, want %s as given", i+1, m.Payload, given[i])
		}
	}

	err = postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := postgres.InsertOutbox(ctx, tx, "CustomerRegistered", json.RawMessage(`{"customerId": 8}`)); err != nil {
			return err
		}
		_, err := postgres.InsertOutbox(ctx, tx, "CustomerRegistered", []byte(`{"customerId": `))
		return err
	})
	if !errors.Is(err, postgres.ErrInvalidPayload) {
		t.Errorf("InsertOutbox of invalid JSON text = %v, want ErrInvalidPayload", err)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox`); n != 2 {
		t.Errorf("outbox holds %d rows, want the 2 before: the transaction that met invalid JSON writes nothing", n)
	}
}

// An aggregate's events are numbered from 1. InsertOutboxFor refuses a seq
// below 1 with ErrInvalidSeq, in the caller's transaction, which then
// writes nothing; ApplyOnce refuses such a message as malformed, never
// takes it for a duplicate. (Caught: seq 0 stored as no seq, and applied as
// a duplicate, applied = false with no error, which dropped the first event
// of every aggregate numbered from 0.)
func TestSeqBelowOneIsRefusedAtInsertAndAtApply(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	for _, seq := range []int64{0, -1} {
		err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			if _, err := postgres.InsertOutbox(ctx, tx, "AccountOpened", map[string]int{"account": 1}); err != nil {
				return err
			}
			_, err := postgres.InsertOutboxFor(ctx, tx, "account/1", seq, "AccountOpened", map[string]int{"account": 1})
			return err
		})
		if !errors.Is(err, postgres.ErrInvalidSeq) {
			t.Errorf("InsertOutboxFor seq %d = %v, want ErrInvalidSeq", seq, err)
		}
	}
	if n := count(t, db, `SELECT count(*) FROM outbox`); n != 0 {
		t.Errorf("outbox holds %d rows, want none", n)
	}
	msg := postgres.Message{ID: 1, Key: "8d0f5a52-0000-4000-8000-000000000001", Type: "AccountOpened",
		Payload: `{"account":1}`, Aggregate: "account/1", Seq: 0}
	ran := false
	applied, err := postgres.ApplyOnce(ctx, db, msg, false, func(context.Context, *sql.Tx) error { ran = true; return nil })
	if applied || ran || !errors.Is(err, postgres.ErrMalformedMessage) {
		t.Errorf("ApplyOnce of seq 0 = %v, %v (effect ran: %v); want ErrMalformedMessage and no effect", applied, err, ran)
	}
	if n := count(t, db, `SELECT count(*) FROM processed_messages`) + count(t, db, `SELECT count(*) FROM aggregate_positions`); n != 0 {
		t.Errorf("%d keys and positions recorded, want none", n)
	}
}

// ApplyOnceIn records a message in the caller's own transaction, beside the
// effect the caller writes there: committed, a copy of the message is a
// duplicate (in the caller's next transaction, and through ApplyOnce);
// rolled back, nothing was recorded and the message is new again. For an
// aggregate it keeps the order as ApplyOnce does.
func TestApplyOnceInTheCallersTransaction(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	if _, err := db.Exec(`CREATE TABLE balances (account text PRIMARY KEY, cents bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	event := func(seq int64) postgres.Message {
		return postgres.Message{ID: seq, Key: "c3a1c9a4-0000-4000-8000-00000000000" + string(rune('0'+seq)), Type: "Deposited",
			Payload: `{"cents":100}`, Aggregate: "account/9", Seq: seq}
	}
	ob := sqlOutbox(t, db, postgres.Config{})
	// deposit handles msg in a transaction of the caller's, which it
	// commits, or rolls back if rollback is set, and reports fresh.
	deposit := func(msg postgres.Message, rollback bool) (bool, error) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		fresh, err := ob.ApplyOnceIn(ctx, tx, msg, postgres.ApplyOptions{})
		if err != nil || !fresh {
			return fresh, err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO balances VALUES ('9', 100)
			ON CONFLICT (account) DO UPDATE SET cents = balances.cents + 100`); err != nil {
			t.Fatal(err)
		}
		if rollback {
			return fresh, tx.Rollback()
		}
		return fresh, tx.Commit()
	}
	if fresh, err := deposit(event(1), true); !fresh || err != nil {
		t.Fatalf("first delivery, rolled back: fresh %v, %v; want fresh", fresh, err)
	}
	if fresh, err := deposit(event(1), false); !fresh || err != nil {
		t.Fatalf("after the rollback: fresh %v, %v; want fresh again, nothing having been kept", fresh, err)
	}
	if fresh, err := deposit(event(1), false); fresh || err != nil {
		t.Errorf("a copy: fresh %v, %v; want a duplicate", fresh, err)
	}
	if applied, err := postgres.ApplyOnce(ctx, db, event(1), false, func(context.Context, *sql.Tx) error {
		t.Error("ApplyOnce ran the effect of a copy ApplyOnceIn recorded")
		return nil
	}); applied || err != nil {
		t.Errorf("ApplyOnce of the copy = %v, %v; want a duplicate", applied, err)
	}
	if _, err := deposit(event(3), false); !errors.Is(err, postgres.ErrOutOfOrder) {
		t.Errorf("seq 3 after 1 = %v, want ErrOutOfOrder", err)
	}
	if fresh, err := deposit(event(2), false); !fresh || err != nil {
		t.Errorf("seq 2 = %v, %v; want fresh", fresh, err)
	}
	if n := count(t, db, `SELECT cents FROM balances`); n != 200 {
		t.Errorf("balance = %d cents, want 200: two deposits, each once", n)
	}
}

// count is query's one integer.
func count(t *testing.T, db *sql.DB, query string) int64 {
	t.Helper()
	var n int64
	if err := db.QueryRow(query).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
