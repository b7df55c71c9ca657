package postgres

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
)

// ErrNotMarked is reported (LogRelay.OnPass, in PassReport.Err) for rows
// the log relay delivered and then could not find to mark sent, after
// MarkRetries marks over some seconds: deleted, or in a table the relay's
// its marks do not see. They stay counted as unsent, and the slot moves
// past them all the same, so that one missing row does not hold the log
// for ever.
var ErrNotMarked = errors.New("postgres: delivered rows not found to mark sent")

// MarkRetries is how many marks in a row may miss a delivered row before
// the log relay gives up on it (ErrNotMarked). A row the log carried can
// be invisible to other sessions for a moment after its commit (the
// server writes the commit to the log before it makes it visible), so a
// mark that finds fewer rows than it was given tries the rest again.
const MarkRetries = 10

// markBackoff is how long the marks wait after the first mark that fell
// short before the next one starts, doubling with each such mark up to
// maxMarkBackoff.
const (
	markBackoff    = 50 * time.Millisecond
	maxMarkBackoff = 5 * time.Second
)

// marks is how a log relay session marks the rows it delivered sent
// (unless LogRelayConfig.Unmarked): in a goroutine, so that the stream never waits for a
// write; one mark at a time, each of every row delivered since the one
// before began, and of the rows the one before could not mark. A mark runs
// before the server hears of the rows it marks: the slot is told of a
// position only once every row delivered before it is marked (or, not
// found after MarkRetries marks, given up on and logged), so that neither
// a crash nor a mark that failed or matched fewer rows than it was given
// ever leaves a delivered row counted as unsent for ever. Used by the
// session's goroutine only.
type marks struct {
	db      *sql.DB
	timeout time.Duration
	logger  *slog.Logger
	report  func(PassReport) // LogRelay.OnPass, or nil

	del       bool                 // LogRelayConfig.DeleteDelivered: a mark deletes its rows
	pending   map[string][]markRow // delivered and not yet being marked, by table
	pendingTo pglogrepl.LSN        // the end of the last transaction in pending
	busy      bool                 // a mark is being written
	done      chan markResult      // where it ends
	markedTo  pglogrepl.LSN        // every row delivered before it has been marked

	short     int            // marks in a row that fell short: their rows wait in pending
	notBefore time.Time      // no mark starts before it, after one that fell short
	missed    map[rowRef]int // rows not found, by how many marks in a row missed them
	now       func() time.Time
}

// markRow is a delivered row to mark: its id and key, and the transaction
// that wrote it (pgoutput's xid), by which a mark that deletes tells a row
// gone from one not visible yet. A mark finds the row by its id, and marks
// it only if the key is the one delivered: after a failover to a standby
// that lacked the row, another row may hold its id, which the marks must
// not take for it.
type markRow struct {
	id  int64
	xid uint32
	key string
}

// rowRef names a row of an outbox table.
type rowRef struct {
	table string
	id    int64
}

// markResult is what one mark did: up to which position, how many rows,
// and which it could not mark.
type markResult struct {
	upTo     pglogrepl.LSN
	marked   int
	unseen   map[string][]markRow // rows the mark's snapshot did not hold: not visible yet, or (unless it deletes) gone
	replaced []rowRef             // rows whose id another row, of another key, holds: lost with a failover
	failed   map[string][]markRow // rows whose statement failed
	err      error
}

func newMarks(r *LogRelay, db *sql.DB) *marks {
	return &marks{db: db, timeout: orDefault(r.cfg.PublishTimeout, DefaultPassTimeout), logger: r.cfg.Logger,
		del: r.cfg.DeleteDelivered, report: r.cfg.OnPass, pending: map[string][]markRow{}, done: make(chan markResult, 1),
		missed: map[rowRef]int{}, now: time.Now}
}

// delivered notes rows delivered, by table, with their keys, all written
// by the transaction xid, and starts a mark if none is being written: a transaction's last,
// up to its end, or, with end 0, a part of a transaction still being read,
// which moves no position.
func (m *marks) delivered(ctx context.Context, tables []string, ids []int64, keys []string, xid uint32, end pglogrepl.LSN) {
	for i, id := range ids {
		m.pending[tables[i]] = append(m.pending[tables[i]], markRow{id, xid, keys[i]})
	}
	if end != 0 {
		m.pendingTo = end
	}
	m.start(ctx)
}

