package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"example.com/patterns/enterprise/outbox"
)

// This file holds what surrounds the pattern, in the order a reader wants it:
//
//   - the examples: the article's scenario (Example), the crash table
//     (Example_crashPoints), the application running (Example_application),
//     and one example for each main method;
//   - the crash table's machinery and its test, TestCrashPoints;
//   - the application of the article's section "Как это собирается": two
//     entry points over one database, wired by a root (newHandler, runRelay,
//     startApp).
//
// The application's tests (bad input over HTTP, the load test) are in
// outbox_test.go, and the benchmarks that make bench compares in
// lessoncheck/, apart from the scenario.
//
//	POST /orders: handler -> OrderService.PlaceOrder -> Database.Transaction
//	background:   ticker  -> OutboxRelay.PublishPending -> outbox -> broker
//
// The application lives beside the examples, not in the package, because it
// is the application's code, not the pattern's.

// The article's scenario. The broker is down while two customers place orders
// through POST /orders; both get 201, because the answer depends only on the
// database. The relay is called by hand, as in the article's test: the first
// pass sends nothing and both messages wait in the outbox; once the broker is
// back, the second pass publishes both in id order; the third finds nothing
// and sends nothing again.
func Example() {
	db := new(outbox.Database)
	broker := new(outbox.InMemoryBroker)
	relay := outbox.NewOutboxRelay(db, broker)
	shop := httptest.NewServer(newHandler(outbox.NewOrderService(db)))
	defer shop.Close()

	broker.SetDown(true)
	fmt.Println("The broker is down.")
	for customer, total := range []int64{2500, 4000} {
		status, location, err := postOrder(shop.URL, total)
		if err != nil {
			fmt.Println("POST failed:", err)
			return
		}
		fmt.Printf("Customer %d: POST /orders {\"totalCents\":%d} -> %d %s, Location %s\n",
			customer+1, total, status, http.StatusText(status), location)
	}
	fmt.Printf("Saved: %d orders; waiting in the outbox: %d messages.\n",
		len(db.Orders()), len(db.Pending()))

	published, err := relay.PublishPending()
	fmt.Printf("Relay pass 1: published %d, stopped with %q.\n", published, err)
	fmt.Printf("Still waiting in the outbox: %d messages.\n", len(db.Pending()))

	broker.SetDown(false)
	fmt.Println("The broker is back up.")
	published, err = relay.PublishPending()
	fmt.Printf("Relay pass 2: published %d, error: %v.\n", published, err)
	for _, msg := range broker.Published() {
		fmt.Printf("  the broker received message %d: %s %s\n", msg.ID, msg.Type, msg.Payload)
	}
	fmt.Printf("Still waiting in the outbox: %d messages.\n", len(db.Pending()))

	published, err = relay.PublishPending()
	held := broker.Published()
	fmt.Printf("Relay pass 3: published %d, error: %v; the broker holds %d messages, %d of them sent twice.\n",
		published, err, len(held), len(held)-len(dropDuplicates(held)))

	// Output:
	// The broker is down.
	// Customer 1: POST /orders {"totalCents":2500} -> 201 Created, Location /orders/1
	// Customer 2: POST /orders {"totalCents":4000} -> 201 Created, Location /orders/2
	// Saved: 2 orders; waiting in the outbox: 2 messages.
	// Relay pass 1: published 0, stopped with "publish message 1: outbox: message broker unavailable".
	// Still waiting in the outbox: 2 messages.
	// The broker is back up.
	// Relay pass 2: published 2, error: <nil>.
	//   the broker received message 1: OrderPlaced {"orderId":1,"totalCents":2500}
	//   the broker received message 2: OrderPlaced {"orderId":2,"totalCents":4000}
	// Still waiting in the outbox: 0 messages.
	// Relay pass 3: published 0, error: <nil>; the broker holds 2 messages, 0 of them sent twice.
}

