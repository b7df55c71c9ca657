package main

import (
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"example.com/patterns/enterprise/outbox"
	"example.com/patterns/enterprise/outbox/postgres"
)

// maxOrderBody is the largest POST /orders body read.
const maxOrderBody = 1 << 10

// newHandler serves the shop's HTTP entry points. Bad input gets a 4xx with
// a JSON {"error": ...} and changes nothing: 400 for a body that is not
// {"totalCents": whole number} or a malformed Idempotency-Key, 422 for a
// total of zero or less (outbox.ErrInvalidTotal) or a key reused for
// another total.
func newHandler(db *sql.DB, orders *postgres.OrderService, broker *embeddedBroker) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			TotalCents *int64 `json:"totalCents"`
		}
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxOrderBody))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&body); err != nil || body.TotalCents == nil || dec.More() {
			writeJSON(w, http.StatusBadRequest, problem(`body must be one JSON object {"totalCents": a whole number of cents}`))
			return
		}
		var id int64
		var err error
		if key := r.Header.Get("Idempotency-Key"); key != "" {
			id, err = orders.PlaceOrderWithKey(r.Context(), key, *body.TotalCents)
		} else {
			id, err = orders.PlaceOrder(r.Context(), *body.TotalCents)
		}
		switch {
		case errors.Is(err, postgres.ErrInvalidIdempotencyKey):
			writeJSON(w, http.StatusBadRequest, problem(err.Error()))
		case errors.Is(err, outbox.ErrInvalidTotal), errors.Is(err, postgres.ErrIdempotencyKeyReused):
			writeJSON(w, http.StatusUnprocessableEntity, problem(err.Error()))
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
		err = db.QueryRowContext(r.Context(), `
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
		lag, err := postgres.ReadLag(r.Context(), db)
		if err != nil {
			writeJSON(w, http.StatusInternalServerError, problem("cannot read the outbox"))
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{
			"unsent": lag.Unsent, "parked": lag.Parked, "oldestWaitSeconds": lag.Oldest.Seconds()})
	})
	mux.HandleFunc("POST /broker/down", func(w http.ResponseWriter, r *http.Request) {
		broker.Down()
		writeJSON(w, http.StatusOK, map[string]string{"broker": "down"})
	})
	mux.HandleFunc("POST /broker/up", func(w http.ResponseWriter, r *http.Request) {
		if err := broker.Up(); err != nil {
			writeJSON(w, http.StatusInternalServerError, problem(err.Error()))
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"broker": "up"})
	})
	return mux
}

func problem(msg string) map[string]string { return map[string]string{"error": msg} }

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(body) // the status is sent; a failed write has no one left to tell
}
