package postgres_test

// What running the outbox takes besides the relay: lag, cleanup of both
// sides, parking the messages the broker refuses for ever, and keys that stay
// unique where consumers meet. Each test names the broken variant it
// catches.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// ReadLag counts the rows still to publish and the parked ones, and ages
// the oldest waiting row by its created_at.
func TestReadLagCountsWaitingAndParkedRowsAndAgesTheOldest(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	if lag, err := postgres.ReadLag(ctx, db); err != nil || lag != (postgres.Lag{}) {
		t.Fatalf("ReadLag of an empty outbox = %+v, %v; want zeros", lag, err)
	}
	place(t, db, 100, 200, 300, 400)
	if _, err := db.ExecContext(ctx, `UPDATE outbox SET created_at = now() - interval '1 hour' WHERE id = 2;
		UPDATE outbox SET sent_at = now() WHERE id = 1;
		UPDATE outbox SET parked_at = now() WHERE id = 4`); err != nil {
		t.Fatal(err)
	}
	lag, err := postgres.ReadLag(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if lag.Unsent != 2 || lag.Parked != 1 || lag.Oldest < time.Hour || lag.Oldest > time.Hour+generous {
		t.Errorf("ReadLag = %+v; want 2 unsent (rows 2 and 3), 1 parked, the oldest about an hour", lag)
	}
}

// DeleteSent deletes the rows sent longer than the retention ago, in
// batches, and nothing else: rows sent recently and rows not sent stay.
// (Caught: a cleanup that deletes by age alone, unsent rows with it.)
func TestDeleteSentDeletesOnlyRowsSentLongerAgo(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertPending(t, db, 10)
	// Rows 1 to 5 sent an hour ago, 6 and 7 just now; 8 to 10 unsent, and
	// all ten written an hour ago.
	if _, err := db.ExecContext(ctx, `UPDATE outbox SET created_at = now() - interval '1 hour';
		UPDATE outbox SET sent_at = now() - interval '1 hour' WHERE id <= 5;
		UPDATE outbox SET sent_at = now() WHERE id IN (6, 7)`); err != nil {
		t.Fatal(err)
	}
	if _, err := sqlOutbox(t, db, postgres.Config{CleanupBatch: 2}).DeleteSent(ctx, -time.Second); err == nil {
		t.Error("DeleteSent with a negative retention succeeded")
	}
	n, err := sqlOutbox(t, db, postgres.Config{CleanupBatch: 2}).DeleteSent(ctx, 30*time.Minute)
	if n != 5 || err != nil {
		t.Fatalf("DeleteSent = %d, %v; want 5, <nil>", n, err)
	}
	var left []int64
	rows, err := db.QueryContext(ctx, `SELECT id FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		left = append(left, id)
	}
	if err := rows.Close(); err != nil {
		t.Fatal(err)
	}
	if want := []int64{6, 7, 8, 9, 10}; !slices.Equal(left, want) {
		t.Errorf("rows left %v, want %v", left, want)
	}
}

// Ids are not handed out again after a cleanup deleted every row: the next
// order's row gets id 4, and a new key.
func TestIdsAreNotReusedAfterCleanup(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200, 300)
	broker := &recorder{}
	relay := newRelay(t, db, broker)
	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("pass = %d, %v", n, err)
	}
	if n, err := sqlOutbox(t, db, postgres.Config{}).DeleteSent(ctx, 0); n != 3 || err != nil {
		t.Fatalf("DeleteSent = %d, %v; want 3", n, err)
	}
	place(t, db, 400)
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass = %d, %v", n, err)
	}
	msgs := broker.Published()
	if msgs[3].ID != 4 || slices.ContainsFunc(msgs[:3], func(m postgres.Message) bool { return m.Key == msgs[3].Key }) {
		t.Errorf("after the cleanup the new row is %d with key %s; want id 4 and a key not seen before", msgs[3].ID, msgs[3].Key)
	}
}

// A cleanup that deletes every sent row as fast as it can, beside four
// relays and four clients placing orders, loses no unsent row and no event:
// every order reaches the warehouse, once.
func TestCleanupBesideRelaysAndPlacementLosesNothing(t *testing.T) {
	const clients, perClient = 4, 150
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	for i := range 4 {
		relay := newRelay(t, open(t, name, fmt.Sprintf("relay-%d", i)), broker, postgres.RelayConfig{BatchSize: 20, PollInterval: 10 * time.Millisecond})
		runRelay(t, relay)
	}
	cleanerCtx, stopCleaner := context.WithCancel(ctx)
	cleanup := sqlOutbox(t, db, postgres.Config{CleanupBatch: 7})
	var cleaner sync.WaitGroup
	var deleted int64
	cleaner.Go(func() {
		for cleanerCtx.Err() == nil {
			n, err := cleanup.DeleteSent(cleanerCtx, 0)
			if err != nil && cleanerCtx.Err() == nil {
				t.Errorf("DeleteSent: %v", err)
				return
			}
			deleted += n
		}
	})

	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			service := shop.NewOrderService(db)
			for range perClient {
				if _, err := service.PlaceOrder(ctx, 100); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	waitUntil(t, "every order published", func() bool {
		lag, err := postgres.ReadLag(ctx, db)
		return err == nil && lag.Unsent == 0 && len(broker.Published()) >= clients*perClient
	})
	stopCleaner()
	cleaner.Wait()
	t.Logf("the cleanup deleted %d sent rows while the relays ran", deleted)
	if deleted == 0 {
		t.Error("the cleanup deleted nothing, so it did not run beside the relays")
	}

	warehouse := shop.NewWarehouse(db)
	for _, m := range broker.Published() {
		if _, err := warehouse.Handle(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	var orders, reserved, distinct int
	if err := db.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM reservations),
		(SELECT count(DISTINCT order_id) FROM reservations)`).Scan(&orders, &reserved, &distinct); err != nil {
		t.Fatal(err)
	}
	if orders != clients*perClient || reserved != orders || distinct != orders {
		t.Errorf("%d orders, %d reservations for %d distinct orders; want %d of each", orders, reserved, distinct, clients*perClient)
	}
}

// ForgetProcessed deletes the keys processed longer than the retention ago.
// It also shows the rule: a copy that arrives after its key was forgotten is
// applied again, one that arrives within the retention is dropped.
func TestForgetProcessedForgetsOnlyOldKeys(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	warehouse := shop.NewWarehouse(db)
	msg := func(key string, order int64) postgres.Message {
		return postgres.Message{Key: key, ID: order, Type: shop.OrderPlaced,
			Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":100}`, order)}
	}
	for i, key := range []string{"old-1", "old-2", "new-3"} {
		if ok, err := warehouse.Handle(ctx, msg(key, int64(i+1))); !ok || err != nil {
			t.Fatalf("Handle(%s) = %v, %v", key, ok, err)
		}
	}
	if _, err := db.ExecContext(ctx, `UPDATE processed_messages SET processed_at = now() - interval '2 hours' WHERE message_key LIKE 'old-%'`); err != nil {
		t.Fatal(err)
	}
	if _, err := warehouse.ForgetProcessed(ctx, -time.Hour, 0); err == nil {
		t.Error("ForgetProcessed with a negative retention succeeded")
	}
	if n, err := warehouse.ForgetProcessed(ctx, time.Hour, 1); n != 2 || err != nil {
		t.Fatalf("ForgetProcessed = %d, %v; want 2, <nil>", n, err)
	}
	late, ok := warehouse.Handle(ctx, msg("old-1", 1))
	if !late || ok != nil {
		t.Errorf("a copy of a forgotten message = %v, %v; want applied again (the retention was too short for it)", late, ok)
	}
	if dup, err := warehouse.Handle(ctx, msg("new-3", 3)); dup || err != nil {
		t.Errorf("a copy within the retention = %v, %v; want dropped", dup, err)
	}
}

// ForgetProcessed forgets the position of an aggregate that was closed (its
// order cancelled) longer than the retention ago, and keeps an open one's
// however old, whose next event must still find its predecessor. (Caught:
// positions never cleaned, and positions forgotten by age alone, which
// refuses the old order's cancellation as out of order for ever.)
func TestForgetProcessedForgetsOnlyClosedPositions(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200)
	if err := shop.NewOrderService(db).CancelOrder(ctx, 1); err != nil {
		t.Fatal(err)
	}
	recorded := &recorder{}
	relay := newRelay(t, db, recorded)
	for range 2 { // order/1's cancellation goes once its placement was marked
		if _, err := relay.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	warehouse := shop.NewWarehouse(db)
	for _, m := range recorded.Published() {
		if ok, err := warehouse.Handle(ctx, m); !ok || err != nil {
			t.Fatalf("Handle(%d) = %v, %v", m.ID, ok, err)
		}
	}
	if _, err := db.ExecContext(ctx, `UPDATE aggregate_positions SET applied_at = now() - interval '2 hours';
		UPDATE processed_messages SET processed_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	if n, err := warehouse.ForgetProcessed(ctx, time.Hour, 0); n != 4 || err != nil {
		t.Fatalf("ForgetProcessed = %d, %v; want 4 (3 keys, order/1's position), <nil>", n, err)
	}
	var positions []string
	rows, err := db.QueryContext(ctx, `SELECT aggregate || ' ' || seq FROM aggregate_positions ORDER BY aggregate`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var p string
		rows.Scan(&p)
		positions = append(positions, p)
	}
	if !slices.Equal(positions, []string{"order/2 1"}) {
		t.Errorf("positions left: %v, want [order/2 1]: the open order's position kept", positions)
	}
	if err := shop.NewOrderService(db).CancelOrder(ctx, 2); err != nil {
		t.Fatal(err)
	}
	if _, err := relay.PublishPending(ctx); err != nil {
		t.Fatal(err)
	}
	last := recorded.Published()[len(recorded.Published())-1]
	if ok, err := warehouse.Handle(ctx, last); !ok || err != nil {
		t.Errorf("the old order's cancellation, after cleanup = %v, %v; want applied", ok, err)
	}
}

// A message the broker rejects for ever is parked after ParkAfter
// rejections, and the rows after it flow; each failed pass wrote its
// attempt, with the error, even though it sent nothing. ListParked shows it,
// ReadLag counts it, Unpark puts it back, after the rows that went on, its
// rejections counted from zero again.
func TestRejectedMessageIsParkedAndTheRestFlow(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200, 300)
	inner := &recorder{}
	var rejecting sync.Map
	rejecting.Store(int64(2), true)
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if _, ok := rejecting.Load(m.ID); ok {
			return fmt.Errorf("payload over the limit: %w", postgres.ErrRejected)
		}
		return inner.Publish(ctx, m)
	})
	// Over the whole table, where a refusal stops the pass.
	relay := newRelay(t, db, broker, postgres.RelayConfig{ParkAfter: 3, WholeTable: true})

	var counts []int
	for range 3 {
		n, _ := relay.PublishPending(ctx)
		counts = append(counts, n)
	}
	if want := []int{1, 0, 1}; !slices.Equal(counts, want) {
		t.Errorf("three passes published %v, want %v: row 1, then row 2 refused twice, then parked and row 3", counts, want)
	}
	if got := inner.IDs(); !slices.Equal(got, []int64{1, 3}) {
		t.Errorf("published %v, want [1 3]", got)
	}
	parked, err := postgres.ListParked(ctx, db, 0)
	if err != nil || len(parked) != 1 {
		t.Fatalf("ListParked = %v, %v; want row 2", parked, err)
	}
	if p := parked[0]; p.ID != 2 || p.Attempts != 3 || p.Rejections != 3 || p.LastError != "payload over the limit: outbox: message rejected by the broker" || p.Key == "" ||
		p.Aggregate != "order/2" || p.Seq != 1 {
		t.Errorf("parked row = %+v; want row 2 of order/2, seq 1, after 3 attempts, 3 rejections, and the broker's error", p)
	}
	if lag, err := postgres.ReadLag(ctx, db); err != nil || lag.Unsent != 0 || lag.Parked != 1 {
		t.Errorf("ReadLag = %+v, %v; want 0 unsent, 1 parked", lag, err)
	}

	if err := postgres.Unpark(ctx, db, 2); err != nil {
		t.Fatal(err)
	}
	if err := postgres.Unpark(ctx, db, 2); !errors.Is(err, postgres.ErrNotParked) {
		t.Errorf("Unpark of a row not parked = %v, want ErrNotParked", err)
	}
	// Its rejections start again from zero: one more is not yet ParkAfter.
	// (Caught: an Unpark that kept them, so that the next refusal parked
	// the row again at once.)
	if n, err := relay.PublishPending(ctx); n != 0 || !errors.Is(err, postgres.ErrRejected) {
		t.Fatalf("pass after Unpark, the broker still refusing = %d, %v; want 0, ErrRejected", n, err)
	}
	if parked, err := postgres.ListParked(ctx, db, 0); err != nil || len(parked) != 0 {
		t.Fatalf("ListParked after one refusal past Unpark = %+v, %v; want none: its rejections start from zero", parked, err)
	}
	rejecting.Delete(int64(2))
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("pass after Unpark = %d, %v; want 1", n, err)
	}
	if got := inner.IDs(); !slices.Equal(got, []int64{1, 3, 2}) {
		t.Errorf("published %v, want [1 3 2]: the parked message lost its place in the order", got)
	}
}

// A broker that is down never has a message parked, however many passes
// fail, even with ParkAfter 1; and without ParkAfter a rejected message is
// never parked either: it blocks the rest, as in the article. Every failure
// is counted. (Caught: parking on any error, which parks on a broker down.)
func TestOnlyRejectionsParkAndOnlyWhenAskedTo(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name      string
		err       error
		parkAfter int
	}{
		{"broker down, ParkAfter 1", postgres.ErrBrokerUnavailable, 1},
		{"rejected, ParkAfter 0", postgres.ErrRejected, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := newDatabase(t)
			place(t, db, 100, 200)
			relay := newRelay(t, db, brokerFunc(func(context.Context, postgres.Message) error { return tc.err }), postgres.RelayConfig{ParkAfter: tc.parkAfter, NeverPark: tc.parkAfter == 0})
			for range 5 {
				retryNow(t, db) // a rejection's backoff passed
				if n, err := relay.PublishPending(ctx); n != 0 || !errors.Is(err, tc.err) {
					t.Fatalf("pass = %d, %v; want 0 and %v", n, err, tc.err)
				}
			}
			var attempts, rejections int
			var parked bool
			if err := db.QueryRowContext(ctx, `SELECT attempts, rejections, parked_at IS NOT NULL FROM outbox WHERE id = 1`).
				Scan(&attempts, &rejections, &parked); err != nil {
				t.Fatal(err)
			}
			wantRejections := map[bool]int{true: 5, false: 0}[errors.Is(tc.err, postgres.ErrRejected)]
			if attempts != 5 || rejections != wantRejections || parked {
				t.Errorf("row 1: %d attempts, %d rejections, parked %v; want 5, %d, not parked", attempts, rejections, parked, wantRejections)
			}
			if lag, err := postgres.ReadLag(ctx, db); err != nil || lag.Unsent != 2 || lag.Parked != 0 {
				t.Errorf("ReadLag = %+v, %v; want 2 unsent, 0 parked", lag, err)
			}
		})
	}
}

// Two producers (two databases, each with its own sequence) publish
// messages with the same ids, 1 and 2, to one warehouse: the warehouse keys
// by Message.Key, so all four are applied. (Caught: a consumer keyed by id
// alone, which drops the second producer's messages as duplicates.) The
// messages carry no aggregate: two shops' "order/1" would be one aggregate
// to the warehouse, so producers that meet must name their aggregates apart
// too.
func TestTwoProducersWithTheSameIDsThroughOneWarehouse(t *testing.T) {
	ctx := context.Background()
	broker := &recorder{}
	for shopNo := range 2 {
		producer := newDatabase(t)
		for order := int64(1); order <= 2; order++ {
			if err := postgres.Transaction(ctx, producer, func(ctx context.Context, tx *sql.Tx) error {
				_, err := postgres.InsertOutbox(ctx, tx, shop.OrderPlaced,
					shop.Order{ID: 10*int64(shopNo+1) + order, TotalCents: 100})
				return err
			}); err != nil {
				t.Fatal(err)
			}
		}
		if n, err := newRelay(t, producer, broker).PublishPending(ctx); n != 2 || err != nil {
			t.Fatalf("pass = %d, %v", n, err)
		}
	}
	if got := broker.IDs(); !slices.Equal(got, []int64{1, 2, 1, 2}) {
		t.Fatalf("published ids %v, want [1 2 1 2]", got)
	}
	warehouse := shop.NewWarehouse(newDatabase(t))
	var applied []bool
	for _, m := range broker.Published() {
		ok, err := warehouse.Handle(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		applied = append(applied, ok)
	}
	if !slices.Equal(applied, []bool{true, true, true, true}) {
		t.Errorf("the warehouse applied %v, want all four", applied)
	}
}

// A cleanup with nothing to delete reads one window of rows, however many
// rows the table holds: 5,000 rows sent a moment ago, a retention of an
// hour, batches of 100; EXPLAIN ANALYZE of the batch shows its scan of the
// outbox reading at most 100 rows, and DeleteSent deletes none. (Caught: a
// cleanup whose last batch walked every row after the last one it deleted,
// 5,000 rows read to delete nothing.)
func TestCleanupWithNothingToDeleteReadsOneWindow(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload, sent_at)
		SELECT 'ItemPicked', '{}', clock_timestamp() FROM generate_series(1, 5000); ANALYZE outbox`); err != nil {
		t.Fatal(err)
	}
	if n, err := sqlOutbox(t, db, postgres.Config{CleanupBatch: 100}).DeleteSent(ctx, time.Hour); n != 0 || err != nil {
		t.Fatalf("DeleteSent = %d, %v; want nothing deleted", n, err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	var plan string
	if err := tx.QueryRowContext(ctx, `EXPLAIN (ANALYZE, FORMAT JSON) `+postgres.DeleteSentQuery, 0, time.Hour.Microseconds(), 100).Scan(&plan); err != nil {
		t.Fatal(err)
	}
	var nodes []struct {
		Plan planNode `json:"Plan"`
	}
	if err := json.Unmarshal([]byte(plan), &nodes); err != nil {
		t.Fatal(err)
	}
	read := 0.0
	var walk func(n planNode)
	walk = func(n planNode) {
		if n.Relation == "outbox" && strings.Contains(n.Type, "Scan") {
			read += (n.Rows + n.Removed) * n.Loops
		}
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(nodes[0].Plan)
	t.Logf("a batch with nothing to delete read %v rows of the outbox", read)
	if read > 100 {
		t.Errorf("a batch with nothing to delete read %v rows of 5,000; want at most its window of 100", read)
	}
}

// planNode is a node of EXPLAIN (FORMAT JSON)'s plan.
type planNode struct {
	Type     string     `json:"Node Type"`
	Relation string     `json:"Relation Name"`
	Rows     float64    `json:"Actual Rows"`
	Removed  float64    `json:"Rows Removed by Filter"`
	Loops    float64    `json:"Actual Loops"`
	Subplan  string     `json:"Subplan Name"` // "CTE released" for a WITH's plan
	Hit      int64      `json:"Shared Hit Blocks"`
	Read     int64      `json:"Shared Read Blocks"`
	Plans    []planNode `json:"Plans"`
}

// ReadLag names the first unsent row that failed to publish, with its
// attempts and last error, and none once it is sent.
func TestReadLagNamesTheRowThatHoldsTheOutboxUp(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	ob := sqlOutbox(t, db, postgres.Config{})
	first := written(ctx, t, db, "order/1", 1)
	written(ctx, t, db, "order/1", 2)
	if lag, err := ob.ReadLag(ctx); err != nil || lag.Blocking != nil {
		t.Fatalf("ReadLag with nothing failed = %+v, %v; want no blocking row", lag, err)
	}
	down := brokerFunc(func(context.Context, postgres.Message) error {
		return fmt.Errorf("payload over the limit: %w", postgres.ErrRejected)
	})
	relay := newRelayOn(t, ob, down, postgres.RelayConfig{NeverPark: true, WholeTable: true})
	for range 2 {
		relay.PublishPending(ctx)
		if _, err := db.Exec(`UPDATE outbox SET retry_at = NULL`); err != nil { // its next attempt now
			t.Fatal(err)
		}
	}
	lag, err := ob.ReadLag(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if b := lag.Blocking; b == nil || b.ID != first || b.Attempts != 2 || b.Aggregate != "order/1" || b.Type != "OrderPlaced" ||
		b.Key == "" || !strings.Contains(b.LastError, "payload over the limit") {
		t.Fatalf("Blocking = %+v; want row %d, 2 attempts, its error", b, first)
	}
	if _, err := db.Exec(`UPDATE outbox SET retry_at = NULL`); err != nil {
		t.Fatal(err)
	}
	up := newRelayOn(t, ob, &recorder{})
	for sent := 0; sent < 2; {
		n, err := up.PublishPending(ctx)
		if n == 0 || err != nil {
			t.Fatalf("pass = %d, %v after %d sent", n, err, sent)
		}
		sent += n
	}
	if lag, err := ob.ReadLag(ctx); err != nil || lag.Blocking != nil {
		t.Errorf("ReadLag once sent = %+v, %v; want no blocking row", lag.Blocking, err)
	}
}
