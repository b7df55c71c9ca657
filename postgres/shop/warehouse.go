package shop

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Warehouse is the consumer of OrderPlaced and OrderCancelled: it reserves
// stock for each order it hears of and releases it when the order is
// cancelled. If a cancellation were applied before its order, the order's
// stock would stay reserved for good, so the warehouse applies an order's
// messages in their Seq order only, and delivery is at least once, so it
// applies each message once: [postgres.Outbox.ApplyOnce] does both, in the
// transaction that writes the reservation.
//
// In a real system the warehouse keeps its tables in its own database; here
// they share the server with the shop so that a test can see both sides.
//
// A Warehouse is safe for concurrent use by multiple goroutines: two
// deliveries of one message at the same time apply it once, the second
// coming back as a duplicate, not as an error. Create one with
// [NewWarehouse]: the zero value has no database.
type Warehouse struct {
	db     *sql.DB
	outbox *postgres.Outbox[postgres.SQLTx] // db's consumer records, through its table outbox
	err    error                            // why db has none
}

// NewWarehouse returns a Warehouse that keeps its reservations in db. db
// must be opened with pgx's stdlib driver ([postgres.OpenDB]); on any other,
// or a nil db, every method returns the error wrapping
// [postgres.ErrInvalidConfig] that says so, and changes nothing.
func NewWarehouse(db *sql.DB) *Warehouse {
	ob, err := postgres.OpenDB(db, postgres.Config{})
	return &Warehouse{db: db, outbox: ob, err: err}
}

// Handle applies msg unless it was applied before, and reports whether it
// did: OrderPlaced reserves the order's stock, OrderCancelled releases it,
// and a message of another type is recorded and has no effect. It refuses,
// changing nothing, what [postgres.Outbox.ApplyOnce] refuses (a message with no
// key, one that arrives before its predecessor) and a payload that is not
// an order, with an error wrapping [postgres.ErrMalformedMessage] and the
// decoding error.
func (w *Warehouse) Handle(ctx context.Context, msg postgres.Message) (applied bool, err error) {
	if w.err != nil {
		return false, w.err
	}
	return w.outbox.ApplyOnce(ctx, msg, options(msg), func(ctx context.Context, tx postgres.SQLTx) error {
		return reserve(ctx, tx, msg)
	})
}

// HandleBatch is Handle for several messages in one transaction, through
// [postgres.Outbox.ApplyBatch]: applied[i] reports whether msgs[i] was
// applied. It is all or nothing: on an error nothing is applied, and the
// caller handles the messages one at a time with Handle to learn what
// became of each (the brokers' consumers do).
func (w *Warehouse) HandleBatch(ctx context.Context, msgs []postgres.Message) (applied []bool, err error) {
	if w.err != nil {
		return nil, w.err
	}
	return w.outbox.ApplyBatch(ctx, msgs, options, reserveAll)
}

// options says whether msg is its order's last event: CancelOrder refuses
// an order that is cancelled already, so OrderCancelled is. Its position
// may then be forgotten.
func options(msg postgres.Message) postgres.ApplyOptions {
	return postgres.ApplyOptions{Last: msg.Type == OrderCancelled}
}

// reserve writes msg's effect in tx: OrderPlaced reserves the order's
// stock, OrderCancelled releases it, any other type has none.
func reserve(ctx context.Context, tx postgres.SQLTx, msg postgres.Message) error {
	if msg.Type != OrderPlaced && msg.Type != OrderCancelled {
		return nil
	}
	order, err := decodeOrder(msg)
	if err != nil {
		return err
	}
	effect := `INSERT INTO reservations (order_id, total_cents) VALUES ($1, $2)`
	if msg.Type == OrderCancelled {
		effect = `DELETE FROM reservations WHERE order_id = $1 AND $2::bigint IS NOT NULL`
	}
	if _, err := tx.ExecContext(ctx, effect, order.ID, order.TotalCents); err != nil {
		return fmt.Errorf("message %s: %s: %w", msg.Key, msg.Type, err)
	}
	return nil
}

// reserveAll writes the effects of msgs in tx in two statements, however
// many they are: one INSERT for the orders placed, then one DELETE for
// those cancelled (an order cancelled in the same batch was placed before
// its cancellation, so its row goes too). A payload that is not an order
// fails the batch before anything is written, naming its message.
func reserveAll(ctx context.Context, tx postgres.SQLTx, msgs []postgres.Message) error {
	var placed, totals, cancelled []int64
	for _, msg := range msgs {
		if msg.Type != OrderPlaced && msg.Type != OrderCancelled {
			continue
		}
		order, err := decodeOrder(msg)
		if err != nil {
			return err
		}
		if msg.Type == OrderPlaced {
			placed, totals = append(placed, order.ID), append(totals, order.TotalCents)
		} else {
			cancelled = append(cancelled, order.ID)
		}
	}
	if len(placed) > 0 {
		if _, err := tx.ExecContext(ctx, `INSERT INTO reservations (order_id, total_cents)
			SELECT * FROM unnest($1::bigint[], $2::bigint[])`, placed, totals); err != nil {
			return fmt.Errorf("%s of %d orders: %w", OrderPlaced, len(placed), err)
		}
	}
	if len(cancelled) > 0 {
		if _, err := tx.ExecContext(ctx, `DELETE FROM reservations WHERE order_id = ANY($1::bigint[])`, cancelled); err != nil {
			return fmt.Errorf("%s of %d orders: %w", OrderCancelled, len(cancelled), err)
		}
	}
	return nil
}

// decodeOrder reads the order msg carries, or says which message does not
// carry one.
func decodeOrder(msg postgres.Message) (Order, error) {
	var order Order
	if err := json.Unmarshal([]byte(msg.Payload), &order); err != nil {
		return Order{}, fmt.Errorf("message %s: decode %s payload: %w: %w", msg.Key, msg.Type, postgres.ErrMalformedMessage, err)
	}
	return order, nil
}

// ForgetProcessed is [postgres.Outbox.ForgetProcessed] on the warehouse's
// database: it forgets the keys and closed positions older than retention,
// batchSize rows a transaction (0 for [postgres.DefaultCleanupBatch]).
func (w *Warehouse) ForgetProcessed(ctx context.Context, retention time.Duration, batchSize int) (int64, error) {
	ob, err := postgres.OpenDB(w.db, postgres.Config{CleanupBatch: batchSize})
	if err != nil {
		return 0, err
	}
	return ob.ForgetProcessed(ctx, retention)
}
