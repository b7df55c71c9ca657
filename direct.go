package outbox

import (
	"encoding/json"
	"fmt"
)

// DirectOrderService places orders the naive way, and exists to show why that
// is wrong: it commits the order to the database and then publishes
// [OrderPlaced] to the broker. These are two writes to two systems with no
// transaction around both (a dual write). If the broker is down, or the
// process dies between the two, the order is saved and the event is lost for
// good: nothing will ever publish it. Retrying Publish does not help, since
// after a crash no one is left to retry; publishing first is worse, since a
// failed commit then leaves the warehouse reserving stock for an order that
// does not exist. Use [OrderService] instead.
//
// A DirectOrderService is safe for concurrent use by multiple goroutines.
// Create one with [NewDirectOrderService]: the zero value has no database and
// no broker.
type DirectOrderService struct {
	db     *Database
	broker MessageBroker
}

// NewDirectOrderService returns a DirectOrderService that saves orders in db
// and publishes their events to broker.
func NewDirectOrderService(db *Database, broker MessageBroker) *DirectOrderService {
	return &DirectOrderService{db: db, broker: broker}
}

// PlaceOrder saves an order of totalCents, commits it, then publishes
// OrderPlaced, and returns the new order's id.
//
// If the broker refuses the message, PlaceOrder returns the id of the order
// it saved together with the broker's error (wrapped; [errors.Is] finds it),
// as [io.Writer] returns what it wrote with its error: the order exists, and
// its event is lost. That is the dual-write bug. A total of zero or less is refused with an
// error wrapping [ErrInvalidTotal]; then nothing is saved or published.
func (s *DirectOrderService) PlaceOrder(totalCents int64) (int64, error) {
	var order Order
	var payload []byte
	err := s.db.Transaction(func(tx *Tx) error {
		var err error
		if order, err = tx.InsertOrder(totalCents); err != nil {
			return err
		}
		payload, err = json.Marshal(order) // the event, while the order can still roll back
		return err
	})
	if err != nil {
		return 0, err
	}

	// The order is committed. If Publish fails, or the process dies right
	// here, no one will ever send this event.
	if err := s.broker.Publish(Message{Type: OrderPlaced, Payload: string(payload)}); err != nil {
		return order.ID, fmt.Errorf("order %d saved, but %s not published: %w", order.ID, OrderPlaced, err)
	}
	return order.ID, nil
}