// The crash table: the article's whole argument in one run. One order is
// placed in each of five ways, and the process dies at one point; then it
// restarts (new services, a new relay, nothing that was in memory) over the
// same database and broker, with the broker up, and the table says what
// became of the order and of its event. The first row is no crash at all: the
// broker is down while the order is placed, and back for the restart.
// TestCrashPoints, below, asserts every cell.
func Example_crashPoints() {
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "what goes wrong\tplacing the order\twhat becomes of the order and its event")
	for _, point := range crashPoints {
		for i, w := range ways {
			where := point.String()
			if i > 0 {
				where = ""
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\n", where, w.name, crashOutcome(w, point))
		}
	}
	tw.Flush()

	// Output:
	// what goes wrong                         placing the order           what becomes of the order and its event
	// the broker is down, no crash            direct                      order saved, event lost for good
	//                                         publish first               nothing saved, nothing sent
	//                                         direct + retries            order saved, event lost for good
	//                                         outbox in two transactions  row waits; the next relay pass sends it
	//                                         outbox + relay              row waits; the next relay pass sends it
	// crash just before last commit           direct                      nothing saved, nothing sent
	//                                         publish first               event sent for an order that does not exist
	//                                         direct + retries            nothing saved, nothing sent
	//                                         outbox in two transactions  order saved, event lost for good
	//                                         outbox + relay              nothing saved, nothing sent
	// crash in Publish, before broker has it  direct                      order saved, event lost for good
	//                                         publish first               nothing saved, nothing sent
	//                                         direct + retries            order saved, event lost for good
	//                                         outbox in two transactions  row waits; the next relay pass sends it
	//                                         outbox + relay              row waits; the next relay pass sends it
	// crash in Publish, after broker has it   direct                      order saved, event sent
	//                                         publish first               event sent for an order that does not exist
	//                                         direct + retries            order saved, event sent
	//                                         outbox in two transactions  sent twice with the same id; dropping by id keeps 1
	//                                         outbox + relay              sent twice with the same id; dropping by id keeps 1
}

// The whole application: the root wires the POST /orders handler and a
// background relay on a ticker over one Database and one broker. Orders come
// in over real HTTP on loopback while the broker is down; the background relay
// keeps failing, then delivers them once the broker is back; the root shuts
// the relay down cleanly.
func Example_application() {
	db := new(outbox.Database)
	broker := new(outbox.InMemoryBroker)
	broker.SetDown(true)

	var refused atomic.Bool // set once a pass has hit the down broker
	var passes atomic.Int64
	handler, stop := startApp(db, broker, 5*time.Millisecond, func(_ int, err error) {
		if errors.Is(err, outbox.ErrBrokerUnavailable) {
			refused.Store(true)
		}
		passes.Add(1)
	})
	shop := httptest.NewServer(handler)
	defer shop.Close()

	fmt.Println("broker down")
	for _, total := range []int64{2500, 4000} {
		status, location, err := postOrder(shop.URL, total)
		if err != nil {
			fmt.Println("POST failed:", err)
			return
		}
		fmt.Printf("POST /orders {\"totalCents\":%d} -> %d %s, Location %s\n", total, status, http.StatusText(status), location)
	}
	if !waitForPass(&passes, refused.Load) {
		fmt.Println("the background relay never reached the broker")
	}
	fmt.Printf("background relay: refused by the broker; %d messages wait in the outbox\n", len(db.Pending()))

	broker.SetDown(false)
	fmt.Println("broker up")
	if !waitFor(func() bool { return len(db.Pending()) == 0 }) {
		fmt.Println("the relay did not deliver in time")
	}
	for _, msg := range broker.Published() {
		fmt.Printf("background relay delivered message %d: %s %s\n", msg.ID, msg.Type, msg.Payload)
	}

	stop()
	fmt.Println("relay stopped; broker holds", len(broker.Published()), "messages")

	// Output:
	// broker down
	// POST /orders {"totalCents":2500} -> 201 Created, Location /orders/1
	// POST /orders {"totalCents":4000} -> 201 Created, Location /orders/2
	// background relay: refused by the broker; 2 messages wait in the outbox
	// broker up
	// background relay delivered message 1: OrderPlaced {"orderId":1,"totalCents":2500}
	// background relay delivered message 2: OrderPlaced {"orderId":2,"totalCents":4000}
	// relay stopped; broker holds 2 messages
}

