package shop_test

import (
	"database/sql"
	"errors"
	"log"
	"net/http"
	"os"
	"strconv"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver for database/sql

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// An HTTP handler that makes POST /orders safe to retry: the client's
// Idempotency-Key names the request, and a retry after a lost response, or
// after a commit of unknown outcome, returns the first order.
func ExampleOrderService_PlaceOrderWithKey() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	service := shop.NewOrderService(db)
	http.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		total, err := strconv.ParseInt(r.FormValue("totalCents"), 10, 64)
		if err != nil {
			http.Error(w, "totalCents must be a number of cents", http.StatusBadRequest)
			return
		}
		id, err := service.PlaceOrderWithKey(r.Context(), r.Header.Get("Idempotency-Key"), total)
		switch {
		case errors.Is(err, shop.ErrInvalidTotal), errors.Is(err, shop.ErrInvalidIdempotencyKey):
			http.Error(w, err.Error(), http.StatusUnprocessableEntity)
		case errors.Is(err, shop.ErrIdempotencyKeyReused):
			http.Error(w, err.Error(), http.StatusConflict)
		case errors.Is(err, postgres.ErrCommitUnknown):
			http.Error(w, "unknown outcome: retry with the same Idempotency-Key", http.StatusServiceUnavailable)
		case err != nil:
			http.Error(w, "try again", http.StatusServiceUnavailable)
		default:
			w.Header().Set("Location", "/orders/"+strconv.FormatInt(id, 10))
			w.WriteHeader(http.StatusCreated)
		}
	})
}
