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

// The tests follow the article: the problem, the solution, the structure,
// how it is wired, the pros and cons; then what goes beyond it. The article's
// four tests, shared by every language's edition, are marked "Article test N".
//
// The pros and cons, each shown: the event is not lost (article test 2, and
// the crash table in example_test.go); orders are accepted while the broker
// is down (TestPostOrdersAnswers201WithLocationWhileBrokerIsDown); the order
// of events is the order of rows (TestRelayPublishesInIDOrder: true of this
// Database, which runs one transaction at a time; on PostgreSQL ids are not
// commit order, as postgres/ shows); at-least-once delivery
// (TestAtLeastOnceDeliveryLostAckPublishesDuplicateWithSameID); the delay
// until the next pass (TestDelayEventWaitsUntilNextRelayPass); sent rows stay
// until a cleanup (TestOutboxTableKeepsSentRowsUntilCleanedUp); and, beyond
// the article, head-of-line blocking
// (TestMessageRefusedForEverBlocksEveryLaterMessage).
//
// Beyond the article: both or neither wherever the process dies, bad input
// that changes nothing, faults as MessageBroker implementations (failOnNth,
// lostAck, brokerFunc) rather than flags, overlapping passes, and the
// application's own tests (bad input over HTTP, the load test). The model of
// the library that every short history is compared with (TestModelExhaustive,
// FuzzModel: make fuzz) and the benchmarks (make bench) are checks a reader
// of the article does not need beside it: they are in lessoncheck/, a module
// of their own, and make test runs them too.

// ---- The problem: the dual write («Проблема») ----

// Article test 1. With the broker down, DirectOrderService keeps the order
// but the OrderPlaced event is lost, and nothing can bring it back.
func TestDualWriteWithBrokerDownKeepsOrderButLosesEvent(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewDirectOrderService(db, broker)

	broker.SetDown(true)
	if id, err := shop.PlaceOrder(2500); id != 1 || !errors.Is(err, outbox.ErrBrokerUnavailable) {
		t.Fatalf("PlaceOrder with the broker down = %d, %v; want 1 (the saved order) and ErrBrokerUnavailable", id, err)
	}
	wantOrders(t, db, outbox.Order{ID: 1, TotalCents: 2500})

	// The broker is back, a relay runs: the event is gone all the same,
	// because it was never written anywhere but to the broker.
	broker.SetDown(false)
	wantPass(t, outbox.NewOutboxRelay(db, broker), 0, nil)
	wantPublished(t, broker)
	wantOutbox(t, db)
}

// While nothing fails, the dual write does deliver: the direct service
// publishes the committed order's own event, with no outbox id.
func TestDirectOrderServicePublishesTheCommittedOrder(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	if id, err := outbox.NewDirectOrderService(db, broker).PlaceOrder(2500); id != 1 || err != nil {
		t.Fatalf("PlaceOrder = %d, %v; want 1, nil", id, err)
	}
	wantOrders(t, db, outbox.Order{ID: 1, TotalCents: 2500})
	wantPublished(t, broker, outbox.Message{Type: "OrderPlaced", Payload: `{"orderId":1,"totalCents":2500}`})
}

// The crash table, where the article's whole argument is run, is
// TestCrashPoints in example_test.go, beside Example_crashPoints.

// ---- The solution: one transaction («Решение») ----

// Article test 2. With the outbox the same failure leaves the message in
// the table, and once the broker is back the relay publishes it.
func TestOutboxKeepsMessageWhileBrokerIsDownAndRelaysItWhenBack(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop, relay := outbox.NewOrderService(db), outbox.NewOutboxRelay(db, broker)

	broker.SetDown(true)
	if id, err := shop.PlaceOrder(2500); id != 1 || err != nil {
		t.Fatalf("PlaceOrder with the broker down = %d, %v; want 1, nil", id, err)
	}
	wantPass(t, relay, 0, outbox.ErrBrokerUnavailable)
	want := outbox.Message{ID: 1, Type: "OrderPlaced", Payload: `{"orderId":1,"totalCents":2500}`}
	wantOutbox(t, db, outbox.OutboxMessage{Message: want, Sent: false})
	wantPublished(t, broker)

	broker.SetDown(false)
	wantPass(t, relay, 1, nil)
	wantPublished(t, broker, want)
	wantOutbox(t, db, outbox.OutboxMessage{Message: want, Sent: true})
}

