// Package postgres is the Transactional Outbox of the root package on a real
// PostgreSQL, through database/sql.
//
// It is the translation of the teaching code: [OrderService] writes the order
// and its [outbox.OrderPlaced] row in one database/sql transaction,
// [OutboxRelay] publishes the unsent rows, and [DirectOrderService] shows the
// dual write beside them. It reuses the root package's [outbox.Message],
// [outbox.ErrInvalidTotal] and [outbox.ErrBrokerUnavailable], so the contract
// is the same; its [MessageBroker] is the root one with a context, and
// [AdaptBroker] makes any [outbox.MessageBroker] one.
//
// What a real database adds, and the in-memory one cannot show, is in the
// doc comments of [OutboxRelay], [Transaction] and [Warehouse]: ids are
// handed out when rows are inserted, not when transactions commit; several
// relays must claim rows, and a claim held by a connection must be bounded in
// time; a commit can fail with its outcome unknown; a consumer must drop
// duplicates, by a key unique across producers ([Message.Key]); order holds
// per aggregate only if producers, relays and consumers each keep it
// ([OrderService.CancelOrder], [OutboxRelay.PerAggregate], [Warehouse]).
//
// What running it takes is here too: [OutboxRelay.Run], a loop woken by
// NOTIFY at commit; [ReadLag] for a gauge; [DeleteSent] and
// [Warehouse.ForgetProcessed] for bounded cleanup; parking of the messages a
// broker rejects for ever ([ErrRejected], [OutboxRelay.ParkAfter],
// [ListParked], [Unpark]).
//
// [Migrate] creates and changes the tables, by the numbered files of
// migrations/, as a step of its own before the services start, and
// [CheckSchema] is what a service calls at start-up instead. The functions
// take a
// *sql.DB opened with pgx's stdlib driver (github.com/jackc/pgx/v5/stdlib),
// as the tests do: the relay passes the ids it marks as a []int64, which pgx
// sends as a PostgreSQL array.
package postgres

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"example.com/patterns/enterprise/outbox"
)

// ErrCommitUnknown is wrapped by the error of a commit whose outcome is
// unknown: the request reached the server, or may have, and no answer came
// back (the connection died, the context ended). The transaction may have
// committed or not, and only a look at the database can tell; a caller that
// simply retries may write everything twice. [OrderService.PlaceOrderWithKey]
// makes a retry safe.
var ErrCommitUnknown = errors.New("postgres: commit outcome unknown")

// Transaction runs fn in a READ COMMITTED transaction on db and commits it if
// fn returns nil. The isolation level is asked for explicitly, so a
// database whose default is stricter does not turn this module's waits
// into serialization failures.
//
// If fn returns an error, or panics, the transaction is rolled back and the
// error is returned unchanged (the panic goes on). If the commit fails with
// the server's own error, nothing fn wrote is kept; any other commit error
// wraps [ErrCommitUnknown], and then what fn wrote may be kept or not.
func Transaction(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	defer tx.Rollback() // after a commit this does nothing; otherwise it undoes fn's writes
	if err := fn(tx); err != nil {
		return err
	}
	return commit(tx)
}

// commit commits tx and tells an error the server sent (the transaction was
// rolled back) from one it did not (the outcome is unknown).
func commit(tx *sql.Tx) error {
	err := tx.Commit()
	switch {
	case err == nil:
		return nil
	case sqlState(err) != "":
		return fmt.Errorf("commit: %w", err)
	default:
		return fmt.Errorf("commit: %w: %w", ErrCommitUnknown, err)
	}
}

// sqlState is the SQLSTATE code of the server's error in err's chain, or ""
// if the server sent none. pgx's *pgconn.PgError, like other drivers' errors,
// has a SQLState method.
func sqlState(err error) string {
	var server interface{ SQLState() string }
	if errors.As(err, &server) {
		return server.SQLState()
	}
	return ""
}

