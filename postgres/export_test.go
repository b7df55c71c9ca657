package postgres

import (
	"context"
	"database/sql"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgxpool"
)

// This file is compiled only into the package's tests. It lets them reach
// one unexported seam without adding API that callers could see.

// ClaimQuery is the relay's claim with its batch size and the default
// budget's limits written in, for EXPLAIN.
var ClaimQuery = strings.NewReplacer(
	batchSize, strconv.Itoa(DefaultBatchSize),
	passLimit, "'"+millis(DefaultPassTimeout)+"'",
	passIdle, "'"+millis(2*DefaultPassTimeout)+"'",
).Replace(claimRows)

// ClaimRunsQuery is ClaimQuery for a relay with PerAggregate.
var ClaimRunsQuery = strings.NewReplacer(
	batchSize, strconv.Itoa(DefaultBatchSize),
	passLimit, "'"+millis(DefaultPassTimeout)+"'",
	passIdle, "'"+millis(2*DefaultPassTimeout)+"'",
).Replace(claimRuns)

// FlushWALPgx is the flush a pass on a pgx pool makes the server do, on one
// of p's connections.
func FlushWALPgx(ctx context.Context, p *pgxpool.Pool) error { return pgxPool{p}.exec(ctx, flushWAL) }

// SetRunWait makes Run wait through f instead of sleeping.
func SetRunWait(r *OutboxRelay, f func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool) {
	r.wait = f
}

// Backoff is backoff.
var Backoff = backoff

// SetMark makes the relay's passes mark with query, given the accepted ids
// as $1, for a benchmark of another design.
func SetMark(r *OutboxRelay, query string) { r.mark = query }

// SetListenWait makes Run's listener wait through f, before it listens
// again after its connection failed, instead of sleeping.
func SetListenWait(r *OutboxRelay, f func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool) {
	r.listenWait = f
}

// MarkSent is the relay's mark, for a benchmark of the same statements
// outside database/sql.
const MarkSent = markSent

// SetMigrationLockWait makes Migrate wait d for another migrator, and
// returns a function that puts the default back.
func SetMigrationLockWait(d time.Duration) (restore func()) {
	migrationLockWait = d
	return func() { migrationLockWait = MigrationLockWait }
}

// DeleteSentQuery is one batch of DeleteSent, for EXPLAIN.
const DeleteSentQuery = deleteSent

// Marks is the log relay's marking of what it delivered, for the tests to
// drive one mark at a time.
type Marks struct{ m *marks }

// NewMarks returns the marks a LogRelay marking in db makes.
func NewMarks(db *sql.DB, timeout time.Duration, logger *slog.Logger, report func(PassReport)) *Marks {
	return &Marks{newMarks(&LogRelay{markIn: db, cfg: LogRelayConfig{PublishTimeout: timeout, Logger: logger, OnPass: report}})}
}

// Delivered notes rows of table delivered up to end, starting a mark.
func (m *Marks) Delivered(ctx context.Context, table string, ids []int64, end uint64) {
	tables := make([]string, len(ids))
	for i := range tables {
		tables[i] = table
	}
	m.m.delivered(ctx, tables, ids, pglogrepl.LSN(end))
}

// Retry lets the next mark start now, past its backoff, and starts it.
func (m *Marks) Retry(ctx context.Context) {
	m.m.notBefore = time.Time{}
	m.m.start(ctx)
}

// Wait waits for the mark being written, if one is, and takes its result.
func (m *Marks) Wait() {
	if m.m.busy {
		m.m.ended(<-m.m.done)
	}
}

// MarkedTo is the position up to which every row delivered is marked.
func (m *Marks) MarkedTo() uint64 { return uint64(m.m.markedTo) }

// Idle reports whether every row delivered is marked (or given up on).
func (m *Marks) Idle() bool { return m.m.idle() }
