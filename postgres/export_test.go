package postgres

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
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

// LogMarkQuery is the log relay's mark of rows of the outbox sent: $1 the
// ids.
var LogMarkQuery = fmt.Sprintf(logMark, "outbox")

// LogDeleteQuery is the mark of a log relay with DeleteDelivered: $1 the
// ids, $2 their transactions' xids.
var LogDeleteQuery = fmt.Sprintf(logDelete, "outbox", "outbox_cleanup")

// FullXidQuery is the 64-bit xid of the 32-bit xid $2 below the xmax $1.
var FullXidQuery = "SELECT " + fullXid("$1::bigint", "$2::bigint")

// FlushWALPgx is the flush a pass on a pgx pool makes the server do, on one
// of p's connections.
func FlushWALPgx(ctx context.Context, p *pgxpool.Pool) error { return pgxPool{p}.exec(ctx, flushWAL) }

// SetRunWait makes Run wait through f instead of sleeping.
func SetRunWait(r *OutboxRelay, f func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool) {
	r.wait = f
}

// Backoff is backoff.
var Backoff = backoff

// CommitError reads a commit's error as Commit does.
var CommitError = commitError

// SetMark makes the relay's passes mark with query, given the accepted ids
// as $1, for a benchmark of another design.
func SetMark(r *OutboxRelay, query string) { r.mark = query }

// SetLogRelaySent has f called with each transaction's commit time and the
// time the server sent it to r, both by the server's clock.
func SetLogRelaySent(r *LogRelay, f func(commit, sent time.Time)) { r.sent = f }

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
	return &Marks{newMarks(&LogRelay{cfg: LogRelayConfig{PublishTimeout: timeout, Logger: logger, OnPass: report}}, db)}
}

// Delivered notes rows of table delivered up to end, starting a mark.
func (m *Marks) Delivered(ctx context.Context, table string, ids []int64, end uint64) {
	m.DeliveredBy(ctx, table, ids, 0, end)
}

// NewDeletingMarks returns the marks of a LogRelay with DeleteDelivered.
func NewDeletingMarks(db *sql.DB, timeout time.Duration, logger *slog.Logger, report func(PassReport)) *Marks {
	return &Marks{newMarks(&LogRelay{cfg: LogRelayConfig{PublishTimeout: timeout, Logger: logger, OnPass: report, DeleteDelivered: true}}, db)}
}

// DeliveredBy notes rows of table written by the transaction xid (its 32
// bits, as pgoutput's BEGIN carries it) delivered up to end, starting a
// mark.
func (m *Marks) DeliveredBy(ctx context.Context, table string, ids []int64, xid uint32, end uint64) {
	tables, keys := make([]string, len(ids)), make([]string, len(ids))
	for i, id := range ids {
		tables[i] = table
		_ = id // the key is not known here (""): the mark matches the row by its id alone
	}
	m.m.delivered(ctx, tables, ids, keys, xid, pglogrepl.LSN(end))
}