// Article test 3. An error inside the transaction rolls back both the
// order and the message, and keeps what was committed before.
func TestErrorInsideTransactionRollsBackOrderAndMessage(t *testing.T) {
	db := new(outbox.Database)
	place(t, outbox.NewOrderService(db), 1000) // a committed row the rollback must keep
	orders, rows := db.Orders(), db.Outbox()

	errDeclined := errors.New("payment declined")
	err := db.Transaction(func(tx *outbox.Tx) error {
		order, err := tx.InsertOrder(2500)
		if err != nil {
			return err
		}
		if _, err := tx.InsertOutbox(outbox.OrderPlaced, order); err != nil {
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

// "Either both are saved or nothing": whatever way a transaction's function
// fails after both writes, both are rolled back, the failure goes on to the
// caller, and the database stays usable. runtime.Goexit is what t.FailNow
// calls.
func TestEveryFailureInsideTransactionRollsBackBoth(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func(tx *outbox.Tx) error // runs after the order and its message are written
		want string                    // what the caller of Transaction sees
	}{
		{"panic", func(*outbox.Tx) error { panic("boom") }, "panic: boom"},
		{"runtime.Goexit", func(*outbox.Tx) error { runtime.Goexit(); return nil }, "the goroutine exits"},
		{"payload that cannot be encoded", func(tx *outbox.Tx) error {
			_, err := tx.InsertOutbox("Unencodable", make(chan int))
			return err
		}, "error: encode Unencodable payload: json: unsupported type: chan int"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := new(outbox.Database)
			place(t, outbox.NewOrderService(db), 1000)
			orders, rows := db.Orders(), db.Outbox()
			got := "the goroutine exits" // unless Transaction returns or panics
			done := make(chan struct{})
			go func() { // a goroutine of its own, which Goexit ends
				defer close(done)
				defer func() {
					if r := recover(); r != nil {
						got = fmt.Sprint("panic: ", r)
					}
				}()
				err := db.Transaction(func(tx *outbox.Tx) error {
					if err := insertOrderAndMessage(tx, 2500); err != nil {
						return err
					}
					return tc.fail(tx)
				})
				got = fmt.Sprint("error: ", err)
			}()
			<-done
			if got != tc.want {
				t.Errorf("the caller of Transaction saw %q, want %q", got, tc.want)
			}
			wantOrders(t, db, orders...)
			wantOutbox(t, db, rows...)
			wantUsable(t, db)
		})
	}
}

// "OrderService in one transaction inserts the order and the message":
// wherever the process dies inside PlaceOrder, both rows are kept or
// neither. The test kills the process at each COMMIT in turn until
// PlaceOrder gets through; an OrderService that wrote the order and its
// message in two transactions would keep an order without its event.
func TestOrderAndEventAreSavedTogetherWhereverTheProcessDies(t *testing.T) {
	for crashAt := 1; crashAt <= 10; crashAt++ {
		db, commits := new(outbox.Database), 0
		outbox.SetBeforeCommit(db, func() {
			if commits++; commits == crashAt {
				panic(errCrash)
			}
		})
		var err error
		if crashes(func() { _, err = outbox.NewOrderService(db).PlaceOrder(2500) }) {
			if orders, rows := db.Orders(), db.Outbox(); len(orders) != 0 || len(rows) != 0 {
				t.Fatalf("the process died at COMMIT %d of PlaceOrder, and %v and %v survive; want neither", crashAt, orders, rows)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		wantOrders(t, db, outbox.Order{ID: 1, TotalCents: 2500})
		wantOutbox(t, db, outbox.OutboxMessage{Message: orderPlaced(1, 2500)})
		return
	}
	t.Fatal("PlaceOrder still had a COMMIT to make after 10")
}

// A Tx kept after its transaction ended is refused, like sql.ErrTxDone.
func TestTxUsedAfterItsTransactionEndedChangesNothing(t *testing.T) {
	db := new(outbox.Database)
	for _, result := range []error{nil, errors.New("rolled back")} {
		var leaked *outbox.Tx
		if err := db.Transaction(func(tx *outbox.Tx) error { leaked = tx; return result }); err != result {
			t.Fatalf("Transaction returned %v, want %v", err, result)
		}
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

// Bad input gets a clear error and changes nothing, in both services, and
// uses up no id.
func TestPlaceOrderRejectsTotalOfZeroOrLess(t *testing.T) {
	type placer interface{ PlaceOrder(int64) (int64, error) }
	for name, newService := range map[string]func(*outbox.Database, outbox.MessageBroker) placer{
		"OrderService":       func(db *outbox.Database, _ outbox.MessageBroker) placer { return outbox.NewOrderService(db) },
		"DirectOrderService": func(db *outbox.Database, b outbox.MessageBroker) placer { return outbox.NewDirectOrderService(db, b) },
	} {
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
			if id, err := shop.PlaceOrder(1); id != 1 || err != nil { // the smallest valid total
				t.Errorf("PlaceOrder(1) = %d, %v; want 1, nil", id, err)
			}
		})
	}
}

// ---- The structure: the relay («Структура») ----

// Article test 4. A second relay pass does not publish again what the first
// one sent.
func TestSecondRelayPassDoesNotRepublishSentMessages(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop, relay := outbox.NewOrderService(db), outbox.NewOutboxRelay(db, broker)
	place(t, shop, 2500, 4000)

	if n, err := relay.PublishPending(); n != 2 || err != nil {
		t.Fatalf("first pass: published %d, error %v; want 2, <nil>", n, err)
	}
	if n, err := relay.PublishPending(); n != 0 || err != nil {
		t.Fatalf("second pass: published %d, error %v; want 0, <nil>", n, err)
	}
	wantPublished(t, broker, orderPlaced(1, 2500), orderPlaced(2, 4000))
}

// "The relay walks the unsent messages in id order", and ✅ "the order of
// events is the order of rows in the table".
func TestRelayPublishesInIDOrder(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	var want []outbox.Message
	for i, total := range []int64{900, 100, 500, 300, 700, 200, 800} {
		place(t, shop, total)
		want = append(want, orderPlaced(int64(i+1), total))
	}
	wantPass(t, outbox.NewOutboxRelay(db, broker), len(want), nil)
	wantPublished(t, broker, want...)
}

// "The relay knows nothing of orders: it moves rows from the table to the
// broker." A row of another event type, written in a transaction of its own,
// goes to the broker unchanged, in its place in id order.
func TestRelayKnowsNothingOfOrders(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	place(t, shop, 100)
	if err := db.Transaction(func(tx *outbox.Tx) error {
		_, err := tx.InsertOutbox("CustomerRegistered", map[string]string{"email": "a@example.com"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	place(t, shop, 300)
	wantPass(t, outbox.NewOutboxRelay(db, broker), 3, nil)
	wantPublished(t, broker, orderPlaced(1, 100),
		outbox.Message{ID: 2, Type: "CustomerRegistered", Payload: `{"email":"a@example.com"}`},
		outbox.Message{ID: 3, Type: "OrderPlaced", Payload: `{"orderId":2,"totalCents":300}`})
}

// "If the broker refused, the pass stops, and what did not go stays until
// the next call": a pass whose 3rd publish is refused sends 1 and 2, marks
// only those, and the next pass sends 3 and 4.
func TestRelayStopsAtFirstFailureAndNextPassResumesThere(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	place(t, shop, 100, 200, 300, 400)
	relay := outbox.NewOutboxRelay(db, &failOnNth{next: broker, n: 3})

	if err := wantPass(t, relay, 2, outbox.ErrBrokerUnavailable); !strings.Contains(err.Error(), "message 3") {
		t.Errorf("error %q does not name message 3", err)
	}
	wantPublished(t, broker, orderPlaced(1, 100), orderPlaced(2, 200))
	wantSent(t, db, true, true, false, false)

	wantPass(t, relay, 2, nil)
	wantPublished(t, broker, orderPlaced(1, 100), orderPlaced(2, 200), orderPlaced(3, 300), orderPlaced(4, 400))
	wantSent(t, db, true, true, true, true)
}

// MarkSent of a row that does not exist is an UPDATE that matches nothing,
// and Outbox and Published hand out copies of their slices: changing an
// element changes no table and no broker. (Orders and Pending build new
// slices of values on every call, so there is nothing of theirs to check.)
func TestMarkSentOfMissingRowAndChangedCopiesChangeNothing(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	place(t, outbox.NewOrderService(db), 2500)
	for _, id := range []int64{0, -1, 2, math.MaxInt64} {
		db.MarkSent(id)
	}
	wantSent(t, db, false)
	wantPass(t, outbox.NewOutboxRelay(db, broker), 1, nil)
	place(t, outbox.NewOrderService(db), 4000)

	db.Outbox()[0].Sent = false
	broker.Published()[0].Payload = "{}"
	wantOrders(t, db, outbox.Order{ID: 1, TotalCents: 2500}, outbox.Order{ID: 2, TotalCents: 4000})
	wantOutbox(t, db, outbox.OutboxMessage{Message: orderPlaced(1, 2500), Sent: true},
		outbox.OutboxMessage{Message: orderPlaced(2, 4000)})
	wantPublished(t, broker, orderPlaced(1, 2500))
}

// ---- How it is wired: POST /orders over real HTTP («Как это собирается») ----
// The application lives in example_test.go, where Example_application runs
// the background relay; its tests as a whole (bad input over HTTP, load) are
// below, after the concurrency tests.

// "The answer 201 depends only on the database": the handler never sees the
// broker, which is down.
func TestPostOrdersAnswers201WithLocationWhileBrokerIsDown(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	broker.SetDown(true)
	handler, stop := startApp(db, broker, time.Hour, func(int, error) {})
	defer stop()
	shop := httptest.NewServer(handler)
	defer shop.Close()

	resp, body := do(t, http.MethodPost, shop.URL+"/orders", `{"totalCents":2500}`)
	got := fmt.Sprintf("%s; Location %s; %s %s", resp.Status, resp.Header.Get("Location"), resp.Header.Get("Content-Type"), body)
	if want := "201 Created; Location /orders/1; application/json {\"orderId\":1}\n"; got != want {
		t.Errorf("response %q, want %q", got, want)
	}
	wantOrders(t, db, outbox.Order{ID: 1, TotalCents: 2500})
	wantOutbox(t, db, outbox.OutboxMessage{Message: orderPlaced(1, 2500)})
}

// ---- Pros and cons («Плюсы и минусы») ----

// ❌ "At least once: if the relay falls after publishing but before marking,
// the message goes again". A lost acknowledgement is that case: the row stays
// unsent and the next pass publishes it again, with the same id, so a
// consumer that remembers ids still reserves each order once.
func TestAtLeastOnceDeliveryLostAckPublishesDuplicateWithSameID(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	place(t, shop, 2500, 4000)
	relay := outbox.NewOutboxRelay(db, &lostAck{next: broker, lose: true})

	wantPass(t, relay, 0, errAckLost)
	wantSent(t, db, false, false) // the relay cannot know the broker has it
	wantPass(t, relay, 2, nil)
	first, second := orderPlaced(1, 2500), orderPlaced(2, 4000)
	wantPublished(t, broker, first, first, second)

	seen := make(map[int64]bool) // the consumer drops a message whose id it has seen
	var handled []outbox.Message
	for _, msg := range broker.Published() {
		if !seen[msg.ID] {
			seen[msg.ID], handled = true, append(handled, msg)
		}
	}
	if !slices.Equal(handled, []outbox.Message{first, second}) {
		t.Errorf("the idempotent consumer handled %v, want each order once", handled)
	}
}

// ❌ "The event arrives late": PlaceOrder has committed, yet the broker has
// nothing until the relay's next pass.
func TestDelayEventWaitsUntilNextRelayPass(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	place(t, outbox.NewOrderService(db), 2500)
	wantPublished(t, broker)
	wantPass(t, outbox.NewOutboxRelay(db, broker), 1, nil)
	wantPublished(t, broker, orderPlaced(1, 2500))
}

// ❌ "An extra table and cleanup of sent rows": sending marks rows, it does
// not remove them, so the outbox grows with every order until something
// deletes the sent rows.
func TestOutboxTableKeepsSentRowsUntilCleanedUp(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop, relay := outbox.NewOrderService(db), outbox.NewOutboxRelay(db, broker)
	for round := 1; round <= 3; round++ {
		place(t, shop, 2500)
		wantPass(t, relay, 1, nil)
		if rows := db.Outbox(); len(rows) != round || !rows[round-1].Sent {
			t.Fatalf("after round %d: outbox holds %v, want %d sent rows", round, rows, round)
		}
	}
}

// ❌ Head-of-line blocking, which the article leaves out: since the relay
// stops at the first failure, a message the broker refuses for ever holds
// back every message after it, pass after pass.
func TestMessageRefusedForEverBlocksEveryLaterMessage(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	place(t, shop, 100, 200, 300)
	relay := outbox.NewOutboxRelay(db, brokerFunc(func(msg outbox.Message) error {
		if msg.ID == 2 {
			return errRefused // such as a payload the broker will never accept
		}
		return broker.Publish(msg)
	}))
	for _, want := range []int{1, 0, 0} {
		wantPass(t, relay, want, errRefused)
	}
	wantPublished(t, broker, orderPlaced(1, 100))
	wantSent(t, db, true, false, false) // message 3 was fine, and still waits
}

// ---- Beyond the article: faults ----
// InMemoryBroker stays as the article describes it (a list and a down
// switch); other faults are MessageBroker implementations of their own,
// which is what the interface is for.

// failOnNth is a broker that goes down for one call: it refuses its nth
// Publish and passes every other one to next.
type failOnNth struct {
	mu       sync.Mutex
	next     outbox.MessageBroker
	n, calls int // the call to refuse, counting from 1 (0 refuses none); calls so far
}

func (b *failOnNth) Publish(msg outbox.Message) error {
	b.mu.Lock()
	b.calls++
	refuse := b.calls == b.n
	b.mu.Unlock()
	if refuse {
		return fmt.Errorf("refused this once: %w", outbox.ErrBrokerUnavailable)
	}
	return b.next.Publish(msg)
}

// errAckLost is what the producer sees when the broker took a message but
// its acknowledgement never arrived, such as a timeout.
var errAckLost = errors.New("acknowledgement lost")

// lostAck is a broker whose acknowledgement goes missing once: when lose is
// set, the next message that next accepts is delivered, and then Publish
// reports errAckLost.
type lostAck struct {
	mu   sync.Mutex
	next outbox.MessageBroker
	lose bool
}

func (b *lostAck) Publish(msg outbox.Message) error {
	if err := b.next.Publish(msg); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.lose {
		b.lose = false
		return errAckLost
	}
	return nil
}

// errRefused is a broker's final word on one message.
var errRefused = errors.New("message refused")

// brokerFunc lets a function be a MessageBroker, as http.HandlerFunc lets a
// function be a Handler.
type brokerFunc func(outbox.Message) error

func (f brokerFunc) Publish(msg outbox.Message) error { return f(msg) }

// ---- Beyond the article: concurrency ----

// A pass that starts while another is still publishing must not read the
// rows the first has not marked yet: it waits its turn. A relay without its
// lock publishes message 1 a second time right away, which the first case
// of the select sees.
func TestOverlappingPassesDoNotPublishARowTwice(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	place(t, shop, 2500, 4000)
	// The broker holds the first Publish until release is closed, and reports
	// every later one on later.
	entered, release, later := make(chan struct{}), make(chan struct{}), make(chan outbox.Message, 8)
	var first atomic.Bool
	relay := outbox.NewOutboxRelay(db, brokerFunc(func(msg outbox.Message) error {
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
		} else {
			later <- msg
		}
		return broker.Publish(msg)
	}))

	results := make(chan error, 2)
	go func() { _, err := relay.PublishPending(); results <- err }()
	select {
	case <-entered: // the first pass is publishing message 1 and has marked nothing
	case err := <-results:
		t.Fatalf("the first pass ended (error %v) without publishing message 1", err)
	}
	go func() { _, err := relay.PublishPending(); results <- err }()
	select {
	case msg := <-later:
		t.Errorf("a second pass published message %d while the first was still publishing message 1", msg.ID)
	case <-results:
		t.Error("a second pass finished while the first was still publishing")
	case <-time.After(50 * time.Millisecond): // a correct relay passes however long this is
	}
	close(release)
	for range 2 {
		if err := <-results; err != nil {
			t.Errorf("pass: %v", err)
		}
	}
	wantPublished(t, broker, orderPlaced(1, 2500), orderPlaced(2, 4000))
}

// ---- Beyond the article: the application's tests (example_test.go holds the application) ----

// Bad input gets a status, a message in the client's terms (never a Go
// type), and writes nothing. Each case has a database of its own.
func TestPostOrdersRefusesBadInputAndWritesNothing(t *testing.T) {
	const (
		notObject = `body must be a JSON object, such as {"totalCents":2500}`
		notWhole  = `totalCents must be a whole number of cents, such as 2500`
		tooLarge  = `body must be at most 1024 bytes`
	)
	big := strings.Repeat(" ", maxOrderBody)
	for _, tc := range []struct {
		name, method, body string
		status             int
		message            string
	}{
		{"empty body", "POST", ``, 400, notObject},
		{"not JSON", "POST", `totalCents=2500`, 400, notObject},
		{"not an object", "POST", `[2500]`, 400, notObject},
		{"null", "POST", `null`, 400, notObject},
		{"unknown field", "POST", `{"totalCents":2500,"coupon":"FREE"}`, 400, `unknown field "coupon": the only field is "totalCents"`},
		{"field name in another case", "POST", `{"TotalCents":5}`, 400, `unknown field "TotalCents": the only field is "totalCents"`},
		{"two objects", "POST", `{"totalCents":1}{"totalCents":2}`, 400, `body must hold one JSON object, but more follows it`},
		{"missing total", "POST", `{}`, 400, `totalCents is required, as in {"totalCents":2500}`},
		{"null total", "POST", `{"totalCents":null}`, 400, notWhole},
		{"total as string", "POST", `{"totalCents":"2500"}`, 400, notWhole},
		{"fractional cents", "POST", `{"totalCents":25.5}`, 400, notWhole},
		{"total beyond int64", "POST", `{"totalCents":9223372036854775808}`, 400, `totalCents is out of range`},
		{"zero total", "POST", `{"totalCents":0}`, 422, `totalCents must be a positive number of cents, got 0`},
		{"negative total", "POST", `{"totalCents":-2500}`, 422, `totalCents must be a positive number of cents, got -2500`},
		{"body too large", "POST", big + `{"totalCents":2500}`, 413, tooLarge},
		{"body too large after the object", "POST", `{"totalCents":2500}` + big, 413, tooLarge},
		{"GET", "GET", ``, 405, ""},
		{"PUT", "PUT", `{"totalCents":2500}`, 405, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := new(outbox.Database)
			shop := httptest.NewServer(newHandler(outbox.NewOrderService(db)))
			defer shop.Close()
			resp, body := do(t, tc.method, shop.URL+"/orders", tc.body)
			wantRefusal(t, resp.StatusCode, resp.Header, body, tc.status, tc.message)
			wantOrders(t, db)
			wantOutbox(t, db)
		})
	}

	// A body of unknown length is cut off at the limit while it is read:
	// inside the object, or after it. It is served in-process: over a
	// connection, net/http would then wait half a second before closing it,
	// for the rest of a body no one reads.
	for _, body := range []string{`{"totalCents":` + big + `2500}`, `{"totalCents":2500}` + big} {
		db := new(outbox.Database)
		req := httptest.NewRequest("POST", "/orders", io.MultiReader(strings.NewReader(body)))
		rec := httptest.NewRecorder()
		newHandler(outbox.NewOrderService(db)).ServeHTTP(rec, req)
		wantRefusal(t, rec.Code, rec.Header(), rec.Body.String(), 413, tooLarge)
		wantOrders(t, db)
		wantOutbox(t, db)
	}
}

func wantRefusal(t *testing.T, status int, header http.Header, body string, wantStatus int, wantMessage string) {
	t.Helper()
	if status != wantStatus {
		t.Errorf("status %d (%s), want %d", status, body, wantStatus)
	}
	if wantStatus == http.StatusMethodNotAllowed {
		if header.Get("Allow") != http.MethodPost {
			t.Errorf("Allow %q, want POST", header.Get("Allow"))
		}
		return
	}
	var got struct{ Error string }
	if err := json.Unmarshal([]byte(body), &got); err != nil || got.Error != wantMessage {
		t.Errorf("body %q, want the error %q", body, wantMessage)
	}
}

// The whole application under load: 16 customers place orders at once, over
// HTTP and through the service, with bad input and rolled-back transactions
// among them, while the background relay runs and an operator takes the
// broker down three times, each time until a pass has met it down. After
// shutdown and a final pass, every committed order has exactly one
// OrderPlaced, in id order, and nothing else was published.
func TestStressApplicationUnderLoadPublishesEveryOrderOnce(t *testing.T) {
	const seed = 20261130
	t.Logf("seed %d", seed)
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	var failedPasses, passes atomic.Int64
	handler, stop := startApp(db, broker, time.Millisecond, func(_ int, err error) {
		if err != nil {
			failedPasses.Add(1)
		}
		passes.Add(1)
	})
	shop := httptest.NewServer(handler)
	defer shop.Close()
	service := outbox.NewOrderService(db)

	const rolledBackTotal = 1_000_000 // no committed order has a total this large
	var committed atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() { // the operator
		for range 3 {
			broker.SetDown(true)
			failed := failedPasses.Load()
			if _, err := service.PlaceOrder(1); err != nil { // a row for the down broker to refuse
				t.Error(err)
				return
			}
			committed.Add(1)
			if !waitForPass(&passes, func() bool { return failedPasses.Load() > failed }) {
				t.Error("no relay pass met the broker while it was down")
			}
			broker.SetDown(false)
		}
	})
	for c := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			for i := range 30 {
				total := int64(1 + rng.IntN(99_999))
				switch (c + i) % 4 { // every kind, in an order that differs between customers
				case 0:
					if status, _, err := postOrder(shop.URL, total); status != http.StatusCreated {
						t.Errorf("POST: %d, %v; want 201 whatever the broker does", status, err)
						continue
					}
					committed.Add(1)
				case 1:
					if _, err := service.PlaceOrder(total); err != nil {
						t.Error(err)
						continue
					}
					committed.Add(1)
				case 2:
					if status, _, err := postOrder(shop.URL, -total); status != http.StatusUnprocessableEntity {
						t.Errorf("POST of a total of %d: %d, %v; want 422", -total, status, err)
					}
				case 3:
					if err := rollBack(db, rolledBackTotal+total); err != errRolledBack {
						t.Errorf("rolled-back transaction returned %v", err)
					}
				}
			}
		})
	}
	wg.Wait()
	stop()
	t.Logf("%d orders committed; %d relay passes met the broker down", committed.Load(), failedPasses.Load())

	wantPass(t, outbox.NewOutboxRelay(db, broker), len(db.Pending()), nil)
	n := int(committed.Load())
	orders, rows, published := db.Orders(), db.Outbox(), broker.Published()
	if len(orders) != n || len(rows) != n || len(published) != n {
		t.Fatalf("%d orders, %d outbox rows, %d published; want %d of each", len(orders), len(rows), len(published), n)
	}
	for i, order := range orders {
		switch want := orderPlaced(order.ID, order.TotalCents); {
		case order.ID != int64(i+1) || order.TotalCents >= rolledBackTotal:
			t.Fatalf("order %d is %v: ids are not 1..%d, or it was rolled back", i+1, order, n)
		case rows[i] != outbox.OutboxMessage{Message: want, Sent: true}:
			t.Fatalf("outbox row %d is %v, want %v sent", i+1, rows[i], want)
		case published[i] != want:
			t.Fatalf("message %d published: %v, want %v", i+1, published[i], want)
		}
	}
}

// ---- Helpers ----

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

// errRolledBack is the error with which rollBack fails its transactions.
var errRolledBack = errors.New("rolled back")

// rollBack makes the two writes of an order of total cents in a transaction
// that then fails with errRolledBack, and returns what Transaction returned.
func rollBack(db *outbox.Database, total int64) error {
	return db.Transaction(func(tx *outbox.Tx) error {
		if err := insertOrderAndMessage(tx, total); err != nil {
			return err
		}
		return errRolledBack
	})
}

// orderPlaced is the message that order id of total cents must produce.
func orderPlaced(id, total int64) outbox.Message {
	return outbox.Message{
		ID:      id,
		Type:    "OrderPlaced",
		Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":%d}`, id, total),
	}
}

// place places an order of each total, in turn, and stops the test if one fails.
func place(t *testing.T, shop *outbox.OrderService, totals ...int64) {
	t.Helper()
	for _, total := range totals {
		if _, err := shop.PlaceOrder(total); err != nil {
			t.Fatalf("PlaceOrder(%d): %v", total, err)
		}
	}
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

// wantPass makes one pass of relay and checks how many messages it
// published and its error (errors.Is; nil for none), which it returns.
func wantPass(t *testing.T, relay *outbox.OutboxRelay, wantN int, wantErr error) error {
	t.Helper()
	n, err := relay.PublishPending()
	if n != wantN || !errors.Is(err, wantErr) {
		t.Fatalf("relay pass: published %d, error %v; want %d, %v", n, err, wantN, wantErr)
	}
	return err
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
// goroutine; goroutines use postOrder instead.
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

// The article's whole argument, cell by cell: wherever the process dies,
// what becomes of the order and its event under each way of placing it.
// Example_crashPoints prints the same table; this names the cell that
// changes. (Its cells are computed in example_test.go. It comes last of the
// tests, so that a change that breaks one of the article's tests shows that
// test's failure first.)
func TestCrashPoints(t *testing.T) {
	// In the order of ways: direct, publish first, direct + retries,
	// outbox in two transactions, outbox + relay.
	want := map[crashPoint][]string{
		brokerDown:        {lost, nothing, lost, waits, waits},
		crashLastCommit:   {nothing, phantom, nothing, lost, nothing},
		crashBeforeBroker: {lost, nothing, lost, waits, waits},
		crashAfterBroker:  {sentOnce, phantom, sentOnce, sentTwice, sentTwice},
	}
	for _, point := range crashPoints {
		for i, w := range ways {
			if got := crashOutcome(w, point); got != want[point][i] {
				t.Errorf("%s, %s: %q, want %q", point, w.name, got, want[point][i])
			}
		}
	}
}
