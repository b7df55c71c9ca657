package postgres_test

// The tests run against a real PostgreSQL named by OUTBOX_POSTGRES_URL; each
// test gets a database of its own. `make postgres`, in the repository's root,
// starts a throwaway server and runs them; without the variable, go test
// starts one of its own (pgtest.Main), or fails saying what is missing.
//
// In order: the article's four tests (as in the root package), both or
// neither when the connection is killed, the trap (ids are not commit order),
// claims under concurrency and the idempotent consumer, then head-of-line
// blocking and bad input. slow_test.go has the relay under slow brokers,
// vanished hosts, lost claims, lost commits and shutdowns.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// ---- The article's four tests, on PostgreSQL ----

// Article test 1: the dual write with the broker down saves the order and
// loses its event.
func TestDualWriteWithBrokerDownKeepsOrderButLosesEvent(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	broker := &recorder{}
	broker.SetDown(true)

	id, err := shop.NewDirectOrderService(db, broker).PlaceOrder(ctx, 2500)

	if !errors.Is(err, postgres.ErrBrokerUnavailable) || id != 1 {
		t.Fatalf("PlaceOrder = %d, %v; want 1 (the saved order) and ErrBrokerUnavailable", id, err)
	}
	wantOrders(t, db, shop.Order{ID: 1, TotalCents: 2500})
	broker.SetDown(false)
	wantPublished(t, broker) // nothing will ever publish it
}

// Article test 2: with the outbox the same failure leaves the message in the
// table, and the relay publishes it, byte for byte, once the broker is back.
func TestOutboxKeepsMessageWhileBrokerIsDownAndRelaysItWhenBack(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	broker := &recorder{}
	broker.SetDown(true)
	relay := newRelay(t, db, broker)

	if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 2500); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.PublishPending(ctx); n != 0 || !errors.Is(err, postgres.ErrBrokerUnavailable) || !errors.Is(err, postgres.ErrBrokerUnavailable) {
		t.Fatalf("pass with the broker down = %d, %v; want 0, ErrBrokerUnavailable", n, err)
	}
	wantSent(t, db, false)

	broker.SetDown(false)
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass with the broker up = %d, %v; want 1, <nil>", n, err)
	}
	wantPublished(t, broker, postgres.Message{ID: 1, Type: shop.OrderPlaced, Payload: `{"orderId":1,"totalCents":2500}`})
	wantSent(t, db, true)
}

var errRolledBack = errors.New("rolled back")

// Article test 3: an error inside the transaction rolls back both the order
// and the message; so does a panic. The pool has one connection, so a
// transaction left open instead of rolled back would keep it, and what comes
// after would fail at the deadline instead of running.
func TestErrorInsideTransactionRollsBackOrderAndMessage(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db := newDatabase(t)
	db.SetMaxOpenConns(1)

	err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		var id int64
		if err := tx.QueryRowContext(ctx, `INSERT INTO orders (total_cents) VALUES (1000) RETURNING id`).Scan(&id); err != nil {
			return err
		}
		if _, err := postgres.InsertOutbox(ctx, tx, shop.OrderPlaced, shop.Order{ID: id, TotalCents: 1000}); err != nil {
			return err
		}
		return errRolledBack
	})
	if err != errRolledBack {
		t.Fatalf("Transaction = %v, want the function's own error", err)
	}

	func() {
		defer func() { _ = recover() }()
		_ = postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, `INSERT INTO orders (total_cents) VALUES (1000)`); err != nil {
				return err
			}
			if _, err := postgres.InsertOutbox(ctx, tx, shop.OrderPlaced, shop.Order{TotalCents: 1000}); err != nil {
				return err
			}
			panic("the process dies")
		})
		t.Error("Transaction returned after its function panicked")
	}()

	if err := db.QueryRowContext(ctx, `SELECT 1`).Scan(new(int)); err != nil {
		t.Fatalf("the connection is still taken, so a transaction was left open, not rolled back: %v", err)
	}
	wantOrders(t, db)
	wantSent(t, db)
}

// Article test 4: a second relay pass does not publish again what the first
// one sent.
func TestSecondRelayPassDoesNotRepublishSentMessages(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	broker := &recorder{}
	relay := newRelay(t, db, broker)
	service := shop.NewOrderService(db)
	for _, total := range []int64{2500, 4000} {
		if _, err := service.PlaceOrder(ctx, total); err != nil {
			t.Fatal(err)
		}
	}

	if n, err := relay.PublishPending(ctx); n != 2 || err != nil {
		t.Fatalf("first pass = %d, %v; want 2, <nil>", n, err)
	}
	if n, err := relay.PublishPending(ctx); n != 0 || err != nil {
		t.Fatalf("second pass = %d, %v; want 0, <nil>", n, err)
	}
	wantIDs(t, broker, 1, 2)
}

