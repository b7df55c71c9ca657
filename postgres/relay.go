package postgres

import (
	"context"
	"database/sql"
	"fmt"

	"example.com/patterns/enterprise/outbox"
)

// DefaultBatchSize is how many rows a relay pass claims when
// [OutboxRelay.BatchSize] is zero.
const DefaultBatchSize = 100

// claimRows takes up to $1 unsent rows, lowest id first, and locks them for
// the rest of the transaction. SKIP LOCKED passes over rows that another
// relay's open transaction holds, so relays running at the same time claim
// disjoint rows instead of waiting for each other. Rows of transactions that
// have not committed are not seen at all.
const claimRows = `
SELECT id, type, payload
FROM outbox
WHERE sent_at IS NULL
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`

// markSent marks, in one statement, the rows the broker accepted.
const markSent = `UPDATE outbox SET sent_at = now() WHERE id = ANY($1)`

// OutboxRelay moves messages from the outbox table to the broker. It knows
// nothing about orders: it publishes rows.
//
// Each pass is one transaction that claims a batch of unsent rows with
// SELECT ... FOR UPDATE SKIP LOCKED and stays open while it publishes them and
// marks them sent. Holding the transaction is the claim: while a relay is
// alive, no other relay sees its rows, and when it dies its connection drops,
// PostgreSQL rolls the pass back and the rows are free again, with no lease to
// expire and no clock to trust. (A short claiming transaction alone would not
// do: its locks end at its commit, before the publish. The other way is a
// written lease, a claimed_until column, which frees the connection during
// slow publishes but needs an expiry longer than any publish.) The price is a
// transaction that lasts as long as a batch takes to publish, so keep batches
// and broker timeouts small.
//
// What several relays give up is one global order: each publishes its own
// batch in id order, but batches of different relays interleave. And what no
// relay can give is order by commit: PostgreSQL hands out an id when a row is
// inserted, so a row with a smaller id can commit, and be published, after
// one with a larger id. The sent flag makes sure such a row is not lost; it
// does not make it go first. Delivery is at least once: a relay that dies
// after publishing and before its commit leaves the rows unsent, and they go
// again with the same ids.
//
// An OutboxRelay is safe for concurrent use by multiple goroutines, and any
// number of relays may run over one database: overlapping passes claim
// disjoint rows. Create one with [NewOutboxRelay]: the zero value has no
// database and no broker.
type OutboxRelay struct {
	db     *sql.DB
	broker outbox.MessageBroker

	// BatchSize is the most rows one pass claims and publishes; zero means
	// DefaultBatchSize. Set it before the first pass.
	BatchSize int
}

// NewOutboxRelay returns an OutboxRelay that publishes the outbox rows of db
// to broker, [DefaultBatchSize] rows a pass.
func NewOutboxRelay(db *sql.DB, broker outbox.MessageBroker) *OutboxRelay {
	return &OutboxRelay{db: db, broker: broker}
}

// PublishPending makes one pass: it claims up to BatchSize unsent rows,
// publishes them in id order, marks the ones the broker accepted sent in one
// statement, commits, and returns how many the broker accepted.
//
// At the first message the broker refuses, PublishPending stops publishing,
// still marks and commits the messages before it, and returns the broker's
// error wrapped with the message id, so that errors.Is(err,
// [outbox.ErrBrokerUnavailable]) works. That message and all after it stay
// unsent for the next pass. A row marked sent is never published again.
//
// If ctx is cancelled during a pass, PublishPending publishes nothing more,
// and database/sql rolls the pass back: nothing is marked, and the messages
// this pass published go again on a later pass, as after a crash. If the mark
// or the commit fails, the error says so, and the count is still what the
// broker accepted.
func (r *OutboxRelay) PublishPending(ctx context.Context) (int, error) {
	batch := r.BatchSize
	if batch <= 0 {
		batch = DefaultBatchSize
	}
	tx, err := r.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback() // after a commit this does nothing; otherwise it frees the claim

	msgs, err := claim(ctx, tx, batch)
	if err != nil {
		return 0, err
	}

	var sent []int64
	var publishErr error
	for _, msg := range msgs {
		if publishErr = ctx.Err(); publishErr != nil {
			break
		}
		if err := r.broker.Publish(msg); err != nil {
			publishErr = fmt.Errorf("publish message %d: %w", msg.ID, err)
			break
		}
		sent = append(sent, msg.ID)
	}

	if len(sent) > 0 {
		if _, err := tx.ExecContext(ctx, markSent, sent); err != nil {
			return len(sent), fmt.Errorf("mark %d published messages sent: %w", len(sent), err)
		}
	}
	if err := tx.Commit(); err != nil {
		return len(sent), fmt.Errorf("commit relay pass: %w", err)
	}
	return len(sent), publishErr
}

func claim(ctx context.Context, tx *sql.Tx, batch int) ([]outbox.Message, error) {
	rows, err := tx.QueryContext(ctx, claimRows, batch)
	if err != nil {
		return nil, fmt.Errorf("claim outbox rows: %w", err)
	}
	defer rows.Close()
	var msgs []outbox.Message
	for rows.Next() {
		var m outbox.Message
		if err := rows.Scan(&m.ID, &m.Type, &m.Payload); err != nil {
			return nil, fmt.Errorf("claim outbox rows: %w", err)
		}
		msgs = append(msgs, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim outbox rows: %w", err)
	}
	return msgs, nil
}
