package postgres

import (
	"context"
	"database/sql"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pglogrepl"
)

// marks is how a log relay session marks the rows it delivered sent
// (LogRelay.MarkIn): in a goroutine, so that the stream never waits for a
// write; one mark at a time, each of every row delivered since the one
// before began. A mark runs before the server hears of the rows it marks:
// what the slot has confirmed is marked (or its mark failed and was
// logged), so that a crash between the two never leaves a delivered row
// counted as unsent for ever. Used by the session's goroutine only.
type marks struct {
	db      *sql.DB
	timeout time.Duration
	logger  *slog.Logger
	report  func(PassReport) // LogRelay.OnPass, or nil

	pending   map[string][]int64 // delivered and not yet being marked, by table
	pendingTo pglogrepl.LSN      // the end of the last transaction in pending
	busy      bool               // a mark is being written
	done      chan markResult    // where it ends
	markedTo  pglogrepl.LSN      // every row delivered before it has been marked
}

// markResult is what one mark did: up to which position, how many rows.
type markResult struct {
	upTo   pglogrepl.LSN
	marked int
	err    error
}

func newMarks(r *LogRelay) *marks {
	return &marks{db: r.MarkIn, timeout: orDefault(r.PublishTimeout, DefaultPassTimeout), logger: r.Logger,
		report: r.OnPass, pending: map[string][]int64{}, done: make(chan markResult, 1)}
}

// delivered notes a transaction delivered whole, its rows by table, up to
// its end, and starts a mark if none is being written.
func (m *marks) delivered(ctx context.Context, tables []string, ids []int64, end pglogrepl.LSN) {
	for i, id := range ids {
		m.pending[tables[i]] = append(m.pending[tables[i]], id)
	}
	m.pendingTo = end
	m.start(ctx)
}

// start hands what is pending to a goroutine that marks it, unless a mark
// is being written or nothing is pending.
func (m *marks) start(ctx context.Context) {
	if m.busy || len(m.pending) == 0 {
		return
	}
	rows, upTo := m.pending, m.pendingTo
	m.pending, m.busy = map[string][]int64{}, true
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.timeout)
	go func() {
		defer cancel()
		n, err := m.write(mctx, rows)
		m.done <- markResult{upTo: upTo, marked: n, err: err}
	}()
}

// poll takes the result of a mark that ended, if one did, and starts the
// next. It never waits.
func (m *marks) poll(ctx context.Context) {
	select {
	case res := <-m.done:
		m.ended(res)
		m.start(ctx)
	default:
	}
}

// finish, as the session ends, waits for the mark being written and marks
// what is still pending.
func (m *marks) finish(ctx context.Context) {
	if m.busy {
		m.ended(<-m.done)
	}
	if len(m.pending) > 0 {
		mctx, cancel := context.WithTimeout(ctx, m.timeout)
		defer cancel()
		n, err := m.write(mctx, m.pending)
		m.ended(markResult{upTo: m.pendingTo, marked: n, err: err})
		m.pending = map[string][]int64{}
	}
}

func (m *marks) ended(res markResult) {
	m.busy, m.markedTo = false, res.upTo
	if m.report != nil {
		m.report(PassReport{Marked: res.marked, Err: res.err})
	}
}

// idle reports whether every row delivered has been marked.
func (m *marks) idle() bool { return !m.busy && len(m.pending) == 0 }

// write marks rows sent, one statement a table, and logs a failure. A row
// parked meanwhile, or marked already, is left as it is.
func (m *marks) write(ctx context.Context, rows map[string][]int64) (int, error) {
	marked, failed := 0, []error(nil)
	for table, ids := range rows {
		res, err := m.db.ExecContext(ctx, `UPDATE `+table+` SET sent_at = clock_timestamp()
			WHERE id = ANY($1) AND sent_at IS NULL AND parked_at IS NULL`, ids)
		if err != nil {
			failed = append(failed, err)
			if m.logger != nil {
				m.logger.Error("outbox: log relay could not mark delivered rows sent; they stay counted as unsent",
					"table", table, "rows", len(ids), "err", err)
			}
			continue
		}
		n, _ := res.RowsAffected()
		marked += int(n)
	}
	return marked, errors.Join(failed...)
}