// A transaction whose function fails after both writes keeps neither.
func ExampleDatabase_Transaction() {
	db := new(outbox.Database)
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

	fmt.Println("error:", err, "| is errDeclined:", errors.Is(err, errDeclined))
	fmt.Println("orders:", len(db.Orders()), "| outbox rows:", len(db.Outbox()))
	// Output:
	// error: payment declined | is errDeclined: true
	// orders: 0 | outbox rows: 0
}

// The dual write with the broker down: the order is saved, its event is lost.
func ExampleDirectOrderService_PlaceOrder() {
	db := new(outbox.Database)
	broker := new(outbox.InMemoryBroker)
	shop := outbox.NewDirectOrderService(db, broker)

	broker.SetDown(true)
	_, err := shop.PlaceOrder(2500)
	fmt.Println("error:", err)

	broker.SetDown(false) // too late: nothing remembers the event
	fmt.Println("orders saved:", len(db.Orders()), "| events published:", len(broker.Published()))
	// Output:
	// error: order 1 saved, but OrderPlaced not published: outbox: message broker unavailable
	// orders saved: 1 | events published: 0
}

// PlaceOrder needs only the database: the order and its message are written
// together, and a total of zero is refused with ErrInvalidTotal.
func ExampleOrderService_PlaceOrder() {
	db := new(outbox.Database)
	shop := outbox.NewOrderService(db) // no broker: PlaceOrder needs only the database

	id, err := shop.PlaceOrder(2500)
	fmt.Println("order:", id, "| error:", err)
	for _, row := range db.Outbox() {
		fmt.Printf("outbox row %d: %s %s, sent: %t\n", row.ID, row.Type, row.Payload, row.Sent)
	}

	_, err = shop.PlaceOrder(0)
	fmt.Println("error:", err, "| is ErrInvalidTotal:", errors.Is(err, outbox.ErrInvalidTotal))
	// Output:
	// order: 1 | error: <nil>
	// outbox row 1: OrderPlaced {"orderId":1,"totalCents":2500}, sent: false
	// error: outbox: order total must be a positive number of cents, got 0 | is ErrInvalidTotal: true
}

// A pass publishes the waiting messages in id order; the next pass finds
// nothing to send again.
func ExampleOutboxRelay_PublishPending() {
	db := new(outbox.Database)
	broker := new(outbox.InMemoryBroker)
	shop := outbox.NewOrderService(db)
	relay := outbox.NewOutboxRelay(db, broker)

	for _, total := range []int64{2500, 4000} {
		if _, err := shop.PlaceOrder(total); err != nil {
			fmt.Println(err)
			return
		}
	}
	published, err := relay.PublishPending()
	fmt.Println("published:", published, "| error:", err)
	for _, msg := range broker.Published() {
		fmt.Println(msg.ID, msg.Type, msg.Payload)
	}
	published, err = relay.PublishPending()
	fmt.Println("published again:", published, "| error:", err)
	// Output:
	// published: 2 | error: <nil>
	// 1 OrderPlaced {"orderId":1,"totalCents":2500}
	// 2 OrderPlaced {"orderId":2,"totalCents":4000}
	// published again: 0 | error: <nil>
}

// ---- Showing the transcripts ----

// TestMain first, if -run selects Example or Example_crashPoints, runs
// those with their standard output sent to standard error, so that `go test
// -run Example` shows what they print, before the verdict; then it runs the
// tests and examples as usual, which check that output. go test prints
// nothing of a passing example's output, and it shows the test binary's
// standard error when run in the package's folder without a package
// argument, or with -v; with a package argument and no -v it keeps a
// passing package's output to itself.
func TestMain(m *testing.M) {
	flag.Parse() // -run, before m.Run would parse it
	showTranscripts(flag.Lookup("test.run").Value.String())
	os.Exit(m.Run())
}

func showTranscripts(run string) {
	if run == "" {
		return
	}
	stdout := os.Stdout
	defer func() { os.Stdout = stdout }()
	os.Stdout = os.Stderr
	for _, example := range []struct {
		name string
		run  func()
	}{{"Example", Example}, {"Example_crashPoints", Example_crashPoints}} {
		if matched, _ := regexp.MatchString(run, example.name); matched {
			example.run()
			fmt.Fprintln(os.Stderr)
		}
	}
}

