package postgres

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"example.com/patterns/enterprise/outbox"
)

// ErrOutOfOrder is returned, wrapped, by [Warehouse.Handle] for a message
// that arrives before its predecessor in its aggregate: it is not applied,
// and applies once the predecessor has been.
var ErrOutOfOrder = errors.New("postgres: message arrived before its predecessor")

// ErrMalformedMessage is returned, wrapped, by [Warehouse.Handle] for a
// message whose payload it cannot read as its type's: delivered again, it
// fails again, so a consumer should drop it (and keep it for a person to
// look at) instead of asking for it again.
var ErrMalformedMessage = errors.New("postgres: message payload cannot be read")

// ErrNoMessageKey is returned by [Warehouse.Handle] for a message whose Key
// is empty, such as one published by [DirectOrderService]: with no key there
// is no way to tell a duplicate from a new message.
var ErrNoMessageKey = errors.New("postgres: message has no key, so duplicates cannot be dropped")

// Warehouse is the consumer of OrderPlaced and OrderCancelled: it reserves
// stock for each order it hears of and releases it when the order is
// cancelled. If a cancellation were applied before its order, the order's
// stock would stay reserved for good, so the warehouse applies an
// aggregate's messages in their Seq order only: it remembers the last Seq
// it applied for each aggregate and refuses one that skips ahead
// ([ErrOutOfOrder]), for the broker to deliver again later. A broker that
// reorders cannot undo the relay's order silently.
//
// Delivery is at least once, so it is idempotent by
// [Message.Key]: in one transaction it records the key in
// processed_messages and applies the message's effect (a row in
// reservations). A message whose key is recorded already changes nothing.
// The key, not [outbox.Message.ID], because a warehouse that hears two
// shops, or one shop whose sequence was reset, sees the same id on different
// messages.
//
// In a real system the warehouse keeps both tables in its own database; here
// they share the server with the shop so that a test can see both sides.
//
// A Warehouse is safe for concurrent use by multiple goroutines: two
// deliveries of one message at the same time apply it once, the second
// coming back as a duplicate, not as an error. Create one with
// [NewWarehouse]: the zero value has no database.
type Warehouse struct {
	db *sql.DB
}

// NewWarehouse returns a Warehouse that keeps its reservations in db.
func NewWarehouse(db *sql.DB) *Warehouse {
	return &Warehouse{db: db}
}

// Handle applies msg unless a message with its key was applied before, and
// reports whether it did. OrderPlaced reserves the order's stock,
// OrderCancelled releases it; messages of other types are recorded and have
// no effect. A message of an aggregate must carry the Seq after the last one
// applied for that aggregate: one that skips ahead is refused with
// [ErrOutOfOrder], to be delivered again later; one at or below it was
// applied before (a copy that came after its key was forgotten, or a
// replay of the stream) and is a duplicate, whatever its key says. A message with no key is
// refused with [ErrNoMessageKey]; a payload that is not an order is refused
// with an error wrapping [ErrMalformedMessage] and the decoding error. A
// refused message changes nothing.
func (w *Warehouse) Handle(ctx context.Context, msg Message) (applied bool, err error) {
	if msg.Key == "" {
		return false, ErrNoMessageKey
	}
	err = Transaction(ctx, w.db, func(tx *sql.Tx) error {
		// Under READ COMMITTED a second delivery waits here for the first
		// one's transaction, then finds the key and inserts nothing.
		res, err := tx.ExecContext(ctx,
			`INSERT INTO processed_messages (message_key) VALUES ($1) ON CONFLICT DO NOTHING`, msg.Key)
		if err != nil {
			return fmt.Errorf("record message %s: %w", msg.Key, err)
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			return err // n == 0: applied before, a duplicate
		}
		if msg.Aggregate != "" {
			if err := advance(ctx, tx, msg); err != nil {
				return err
			}
		}
		if msg.Type != outbox.OrderPlaced && msg.Type != OrderCancelled {
			applied = true
			return nil
		}
		var order outbox.Order
		if err := json.Unmarshal([]byte(msg.Payload), &order); err != nil {
			return fmt.Errorf("message %s: decode %s payload: %w: %w", msg.Key, msg.Type, ErrMalformedMessage, err)
		}
		effect := `INSERT INTO reservations (order_id, total_cents) VALUES ($1, $2)`
		if msg.Type == OrderCancelled {
			effect = `DELETE FROM reservations WHERE order_id = $1 AND $2::bigint IS NOT NULL`
		}
		if _, err := tx.ExecContext(ctx, effect, order.ID, order.TotalCents); err != nil {
			return fmt.Errorf("message %s: %s: %w", msg.Key, msg.Type, err)
		}
		applied = true
		return nil
	})
	if errors.Is(err, errStale) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return applied, nil
}

