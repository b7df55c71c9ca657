package outbox_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox"
)

// The article's four tests, shared by every language's edition, come first.

// Problem: the dual write. With the broker down, DirectOrderService keeps the
// order but the OrderPlaced event is lost, and nothing can bring it back.
func TestDualWriteWithBrokerDownKeepsOrderButLosesEvent(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewDirectOrderService(db, broker)

	broker.SetDown(true)
	if _, err := shop.PlaceOrder(2500); !errors.Is(err, outbox.ErrBrokerUnavailable) {
		t.Fatalf("PlaceOrder with the broker down: error %v, want ErrBrokerUnavailable", err)
	}
	wantOrders(t, db, outbox.Order{ID: 1, TotalCents: 2500})

	// The broker is back, a relay runs: the event is gone all the same,
	// because it was never written anywhere but to the broker.
	broker.SetDown(false)
	if n, err := outbox.NewOutboxRelay(db, broker).PublishPending(); n != 0 || err != nil {
		t.Errorf("relay pass: published %d, error %v; want 0, nil", n, err)
	}
	wantPublished(t, broker)
	wantOutbox(t, db)
}

// Solution: with the outbox the same failure leaves the message in the table,
// and once the broker is back the relay publishes it.
func TestOutboxKeepsMessageWhileBrokerIsDownAndRelaysItWhenBack(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop, relay := outbox.NewOrderService(db), outbox.NewOutboxRelay(db, broker)

	broker.SetDown(true)
	if id, err := shop.PlaceOrder(2500); id != 1 || err != nil {
		t.Fatalf("PlaceOrder with the broker down = %d, %v; want 1, nil", id, err)
	}
	n, err := relay.PublishPending()
	if n != 0 || !errors.Is(err, outbox.ErrBrokerUnavailable) {
		t.Fatalf("pass with the broker down: published %d, error %v; want 0, ErrBrokerUnavailable", n, err)
	}
	want := outbox.Message{ID: 1, Type: "OrderPlaced", Payload: `{"orderId":1,"totalCents":2500}`}
	wantOutbox(t, db, outbox.OutboxMessage{Message: want, Sent: false})
	wantPublished(t, broker)

	broker.SetDown(false)
	if n, err := relay.PublishPending(); n != 1 || err != nil {
		t.Fatalf("pass with the broker up: published %d, error %v; want 1, nil", n, err)
	}
	wantPublished(t, broker, want)
	wantOutbox(t, db, outbox.OutboxMessage{Message: want, Sent: true})
}

// An error inside the transaction rolls back both the order and the message.
func TestErrorInsideTransactionRollsBackOrderAndMessage(t *testing.T) {
	db := new(outbox.Database)
	place(t, outbox.NewOrderService(db), 1000) // a committed row the rollback must keep
	orders, rows := db.Orders(), db.Outbox()

	errDeclined := errors.New("payment declined")
	err := db.Transaction(func(tx *outbox.Tx) error {
		if err := insertOrderAndMessage(tx, 2500); err != nil {
			return err
		}
		return errDeclined // something fails after both writes
	})
	if err != errDeclined {
		t.Fatalf("Transaction returned %v, want the function's own error", err)
	}
	wantOrders(t, db, orders...)
	wantOutbox(t, db, rows...)
}

// A second relay pass does not publish again what the first one sent.
func TestSecondRelayPassDoesNotRepublishSentMessages(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop, relay := outbox.NewOrderService(db), outbox.NewOutboxRelay(db, broker)
	place(t, shop, 2500)
	place(t, shop, 4000)

	if n, err := relay.PublishPending(); n != 2 || err != nil {
		t.Fatalf("first pass: published %d, error %v; want 2, nil", n, err)
	}
	if n, err := relay.PublishPending(); n != 0 || err != nil {
		t.Fatalf("second pass: published %d, error %v; want 0, nil", n, err)
	}
	wantPublished(t, broker, orderPlaced(1, 2500), orderPlaced(2, 4000))
}

// Transactions that cannot leak.

func TestPanicInsideTransactionRollsBackAndRepanics(t *testing.T) {
	db := new(outbox.Database)
	shop := outbox.NewOrderService(db)
	place(t, shop, 1000)
	orders, rows := db.Orders(), db.Outbox()

	errBoom := errors.New("boom")
	got := func() (recovered any) {
		defer func() { recovered = recover() }()
		db.Transaction(func(tx *outbox.Tx) error {
			if err := insertOrderAndMessage(tx, 2500); err != nil {
				return err
			}
			panic(errBoom)
		})
		return nil
	}()
	if got != errBoom {
		t.Fatalf("recovered %v, want the function's own panic value", got)
	}
	wantOrders(t, db, orders...)
	wantOutbox(t, db, rows...)
	wantUsable(t, db)
}

// runtime.Goexit is what t.FailNow calls inside a transaction's function.
func TestGoexitInsideTransactionRollsBack(t *testing.T) {
	db := new(outbox.Database)
	done := make(chan struct{})
	go func() {
		defer close(done)
		db.Transaction(func(tx *outbox.Tx) error {
			if err := insertOrderAndMessage(tx, 2500); err != nil {
				return err
			}
			runtime.Goexit()
			return nil
		})
	}()
	<-done
	wantOrders(t, db)
	wantOutbox(t, db)
	wantUsable(t, db)
}

