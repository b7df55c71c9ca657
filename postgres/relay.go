package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// DefaultBatchSize is how many rows a relay pass claims, as
// [NewOutboxRelay] sets [OutboxRelay.BatchSize].
const DefaultBatchSize = 100

// DefaultPassTimeout is a relay pass's time budget, as [NewOutboxRelay]
// sets [OutboxRelay.PassTimeout].
const DefaultPassTimeout = 5 * time.Second

// ClaimCheckInterval is how often, at most, a relay pass asks the server
// whether its transaction is still alive while it publishes. A pass whose
// session was lost (killed, timed out, cut off) goes on publishing for at
// most this long before it notices and stops, and through a
// [BatchPublisher] or a [SequencePublisher], which is asked before each
// batch, for at most this long plus one batch.
const ClaimCheckInterval = 100 * time.Millisecond

// ErrClaimLost is returned, wrapped, by [OutboxRelay.PublishPending] when a
// pass finds in the middle of publishing that its transaction is gone, and
// with it the locks that were its claim: another relay may already be
// publishing the same rows.
var ErrClaimLost = errors.New("postgres: relay pass lost its claim")

// passLimits is the first step of every claim: before the claim reads a
// row, it makes the server enforce the pass's budget on this transaction
// alone (set_config with true is SET LOCAL). From the claim on, no statement
// and no lock wait may last longer than passLimit ms, and no pause between
// statements longer than passIdle ms, after which the server ends the
// session and frees the rows. The claim itself runs under the session's own
// limits and the pass's context. An uncorrelated subquery in WHERE is run
// once, as the plan's first step, whether or not any row matches
// ("One-Time Filter" in EXPLAIN). A statement of its own would do the same for one round trip
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

// claimRows takes up to batchSize rows still to publish (not sent, not parked),
// lowest id first, and locks them for the rest of the transaction. SKIP
// LOCKED passes over rows that another relay's open transaction holds, so
// relays running at the same time claim disjoint rows instead of waiting for
// each other. Rows of transactions that have not committed are not seen at
// all.
const claimRows = `
SELECT id, message_key, type, payload, COALESCE(aggregate, ''), COALESCE(seq, 0), rejections,
       COALESCE(traceparent, ''), COALESCE(tracestate, ''), ` + walPositions + `
FROM outbox
WHERE sent_at IS NULL AND parked_at IS NULL
  AND ` + passLimits + `
ORDER BY id
LIMIT ` + batchSize + `
FOR UPDATE SKIP LOCKED`

// claimRuns is claimRows for a relay with PerAggregate: it does not claim
// a row when an earlier row of its aggregate is held back (outbox_held:
// parked, or failed to publish), so that the rows of a stuck aggregate do
// not fill the batch of every pass. Whether any row is held is asked once
// (an InitPlan), and only if one is, of each row.
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
const claimRuns = `
SELECT id, message_key, type, payload, COALESCE(aggregate, ''), COALESCE(seq, 0), rejections,
       COALESCE(traceparent, ''), COALESCE(tracestate, ''), ` + walPositions + `,
       (SELECT count(*) || ' ' || COALESCE(max(id), 0)
        FROM (SELECT id FROM outbox WHERE sent_at IS NULL AND parked_at IS NULL ORDER BY id LIMIT ` + batchSize + `) f) AS unsent_head
FROM outbox o
WHERE sent_at IS NULL AND parked_at IS NULL
  AND (aggregate IS NULL
       OR (SELECT NOT EXISTS (SELECT FROM outbox WHERE aggregate IS NOT NULL
                              AND sent_at IS NULL AND (parked_at IS NOT NULL OR attempts > 0)))
       OR NOT EXISTS (
           SELECT FROM outbox h
           WHERE h.aggregate = o.aggregate AND h.id < o.id
             AND h.sent_at IS NULL AND (h.parked_at IS NOT NULL OR h.attempts > 0)))
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
const recordFailure = `
UPDATE outbox
SET attempts = attempts + 1, rejections = rejections + $2, last_error = $3,
    parked_at = CASE WHEN $4 THEN clock_timestamp() END