// ---- The crash table: how Example_crashPoints computes its cells ----

// The outcomes of the crash table, in a reader's words.
const (
	nothing   = "nothing saved, nothing sent"
	lost      = "order saved, event lost for good"
	phantom   = "event sent for an order that does not exist"
	sentOnce  = "order saved, event sent"
	waits     = "row waits; the next relay pass sends it"
	sentTwice = "sent twice with the same id; dropping by id keeps 1"
)

// crashPoint is where the process dies while it places an order.
type crashPoint int

const (
	brokerDown        crashPoint = iota // no crash: the broker is down while the order is placed
	crashLastCommit                     // just before the last transaction commits (the only one, for a way with one)
	crashBeforeBroker                   // in a call to the broker, before the broker has the event
	crashAfterBroker                    // in a call to the broker, after the broker has the event
)

// A crash before an earlier commit is left out: only outbox in two
// transactions has one, and it saves nothing there, as the other ways do
// before their only commit.
var crashPoints = []crashPoint{brokerDown, crashLastCommit, crashBeforeBroker, crashAfterBroker}

func (p crashPoint) String() string {
	return [...]string{"the broker is down, no crash", "crash just before last commit",
		"crash in Publish, before broker has it", "crash in Publish, after broker has it"}[p]
}

// errCrash is the panic that stands for the process dying. Recovering it
// stands for the restart.
var errCrash = errors.New("the process died")

// crashingBroker is a broker whose process dies during Publish: before it
// hands msg to next, or after next has it.
type crashingBroker struct {
	next  outbox.MessageBroker
	point crashPoint
}

func (b crashingBroker) Publish(msg outbox.Message) error {
	if b.point == crashAfterBroker {
		if err := b.next.Publish(msg); err != nil {
			return err
		}
	}
	panic(errCrash)
}

// way is one way of placing an order. place runs it as a fresh process would,
// making its services anew; restart is what the process does after it comes
// back, nil for ways that kept nothing to finish with.
type way struct {
	name    string
	place   func(db *outbox.Database, broker outbox.MessageBroker) error
	restart func(db *outbox.Database, broker outbox.MessageBroker) error
}

// relayPass is one pass of a new relay: the outbox ways' second half, and
// what they do when the process comes back.
func relayPass(db *outbox.Database, broker outbox.MessageBroker) error {
	_, err := outbox.NewOutboxRelay(db, broker).PublishPending()
	return err
}

var ways = []way{
	{"direct", func(db *outbox.Database, broker outbox.MessageBroker) error {
		_, err := outbox.NewDirectOrderService(db, broker).PlaceOrder(2500)
		return err
	}, nil},
	{"publish first", func(db *outbox.Database, broker outbox.MessageBroker) error {
		_, err := publishFirstService{db, broker}.PlaceOrder(2500)
		return err
	}, nil},
	{"direct + retries", func(db *outbox.Database, broker outbox.MessageBroker) error {
		_, err := retryingDirectService{db, broker, 3}.PlaceOrder(2500)
		return err
	}, nil},
	{"outbox in two transactions", func(db *outbox.Database, broker outbox.MessageBroker) error {
		if _, err := (splitOutboxService{db}).PlaceOrder(2500); err != nil {
			return err
		}
		return relayPass(db, broker)
	}, relayPass},
	{"outbox + relay", func(db *outbox.Database, broker outbox.MessageBroker) error {
		if _, err := outbox.NewOrderService(db).PlaceOrder(2500); err != nil {
			return err
		}
		return relayPass(db, broker)
	}, relayPass},
}

