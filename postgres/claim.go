package postgres

// A pass's claim: the statements that claim, check and mark the rows, and
// the functions that run them.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// passLimits is the first step of every claim: before the claim reads a
// row, it makes the server enforce the pass's budget on this transaction
// alone (set_config with true is SET LOCAL). From the claim on, no statement
// and no lock wait may last longer than passLimit ms, and no pause between
// statements longer than passIdle ms, after which the server ends the
// session and frees the rows. The claim itself runs under the session's own
// limits and the pass's context. An uncorrelated subquery in WHERE is run
// once, as the plan's first step, whether or not any row matches
// ("One-Time Filter" in EXPLAIN). A statement of its own would do the same for one round trip
// more a pass, which costs a pass of one row dearly.
//
// It also turns off sequential scans for the rest of the pass, whose
// statements find their rows by primary key. The driver prepares
// statements, and after five runs the server may keep one generic plan for
// any arguments, until the table is next analyzed. For the mark, planned
// while the outbox was small, that plan was a sequential scan, and it stayed
// one while the table grew: measured, a drain of 20,000 rows in passes of
// 100 took several times as long a message with it as without. (Planning
// the mark afresh each pass, plan_cache_mode = force_custom_plan, fixes it
// too, but made a pass of one row slower, measured.)
//
// And it notes where the server's write-ahead log stands as the claim
// begins, for walPositions to read: see there.
const passLimits = `(SELECT set_config('statement_timeout', ` + passLimit + `, true)
       || set_config('lock_timeout', ` + passLimit + `, true)
       || set_config('idle_in_transaction_session_timeout', ` + passIdle + `, true)
       || set_config('enable_seqscan', 'off', true)
       || set_config('outbox.wal_flushed', (pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn())::text, true)
       || set_config('outbox.wal_inserted', pg_current_wal_insert_lsn()::text, true)) IS NOT NULL`

// walPositions are the claim's last two columns, noted by passLimits as the
// claim begins: whether the server had flushed its write-ahead log as far as
// it had written it, and how far it had written it. A commit is written to
// the log before other sessions can see it, and the claim's snapshot is
// taken before passLimits runs, so that position is past the commit of
// every row the claim returns; once the log is flushed that far, those
// commits survive a crash of the server. (Noted before the claim reads a
// row, the position leaves out what the claim itself writes to the log: its
// row locks, and the pruning of pages its scan visits.) Producers that
// commit with synchronous_commit = off make their rows visible before their
// commit is flushed: see [OutboxRelay] on what the relay does about it.
const walPositions = `current_setting('outbox.wal_flushed')::boolean AS wal_flushed, current_setting('outbox.wal_inserted') AS wal_inserted`

// walFlushed says whether the server has flushed its log up to $1.
const walFlushed = `SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn`

// flushWAL makes the server flush its log as far as it has written it. A
// synchronous commit flushes the log up to its commit record, which lies
// after every record written before it (and, with synchronous standbys,
// waits for them to confirm as much); but only a transaction that wrote to
// the log commits that way, and taking a transaction id writes nothing. So
// it writes the smallest record there is, a logical decoding message, with
// the prefix outbox.flush (a reader of the log, with wal_level = logical,
// sees it and may skip it). Any role may call pg_logical_emit_message. One
// round trip, with no arguments, so the driver sends it as one simple query.
const flushWAL = `BEGIN;
SET LOCAL synchronous_commit = on;
SELECT pg_logical_emit_message(true, 'outbox.flush', '');
COMMIT`

// batchSize stands for the pass's batch size in a claim: written in as a
// number before the claim is sent, not passed as a parameter. The server
// keeps one generic plan of a prepared statement after five runs, and
// with LIMIT $1 that plan cannot know the limit: it sized the hash tables
// of an earlier claimRuns, which checked the runs in the same statement,
// for a large part of the table. Measured on 100,000 rows of one
// aggregate, that claim ran in 20 ms with LIMIT $1 and 0.4 ms with LIMIT 100.
const batchSize = "$batch"

