// Package outbox is a teaching example of the Transactional Outbox pattern.
//
// A shop saves an order and must tell the warehouse with an [OrderPlaced]
// event. Saving to the database and then publishing to the broker is a dual
// write: [DirectOrderService] does that, and loses the event when the broker is
// down. [OrderService] instead writes the order and an outbox row in one
// [Database.Transaction], so both are saved or neither is; a separate
// [OutboxRelay] later publishes the unsent rows in id order, marks each sent
// only after the broker accepted it, and stops at the first failure, so that
// the rest wait for its next pass.
//
// The database and the broker are in-memory fakes: [Database] rolls back by
// restoring a snapshot of its tables, and [InMemoryBroker] keeps a list and can
// be taken down. Delivery is at least once: a relay that dies after publishing
// a message but before marking it sent publishes it again, with the same
// [Message.ID], so consumers must drop duplicates.
//
// What is Go about it, as the article's «Отличия между языками» says: the
// transaction takes a function and rolls back when it returns an error (or
// panics), as wrappers over database/sql do, and returns that error
// unchanged for [errors.Is]; maps.Clone and slices.Clone take the snapshot.
// The relay returns the broker's error to its caller, who decides when to try
// again: there is no Run loop, since the article draws the timer as a box of
// its own (the application in example_test.go runs the relay on a ticker).
// [MessageBroker.Publish] takes no context, to match the article's
// one-method interface in every language; the postgres module's takes one.
package outbox

import (
	"fmt"
	"sync"
)

// OrderService places orders the outbox way: the order and its [OrderPlaced]
// message are written to the same database in one transaction, and the broker
// is not involved at all. The message reaches the broker later, through an
// [OutboxRelay].
//
// An OrderService is safe for concurrent use by multiple goroutines. Create
// one with [NewOrderService]: the zero value has no database to write to.
type OrderService struct {
	db *Database
}

// NewOrderService returns an OrderService that saves orders in db.
func NewOrderService(db *Database) *OrderService {
	return &OrderService{db: db}
}

// PlaceOrder inserts an order of totalCents into the orders table and an
// OrderPlaced message for it into the outbox table, in one transaction, and
// returns the new order's id. Its result depends only on the database: it
// succeeds even while the broker is down.
//
// A total of zero or less is refused with an error wrapping
// [ErrInvalidTotal]; then neither table changes.
func (s *OrderService) PlaceOrder(totalCents int64) (int64, error) {
	var order Order
	err := s.db.Transaction(func(tx *Tx) error {
		var err error
		if order, err = tx.InsertOrder(totalCents); err != nil {
			return err
		}
		_, err = tx.InsertOutbox(OrderPlaced, order)
		return err
	})
	if err != nil {
		return 0, err
	}
	return order.ID, nil
}

// OutboxRelay moves messages from the outbox table to the broker. It knows
// nothing about orders: it publishes rows.
//
// An OutboxRelay is safe for concurrent use by multiple goroutines:
// overlapping calls to PublishPending run one after the other, so none
// publishes a row that another has just published. Two relays over one
// Database do not coordinate like that, so run one relay per Database. (A
// real service that runs several relays has each claim its rows, for example
// with SELECT ... FOR UPDATE SKIP LOCKED in a transaction that stays open
// until the rows are published and marked.) Create one with
// [NewOutboxRelay]: the zero value has no database and no broker.
type OutboxRelay struct {
	db     *Database
	broker MessageBroker
	mu     sync.Mutex // held for a whole pass
}

// NewOutboxRelay returns an OutboxRelay that publishes the outbox rows of db
// to broker. A relay has no state of its own beyond that: a new one over the
// same Database resumes where an old one stopped.
func NewOutboxRelay(db *Database, broker MessageBroker) *OutboxRelay {
	return &OutboxRelay{db: db, broker: broker}
}

// PublishPending makes one pass over the outbox. It publishes the unsent
// messages in id order and marks each one sent right after the broker accepted
// it, and returns how many it published.
//
// At the first message the broker refuses, PublishPending stops and returns
// the broker's error, wrapped with the message id, so that
// errors.Is(err, [ErrBrokerUnavailable]) works. That message and all after it
// stay unsent and wait for the next call; the caller decides when that is.
// Messages marked sent are never published again.
func (r *OutboxRelay) PublishPending() (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()

	published := 0
	for _, msg := range r.db.Pending() {
		if err := r.broker.Publish(msg); err != nil {
			return published, fmt.Errorf("publish message %d: %w", msg.ID, err)
		}
		r.db.MarkSent(msg.ID)
		published++
	}
	return published, nil
}
