package postgres_test

// The relay when things are slow or fail in the middle: a broker that hangs,
// a server-wide idle timeout, a stricter default isolation, a shutdown in the
// middle of a pass, a host that vanishes, a session killed while the relay
// publishes, a commit whose answer is lost. Each test names the broken relay
// it catches.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"github.com/jackc/pgx/v5"
)

// generous is how long a test waits for something that takes milliseconds,
// or a few seconds where a server-side timeout is involved: long enough for
// a loaded machine, far shorter than what a broken relay would take (for
// ever, or TCP keepalive's two hours).
const generous = 60 * time.Second

// A broker that hangs until its context ends: the pass stops at its budget,
// marks what the broker accepted before, commits, and leaves its session idle
// with no transaction, so the rest of the rows are free for another relay at
// once and vacuum is no longer held back. (Caught: a relay whose Publish
// takes no context, which never returns.)
func TestHungBrokerCannotHoldAPassBeyondItsBudget(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	place(t, db, 100, 200, 300)

	broker := &recorder{}
	hangAt2 := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 2 {
			<-ctx.Done() // a broker that never answers, until the relay gives up
			return fmt.Errorf("no answer: %w", ctx.Err())
		}
		return publish(broker, m)
	})
	relay := newRelay(t, open(t, name, "hung-relay"), hangAt2, postgres.RelayConfig{PassTimeout: time.Second})

	type result struct {
		n   int
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, err := relay.PublishPending(ctx)
		done <- result{n, err}
	}()
	var res result
	select {
	case res = <-done:
	case <-time.After(generous):
		t.Fatalf("the pass did not return in %v with a budget of %v", generous, relay.Config().PassTimeout)
	}
	if res.n != 1 || !errors.Is(res.err, context.DeadlineExceeded) {
		t.Fatalf("pass with a hung broker = %d, %v; want 1 and context.DeadlineExceeded", res.n, res.err)
	}
	wantSent(t, db, true, false, false)

	var state string
	var xid, xmin sql.NullString
	if err := db.QueryRowContext(ctx, `SELECT state, backend_xid::text, backend_xmin::text
		FROM pg_stat_activity WHERE application_name = 'hung-relay'`).Scan(&state, &xid, &xmin); err != nil {
		t.Fatal(err)
	}
	if state != "idle" || xid.Valid || xmin.Valid {
		t.Errorf("the relay's session after the pass: state %q, backend_xid %v, backend_xmin %v; want idle with neither (vacuum free)", state, xid, xmin)
	}

	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != 2 || err != nil {
		t.Fatalf("another relay's pass right after = %d, %v; want 2, <nil>", n, err)
	}
	wantIDs(t, broker, 1, 2, 3)
}

// The livelock: idle_in_transaction_session_timeout of 500 ms on the
// database, a broker that takes 10 ms a message, a batch of 100. The pass
// publishes for about a second; it sets its own limit for its transaction and
// asks the server every ClaimCheckInterval, so the server does not end it.
// Every row is published once: publications stay bounded at the number of
// rows. (Caught: today's relay, whose every pass published 100 messages and
// then failed its mark, for ever.)
func TestServerIdleTimeoutDoesNotLivelockTheRelay(t *testing.T) {
	const rows = 100
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	if _, err := db.ExecContext(ctx, "ALTER DATABASE "+name+" SET idle_in_transaction_session_timeout = '500ms'"); err != nil {
		t.Fatal(err)
	}
	insertPending(t, db, rows)

	broker := &recorder{}
	relay := newRelay(t, open(t, name, "relay"), slowBroker(broker, 10*time.Millisecond))
	for pass := 1; pass <= 5; pass++ {
		n, err := relay.PublishPending(ctx)
		if err != nil {
			t.Fatalf("pass %d: %v", pass, err)
		}
		if n == 0 {
			break
		}
	}
	if got := len(broker.Published()); got != rows {
		t.Errorf("%d publications for %d rows, want exactly %d", got, rows, rows)
	}
	wantUnsent(t, db, 0)
}