func TestTxUsedAfterItsTransactionEndedChangesNothing(t *testing.T) {
	db := new(outbox.Database)
	for _, result := range []error{nil, errors.New("rolled back")} {
		var leaked *outbox.Tx
		db.Transaction(func(tx *outbox.Tx) error { leaked = tx; return result })

		if _, err := leaked.InsertOrder(2500); err != outbox.ErrTxDone {
			t.Errorf("InsertOrder after the transaction (ended with %v): error %v, want ErrTxDone", result, err)
		}
		if _, err := leaked.InsertOutbox(outbox.OrderPlaced, outbox.Order{ID: 1, TotalCents: 2500}); err != outbox.ErrTxDone {
			t.Errorf("InsertOutbox after the transaction (ended with %v): error %v, want ErrTxDone", result, err)
		}
	}
	wantOrders(t, db)
	wantOutbox(t, db)
}

func TestPayloadThatCannotBeEncodedRollsBackTheOrder(t *testing.T) {
	db := new(outbox.Database)
	err := db.Transaction(func(tx *outbox.Tx) error {
		if _, err := tx.InsertOrder(2500); err != nil {
			return err
		}
		_, err := tx.InsertOutbox("Unencodable", make(chan int))
		return err
	})
	var unsupported *json.UnsupportedTypeError
	if !errors.As(err, &unsupported) {
		t.Fatalf("Transaction: error %v, want a *json.UnsupportedTypeError", err)
	}
	wantOrders(t, db)
	wantOutbox(t, db)
}

// Bad input gets a clear error and changes nothing, in both services.

func TestPlaceOrderRejectsTotalOfZeroOrLess(t *testing.T) {
	services := map[string]func(*outbox.Database, outbox.MessageBroker) interface {
		PlaceOrder(int64) (int64, error)
	}{
		"OrderService": func(db *outbox.Database, _ outbox.MessageBroker) interface {
			PlaceOrder(int64) (int64, error)
		} {
			return outbox.NewOrderService(db)
		},
		"DirectOrderService": func(db *outbox.Database, b outbox.MessageBroker) interface {
			PlaceOrder(int64) (int64, error)
		} {
			return outbox.NewDirectOrderService(db, b)
		},
	}
	for name, newService := range services {
		t.Run(name, func(t *testing.T) {
			db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
			shop := newService(db, broker)
			for _, total := range []int64{0, -1, math.MinInt64} {
				id, err := shop.PlaceOrder(total)
				if id != 0 || !errors.Is(err, outbox.ErrInvalidTotal) {
					t.Errorf("PlaceOrder(%d) = %d, %v; want 0 and ErrInvalidTotal", total, id, err)
				}
				if want := fmt.Sprint("got ", total); err == nil || !strings.Contains(err.Error(), want) {
					t.Errorf("PlaceOrder(%d): error %q does not say %q", total, err, want)
				}
			}
			wantOrders(t, db)
			wantOutbox(t, db)
			wantPublished(t, broker)

			// The smallest valid total is accepted, and no id was used up.
			if id, err := shop.PlaceOrder(1); id != 1 || err != nil {
				t.Errorf("PlaceOrder(1) = %d, %v; want 1, nil", id, err)
			}
		})
	}
}

// The relay under faults. InMemoryBroker stays as the article describes it (a
// list and a down switch); the other faults are MessageBroker implementations
// of their own, which is what the interface is for.

// failOnNth is a broker that goes down for one call: it refuses its nth
// Publish and passes every other one to next. Not safe for concurrent use.
type failOnNth struct {
	next  outbox.MessageBroker
	n     int // the call to refuse, counting from 1; 0 refuses none
	calls int
}

func (b *failOnNth) Publish(msg outbox.Message) error {
	b.calls++
	if b.calls == b.n {
		return fmt.Errorf("call %d: %w", b.calls, outbox.ErrBrokerUnavailable)
	}
	return b.next.Publish(msg)
}

// errAckLost is what the producer sees when the broker took a message but
// its acknowledgement never arrived, such as a timeout.
var errAckLost = errors.New("acknowledgement lost")

// lostAck is a broker whose acknowledgement goes missing once: when lose is
// set, the next message that next accepts is delivered, and then Publish
// reports errAckLost. Not safe for concurrent use.
type lostAck struct {
	next outbox.MessageBroker
	lose bool
}

func (b *lostAck) Publish(msg outbox.Message) error {
	if err := b.next.Publish(msg); err != nil {
		return err
	}
	if b.lose {
		b.lose = false
		return errAckLost
	}
	return nil
}

func TestRelayStopsAtNthFailureAndNextPassResumesThere(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	for _, total := range []int64{100, 200, 300, 400} {
		place(t, shop, total)
	}
	relay := outbox.NewOutboxRelay(db, &failOnNth{next: broker, n: 3})

	n, err := relay.PublishPending()
	if n != 2 || !errors.Is(err, outbox.ErrBrokerUnavailable) {
		t.Fatalf("pass with the 3rd publish refused: published %d, error %v; want 2, ErrBrokerUnavailable", n, err)
	}
	if !strings.Contains(err.Error(), "message 3") {
		t.Errorf("error %q does not name message 3", err)
	}
	wantPublished(t, broker, orderPlaced(1, 100), orderPlaced(2, 200))
	wantSent(t, db, true, true, false, false)

	if n, err := relay.PublishPending(); n != 2 || err != nil {
		t.Fatalf("next pass: published %d, error %v; want 2, nil", n, err)
	}
	wantPublished(t, broker, orderPlaced(1, 100), orderPlaced(2, 200), orderPlaced(3, 300), orderPlaced(4, 400))
	wantSent(t, db, true, true, true, true)
}