WHERE id = $1
RETURNING attempts`

// FailingAfter is how many failed publishes, for any reason, make an unsent
// row failing: a message that holds up the outbox, or its aggregate, pass
// after pass. [OutboxRelay.Run] logs it once, at level Warn, with its id,
// key and last error, when its attempts reach FailingAfter; [ReadLag]
// counts the failing rows in Lag.Failing.
const FailingAfter = 5

// OutboxRelay moves messages from the outbox table to the broker. It knows
// nothing of the producers' tables: it publishes rows.
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
// A pass publishes only what a crash of the server cannot take back. A
// producer that commits with synchronous_commit = off (or local, or
// remote_write, with a standby) makes its rows visible before its commit is
// flushed to the write-ahead log, and a crash in that moment erases the
// change and its row; a relay that had published the row's event would have
// told the consumers of a change that never was. So after its claim a pass
// makes sure, within its budget, that the server has flushed its log past
// every commit the claim could see (pg_current_wal_flush_lsn against the
// pg_current_wal_insert_lsn, read as the claim began). Where everything is
// flushed already it costs nothing but two function calls in the claim;
// otherwise it looks again, a few times in a few milliseconds, since with
// producers that commit synchronously what was not flushed is the log of
// transactions still open, which their commits flush a moment later; and
// only if the log is still not flushed makes the server flush, with a
// synchronous commit of a one-record transaction on a second connection of
// its pool, before it publishes: a pass may need two connections at once.
// With synchronous producers few passes flush ([PassReport].Flushed). With synchronous
// standbys that commit also waits for them. What it cannot see is an
// asynchronous standby: after a failover to one, the new primary may lack
// changes whose events were published, with this relay and with the dual
// write alike.
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
	db     pool // nil if none was given
	broker MessageBroker
	outbox *Outbox

	// BatchSize is the most rows one pass claims and publishes,
	// DefaultBatchSize unless set; it must be positive.
	BatchSize int

	// PassTimeout is a pass's time budget for publishing,
	// DefaultPassTimeout unless set; it must be positive. The pass's statements, its mark and its commit get
	// as long again, so a pass ends at most twice PassTimeout after it
	// began; a stop before the claim returns (one waiting for a lock) ends
	// the pass at once. Set it before the first pass, longer than the
	// broker's slowest publish of a batch.
	PassTimeout time.Duration

	// ParkAfter is how many rejections (broker errors wrapping ErrRejected)
	// set a row aside, parked: it is no longer published and no longer holds
	// back the rows after it, which go on in the same pass. Zero keeps the
	// article's relay: a message the broker refuses for ever
	// blocks every message after it, and the order of all of them is kept.
	// Parking gives up that message's place in the order: if it is put back
	// (Unpark), it is published after messages that were written after it.
	// Errors that do not wrap ErrRejected, a broker that is down among them,
	// never park a row. ReadLag counts the parked rows; ListParked lists
	// them. NewOutboxRelay sets DefaultParkAfter.
	ParkAfter int

	// PerAggregate makes the relay keep order per aggregate instead of over
	// the whole table (see [Message.Aggregate]). A pass then publishes an
	// aggregate's rows only as a run from its first unsent row, so a
	// message being retried, or held by another relay, is never overtaken
	// by a later one of its aggregate, however many relays run; a hot
	// aggregate's backlog goes a batch a pass, like the whole table's. It
	// hands a [BatchPublisher] the rows of its batch that hold no aggregate
	// twice at once, and a [SequencePublisher] the whole batch when an
	// aggregate is in it twice. A message the
	// broker refuses holds back its aggregate alone: the pass goes on with
	// the other aggregates' rows (it stops only when the broker is
	// unavailable), and reports the refusals in its error; later passes
	// leave that aggregate's later rows unclaimed until it is published. A parked row,
	// too, holds back the rest of its aggregate until Unpark.
	//
	// NewOutboxRelay sets it. Without it the relay keeps the article's
	// order: the whole table in id
	// order for one relay, stopping at the first refusal, and publishing
	// one message at a time (a batch a pass to a [SequencePublisher]). That is right for one relay, and for events
	// whose order between aggregates matters too.
	// With several relays, whose batches interleave, or when one stuck
	// message must not stop every other, PerAggregate is the one that keeps
	// an order a consumer can rely on. Its price: a claim that reads a
	// batch's index entries twice (to tell whether it passed over a row),
	// and a statement more, which looks up each claimed aggregate's run,
	// when it passed over a row another relay holds; and a row of an
	// aggregate that another relay's pass holds waits for a pass after that
	// one's (BenchmarkDeliverOrdered,
	// BenchmarkHotAggregate and peerbench's BenchmarkDrain measure it;
	// REFERENCE.md quotes them).
	PerAggregate bool

	// Standbys names the standby servers (their application_name, as the
	// primary's pg_stat_replication shows it) that a pass waits for: it
	// publishes only once each of them has flushed the primary's log past
	// the commits of the rows it claimed, so that a failover to any of
	// them never loses a change whose event went out. A synchronous standby
	// (synchronous_standby_names) has what a commit acknowledged already,
	// and costs nothing more here; an asynchronous one is what it is for:
	// without it, a failover to a standby that was behind loses changes
	// whose events were published: phantom events, of rows the new primary
	// never had, whose ids and aggregates it may hand out again. A pass whose
	// standbys do not catch up within its budget (one disconnected, or far
	// behind) publishes nothing and fails with [ErrStandbyBehind]: events
	// wait while a standby is away; decide whether that is what you want,
	// or name fewer. Empty: the pass waits for the primary's own log only.
	// The relay's role needs pg_read_all_stats to read the standbys'
	// positions; without it a pass fails with [ErrStandbysUnreadable].
	Standbys []string

	// PollInterval, MaxBackoff, PollOnly and Logger configure Run: how long
	// it waits for a notification before it passes anyway and the longest
	// it waits after failed passes (DefaultPollInterval and
	// DefaultMaxBackoff unless set; positive), whether it only polls, and
	// where it logs failed passes and parked messages (nil: nowhere).
	PollInterval time.Duration
	MaxBackoff   time.Duration
	PollOnly     bool
	Logger       *slog.Logger

	// TracerProvider and MeterProvider are where the relay reports (nil:
	// otel's global ones, no-ops until the application sets them). Each
	// pass that claimed rows is a span, "outbox relay pass" (an empty one
	// makes none), and each publish a producer span,
	// "send <type>", in the trace of the transaction that wrote the row
	// (InsertOutbox stored it), linked to the pass; the broker gets the
	// publish's trace context in Message.TraceContext. The meter records
	// outbox.relay.pass.duration (seconds; its count is the passes) and
	// messaging.client.sent.messages (with error.type unavailable, rejected
	// or budget for the failed ones). They are read at the first pass:
	// set them before.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// OnPass, if not nil, is called after each pass, in the pass's
	// goroutine, with what it did: for a live view of the relay. It must
	// return quickly.
	OnPass func(PassReport)

	// wait is how Run waits, listenWait how its listener waits before it
	// listens again, and mark the statement that marks: seams for the tests
	// and benchmarks; nil and "" are sleep and markSent.
	wait, listenWait func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool
	mark             string

	telemetryOnce sync.Once
	tel           *relayTelemetry
}

// DefaultParkAfter is [OutboxRelay.ParkAfter] as [NewOutboxRelay] sets
// it: a message the broker refused five times is set aside, so that it
// does not hold back the rest for ever.
const DefaultParkAfter = 5

// ErrInvalidConfig is wrapped by the error of [OutboxRelay.Validate], and
// so of PublishPending and Run, for a relay they cannot run as configured:
// the error says which setting and why. Nothing is claimed or published.
var ErrInvalidConfig = errors.New("postgres: invalid relay configuration")

// NewOutboxRelay returns an OutboxRelay that publishes the outbox rows of db
// to broker, configured as a team should run it, each setting in its field
// where it can be read and changed before the first pass:
//   - PerAggregate: order per aggregate, a batch at once through a
//     [BatchPublisher] (no aggregate twice in it) or a [SequencePublisher]
//     (the whole claim), a refusal holding back its aggregate alone (rows
//     with no aggregate are in no order, and go in batches);
//   - ParkAfter: [DefaultParkAfter], so a message the broker can never take
//     is set aside instead of blocking the rest for ever;
//   - BatchSize, PassTimeout, PollInterval and MaxBackoff: their Default
//     constants.
//
// The article's relay, the whole table in id order stopping at the first
// refusal and never setting a message aside, is the choice of
// PerAggregate = false and ParkAfter = 0.
//
// A pass takes one connection of db's pool for its transaction and, while
// it makes the server flush its log, a second one; Run holds one more for
// listening. db must be opened with pgx's stdlib driver
// (github.com/jackc/pgx/v5/stdlib, by stdlib.OpenDB or sql.Open("pgx", …)):
// the mark sends the accepted ids as a []int64, which pgx alone turns into
// a PostgreSQL array, and Run listens on pgx's own connection.
// [OutboxRelay.Validate] checks all of it, and PublishPending and Run call
// it first. [NewOutboxRelayPgx] is the same relay on pgx's own pool.
func NewOutboxRelay(db *sql.DB, broker MessageBroker) *OutboxRelay {
	return DefaultOutbox.NewRelay(db, broker)
}

// NewRelay is [NewOutboxRelay] for o: a relay of o's rows, which listens
// on o's channel.
func (o *Outbox) NewRelay(db *sql.DB, broker MessageBroker) *OutboxRelay {
	var p pool
	if db != nil {
		p = sqlPool{db}
	}
	return o.newRelay(p, broker)
}

// NewOutboxRelayPgx is [NewOutboxRelay] on pgx's own pool: the same relay,
// configured the same way, whose passes run in pgx transactions (pgx.Tx)
// without database/sql between them and the server, for a team whose
// services use pgxpool. A pass takes one connection of p for its
// transaction and, while it makes the server flush its log, a second one;
// Run takes one more for good (Hijack) to listen on. [OutboxRelay.Validate]
// checks that MaxConns allows as much.
func NewOutboxRelayPgx(p *pgxpool.Pool, broker MessageBroker) *OutboxRelay {
	return DefaultOutbox.NewRelayPgx(p, broker)
}

// NewRelayPgx is [NewOutboxRelayPgx] for o.
func (o *Outbox) NewRelayPgx(p *pgxpool.Pool, broker MessageBroker) *OutboxRelay {
	var db pool
	if p != nil {
		db = pgxPool{p}
	}
	return o.newRelay(db, broker)
}

func (o *Outbox) newRelay(db pool, broker MessageBroker) *OutboxRelay {
	return &OutboxRelay{db: db, broker: broker, outbox: o,
		BatchSize: DefaultBatchSize, PassTimeout: DefaultPassTimeout, ParkAfter: DefaultParkAfter, PerAggregate: true,
		PollInterval: DefaultPollInterval, MaxBackoff: DefaultMaxBackoff}
}

// Validate reports, with an error wrapping [ErrInvalidConfig] that names
// the setting, a relay that cannot run as configured: no database or no
// broker, a database/sql driver other than pgx's, a BatchSize, PassTimeout,
// PollInterval or MaxBackoff of zero or less, a negative ParkAfter, or a
// pool whose MaxOpenConns is below what a pass needs (two connections) or,
// unless PollOnly, what Run needs (three). PublishPending and Run call it
// before they claim anything.
func (r *OutboxRelay) Validate() error {
	return r.validate(false)
}

// validate is Validate; run says whether Run asks, which needs one
// connection more for listening.
func (r *OutboxRelay) validate(run bool) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case r.db == nil:
		return bad("no database")
	case r.broker == nil:
		return bad("no broker")
	case r.BatchSize <= 0:
		return bad("BatchSize is %d: a pass claims at least one row (DefaultBatchSize is %d)", r.BatchSize, DefaultBatchSize)
	case r.PassTimeout <= 0:
		return bad("PassTimeout is %v: a pass needs a budget (DefaultPassTimeout is %v)", r.PassTimeout, DefaultPassTimeout)
	case r.ParkAfter < 0:
		return bad("ParkAfter is %d: 0 never parks, n parks after n rejections", r.ParkAfter)
	case slices.Contains(r.Standbys, ""):
		return bad("Standbys holds an empty name")
	case run && r.PollInterval <= 0:
		return bad("PollInterval is %v (DefaultPollInterval is %v)", r.PollInterval, DefaultPollInterval)
	case run && r.MaxBackoff <= 0:
		return bad("MaxBackoff is %v (DefaultMaxBackoff is %v)", r.MaxBackoff, DefaultMaxBackoff)
	}
	if err := r.db.check(); err != nil {
		return bad("%v", err)
	}
	need, what := 2, "a pass (its transaction, and the flush of the server's log)"
	if run && !r.PollOnly {
		need, what = 3, "Run (a pass's two, and one to listen on)"
	}
	if max := r.db.maxConns(); max > 0 && max < need {
		return bad("the pool allows %d open connections, and %s needs %d at once: SetMaxOpenConns(%d), or MaxConns, or more", max, what, need, need)
	}
	return nil
}

// PublishPending makes one pass: it claims up to BatchSize unsent rows,
// waits until the server has made their commits durable, publishes them in
// id order, marks the ones the broker accepted sent in one statement,
// commits, and returns how many messages it marked sent. That count is the
// pass's progress and nothing else: a message the broker accepted but the
// pass could not mark (the mark or the commit failed) is not counted, since
// it is still unsent and goes again. Nothing the broker did not accept is
// marked.
//
// At the first message the broker refuses, PublishPending stops publishing,
// still marks and commits the messages before it, and returns the broker's
// error wrapped with the message id, so that errors.Is(err,
// [ErrBrokerUnavailable]) works. That message and all after it stay
// unsent for the next pass. The pass writes the failure to the row
// (attempts, rejections, last_error) in its own transaction, which commits
// even when nothing was sent; a row rejected ParkAfter times is parked
// instead, and the pass goes on with the rows after it.
//
// Through a [SequencePublisher], which stores nothing after a message it did
// not store, the pass publishes its whole batch in one call, with
// PerAggregate or without, and what follows the first message the broker did
// not accept in the same way as above, in a call of its own. With
// PerAggregate, through a [BatchPublisher], it publishes in one call as many
// rows as hold no aggregate twice (all of them, or else the broker is no
// SequencePublisher). Otherwise it publishes one message at a
// time, waiting for each ack: a batch's messages after a refused one may be
// stored all the same, ahead of it, which would break the table's order.
//
// A pass stops publishing when its budget (PassTimeout) runs out or ctx
// ends, and then still marks and commits what the broker accepted, under a
// context of its own that ctx's cancellation does not cut. A shutdown in the
// middle of a pass therefore sends again, later, at most the one message
// whose publish was in flight, or, through a batch, the part of the
// batch whose acks had not come back. When the budget runs out between publishes,
// the rest wait for the next pass and the error is nil; when ctx ends, the
// error wraps ctx's. When the server's log cannot be flushed past the claimed
// rows' commits within the budget, nothing is published and the error says
// so.
//
// A row marked sent is not published again by a relay that holds its claim.
// A relay whose session was lost can still publish what it claimed until it
// notices: it checks at most every [ClaimCheckInterval], and then stops with
// an error wrapping [ErrClaimLost]. That bounds the duplicates a lost claim
// makes; it cannot remove them, and consumers must drop them.
//
// If the mark or the commit fails, the error says so, says how many
// messages the broker accepted that go again, and keeps the cause of the
// stop and the refusals too (errors.Is finds each); the count is 0. An
// error from the commit may wrap [ErrCommitUnknown]: the marks may or may
// not have been kept, and the count is 0 either way.
func (r *OutboxRelay) PublishPending(ctx context.Context) (int, error) {
	if err := r.validate(false); err != nil {
		return 0, err
	}
	res, err := r.pass(ctx)
	return res.marked, err
}

// PassReport is what one relay pass did, as [OutboxRelay.OnPass] is told:
// the rows it claimed, the messages the broker accepted, those it marked
// sent and committed (its progress), the rows it parked, whether it made
// the server flush its log before it published (Flushed: see
// [OutboxRelay] on why), and its error.
type PassReport struct {
	Claimed, Published, Marked, Parked int
	Flushed                            bool
	Err                                error
}

// passResult is what a pass did, for Run.
type passResult struct {
	published int       // accepted by the broker
	marked    int       // marked sent, and committed: the pass's progress
	claimed   int       // rows the pass claimed
	full      bool      // it claimed a whole batch
	flushed   bool      // it made the server flush its log
	parked    []int64   // ids of the rows it parked, if it committed
	failing   []failure // the rows whose attempts reached FailingAfter, if it committed
	// fatal is set when a statement failed in a way no retry mends: a
	// table or column that does not exist, a permission the relay lacks.
	fatal bool
}

// pass is PublishPending, reporting more.
func (r *OutboxRelay) pass(ctx context.Context) (res passResult, err error) {
	batch, budget := r.BatchSize, r.PassTimeout
	tel, start := r.telemetry(), time.Now()
	var span trace.Span // started once the claim found rows: an empty pass makes no trace
	defer func() { tel.endPass(ctx, span, start, res, err) }()
	if r.OnPass != nil {
		defer func() {
			r.OnPass(PassReport{Claimed: res.claimed, Published: res.published, Marked: res.marked, Parked: len(res.parked),
				Flushed: res.flushed, Err: err})
		}()
	}
	defer func() { res.fatal = err != nil && cannotPass(err) }()

	// Publishing stops at the budget or when the caller's ctx ends. The
	// transaction lives under a context that the caller cannot cancel, so
	// that what the broker accepted can still be marked, and that ends at
	// twice the budget whatever happens.
	pubCtx, cancelPub := context.WithTimeout(ctx, budget)
	defer cancelPub()
	txCtx, cancelTx := context.WithTimeout(context.WithoutCancel(ctx), 2*budget)
	defer cancelTx()

	tx, err := r.db.begin(txCtx)
	if err != nil {
		return res, fmt.Errorf("begin relay pass: %w", err)
	}
	defer tx.rollback() // after a commit this does nothing; otherwise it frees the claim

	query := r.outbox.sql.claimRows
	if r.PerAggregate {
		query = r.outbox.sql.claimRuns
	}
	// Until the claim is done nothing is published, so a stop may cut it
	// short: a claim that waits for a lock (a migration's, a VACUUM FULL)
	// ends at the stop, not at its lock_timeout.
	claimCtx, cancelClaim := context.WithCancel(txCtx)
	defer cancelClaim()
	defer context.AfterFunc(ctx, cancelClaim)()
	msgs, wal, head, err := claim(claimCtx, tx, query, batch, millis(budget), millis(2*budget), r.PerAggregate)
	if err == nil && r.PerAggregate && head.passedOver(msgs) {
		// Rows of an aggregate may have been claimed without its first:
		// those stay as they are, claimed by this pass and left unsent.
		msgs, err = r.runsOnly(claimCtx, tx, msgs)
	}
	if err != nil {
		if ctx.Err() != nil {
			return res, fmt.Errorf("relay pass stopped while it claimed: %w", ctx.Err())
		}
		return res, err
	}
	// The claim is done: from here on a stop lets the pass mark what the
	// broker accepted, under txCtx.
	res.claimed, res.full = len(msgs), len(msgs) == batch
	if len(msgs) > 0 {
		// The publishes' context carries the pass's span, their link.
		pubCtx, span = tel.tracer.Start(pubCtx, "outbox relay pass", trace.WithTimestamp(start))
	}
	if len(msgs) > 0 && !wal.flushed {
		var err error
		if res.flushed, err = r.flush(pubCtx, tx, wal.inserted); err != nil {
			if ctx.Err() != nil {
				return res, fmt.Errorf("relay pass stopped: %w", ctx.Err())
			}
			return res, fmt.Errorf("relay pass: flush the server's log to %s, past the claimed rows' commits: %w", wal.inserted, err)
		}
	}
	// The standbys get only what the primary flushed: first the flush.
	if len(msgs) > 0 && len(r.Standbys) > 0 {
		if err := r.waitForStandbys(pubCtx, tx, wal.inserted); err != nil {
			if ctx.Err() != nil {
				return res, fmt.Errorf("relay pass stopped: %w", ctx.Err())
			}
			return res, fmt.Errorf("relay pass: %w", err)
		}
	}

	sent := make([]int64, 0, len(msgs))
	var failed []failure
	var stop error      // why publishing stopped before the end of the batch, if it matters
	var refused []error // with PerAggregate, the refusals the pass went on after
	checked := time.Now()
	for pending := msgs; len(pending) > 0; {
		if pubCtx.Err() != nil {
			if err := ctx.Err(); err != nil {
				stop = fmt.Errorf("relay pass stopped: %w", err)
			} // else the budget ran out: the rest wait for the next pass
			break
		}
		if time.Since(checked) >= ClaimCheckInterval {
			if err := tx.exec(txCtx, `SELECT 1`); err != nil {
				stop = fmt.Errorf("%w after %d published messages: %w", ErrClaimLost, len(sent), err)
				break
			}
			checked = time.Now()
		}
		n, err := r.publish(pubCtx, pending)
		for _, msg := range pending[:n] {
			sent = append(sent, msg.ID)
		}
		if err == nil {
			pending = pending[n:]
			continue
		}
		msg := pending[n] // the message the broker did not accept
		pending = pending[n+1:]
		if ctx.Err() != nil { // stopped: nothing is written to the row
			stop = fmt.Errorf("publish message %d: %w", msg.ID, err)
			break
		}
		// The broker's failure, or the end of the pass's budget (a publish
		// that hung): either way written to the row, so that it says why the
		// message is stuck. Only a refusal the broker made in time counts as
		// a rejection; a timeout never parks a row. Each context is read
		// once: a parent's Err is set before its children are cancelled.
		inTime := pubCtx.Err() == nil
		f := failure{id: msg.ID, key: msg.Key, err: err, rejected: inTime && errors.Is(err, ErrRejected)}
		f.park = f.rejected && r.ParkAfter > 0 && msg.rejections+1 >= r.ParkAfter
		failed = append(failed, f)
		if inTime { // the broker's own failure, not the end of the pass
			if f.park {
				res.parked = append(res.parked, msg.ID)
				if r.PerAggregate { // parked, it still holds back its aggregate
					pending = without(pending, msg.Aggregate)
				}
				continue // set aside: the rows after it go on
			}
			if r.PerAggregate && !errors.Is(err, ErrBrokerUnavailable) {
				// It holds back its aggregate alone: the pass goes on
				// with the other aggregates' rows.
				refused = append(refused, fmt.Errorf("publish message %d: %w", msg.ID, err))
				pending = without(pending, msg.Aggregate)
				continue
			}
		}
		stop = fmt.Errorf("publish message %d: %w", msg.ID, err)
		break
	}
	res.published = len(sent)
	stop = errors.Join(stop, errors.Join(refused...))

	// Whatever fails from here on leaves every accepted message unsent, to
	// go again, and no row parked.
	unmarked := func(what string, err error) (passResult, error) {
		res.parked, res.failing = nil, nil
		return res, errors.Join(stop, fmt.Errorf("%s%s, so the %d messages the broker accepted stay unsent and go again: %w",
			what, why(txCtx, err), len(sent), err))
	}
	if len(sent) > 0 {
		mark := r.outbox.sql.markSent
		if r.mark != "" {
			mark = r.mark
		}
		if err := tx.exec(txCtx, mark, sent); err != nil {
			return unmarked("mark the published messages sent", err)
		}
	}
	for _, f := range failed {
		var attempts int
		if err := tx.queryRow(txCtx, r.outbox.sql.recordFailure, f.id, b2i(f.rejected), f.err.Error(), f.park).Scan(&attempts); err != nil {
			return unmarked(fmt.Sprintf("record the failure of message %d", f.id), err)
		}
		if attempts == FailingAfter && !f.park {
			res.failing = append(res.failing, f)
		}
	}
	if err := tx.commit(txCtx); err != nil {
		return unmarked("relay pass", err)
	}
	res.marked = len(sent)
	return res, stop
}

// why says, for an error of the pass's transaction, what happened to it
// when the error itself does not: the pass ran past twice its budget (its
// transaction's context ended), or its session is gone (the server ended
// it, or a pooler, or the network did) and with it everything the pass
// wrote.
// (A commit whose outcome is unknown says so itself.)
func why(txCtx context.Context, err error) string {
	code := sqlState(err)
	switch {
	case errors.Is(err, ErrCommitUnknown):
		return ""
	case txCtx.Err() != nil:
		return " (the pass ran past twice its budget, PassTimeout: a broker slower than the budget?)"
	case errors.Is(err, driver.ErrBadConn), strings.HasPrefix(code, "08"), code == "57P01", code == "57P02", code == "25P03":
		return " (the pass's session is gone, ended by the server, a pooler or the network, and nothing it wrote was kept)"
	}
	return ""
}

// ErrStandbyBehind is returned, wrapped, by [OutboxRelay.PublishPending]
// when a pass's standbys (OutboxRelay.Standbys) had not flushed the log
// past its rows' commits within its budget: it published nothing, and the
// rows wait for a later pass.
var ErrStandbyBehind = errors.New("postgres: a standby the relay waits for is behind")

// ErrStandbysUnreadable is returned, wrapped, by
// [OutboxRelay.PublishPending] when the relay has Standbys and its role
// cannot read their positions: pg_stat_replication shows a role without
// the privileges of pg_read_all_stats (nor superuser) a NULL flush_lsn,
// which would look like a standby for ever behind. Grant the role
// pg_read_all_stats. Run stops on it, as on any failure no retry mends.
var ErrStandbysUnreadable = errors.New("postgres: the relay's role cannot read its standbys' positions (it needs pg_read_all_stats)")

// standbysFlushed says whether every standby of $2, by application_name,
// is connected and has flushed the log up to $1, and whether the role may
// read the standbys' positions at all.
const standbysFlushed = `SELECT count(DISTINCT application_name) = cardinality($2::text[]),
       pg_has_role('pg_read_all_stats', 'USAGE')