// Executor is what [InsertOutbox] and [InsertOutboxFor] need of the
// caller's transaction: the methods that database/sql's *sql.Tx, *sql.Conn
// and *sql.DB share, as do sqlc's generated DBTX and the transaction types
// of libraries built on database/sql. So a team's own transaction, however
// its code opens it, writes the outbox row beside its own change. Give it
// the transaction that writes the change: a *sql.DB would write the row in
// a transaction of its own, which is the dual write again.
type Executor interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// ErrInvalidEventType is returned, wrapped, by [InsertOutbox] and
// [InsertOutboxFor] for an event type that a broker could not route: one
// that is not words of letters, digits, '_' and '-' joined by single dots
// ("OrderPlaced", "order.placed"), or is longer than [MaxEventTypeLen]
// bytes. A broker names its destination after the type (JetStream's
// subject outbox.<type>), and a space or a wildcard there would hold the
// row in the outbox for ever; refused at insert, the caller's transaction
// learns of it while it can still roll back.
var ErrInvalidEventType = errors.New("postgres: event type no broker can route")

// MaxEventTypeLen is the longest event type, in bytes.
const MaxEventTypeLen = 200

// InsertOutbox adds an unsent message of the given type to the outbox table,
// with payload encoded as JSON, inside tx (the caller's transaction, any
// [Executor]), and returns the new row's id. The row is written, and seen
// by the relay, only if tx commits. A type no
// broker can route is refused with [ErrInvalidEventType] before any
// statement is sent.
func InsertOutbox(ctx context.Context, tx Executor, eventType string, payload any) (int64, error) {
	return insertOutbox(ctx, tx, sql.NullString{}, 0, eventType, payload)
}

// InsertOutboxFor is InsertOutbox for an event that must keep its place
// among the events of its aggregate, such as "order/17": the row carries the
// aggregate and seq, the event's number among them (1 for the first).
//
// The caller must hold the aggregate's row lock in tx (SELECT ... FOR UPDATE,
// or an UPDATE of its row) from before this insert until tx ends, as
// CancelOrder does: then a later event of the aggregate takes its id only
// after this one committed, so one aggregate's ids follow its commits, and
// the seq read under the lock is not taken twice.
func InsertOutboxFor(ctx context.Context, tx Executor, aggregate string, seq int64, eventType string, payload any) (int64, error) {
	return insertOutbox(ctx, tx, sql.NullString{String: aggregate, Valid: true}, seq, eventType, payload)
}

func insertOutbox(ctx context.Context, tx Executor, aggregate sql.NullString, seq int64, eventType string, payload any) (int64, error) {
	if !routable(eventType) {
		return 0, fmt.Errorf("%w: %q", ErrInvalidEventType, eventType)
	}
	data, err := json.Marshal(payload)
	if err != nil {
		return 0, fmt.Errorf("encode %s payload: %w", eventType, err)
	}
	var id int64
	err = tx.QueryRowContext(ctx,
		`INSERT INTO outbox (type, payload, aggregate, seq) VALUES ($1, $2, $3, NULLIF($4, 0)) RETURNING id`,
		eventType, string(data), aggregate, seq).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("insert into outbox: %w", err)
	}
	return id, nil
}

// routable reports whether t is words of letters, digits, '_' and '-'
// joined by single dots, at most MaxEventTypeLen bytes.
func routable(t string) bool {
	if t == "" || len(t) > MaxEventTypeLen {
		return false
	}
	for word := range strings.SplitSeq(t, ".") {
		if word == "" {
			return false
		}
		for _, c := range word {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
				return false
			}
		}
	}
	return true
}

// OrderCancelled is the type of the event that tells the warehouse an order
// was cancelled, so that it releases the order's stock. Its payload is the
// [outbox.Order] as JSON, like OrderPlaced's.
const OrderCancelled = "OrderCancelled"

// ErrOrderNotFound and ErrOrderCancelled are returned, wrapped, by
// [OrderService.CancelOrder] for an order that does not exist or is
// cancelled already; nothing is written.
var (
	ErrOrderNotFound  = errors.New("postgres: no such order")
	ErrOrderCancelled = errors.New("postgres: order already cancelled")
)

