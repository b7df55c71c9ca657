// Package shop is the example built on the outbox package
// (example.com/patterns/enterprise/outbox/postgres): the root teaching
// package's shop and warehouse on a real PostgreSQL. [OrderService] writes
// an order and its OrderPlaced event in one transaction, with
// postgres.Outbox.Write; [Warehouse] applies each event once, with
// postgres.Outbox.ApplyOnce; [DirectOrderService] shows the dual write beside them.
// Its [Order], [OrderPlaced] and [ErrInvalidTotal] are the root teaching
// package's, the same JSON and the same rule, declared again here so that
// the outbox's module needs nothing of the lesson (the shop program's tests
// check that they agree).
//
// A team does not import this package: it reads it as the pattern applied
// to one pair of tables, and writes its own on its own tables. [Migrate]
// creates the example's tables, apart from the outbox's (postgres.Outbox.Migrate).
package shop

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Order is an order as the shop stores it and as its events carry it:
// {"orderId":1,"totalCents":2500}, the root package's Order.
type Order struct {
	ID         int64 `json:"orderId"`    // the orders table's id: 1, 2, 3, ...
	TotalCents int64 `json:"totalCents"` // the order's total in cents; always positive
}

// OrderPlaced is the type of the event that tells the warehouse about a new
// order; OrderCancelled, of the one that tells it an order was cancelled,
// so that it releases the order's stock. The payload of each is the [Order]
// as JSON.
const (
	OrderPlaced    = "OrderPlaced"
	OrderCancelled = "OrderCancelled"
)

// ErrInvalidTotal is returned, wrapped, for an order whose total is zero or
// less; nothing is written.
var ErrInvalidTotal = errors.New("shop: order total must be a positive number of cents")

// ErrOrderNotFound and ErrOrderCancelled are returned, wrapped, by
// [OrderService.CancelOrder] for an order that does not exist or is
// cancelled already; nothing is written.
var (
	ErrOrderNotFound  = errors.New("shop: no such order")
	ErrOrderCancelled = errors.New("shop: order already cancelled")
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
	db     *sql.DB
	outbox *postgres.Outbox[postgres.SQLTx] // the table outbox of db
	err    error                            // why db has no outbox
}

// NewOrderService returns an OrderService that saves orders in db and their
// events in db's table outbox. db must be opened with pgx's stdlib driver
// ([postgres.OpenDB]); on any other, or a nil db, every method returns the
// error wrapping [postgres.ErrInvalidConfig] that says so, and writes
// nothing.
func NewOrderService(db *sql.DB) *OrderService {
	ob, err := postgres.OpenDB(db, postgres.Config{})
	return &OrderService{db: db, outbox: ob, err: err}
}

// ErrInvalidIdempotencyKey is returned, wrapped, by
// [OrderService.PlaceOrderWithKey] for a key that is empty, longer than
// [MaxIdempotencyKeyLen] bytes, not UTF-8, or holds a NUL byte.
var ErrInvalidIdempotencyKey = errors.New("shop: invalid idempotency key")

// ErrIdempotencyKeyReused is returned, wrapped, by
// [OrderService.PlaceOrderWithKey] when its key already placed an order of
// another total: a retry must repeat the request it retries.
var ErrIdempotencyKeyReused = errors.New("shop: idempotency key already used for another order")

// MaxIdempotencyKeyLen is the longest idempotency key, in bytes.
const MaxIdempotencyKeyLen = 255

// PlaceOrder inserts an order of totalCents into orders and an OrderPlaced
// message for it into outbox, in one transaction, and returns the order's id.
// Its result depends only on the database. It is a span, "PlaceOrder", of
// otel's global tracer provider, whose context the outbox row keeps.
//
// A total of zero or less is refused with an error wrapping
// [ErrInvalidTotal], and nothing is written. An error wrapping
// [postgres.ErrCommitUnknown] leaves it unknown whether the order was placed: retry
// with [OrderService.PlaceOrderWithKey], not with PlaceOrder, which would
// place a second order with a second event.
func (s *OrderService) PlaceOrder(ctx context.Context, totalCents int64) (int64, error) {
	return s.place(ctx, sql.NullString{}, totalCents)
}

// PlaceOrderWithKey is PlaceOrder made safe to retry. key names the request
// (an HTTP handler takes it from the Idempotency-Key header) and is stored
// with the order under a unique constraint. If an order with key exists
// already, PlaceOrderWithKey writes nothing and returns that order's id, so
// a retry after an unknown outcome ([postgres.ErrCommitUnknown]) or a lost response
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

func (s *OrderService) place(ctx context.Context, key sql.NullString, totalCents int64) (id int64, err error) {
	if err := checkTotal(totalCents); err != nil {
		return 0, err
	}
	if s.err != nil {
		return 0, s.err
	}
	ctx, end := startSpan(ctx, "PlaceOrder")
	defer func() { end(err) }()
	err = postgres.Transaction(ctx, s.db, func(ctx context.Context, tx *sql.Tx) error {
		var err error
		id, err = s.placeIn(ctx, tx, key, totalCents)
		return err
	})
	if err != nil {
		return 0, err
	}
	return id, nil
}