// ---- Both or neither, when the connection dies ----

// The connection that runs PlaceOrder is killed (pg_terminate_backend, as
// when the process or the network dies) after the order is inserted and
// before the outbox row is: the server rolls back, and neither row exists.
// The order's id is used up all the same: a sequence never gives a value
// back, so ids have gaps.
func TestConnectionKilledInsidePlaceOrderLeavesNeitherRow(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db, victim := open(t, name, ""), open(t, name, "victim")

	// Hold a lock that the outbox insert waits for, and the orders insert not.
	locker, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Rollback()
	if _, err := locker.ExecContext(ctx, `LOCK TABLE outbox IN SHARE ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}

	placed := make(chan error, 1)
	go func() {
		_, err := shop.NewOrderService(victim).PlaceOrder(ctx, 2500)
		placed <- err
	}()
	pid := waitForQuery(t, db, `SELECT pid FROM pg_stat_activity
		WHERE application_name = 'victim' AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO outbox%'`)
	var killed bool
	if err := db.QueryRowContext(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&killed); err != nil || !killed {
		t.Fatalf("pg_terminate_backend = %v, %v", killed, err)
	}
	if err := <-placed; err == nil {
		t.Fatal("PlaceOrder succeeded on a killed connection")
	}
	if err := locker.Rollback(); err != nil {
		t.Fatal(err)
	}

	wantOrders(t, db)
	wantSent(t, db)
	if id, err := shop.NewOrderService(db).PlaceOrder(ctx, 4000); id != 2 || err != nil {
		t.Fatalf("next PlaceOrder = %d, %v; want 2 (id 1 went with the killed transaction), <nil>", id, err)
	}
}

// ---- The trap: ids are handed out at insert, not at commit ----

// highWaterMarkRelay is WRONG, and exists to show why: it remembers the last
// id it sent and asks only for rows above it. Under concurrent writers it
// loses every row whose transaction commits after a row with a larger id was
// sent.
type highWaterMarkRelay struct {
	db     *sql.DB
	broker postgres.MessageBroker
	last   int64
}

func (r *highWaterMarkRelay) PublishPending(ctx context.Context) (int, error) {
	rows, err := r.db.QueryContext(ctx, `SELECT id, type, payload FROM outbox WHERE id > $1 ORDER BY id`, r.last)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var m postgres.Message
		if err := rows.Scan(&m.ID, &m.Type, &m.Payload); err != nil {
			return n, err
		}
		if err := r.broker.Publish(ctx, m); err != nil {
			return n, err
		}
		r.last = m.ID
		n++
	}
	return n, rows.Err()
}