// The article's ❌ "at least once": when the acknowledgement of a delivered
// message is lost, the row stays unsent and the next pass publishes it again,
// with the same id, so an idempotent consumer still sees each order once.
func TestAtLeastOnceDeliveryLostAckPublishesDuplicateWithSameID(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	place(t, shop, 2500)
	place(t, shop, 4000)
	flaky := &lostAck{next: broker, lose: true}
	relay := outbox.NewOutboxRelay(db, flaky)

	if n, err := relay.PublishPending(); n != 0 || !errors.Is(err, errAckLost) {
		t.Fatalf("pass with a lost ack: published %d, error %v; want 0, errAckLost", n, err)
	}
	wantSent(t, db, false, false) // the relay cannot know the broker has it
	if n, err := relay.PublishPending(); n != 2 || err != nil {
		t.Fatalf("next pass: published %d, error %v; want 2, nil", n, err)
	}
	first, second := orderPlaced(1, 2500), orderPlaced(2, 4000)
	wantPublished(t, broker, first, first, second) // message 1 twice: at least once

	// A consumer that remembers message ids receives each order exactly once.
	seen := make(map[int64]bool)
	var reserved []outbox.Order
	for _, msg := range broker.Published() {
		if seen[msg.ID] {
			continue
		}
		seen[msg.ID] = true
		var order outbox.Order
		if err := json.Unmarshal([]byte(msg.Payload), &order); err != nil {
			t.Fatalf("message %d: payload %s: %v", msg.ID, msg.Payload, err)
		}
		reserved = append(reserved, order)
	}
	if want := []outbox.Order{{ID: 1, TotalCents: 2500}, {ID: 2, TotalCents: 4000}}; !slices.Equal(reserved, want) {
		t.Errorf("the idempotent consumer reserved %v, want %v", reserved, want)
	}
}

// A relay keeps no state of its own: after a crash, a new one over the same
// database resumes at the first unsent row.
func TestNewRelayResumesWhereOldOneStopped(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	for _, total := range []int64{100, 200, 300} {
		place(t, shop, total)
	}
	if n, _ := outbox.NewOutboxRelay(db, &failOnNth{next: broker, n: 2}).PublishPending(); n != 1 {
		t.Fatalf("old relay published %d, want 1", n)
	}

	if n, err := outbox.NewOutboxRelay(db, broker).PublishPending(); n != 2 || err != nil {
		t.Fatalf("new relay: published %d, error %v; want 2, nil", n, err)
	}
	wantPublished(t, broker, orderPlaced(1, 100), orderPlaced(2, 200), orderPlaced(3, 300))
}

// ✅ "the order of events is the order of rows in the table".
func TestRelayPublishesInIDOrder(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	var want []outbox.Message
	for i, total := range []int64{900, 100, 500, 300, 700, 200, 800} {
		place(t, shop, total)
		want = append(want, orderPlaced(int64(i+1), total))
	}
	if n, err := outbox.NewOutboxRelay(db, broker).PublishPending(); n != len(want) || err != nil {
		t.Fatalf("published %d, error %v; want %d, nil", n, err, len(want))
	}
	wantPublished(t, broker, want...)
}

func TestRolledBackOrderIsNeverPublishedNorHidesLaterRows(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop, relay := outbox.NewOrderService(db), outbox.NewOutboxRelay(db, broker)
	place(t, shop, 100)
	db.Transaction(func(tx *outbox.Tx) error {
		if err := insertOrderAndMessage(tx, 666); err != nil {
			return err
		}
		return errors.New("rolled back")
	})
	place(t, shop, 200)

	if n, err := relay.PublishPending(); n != 2 || err != nil {
		t.Fatalf("published %d, error %v; want 2, nil", n, err)
	}
	wantPublished(t, broker, orderPlaced(1, 100), orderPlaced(2, 200))
}

// The article's other two ❌ costs, as far as a test can show them.

// ❌ "the event arrives late": PlaceOrder has committed, yet the broker has
// nothing until the relay's next pass.
func TestDelayEventWaitsUntilNextRelayPass(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	place(t, outbox.NewOrderService(db), 2500)
	wantPublished(t, broker)

	outbox.NewOutboxRelay(db, broker).PublishPending()
	wantPublished(t, broker, orderPlaced(1, 2500))
}

// ❌ "an extra table and cleanup of sent rows": sending marks rows, it does
// not remove them, so the outbox grows with every order until something
// deletes the sent rows (see the README's "toward production").
func TestOutboxTableKeepsSentRowsUntilCleanedUp(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop, relay := outbox.NewOrderService(db), outbox.NewOutboxRelay(db, broker)
	for round := 1; round <= 3; round++ {
		place(t, shop, 2500)
		relay.PublishPending()
		if rows := db.Outbox(); len(rows) != round || !rows[round-1].Sent {
			t.Fatalf("after round %d: outbox holds %d rows (last sent: %t), want %d sent rows",
				round, len(rows), len(rows) > 0 && rows[len(rows)-1].Sent, round)
		}
	}
	if pending := db.Pending(); len(pending) != 0 {
		t.Errorf("pending: %v, want none", pending)
	}
}

