package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"example.com/patterns/enterprise/outbox"
)

// This file holds the application of the article's section "Как это
// собирается": two entry points over one database, wired by a root.
//
//	POST /orders: handler -> OrderService.PlaceOrder -> Database.Transaction
//	background:   ticker  -> OutboxRelay.PublishPending -> outbox -> broker
//
// It lives beside the examples, not in the package, because it is the
// application's code, not the pattern's.

// maxOrderBody is the largest request body POST /orders reads. An order is a
// few dozen bytes of JSON; anything much larger is a mistake or an attack.
const maxOrderBody = 1 << 10

// newHandler returns the HTTP entry point: POST /orders, served by orders
// alone. It never sees the broker, so its answer depends only on the database.
//
// It answers 201 Created with {"orderId":N} and the order's Location. Bad
// input is refused before anything is written: a body that is not one JSON
// object with only known fields, or has no totalCents, gets 400 Bad Request; a
// body over maxOrderBody gets 413 Content Too Large; a well-formed total of
// zero or less gets 422 Unprocessable Content, because the request is
// understood but breaks a business rule (the service's ErrInvalidTotal). Other
// methods get 405 Method Not Allowed with "Allow: POST" from the ServeMux.
func newHandler(orders *outbox.OrderService) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			TotalCents *int64 `json:"totalCents"` // a pointer, to tell a missing total from 0
		}
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxOrderBody))
		dec.DisallowUnknownFields()
		err := dec.Decode(&req)
		if err == nil { // after the object, only the end of the body may come
			switch err = dec.Decode(&struct{}{}); err {
			case io.EOF:
				err = nil
			case nil:
				err = errors.New("body must hold a single JSON object")
			}
		}
		var tooLarge *http.MaxBytesError
		switch {
		case errors.As(err, &tooLarge):
			writeJSON(w, http.StatusRequestEntityTooLarge, map[string]string{"error": err.Error()})
			return
		case err != nil:
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
			return
		case req.TotalCents == nil:
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": "totalCents is required"})
			return
		}

		id, err := orders.PlaceOrder(*req.TotalCents)
		switch {
		case errors.Is(err, outbox.ErrInvalidTotal):
			writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"error": err.Error()})
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

// placeOrder is a customer: it posts an order over real HTTP and returns the
// response's status line and Location.
func placeOrder(url string, totalCents int64) (status, location string, err error) {
	resp, err := http.Post(url+"/orders", "application/json",
		strings.NewReader(fmt.Sprintf(`{"totalCents":%d}`, totalCents)))
	if err != nil {
		return "", "", err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	return resp.Status, resp.Header.Get("Location"), nil
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

// The article's scenario. The broker is down while two customers place orders
// through POST /orders; both get 201, because the answer depends only on the
// database. The relay is called by hand, as in the article's test: the first
// pass sends nothing and both messages wait in the outbox; once the broker is
// back, the second pass publishes both in id order; the third finds nothing
// and sends nothing again.
func Example() {
	// go test compares what an example writes to os.Stdout with its Output
	// comment and, when they match, prints nothing. So that
	// `go test -run Example` also shows the scenario, every line goes to
	// os.Stderr as well, which go test passes through untouched.
	out := io.MultiWriter(os.Stdout, os.Stderr)

	db := new(outbox.Database)
	broker := new(outbox.InMemoryBroker)
	relay := outbox.NewOutboxRelay(db, broker)
	shop := httptest.NewServer(newHandler(outbox.NewOrderService(db)))
	defer shop.Close()

	broker.SetDown(true)
	fmt.Fprintln(out, "The broker is down.")
	for customer, total := range []int64{2500, 4000} {
		status, location, err := placeOrder(shop.URL, total)
		if err != nil {
			fmt.Fprintln(out, "POST failed:", err)
			return
		}
		fmt.Fprintf(out, "Customer %d: POST /orders {\"totalCents\":%d} -> %s, Location %s\n",
			customer+1, total, status, location)
	}
	fmt.Fprintf(out, "Saved: %d orders; waiting in the outbox: %d messages.\n",
		len(db.Orders()), len(db.Pending()))

	published, err := relay.PublishPending()
	fmt.Fprintf(out, "Relay pass 1: published %d, stopped with %q.\n", published, err)
	fmt.Fprintf(out, "Still waiting in the outbox: %d messages.\n", len(db.Pending()))

	broker.SetDown(false)
	fmt.Fprintln(out, "The broker is back up.")
	published, err = relay.PublishPending()
	fmt.Fprintf(out, "Relay pass 2: published %d, error: %v.\n", published, err)
	for _, msg := range broker.Published() {
		fmt.Fprintf(out, "  the broker received message %d: %s %s\n", msg.ID, msg.Type, msg.Payload)
	}
	fmt.Fprintf(out, "Still waiting in the outbox: %d messages.\n", len(db.Pending()))

	published, err = relay.PublishPending()
	fmt.Fprintf(out, "Relay pass 3: published %d, error: %v; the broker holds %d messages, nothing sent twice.\n",
		published, err, len(broker.Published()))

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
	// Relay pass 3: published 0, error: <nil>; the broker holds 2 messages, nothing sent twice.
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
	handler, stop := startApp(db, broker, 5*time.Millisecond, func(_ int, err error) {
		if errors.Is(err, outbox.ErrBrokerUnavailable) {
			refused.Store(true)
		}
	})
	shop := httptest.NewServer(handler)
	defer shop.Close()

	fmt.Println("broker down")
	for _, total := range []int64{2500, 4000} {
		status, location, err := placeOrder(shop.URL, total)
		if err != nil {
			fmt.Println("POST failed:", err)
			return
		}
		fmt.Printf("POST /orders {\"totalCents\":%d} -> %s, Location %s\n", total, status, location)
	}
	if !waitFor(refused.Load) {
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