// default_transaction_isolation = 'repeatable read' on the database: four
// relays and eight concurrent duplicate deliveries behave exactly as under
// the default, because the relay and Transaction ask for READ COMMITTED.
// (Caught: a BeginTx without the isolation level, where relays fail with
// 40001 and duplicates come back as errors.)
func TestStricterDefaultIsolationChangesNothing(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	if _, err := db.ExecContext(ctx, "ALTER DATABASE "+name+" SET default_transaction_isolation = 'repeatable read'"); err != nil {
		t.Fatal(err)
	}
	db = open(t, name, "") // connections opened after the change
	var level string
	if err := db.QueryRowContext(ctx, `SHOW default_transaction_isolation`).Scan(&level); err != nil || level != "repeatable read" {
		t.Fatalf("default_transaction_isolation = %q, %v", level, err)
	}
	drainWithFourRelays(t, name, 3000)
	deliverEightTimesAtOnce(t, db)
}

// A shutdown in the middle of a pass: the caller's context is cancelled
// right after the broker accepted message 3 of 5. The pass stops, marks 1 to
// 3 under a context of its own and commits; nothing is sent twice. If
// instead the cancellation cuts the publish of message 3 after the broker
// stored it, that one message goes twice: at most one, whatever the moment.
// (Caught: a relay that marks under the caller's context and so marks
// nothing, sending 1 to 3 again.)
func TestShutdownMidPassMarksWhatTheBrokerAccepted(t *testing.T) {
	for _, tc := range []struct {
		name     string
		inFlight bool // the cancellation cuts the publish of message 3, after the broker stored it
		marked   []bool
		wantIDs  []int64
	}{
		{"after an accept", false, []bool{true, true, true, false, false}, []int64{1, 2, 3, 4, 5}},
		{"during a publish", true, []bool{true, true, false, false, false}, []int64{1, 2, 3, 3, 4, 5}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := newDatabase(t)
			place(t, db, 100, 200, 300, 400, 500)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			broker := &recorder{}
			cancelAt3 := brokerFunc(func(ctx context.Context, m postgres.Message) error {
				err := publish(broker, m)
				if m.ID == 3 {
					cancel() // the process is told to stop
					if tc.inFlight {
						<-ctx.Done()
						return ctx.Err() // stored, but the ack is lost to the cancellation
					}
				}
				return err
			})

			n, err := newRelay(t, db, cancelAt3).PublishPending(ctx)
			if want := map[bool]int{false: 3, true: 2}[tc.inFlight]; n != want || !errors.Is(err, context.Canceled) {
				t.Fatalf("cancelled pass = %d, %v; want %d, context.Canceled", n, err, want)
			}
			wantSent(t, db, tc.marked...)

			relay := newRelay(t, db, broker)
			for {
				n, err := relay.PublishPending(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if n == 0 {
					break
				}
			}
			wantIDs(t, broker, tc.wantIDs...)
		})
	}
}

// A vanished host: the relay's connection goes through a proxy that stops
// forwarding in both directions and closes nothing, right after the relay
// claimed the rows, so the server sees neither data nor a FIN. The server
// ends the session at the pass's own idle limit (twice its 1 s budget), and
// another relay then claims and publishes the rows. (Caught: a relay that
// sets no server-side limits, whose rows stay locked until TCP keepalive
// gives up, two hours and more.)
func TestVanishedRelayFreesItsRowsAtThePassLimit(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	place(t, db, 100, 200, 300)
	p := startProxy(t)

	frozen := make(chan struct{})
	var once sync.Once
	cutOff := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		once.Do(func() { p.freeze(); close(frozen) })
		return nil // the vanished host's broker: whatever it did is gone with it
	})
	relay := newRelay(t, p.open(t, name, "vanished-relay"), cutOff, postgres.RelayConfig{PassTimeout: time.Second})
	vanished := make(chan error, 1)
	go func() { _, err := relay.PublishPending(ctx); vanished <- err }()
	<-frozen
	frozenAt := time.Now()

	broker := &recorder{}
	rescuer := newRelay(t, db, broker)
	for deadline := time.Now().Add(generous); len(broker.Published()) < 3; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the vanished relay's rows were not free after %v; published %v", generous, broker.IDs())
		}
		if _, err := rescuer.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("the vanished relay's rows were claimed again %v after its connection froze (pass budget %v)",
		time.Since(frozenAt).Round(100*time.Millisecond), relay.Config().PassTimeout)
	// Each once, in whatever order: a claim that runs while the dead
	// session's locks are being released can skip row 1 and take 2 and 3,
	// and row 1 goes on the next pass.
	if got := broker.IDs(); len(got) != 3 || !slices.Equal(slices.Sorted(slices.Values(got)), []int64{1, 2, 3}) {
		t.Errorf("the rescuing relay published %v, want 1, 2 and 3 once each", got)
	}
	wantSent(t, db, true, true, true)

	select {
	case err := <-vanished:
		if err == nil {
			t.Error("the vanished relay's pass succeeded")
		}
	case <-time.After(generous):
		t.Fatal("the vanished relay's pass did not end")
	}
}

