package postgres

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// What running an outbox takes besides the relay: a gauge of how far it is
// behind, a cleanup of the rows it sent, and a way to look at the messages
// it parked and put them back.

// DefaultCleanupBatch is how many rows [Outbox.DeleteSent] and
// [Outbox.ForgetProcessed] delete in one transaction when
// [Config.CleanupBatch] is zero.
const DefaultCleanupBatch = 1000

// DefaultListLimit is how many parked messages [Outbox.ListParked] returns when its
// limit is zero or less.
const DefaultListLimit = 100

// ErrNotParked is returned by [Outbox.Unpark] for an id that names no parked row.
var ErrNotParked = errors.New("postgres: no parked outbox row with that id")

// Lag is how far the relays are behind, as [Outbox.ReadLag] measures it.
type Lag struct {
	// Unsent is how many rows wait to be published (not sent, not parked,
	// and not scheduled for a time still to come).
	Unsent int64
	// Oldest is how long the oldest of them has waited, from the start of
	// the transaction that wrote it, or from its time to deliver if it had
	// one; zero when none waits.
	Oldest time.Duration
	// Parked is how many rows are parked: set aside after too many
	// rejections, and published only once put back with Unpark.
	Parked int64
	// Failing is how many of the Unsent rows failed FailingAfter publishes
	// or more: messages that hold up the outbox, or their aggregates.
	Failing int64
	// Scheduled is how many rows wait for their time to deliver
	// (Event.DeliverAt), still to come: not lag.
	Scheduled int64
	// Blocking is the first row, by id, still to publish that failed to
	// publish at least once, nil if none: the row that holds up the
	// outbox, or its aggregate's rows behind it, with why.
	Blocking *BlockingRow
}

// A BlockingRow is an unsent row that failed to publish: [Lag.Blocking].
type BlockingRow struct {
	ID        int64
	Key       string
	Type      string
	Aggregate string // "" for none
	Attempts  int    // failed publishes, for any reason
	LastError string // the last failure's error
}

// readLag counts through the three partial indexes, and finds the first
// failing row in the first of them, so its cost follows the rows still
// waiting (and the dead entries vacuum has not yet removed), not
// the sent rows the table keeps. A scheduled row whose time has come, and
// that no pass has released yet, is lag from that time.
const readLag = `
WITH due AS (SELECT created_at, attempts FROM outbox
             WHERE sent_at IS NULL AND parked_at IS NULL AND deliver_at IS NULL
             UNION ALL
             SELECT deliver_at, attempts FROM outbox
             WHERE sent_at IS NULL AND parked_at IS NULL AND deliver_at <= clock_timestamp()),
d AS (SELECT count(*) AS unsent,
             COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8 AS oldest,
             count(*) FILTER (WHERE attempts >= $1) AS failing
      FROM due),
b AS (SELECT id, message_key::text AS k, type, COALESCE(aggregate, '') AS aggregate, attempts, COALESCE(last_error, '') AS last_error
      FROM outbox WHERE sent_at IS NULL AND parked_at IS NULL AND attempts > 0
      ORDER BY id LIMIT 1)
SELECT d.unsent, d.oldest,
       (SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL AND sent_at IS NULL),
       d.failing,
       (SELECT count(*) FROM outbox WHERE sent_at IS NULL AND deliver_at > clock_timestamp()),
       b.id, b.k, b.type, b.aggregate, b.attempts, b.last_error
FROM d LEFT JOIN b ON true`

// ReadLag measures the outbox in one query, for a gauge.
//
// Alert on Oldest, not on Unsent. A burst of writes makes Unsent large while
// the relays keep up, and a quiet service whose broker is down makes it small
// while nothing is delivered; but when delivery stops, for any reason (the
// broker down, every relay dead, a message that blocks the rest), Oldest
// grows without bound, and while it works Oldest stays below a relay's poll
// interval plus a pass. A threshold of a few poll intervals catches a stop
// whatever the traffic. Alert on any Parked row too: each is a message no
// consumer will see until someone looks at it; and on any Failing row, a
// message that may hold the others up.
func (o *Outbox[T]) ReadLag(ctx context.Context) (Lag, error) {
	if err := o.usable(); err != nil {
		return Lag{}, err
	}
	var lag Lag
	var seconds float64
	var id sql.NullInt64
	var key, typ, aggregate, lastError sql.NullString
	var attempts sql.NullInt32
	if err := o.db.queryRow(ctx, o.t.sql.readLag, FailingAfter).Scan(&lag.Unsent, &seconds, &lag.Parked, &lag.Failing, &lag.Scheduled,
		&id, &key, &typ, &aggregate, &attempts, &lastError); err != nil {
		return Lag{}, fmt.Errorf("read the lag of %s: %w", o.t.table, err)
	}
	lag.Oldest = time.Duration(seconds * float64(time.Second))
	if id.Valid {
		lag.Blocking = &BlockingRow{ID: id.Int64, Key: key.String, Type: typ.String, Aggregate: aggregate.String,
			Attempts: int(attempts.Int32), LastError: lastError.String}
	}
	return lag, nil
}