// start hands what is pending to a goroutine that marks it, unless a mark
// is being written, nothing is pending, or the backoff after a mark that
// fell short has not passed.
func (m *marks) start(ctx context.Context) {
	if m.busy || len(m.pending) == 0 || m.now().Before(m.notBefore) {
		return
	}
	rows, upTo := m.pending, m.pendingTo
	m.pending, m.busy = map[string][]markRow{}, true
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.timeout)
	go func() {
		defer cancel()
		m.done <- m.write(mctx, rows, upTo)
	}()
}

// poll takes the result of a mark that ended, if one did, and starts the
// next. It never waits.
func (m *marks) poll(ctx context.Context) {
	select {
	case res := <-m.done:
		m.ended(res)
	default:
	}
	m.start(ctx)
}

// finish, as the session ends, waits for the mark being written and marks
// what is still pending, trying again after each mark that fell short, for
// at most the marks' timeout in all. What is left then is marked by a later
// session, which the server sends the same transactions again.
func (m *marks) finish(ctx context.Context) {
	if m.busy {
		m.ended(<-m.done)
	}
	fctx, cancel := context.WithTimeout(ctx, m.timeout)
	defer cancel()
	for len(m.pending) > 0 && fctx.Err() == nil {
		if wait := m.notBefore.Sub(m.now()); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-t.C:
			case <-fctx.Done():
				t.Stop()
				return
			}
		}
		rows := m.pending
		m.pending = map[string][]markRow{}
		m.ended(m.write(fctx, rows, m.pendingTo))
	}
}

// ended takes a mark's result: the position moves on if every row up to it
// is marked (or given up on); otherwise the rows it could not mark wait in
// pending, for the next mark, after a backoff.
func (m *marks) ended(res markResult) {
	m.busy = false
	missedAgain := map[rowRef]int{}
	var gaveUp []rowRef
	for table, rows := range res.unseen {
		keep := rows[:0]
		for _, row := range rows {
			ref := rowRef{table, row.id}
			if n := m.missed[ref] + 1; n >= MarkRetries {
				gaveUp = append(gaveUp, ref)
			} else {
				missedAgain[ref] = n
				keep = append(keep, row)
			}
		}
		if len(keep) > 0 {
			m.pending[table] = append(keep, m.pending[table]...)
		}
	}
	m.missed = missedAgain
	for table, rows := range res.failed {
		m.pending[table] = append(append([]markRow(nil), rows...), m.pending[table]...)
	}
	err := res.err
	if len(res.replaced) > 0 {
		lost := fmt.Errorf("%d rows (%s) delivered and not in the database, another row holding each id: %w",
			len(res.replaced), refsText(res.replaced), ErrNotMarked)
		err = errors.Join(err, lost)
		if m.logger != nil {
			m.logger.Warn("outbox: log relay delivered rows the database no longer has: another row, of another key, holds each id, as after a failover to a standby that lacked them; their events went out for changes that were lost, and the rows holding the ids are left unmarked",
				"rows", len(res.replaced), "ids", refsText(res.replaced))
		}
	}
	if len(gaveUp) > 0 {
		gone := fmt.Errorf("%d rows (%s) not found after %d marks: %w", len(gaveUp), refsText(gaveUp), MarkRetries, ErrNotMarked)
		err = errors.Join(err, gone)
		if m.logger != nil {
			m.logger.Error("outbox: log relay gave up marking delivered rows it cannot find; they stay counted as unsent",
				"rows", len(gaveUp), "ids", refsText(gaveUp), "err", gone)
		}
	}
	if len(missedAgain) == 0 && len(res.failed) == 0 {
		m.markedTo, m.short, m.notBefore = res.upTo, 0, time.Time{}
	} else {
		m.short++
		m.pendingTo = max(m.pendingTo, res.upTo)
		m.notBefore = m.now().Add(min(markBackoff<<min(m.short-1, 16), maxMarkBackoff))
		if m.logger != nil && len(missedAgain) > 0 {
			m.logger.Debug("outbox: log relay's mark found fewer rows than it delivered; trying again",
				"missing", len(missedAgain), "marks", m.short)
		}
	}
	if m.report != nil {
		m.report(PassReport{Marked: res.marked, Err: err})
	}
}