FROM pg_stat_replication WHERE application_name = ANY($2::text[]) AND flush_lsn >= $1::pg_lsn`

// waitForStandbys waits until every standby of r.Standbys has flushed the
// log up to lsn, looking again after 1 ms, then twice as long each time up
// to 50 ms, until ctx ends.
func (r *OutboxRelay) waitForStandbys(ctx context.Context, tx txn, lsn string) error {
	names := slices.Compact(slices.Sorted(slices.Values(r.Standbys)))
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		var caught, readable bool
		err := tx.queryRow(ctx, standbysFlushed, lsn, names).Scan(&caught, &readable)
		switch {
		case err != nil && ctx.Err() == nil:
			return fmt.Errorf("read the standbys' positions: %w", err)
		case err == nil && caught:
			return nil
		case err == nil && !readable:
			return fmt.Errorf("%w: pg_stat_replication shows the role flush_lsn NULL for %v: GRANT pg_read_all_stats TO the relay's role",
				ErrStandbysUnreadable, names)
		}
		if err != nil || !pause(ctx, wait) {
			return fmt.Errorf("%w: %v had not all flushed the log to %s, past the claimed rows' commits, within the pass's budget",
				ErrStandbyBehind, names, lsn)
		}
	}
}

// pause waits for d, and reports false if ctx ended first.
func pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// flushLooks is how often a pass looks again whether the server has
// flushed its log far enough before it makes it flush: each look is a
// round trip on the pass's connection, and with producers that commit
// synchronously the log is flushed far enough within a few of them in all
// but a few passes in a hundred (make measure-relays, flushed-%).
const flushLooks = 5

// flushLookAfter is the wait before the second look; each next one waits
// twice as long (all five looks: 3.75 ms at most).
const flushLookAfter = 250 * time.Microsecond

// flush makes sure the server has flushed its log up to lsn before the pass
// publishes, and reports whether it had to make it flush. The log that was
// not flushed as the claim began is mostly that of producers still in their
// transactions, whose synchronous commits flush it a moment later: so it
// first looks again, flushLooks times at most, on the pass's connection.
// Only if the log is still not flushed that far does it commit flushWAL on
// a second connection of the relay's pool (the pass's is inside its
// transaction), then check again. That is needed when some producer commits
// asynchronously, or when nothing commits after a write to the log (a
// transaction still open, vacuum).
func (r *OutboxRelay) flush(ctx context.Context, tx txn, lsn string) (flushed bool, err error) {
	var done bool
	for look := range flushLooks {
		if look > 0 && !pause(ctx, flushLookAfter<<(look-1)) {
			return false, ctx.Err()
		}
		if err := tx.queryRow(ctx, walFlushed, lsn).Scan(&done); err != nil || done {
			return false, err
		}
	}
	if err := r.db.exec(ctx, flushWAL); err != nil {
		return true, err
	}
	if err := tx.queryRow(ctx, walFlushed, lsn).Scan(&done); err != nil {
		return true, err
	}
	if !done {
		return true, errors.New("the server's log is still not flushed after a synchronous commit: is the pool's every connection to the same server?")
	}
	return true, nil
}

// cannotPass reports whether err holds a server error that the same
// statement would meet again however often it is retried: SQLSTATE class 42
// (a table, column or function that does not exist, a permission denied)
// or 3D000 (a database that does not exist).
func cannotPass(err error) bool {
	if errors.Is(err, ErrStandbysUnreadable) {
		return true
	}
	code := sqlState(err)
	return strings.HasPrefix(code, "42") || code == "3D000"
}

// publish publishes msgs from the first, as many at once as the broker and
// the relay's order allow (see send), and returns how many the broker
// accepted and, if it did not accept them all, the error of the first it did
// not accept.
//
// A pass with PerAggregate holds only runs of each aggregate from its
// first unsent row, and the next row of an aggregate is claimed only once
// the rows before it are marked: so a batch that holds no aggregate twice
// breaks no order a consumer relies on, whatever the broker stores after a
// message it refused. Over the whole table it would: so without
// PerAggregate the relay sends a batch only to a [SequencePublisher].
func (r *OutboxRelay) publish(ctx context.Context, msgs []claimed) (int, error) {
	_, batches := r.broker.(BatchPublisher)
	if _, sequences := r.broker.(SequencePublisher); !sequences && !(batches && r.PerAggregate) {
		return sendOne(ctx, r.telemetry(), r.broker, msgs[0].Message) // one at a time: nothing to copy
	}
	batch := make([]Message, len(msgs))
	for i, m := range msgs {
		batch[i] = m.Message
	}
	return send(ctx, r.telemetry(), r.broker, batch, r.PerAggregate)
}

// send publishes msgs from the first, each in a send span: through a
// [BatchPublisher], if byAggregate, as many as hold no aggregate twice
// (batchOf), unless that is fewer than all of them and the broker is a
// [SequencePublisher] too; through a [SequencePublisher], all of them;
// otherwise the first alone. An asynchronous batch costs the broker no more
// than a sequence (natsbroker's REFERENCE.md measures both), so it goes
// first where it keeps the order. send returns how many the
// broker accepted, from the first, and, if not all it sent, the error of the
// first it did not accept.
func send(ctx context.Context, tel *relayTelemetry, broker MessageBroker, msgs []Message, byAggregate bool) (int, error) {
	sp, sequences := broker.(SequencePublisher)
	if bp, ok := broker.(BatchPublisher); ok && byAggregate {
		if n := batchOf(msgs, len(msgs)); n > 1 && (n == len(msgs) || !sequences) {
			return publishBatch(ctx, tel, broker, bp.PublishBatch, msgs[:n])
		}
	}
	if sequences && len(msgs) > 1 {
		return publishBatch(ctx, tel, broker, sp.PublishSequence, msgs)
	}
	return sendOne(ctx, tel, broker, msgs[0])
}

// sendOne publishes msg in a send span, and returns 1 if the broker
// accepted it, or 0 and its error.
func sendOne(ctx context.Context, tel *relayTelemetry, broker MessageBroker, msg Message) (int, error) {
	msg, span := tel.startSend(ctx, messagingSystem(broker), msg)
	err := broker.Publish(ctx, msg)
	tel.endSend(ctx, span, err)
	if err != nil {
		return 0, err
	}
	return 1, nil
}

// without is msgs without the rows of aggregate (none if it is empty).
func without(msgs []claimed, aggregate string) []claimed {
	if aggregate == "" {
		return msgs
	}
	var rest []claimed
	for _, m := range msgs {
		if m.Aggregate != aggregate {
			rest = append(rest, m)
		}
	}
	return rest
}

// publishBatch publishes msgs with publish (a BatchPublisher's PublishBatch
// or an SequencePublisher's PublishSequence), each in a send span, and returns how many the broker accepted, from the first, and, if not all, the error
// of the first it did not accept. A broker that misreports is taken for one
// that is down.
func publishBatch(ctx context.Context, tel *relayTelemetry, broker MessageBroker,
	publish func(context.Context, []Message) (int, error), msgs []Message) (int, error) {
	batch := make([]Message, len(msgs))
	spans := make([]trace.Span, len(msgs))
	for i, m := range msgs {
		batch[i], spans[i] = tel.startSend(ctx, messagingSystem(broker), m)
	}
	n, err := publish(ctx, batch)
	switch {
	case n < 0 || n > len(msgs):
		err = fmt.Errorf("broker says it accepted %d of %d messages: %w", n, len(msgs), ErrBrokerUnavailable)
		n = 0
	case n < len(msgs) && err == nil:
		err = fmt.Errorf("broker accepted %d of %d messages and gave no error for the next: %w", n, len(msgs), ErrBrokerUnavailable)
	case n == len(msgs):
		err = nil
	}
	for i, span := range spans {
		switch {
		case i < n:
			tel.endSend(ctx, span, nil)
		case i == n:
			tel.endSend(ctx, span, err)
		default: // sent after the first failure: goes again, whatever the broker did with it
			span.SetAttributes(attribute.Bool("outbox.acknowledged", false))
			span.End()
		}
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
	key            string
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
	dest := []any{&m.ID, &m.Key, &m.Type, &m.Payload, &m.Aggregate, &m.Seq, &m.rejections,
		&traceparent, &tracestate, &wal.flushed, &wal.inserted} // the WAL's the same in every row
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