// passLimit and passIdle stand for the pass's limits in passLimits, in
// milliseconds: written in as quoted numbers too, so that a claim has no
// parameter at all. The server plans a prepared statement without
// parameters once per connection and keeps that plan; with parameters it
// plans each of its first five runs afresh, and goes on doing so while the
// generic plan's estimate exceeds theirs, which it did for claimRuns while
// the outbox grew: measured, 12 of 51 passes planned it (0.4 to 0.8 ms
// each, against 0.15 for claimRows), where the statements' plans were the
// same for any limits.
const (
	passLimit = "$limit"
	passIdle  = "$idle"
)

// releaseDue begins each claim: it releases up to a batch of scheduled rows
// whose time to deliver has come (migration 7), lowest deliver_at first,
// by clearing their deliver_at. A data-modifying WITH runs to its end
// whether or not the query reads it, and its changes are not seen by the
// query's own snapshot: the claim does not take the rows it releases. They
// are the next pass's, in their place by id, and the trigger outbox_released
// notifies the relays when this pass commits (an empty pass commits too).
// SKIP LOCKED passes over a row that another relay is releasing. It finds
// the due rows through outbox_scheduled, by time, which is empty while
// nothing is scheduled: one lookup a pass. (While both are empty the server
// may plan it on outbox_held, which holds the scheduled rows too, as
// cheaply; a connection's plan kept from then is made again when
// autovacuum analyzes the table.) Being an UPDATE, it makes the claim take
// ROW EXCLUSIVE on the table, as the producers' inserts and the mark do,
// where a SELECT ... FOR UPDATE alone takes ROW SHARE: a session that holds
// SHARE (a plain CREATE INDEX) holds up the claim, not only the mark, until
// the pass's context ends it (twice the budget), and nothing is published
// meanwhile, nor republished.
const releaseDue = `
WITH released AS (
    UPDATE outbox SET deliver_at = NULL
    WHERE id IN (SELECT id FROM outbox WHERE sent_at IS NULL AND deliver_at <= now()
                 ORDER BY deliver_at LIMIT ` + batchSize + ` FOR UPDATE SKIP LOCKED))`

// claimRows takes up to batchSize rows still to publish (not sent, not
// parked, not scheduled for later), lowest id first, and locks them for the
// rest of the transaction. SKIP LOCKED passes over rows that another
// relay's open transaction holds, so relays running at the same time claim
// disjoint rows instead of waiting for each other. Rows of transactions
// that have not committed are not seen at all.
const claimRows = releaseDue + `
SELECT id, message_key, type, ` + bodyColumns + `, created_at, COALESCE(aggregate, ''), COALESCE(seq, 0), rejections,
       COALESCE(traceparent, ''), COALESCE(tracestate, ''), ` + walPositions + `
FROM outbox
WHERE sent_at IS NULL AND parked_at IS NULL AND deliver_at IS NULL
  AND ` + passLimits + `
ORDER BY id
LIMIT ` + batchSize + `
FOR UPDATE SKIP LOCKED`

