package outbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
)

// ErrInvalidTotal is returned, wrapped, by [Tx.InsertOrder] for a total of zero
// cents or less, like a CHECK constraint on the orders table. Both order services
// pass that error on as it is, so callers can test for it with [errors.Is].
var ErrInvalidTotal = errors.New("outbox: order total must be a positive number of cents")

// ErrTxDone is returned by every method of a [Tx] that is called after its
// transaction has committed or rolled back. The call changes nothing.
var ErrTxDone = errors.New("outbox: transaction has already been committed or rolled back")

// Order is a row of the orders table. Its JSON form is the payload of the
// OrderPlaced event: {"orderId":1,"totalCents":2500}. Amounts are in cents, so
// that no money is ever a float.
type Order struct {
	ID         int64 `json:"orderId"`    // assigned by InsertOrder: 1, 2, 3, ...
	TotalCents int64 `json:"totalCents"` // the order's total in cents; always positive
}

// OutboxMessage is a row of the outbox table: a [Message] waiting for the
// [OutboxRelay], and whether the relay has published it yet.
type OutboxMessage struct {
	Message
	Sent bool // set by MarkSent once the broker has accepted the message; never cleared
}

// Database is an in-memory stand-in for a relational database with two
// tables, orders and outbox. Its zero value is an empty database ready to use.
//
// Changes go through [Database.Transaction], which commits all of them or none.
// The other methods each read or write in a statement of their own, as a
// database/sql query outside a transaction does, and see only committed rows.
//
// A Database is safe for concurrent use by multiple goroutines. It runs one
// transaction at a time, so its ids follow commit order. That is true of this
// Database, not of PostgreSQL, where a row with a smaller id can commit after
// one with a larger id: the postgres module's tests show it, and why the
// relay selects unsent rows by their sent flag, as [OutboxRelay] does, never
// by "ids above the last one sent". A Database must not be copied after first
// use.
//
// Ids are one more than the table's length, which is safe only because a
// Database never deletes a row: a job that deleted sent rows would hand their
// ids out again, and consumers that drop duplicates by [Message.ID] would drop
// new messages. The postgres module takes ids from a sequence instead.
type Database struct {
	mu     sync.Mutex
	orders map[int64]Order // keyed by order id
	outbox []OutboxMessage // in id order; the row with id N is outbox[N-1]

	// beforeCommit, when set, runs inside every transaction whose function
	// succeeded, just before its changes are kept. Only the package's tests
	// set it (export_test.go), to stop the process at that point.
	beforeCommit func()
}

// Transaction runs fn in a transaction and commits its changes if fn returns
// nil. If fn returns an error, Transaction rolls back every change fn made to
// either table and returns that same error. If fn panics, or calls
// runtime.Goexit, the changes are rolled back too and the panic goes on.
//
// Rollback is real: Transaction snapshots both tables before calling fn and
// restores the snapshot unless fn succeeds. Other transactions and reads wait
// until this one ends; fn must therefore not call methods of the same
// Database, and must not keep tx after it returns.
func (db *Database) Transaction(fn func(tx *Tx) error) error {
	db.mu.Lock()
	defer db.mu.Unlock()

	orders, outbox := maps.Clone(db.orders), slices.Clone(db.outbox)
	tx := &Tx{db: db}
	committed := false
	defer func() {
		tx.done.Store(true)
		if !committed {
			db.orders, db.outbox = orders, outbox
		}
	}()

	if err := fn(tx); err != nil {
		return err
	}
	if db.beforeCommit != nil {
		db.beforeCommit()
	}
	committed = true
	return nil
}

// Orders returns a copy of the committed orders in id order.
func (db *Database) Orders() []Order {
	db.mu.Lock()
	defer db.mu.Unlock()
	orders := make([]Order, 0, len(db.orders))
	for _, id := range slices.Sorted(maps.Keys(db.orders)) {
		orders = append(orders, db.orders[id])
	}
	return orders
}

// Outbox returns a copy of every committed outbox row, sent or not, in id
// order.
func (db *Database) Outbox() []OutboxMessage {
	db.mu.Lock()
	defer db.mu.Unlock()
	return slices.Clone(db.outbox)
}

// Pending returns the messages of the outbox rows not yet marked sent, in id
// order.
func (db *Database) Pending() []Message {
	db.mu.Lock()
	defer db.mu.Unlock()
	var pending []Message
	for _, row := range db.outbox {
		if !row.Sent {
			pending = append(pending, row.Message)
		}
	}
	return pending
}

// MarkSent marks the outbox row with the given id as sent. Like an SQL UPDATE
// that matches no row, it does nothing if there is no such row.
func (db *Database) MarkSent(id int64) {
	db.mu.Lock()
	defer db.mu.Unlock()
	if id >= 1 && id <= int64(len(db.outbox)) {
		db.outbox[id-1].Sent = true
	}
}

// Tx is a transaction in progress, handed by [Database.Transaction] to its
// function. Its changes become visible to others only when that function
// returns nil. A Tx is not safe for concurrent use; after the transaction
// ends, every method returns [ErrTxDone].
type Tx struct {
	db   *Database
	done atomic.Bool
}

// InsertOrder adds an order of totalCents to the orders table and returns it
// with its new id. A total of zero or less is refused with an error wrapping
// [ErrInvalidTotal], and nothing is written.
func (tx *Tx) InsertOrder(totalCents int64) (Order, error) {
	if tx.done.Load() {
		return Order{}, ErrTxDone
	}
	if totalCents <= 0 {
		return Order{}, fmt.Errorf("%w, got %d", ErrInvalidTotal, totalCents)
	}
	db := tx.db
	if db.orders == nil {
		db.orders = make(map[int64]Order)
	}
	order := Order{ID: int64(len(db.orders)) + 1, TotalCents: totalCents}
	db.orders[order.ID] = order
	return order, nil
}

// InsertOutbox adds an unsent message of the given type to the outbox table,
// with payload encoded as JSON, and returns the new row's id. If payload cannot
// be encoded, InsertOutbox returns the encoding error and writes nothing.
func (tx *Tx) InsertOutbox(eventType string, payload any) (int64, error) {
	if tx.done.Load() {
		return 0, ErrTxDone
	}
	data, err := json.Marshal(payload)
	if err != nil {
		return 0, fmt.Errorf("encode %s payload: %w", eventType, err)
	}
	db := tx.db
	id := int64(len(db.outbox)) + 1
	db.outbox = append(db.outbox, OutboxMessage{
		Message: Message{ID: id, Type: eventType, Payload: string(data)},
	})
	return id, nil
}
