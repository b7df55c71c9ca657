package postgres_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// A team on pgx itself writes the outbox row in its pgx.Tx: rolled back,
// nothing is written; committed, the relay publishes it, aggregate and seq
// kept. Bad input is refused before any statement, and the transaction
// goes on. (Caught: InsertOutbox took only database/sql's transactions.)
func TestInsertOutboxInAPgxTransaction(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	cfg := pgtest.Config.Copy()
	cfg.Database = name
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := postgres.InsertOutboxPgx(ctx, tx, "ItemPicked", map[string]int{"item": 1}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox`); n != 0 {
		t.Fatalf("%d rows after a rollback", n)
	}

	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := postgres.InsertOutboxForPgx(ctx, tx, "account/7", 0, "Opened", "{}"); !errors.Is(err, postgres.ErrInvalidSeq) {
		t.Errorf("seq 0 = %v, want ErrInvalidSeq", err)
	}
	if _, err := postgres.InsertOutboxPgx(ctx, tx, "bad type", "{}"); !errors.Is(err, postgres.ErrInvalidEventType) {
		t.Errorf("a type with a space = %v, want ErrInvalidEventType", err)
	}
	id, err := postgres.InsertOutboxForPgx(ctx, tx, "account/7", 1, "Opened", []byte(`{"account":7}`))
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	broker := &recorder{}
	if n, err := postgres.NewOutboxRelay(db, broker).PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass = %d, %v; want the row", n, err)
	}
	m := broker.Published()[0]
	if m.ID != id || m.Aggregate != "account/7" || m.Seq != 1 || m.Type != "Opened" || m.Payload != `{"account":7}` {
		t.Errorf("published %+v; want row %d of account/7, seq 1, as written", m, id)
	}
}