// The readers hand out copies: changing them changes no table.
func TestReadersReturnCopies(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	place(t, outbox.NewOrderService(db), 2500)
	outbox.NewOutboxRelay(db, broker).PublishPending()
	place(t, outbox.NewOrderService(db), 4000)

	db.Orders()[0].TotalCents = 1
	db.Outbox()[0].Sent = false
	db.Pending()[0].Payload = "{}"
	broker.Published()[0].Payload = "{}"

	wantOrders(t, db, outbox.Order{ID: 1, TotalCents: 2500}, outbox.Order{ID: 2, TotalCents: 4000})
	wantOutbox(t, db, outbox.OutboxMessage{Message: orderPlaced(1, 2500), Sent: true},
		outbox.OutboxMessage{Message: orderPlaced(2, 4000)})
	wantPublished(t, broker, orderPlaced(1, 2500))
}

func TestMarkSentOfMissingRowChangesNothing(t *testing.T) {
	db := new(outbox.Database)
	place(t, outbox.NewOrderService(db), 2500)
	for _, id := range []int64{0, -1, 2, math.MaxInt64} {
		db.MarkSent(id)
	}
	wantSent(t, db, false)
	db.MarkSent(1)
	wantSent(t, db, true)
}

// POST /orders, the HTTP entry point of example_test.go, over real HTTP.

func TestPostOrdersAnswers201WithLocationWhileBrokerIsDown(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	broker.SetDown(true) // the handler never sees it: its answer depends on the database alone
	handler, stop := startApp(db, broker, time.Hour, func(int, error) {})
	defer stop()
	shop := httptest.NewServer(handler)
	defer shop.Close()

	resp, body := do(t, http.MethodPost, shop.URL+"/orders", `{"totalCents":2500}`)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("status %s (%s), want 201 Created", resp.Status, body)
	}
	if got := resp.Header.Get("Location"); got != "/orders/1" {
		t.Errorf("Location %q, want /orders/1", got)
	}
	if got := resp.Header.Get("Content-Type"); got != "application/json" {
		t.Errorf("Content-Type %q, want application/json", got)
	}
	if body != `{"orderId":1}`+"\n" {
		t.Errorf("body %q, want {\"orderId\":1}", body)
	}
	wantOrders(t, db, outbox.Order{ID: 1, TotalCents: 2500})
	wantOutbox(t, db, outbox.OutboxMessage{Message: orderPlaced(1, 2500)})
}

func TestPostOrdersRefusesBadInputAndWritesNothing(t *testing.T) {
	db := new(outbox.Database)
	handler, stop := startApp(db, new(outbox.InMemoryBroker), time.Hour, func(int, error) {})
	defer stop()
	shop := httptest.NewServer(handler)
	defer shop.Close()

	for _, tc := range []struct {
		name, method, body string
		status             int
	}{
		{"empty body", http.MethodPost, ``, http.StatusBadRequest},
		{"not JSON", http.MethodPost, `totalCents=2500`, http.StatusBadRequest},
		{"unknown field", http.MethodPost, `{"totalCents":2500,"coupon":"FREE"}`, http.StatusBadRequest},
		{"two objects", http.MethodPost, `{"totalCents":2500}{"totalCents":2500}`, http.StatusBadRequest},
		{"not an object", http.MethodPost, `[2500]`, http.StatusBadRequest},
		{"missing total", http.MethodPost, `{}`, http.StatusBadRequest},
		{"null total", http.MethodPost, `{"totalCents":null}`, http.StatusBadRequest},
		{"total as string", http.MethodPost, `{"totalCents":"2500"}`, http.StatusBadRequest},
		{"fractional cents", http.MethodPost, `{"totalCents":25.5}`, http.StatusBadRequest},
		{"total beyond int64", http.MethodPost, `{"totalCents":9223372036854775808}`, http.StatusBadRequest},
		{"zero total", http.MethodPost, `{"totalCents":0}`, http.StatusUnprocessableEntity},
		{"negative total", http.MethodPost, `{"totalCents":-2500}`, http.StatusUnprocessableEntity},
		{"body too large", http.MethodPost, strings.Repeat(" ", maxOrderBody) + `{"totalCents":2500}`, http.StatusRequestEntityTooLarge},
		{"body too large after the object", http.MethodPost, `{"totalCents":2500}` + strings.Repeat(" ", maxOrderBody), http.StatusRequestEntityTooLarge},
		{"GET", http.MethodGet, ``, http.StatusMethodNotAllowed},
		{"PUT", http.MethodPut, `{"totalCents":2500}`, http.StatusMethodNotAllowed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := do(t, tc.method, shop.URL+"/orders", tc.body)
			if resp.StatusCode != tc.status {
				t.Errorf("status %s (%s), want %d", resp.Status, body, tc.status)
			}
			if tc.status == http.StatusMethodNotAllowed && resp.Header.Get("Allow") != http.MethodPost {
				t.Errorf("Allow %q, want POST", resp.Header.Get("Allow"))
			}
			if tc.status != http.StatusMethodNotAllowed && !strings.Contains(body, `"error"`) {
				t.Errorf("body %q does not explain the error", body)
			}
			wantOrders(t, db)
			wantOutbox(t, db)
		})
	}
}

// Concurrency.

// gate is a broker whose first Publish call tells entered, then waits until
// release is closed. Calls made meanwhile wait for it too; all of them then
// go on to next.
type gate struct {
	next     outbox.MessageBroker
	entered  chan struct{}
	release  chan struct{}
	blockOne sync.Once
}

