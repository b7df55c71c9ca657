package postgres

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"example.com/patterns/enterprise/outbox"
)

// DefaultBatchSize is how many rows a relay pass claims when
// [OutboxRelay.BatchSize] is zero.
const DefaultBatchSize = 100

// DefaultPassTimeout is a relay pass's time budget when
// [OutboxRelay.PassTimeout] is zero.
const DefaultPassTimeout = 5 * time.Second

// ClaimCheckInterval is how often, at most, a relay pass asks the server
// whether its transaction is still alive while it publishes. A pass whose
// session was lost (killed, timed out, cut off) goes on publishing for at
// most this long before it notices and stops, and through a
// [BatchPublisher], which is asked before each batch, for at most this long
// plus one batch.
const ClaimCheckInterval = 100 * time.Millisecond

// ErrClaimLost is returned, wrapped, by [OutboxRelay.PublishPending] when a
// pass finds in the middle of publishing that its transaction is gone, and
// with it the locks that were its claim: another relay may already be
// publishing the same rows.
var ErrClaimLost = errors.New("postgres: relay pass lost its claim")

// passLimits is the first step of every claim: before the claim reads a
// row, it makes the server enforce the pass's budget on this transaction
// alone (set_config with true is SET LOCAL). From the claim on, no statement
// and no lock wait may last longer than $2 ms, and no pause between
// statements longer than $3 ms, after which the server ends the session and
// frees the rows. The claim itself runs under the session's own limits and
// the pass's context. An uncorrelated subquery in WHERE is run once, as the
// plan's first step, whether or not any row matches ("One-Time Filter" in
// EXPLAIN). A statement of its own would do the same for one round trip
// more a pass: 16% of a pass of one row, measured.
//
// It also turns off sequential scans for the rest of the pass, whose
// statements find their rows by primary key. The driver prepares
// statements, and after five runs the server may keep one generic plan for
// any arguments, until the table is next analyzed. For the mark, planned
// while the outbox was small, that plan was a sequential scan, and it stayed
// one while the table grew: measured, a drain of 20,000 rows in passes of
// 100 took 74 to 94 µs a message with it, 21 µs without. (Planning the mark
// afresh each pass, plan_cache_mode = force_custom_plan, fixes it too, but
// made a pass of one row slower, measured.)
const passLimits = `(SELECT set_config('statement_timeout', $2, true)
       || set_config('lock_timeout', $2, true)
       || set_config('idle_in_transaction_session_timeout', $3, true)
       || set_config('enable_seqscan', 'off', true)) IS NOT NULL`

// claimRows takes up to $1 rows still to publish (not sent, not parked),
// lowest id first, and locks them for the rest of the transaction. SKIP
// LOCKED passes over rows that another relay's open transaction holds, so
// relays running at the same time claim disjoint rows instead of waiting for
// each other. Rows of transactions that have not committed are not seen at
// all.
const claimRows = `
SELECT id, message_key, type, payload, COALESCE(aggregate, ''), COALESCE(seq, 0), rejections
FROM outbox
WHERE sent_at IS NULL AND parked_at IS NULL
  AND ` + passLimits + `
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`

// claimFirstOfEachAggregate is claimRows for a relay with PerAggregate: it
// takes only the rows that are the lowest unsent id of their aggregate,
// whether the rows before them are parked, held by another relay or not. So
// a row is claimed only once every earlier row of its aggregate was accepted
// by the broker and marked, and a pass holds at most one row of each
// aggregate. Rows with no aggregate are taken as claimRows takes them. The
// correlated subquery is run for each candidate through
// outbox_unsent_by_aggregate; the same test written as NOT EXISTS let the
// planner scan that whole index for each candidate (18 ms against 1.2 ms a
// claim, measured on 1,000 rows without statistics).
const claimFirstOfEachAggregate = `
SELECT id, message_key, type, payload, COALESCE(aggregate, ''), COALESCE(seq, 0), rejections
FROM outbox o
WHERE sent_at IS NULL AND parked_at IS NULL
  AND (aggregate IS NULL
       OR id = (SELECT min(e.id) FROM outbox e WHERE e.aggregate = o.aggregate AND e.sent_at IS NULL))
  AND ` + passLimits + `
ORDER BY id
LIMIT $1
FOR UPDATE OF o SKIP LOCKED`

// markSent marks, in one statement, the rows the broker accepted.
// clock_timestamp() is the time of the mark, just after the broker accepted
// the last of them; now() would be the pass's start, before any publish.
const markSent = `UPDATE outbox SET sent_at = clock_timestamp() WHERE id = ANY($1)`