// Transaction A inserts its outbox row (id 7), transaction B inserts its row
// (id 8) and commits, a relay pass runs, then A commits. OutboxRelay, which
// asks for rows whose sent flag is unset, sends 7 on its next pass, after 8:
// not lost, but out of id order. The high-water-mark relay never sends 7.
func TestRowCommittedAfterAHigherIDIsSentLateNotLost(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	flagBroker, markBroker := &recorder{}, &recorder{}
	relay := newRelay(t, db, flagBroker)
	wrong := &highWaterMarkRelay{db: db, broker: markBroker}
	passBoth := func() {
		t.Helper()
		if _, err := relay.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := wrong.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	service := shop.NewOrderService(db)
	for total := int64(100); total <= 600; total += 100 { // rows 1 to 6
		if _, err := service.PlaceOrder(ctx, total); err != nil {
			t.Fatal(err)
		}
	}
	passBoth()

	a, b := begin(t, db), begin(t, db)
	if id := insertOrderAndRow(t, a, 700); id != 7 {
		t.Fatalf("A's outbox row has id %d, want 7", id)
	}
	if id := insertOrderAndRow(t, b, 800); id != 8 {
		t.Fatalf("B's outbox row has id %d, want 8", id)
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	passBoth() // sees 8; 7 is not committed yet
	if err := a.Commit(); err != nil {
		t.Fatal(err)
	}
	passBoth()
	passBoth()

	flag, mark := flagBroker.IDs(), markBroker.IDs()
	t.Logf("sent flag (OutboxRelay):             published %v: row 7 goes one pass late, after 8", flag)
	t.Logf("high-water mark (id > last sent id): published %v: row 7 is never sent", mark)
	if want := []int64{1, 2, 3, 4, 5, 6, 8, 7}; !slices.Equal(flag, want) {
		t.Errorf("OutboxRelay published %v, want %v", flag, want)
	}
	if want := []int64{1, 2, 3, 4, 5, 6, 8}; !slices.Equal(mark, want) {
		t.Errorf("the high-water-mark relay published %v, want %v (the trap)", mark, want)
	}
	wantSent(t, db, true, true, true, true, true, true, true, true)
}

// ---- Claims under concurrency, and the idempotent consumer ----

// Four relays, each on a connection pool of its own, drain thousands of rows
// at the same time, and every row is published exactly once.
func TestFourRelaysPublishEveryRowExactlyOnce(t *testing.T) {
	drainWithFourRelays(t, newDatabaseName(t), 3000)
}

// drainWithFourRelays writes rows pending rows into the database name and
// drains them with four relays at once, each on a connection pool of its
// own, and checks that every row was published exactly once. Each relay's
// first publish waits until all four are inside a pass at once, so the
// passes are known to overlap: relays that claim the same rows publish them
// twice, and relays that wait for each other's locks never get there
// together.
func drainWithFourRelays(t *testing.T, name string, rows int) {
	t.Helper()
	const relays = 4
	ctx := context.Background()
	db := open(t, name, "")
	if _, err := db.ExecContext(ctx, `INSERT INTO orders (total_cents) SELECT g FROM generate_series(1, $1) g`, rows); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload)
		SELECT 'OrderPlaced', json_build_object('orderId', id, 'totalCents', total_cents) FROM orders ORDER BY id`); err != nil {
		t.Fatal(err)
	}
	shared := &recorder{}
	var arrived sync.WaitGroup
	arrived.Add(relays)
	together := make(chan struct{})
	go func() { arrived.Wait(); close(together) }()

	var wg sync.WaitGroup
	errs := make(chan error, 2*relays) // a relay reports at most a wait and a pass error
	for i := range relays {
		var first sync.Once
		broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
			first.Do(func() {
				arrived.Done()
				select {
				case <-together:
				case <-time.After(30 * time.Second):
					errs <- fmt.Errorf("relay %d waited 30 s for the other relays to be inside a pass at the same time", i)
				}
			})
			return publish(shared, m)
		})
		relay := newRelay(t, open(t, name, fmt.Sprintf("relay-%d", i)), broker)
		wg.Go(func() {
			for {
				n, err := relay.PublishPending(ctx)
				if err != nil {
					errs <- err
					return
				}
				if n == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	count := make(map[int64]int)
	for _, m := range shared.Published() {
		count[m.ID]++
	}
	var wrong []string
	for id := int64(1); id <= int64(rows); id++ {
		if count[id] != 1 {
			wrong = append(wrong, fmt.Sprintf("message %d %d times", id, count[id]))
		}
	}
	if len(wrong) > 0 {
		t.Errorf("%d of %d messages were not published exactly once: %s", len(wrong), rows, strings.Join(wrong[:min(5, len(wrong))], ", "))
	}
	var unsent int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&unsent); err != nil || unsent != 0 {
		t.Errorf("unsent rows after the drain: %d, %v; want 0", unsent, err)
	}
}

// A relay that dies after the broker accepted its messages and before its
// pass commits (its connection is killed from inside the last Publish) leaves
// them unsent. The next relay publishes them again, with the same ids and
// keys, and the warehouse, which drops duplicates by Message.Key, reserves
// each order once.
func TestRelayThatDiesAfterPublishingSendsAgainAndConsumerAppliesOnce(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	place(t, db, 100, 200, 300)

	broker := &recorder{}
	dying := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if err := broker.Publish(ctx, m); err != nil {
			return err
		}
		if m.ID == 3 { // accepted; now the relay's process dies
			terminate(t, db, "dying-relay") // and is gone, with its locks, before the next pass
		}
		return nil
	})
	if n, err := newRelay(t, open(t, name, "dying-relay"), dying).PublishPending(ctx); n != 0 || err == nil {
		t.Fatalf("the dying relay's pass = %d, %v; want 0 marked and an error", n, err)
	}
	wantSent(t, db, false, false, false)

	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("the next relay's pass = %d, %v; want 3, <nil>", n, err)
	}
	if got := broker.IDs(); !slices.Equal(got, []int64{1, 2, 3, 1, 2, 3}) {
		t.Errorf("broker received ids %v, want [1 2 3 1 2 3]", got)
	}
	if m := broker.Published(); m[0].Key == "" || m[0].Key != m[3].Key || m[0].Key == m[1].Key {
		t.Errorf("keys %q, %q, %q: want a key per row, the same on a re-send", m[0].Key, m[1].Key, m[3].Key)
	}

	warehouse := shop.NewWarehouse(db)
	var applied []bool
	for _, m := range broker.Published() {
		ok, err := warehouse.Handle(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		applied = append(applied, ok)
	}
	if want := []bool{true, true, true, false, false, false}; !slices.Equal(applied, want) {
		t.Errorf("Handle applied %v, want %v", applied, want)
	}
	wantReservations(t, db, shop.Order{ID: 1, TotalCents: 100}, shop.Order{ID: 2, TotalCents: 200}, shop.Order{ID: 3, TotalCents: 300})
}

// Two deliveries of one message at the same time reserve once: the second
// insert into processed_messages waits for the first transaction, then finds
// the id.
func TestConcurrentDuplicatesAreAppliedOnce(t *testing.T) {
	deliverEightTimesAtOnce(t, newDatabase(t))
}

// deliverEightTimesAtOnce hands one message to the warehouse of db eight
// times at once and checks that one delivery applied it and seven came back
// as duplicates, none as an error.
func deliverEightTimesAtOnce(t *testing.T, db *sql.DB) {
	t.Helper()
	ctx := context.Background()
	warehouse := shop.NewWarehouse(db)
	msg := postgres.Message{ID: 1, Type: shop.OrderPlaced, Payload: `{"orderId":1,"totalCents":2500}`,
		Key: "5d0f1c1e-9b35-4c2c-8a3c-2f7b1f0e6a01"}

	var applied atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			ok, err := warehouse.Handle(ctx, msg)
			if err != nil {
				t.Errorf("a duplicate delivery failed instead of returning applied == false: %v", err)
			}
			if ok {
				applied.Add(1)
			}
		})
	}
	wg.Wait()
	if applied.Load() != 1 {
		t.Errorf("%d of 8 deliveries were applied, want 1", applied.Load())
	}
	wantReservations(t, db, shop.Order{ID: 1, TotalCents: 2500})
}

// ---- The relay's other promises ----

// The relay knows nothing of orders: a row of another type, written with
// InsertOutbox in a transaction of its own, goes to the broker unchanged and
// in its place in id order.
func TestRelayPublishesAnyRowInIDOrder(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100)
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := postgres.InsertOutbox(ctx, tx, "CustomerRegistered", map[string]string{"email": "a@example.com"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	place(t, db, 300)
	broker := &recorder{}
	if _, err := newRelay(t, db, broker).PublishPending(ctx); err != nil {
		t.Fatal(err)
	}
	wantPublished(t, broker,
		postgres.Message{ID: 1, Type: shop.OrderPlaced, Payload: `{"orderId":1,"totalCents":100}`},
		postgres.Message{ID: 2, Type: "CustomerRegistered", Payload: `{"email":"a@example.com"}`},
		postgres.Message{ID: 3, Type: shop.OrderPlaced, Payload: `{"orderId":2,"totalCents":300}`})
}

// A pass claims at most BatchSize rows; the rest wait for the next pass.
func TestPassPublishesAtMostBatchSize(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 1, 2, 3, 4, 5)
	broker := &recorder{}
	relay := newRelay(t, db, broker, postgres.RelayConfig{BatchSize: 2})
	var got []int
	for range 4 {
		n, err := relay.PublishPending(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, n)
	}
	if want := []int{2, 2, 1, 0}; !slices.Equal(got, want) {
		t.Errorf("passes published %v, want %v", got, want)
	}
	wantIDs(t, broker, 1, 2, 3, 4, 5)
}

// Head-of-line blocking: a message the broker refuses on every pass holds
// back every message after it, which are fine.
func TestMessageRefusedForEverBlocksEveryLaterMessage(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200, 300)
	broker := &recorder{}
	refuse2 := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 2 {
			return errRefused
		}
		return publish(broker, m)
	})
	relay := newRelay(t, db, refuse2, postgres.RelayConfig{WholeTable: true, NeverPark: true}) // the article's relay
	for pass := 1; pass <= 3; pass++ {
		n, err := relay.PublishPending(ctx)
		if want := map[bool]int{true: 1, false: 0}[pass == 1]; n != want || !errors.Is(err, errRefused) ||
			err.Error() != "publish message 2: message refused" {
			t.Fatalf("pass %d = %d, %v; want %d, publish message 2: message refused", pass, n, err, want)
		}
	}
	wantIDs(t, broker, 1)
	wantSent(t, db, true, false, false)
}

// ---- Bad input changes nothing ----

// Both services refuse a total of zero or less with ErrInvalidTotal before
// any statement, so nothing is written and no id is used up; the orders
// table's CHECK refuses it too, for writers that bypass the services.
func TestPlaceOrderRejectsTotalOfZeroOrLess(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	broker := &recorder{}
	services := map[string]func(context.Context, int64) (int64, error){
		"outbox": shop.NewOrderService(db).PlaceOrder,
		"direct": shop.NewDirectOrderService(db, broker).PlaceOrder,
	}
	for name, placeOrder := range services {
		for _, total := range []int64{0, -1, math.MinInt64} {
			if id, err := placeOrder(ctx, total); id != 0 || !errors.Is(err, shop.ErrInvalidTotal) {
				t.Errorf("%s PlaceOrder(%d) = %d, %v; want 0, ErrInvalidTotal", name, total, id, err)
			}
		}
	}
	wantOrders(t, db)
	wantSent(t, db)
	wantPublished(t, broker)

	if id, err := shop.NewOrderService(db).PlaceOrder(ctx, 1); id != 1 || err != nil {
		t.Errorf("PlaceOrder(1) = %d, %v; want 1, <nil>", id, err)
	}
	_, err := db.ExecContext(ctx, `INSERT INTO orders (total_cents) VALUES (0)`)
	if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "23514" {
		t.Errorf("INSERT of a zero total = %v, want a check_violation (23514)", err)
	}
	wantOrders(t, db, shop.Order{ID: 1, TotalCents: 1})
}

// The warehouse refuses a message it cannot apply or deduplicate, and
// records nothing for it.
func TestWarehouseRefusesBadMessagesAndRecordsNothing(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	warehouse := shop.NewWarehouse(db)
	msg := func(key, typ, payload string) postgres.Message {
		return postgres.Message{ID: 1, Type: typ, Payload: payload, Key: key}
	}
	if _, err := warehouse.Handle(ctx, msg("", shop.OrderPlaced, `{"orderId":1,"totalCents":5}`)); !errors.Is(err, postgres.ErrNoMessageKey) {
		t.Errorf("Handle of a message with no key = %v, want ErrNoMessageKey", err)
	}
	var decodeErr *json.UnmarshalTypeError
	if _, err := warehouse.Handle(ctx, msg("k1", shop.OrderPlaced, `[1]`)); !errors.Is(err, postgres.ErrMalformedMessage) ||
		!errors.As(err, &decodeErr) || !strings.HasPrefix(err.Error(), "message k1: decode OrderPlaced payload: ") {
		t.Errorf("Handle of a payload that is not an order = %v, want ErrMalformedMessage and the decode error", err)
	}
	var processed int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM processed_messages`).Scan(&processed); err != nil || processed != 0 {
		t.Errorf("processed_messages holds %d rows (%v), want 0", processed, err)
	}
	wantReservations(t, db)
	if ok, err := warehouse.Handle(ctx, msg("k1", "CustomerRegistered", `{}`)); !ok || err != nil {
		t.Errorf("Handle of another type = %v, %v; want true (recorded, no effect), <nil>", ok, err)
	}
	wantReservations(t, db)
}