func (b *gate) Publish(msg outbox.Message) error {
	b.blockOne.Do(func() {
		close(b.entered)
		<-b.release
	})
	return b.next.Publish(msg)
}

// A pass that starts while another is in the middle of publishing must not
// read the rows the first one has not marked yet: it waits its turn.
func TestOverlappingPassesDoNotPublishARowTwice(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	place(t, shop, 2500)
	place(t, shop, 4000)
	g := &gate{next: broker, entered: make(chan struct{}), release: make(chan struct{})}
	relay := outbox.NewOutboxRelay(db, g)

	var wg sync.WaitGroup
	wg.Go(func() { relay.PublishPending() })
	<-g.entered // the first pass is publishing message 1 and has marked nothing
	second := make(chan struct{})
	go func() { defer close(second); relay.PublishPending() }()

	// Give the second pass a moment to read the outbox. A correct relay makes
	// it wait for the first, so the test passes however long this takes.
	select {
	case <-second:
		t.Error("a second pass finished while the first was still publishing")
	case <-time.After(50 * time.Millisecond):
	}
	close(g.release)
	wg.Wait()
	<-second
	wantPublished(t, broker, orderPlaced(1, 2500), orderPlaced(2, 4000))
}

// yielding is a broker that lets other goroutines run before each Publish,
// as a network call would, so that concurrent passes really interleave.
type yielding struct{ next outbox.MessageBroker }

func (b yielding) Publish(msg outbox.Message) error {
	runtime.Gosched()
	return b.next.Publish(msg)
}

// Overlapping passes of one relay, racing with new orders and a broker that
// goes down and up, publish every row exactly once, in id order. Under load a
// relay without its lock fails this test on most runs;
// TestOverlappingPassesDoNotPublishARowTwice catches that every time.
func TestConcurrentPassesPublishEachRowOnce(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop, relay := outbox.NewOrderService(db), outbox.NewOutboxRelay(db, yielding{broker})
	const placers, passers, each = 8, 8, 60
	var wg sync.WaitGroup
	for p := range placers {
		wg.Go(func() {
			for i := range each {
				if _, err := shop.PlaceOrder(int64(1 + p*each + i)); err != nil {
					t.Error(err)
				}
				if p == 0 && i%5 == 0 {
					broker.SetDown(i%10 == 0)
				}
			}
		})
	}
	for range passers {
		wg.Go(func() {
			for range each {
				relay.PublishPending()
			}
		})
	}
	wg.Wait()
	broker.SetDown(false)
	relay.PublishPending()
	wantEachOrderPublishedOnce(t, db, broker, placers*each)
}

// The whole application under load: at least 16 customers place orders at
// once, some over HTTP and some through the service, with bad input and
// rolled-back transactions among them, while the background relay runs and
// the broker goes down and up. After shutdown and a final pass, every
// committed order has exactly one OrderPlaced, in id order, and nothing else
// was published.
func TestStressApplicationUnderLoadPublishesEveryOrderOnce(t *testing.T) {
	const seed = 20261130
	t.Logf("seed %d", seed)
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	var passes, failedPasses atomic.Int64
	handler, stop := startApp(db, broker, time.Millisecond, func(_ int, err error) {
		passes.Add(1)
		if err != nil {
			failedPasses.Add(1)
		}
	})
	shop := httptest.NewServer(handler)
	defer shop.Close()
	service := outbox.NewOrderService(db)

	const customers, each = 16, 30
	const rolledBackTotal = 1_000_000 // no committed order has a total this large
	var committed atomic.Int64
	var wg sync.WaitGroup
	for c := range customers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			for i := range each {
				total := int64(1 + rng.IntN(99_999))
				switch op := rng.IntN(10); {
				case c == 0 && i%3 == 0: // one customer is the operator who trips the broker
					broker.SetDown(i%6 == 0)
				case op < 4: // over HTTP
					if status, _, err := placeOrder(shop.URL, total); status != "201 Created" {
						t.Errorf("POST: %q, %v; want 201 Created whatever the broker does", status, err)
						continue
					}
					committed.Add(1)
				case op < 7: // through the service
					if _, err := service.PlaceOrder(total); err != nil {
						t.Error(err)
						continue
					}
					committed.Add(1)
				case op < 8: // bad input
					if status, _, err := placeOrder(shop.URL, 0); status != "422 Unprocessable Entity" {
						t.Errorf("POST of a zero total: %q, %v; want 422", status, err)
					}
					if _, err := service.PlaceOrder(-total); !errors.Is(err, outbox.ErrInvalidTotal) {
						t.Errorf("PlaceOrder(%d): %v, want ErrInvalidTotal", -total, err)
					}
				default: // a transaction that fails after both writes
					db.Transaction(func(tx *outbox.Tx) error {
						if err := insertOrderAndMessage(tx, rolledBackTotal+total); err != nil {
							return err
						}
						return errors.New("rolled back")
					})
				}
			}
		})
	}
	wg.Wait()
	stop()
	t.Logf("background relay made %d passes, %d of them failed", passes.Load(), failedPasses.Load())

	broker.SetDown(false)
	if _, err := outbox.NewOutboxRelay(db, broker).PublishPending(); err != nil {
		t.Fatalf("final pass: %v", err)
	}
	n := int(committed.Load())
	wantEachOrderPublishedOnce(t, db, broker, n)
	for _, order := range db.Orders() {
		if order.TotalCents >= rolledBackTotal {
			t.Errorf("order %v of a rolled-back transaction was committed", order)
		}
	}
}

