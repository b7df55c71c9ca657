package shop

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"

	"example.com/patterns/enterprise/outbox/postgres"
)

// DirectOrderService places orders the naive way, to show why that is wrong:
// it commits the order, then publishes OrderPlaced. Two writes to two systems
// with no transaction around both: if the broker is down, or the process dies
// between them, the order is saved and its event is lost for good. Use
// [OrderService] instead.
//
// A DirectOrderService is safe for concurrent use by multiple goroutines.
// Create one with [NewDirectOrderService]: the zero value has no database and
// no broker.
type DirectOrderService struct {
	db     *sql.DB
	broker postgres.MessageBroker
}

// NewDirectOrderService returns a DirectOrderService that saves orders in db
// and publishes their events to broker.
func NewDirectOrderService(db *sql.DB, broker postgres.MessageBroker) *DirectOrderService {
	return &DirectOrderService{db: db, broker: broker}
}

// PlaceOrder saves and commits an order of totalCents, then publishes
// OrderPlaced, and returns the order's id.
//
// If the broker refuses the message, PlaceOrder returns the id of the order
// it saved together with the broker's error (wrapped; [errors.Is] finds it):
// the order exists, and its event is lost. That is the dual-write bug. A
// total of zero or less is refused with an error wrapping
// [ErrInvalidTotal], and nothing is saved or published.
func (s *DirectOrderService) PlaceOrder(ctx context.Context, totalCents int64) (int64, error) {
	if err := checkTotal(totalCents); err != nil {
		return 0, err
	}
	var order Order
	err := postgres.Transaction(ctx, s.db, func(ctx context.Context, tx *sql.Tx) error {
		var err error
		order, _, err = insertOrder(ctx, tx, sql.NullString{}, totalCents)
		return err
	})
	if err != nil {
		return 0, err
	}

	// The order is committed. If Publish fails, or the process dies right
	// here, no one will ever send this event.
	payload, err := json.Marshal(order)
	if err != nil {
		return order.ID, err // an Order is two integers: this cannot happen
	}
	if err := s.broker.Publish(ctx, postgres.Message{Type: OrderPlaced, Payload: string(payload)}); err != nil {
		return order.ID, fmt.Errorf("order %d saved, but %s not published: %w", order.ID, OrderPlaced, err)
	}
	return order.ID, nil
}