// recordFailure counts a failed publish of row $1 with its error $3, as a
// rejection too if $2 is 1, and parks the row if $4.
const recordFailure = `
UPDATE outbox
SET attempts = attempts + 1, rejections = rejections + $2, last_error = $3,
    parked_at = CASE WHEN $4 THEN clock_timestamp() END
WHERE id = $1`

// OutboxRelay moves messages from the outbox table to the broker. It knows
// nothing about orders: it publishes rows.
//
// Each pass is one READ COMMITTED transaction that claims a batch of unsent
// rows with SELECT ... FOR UPDATE SKIP LOCKED and stays open while it
// publishes them and marks them sent. Holding the transaction is the claim:
// no other relay sees the rows while the pass's session lives, and when the
// session ends PostgreSQL rolls the pass back and the rows are free again.
// (A short claiming transaction alone would not do: its locks end at its
// commit, before the publish. The other way is a written lease, a
// claimed_until column, which frees the connection during slow publishes but
// needs an expiry longer than any publish.)
//
// The connection is a lease only while its socket closes when the relay
// dies. If the relay's host vanishes or the network splits, nothing closes
// it, and the server would keep the rows until TCP keepalive gives up (two
// hours and more by default). So every pass has a time budget, PassTimeout,
// and sets the server's limits for its own transaction from it: statements
// and lock waits of at most the budget, and at most twice the budget idle
// between statements, after which the server ends the session. A vanished
// relay's rows are free again at most three times the budget after its last
// statement after the claim began (the claim itself, which sets the limits,
// waits for no row, only for a schema change's lock on the table). A long
// pass also holds back vacuum on the whole server, since its transaction has
// an id; the budget bounds that too.
//
// What several relays give up is one global order: each publishes its own
// batch in id order, but batches of different relays interleave
// (PerAggregate keeps the order of each aggregate instead). Nor is id
// order commit order on PostgreSQL: the trap test,
// TestRowCommittedAfterAHigherIDIsSentLateNotLost, shows a row sent late, not
// lost. Delivery is at least once: a relay that dies after publishing and
// before its commit leaves the rows unsent, and they go again with the same
// ids.
//
// An OutboxRelay is safe for concurrent use by multiple goroutines, and any
// number of relays may run over one database: overlapping passes claim
// disjoint rows. Create one with [NewOutboxRelay]: the zero value has no
// database and no broker.
type OutboxRelay struct {
	db     *sql.DB
	broker MessageBroker

	// BatchSize is the most rows one pass claims and publishes; zero or less
	// means DefaultBatchSize. Set it before the first pass.
	BatchSize int

	// PassTimeout is a pass's time budget for publishing; zero or less means
	// DefaultPassTimeout. The pass's statements, its mark and its commit get
	// as long again, so a pass ends at most twice PassTimeout after it
	// began. Set it before the first pass, longer than the broker's slowest
	// publish of a batch.
	PassTimeout time.Duration

	// ParkAfter is how many rejections (broker errors wrapping ErrRejected)
	// set a row aside, parked: it is no longer published and no longer holds
	// back the rows after it, which go on in the same pass. Zero or less
	// keeps the article's relay: a message the broker refuses for ever
	// blocks every message after it, and the order of all of them is kept.
	// Parking gives up that message's place in the order: if it is put back
	// (Unpark), it is published after messages that were written after it.
	// Errors that do not wrap ErrRejected, a broker that is down among them,
	// never park a row. ReadLag counts the parked rows; ListParked lists them.
	ParkAfter int

	// PerAggregate makes the relay keep order per aggregate instead of over
	// the whole table (see [Message.Aggregate]). A pass then claims only the
	// rows whose earlier rows of the same aggregate the broker accepted
	// already, so a message being retried, or held by another relay, is
	// never overtaken by a later one of its aggregate, however many relays
	// run. A message the broker refuses holds back its aggregate alone: the
	// pass goes on with the other aggregates' rows (it stops only when the
	// broker is unavailable), and reports the refusals in its error. A
	// parked row, too, holds back the rest of its aggregate until Unpark.
	//
	// Without it the relay keeps the article's order: the whole table in id
	// order for one relay, stopping at the first refusal. That is right for
	// one relay, and for events whose order between aggregates matters too.
	// With several relays, whose batches interleave, or when one stuck
	// message must not stop every other, PerAggregate is the one that keeps
	// an order a consumer can rely on. Its price: an aggregate's next event
	// waits for a pass after the one before it was marked, and each claimed
	// row costs one index lookup more (BenchmarkDeliverOrdered found no
	// difference in drain rate on a shop's rows).
	PerAggregate bool

	// PollInterval, MaxBackoff, PollOnly and Logger configure Run: how long
	// it waits for a notification before it passes anyway, the longest it
	// waits after failed passes, whether it only polls, and where it logs
	// failed passes and parked messages (nil: nowhere).
	PollInterval time.Duration
	MaxBackoff   time.Duration
	PollOnly     bool
	Logger       *slog.Logger

	// wait is how Run waits, and mark the statement that marks: seams for
	// the tests and benchmarks; nil and "" are sleep and markSent.
	wait func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool
	mark string
}

