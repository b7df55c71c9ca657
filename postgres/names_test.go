package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Two outboxes in one database, the default one and billing_outbox: each
// has its own table, indexes, trigger, channel, publication and record of
// migrations; each relay publishes its own rows only, each lag counts its
// own, and a relay's Run wakes on its own outbox's commits. (Caught: every
// name fixed, so a second outbox could not exist.)
func TestTwoOutboxesInOneDatabase(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t) // the default outbox, migrated
	billing := sqlOutbox(t, db, postgres.Config{Table: "billing_outbox"})
	orders := sqlOutbox(t, db, postgres.Config{})
	for range 2 { // the second run applies nothing
		if err := billing.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := billing.CheckSchema(ctx); err != nil {
		t.Fatal(err)
	}
	var objects []string
	rows, err := db.Query(`
		SELECT relname FROM pg_class WHERE relname LIKE 'billing_outbox%' AND relkind IN ('r', 'i')
		UNION ALL SELECT tgname FROM pg_trigger WHERE tgname LIKE 'billing_outbox%'
		UNION ALL SELECT pubname FROM pg_publication_tables WHERE tablename = 'billing_outbox'
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			t.Fatal(err)
		}
		objects = append(objects, name)
	}
	want := []string{"billing_outbox", "billing_outbox_inserts", "billing_outbox_migrations", "billing_outbox_migrations_pkey",
		"billing_outbox_notify", "billing_outbox_parked", "billing_outbox_pkey", "billing_outbox_unsent", "billing_outbox_unsent_by_aggregate"}
	for _, w := range want {
		if !slices.Contains(objects, w) {
			t.Errorf("no %s among billing's objects %v", w, objects)
		}
	}
	if n := count(t, db, `SELECT count(*) FROM outbox_migrations`); n != int64(postgres.SchemaVersion) {
		t.Errorf("outbox_migrations records %d migrations, want the default outbox's %d alone", n, postgres.SchemaVersion)
	}

	// One transaction writes to both: each row lands in its own table.
	err = postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		for seq, typ := range []string{"InvoiceIssued", "InvoicePaid", "InvoiceVoided"} {
			if _, err := billing.Write(ctx, tx, postgres.Event{Type: typ, Payload: map[string]int{"invoice": 1}, Aggregate: "invoice/1", Seq: int64(seq + 1)}); err != nil {
				return err
			}
		}
		for _, typ := range []string{"OrderPlaced", "OrderShipped"} {
			if _, err := postgres.InsertOutbox(ctx, tx, typ, map[string]int{"order": 1}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	lagOf := func(o *postgres.Outbox[postgres.SQLTx]) int64 {
		lag, err := o.ReadLag(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return lag.Unsent
	}
	ordersWaiting, billingWaiting := lagOf(orders), lagOf(billing)
	if ordersWaiting != 2 || billingWaiting != 3 {
		t.Fatalf("lag: %d rows in the default outbox, %d in billing's; want 2 and 3", ordersWaiting, billingWaiting)
	}

	billingBroker, ordersBroker := &recorder{}, &recorder{}
	if n := drain(t, newRelayOn(t, billing, billingBroker)); int64(n) != billingWaiting {
		t.Fatalf("billing's relay published %d, want its %d rows", n, billingWaiting)
	}
	if n := drain(t, newRelay(t, db, ordersBroker)); int64(n) != ordersWaiting {
		t.Fatalf("the default outbox's relay published %d, want its %d rows", n, ordersWaiting)
	}
	for _, m := range billingBroker.Published() {
		if !strings.HasPrefix(m.Type, "Invoice") {
			t.Errorf("billing's relay published %s", m.Type)
		}
	}
	for _, m := range ordersBroker.Published() {
		if strings.HasPrefix(m.Type, "Invoice") {
			t.Errorf("the default relay published %s", m.Type)
		}
	}
	if got := lagOf(billing) + lagOf(orders); got != 0 {
		t.Errorf("%d rows still waiting, want none", got)
	}
	t.Logf("billing: %d published; the default outbox: %d", len(billingBroker.Published()), len(ordersBroker.Published()))

	// Run listens on billing's own channel: with an hour between polls, a
	// billing row is published because its commit woke the relay.
	relay := newRelayOn(t, billing, billingBroker, postgres.RelayConfig{PollInterval: time.Hour})
	before := len(billingBroker.Published())
	runRelay(t, relay)
	waitUntil(t, "billing's relay listening on billing_outbox", func() bool {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN billing_outbox' AND state = 'idle'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := billing.Write(ctx, tx, postgres.Event{Type: "InvoiceIssued", Payload: map[string]int{"invoice": 2}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the new billing row published on its notification", func() bool { return len(billingBroker.Published()) == before+1 })
}

// OpenDB takes a plain lowercase table name and refuses any other with an
// error that names the setting, before any SQL is written with it.
func TestOpenRefusesTableNamesThatAreNotPlain(t *testing.T) {
	db := newDatabase(t)
	for _, name := range []string{"Billing", "1outbox", "billing-outbox", "billing outbox", `x"; DROP TABLE outbox; --`, strings.Repeat("a", 41)} {
		o, err := postgres.OpenDB(db, postgres.Config{Table: name})
		if o != nil || !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(fmt.Sprint(err), "Config.Table") {
			t.Errorf("OpenDB with Table %q = %v, %v; want ErrInvalidConfig naming Config.Table", name, o, err)
		}
	}
	o := sqlOutbox(t, db, postgres.Config{Table: "billing_outbox"})
	if o.Table() != "billing_outbox" || o.Channel() != "billing_outbox" || o.Publication() != "billing_outbox_inserts" || o.Slot() != "billing_outbox" {
		t.Errorf("names: table %s, channel %s, publication %s, slot %s", o.Table(), o.Channel(), o.Publication(), o.Slot())
	}
	d := sqlOutbox(t, db, postgres.Config{})
	if d.Table() != "outbox" || d.Channel() != postgres.NotifyChannel || d.Publication() != postgres.DefaultPublication || d.Slot() != postgres.DefaultSlot {
		t.Errorf("the default's names: table %s, channel %s, publication %s, slot %s", d.Table(), d.Channel(), d.Publication(), d.Slot())
	}
}