// refsText is up to ten rows' table and id, for a log line.
func refsText(refs []rowRef) string {
	var b strings.Builder
	for i, ref := range refs {
		if i == 10 {
			fmt.Fprintf(&b, " and %d more", len(refs)-i)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s %d", ref.table, ref.id)
	}
	return b.String()
}

// idle reports whether every row delivered has been marked.
func (m *marks) idle() bool { return !m.busy && len(m.pending) == 0 }

// logMark marks the rows $1 of a table sent, each if its key is the one
// of $2 (in the same order) delivered, or $2's is empty (a test's, which
// does not know it), and returns how many it marked and, as text
// ("1,2"), the ids its snapshot did not hold (rows not visible yet, or
// gone) and the ids another row holds, of another key (a row lost with a
// failover, its id handed out again). A row parked meanwhile, or marked
// already, is in the snapshot and left as it is. The main query sees the table as the
// UPDATE found it, before its changes.
//
// The check that a row is still unsent is written so that it matches no
// partial index of unsent rows (sent_at IS NULL ...): the server finds the
// rows by their ids. A plan made while the statistics said that next to no
// row is unsent, as they do of an outbox whose relay keeps up, scanned such
// an index whole instead, and before a vacuum it holds an entry for every
// row written since the last, sent or not (TestLogMarkFindsItsRowsByID).
const logMark = `
WITH marked AS (
	UPDATE %[1]s t SET sent_at = clock_timestamp()
	WHERE id = ANY($1) AND coalesce(sent_at, parked_at) IS NULL
	  AND EXISTS (SELECT FROM unnest($1::bigint[], $2::text[]) AS u(id, k)
	              WHERE u.id = t.id AND (u.k = '' OR u.k = t.message_key::text))
	RETURNING id)
SELECT (SELECT count(*) FROM marked),
       array_to_string(ARRAY(SELECT u.id FROM unnest($1::bigint[]) AS u(id)
                             WHERE NOT EXISTS (SELECT FROM %[1]s t WHERE t.id = u.id)), ','),
       array_to_string(ARRAY(SELECT u.id FROM unnest($1::bigint[], $2::text[]) AS u(id, k)
                             WHERE u.k <> '' AND EXISTS (SELECT FROM %[1]s t WHERE t.id = u.id AND t.message_key::text <> u.k)), ',')`

// logDelete is logMark for a relay that deletes what it delivered
// (LogRelayConfig.DeleteDelivered): it deletes the rows $1 of a table that
// are still unsent and whose keys are the ones of $3 delivered, and
// returns how many it deleted and, as text, the ids its snapshot did not
// hold whose transactions ($2, pgoutput's xids, in the same order as $1)
// it does not see either (rows not visible yet), and those another row
// holds, of another key, as logMark does. A
// row missing though its transaction is visible is gone, which for this
// relay is done: deleted by one of its marks before (the server sends a
// transaction again after a restart if its position was not confirmed),
// or by anyone. A row parked meanwhile, or sent already, is left as it
// is. An xid is 32 bits; its snapshot's is 64 (fullXid). The newest
// created_at it deleted moves the table's record of what cleanup cut (%[2]s,
// migration 10), as DeleteSent's does, for Replay.
var logDelete = `
WITH deleted AS (
	DELETE FROM %[1]s t
	WHERE id = ANY($1) AND coalesce(sent_at, parked_at) IS NULL
	  AND EXISTS (SELECT FROM unnest($1::bigint[], $3::text[]) AS u(id, k)
	              WHERE u.id = t.id AND (u.k = '' OR u.k = t.message_key::text))
	RETURNING id, created_at),
cut AS (
	UPDATE %[2]s SET deleted_through = d.t
	FROM (SELECT max(created_at) AS t FROM deleted) d
	WHERE d.t > deleted_through),
snap AS (SELECT s, pg_snapshot_xmax(s)::text::bigint AS xmax FROM pg_current_snapshot() AS s)
SELECT (SELECT count(*) FROM deleted),
       array_to_string(ARRAY(SELECT u.id FROM unnest($1::bigint[], $2::bigint[]) AS u(id, xid), snap
                             WHERE NOT EXISTS (SELECT FROM %[1]s t WHERE t.id = u.id)
                               AND NOT pg_visible_in_snapshot(` + fullXid("snap.xmax", "u.xid") + `::text::xid8, snap.s)), ','),
       array_to_string(ARRAY(SELECT u.id FROM unnest($1::bigint[], $3::text[]) AS u(id, k)
                             WHERE u.k <> '' AND EXISTS (SELECT FROM %[1]s t WHERE t.id = u.id AND t.message_key::text <> u.k)), ',')`

// cleanupOf is the record of what cleanup cut (migration 10's
// <table>_cleanup) of table, an SQL identifier: as pgx.Identifier's
// Sanitize writes it, each part quoted, or a plain name.
func cleanupOf(table string) string {
	if t, quoted := strings.CutSuffix(table, `"`); quoted {
		return t + `_cleanup"`
	}
	return table + "_cleanup"
}

// fullXid is SQL for the 64-bit transaction id whose low 32 bits are xid
// (a bigint expression: a 32-bit xid, as pgoutput's BEGIN carries it), the
// latest one below xmax (a bigint expression: a snapshot's xmax), which a
// transaction that committed before the snapshot was taken is: in xmax's
// epoch, or in the one before if its low bits are above xmax's.
func fullXid(xmax, xid string) string {
	return "(" + xmax + " - ((" + xmax + " - " + xid + ") & 4294967295))"
}

// write marks rows sent (or deletes them), one statement a table, and logs
// a failure.
func (m *marks) write(ctx context.Context, rows map[string][]markRow, upTo pglogrepl.LSN) markResult {
	res := markResult{upTo: upTo}
	var failed []error
	for table, batch := range rows {
		ids, xids, keys := make([]int64, len(batch)), make([]int64, len(batch)), make([]string, len(batch))
		rowOf := make(map[int64]markRow, len(batch))
		for i, row := range batch {
			ids[i], xids[i], keys[i], rowOf[row.id] = row.id, int64(row.xid), row.key, row
		}
		var n int
		var unseen, replaced string
		var err error
		if m.del {
			err = m.db.QueryRowContext(ctx, fmt.Sprintf(logDelete, table, cleanupOf(table)), ids, xids, keys).Scan(&n, &unseen, &replaced)
		} else {
			err = m.db.QueryRowContext(ctx, fmt.Sprintf(logMark, table), ids, keys).Scan(&n, &unseen, &replaced)
		}
		if err == nil && unseen != "" {
			var missing []markRow
			for _, s := range strings.Split(unseen, ",") {
				id, perr := strconv.ParseInt(s, 10, 64)
				if perr != nil {
					err = fmt.Errorf("read the ids not found: %w", perr)
					break
				}
				missing = append(missing, rowOf[id])
			}
			if err == nil {
				if res.unseen == nil {
					res.unseen = map[string][]markRow{}
				}
				res.unseen[table] = missing
			}
		}
		if err == nil && replaced != "" {
			for _, s := range strings.Split(replaced, ",") {
				id, perr := strconv.ParseInt(s, 10, 64)
				if perr != nil {
					err = fmt.Errorf("read the ids another row holds: %w", perr)
					break
				}
				res.replaced = append(res.replaced, rowRef{table, id})
			}
		}
		if err != nil {
			failed = append(failed, err)
			if res.failed == nil {
				res.failed = map[string][]markRow{}
			}
			res.failed[table] = batch
			if m.logger != nil {
				m.logger.Error("outbox: log relay could not mark delivered rows sent; it tries again before the slot moves past them",
					"table", table, "rows", len(batch), "err", err)
			}
			continue
		}
		res.marked += n
	}
	res.err = errors.Join(failed...)
	return res
}