// wantEachOrderPublishedOnce checks that db holds n orders with ids 1..n, that
// every outbox row is sent, and that broker got exactly one OrderPlaced for
// each order, in id order, with the order's own payload.
func wantEachOrderPublishedOnce(t *testing.T, db *outbox.Database, broker *outbox.InMemoryBroker, n int) {
	t.Helper()
	orders, rows, published := db.Orders(), db.Outbox(), broker.Published()
	if len(orders) != n || len(rows) != n || len(published) != n {
		t.Fatalf("%d orders, %d outbox rows, %d published; want %d of each", len(orders), len(rows), len(published), n)
	}
	for i, order := range orders {
		want := orderPlaced(order.ID, order.TotalCents)
		switch {
		case order.ID != int64(i+1):
			t.Fatalf("order %d has id %d: ids are not 1..%d", i+1, order.ID, n)
		case !rows[i].Sent:
			t.Fatalf("outbox row %d is not sent", rows[i].ID)
		case published[i] != want:
			t.Fatalf("message %d published: %v, want %v", i+1, published[i], want)
		}
	}
}

// A model-based test. Each pair of bytes is an operation on the library and
// on a plain reference model; after each one the library must match the model
// exactly, and the guarantees must hold.

// Operations, chosen by the first byte of a pair (modulo opCount); the second
// byte is the operation's argument.
const (
	opPlace       = iota // an order of arg+1 cents through OrderService
	opPlaceFailed        // the same writes in a transaction that fails
	opBadInput           // a total of -arg (0 or less) through either service
	opBrokerDown
	opBrokerUp
	opFailNth     // the (arg%4+1)th publish from now is refused
	opLoseAck     // the next acknowledgement is lost
	opRelayPass   // one PublishPending
	opRelayReboot // a new OutboxRelay over the same database and broker
	opCount
)

func FuzzModel(f *testing.F) {
	f.Add([]byte{opPlace, 10, opRelayPass, 0})
	f.Add([]byte{opPlace, 1, opPlaceFailed, 2, opBadInput, 0, opBadInput, 7, opPlace, 3, opRelayPass, 0})
	f.Add([]byte{opBrokerDown, 0, opPlace, 1, opPlace, 2, opRelayPass, 0, opBrokerUp, 0, opRelayPass, 0, opRelayPass, 0})
	f.Add([]byte{opPlace, 1, opPlace, 2, opPlace, 3, opFailNth, 1, opRelayPass, 0, opRelayReboot, 0, opRelayPass, 0})
	f.Add([]byte{opPlace, 1, opPlace, 2, opLoseAck, 0, opRelayPass, 0, opRelayPass, 0, opLoseAck, 0, opRelayPass, 0})
	f.Add([]byte{opLoseAck, 0, opBrokerDown, 0, opPlace, 9, opRelayPass, 0, opFailNth, 0, opBrokerUp, 0,
		opRelayPass, 0, opRelayReboot, 0, opRelayPass, 0, opPlaceFailed, 1, opRelayPass, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 256 {
			ops = ops[:256] // 128 steps; the checks after each step cost O(steps)
		}
		h := newHarness()
		for i := 0; i+1 < len(ops); i += 2 {
			s := step{i / 2, ops[i] % opCount, ops[i+1]}
			h.do(t, s)
			h.check(t, s)
		}
		h.drain(t)
		h.check(t, step{n: -1})
		if n := len(h.model.placed); h.model.sent != n {
			t.Fatalf("after the final drain %d of %d rows are sent", h.model.sent, n)
		}
	})
}

// step names an operation in failure messages.
type step struct {
	n       int // -1 for the final drain
	op, arg byte
}

func (s step) String() string {
	if s.n < 0 {
		return "final drain"
	}
	return fmt.Sprintf("step %d (op %d, arg %d)", s.n, s.op, s.arg)
}

// model is the reference: what a correct library must have done.
type model struct {
	placed   []placed // committed orders in id order: order i+1 is placed[i]
	sent     int      // rows 1..sent are marked sent: always a prefix
	log      []int64  // ids of the messages the broker received, duplicates included
	lostAcks int      // how many acknowledgements were lost so far
	down     bool     // the InMemoryBroker is down
	calls    int      // Publish calls that reached the fault injectors
	failAt   int      // the call failOnNth refuses; 0 for none
	loseAck  bool     // lostAck is armed
}

// placed is a committed order in the model, with the OrderPlaced message it
// must have in the outbox (kept, not rebuilt, to keep each check cheap).
type placed struct {
	order outbox.Order
	event outbox.Message
}

// pass is the reference relay pass over the reference broker chain
// (failOnNth, then lostAck, then InMemoryBroker).
func (m *model) pass() (published int, err error) {
	for ; m.sent < len(m.placed); m.sent++ {
		m.calls++
		switch {
		case m.calls == m.failAt, m.down:
			return published, outbox.ErrBrokerUnavailable
		case m.loseAck:
			m.log = append(m.log, int64(m.sent+1))
			m.loseAck = false
			m.lostAcks++
			return published, errAckLost
		}
		m.log = append(m.log, int64(m.sent+1))
		published++
	}
	return published, nil
}

type harness struct {
	model  model
	db     *outbox.Database
	broker *outbox.InMemoryBroker
	lost   *lostAck
	fail   *failOnNth
	relay  *outbox.OutboxRelay
}