// OrderAggregate is the aggregate of an order's events in the outbox:
// "order/" and its id.
func OrderAggregate(orderID int64) string { return "order/" + strconv.FormatInt(orderID, 10) }

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

// ErrInvalidIdempotencyKey is returned, wrapped, by
// [OrderService.PlaceOrderWithKey] for a key that is empty, longer than
// [MaxIdempotencyKeyLen] bytes, not UTF-8, or holds a NUL byte.
var ErrInvalidIdempotencyKey = errors.New("postgres: invalid idempotency key")

// ErrIdempotencyKeyReused is returned, wrapped, by
// [OrderService.PlaceOrderWithKey] when its key already placed an order of
// another total: a retry must repeat the request it retries.
var ErrIdempotencyKeyReused = errors.New("postgres: idempotency key already used for another order")

// MaxIdempotencyKeyLen is the longest idempotency key, in bytes.
const MaxIdempotencyKeyLen = 255

// PlaceOrder inserts an order of totalCents into orders and an OrderPlaced
// message for it into outbox, in one transaction, and returns the order's id.
// Its result depends only on the database.
//
// A total of zero or less is refused with an error wrapping
// [outbox.ErrInvalidTotal], and nothing is written. An error wrapping
// [ErrCommitUnknown] leaves it unknown whether the order was placed: retry
// with [OrderService.PlaceOrderWithKey], not with PlaceOrder, which would
// place a second order with a second event.
func (s *OrderService) PlaceOrder(ctx context.Context, totalCents int64) (int64, error) {
	return s.place(ctx, sql.NullString{}, totalCents)
}

// PlaceOrderWithKey is PlaceOrder made safe to retry. key names the request
// (an HTTP handler takes it from the Idempotency-Key header) and is stored
// with the order under a unique constraint. If an order with key exists
// already, PlaceOrderWithKey writes nothing and returns that order's id, so
// a retry after an unknown outcome ([ErrCommitUnknown]) or a lost response
// places one order and one event, however often it runs, also concurrently.
//
// A key that placed an order of another total is refused with
// [ErrIdempotencyKeyReused]; an empty or malformed key with
// [ErrInvalidIdempotencyKey]. Neither writes anything.
func (s *OrderService) PlaceOrderWithKey(ctx context.Context, key string, totalCents int64) (int64, error) {
	if len(key) == 0 || len(key) > MaxIdempotencyKeyLen || !utf8.ValidString(key) || strings.IndexByte(key, 0) >= 0 {
		return 0, fmt.Errorf("%w: %q", ErrInvalidIdempotencyKey, key)
	}
	return s.place(ctx, sql.NullString{String: key, Valid: true}, totalCents)
}

func (s *OrderService) place(ctx context.Context, key sql.NullString, totalCents int64) (int64, error) {
	if err := checkTotal(totalCents); err != nil {
		return 0, err
	}
	var order outbox.Order
	err := Transaction(ctx, s.db, func(tx *sql.Tx) error {
		var placed bool
		var err error
		if order, placed, err = insertOrder(ctx, tx, key, totalCents); err != nil || !placed {
			return err // !placed: the key's order exists, and so does its event
		}
		// The order's row is new, so no one else sees it, let alone locks
		// it, before this commits: its first event needs no lock.
		_, err = InsertOutboxFor(ctx, tx, OrderAggregate(order.ID), 1, outbox.OrderPlaced, order)
		return err
	})
	if err != nil {
		return 0, err
	}
	return order.ID, nil
}