// crashOutcome places one order of 2500 cents the given way, lets the process
// die at point, restarts it, and says what became of the order and its event.
// The errors that placing returns are not the question here: a dead process
// tells no one anything. What counts is what the database and the broker keep.
func crashOutcome(w way, point crashPoint) string {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	var calls outbox.MessageBroker = broker
	switch point {
	case brokerDown:
		broker.SetDown(true)
	case crashLastCommit:
		at, commits := commitsOf(w), 0
		outbox.SetBeforeCommit(db, func() {
			if commits++; commits == at {
				panic(errCrash)
			}
		})
	default:
		calls = crashingBroker{broker, point}
	}
	crashes(func() { w.place(db, calls) })

	broker.SetDown(false) // the restart: the broker is up, nothing armed
	outbox.SetBeforeCommit(db, nil)
	waited := len(db.Pending()) > 0 && len(broker.Published()) == 0
	if w.restart != nil {
		if err := w.restart(db, broker); err != nil {
			return "restart failed: " + err.Error()
		}
	}

	orders, events := db.Orders(), broker.Published()
	switch {
	case len(orders) == 0 && len(events) == 0:
		return nothing
	case len(orders) == 0:
		return phantom
	case len(events) == 0:
		return lost
	case len(orders) > 1 || events[0].Payload != `{"orderId":1,"totalCents":2500}`:
		return fmt.Sprintf("wrong: orders %v, events %v", orders, events)
	case len(events) == 2 && events[0] == events[1]:
		return fmt.Sprintf("sent twice with the same id; dropping by id keeps %d", len(dropDuplicates(events)))
	case len(events) > 1:
		return fmt.Sprintf("wrong: events %v", events)
	case waited:
		return waits
	}
	return sentOnce
}

// commitsOf counts the commits that placing an order the given way makes,
// in a run of its own where nothing fails.
func commitsOf(w way) int {
	db, commits := new(outbox.Database), 0
	outbox.SetBeforeCommit(db, func() { commits++ })
	w.place(db, new(outbox.InMemoryBroker))
	return commits
}

// dropDuplicates is an idempotent consumer: it keeps the first message with
// each id and drops the rest.
func dropDuplicates(msgs []outbox.Message) []outbox.Message {
	seen := make(map[int64]bool)
	var kept []outbox.Message
	for _, msg := range msgs {
		if !seen[msg.ID] {
			seen[msg.ID], kept = true, append(kept, msg)
		}
	}
	return kept
}

// crashes runs f and reports whether the process died in it (f panicked with
// errCrash). Any other panic goes on.
func crashes(f func()) (crashed bool) {
	defer func() {
		if r := recover(); r != nil {
			if r != errCrash {
				panic(r)
			}
			crashed = true
		}
	}()
	f()
	return false
}

// publishFirstService is a WRONG way to place an order, shown only to be
// rejected, as the article does: it publishes OrderPlaced inside the
// transaction, before the commit. If the commit then fails, or the process
// dies first, the warehouse reserves stock for an order that does not exist.
type publishFirstService struct {
	db     *outbox.Database
	broker outbox.MessageBroker
}

func (s publishFirstService) PlaceOrder(totalCents int64) (int64, error) {
	var order outbox.Order
	err := s.db.Transaction(func(tx *outbox.Tx) error {
		var err error
		if order, err = tx.InsertOrder(totalCents); err != nil {
			return err
		}
		payload, err := json.Marshal(order)
		if err != nil {
			return err
		}
		return s.broker.Publish(outbox.Message{Type: outbox.OrderPlaced, Payload: string(payload)})
	})
	if err != nil {
		return 0, err
	}
	return order.ID, nil
}

// retryingDirectService is another WRONG way: DirectOrderService's dual write
// with retries around Publish. Retries help while the process lives; when it
// dies between the commit and a successful Publish, no one is left to retry.
type retryingDirectService struct {
	db       *outbox.Database
	broker   outbox.MessageBroker
	attempts int
}

func (s retryingDirectService) PlaceOrder(totalCents int64) (int64, error) {
	order, err := commitOrder(s.db, totalCents)
	if err != nil {
		return 0, err
	}
	payload, err := json.Marshal(order)
	if err != nil {
		return 0, err
	}
	for range s.attempts {
		if err = s.broker.Publish(outbox.Message{Type: outbox.OrderPlaced, Payload: string(payload)}); err == nil {
			return order.ID, nil
		}
	}
	return order.ID, fmt.Errorf("order %d saved, but %s not published after %d attempts: %w", order.ID, outbox.OrderPlaced, s.attempts, err)
}