// deleteSent looks at the next $3 rows in id order after id $1, a window,
// and deletes those of them that were sent more than $2 microseconds ago.
// It says how many it deleted, the window's highest id and its size, and
// whether the window held a row written less than $2 ago: such a row cannot
// have been sent earlier, and the rows after it are mostly as young, so the
// cleanup stops there. Each batch reads one window of the primary key, so a
// cleanup reads the rows up to the first young one and one window more,
// whatever the table holds after it: with nothing to delete, one window. A
// row older than one before it (written by a transaction that began
// earlier) waits for the next cleanup that reaches it. The newest
// created_at it deleted moves outbox_cleanup's deleted_through, in the same
// statement, so that Replay knows what is gone.
const deleteSent = `
WITH cutoff AS (SELECT clock_timestamp() - $2 * interval '1 microsecond' AS t),
window_ AS (
    SELECT id, sent_at, created_at FROM outbox
    WHERE id > $1
    ORDER BY id
    LIMIT $3),
gone AS (
    DELETE FROM outbox
    WHERE id IN (SELECT id FROM window_, cutoff WHERE sent_at < cutoff.t)
    RETURNING id, created_at),
cut AS (
    UPDATE outbox_cleanup SET deleted_through = g.t
    FROM (SELECT max(created_at) AS t FROM gone) g
    WHERE g.t > deleted_through)
SELECT (SELECT count(*) FROM gone), COALESCE((SELECT max(id) FROM window_), 0), (SELECT count(*) FROM window_),
       COALESCE((SELECT bool_or(created_at >= cutoff.t) FROM window_, cutoff), false)`

// DeleteSent deletes the outbox's rows that were sent longer than
// retention ago, at most [Config.CleanupBatch] rows a transaction, each
// batch its own short transaction, walking the
// table in id order up to the rows written less than retention ago, and
// returns how many it deleted. It reads what it deletes and a batch more,
// however many younger rows follow. It never deletes a row that is not
// sent, and is safe to run beside relays, producers and another
// DeleteSent. A negative retention is refused.
//
// It records, with each batch, when the newest row it deleted was written
// (migration 10's <table>_cleanup): [Outbox.Replay] refuses a range that
// begins then or before, whatever rows of it the table still holds.
//
// Deleting a row does not free its id: the identity's sequence hands out
// larger ones. What consumers remember, though, is [Message.Key], which stays
// unique whatever happens to ids.
func (o *Outbox[T]) DeleteSent(ctx context.Context, retention time.Duration) (int64, error) {
	if err := o.usable(); err != nil {
		return 0, err
	}
	if retention < 0 {
		return 0, fmt.Errorf("postgres: DeleteSent: negative retention %v", retention)
	}
	batchSize := o.cleanupBatch
	var total, after int64
	for {
		var n, last, looked int64
		var young bool
		if err := o.db.queryRow(ctx, o.t.sql.deleteSent, after, retention.Microseconds(), batchSize).Scan(&n, &last, &looked, &young); err != nil {
			return total, fmt.Errorf("delete sent rows of %s: %w", o.t.table, err)
		}
		total += n
		if young || looked < int64(batchSize) {
			return total, nil
		}
		after = last
	}
}

// deleteInBatches runs query, which deletes up to $2 of consumer's ($3)
// rows older than $1 microseconds and returns how many, until it deletes
// fewer than a batch.
func deleteInBatches(ctx context.Context, db stmts, query string, retention time.Duration, batchSize int, consumer string) (int64, error) {
	if retention < 0 {
		return 0, fmt.Errorf("postgres: negative retention %v", retention)
	}
	var total int64
	for {
		var n int64
		if err := db.queryRow(ctx, query, retention.Microseconds(), batchSize, consumer).Scan(&n); err != nil {
			return total, fmt.Errorf("delete consumer records: %w", err)
		}
		total += n
		if n < int64(batchSize) {
			return total, nil
		}
	}
}

// ParkedMessage is a parked outbox row, as [Outbox.ListParked] returns it. Its Message
// carries the row's Aggregate and Seq: with order per aggregate (the
// default) a parked row holds back every later event of its
// aggregate until it is put back.
type ParkedMessage struct {
	Message
	Attempts   int       // failed publishes, for any reason
	Rejections int       // of which the broker refused for ever
	LastError  string    // the broker's last error
	ParkedAt   time.Time // when the relay set it aside
}

// listParked returns up to $1 parked rows, lowest id first.
const listParked = `
SELECT id, message_key, type, ` + bodyColumns + `, COALESCE(aggregate, ''), COALESCE(seq, 0),
       attempts, rejections, COALESCE(last_error, ''), parked_at
FROM outbox WHERE parked_at IS NOT NULL AND sent_at IS NULL ORDER BY id LIMIT $1`