// A relay whose session is killed in the middle of a slow pass (10 ms a
// message) goes on publishing its stale batch only until its next check:
// at most ClaimCheckInterval / 10 ms + 1 messages after the kill, then it
// stops with ErrClaimLost. (Caught: a relay that never checks, which
// publishes the whole rest of its batch.)
func TestRelayThatLostItsSessionStopsAtItsNextCheck(t *testing.T) {
	const rows, killAt, perMessage = 100, 20, 10 * time.Millisecond
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	insertPending(t, db, rows)

	var afterKill atomic.Int32
	var killed atomic.Bool
	broker := &recorder{}
	slow := slowBroker(broker, perMessage)
	killing := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if killed.Load() {
			afterKill.Add(1)
		}
		if err := slow.Publish(ctx, m); err != nil {
			return err
		}
		if m.ID == killAt {
			terminate(t, db, "slow-relay")
			killed.Store(true)
		}
		return nil
	})
	n, err := newRelay(t, open(t, name, "slow-relay"), killing).PublishPending(ctx)
	if !errors.Is(err, postgres.ErrClaimLost) {
		t.Fatalf("pass = %d, %v; want ErrClaimLost", n, err)
	}
	bound := int32(postgres.ClaimCheckInterval/perMessage) + 1
	t.Logf("after its session was killed the relay published %d more messages (bound %d)", afterKill.Load(), bound)
	if afterKill.Load() > bound {
		t.Errorf("the relay published %d messages after losing its claim, more than the bound %d", afterKill.Load(), bound)
	}
	wantUnsent(t, db, rows)
}

// A transaction with a lower id than a claimed row commits while the pass is
// publishing. The pass marks the ids the broker accepted, not a range, so
// that row stays unsent and goes on the next pass. (Caught: a mark of
// id BETWEEN the first and the last id sent.)
func TestRowCommittedDuringAPassStaysUnsent(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100) // row 1
	a := begin(t, db)
	if id := insertOrderAndRow(t, a, 200); id != 2 {
		t.Fatalf("A's row has id %d, want 2", id)
	}
	place(t, db, 300) // row 3

	broker := &recorder{}
	commitA := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 1 {
			if err := a.Commit(); err != nil {
				return err
			}
		}
		return publish(broker, m)
	})
	if n, err := newRelay(t, db, commitA).PublishPending(ctx); n != 2 || err != nil {
		t.Fatalf("pass = %d, %v; want 2 (rows 1 and 3), <nil>", n, err)
	}
	wantSent(t, db, true, false, true)
	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("next pass = %d, %v; want 1, <nil>", n, err)
	}
	wantIDs(t, broker, 1, 3, 2)
}