// Retries are no strawman: while the process lives they mend a short
// outage. The broker refuses the first attempt and takes the second:
// direct + retries saves the order and publishes its event, once. What
// they cannot mend is the crash table's: a process that dies between the
// commit and a publish that succeeds leaves no one to retry.
func TestRetriesMendAShortOutageWhileNothingCrashes(t *testing.T) {
	db, broker := new(outbox.Database), new(outbox.InMemoryBroker)
	refusals := 1
	flaky := brokerFunc(func(msg outbox.Message) error {
		if refusals > 0 {
			refusals--
			return fmt.Errorf("broker down for a moment: %w", outbox.ErrBrokerUnavailable)
		}
		return broker.Publish(msg)
	})
	id, err := retryingDirectService{db, flaky, 3}.PlaceOrder(2500)
	if err != nil || id != 1 {
		t.Fatalf("PlaceOrder = %d, %v; want order 1 and its event published on the second attempt", id, err)
	}
	if got := broker.Published(); len(got) != 1 || got[0].Payload != `{"orderId":1,"totalCents":2500}` {
		t.Errorf("the broker holds %v; want OrderPlaced for order 1, once", got)
	}
}

// splitOutboxService is a third WRONG way: an outbox whose row is written in
// a transaction of its own, after the order's has committed. It has a table
// and a relay, and still the dual write: a process that dies between the two
// commits keeps the order and loses its event for good.
type splitOutboxService struct {
	db *outbox.Database
}

func (s splitOutboxService) PlaceOrder(totalCents int64) (int64, error) {
	order, err := commitOrder(s.db, totalCents)
	if err != nil {
		return 0, err
	}
	err = s.db.Transaction(func(tx *outbox.Tx) error {
		_, err := tx.InsertOutbox(outbox.OrderPlaced, order)
		return err
	})
	return order.ID, err
}

// commitOrder saves an order of totalCents in a transaction of its own: the
// first half of the two wrong ways above that commit the order before they
// see to its event.
func commitOrder(db *outbox.Database, totalCents int64) (outbox.Order, error) {
	var order outbox.Order
	err := db.Transaction(func(tx *outbox.Tx) error {
		var err error
		order, err = tx.InsertOrder(totalCents)
		return err
	})
	return order, err
}

// ---- The application ----

// maxOrderBody is the largest request body POST /orders reads. An order is a
// few dozen bytes of JSON; anything much larger is a mistake or an attack.
const maxOrderBody = 1 << 10

// newHandler returns the HTTP entry point: POST /orders, served by orders
// alone. It never sees the broker, so its answer depends only on the database.
//
// It answers 201 Created with {"orderId":N} and the order's Location. Bad
// input is refused before anything is written, with {"error":"..."} saying
// what is wrong in the client's terms: a body that is not exactly one JSON
// object whose only field is "totalCents", a whole number, gets 400 Bad
// Request; a body over maxOrderBody gets 413 Content Too Large; a total of
// zero or less gets 422 Unprocessable Content, because the request is
// understood but breaks a business rule (the service's ErrInvalidTotal).
// Other methods get 405 Method Not Allowed with "Allow: POST" from the
// ServeMux.
func newHandler(orders *outbox.OrderService) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		total, status, problem := readOrder(w, r)
		if problem != "" {
			writeJSON(w, status, map[string]string{"error": problem})
			return
		}
		id, err := orders.PlaceOrder(total)
		switch {
		case errors.Is(err, outbox.ErrInvalidTotal):
			writeJSON(w, http.StatusUnprocessableEntity, map[string]string{
				"error": fmt.Sprintf("totalCents must be a positive number of cents, got %d", total)})
			return
		case err != nil:
			writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "cannot save the order"})
			return
		}
		// Location names the new order, as a 201 should; this example serves
		// no GET /orders/{id}, since the article has no such entry point.
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		writeJSON(w, http.StatusCreated, map[string]int64{"orderId": id})
	})
	return mux
}