// NewOutboxRelay returns an OutboxRelay that publishes the outbox rows of db
// to broker, [DefaultBatchSize] rows a pass. Wrap a broker whose Publish
// takes no context, such as [outbox.InMemoryBroker], with [AdaptBroker].
func NewOutboxRelay(db *sql.DB, broker MessageBroker) *OutboxRelay {
	return &OutboxRelay{db: db, broker: broker}
}

// PublishPending makes one pass: it claims up to BatchSize unsent rows,
// publishes them in id order, marks the ones the broker accepted sent in one
// statement, commits, and returns how many the broker accepted. Nothing the
// broker did not accept is marked.
//
// At the first message the broker refuses, PublishPending stops publishing,
// still marks and commits the messages before it, and returns the broker's
// error wrapped with the message id, so that errors.Is(err,
// [outbox.ErrBrokerUnavailable]) works. That message and all after it stay
// unsent for the next pass. The pass writes the failure to the row
// (attempts, rejections, last_error) in its own transaction, which commits
// even when nothing was sent; a row rejected ParkAfter times is parked
// instead, and the pass goes on with the rows after it.
//
// Through a [BatchPublisher] the pass publishes its whole batch in one call,
// and what follows the first message the broker did not accept in the same
// way as above, in a call of its own.
//
// A pass stops publishing when its budget (PassTimeout) runs out or ctx
// ends, and then still marks and commits what the broker accepted, under a
// context of its own that ctx's cancellation does not cut. A shutdown in the
// middle of a pass therefore sends again, later, at most the one message
// whose publish was in flight. When the budget runs out between publishes,
// the rest wait for the next pass and the error is nil; when ctx ends, the
// error wraps ctx's.
//
// A row marked sent is not published again by a relay that holds its claim.
// A relay whose session was lost can still publish what it claimed until it
// notices: it checks at most every [ClaimCheckInterval], and then stops with
// an error wrapping [ErrClaimLost]. That bounds the duplicates a lost claim
// makes; it cannot remove them, and consumers must drop them.
//
// If the mark or the commit fails, the error says so and keeps the cause of
// the stop too (errors.Is finds each); the count is still what the broker
// accepted, and those messages go again. An error from the commit may wrap
// [ErrCommitUnknown]: the marks may or may not have been kept.
func (r *OutboxRelay) PublishPending(ctx context.Context) (int, error) {
	res, err := r.pass(ctx)
	return res.published, err
}

// passResult is what a pass did, for Run.
type passResult struct {
	published int     // accepted by the broker
	claimed   int     // rows the pass claimed
	full      bool    // it claimed a whole batch
	parked    []int64 // ids of the rows it parked
}