// claimRuns is claimRows for a relay with order per aggregate: it does not
// claim a row when an earlier row of its aggregate is held back
// (outbox_held: parked, failed to publish, or scheduled for later), so that
// the rows of a stuck aggregate do not fill the batch of every pass.
// Whether any row is held is asked once (an InitPlan), and only if one is,
// of each row. Nor does it claim a row
// whose retry_at (migration 6) is still to come: a failed publish's
// backoff. Such a row is among the few that failed, all in outbox_held, so
// it costs the claim no more than a held row does.
//
// The broker may take an aggregate's claimed rows in their order only if
// they are a run from its first unsent row: its first k unsent rows, for
// the k claimed. They are unless the claim passed over an unsent row, one
// held by another relay (SKIP LOCKED passed over it) or held back; so the
// claim also returns, in every row, how many unsent rows its snapshot held
// up to the batch size and the id of the last of them, as the text "n id"
// (one InitPlan, a walk of at most a batch of outbox_unsent). If the claim
// took that many rows and its last is that id, it took exactly those rows
// and passed over none; otherwise the pass asks checkRuns which
// aggregates' rows are not a run, and leaves them as they are. So the claim
// sends its rows as it locks them: the claim before this one decided in the
// same statement, and gathered and sorted its rows to do so (measured, six
// drains of 10,000 one-row aggregates each way, interleaved: the median
// rate 7% higher without it).
//
// Its cost is bounded by the batch: the walk of outbox_unsent reads the
// rows it claims and those it passes over (locked by other relays, or
// behind a held row), one lookup in outbox_held each while a row is held,
// and the InitPlan reads a batch's entries again; checkRuns, when it runs,
// reads in outbox_unsent_by_aggregate as many rows of each aggregate as
// were claimed. It no longer depends on how many rows an aggregate has
// waiting, as the claim before these did (it took one row of each
// aggregate, and walked past an aggregate's whole backlog to do so: 9 ms a
// pass with 1,000 rows of one aggregate, 188 ms with 50,000).
const claimRuns = releaseDue + `
SELECT id, message_key, type, ` + bodyColumns + `, created_at, COALESCE(aggregate, ''), COALESCE(seq, 0), rejections,
       COALESCE(traceparent, ''), COALESCE(tracestate, ''), ` + walPositions + `,
       (SELECT count(*) || ' ' || COALESCE(max(id), 0)
        FROM (SELECT id FROM outbox WHERE sent_at IS NULL AND parked_at IS NULL AND deliver_at IS NULL
              ORDER BY id LIMIT ` + batchSize + `) f) AS unsent_head
FROM outbox o
WHERE sent_at IS NULL AND parked_at IS NULL AND deliver_at IS NULL
  AND (aggregate IS NULL
       OR (SELECT NOT EXISTS (SELECT FROM outbox WHERE aggregate IS NOT NULL
                              AND sent_at IS NULL AND (parked_at IS NOT NULL OR attempts > 0 OR deliver_at IS NOT NULL)))
       OR NOT EXISTS (
           SELECT FROM outbox h
           WHERE h.aggregate = o.aggregate AND h.id < o.id
             AND h.sent_at IS NULL AND (h.parked_at IS NOT NULL OR h.attempts > 0 OR h.deliver_at IS NOT NULL)))
  AND (retry_at IS NULL OR retry_at <= now())
  AND ` + passLimits + `
ORDER BY id
LIMIT ` + batchSize + `
FOR UPDATE OF o SKIP LOCKED`

// checkRuns returns, of the aggregates of the claimed rows $1 (ids) and $2
// (their aggregates), those whose claimed rows are not their first unsent
// rows: whose last claimed row is not the aggregate's k-th unsent, for the
// k claimed. Its snapshot is later than the claim's, which can only hold
// back more: rows another relay marked sent since are no longer in the
// way, and rows that committed since, below the claimed ids, are.
const checkRuns = `
SELECT r.aggregate
FROM (SELECT aggregate, count(*) AS n, max(id) AS last
      FROM unnest($1::bigint[], $2::text[]) AS c(id, aggregate)
      GROUP BY aggregate) r
WHERE r.last IS DISTINCT FROM (
      SELECT e.id FROM outbox e WHERE e.aggregate = r.aggregate AND e.sent_at IS NULL
      ORDER BY e.id OFFSET r.n - 1 LIMIT 1)`

// markSent marks, in one statement, the rows the broker accepted.
// clock_timestamp() is the time of the mark, just after the broker accepted
// the last of them; now() would be the pass's start, before any publish.
const markSent = `UPDATE outbox SET sent_at = clock_timestamp() WHERE id = ANY($1)`

// recordFailure counts a failed publish of row $1 with its error $3, as a
// rejection too if $2 is 1, parks the row if $4, and returns its attempts.
// If $5, it sets the row's next attempt (retry_at) after the failure by $6
// ms doubled for each failure before this one, at most $7 ms, and of that a
// random point in the upper half, as Run's own backoff; otherwise it clears
// it. (attempts on the right of SET is the count before this failure.)
const recordFailure = `
UPDATE outbox
SET attempts = attempts + 1, rejections = rejections + $2, last_error = $3,
    parked_at = CASE WHEN $4 THEN clock_timestamp() END,
    retry_at = CASE WHEN $5 THEN clock_timestamp() + interval '1 millisecond' *
        least($6::float8 * power(2::float8, least(attempts, 40)), $7::float8) * (0.5 + random() / 2) END
WHERE id = $1
RETURNING attempts`

// walPosition is what a claim read of the server's write-ahead log.
type walPosition struct {
	flushed  bool   // flushed as far as written, as the claim began
	inserted string // how far written then, a pg_lsn such as 0/1A2B3C4
}

