package postgres

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"

	"example.com/patterns/enterprise/outbox"
)

// ErrNoMessageID is returned by [Warehouse.Handle] for a message whose ID is
// zero, such as one published by [DirectOrderService]: with no id there is
// no way to tell a duplicate from a new message.
var ErrNoMessageID = errors.New("postgres: message has no id, so duplicates cannot be dropped")

// Warehouse is the consumer of OrderPlaced: it reserves stock for each order
// it hears of. Delivery is at least once, so it is idempotent by
// [outbox.Message.ID]: in one transaction it records the id in
// processed_messages and applies the message's effect (a row in
// reservations). A message whose id is recorded already changes nothing.
//
// In a real system the warehouse keeps both tables in its own database; here
// they share the server with the shop so that a test can see both sides.
//
// A Warehouse is safe for concurrent use by multiple goroutines: two
// deliveries of one message at the same time apply it once. Create one with
// [NewWarehouse]: the zero value has no database.
type Warehouse struct {
	db *sql.DB
}

// NewWarehouse returns a Warehouse that keeps its reservations in db.
func NewWarehouse(db *sql.DB) *Warehouse {
	return &Warehouse{db: db}
}

// Handle applies msg unless a message with its id was applied before, and
// reports whether it did. Messages of types other than OrderPlaced are
// recorded and have no effect. A message with no id is refused with
// [ErrNoMessageID]; a payload that is not an order is refused with its
// decoding error. A refused message changes nothing.
func (w *Warehouse) Handle(ctx context.Context, msg outbox.Message) (applied bool, err error) {
	if msg.ID == 0 {
		return false, ErrNoMessageID
	}
	err = Transaction(ctx, w.db, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx,
			`INSERT INTO processed_messages (message_id) VALUES ($1) ON CONFLICT DO NOTHING`, msg.ID)
		if err != nil {
			return fmt.Errorf("record message %d: %w", msg.ID, err)
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			return err // n == 0: applied before, a duplicate
		}
		if msg.Type != outbox.OrderPlaced {
			applied = true
			return nil
		}
		var order outbox.Order
		if err := json.Unmarshal([]byte(msg.Payload), &order); err != nil {
			return fmt.Errorf("message %d: decode %s payload: %w", msg.ID, msg.Type, err)
		}
		if _, err := tx.ExecContext(ctx,
			`INSERT INTO reservations (order_id, total_cents) VALUES ($1, $2)`,
			order.ID, order.TotalCents); err != nil {
			return fmt.Errorf("message %d: reserve: %w", msg.ID, err)
		}
		applied = true
		return nil
	})
	if err != nil {
		return false, err
	}
	return applied, nil
}