func newHarness() *harness {
	h := &harness{db: new(outbox.Database), broker: new(outbox.InMemoryBroker)}
	h.lost = &lostAck{next: h.broker}
	h.fail = &failOnNth{next: h.lost}
	h.relay = outbox.NewOutboxRelay(h.db, h.fail)
	return h
}

func (h *harness) do(t *testing.T, step step) {
	op, arg := step.op, step.arg
	m := &h.model
	orders, rows := h.db.Orders(), h.db.Outbox()
	unchanged := func() {
		t.Helper()
		if !slices.Equal(h.db.Orders(), orders) || !slices.Equal(h.db.Outbox(), rows) {
			t.Fatalf("%s: a failed operation changed the tables", step)
		}
	}
	switch op {
	case opPlace:
		total := int64(arg) + 1
		id, err := outbox.NewOrderService(h.db).PlaceOrder(total)
		want := int64(len(m.placed)) + 1
		m.placed = append(m.placed, placed{outbox.Order{ID: want, TotalCents: total}, orderPlaced(want, total)})
		if id != want || err != nil {
			t.Fatalf("%s: PlaceOrder(%d) = %d, %v; want %d, nil", step, total, id, err, want)
		}
	case opPlaceFailed:
		errFailed := errors.New("failed")
		err := h.db.Transaction(func(tx *outbox.Tx) error {
			if err := insertOrderAndMessage(tx, int64(arg)+1); err != nil {
				return err
			}
			return errFailed
		})
		if err != errFailed {
			t.Fatalf("%s: failed transaction returned %v", step, err)
		}
		unchanged()
	case opBadInput:
		var err error
		if arg%2 == 0 {
			_, err = outbox.NewOrderService(h.db).PlaceOrder(-int64(arg))
		} else {
			_, err = outbox.NewDirectOrderService(h.db, h.fail).PlaceOrder(-int64(arg))
		}
		if !errors.Is(err, outbox.ErrInvalidTotal) {
			t.Fatalf("%s: PlaceOrder(%d): %v, want ErrInvalidTotal", step, -int64(arg), err)
		}
		unchanged()
	case opBrokerDown, opBrokerUp:
		m.down = op == opBrokerDown
		h.broker.SetDown(m.down)
	case opFailNth:
		m.failAt = m.calls + int(arg%4) + 1
		h.fail.n = h.fail.calls + int(arg%4) + 1
	case opLoseAck:
		m.loseAck, h.lost.lose = true, true
	case opRelayPass:
		wantN, wantErr := m.pass()
		n, err := h.relay.PublishPending()
		if n != wantN || !errors.Is(err, wantErr) || (err == nil) != (wantErr == nil) {
			t.Fatalf("%s: PublishPending = %d, %v; the model says %d, %v", step, n, err, wantN, wantErr)
		}
	case opRelayReboot:
		h.relay = outbox.NewOutboxRelay(h.db, h.fail)
	}
}

// drain brings the broker up, disarms every fault and makes one last pass.
func (h *harness) drain(t *testing.T) {
	h.model.down, h.model.failAt, h.model.loseAck = false, 0, false
	h.broker.SetDown(false)
	h.fail.n, h.lost.lose = 0, false
	h.do(t, step{n: -1, op: opRelayPass})
}

func (h *harness) check(t *testing.T, step step) {
	t.Helper()
	m := &h.model

	// Every committed order has exactly one outbox row, with its payload;
	// ids strictly increase; the sent rows are exactly the first m.sent.
	orders, rows := h.db.Orders(), h.db.Outbox()
	if len(orders) != len(m.placed) || len(rows) != len(m.placed) {
		t.Fatalf("%s: %d orders and %d outbox rows, the model has %d", step, len(orders), len(rows), len(m.placed))
	}
	for i, p := range m.placed {
		if orders[i] != p.order {
			t.Fatalf("%s: order %d is %v, the model has %v", step, i+1, orders[i], p.order)
		}
		if want := (outbox.OutboxMessage{Message: p.event, Sent: i < m.sent}); rows[i] != want {
			t.Fatalf("%s: outbox row %d is %v, want %v", step, i+1, rows[i], want)
		}
	}

	// The broker received exactly what the model says, each message equal
	// to its row. Without its duplicates the log is the sent rows in id
	// order, plus at most the one row whose acknowledgement was just lost;
	// duplicates appear only after lost acknowledgements.
	published := h.broker.Published()
	ids := make([]int64, len(published))
	for i, msg := range published {
		ids[i] = msg.ID
		if msg.ID < 1 || int(msg.ID) > len(rows) || msg != rows[msg.ID-1].Message {
			t.Fatalf("%s: the broker received %v, which is no outbox row", step, msg)
		}
	}
	if !slices.Equal(ids, m.log) {
		t.Fatalf("%s: the broker received ids %v, the model says %v", step, ids, m.log)
	}
	unique := slices.Compact(slices.Clone(ids))
	for i, id := range unique {
		if id != int64(i+1) {
			t.Fatalf("%s: without duplicates the broker's log is %v, not 1..n in id order", step, unique)
		}
	}
	if extra := len(unique) - m.sent; extra != 0 && (extra != 1 || m.lostAcks == 0) {
		t.Fatalf("%s: the broker holds %d distinct messages but %d rows are sent", step, len(unique), m.sent)
	}
	if dups := len(ids) - len(unique); dups > m.lostAcks {
		t.Fatalf("%s: %d duplicates after only %d lost acknowledgements", step, dups, m.lostAcks)
	}
}