// Pending rows whose place in the table differs from their id order (rows 1
// to 10 were updated, so their new versions lie after row 1000): the relay
// still publishes in id order. The table is analyzed, and nearly all of it is
// pending, so that the planner reads it in heap order where the query lets
// it. (Caught: a claim with no ORDER BY, which publishes 11 to 110 first.)
func TestRelayPublishesInIDOrderWhateverTheHeapOrder(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertPending(t, db, 1000)
	if _, err := db.ExecContext(ctx, `UPDATE outbox SET created_at = created_at WHERE id <= 10`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `ANALYZE outbox`); err != nil {
		t.Fatal(err)
	}
	var first int64
	if err := db.QueryRowContext(ctx, `SELECT id FROM outbox ORDER BY ctid LIMIT 1`).Scan(&first); err != nil || first != 11 {
		t.Fatalf("the first row in the heap is %d (%v), want 11 for the test to mean anything", first, err)
	}
	broker := &recorder{}
	if _, err := newRelay(t, db, broker).PublishPending(ctx); err != nil {
		t.Fatal(err)
	}
	var want []int64
	for id := int64(1); id <= postgres.DefaultBatchSize; id++ {
		want = append(want, id)
	}
	if got := broker.IDs(); !slices.Equal(got, want) {
		t.Errorf("the first pass published %v..., want 1 to %d in order", got[:min(12, len(got))], postgres.DefaultBatchSize)
	}
}

// sent_at is when the broker accepted the message, not when the pass began.
// (Caught: sent_at = now(), the transaction's start.)
func TestSentAtIsAfterTheBrokerAccepted(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200)
	accepted := map[int64]time.Time{}
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		var at time.Time
		err := db.QueryRowContext(ctx, `SELECT clock_timestamp()`).Scan(&at) // the server's clock, as sent_at
		accepted[m.ID] = at
		return err
	})
	if _, err := newRelay(t, db, broker).PublishPending(ctx); err != nil {
		t.Fatal(err)
	}
	for id, at := range accepted {
		var sentAt time.Time
		if err := db.QueryRowContext(ctx, `SELECT sent_at FROM outbox WHERE id = $1`, id).Scan(&sentAt); err != nil {
			t.Fatal(err)
		}
		if sentAt.Before(at) {
			t.Errorf("message %d: sent_at %v is before the broker accepted it at %v", id, sentAt, at)
		}
	}
}

// When the mark fails after the broker refused a message, the error keeps
// both causes: errors.Is finds the refusal and the lost session.
func TestFailedMarkKeepsTheBrokersError(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	place(t, db, 100, 200)
	refuse2AndDie := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 2 {
			terminate(t, db, "dying-relay")
			return errRefused
		}
		return nil
	})
	n, err := newRelay(t, open(t, name, "dying-relay"), refuse2AndDie).PublishPending(ctx)
	if n != 0 || !errors.Is(err, errRefused) || err == errRefused {
		t.Fatalf("pass = %d, %v; want 0 marked and an error that holds both the refusal and the failed mark", n, err)
	}
	if !strings.Contains(err.Error(), "the pass's session is gone") {
		t.Errorf("the pass's error %q does not say that its session is gone", err)
	}
	t.Logf("the pass's error: %v", err)
	wantSent(t, db, false, false)
}

// A commit whose answer is lost: the proxy forwards PlaceOrderWithKey's
// COMMIT and drops the reply. The error says the outcome is unknown, the
// order is in fact committed, and the retry with the same key returns the
// first order's id and writes nothing: one order, one outbox row. (Caught: a
// retry without the key, which places a second order.)
func TestRetryAfterAnUnknownCommitPlacesOneOrder(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	p := startProxy(t)
	p.cutNextCommit()

	_, err := shop.NewOrderService(p.open(t, name, "shop")).PlaceOrderWithKey(ctx, "req-1", 2500)
	if !errors.Is(err, postgres.ErrCommitUnknown) {
		t.Fatalf("PlaceOrderWithKey with the COMMIT's answer lost = %v, want ErrCommitUnknown", err)
	}
	t.Logf("the lost commit: %v", err)
	wantOrders(t, db, shop.Order{ID: 1, TotalCents: 2500}) // it did commit

	id, err := shop.NewOrderService(db).PlaceOrderWithKey(ctx, "req-1", 2500)
	if id != 1 || err != nil {
		t.Fatalf("the retry = %d, %v; want 1 (the first order), <nil>", id, err)
	}
	wantOrders(t, db, shop.Order{ID: 1, TotalCents: 2500})
	wantSent(t, db, false) // one outbox row
}