// readOrder reads the body of POST /orders, which must be exactly one JSON
// object whose only field is "totalCents", a whole number. It returns the
// total, or a status and a message for the client. Field names match
// exactly: encoding/json alone would also take "TotalCents".
func readOrder(w http.ResponseWriter, r *http.Request) (total int64, status int, problem string) {
	const example = `{"totalCents":2500}`
	tooLarge := fmt.Sprintf("body must be at most %d bytes", maxOrderBody)
	if r.ContentLength > maxOrderBody { // refused before reading a byte
		return 0, http.StatusRequestEntityTooLarge, tooLarge
	}
	var limitHit *http.MaxBytesError // a body of unknown length that runs over
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxOrderBody))

	var fields map[string]json.RawMessage
	if err := dec.Decode(&fields); errors.As(err, &limitHit) {
		return 0, http.StatusRequestEntityTooLarge, tooLarge
	} else if err != nil || fields == nil {
		return 0, http.StatusBadRequest, "body must be a JSON object, such as " + example
	}
	if _, err := dec.Token(); errors.As(err, &limitHit) {
		return 0, http.StatusRequestEntityTooLarge, tooLarge
	} else if err != io.EOF {
		return 0, http.StatusBadRequest, "body must hold one JSON object, but more follows it"
	}
	for _, name := range slices.Sorted(maps.Keys(fields)) {
		if name != "totalCents" {
			return 0, http.StatusBadRequest, fmt.Sprintf("unknown field %q: the only field is \"totalCents\"", name)
		}
	}
	raw, ok := fields["totalCents"]
	if !ok {
		return 0, http.StatusBadRequest, "totalCents is required, as in " + example
	}
	total, err := strconv.ParseInt(string(raw), 10, 64)
	if errors.Is(err, strconv.ErrRange) {
		return 0, http.StatusBadRequest, "totalCents is out of range"
	} else if err != nil {
		return 0, http.StatusBadRequest, "totalCents must be a whole number of cents, such as 2500"
	}
	return total, 0, ""
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(body) // the status is sent; a failed write has no one left to tell
}

// runRelay is the background process: on every tick it asks relay for one
// pass and reports the result to onPass (a real service would log it). A pass
// that fails because the broker is down leaves the messages in the outbox, and
// the next tick tries again: the relay returns the broker's error, and the
// decision to try later is made here, by the code that runs it. runRelay
// returns when ctx is cancelled.
func runRelay(ctx context.Context, relay *outbox.OutboxRelay, every time.Duration, onPass func(published int, err error)) {
	ticker := time.NewTicker(every)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			onPass(relay.PublishPending())
		}
	}
}

// startApp is the application root. It hands one db and one broker to both
// entry points: the HTTP handler, which gets an OrderService, and the
// background relay, which gets an OutboxRelay and runs on its own goroutine.
// (In a real service db is a connection pool and broker a broker client.)
// It returns the handler and stop, which stops the relay and waits until its
// goroutine has returned.
func startApp(db *outbox.Database, broker outbox.MessageBroker, every time.Duration, onPass func(int, error)) (handler http.Handler, stop func()) {
	handler = newHandler(outbox.NewOrderService(db))

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { runRelay(ctx, outbox.NewOutboxRelay(db, broker), every, onPass) })

	return handler, func() { cancel(); wg.Wait() }
}

// postOrder is a customer: it posts an order over real HTTP and returns the
// response's status code and Location.
func postOrder(url string, totalCents int64) (status int, location string, err error) {
	resp, err := http.Post(url+"/orders", "application/json",
		strings.NewReader(fmt.Sprintf(`{"totalCents":%d}`, totalCents)))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return 0, "", err
	}
	return resp.StatusCode, resp.Header.Get("Location"), nil
}

// waitForPass is waitFor for what a relay pass must do once rows wait
// (meet the down broker, and say so): it stops waiting, and reports false,
// once two passes ended without cond, since the second began after the
// wait did and so saw what the first may not have. A relay that carries on
// past a failure fails at once, not at the deadline.
func waitForPass(passes *atomic.Int64, cond func() bool) bool {
	start := passes.Load()
	waitFor(func() bool { return cond() || passes.Load() >= start+2 })
	return cond()
}

// waitFor polls cond until it holds, for at most ten seconds, and reports
// whether it did. It waits on a condition, never for a fixed time.
func waitFor(cond func() bool) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}