// Benchmarks: what the pattern costs. README.md quotes their figures.

// PlaceOrder through the outbox against the direct dual write, broker up.
// Each database is thrown away after 100 orders, so the snapshot that every
// transaction takes stays small (0 to 100 rows).
func BenchmarkPlaceOrder(b *testing.B) {
	b.Run("outbox", func(b *testing.B) {
		var shop *outbox.OrderService
		for i := 0; b.Loop(); i++ {
			if i%100 == 0 {
				shop = outbox.NewOrderService(new(outbox.Database))
			}
			shop.PlaceOrder(2500)
		}
	})
	b.Run("direct", func(b *testing.B) {
		var shop *outbox.DirectOrderService
		for i := 0; b.Loop(); i++ {
			if i%100 == 0 {
				shop = outbox.NewDirectOrderService(new(outbox.Database), new(outbox.InMemoryBroker))
			}
			shop.PlaceOrder(2500)
		}
	})
}

// Delivering one message: through a relay pass (read the pending rows,
// publish, mark sent) against a direct Publish. The relay's op is one message
// of a single pass over b.N pending rows.
func BenchmarkDeliver(b *testing.B) {
	b.Run("relay", func(b *testing.B) {
		db := new(outbox.Database)
		fill(b, db, b.N)
		relay := outbox.NewOutboxRelay(db, new(outbox.InMemoryBroker))
		b.ResetTimer()
		if n, err := relay.PublishPending(); n != b.N || err != nil {
			b.Fatalf("published %d, error %v; want %d, nil", n, err, b.N)
		}
	})
	b.Run("direct", func(b *testing.B) {
		broker := new(outbox.InMemoryBroker)
		msg := orderPlaced(1, 2500)
		for b.Loop() {
			broker.Publish(msg)
		}
	})
}

// One transaction (an order and an outbox row, rolled back so that the size
// stays put) over tables of 100 and of 10,000 rows each: the snapshot copies
// both tables, so the cost grows with them.
func BenchmarkTransaction(b *testing.B) {
	errRollback := errors.New("rollback")
	for _, rows := range []int{100, 10_000} {
		b.Run(fmt.Sprintf("rows=%d", rows), func(b *testing.B) {
			db := new(outbox.Database)
			fill(b, db, rows)
			for b.Loop() {
				db.Transaction(func(tx *outbox.Tx) error {
					if err := insertOrderAndMessage(tx, 2500); err != nil {
						return err
					}
					return errRollback
				})
			}
		})
	}
}

// fill commits n orders with their outbox rows in one transaction.
func fill(tb testing.TB, db *outbox.Database, n int) {
	err := db.Transaction(func(tx *outbox.Tx) error {
		for range n {
			if err := insertOrderAndMessage(tx, 2500); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// Helpers.

// insertOrderAndMessage makes the two writes of OrderService.PlaceOrder in
// tx: an order of total cents and its OrderPlaced outbox row.
func insertOrderAndMessage(tx *outbox.Tx, total int64) error {
	order, err := tx.InsertOrder(total)
	if err != nil {
		return err
	}
	_, err = tx.InsertOutbox(outbox.OrderPlaced, order)
	return err
}

// orderPlaced is the message that order id of total cents must produce.
func orderPlaced(id, total int64) outbox.Message {
	return outbox.Message{
		ID:      id,
		Type:    "OrderPlaced",
		Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":%d}`, id, total),
	}
}

func place(t *testing.T, shop *outbox.OrderService, total int64) int64 {
	t.Helper()
	id, err := shop.PlaceOrder(total)
	if err != nil {
		t.Fatalf("PlaceOrder(%d): %v", total, err)
	}
	return id
}

func wantOrders(t *testing.T, db *outbox.Database, want ...outbox.Order) {
	t.Helper()
	if got := db.Orders(); !slices.Equal(got, want) {
		t.Errorf("orders table: %v, want %v", got, want)
	}
}

func wantOutbox(t *testing.T, db *outbox.Database, want ...outbox.OutboxMessage) {
	t.Helper()
	if got := db.Outbox(); !slices.Equal(got, want) {
		t.Errorf("outbox table: %v, want %v", got, want)
	}
}

func wantSent(t *testing.T, db *outbox.Database, want ...bool) {
	t.Helper()
	var got []bool
	for _, row := range db.Outbox() {
		got = append(got, row.Sent)
	}
	if !slices.Equal(got, want) {
		t.Errorf("outbox rows sent: %v, want %v", got, want)
	}
}

func wantPublished(t *testing.T, broker *outbox.InMemoryBroker, want ...outbox.Message) {
	t.Helper()
	if got := broker.Published(); !slices.Equal(got, want) {
		t.Errorf("broker received %v, want %v", got, want)
	}
}

// wantUsable checks that db still takes a transaction, so no lock was left
// held, and fails the test rather than hang if it does not.
func wantUsable(t *testing.T, db *outbox.Database) {
	t.Helper()
	done := make(chan error, 1)
	go func() { _, err := outbox.NewOrderService(db).PlaceOrder(1); done <- err }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("PlaceOrder after the rollback: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the database takes no transaction: its lock is still held")
	}
}

// do sends a request over real HTTP and returns the response with its body.
// It stops the test on a transport error, so it must run on the test's own
// goroutine; goroutines use placeOrder instead.
func do(t *testing.T, method, url, body string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(data)
}