// CancelOrder cancels the order orderID and writes its OrderCancelled event
// in the same transaction, as PlaceOrder writes OrderPlaced. The UPDATE of
// the order's row takes its lock and its next event number, so the two
// events of an order commit, and take their outbox ids, in their order:
// OrderPlaced seq 1, OrderCancelled seq 2.
//
// An order that does not exist, or is cancelled already, is refused with an
// error wrapping [ErrOrderNotFound] or [ErrOrderCancelled], and nothing is
// written. An error wrapping [ErrCommitUnknown] leaves it unknown whether the
// order was cancelled; a retry then says ErrOrderCancelled if it was.
func (s *OrderService) CancelOrder(ctx context.Context, orderID int64) error {
	return Transaction(ctx, s.db, func(tx *sql.Tx) error {
		order := outbox.Order{ID: orderID}
		var seq int64
		err := tx.QueryRowContext(ctx, `UPDATE orders SET cancelled_at = clock_timestamp(), events = events + 1
			WHERE id = $1 AND cancelled_at IS NULL RETURNING total_cents, events`, orderID).Scan(&order.TotalCents, &seq)
		if errors.Is(err, sql.ErrNoRows) {
			var cancelled bool
			err := tx.QueryRowContext(ctx, `SELECT cancelled_at IS NOT NULL FROM orders WHERE id = $1`, orderID).Scan(&cancelled)
			switch {
			case errors.Is(err, sql.ErrNoRows):
				return fmt.Errorf("cancel order %d: %w", orderID, ErrOrderNotFound)
			case err != nil:
				return fmt.Errorf("cancel order %d: %w", orderID, err)
			default:
				return fmt.Errorf("cancel order %d: %w", orderID, ErrOrderCancelled)
			}
		}
		if err != nil {
			return fmt.Errorf("cancel order %d: %w", orderID, err)
		}
		_, err = InsertOutboxFor(ctx, tx, OrderAggregate(orderID), seq, OrderCancelled, order)
		return err
	})
}

// checkTotal refuses what the orders table's CHECK would refuse, before any
// statement is sent, with the root package's error.
func checkTotal(totalCents int64) error {
	if totalCents <= 0 {
		return fmt.Errorf("%w, got %d", outbox.ErrInvalidTotal, totalCents)
	}
	return nil
}

// insertOrder inserts an order of totalCents with key (NULL for none) and
// reports placed. If key placed an order before, it inserts nothing and
// returns that order with placed false, or ErrIdempotencyKeyReused if its
// total differs. The orders table's CHECK, for a caller that skipped
// checkTotal, comes back as outbox.ErrInvalidTotal.
func insertOrder(ctx context.Context, tx *sql.Tx, key sql.NullString, totalCents int64) (order outbox.Order, placed bool, err error) {
	order = outbox.Order{TotalCents: totalCents}
	// ON CONFLICT waits for a transaction that holds the same key to end;
	// under READ COMMITTED the SELECT after it then sees that order.
	err = tx.QueryRowContext(ctx, `INSERT INTO orders (total_cents, idempotency_key) VALUES ($1, $2)
		ON CONFLICT (idempotency_key) DO NOTHING RETURNING id`, totalCents, key).Scan(&order.ID)
	switch {
	case err == nil:
		return order, true, nil
	case errors.Is(err, sql.ErrNoRows) && key.Valid:
		var first outbox.Order
		if err := tx.QueryRowContext(ctx, `SELECT id, total_cents FROM orders WHERE idempotency_key = $1`,
			key).Scan(&first.ID, &first.TotalCents); err != nil {
			return outbox.Order{}, false, fmt.Errorf("find the order of idempotency key %q: %w", key.String, err)
		}
		if first.TotalCents != totalCents {
			return outbox.Order{}, false, fmt.Errorf("%w: key %q placed order %d of %d cents, not %d",
				ErrIdempotencyKeyReused, key.String, first.ID, first.TotalCents, totalCents)
		}
		return first, false, nil
	case sqlState(err) == "23514": // check_violation
		return outbox.Order{}, false, fmt.Errorf("insert into orders: %w, got %d: %w", outbox.ErrInvalidTotal, totalCents, err)
	default:
		return outbox.Order{}, false, fmt.Errorf("insert into orders: %w", err)
	}
}