// Eight concurrent requests with one key place one order; a key reused for
// another total, and malformed keys, are refused and write nothing.
func TestIdempotencyKeyPlacesOneOrder(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	service := shop.NewOrderService(db)
	var wg sync.WaitGroup
	got := make([]int64, 8)
	for i := range got {
		wg.Go(func() {
			id, err := service.PlaceOrderWithKey(ctx, "req-7", 700)
			if err != nil {
				t.Error(err)
			}
			got[i] = id
		})
	}
	wg.Wait()
	// Each request takes an id from the sequence before it meets the key's
	// conflict, so the one order's id is whichever the winner took.
	first := got[0]
	if slices.ContainsFunc(got, func(id int64) bool { return id != first }) || first == 0 {
		t.Errorf("eight requests with one key returned ids %v, want one id eight times", got)
	}
	if _, err := service.PlaceOrderWithKey(ctx, "req-7", 800); !errors.Is(err, shop.ErrIdempotencyKeyReused) {
		t.Errorf("the key again for another total = %v, want ErrIdempotencyKeyReused", err)
	}
	for _, key := range []string{"", string(make([]byte, shop.MaxIdempotencyKeyLen+1)), "a\x00b", "\xff"} {
		if id, err := service.PlaceOrderWithKey(ctx, key, 100); id != 0 || !errors.Is(err, shop.ErrInvalidIdempotencyKey) {
			t.Errorf("PlaceOrderWithKey(%q) = %d, %v; want 0, ErrInvalidIdempotencyKey", key, id, err)
		}
	}
	if _, err := service.PlaceOrderWithKey(ctx, "req-8", 0); !errors.Is(err, shop.ErrInvalidTotal) {
		t.Errorf("a zero total with a key = %v, want ErrInvalidTotal", err)
	}
	wantOrders(t, db, shop.Order{ID: first, TotalCents: 700})
	wantSent(t, db, false)
}

// ---- Helpers of the slow tests ----

// slowBroker publishes to broker after taking d, or fails when ctx ends
// first: a broker across a slow network.
func slowBroker(broker *recorder, d time.Duration) postgres.MessageBroker {
	return brokerFunc(func(ctx context.Context, m postgres.Message) error {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			return publish(broker, m)
		case <-ctx.Done():
			return ctx.Err()
		}
	})
}

// insertPending writes n OrderPlaced rows straight into the outbox.
func insertPending(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	if _, err := db.Exec(`INSERT INTO outbox (type, payload)
		SELECT 'OrderPlaced', json_build_object('orderId', g, 'totalCents', 2500) FROM generate_series(1, $1) g`, n); err != nil {
		t.Fatal(err)
	}
}

// A relay whose idle connections the server ended takes another for its
// pass, on a *sql.DB and on pgx's pool alike: the BEGIN pgx sends on the
// first reads the server's FATAL error (or cannot be written), the
// connection is dropped, and the pass goes on on the next. (Caught: the
// pass failed, once for each connection the server had ended; through
// database/sql's BeginTx it did too, since that tries again only on a
// connection found broken before it sends.) Were the connection new, or
// idle for over a second, the drivers' ping would find it broken first,
// and the test would pass without the retry.
func TestRelayTakesAnotherConnectionForOneTheServerEnded(t *testing.T) {
	for _, driver := range []string{"sql", "pgx"} {
		t.Run(driver, func(t *testing.T) {
			ctx := context.Background()
			name := newDatabaseName(t)
			db := open(t, name, "")
			var published []int64
			broker := brokerFunc(func(_ context.Context, m postgres.Message) error {
				published = append(published, m.ID)
				return nil
			})
			var relay *postgres.OutboxRelay
			if driver == "sql" {
				relayDB := open(t, name, "ended-relay")
				relayDB.SetMaxIdleConns(4)
				relay = newRelay(t, relayDB, broker)
			} else {
				relay = newRelayOn(t, pgxOutbox(t, newPoolAs(t, name, "ended-relay", 4)), broker)
			}
			place(t, db, 100)
			if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
				t.Fatalf("first pass = %d, %v; want 1, nil", n, err)
			}
			// A pass with nothing to publish takes the connection again:
			// the stdlib driver pings a connection on its first reuse, and
			// after that, as pgxpool does, only if it sat idle for over a
			// second.
			if n, err := relay.PublishPending(ctx); n != 0 || err != nil {
				t.Fatalf("empty pass = %d, %v; want 0, nil", n, err)
			}
			terminate(t, db, "ended-relay")
			place(t, db, 200)
			if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
				t.Fatalf("pass after the server ended the relay's connections = %d, %v; want 1, nil", n, err)
			}
			t.Logf("published %v", published)
			wantSent(t, db, true, true)
		})
	}
}

