package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// maxOrderBody is the largest POST /orders body read.
const maxOrderBody = 1 << 10

// requestTimeout bounds each request's database work: a database that does
// not answer gets a 503 within it, not a client waiting for ever.
const requestTimeout = 5 * time.Second

// orderPlacer is what POST /orders needs of [shop.OrderService].
type orderPlacer interface {
	PlaceOrder(ctx context.Context, totalCents int64) (int64, error)
	PlaceOrderWithKey(ctx context.Context, key string, totalCents int64) (int64, error)
}

// badBody is the answer to a POST /orders body that is not one JSON object
// {"totalCents": a whole number}.
const badBody = `body must be one JSON object {"totalCents": a whole number of cents}`

// newHandler serves the shop's HTTP entry points. Bad input gets a 4xx with
// a JSON {"error": ...} and changes nothing: 400 for a body that is not one
// JSON object {"totalCents": whole number} and nothing after it, or a
// malformed Idempotency-Key; 413 for a body over maxOrderBody; 422 for a
// total of zero or less (shop.ErrInvalidTotal) or a key reused for another
// total. A commit whose outcome is unknown (postgres.ErrCommitUnknown) gets
// a 503 whose body says so and how to retry safely; a database that did not
// answer within requestTimeout, a 503 that says nothing was placed.
//
// GET /outbox is the operator's view: the counts of ob.ReadLag, the row that
// blocks others (blockingRow: a failing row, or a parked one with rows of
// its aggregate behind it), and the warehouse consumer's state from the
// broker (messages pending; from JetStream its redeliveries, from RabbitMQ
// its consumers and dead letters), asked for at most brokerTimeout. GET
// /outbox/parked lists the parked rows, and POST /outbox/parked/{id}/unpark
// puts one back.
func newHandler(db *sql.DB, ob *postgres.Outbox[postgres.SQLTx], orders orderPlacer, broker messageBroker, warehouse *countingHandler) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			TotalCents *int64 `json:"totalCents"`
		}
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxOrderBody))
		dec.DisallowUnknownFields()
		err := dec.Decode(&body)
		if err == nil {
			if _, next := dec.Token(); next != io.EOF { // anything after the object
				err = errors.New("more after the object")
			}
		}
		var tooLarge *http.MaxBytesError
		switch {
		case errors.As(err, &tooLarge):
			writeJSON(w, http.StatusRequestEntityTooLarge, problem(fmt.Sprintf("body over %d bytes", maxOrderBody)))
			return
		case err != nil || body.TotalCents == nil:
			writeJSON(w, http.StatusBadRequest, problem(badBody))
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
		defer cancel()
		var id int64
		key := r.Header.Get("Idempotency-Key")
		if key != "" {
			id, err = orders.PlaceOrderWithKey(ctx, key, *body.TotalCents)
		} else {
			id, err = orders.PlaceOrder(ctx, *body.TotalCents)
		}
		switch {
		case errors.Is(err, shop.ErrInvalidIdempotencyKey):
			writeJSON(w, http.StatusBadRequest, problem(err.Error()))
		case errors.Is(err, shop.ErrInvalidTotal), errors.Is(err, shop.ErrIdempotencyKeyReused):
			writeJSON(w, http.StatusUnprocessableEntity, problem(err.Error()))
		case errors.Is(err, postgres.ErrCommitUnknown):
			retry := "send the same request again with the same Idempotency-Key: it places the order at most once"
			if key == "" {
				retry = "this request had no Idempotency-Key, so sending it again may place a second order; send orders with one"
			}
			w.Header().Set("Retry-After", "1")
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{
				"error": "the database did not answer the commit: whether the order was placed is unknown",
				"retry": retry,
			})
		case errors.Is(err, context.DeadlineExceeded):
			w.Header().Set("Retry-After", "1")
			writeJSON(w, http.StatusServiceUnavailable, problem(
				fmt.Sprintf("the database did not answer within %v; the order was not placed", requestTimeout)))
		case err != nil:
			writeJSON(w, http.StatusInternalServerError, problem("cannot save the order"))
		default:
			w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
			writeJSON(w, http.StatusCreated, map[string]int64{"orderId": id})
		}
	})
	mux.HandleFunc("GET /orders/{id}", func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
		if err != nil {
			writeJSON(w, http.StatusBadRequest, problem("order id must be a whole number"))
			return
		}
		var order struct {
			ID         int64 `json:"orderId"`
			TotalCents int64 `json:"totalCents"`
			Sent       bool  `json:"sent"`     // its OrderPlaced is no longer waiting: the broker stored it
			Reserved   bool  `json:"reserved"` // the warehouse applied it
		}
		ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
		defer cancel()
		err = db.QueryRowContext(ctx, `
			SELECT o.id, o.total_cents,
			       NOT EXISTS (SELECT 1 FROM outbox -- through outbox_unsent_by_aggregate; a sent row may be cleaned up
			                   WHERE aggregate = 'order/' || o.id AND sent_at IS NULL AND type = 'OrderPlaced'),
			       EXISTS (SELECT 1 FROM reservations WHERE order_id = o.id)
			FROM orders o WHERE o.id = $1`, id).Scan(&order.ID, &order.TotalCents, &order.Sent, &order.Reserved)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			writeJSON(w, http.StatusNotFound, problem(fmt.Sprintf("no order %d", id)))
		case err != nil:
			writeJSON(w, http.StatusInternalServerError, problem("cannot read the order"))
		default:
			writeJSON(w, http.StatusOK, order)
		}
	})
	mux.HandleFunc("GET /outbox", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
		defer cancel()
		lag, err := ob.ReadLag(ctx)
		if err != nil {
			writeJSON(w, http.StatusInternalServerError, problem("cannot read the outbox"))
			return
		}
		view := map[string]any{"unsent": lag.Unsent, "parked": lag.Parked, "failing": lag.Failing,
			"scheduled": lag.Scheduled, "oldestWaitSeconds": lag.Oldest.Seconds(), "blocking": nil}
		var b struct {
			ID        int64  `json:"id"`
			Key       string `json:"key"`
			Attempts  int    `json:"attempts"`
			LastError string `json:"lastError"`
			Parked    bool   `json:"parked"`
			Waiting   int64  `json:"waiting"` // rows of its aggregate behind it
		}
		err = db.QueryRowContext(ctx, blockingRow).Scan(&b.ID, &b.Key, &b.Attempts, &b.LastError, &b.Parked, &b.Waiting)
		switch {
		case err == nil:
			view["blocking"] = b
		case err != nil && !errors.Is(err, sql.ErrNoRows):
			writeJSON(w, http.StatusInternalServerError, problem("cannot read the outbox"))
			return
		}
		// What the warehouse applied and the copies it dropped by key, and
		// the copies the broker dropped before the warehouse saw them (a
		// lost ack's, within JetStream's duplicate window): counted since
		// this process started, which "since" says.
		if warehouse != nil {
			view["warehouse"] = map[string]any{"applied": warehouse.applied.Load(), "duplicates": warehouse.duplicates.Load(),
				"since": warehouse.since.UTC().Format(time.RFC3339)}
		}
		if broker != nil {
			view["broker"] = map[string]int64{"duplicates": broker.Dropped()}
		}
		if broker != nil {
			// The broker gets a short bound of its own: while it is down the
			// operator still gets the database's view at once.
			bctx, cancel := context.WithTimeout(ctx, brokerTimeout)
			consumer, err := broker.ConsumerView(bctx)
			cancel()
			if err != nil {
				view["consumer"] = problem("cannot reach the broker: " + err.Error())
			} else {
				view["consumer"] = consumer
			}
		}
		writeJSON(w, http.StatusOK, view)
	})
	mux.HandleFunc("GET /outbox/parked", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
		defer cancel()
		parked, err := ob.ListParked(ctx, 0)
		if err != nil {
			writeJSON(w, http.StatusInternalServerError, problem("cannot read the outbox"))
			return
		}
		type row struct {
			ID         int64     `json:"id"`
			Key        string    `json:"key"`
			Type       string    `json:"type"`
			Aggregate  string    `json:"aggregate,omitempty"`
			Seq        int64     `json:"seq,omitempty"`
			Attempts   int       `json:"attempts"`
			Rejections int       `json:"rejections"`
			LastError  string    `json:"lastError"`
			ParkedAt   time.Time `json:"parkedAt"`
		}
		rows := []row{}
		for _, p := range parked {
			rows = append(rows, row{p.ID, p.Key, p.Type, p.Aggregate, p.Seq, p.Attempts, p.Rejections, p.LastError, p.ParkedAt})
		}
		writeJSON(w, http.StatusOK, rows)
	})
	mux.HandleFunc("POST /outbox/parked/{id}/unpark", func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
		if err != nil {
			writeJSON(w, http.StatusBadRequest, problem("outbox row id must be a whole number"))
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
		defer cancel()
		switch err := ob.Unpark(ctx, id); {
		case errors.Is(err, postgres.ErrNotParked):
			writeJSON(w, http.StatusNotFound, problem(fmt.Sprintf("no parked outbox row %d", id)))
		case err != nil:
			writeJSON(w, http.StatusInternalServerError, problem("cannot unpark the row"))
		default:
			writeJSON(w, http.StatusOK, map[string]int64{"unparked": id})
		}
	})
	mux.HandleFunc("POST /broker/down", func(w http.ResponseWriter, r *http.Request) {
		switchTimeout(w)
		writeJSON(w, http.StatusOK, map[string]string{"broker": broker.Down()})
	})
	mux.HandleFunc("POST /broker/up", func(w http.ResponseWriter, r *http.Request) {
		switchTimeout(w)
		if err := broker.Up(); err != nil {
			writeJSON(w, http.StatusInternalServerError, problem(err.Error()))
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"broker": "up"})
	})
	return mux
}