// The warehouse's batch writes what one message at a time writes: orders
// placed reserved, orders cancelled released, also one placed and cancelled
// in the same batch, in two statements for the batch; a batch with a
// payload that is not an order writes nothing and names that message.
func TestWarehouseBatchReservesWhatOneAtATimeDoes(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	warehouse := shop.NewWarehouse(db)
	event := func(typ string, id, total, seq int64) postgres.Message {
		return postgres.Message{Type: typ, Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":%d}`, id, total),
			Key: fmt.Sprintf("%s-%d", typ, id), Aggregate: shop.OrderAggregate(id), Seq: seq}
	}
	if ok, err := warehouse.Handle(ctx, event(shop.OrderPlaced, 1, 100, 1)); !ok || err != nil {
		t.Fatalf("Handle of order 1: %v, %v", ok, err)
	}
	batch := []postgres.Message{
		event(shop.OrderPlaced, 2, 200, 1),
		event(shop.OrderCancelled, 3, 300, 2), // delivered before its order: applied after it
		event(shop.OrderPlaced, 3, 300, 1),
		event(shop.OrderCancelled, 1, 100, 2), // order 1 was reserved one at a time
		event(shop.OrderPlaced, 4, 400, 1),
		{Type: "CustomerRegistered", Payload: `{}`, Key: "customer-9"},
	}
	applied, err := warehouse.HandleBatch(ctx, batch)
	if err != nil || !slices.Equal(applied, []bool{true, true, true, true, true, true}) {
		t.Fatalf("HandleBatch: %v, %v; want every message applied", applied, err)
	}
	wantReservations(t, db, shop.Order{ID: 2, TotalCents: 200}, shop.Order{ID: 4, TotalCents: 400})

	before := count(t, db, `SELECT count(*) FROM processed_messages`)
	bad := []postgres.Message{event(shop.OrderPlaced, 5, 500, 1), {Type: shop.OrderPlaced, Payload: `[1]`, Key: "bad",
		Aggregate: shop.OrderAggregate(6), Seq: 1}}
	if applied, err := warehouse.HandleBatch(ctx, bad); applied != nil || !errors.Is(err, postgres.ErrMalformedMessage) ||
		!strings.Contains(err.Error(), "message bad: decode OrderPlaced payload: ") {
		t.Errorf("HandleBatch with a payload that is not an order = %v, %v; want nil and ErrMalformedMessage naming bad", applied, err)
	}
	wantReservations(t, db, shop.Order{ID: 2, TotalCents: 200}, shop.Order{ID: 4, TotalCents: 400})
	if after := count(t, db, `SELECT count(*) FROM processed_messages`); after != before {
		t.Errorf("the refused batch recorded %d keys", after-before)
	}
}

