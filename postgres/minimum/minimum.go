// Package minimum is the outbox at its smallest on a real PostgreSQL, the
// step between the root package's lesson and package postgres: the order
// and its event in one transaction, a relay pass that claims, publishes,
// marks after the publish and stops at the first failure, a loop on a
// ticker, and a consumer that drops a duplicate. Read it, then read what
// package postgres adds to each part, and why (its README).
//
// What it leaves out, on purpose (README.md beside it says what each
// costs):
//   - Ids are handed out at insert, not at commit: a transaction that took
//     id 7 may commit after a pass has sent id 8, and 7 then goes at the next
//     pass, after 8. No event is lost, but the order is not commit order.
//   - It never deletes what it sent: the outbox grows for ever.
//   - A pass is not bounded in time: a broker that never answers holds the
//     pass's transaction and its rows.
//   - Its consumer drops copies by the row's id, unique in this database
//     only.
package minimum

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"time"
)

// Schema is the three tables: the shop's, the outbox, the consumer's record.
const Schema = `
CREATE TABLE orders    (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, total_cents bigint NOT NULL);
CREATE TABLE outbox    (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, type text NOT NULL,
                        payload text NOT NULL, sent_at timestamptz);
CREATE TABLE processed (message_id bigint PRIMARY KEY);`

// Message is an outbox row as the broker carries it.
type Message struct {
	ID            int64
	Type, Payload string
}

// Broker is the producer side of a broker: nil means it accepted msg.
type Broker interface {
	Publish(ctx context.Context, msg Message) error
}

// PlaceOrder writes the order and its OrderPlaced event in one transaction:
// both are kept, or neither. The broker is not involved.
func PlaceOrder(ctx context.Context, db *sql.DB, totalCents int64) (int64, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback() // does nothing after Commit
	var id int64
	if err := tx.QueryRowContext(ctx, `INSERT INTO orders (total_cents) VALUES ($1) RETURNING id`, totalCents).Scan(&id); err != nil {
		return 0, err
	}
	payload := fmt.Sprintf(`{"orderId":%d,"totalCents":%d}`, id, totalCents)
	if _, err := tx.ExecContext(ctx, `INSERT INTO outbox (type, payload) VALUES ('OrderPlaced', $1)`, payload); err != nil {
		return 0, err
	}
	return id, tx.Commit()
}

// PublishPending is one relay pass: in one transaction it claims up to 100
// unsent rows in id order (FOR UPDATE SKIP LOCKED: two relays claim
// different rows), publishes each, marks it sent only after the broker
// accepted it, stops at the first failure, and commits what it marked. Id
// order is insert order: a row whose transaction commits late, after a
// pass sent a higher id, goes at the next pass, after it.
func PublishPending(ctx context.Context, db *sql.DB, broker Broker) (int, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback()
	rows, err := tx.QueryContext(ctx, `SELECT id, type, payload FROM outbox WHERE sent_at IS NULL
		ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED`)
	if err != nil {
		return 0, err
	}
	var claimed []Message
	for rows.Next() {
		var m Message
		if err := rows.Scan(&m.ID, &m.Type, &m.Payload); err != nil {
			rows.Close()
			return 0, err
		}
		claimed = append(claimed, m)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	sent := 0
	var pubErr error
	for _, m := range claimed {
		if pubErr = broker.Publish(ctx, m); pubErr != nil {
			break // the rest wait for the next pass, in order
		}
		if _, err := tx.ExecContext(ctx, `UPDATE outbox SET sent_at = now() WHERE id = $1`, m.ID); err != nil {
			return 0, err
		}
		sent++
	}
	if err := tx.Commit(); err != nil {
		return 0, err
	}
	return sent, pubErr
}

// Run makes a pass every interval until ctx ends; a failed pass is logged
// to log (slog's default if nil), what it sent and why it stopped, and
// tried again at the next tick. A relay that drops its errors fails in
// silence for ever: a missing table, a broker that refuses.
func Run(ctx context.Context, db *sql.DB, broker Broker, every time.Duration, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		if n, err := PublishPending(ctx, db, broker); err != nil && ctx.Err() == nil {
			log.Warn("outbox: relay pass failed", "sent", n, "err", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Consume applies msg once: it records the message's id and runs apply in
// one transaction, and a message whose id was recorded before is a
// duplicate, dropped (applied is false).
func Consume(ctx context.Context, db *sql.DB, msg Message, apply func(tx *sql.Tx) error) (applied bool, err error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	defer tx.Rollback()
	res, err := tx.ExecContext(ctx, `INSERT INTO processed (message_id) VALUES ($1) ON CONFLICT DO NOTHING`, msg.ID)
	if err != nil {
		return false, err
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return false, err // n == 0: a duplicate
	}
	if err := apply(tx); err != nil {
		return false, err
	}
	return true, tx.Commit()
}
