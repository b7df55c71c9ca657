// Package postgres is the Transactional Outbox of the root package on a real
// PostgreSQL, through database/sql.
//
// It is the translation of the teaching code: [OrderService] writes the order
// and its [outbox.OrderPlaced] row in one database/sql transaction,
// [OutboxRelay] publishes the unsent rows, and [DirectOrderService] shows the
// dual write beside them. It reuses the root package's [outbox.MessageBroker],
// [outbox.Message], [outbox.ErrInvalidTotal] and [outbox.ErrBrokerUnavailable],
// so the contract is the same. What a real database adds, and the in-memory
// one cannot show, is in the doc comments of [OutboxRelay] and [Warehouse]:
// ids are handed out when rows are inserted, not when transactions commit;
// several relays must claim rows; a consumer must drop duplicates.
//
// [CreateTables] creates the tables of schema.sql. The functions take a
// *sql.DB opened with pgx's stdlib driver (github.com/jackc/pgx/v5/stdlib),
// as the tests do: the relay passes the ids it marks as a []int64, which pgx
// sends as a PostgreSQL array.
package postgres

import (
	"context"
	"database/sql"
	_ "embed"
	"encoding/json"
	"fmt"

	"example.com/patterns/enterprise/outbox"
)

//go:embed schema.sql
var schema string

// CreateTables creates the tables orders and outbox, the index the relay
// reads, and the consumer's tables processed_messages and reservations, as
// schema.sql says. Tables that exist already are left as they are, so it is
// safe to call more than once.
func CreateTables(ctx context.Context, db *sql.DB) error {
	if _, err := db.ExecContext(ctx, schema); err != nil {
		return fmt.Errorf("create tables: %w", err)
	}
	return nil
}

// Transaction runs fn in a transaction on db and commits it if fn returns
// nil. If fn returns an error, or panics, the transaction is rolled back and
// the error is returned unchanged (the panic goes on). If the commit itself
// fails, nothing fn wrote is kept.
func Transaction(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() // after a commit this does nothing; otherwise it undoes fn's writes
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// InsertOutbox adds an unsent message of the given type to the outbox table,
// with payload encoded as JSON, inside tx, and returns the new row's id. The
// row is written, and seen by the relay, only if tx commits.
func InsertOutbox(ctx context.Context, tx *sql.Tx, eventType string, payload any) (int64, error) {
	data, err := json.Marshal(payload)
	if err != nil {
		return 0, fmt.Errorf("encode %s payload: %w", eventType, err)
	}
	var id int64
	err = tx.QueryRowContext(ctx,
		`INSERT INTO outbox (type, payload) VALUES ($1, $2) RETURNING id`,
		eventType, string(data)).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("insert into outbox: %w", err)
	}
	return id, nil
}

// OrderService places orders the outbox way: the order and its OrderPlaced
// message are written in one transaction, and the broker is not involved.
//
// An OrderService is safe for concurrent use by multiple goroutines. Create
// one with [NewOrderService]: the zero value has no database.
type OrderService struct {
	db *sql.DB
}

// NewOrderService returns an OrderService that saves orders in db.
func NewOrderService(db *sql.DB) *OrderService {
	return &OrderService{db: db}
}

// PlaceOrder inserts an order of totalCents into orders and an OrderPlaced
// message for it into outbox, in one transaction, and returns the order's id.
// Its result depends only on the database.
//
// A total of zero or less is refused with an error wrapping
// [outbox.ErrInvalidTotal], and nothing is written.
func (s *OrderService) PlaceOrder(ctx context.Context, totalCents int64) (int64, error) {
	if err := checkTotal(totalCents); err != nil {
		return 0, err
	}
	var order outbox.Order
	err := Transaction(ctx, s.db, func(tx *sql.Tx) error {
		var err error
		if order, err = insertOrder(ctx, tx, totalCents); err != nil {
			return err
		}
		_, err = InsertOutbox(ctx, tx, outbox.OrderPlaced, order)
		return err
	})
	if err != nil {
		return 0, err
	}
	return order.ID, nil
}

// checkTotal refuses what the orders table's CHECK would refuse, before any
// statement is sent, with the root package's error.
func checkTotal(totalCents int64) error {
	if totalCents <= 0 {
		return fmt.Errorf("%w, got %d", outbox.ErrInvalidTotal, totalCents)
	}
	return nil
}

func insertOrder(ctx context.Context, tx *sql.Tx, totalCents int64) (outbox.Order, error) {
	order := outbox.Order{TotalCents: totalCents}
	err := tx.QueryRowContext(ctx,
		`INSERT INTO orders (total_cents) VALUES ($1) RETURNING id`, totalCents).Scan(&order.ID)
	if err != nil {
		return outbox.Order{}, fmt.Errorf("insert into orders: %w", err)
	}
	return order, nil
}