// ---- Helpers ----

var errRefused = errors.New("message refused")

// brokerFunc makes a function a postgres.MessageBroker, for the fault brokers
// of the tests.
type brokerFunc func(context.Context, postgres.Message) error

func (f brokerFunc) Publish(ctx context.Context, msg postgres.Message) error { return f(ctx, msg) }

// recorder is a postgres.MessageBroker that keeps every message it is given,
// keys and all, in order, like the root package's InMemoryBroker; the zero
// value is a broker that is up. While it is down (SetDown) it keeps nothing
// and returns an error wrapping postgres.ErrBrokerUnavailable.
type recorder struct {
	mu   sync.Mutex
	down bool
	msgs []postgres.Message
}

func (r *recorder) Publish(_ context.Context, msg postgres.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.down {
		return fmt.Errorf("in-memory broker is down: %w", postgres.ErrBrokerUnavailable)
	}
	r.msgs = append(r.msgs, msg)
	return nil
}

// SetDown takes the broker down (true) or brings it back up (false).
func (r *recorder) SetDown(down bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.down = down
}

func (r *recorder) Published() []postgres.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.msgs)
}

func (r *recorder) IDs() []int64 {
	var ids []int64
	for _, m := range r.Published() {
		ids = append(ids, m.ID)
	}
	return ids
}