// blockingRow is the oldest row that holds others up: an unsent one whose
// publish failed (with PerAggregate it holds back its aggregate; without,
// every row after it), or a parked one with rows of its aggregate waiting
// behind it, which PerAggregate holds until it is put back or dropped.
const blockingRow = `
SELECT b.id, b.message_key, b.attempts, COALESCE(b.last_error, ''), b.parked_at IS NOT NULL,
       (SELECT count(*) FROM outbox w WHERE w.aggregate = b.aggregate AND w.id > b.id AND w.sent_at IS NULL AND w.parked_at IS NULL)
FROM outbox b
WHERE b.sent_at IS NULL
  AND ((b.parked_at IS NULL AND b.attempts > 0)
       OR (b.parked_at IS NOT NULL AND EXISTS (SELECT 1 FROM outbox w
           WHERE w.aggregate = b.aggregate AND w.id > b.id AND w.sent_at IS NULL AND w.parked_at IS NULL)))
ORDER BY b.id
LIMIT 1`

// switchTimeout gives the answer to POST /broker/down or /broker/up until
// brokerSwitchTimeout to be written: stopping a RabbitMQ node, starting
// one (up to two minutes), or a JetStream cluster electing its leaders (up
// to 30 s) takes longer than the server's WriteTimeout, which would cut
// the answer off.
func switchTimeout(w http.ResponseWriter) {
	http.NewResponseController(w).SetWriteDeadline(time.Now().Add(brokerSwitchTimeout))
}

// brokerSwitchTimeout bounds the writing of POST /broker/down's and
// /broker/up's answers.
const brokerSwitchTimeout = 3 * time.Minute

// brokerTimeout bounds GET /outbox's question to the broker.
const brokerTimeout = 500 * time.Millisecond

func problem(msg string) map[string]string { return map[string]string{"error": msg} }

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(body) // the status is sent; a failed write has no one left to tell
}