// DeliveredWithKeys notes rows of table delivered up to end with the keys
// the log carried, starting a mark.
func (m *Marks) DeliveredWithKeys(ctx context.Context, table string, ids []int64, keys []string, end uint64) {
	tables := make([]string, len(ids))
	for i := range tables {
		tables[i] = table
	}
	m.m.delivered(ctx, tables, ids, keys, 0, pglogrepl.LSN(end))
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

// The package's tests were written against the table outbox of a *sql.DB
// before there was an Outbox; these are the Outbox's methods on it, in the
// old calls' shapes, so that the tests read as they did. Callers have the
// methods only.

// Executor is what InsertOutbox needs of a transaction.
type Executor interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// executor is an Executor as a rowQuerier.
type executor struct{ tx Executor }

func (e executor) queryRow(ctx context.Context, query string, args ...any) rowScanner {
	return e.tx.QueryRowContext(ctx, query, args...)
}

// InsertOutbox is Outbox.Write of an event with no aggregate, on the table
// outbox.
func InsertOutbox(ctx context.Context, tx Executor, eventType string, payload any) (int64, error) {
	return defaultTables.insert(ctx, executor{tx}, Event{Type: eventType, Payload: payload})
}

// InsertOutboxFor is Outbox.Write of an event of aggregate.
func InsertOutboxFor(ctx context.Context, tx Executor, aggregate string, seq int64, eventType string, payload any) (int64, error) {
	if aggregate == "" {
		return 0, fmt.Errorf("%w: seq %d of no aggregate", ErrInvalidSeq, seq)
	}
	return defaultTables.insert(ctx, executor{tx}, Event{Type: eventType, Payload: payload, Aggregate: aggregate, Seq: seq})
}

// Migrate is Outbox.Migrate on the table outbox of db.
func Migrate(ctx context.Context, db *sql.DB) error { return sqlOutbox(db, 0).Migrate(ctx) }

// CheckSchema is Outbox.CheckSchema on the table outbox of db.
func CheckSchema(ctx context.Context, db *sql.DB) error { return sqlOutbox(db, 0).CheckSchema(ctx) }

// ReadLag is Outbox.ReadLag of the table outbox of db.
func ReadLag(ctx context.Context, db *sql.DB) (Lag, error) { return sqlOutbox(db, 0).ReadLag(ctx) }

// ListParked is Outbox.ListParked of the table outbox of db.
func ListParked(ctx context.Context, db *sql.DB, limit int) ([]ParkedMessage, error) {
	return sqlOutbox(db, 0).ListParked(ctx, limit)
}

// Unpark is Outbox.Unpark in the table outbox of db.
func Unpark(ctx context.Context, db *sql.DB, id int64) error { return sqlOutbox(db, 0).Unpark(ctx, id) }

// ForgetProcessed is Outbox.ForgetProcessed on db, batchSize rows a
// transaction.
func ForgetProcessed(ctx context.Context, db *sql.DB, retention time.Duration, batchSize int) (int64, error) {
	return sqlOutbox(db, max(batchSize, 0)).ForgetProcessed(ctx, retention)
}

// ApplyOnce is Outbox.ApplyOnce on db.
func ApplyOnce(ctx context.Context, db *sql.DB, msg Message, last bool, apply func(ctx context.Context, tx *sql.Tx) error) (bool, error) {
	return sqlOutbox(db, 0).ApplyOnce(ctx, msg, ApplyOptions{Last: last}, func(ctx context.Context, tx SQLTx) error {
		return apply(ctx, tx.(*sql.Tx))
	})
}

// NewOutboxRelay is Outbox.NewRelay on the table outbox of db.
func NewOutboxRelay(db *sql.DB, broker MessageBroker, cfg RelayConfig) (*OutboxRelay, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: no database", ErrInvalidConfig)
	}
	return sqlOutbox(db, 0).NewRelay(broker, cfg)
}

// CreateLogSlot is Outbox.CreateLogSlot on db.
func CreateLogSlot(ctx context.Context, db *sql.DB, slot string) error {
	return createLogSlot(ctx, db, slot)
}

// DropLogSlot is Outbox.DropLogSlot on db.
func DropLogSlot(ctx context.Context, db *sql.DB, slot string) error {
	return dropLogSlot(ctx, db, slot)
}

// BeginOn begins a relay pass's transaction on conn and runs f in it, as
// each try of a pass does: again reports whether the pass would try once
// more on another connection.
func BeginOn(ctx context.Context, conn *pgx.Conn, f func() error, retry bool) (again bool, err error) {
	return beginOn(ctx, conn, func(txn) error { return f() }, retry)
}

// TryBegin is a pass's loop of tries, each on a connection of its own.
func TryBegin(try func(retry bool) (again bool, err error)) error { return tryBegin(try) }

// BeginTries is how many tries a pass makes at most.
const BeginTries = beginTries

// SetAwake is what Run says to the producers: whether a relay is awake.
func (r *OutboxRelay) SetAwake(ctx context.Context, awake bool) error { return r.setAwake(ctx, awake) }