func TestMain(m *testing.M) { pgtest.Main(m) }

// newDatabaseName creates a database with the outbox's and the example's
// tables for tb alone, to be dropped when tb ends, and returns its name.
func newDatabaseName(tb testing.TB) string {
	tb.Helper()
	name := newBlankDatabase(tb)
	db := open(tb, name, "")
	if err := postgres.Migrate(context.Background(), db); err != nil {
		tb.Fatal(err)
	}
	if err := shop.Migrate(context.Background(), db); err != nil {
		tb.Fatal(err)
	}
	return name
}

// newBlankDatabase creates an empty database for tb alone, to be dropped
// when tb ends, and returns its name.
func newBlankDatabase(tb testing.TB) string { tb.Helper(); return pgtest.NewBlankDatabase(tb) }

// newDatabase is newDatabaseName, opened.
func newDatabase(tb testing.TB) *sql.DB {
	tb.Helper()
	return open(tb, newDatabaseName(tb), "")
}

// open is pgtest.Open: a pool to the database named, as application app.
func open(tb testing.TB, database, app string) *sql.DB { return pgtest.Open(tb, database, app) }

func place(t *testing.T, db *sql.DB, totals ...int64) {
	t.Helper()
	service := shop.NewOrderService(db)
	for _, total := range totals {
		if _, err := service.PlaceOrder(context.Background(), total); err != nil {
			t.Fatal(err)
		}
	}
}