// pass is PublishPending, reporting more.
func (r *OutboxRelay) pass(ctx context.Context) (res passResult, err error) {
	batch := orDefault(r.BatchSize, DefaultBatchSize)
	budget := orDefault(r.PassTimeout, DefaultPassTimeout)

	// Publishing stops at the budget or when the caller's ctx ends. The
	// transaction lives under a context that the caller cannot cancel, so
	// that what the broker accepted can still be marked, and that ends at
	// twice the budget whatever happens.
	pubCtx, cancelPub := context.WithTimeout(ctx, budget)
	defer cancelPub()
	txCtx, cancelTx := context.WithTimeout(context.WithoutCancel(ctx), 2*budget)
	defer cancelTx()

	tx, err := r.db.BeginTx(txCtx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return res, fmt.Errorf("begin relay pass: %w", err)
	}
	defer tx.Rollback() // after a commit this does nothing; otherwise it frees the claim

	query := claimRows
	if r.PerAggregate {
		query = claimFirstOfEachAggregate
	}
	msgs, err := claim(txCtx, tx, query, batch, millis(budget), millis(2*budget))
	if err != nil {
		return res, err
	}
	res.claimed, res.full = len(msgs), len(msgs) == batch

	var sent []int64
	var failed []failure
	var stop error      // why publishing stopped before the end of the batch, if it matters
	var refused []error // with PerAggregate, the refusals the pass went on after
	checked := time.Now()
	for i := 0; i < len(msgs); {
		if pubCtx.Err() != nil {
			if err := ctx.Err(); err != nil {
				stop = fmt.Errorf("relay pass stopped: %w", err)
			} // else the budget ran out: the rest wait for the next pass
			break
		}
		if time.Since(checked) >= ClaimCheckInterval {
			if _, err := tx.ExecContext(txCtx, `SELECT 1`); err != nil {
				stop = fmt.Errorf("%w after %d published messages: %w", ErrClaimLost, len(sent), err)
				break
			}
			checked = time.Now()
		}
		n, err := r.publish(pubCtx, msgs[i:])
		for _, msg := range msgs[i : i+n] {
			sent = append(sent, msg.ID)
		}
		if i += n; err == nil {
			continue
		}
		msg := msgs[i]           // the message the broker did not accept
		if pubCtx.Err() == nil { // the broker's own failure, not the end of the pass
			f := failure{id: msg.ID, err: err, rejected: errors.Is(err, ErrRejected)}
			f.park = f.rejected && r.ParkAfter > 0 && msg.rejections+1 >= r.ParkAfter
			failed = append(failed, f)
			if f.park {
				res.parked = append(res.parked, msg.ID)
				i++
				continue // set aside: the rows after it go on
			}
			if r.PerAggregate && !errors.Is(err, outbox.ErrBrokerUnavailable) {
				// It holds back its aggregate alone, and this pass holds no
				// other row of that aggregate.
				refused = append(refused, fmt.Errorf("publish message %d: %w", msg.ID, err))
				i++
				continue
			}
		}
		stop = fmt.Errorf("publish message %d: %w", msg.ID, err)
		break
	}
	res.published = len(sent)

	if len(sent) > 0 {
		mark := markSent
		if r.mark != "" {
			mark = r.mark
		}
		if _, err := tx.ExecContext(txCtx, mark, sent); err != nil {
			return res, errors.Join(stop, fmt.Errorf("mark %d published messages sent: %w", len(sent), err))
		}
	}
	for _, f := range failed {
		if _, err := tx.ExecContext(txCtx, recordFailure, f.id, b2i(f.rejected), f.err.Error(), f.park); err != nil {
			return res, errors.Join(stop, fmt.Errorf("record the failure of message %d: %w", f.id, err))
		}
	}
	if err := commit(tx); err != nil {
		return res, errors.Join(stop, errors.Join(refused...), fmt.Errorf("relay pass: %w", err))
	}
	if len(refused) > 0 {
		return res, errors.Join(stop, errors.Join(refused...))
	}
	return res, stop
}

// publish publishes msgs from the first, all of them through a
// BatchPublisher, only the first through any other broker, and returns how
// many the broker accepted and, if it did not accept them all, the error of
// the first it did not accept.
func (r *OutboxRelay) publish(ctx context.Context, msgs []claimed) (int, error) {
	bp, ok := r.broker.(BatchPublisher)
	if !ok {
		if err := r.broker.Publish(ctx, msgs[0].Message); err != nil {
			return 0, err
		}
		return 1, nil
	}
	batch := make([]Message, len(msgs))
	for i, m := range msgs {
		batch[i] = m.Message
	}
	n, err := bp.PublishBatch(ctx, batch)
	switch {
	case n < 0 || n > len(msgs):
		return 0, fmt.Errorf("broker says it accepted %d of %d messages", n, len(msgs))
	case n < len(msgs) && err == nil:
		err = fmt.Errorf("broker accepted %d of %d messages and gave no error for the next", n, len(msgs))
	case n == len(msgs):
		err = nil
	}
	return n, err
}

// claimed is a claimed row: its message, and how often the broker rejected
// it before.
type claimed struct {
	Message
	rejections int
}

// failure is a failed publish, to be written to its row.
type failure struct {
	id             int64
	err            error
	rejected, park bool
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// orDefault is v, or def where v is zero or less: how every field and
// argument of this package that says "zero or less means the default" reads.
func orDefault[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

// millis is d in whole milliseconds, at least 1, as the server's timeout
// settings take it (0 would turn the timeout off).
func millis(d time.Duration) string {
	return strconv.FormatInt(max(1, int64((d+time.Millisecond-1)/time.Millisecond)), 10)
}

func claim(ctx context.Context, tx *sql.Tx, query string, batch int, limit, idle string) ([]claimed, error) {
	rows, err := tx.QueryContext(ctx, query, batch, limit, idle)
	if err != nil {
		return nil, fmt.Errorf("claim outbox rows: %w", err)
	}
	defer rows.Close()
	var msgs []claimed
	for rows.Next() {
		var m claimed
		if err := rows.Scan(&m.ID, &m.Key, &m.Type, &m.Payload, &m.Aggregate, &m.Seq, &m.rejections); err != nil {
			return nil, fmt.Errorf("claim outbox rows: %w", err)
		}
		msgs = append(msgs, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim outbox rows: %w", err)
	}
	return msgs, nil
}