// A pass tries another connection only when its own broke as the
// transaction began and its context is still live, and at most BeginTries
// times in all. Breaks the relay that retries on any failed BEGIN (case
// "live connection"), after its context ended (case "context ended"), or
// without end (the loop's count).
func TestRelayTriesAnotherConnectionOnlyForOneThatBroke(t *testing.T) {
	ctx := context.Background()
	// A connection whose transaction failed refuses a BEGIN and stays
	// open: the failure is the statement's, not the connection's.
	failed := func(t *testing.T) *pgx.Conn {
		conn := connectTo(t, "")
		if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "SELECT 1/0"); err == nil {
			t.Fatal("SELECT 1/0 succeeded")
		}
		return conn
	}
	closed := func(t *testing.T) *pgx.Conn {
		conn := connectTo(t, "")
		if err := conn.Close(ctx); err != nil {
			t.Fatal(err)
		}
		return conn
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	for _, c := range []struct {
		name      string
		conn      func(*testing.T) *pgx.Conn
		ctx       context.Context
		retry     bool
		wantAgain bool
	}{
		{"live connection", failed, ctx, true, false},
		{"broken connection", closed, ctx, true, true},
		{"broken connection, last try", closed, ctx, false, false},
		{"context ended", closed, ended, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn := c.conn(t)
			ran := false
			again, err := postgres.BeginOn(c.ctx, conn, func() error { ran = true; return nil }, c.retry)
			t.Logf("again %v, %v", again, err)
			if err == nil || ran {
				t.Errorf("BeginOn = %v, ran %v; want the BEGIN's error, and the pass's body not run", err, ran)
			}
			if again != c.wantAgain {
				t.Errorf("again = %v, want %v", again, c.wantAgain)
			}
			if c.name == "live connection" && conn.IsClosed() {
				t.Error("the connection whose transaction failed was closed")
			}
		})
	}
	t.Run("tries", func(t *testing.T) {
		var retries []bool
		err := postgres.TryBegin(func(retry bool) (bool, error) {
			retries = append(retries, retry)
			return retry, fmt.Errorf("try %d", len(retries))
		})
		want := fmt.Sprintf("try %d", postgres.BeginTries)
		if len(retries) != postgres.BeginTries || retries[len(retries)-1] || err == nil || err.Error() != want {
			t.Errorf("tries told retry %v and returned %v; want %d tries, the last told no more, and %q", retries, err, postgres.BeginTries, want)
		}
	})
}

// terminate kills the backends whose application_name is app and waits
// until they have left pg_stat_activity: pg_terminate_backend only sends a
// signal, and until the backend has exited its locks are still held.
func terminate(t *testing.T, db *sql.DB, app string) {
	t.Helper()
	if _, err := db.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, app); err != nil {
		t.Error(err)
		return
	}
	for deadline := time.Now().Add(generous); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n); err != nil {
			t.Error(err)
			return
		}
		if n == 0 {
			return
		}
	}
	t.Errorf("the backends of %s were still there %v after pg_terminate_backend", app, generous)
}

func wantUnsent(t *testing.T, db *sql.DB, want int) {
	t.Helper()
	var unsent int
	if err := db.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&unsent); err != nil || unsent != want {
		t.Errorf("unsent rows: %d, %v; want %d", unsent, err, want)
	}
}