func begin(t *testing.T, db *sql.DB) *sql.Tx {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// insertOrderAndRow does what PlaceOrder does inside its transaction, in a
// transaction the test commits when it chooses, and returns the row's id.
func insertOrderAndRow(t *testing.T, tx *sql.Tx, total int64) int64 {
	t.Helper()
	ctx := context.Background()
	order := shop.Order{TotalCents: total}
	if err := tx.QueryRowContext(ctx, `INSERT INTO orders (total_cents) VALUES ($1) RETURNING id`, total).Scan(&order.ID); err != nil {
		t.Fatal(err)
	}
	id, err := postgres.InsertOutbox(ctx, tx, shop.OrderPlaced, order)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// waitForQuery polls query, which returns one number, until it returns a
// row, for at most 30 s.
func waitForQuery(t *testing.T, db *sql.DB, query string) int64 {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var n int64
		err := db.QueryRow(query).Scan(&n)
		if err == nil {
			return n
		}
		if err != sql.ErrNoRows {
			t.Fatal(err)
		}
	}
	t.Fatalf("no row in 30 s from %s", query)
	return 0
}

func wantIDs(t *testing.T, broker *recorder, want ...int64) {
	t.Helper()
	if got := broker.IDs(); !slices.Equal(got, want) {
		t.Errorf("broker received message ids %v, want %v", got, want)
	}
}

// wantPublished checks the ids, types and payloads of the messages the
// broker received, in order: the lesson's Message.
func wantPublished(t *testing.T, broker *recorder, want ...postgres.Message) {
	t.Helper()
	var got []postgres.Message
	for _, m := range broker.Published() {
		got = append(got, postgres.Message{ID: m.ID, Type: m.Type, Payload: m.Payload})
	}
	if !slices.EqualFunc(got, want, func(a, b postgres.Message) bool {
		return a.ID == b.ID && a.Type == b.Type && a.Payload == b.Payload
	}) {
		t.Errorf("broker received %v, want %v", got, want)
	}
}

func wantOrders(t *testing.T, db *sql.DB, want ...shop.Order) {
	t.Helper()
	if got := queryOrders(t, db, `SELECT id, total_cents FROM orders ORDER BY id`); !slices.Equal(got, want) {
		t.Errorf("orders table: %v, want %v", got, want)
	}
}

func wantReservations(t *testing.T, db *sql.DB, want ...shop.Order) {
	t.Helper()
	if got := queryOrders(t, db, `SELECT order_id, total_cents FROM reservations ORDER BY id`); !slices.Equal(got, want) {
		t.Errorf("reservations table: %v, want %v", got, want)
	}
}

func queryOrders(t *testing.T, db *sql.DB, query string) []shop.Order {
	t.Helper()
	rows, err := db.Query(query)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var orders []shop.Order
	for rows.Next() {
		var o shop.Order
		if err := rows.Scan(&o.ID, &o.TotalCents); err != nil {
			t.Fatal(err)
		}
		orders = append(orders, o)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return orders
}

// wantSent checks the outbox table's rows, in id order: whether each is sent.
func wantSent(t *testing.T, db *sql.DB, want ...bool) {
	t.Helper()
	rows, err := db.Query(`SELECT sent_at IS NOT NULL FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []bool
	for rows.Next() {
		var sent bool
		if err := rows.Scan(&sent); err != nil {
			t.Fatal(err)
		}
		got = append(got, sent)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("outbox rows sent: %v, want %v", got, want)
	}
}

// teamTx is a team's own transaction type, as a repository layer wraps
// one: not a *sql.Tx, but a postgres.SQLTx.
type teamTx struct{ tx *sql.Tx }

func (q teamTx) Commit() error   { return q.tx.Commit() }
func (q teamTx) Rollback() error { return q.tx.Rollback() }

func (q teamTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return q.tx.ExecContext(ctx, query, args...)
}

func (q teamTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return q.tx.QueryContext(ctx, query, args...)
}

func (q teamTx) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return q.tx.QueryRowContext(ctx, query, args...)
}

// A team's own transaction, through its own type, writes the outbox row
// beside its change: rolled back, neither is there; committed, both are,
// and the relay publishes the row.
func TestWriteInATeamsOwnTransaction(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	ob := sqlOutbox(t, db, postgres.Config{})
	if _, err := db.Exec(`CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	for _, commit := range []bool{false, true} {
		tx := begin(t, db)
		q := teamTx{tx}
		if _, err := q.ExecContext(ctx, `INSERT INTO customers VALUES (7, 'Ada')`); err != nil {
			t.Fatal(err)
		}
		if _, err := ob.Write(ctx, q, postgres.Event{Type: "CustomerRegistered", Payload: map[string]any{"customerId": 7}}); err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		} else if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		var customers, rows int
		if err := db.QueryRow(`SELECT (SELECT count(*) FROM customers), (SELECT count(*) FROM outbox)`).Scan(&customers, &rows); err != nil {
			t.Fatal(err)
		}
		if want := map[bool]int{false: 0, true: 1}[commit]; customers != want || rows != want {
			t.Errorf("committed %v: %d customers, %d outbox rows; want %d of each", commit, customers, rows, want)
		}
	}
	broker := &recorder{}
	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass = %d, %v; want 1", n, err)
	}
	if m := broker.Published()[0]; m.Type != "CustomerRegistered" || m.Payload != `{"customerId":7}` {
		t.Errorf("published %+v, want the CustomerRegistered row", m)
	}
}

// The shop's PlaceOrderIn writes the order and its event in a team's own
// transaction, beside the team's own write: all of it rolls back together,
// or commits together; a bad total writes nothing.
func TestPlaceOrderInATeamsOwnTransaction(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	if _, err := db.Exec(`CREATE TABLE audit (note text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	service := shop.NewOrderService(db)
	for _, commit := range []bool{false, true} {
		tx := begin(t, db)
		q := teamTx{tx}
		if _, err := q.ExecContext(ctx, `INSERT INTO audit VALUES ('order placed')`); err != nil {
			t.Fatal(err)
		}
		if _, err := service.PlaceOrderIn(ctx, q, 0); !errors.Is(err, shop.ErrInvalidTotal) {
			t.Errorf("PlaceOrderIn(0) = %v, want ErrInvalidTotal", err)
		}
		if _, err := service.PlaceOrderIn(ctx, q, 2500); err != nil {
			t.Fatal(err)
		}
		var err error
		if commit {
			err = tx.Commit()
		} else {
			err = tx.Rollback()
		}
		if err != nil {
			t.Fatal(err)
		}
		var audits, orders, rows int
		if err := db.QueryRow(`SELECT (SELECT count(*) FROM audit), (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox)`).Scan(&audits, &orders, &rows); err != nil {
			t.Fatal(err)
		}
		if want := map[bool]int{false: 0, true: 1}[commit]; audits != want || orders != want || rows != want {
			t.Errorf("committed %v: %d audit rows, %d orders, %d outbox rows; want %d of each", commit, audits, orders, rows, want)
		}
	}
}

// ApplyOnce on a team's own table: an effect that fails records nothing and
// comes back as it was, the same message then applies, and a copy of it
// changes nothing.
func TestApplyOnceOnATeamsOwnTable(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	if _, err := db.Exec(`CREATE TABLE welcome_mails (customer bigint PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	msg := postgres.Message{ID: 1, Key: "9b1e1d3c-0000-4000-8000-000000000001", Type: "CustomerRegistered", Payload: `{"customerId":7}`}
	mailFails := errors.New("mail server down")
	apply := func(fail bool) func(context.Context, *sql.Tx) error {
		return func(ctx context.Context, tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, `INSERT INTO welcome_mails VALUES (7)`); err != nil {
				return err
			}
			if fail {
				return mailFails
			}
			return nil
		}
	}
	if applied, err := postgres.ApplyOnce(ctx, db, msg, false, apply(true)); applied || !errors.Is(err, mailFails) {
		t.Errorf("ApplyOnce with a failing effect = %v, %v; want false and the effect's error", applied, err)
	}
	var mails, keys int
	count := func() {
		t.Helper()
		if err := db.QueryRow(`SELECT (SELECT count(*) FROM welcome_mails), (SELECT count(*) FROM processed_messages)`).Scan(&mails, &keys); err != nil {
			t.Fatal(err)
		}
	}
	if count(); mails != 0 || keys != 0 {
		t.Errorf("after a failed effect: %d mails, %d keys; want none", mails, keys)
	}
	for i, want := range []bool{true, false} {
		if applied, err := postgres.ApplyOnce(ctx, db, msg, false, apply(false)); applied != want || err != nil {
			t.Errorf("delivery %d: ApplyOnce = %v, %v; want %v, <nil>", i+1, applied, err, want)
		}
	}
	if count(); mails != 1 || keys != 1 {
		t.Errorf("after two deliveries: %d mails, %d keys; want 1 and 1", mails, keys)
	}
	if _, err := postgres.ApplyOnce(ctx, db, postgres.Message{ID: 2, Type: "CustomerRegistered"}, false, apply(false)); !errors.Is(err, postgres.ErrNoMessageKey) {
		t.Errorf("ApplyOnce of a message with no key = %v, want ErrNoMessageKey", err)
	}
}

// publish hands m to b.
func publish(b *recorder, m postgres.Message) error {
	return b.Publish(context.Background(), m)
}

// newRelay is the relay cfg describes (none: the defaults) on the table
// outbox of db; a configuration NewRelay refuses fails tb.
func newRelay(tb testing.TB, db *sql.DB, broker postgres.MessageBroker, cfg ...postgres.RelayConfig) *postgres.OutboxRelay {
	tb.Helper()
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		tb.Fatal(err)
	}
	return newRelayOn(tb, ob, broker, cfg...)
}

// newRelayOn is newRelay on the Outbox ob.
func newRelayOn[T any](tb testing.TB, ob *postgres.Outbox[T], broker postgres.MessageBroker, cfg ...postgres.RelayConfig) *postgres.OutboxRelay {
	tb.Helper()
	var c postgres.RelayConfig
	if len(cfg) > 0 {
		c = cfg[0]
	}
	r, err := ob.NewRelay(broker, c)
	if err != nil {
		tb.Fatal(err)
	}
	return r
}