// errStale is what advance returns for a message at or below its
// aggregate's position: Handle rolls back and reports a duplicate.
var errStale = errors.New("postgres: message at or below its aggregate's position")

// advance moves the aggregate's position from msg.Seq-1 to msg.Seq, under
// the position's row lock, or refuses msg with ErrOutOfOrder.
func advance(ctx context.Context, tx *sql.Tx, msg Message) error {
	if _, err := tx.ExecContext(ctx,
		`INSERT INTO aggregate_positions (aggregate, seq) VALUES ($1, 0) ON CONFLICT DO NOTHING`, msg.Aggregate); err != nil {
		return fmt.Errorf("message %s: %w", msg.Key, err)
	}
	var last int64
	if err := tx.QueryRowContext(ctx,
		`SELECT seq FROM aggregate_positions WHERE aggregate = $1 FOR UPDATE`, msg.Aggregate).Scan(&last); err != nil {
		return fmt.Errorf("message %s: %w", msg.Key, err)
	}
	if msg.Seq <= last {
		return errStale // applied before: a copy whose key was forgotten, or a replay
	}
	if msg.Seq != last+1 {
		return fmt.Errorf("message %s: %s seq %d, but the last applied is %d: %w",
			msg.Key, msg.Aggregate, msg.Seq, last, ErrOutOfOrder)
	}
	// OrderCancelled is an order's last event: CancelOrder refuses an order
	// that is cancelled already. Its position may then be forgotten.
	if _, err := tx.ExecContext(ctx,
		`UPDATE aggregate_positions SET seq = $2, applied_at = clock_timestamp(), closed = $3 WHERE aggregate = $1`,
		msg.Aggregate, msg.Seq, msg.Type == OrderCancelled); err != nil {
		return fmt.Errorf("message %s: %w", msg.Key, err)
	}
	return nil
}

// ForgetProcessed deletes the keys of messages processed longer than
// retention ago, and the positions of the aggregates that were closed (an
// order's OrderCancelled applied) longer than retention ago, at most
// batchSize rows a transaction (zero or less means [DefaultCleanupBatch]),
// and returns how many keys and positions it deleted. It is safe to run
// beside Handle. The position of an aggregate that is still open is kept,
// however old: forgotten, the aggregate's next event would find no
// predecessor and be refused as out of order for ever.
//
// The rule: forget a key only once no copy of its message can still arrive.
// A copy comes as late as the longest delay before a relay sends again (a
// broker down for hours, a parked message put back) plus the broker's own
// redelivery delay; a retention shorter than that applies a late duplicate
// as a new message. Keep it generous: a key is a few dozen bytes.
func (w *Warehouse) ForgetProcessed(ctx context.Context, retention time.Duration, batchSize int) (int64, error) {
	keys, err := deleteInBatches(ctx, w.db, forgetProcessed, retention, batchSize)
	if err != nil {
		return keys, err
	}
	positions, err := deleteInBatches(ctx, w.db, forgetClosedPositions, retention, batchSize)
	return keys + positions, err
}

// forgetProcessed deletes up to $2 keys older than $1 microseconds.
const forgetProcessed = `
WITH gone AS (
    DELETE FROM processed_messages
    WHERE message_key IN (
        SELECT message_key FROM processed_messages
        WHERE processed_at < clock_timestamp() - $1 * interval '1 microsecond'
        ORDER BY processed_at
        LIMIT $2)
    RETURNING 1)
SELECT count(*) FROM gone`

// forgetClosedPositions deletes up to $2 positions of closed aggregates
// last moved more than $1 microseconds ago.
const forgetClosedPositions = `
WITH gone AS (
    DELETE FROM aggregate_positions
    WHERE aggregate IN (
        SELECT aggregate FROM aggregate_positions
        WHERE closed AND applied_at < clock_timestamp() - $1 * interval '1 microsecond'
        ORDER BY applied_at
        LIMIT $2)
    RETURNING 1)
SELECT count(*) FROM gone`