// ListParked returns up to limit parked rows, lowest id first (zero or
// less means [DefaultListLimit]).
func (o *Outbox[T]) ListParked(ctx context.Context, limit int) ([]ParkedMessage, error) {
	if err := o.usable(); err != nil {
		return nil, err
	}
	limit = orDefault(limit, DefaultListLimit)
	rows, err := o.db.query(ctx, o.t.sql.listParked, limit)
	if err != nil {
		return nil, fmt.Errorf("list parked outbox rows: %w", err)
	}
	defer rows.Close()
	var parked []ParkedMessage
	for rows.Next() {
		var p ParkedMessage
		var body rowBody
		if err := rows.Scan(append(append([]any{&p.ID, &p.Key, &p.Type}, body.dest()...),
			&p.Aggregate, &p.Seq, &p.Attempts, &p.Rejections, &p.LastError, &p.ParkedAt)...); err != nil {
			return nil, fmt.Errorf("list parked outbox rows: %w", err)
		}
		if err := body.setOn(&p.Message); err != nil {
			return nil, fmt.Errorf("list parked outbox rows: row %d: %w", p.ID, err)
		}
		parked = append(parked, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list parked outbox rows: %w", err)
	}
	return parked, nil
}

// unpark puts the parked row $1 back.
const unpark = `UPDATE outbox SET parked_at = NULL, rejections = 0 WHERE id = $1 AND parked_at IS NOT NULL AND sent_at IS NULL`

// Unpark puts the parked row id back: its rejections start again from zero,
// and the next relay pass publishes it, after the rows that went on while it
// was parked. An id that names no parked row is refused with [ErrNotParked].
func (o *Outbox[T]) Unpark(ctx context.Context, id int64) error {
	if err := o.usable(); err != nil {
		return err
	}
	if n, err := o.db.execN(ctx, o.t.sql.unpark, id); err != nil {
		return fmt.Errorf("unpark outbox row %d: %w", id, err)
	} else if n == 0 {
		return fmt.Errorf("unpark outbox row %d: %w", id, ErrNotParked)
	}
	return nil
}

// dropParked deletes the parked row $1 and returns it.
const dropParked = `
DELETE FROM outbox WHERE id = $1 AND parked_at IS NOT NULL AND sent_at IS NULL
RETURNING id, message_key, type, ` + bodyColumns + `, COALESCE(aggregate, ''), COALESCE(seq, 0),
          attempts, rejections, COALESCE(last_error, ''), parked_at`

// DropParked deletes the parked row id, for good: a message that no consumer
// needs, or that a person has delivered by other means. It returns the row as
// it was, for the caller to log (its key, type and last error say what was
// dropped and why it had been parked). An id that names no parked row is
// refused with [ErrNotParked], and nothing is deleted. With order per aggregate
// (the default), the row's aggregate goes on with its next event,
// whose consumer, keeping the aggregate's order, will wait for the dropped one
// ([ErrOutOfOrder]) until its bound: drop only what ends its aggregate, or what
// its consumers can do without.
func (o *Outbox[T]) DropParked(ctx context.Context, id int64) (ParkedMessage, error) {
	if err := o.usable(); err != nil {
		return ParkedMessage{}, err
	}
	var p ParkedMessage
	var body rowBody
	err := o.db.queryRow(ctx, o.t.sql.dropParked, id).Scan(append(append([]any{&p.ID, &p.Key, &p.Type}, body.dest()...),
		&p.Aggregate, &p.Seq, &p.Attempts, &p.Rejections, &p.LastError, &p.ParkedAt)...)
	if err == nil {
		err = body.setOn(&p.Message) // the row is deleted whatever its headers
	}
	switch {
	case errors.Is(err, sql.ErrNoRows), errors.Is(err, pgx.ErrNoRows):
		return ParkedMessage{}, fmt.Errorf("drop row %d of %s: %w", id, o.t.table, ErrNotParked)
	case err != nil:
		return ParkedMessage{}, fmt.Errorf("drop row %d of %s: %w", id, o.t.table, err)
	}
	return p, nil
}

// Standbys says how many physical standbys stream from the primary o's
// pool reaches (its pg_stat_replication's, less the logical walsenders of
// log relays): what a relay with RelayConfig.StandbyCount waits for. The
// role needs pg_read_all_stats to see their state.
func (o *Outbox[T]) Standbys(ctx context.Context) (int, error) {
	if err := o.usable(); err != nil {
		return 0, err
	}
	var n int
	if err := o.db.queryRow(ctx, `SELECT count(*) FROM pg_stat_replication r WHERE state = 'streaming'
		AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical')`).Scan(&n); err != nil {
		return 0, fmt.Errorf("count the standbys: %w", err)
	}
	return n, nil
}