// startSpan starts a span of otel's global tracer provider, in which the
// transaction's outbox row stores its trace context; end ends it with err.
func startSpan(ctx context.Context, name string) (context.Context, func(err error)) {
	ctx, span := otel.Tracer("example.com/patterns/enterprise/outbox/postgres/shop").Start(ctx, name)
	return ctx, func(err error) {
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// PlaceOrderIn is PlaceOrder inside the caller's transaction tx, a
// [postgres.SQLTx] (a *sql.Tx, or what embeds one; never a *sql.DB): it writes the order and its
// OrderPlaced row in tx and returns the order's id, and both are kept only
// if tx commits. It refuses a total of zero or less as PlaceOrder does,
// before any statement. Committing is the caller's, and so is an unknown
// outcome of that commit.
func (s *OrderService) PlaceOrderIn(ctx context.Context, tx postgres.SQLTx, totalCents int64) (int64, error) {
	if err := checkTotal(totalCents); err != nil {
		return 0, err
	}
	if s.err != nil {
		return 0, s.err
	}
	return s.placeIn(ctx, tx, sql.NullString{}, totalCents)
}

// placeIn writes the order and, if it is new, its event, in tx.
func (s *OrderService) placeIn(ctx context.Context, tx postgres.SQLTx, key sql.NullString, totalCents int64) (int64, error) {
	order, placed, err := insertOrder(ctx, tx, key, totalCents)
	if err != nil || !placed {
		return order.ID, err // !placed: the key's order exists, and so does its event
	}
	// The order's row is new, so no one else sees it, let alone locks it,
	// before this commits: its first event needs no lock.
	event := postgres.Event{Type: OrderPlaced, Payload: order, Aggregate: OrderAggregate(order.ID), Seq: 1}
	if _, err := s.outbox.Write(ctx, tx, event); err != nil {
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
// written. An error wrapping [postgres.ErrCommitUnknown] leaves it unknown whether the
// order was cancelled; a retry then says ErrOrderCancelled if it was.
func (s *OrderService) CancelOrder(ctx context.Context, orderID int64) (err error) {
	if s.err != nil {
		return s.err
	}
	ctx, end := startSpan(ctx, "CancelOrder")
	defer func() { end(err) }()
	return postgres.Transaction(ctx, s.db, func(ctx context.Context, tx *sql.Tx) error {
		order := Order{ID: orderID}
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
		_, err = s.outbox.Write(ctx, tx, postgres.Event{Type: OrderCancelled, Payload: order, Aggregate: OrderAggregate(orderID), Seq: seq})
		return err
	})
}

// checkTotal refuses what the orders table's CHECK would refuse, before any
// statement is sent, with the root package's error.
func checkTotal(totalCents int64) error {
	if totalCents <= 0 {
		return fmt.Errorf("%w, got %d", ErrInvalidTotal, totalCents)
	}
	return nil
}

// insertOrder inserts an order of totalCents with key (NULL for none) and
// reports placed. If key placed an order before, it inserts nothing and
// returns that order with placed false, or ErrIdempotencyKeyReused if its
// total differs. The orders table's CHECK, for a caller that skipped
// checkTotal, comes back as ErrInvalidTotal.
func insertOrder(ctx context.Context, tx postgres.SQLTx, key sql.NullString, totalCents int64) (order Order, placed bool, err error) {
	order = Order{TotalCents: totalCents}
	// ON CONFLICT waits for a transaction that holds the same key to end;
	// under READ COMMITTED the SELECT after it then sees that order.
	err = tx.QueryRowContext(ctx, `INSERT INTO orders (total_cents, idempotency_key) VALUES ($1, $2)
		ON CONFLICT (idempotency_key) DO NOTHING RETURNING id`, totalCents, key).Scan(&order.ID)
	switch {
	case err == nil:
		return order, true, nil
	case errors.Is(err, sql.ErrNoRows) && key.Valid:
		var first Order
		if err := tx.QueryRowContext(ctx, `SELECT id, total_cents FROM orders WHERE idempotency_key = $1`,
			key).Scan(&first.ID, &first.TotalCents); err != nil {
			return Order{}, false, fmt.Errorf("find the order of idempotency key %q: %w", key.String, err)
		}
		if first.TotalCents != totalCents {
			return Order{}, false, fmt.Errorf("%w: key %q placed order %d of %d cents, not %d",
				ErrIdempotencyKeyReused, key.String, first.ID, first.TotalCents, totalCents)
		}
		return first, false, nil
	case isCheckViolation(err):
		return Order{}, false, fmt.Errorf("insert into orders: %w, got %d: %w", ErrInvalidTotal, totalCents, err)
	default:
		return Order{}, false, fmt.Errorf("insert into orders: %w", err)
	}
}

// isCheckViolation reports whether err is the server's check_violation.
func isCheckViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23514"
}