// unsentHead is what claimRuns read of the first unsent rows as it began:
// how many, up to the batch size, and the id of the last of them.
type unsentHead struct{ n, last int64 }

// passedOver says whether a claim that began with head and claimed msgs,
// in id order, passed over an unsent row: unless it claimed as many rows
// as head counts and its last is head's, it did.
func (head unsentHead) passedOver(msgs []claimed) bool {
	return int64(len(msgs)) != head.n || len(msgs) > 0 && msgs[len(msgs)-1].ID != head.last
}

// claim runs query, claimRows or claimRuns, with the batch size and the
// limits (in milliseconds, as millis gives them) written in, and returns
// the rows it claimed, the log's position it noted, and, for claimRuns
// (perAggregate), the unsent head.
func claim(ctx context.Context, tx txn, query string, batch int, limit, idle string, perAggregate bool) ([]claimed, walPosition, unsentHead, error) {
	var wal walPosition
	var head unsentHead
	query = strings.ReplaceAll(strings.ReplaceAll(strings.ReplaceAll(query,
		batchSize, strconv.Itoa(batch)), passLimit, "'"+limit+"'"), passIdle, "'"+idle+"'")
	rows, err := tx.query(ctx, query)
	if err != nil {
		return nil, wal, head, fmt.Errorf("claim outbox rows: %w", err)
	}
	defer rows.Close()
	// Each row is scanned into m, then copied into msgs: every column is
	// written each time (strings, numbers), so nothing of the row before is
	// left in m, and one set of destinations serves every row.
	var m claimed
	var traceparent, tracestate, headText string
	var body rowBody
	dest := append(append([]any{&m.ID, &m.Key, &m.Type}, body.dest()...), &m.Time, &m.Aggregate, &m.Seq, &m.rejections,
		&traceparent, &tracestate, &wal.flushed, &wal.inserted) // the WAL's the same in every row
	if perAggregate {
		dest = append(dest, &headText) // and so is the head
	}
	var msgs []claimed
	for rows.Next() {
		if msgs == nil { // one allocation for a default batch, none for an empty claim
			msgs = make([]claimed, 0, min(batch, DefaultBatchSize))
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, wal, head, fmt.Errorf("claim outbox rows: %w", err)
		}
		if perAggregate && len(msgs) == 0 {
			if _, err := fmt.Sscan(headText, &head.n, &head.last); err != nil {
				return nil, wal, head, fmt.Errorf("claim outbox rows: the unsent head %q: %w", headText, err)
			}
		}
		m.TraceContext = claimedTraceContext(traceparent, tracestate)
		if err := body.setOn(&m.Message); err != nil {
			return nil, wal, head, fmt.Errorf("claim outbox rows: row %d: %w", m.ID, err)
		}
		msgs = append(msgs, m)
	}
	if err := rows.Err(); err != nil {
		return nil, wal, head, fmt.Errorf("claim outbox rows: %w", err)
	}
	return msgs, wal, head, nil
}

// runsOnly is msgs without the rows of the aggregates whose claimed rows
// are not a run from their first unsent row, as checkRuns finds them.
func (r *OutboxRelay) runsOnly(ctx context.Context, tx txn, msgs []claimed) ([]claimed, error) {
	var ids []int64
	var aggregates []string
	for _, m := range msgs {
		if m.Aggregate != "" {
			ids, aggregates = append(ids, m.ID), append(aggregates, m.Aggregate)
		}
	}
	if len(ids) == 0 {
		return msgs, nil
	}
	rows, err := tx.query(ctx, r.outbox.sql.checkRuns, ids, aggregates)
	if err != nil {
		return nil, fmt.Errorf("check the claimed runs: %w", err)
	}
	defer rows.Close()
	notRuns := map[string]bool{}
	for rows.Next() {
		var aggregate string
		if err := rows.Scan(&aggregate); err != nil {
			return nil, fmt.Errorf("check the claimed runs: %w", err)
		}
		notRuns[aggregate] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("check the claimed runs: %w", err)
	}
	if len(notRuns) == 0 {
		return msgs, nil
	}
	var runs []claimed
	for _, m := range msgs {
		if !notRuns[m.Aggregate] {
			runs = append(runs, m)
		}
	}
	return runs, nil
}