// An operator drops a parked row for good: DropParked deletes it and
// returns it, key and last error, to be logged; the rows after it go on,
// and a second drop, or a drop of a row that is not parked, is refused
// with ErrNotParked and deletes nothing.
func TestDropParkedDeletesOnlyAParkedRowAndSaysWhich(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertPending(t, db, 3)
	broker := &recorder{}
	refuse2 := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 2 {
			return errors.Join(errRefused, postgres.ErrRejected)
		}
		return broker.Publish(ctx, m)
	})
	relay := newRelay(t, db, refuse2, postgres.RelayConfig{ParkAfter: 1})
	drain(t, relay)
	if parked, err := postgres.ListParked(ctx, db, 0); err != nil || len(parked) != 1 || parked[0].ID != 2 {
		t.Fatalf("ListParked = %v, %v; want row 2", parked, err)
	}
	if _, err := sqlOutbox(t, db, postgres.Config{}).DropParked(ctx, 1); !errors.Is(err, postgres.ErrNotParked) {
		t.Errorf("DropParked of a sent row = %v, want ErrNotParked", err)
	}
	dropped, err := sqlOutbox(t, db, postgres.Config{}).DropParked(ctx, 2)
	if err != nil || dropped.ID != 2 || dropped.Key == "" || !strings.Contains(dropped.LastError, "refused") || dropped.Rejections != 1 {
		t.Fatalf("DropParked(2) = %+v, %v; want row 2 with its key and its last error", dropped, err)
	}
	t.Logf("dropped: id %d key %s type %s, parked after: %s", dropped.ID, dropped.Key, dropped.Type, dropped.LastError)
	if _, err := sqlOutbox(t, db, postgres.Config{}).DropParked(ctx, 2); !errors.Is(err, postgres.ErrNotParked) {
		t.Errorf("a second DropParked(2) = %v, want ErrNotParked", err)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox`); n != 2 {
		t.Errorf("outbox holds %d rows, want 2: only the parked one gone", n)
	}
	if parked, err := postgres.ListParked(ctx, db, 0); err != nil || len(parked) != 0 {
		t.Errorf("ListParked = %v, %v; want none", parked, err)
	}
	if ids := broker.IDs(); !slices.Equal(ids, []int64{1, 3}) {
		t.Errorf("the broker got %v, want [1 3]", ids)
	}
}

// drain makes passes of relay until one marks nothing, and returns how
// many messages they marked sent; a pass's refusals are not failures here.
func drain(t *testing.T, relay *postgres.OutboxRelay) int {
	t.Helper()
	total := 0
	for {
		n, err := relay.PublishPending(context.Background())
		if err != nil && !errors.Is(err, postgres.ErrRejected) && !errors.Is(err, errRefused) {
			t.Fatal(err)
		}
		if n == 0 {
			return total
		}
		total += n
	}
}

// sqlOutbox is the outbox cfg describes on db.
func sqlOutbox(tb testing.TB, db *sql.DB, cfg postgres.Config) *postgres.Outbox[postgres.SQLTx] {
	tb.Helper()
	ob, err := postgres.OpenDB(db, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return ob
}
