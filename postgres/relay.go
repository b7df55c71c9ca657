package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// DefaultBatchSize is how many rows a relay pass claims when
// [RelayConfig.BatchSize] is zero.
const DefaultBatchSize = 100

// DefaultPassTimeout is a relay pass's time budget when
// [RelayConfig.PassTimeout] is zero.
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

// FailingAfter is how many failed publishes, for any reason, make an unsent
// row failing: a message that holds up the outbox, or its aggregate, pass
// after pass. [OutboxRelay.Run] logs it once, at level Warn, with its id,
// key and last error, when its attempts reach FailingAfter; [Outbox.ReadLag]
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
// (order per aggregate, the default, keeps each aggregate's). Nor is id
// order commit order on PostgreSQL: the trap test,
// TestRowCommittedAfterAHigherIDIsSentLateNotLost, shows a row sent late, not
// lost. Delivery is at least once: a relay that dies after publishing and
// before its commit leaves the rows unsent, and they go again with the same
// ids.
//
// An OutboxRelay is safe for concurrent use by multiple goroutines, and any
// number of relays may run over one database: overlapping passes claim
// disjoint rows. Make one with [Outbox.NewRelay], which checks its
// [RelayConfig]; it is fixed from then on. The zero OutboxRelay has no
// database and no broker, and its passes fail with [ErrInvalidConfig].
type OutboxRelay struct {
	db     pool // nil if none was given
	broker MessageBroker
	outbox *tables
	cfg    RelayConfig // with the defaults filled in

	// wait is how Run waits, listenWait how its listener waits before it
	// listens again, and mark the statement that marks: seams for the tests
	// and benchmarks; nil and "" are sleep and markSent.
	wait, listenWait func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool
	mark             string

	alone aloneLog // PublishWithoutStandbys, said once a state

	telemetryOnce sync.Once
	tel           *relayTelemetry
}

// RelayConfig configures an [OutboxRelay]: [Outbox.NewRelay] checks it,
// refuses a bad value with an error that names it, and keeps a copy, so
// that nothing changes a relay once made. The zero RelayConfig is the relay
// as a team should run it: order per aggregate, a batch at once where the
// broker allows it, a message the broker refused DefaultParkAfter times
// set aside, and the Default constants' budget, batch and intervals. Zero
// means the default in every field.
//
// The article's relay, the whole table in id order stopping at the first
// refusal and never setting a message aside, is RelayConfig{WholeTable:
// true, NeverPark: true}.
type RelayConfig struct {
	// BatchSize is the most rows one pass claims and publishes: 0 means
	// DefaultBatchSize, and at most MaxBatchSize.
	BatchSize int

	// PassTimeout is a pass's time budget for publishing: 0 means
	// DefaultPassTimeout. The pass's statements, its mark and its commit
	// get as long again, so a pass ends at most twice PassTimeout after it
	// began; a stop before the claim returns (one waiting for a lock) ends
	// the pass at once. Make it longer than the broker's slowest publish
	// of a batch.
	PassTimeout time.Duration

	// ParkAfter is how many rejections (broker errors wrapping ErrRejected)
	// set a row aside, parked: 0 means DefaultParkAfter. A parked row is no
	// longer published. The rows of other aggregates go on in the same
	// pass; with order per aggregate, the later rows of its own aggregate
	// wait behind it (migration 5), so that the aggregate's order holds, until it is put back
	// (Unpark) and published, or dropped (DropParked). A row of no
	// aggregate holds nothing back. Errors that do not wrap
	// ErrRejected, a broker that is down among them, never park a row.
	// ReadLag counts the parked rows; ListParked lists them.
	ParkAfter int

	// NeverPark keeps the article's relay on rejections: a message the
	// broker refuses for ever blocks every message after it (of its
	// aggregate, or of the table with WholeTable), and their order is kept.
	// ParkAfter must then be 0.
	NeverPark bool

	// WholeTable makes the relay keep the article's order, the whole table
	// in id order, instead of order per aggregate (see
	// [Message.Aggregate]). That is right for one relay, and for events
	// whose order between aggregates matters too: a pass stops at the
	// first refusal, and publishes one message at a time (a batch a pass to
	// a [SequencePublisher]).
	//
	// Without it, a pass publishes an aggregate's rows only as a run from
	// its first unsent row, so a message being retried, or held by another
	// relay, is never overtaken by a later one of its aggregate, however
	// many relays run; a hot aggregate's backlog goes a batch a pass, like
	// the whole table's. It hands a [BatchPublisher] the rows of its batch
	// that hold no aggregate twice at once, and a [SequencePublisher] the
	// whole batch when an aggregate is in it twice. A message the broker
	// refuses holds back its aggregate alone: the pass goes on with the
	// other aggregates' rows (it stops only when the broker is
	// unavailable), and reports the refusals in its error; later passes
	// leave that aggregate's later rows unclaimed until it is published. A
	// parked row, too, holds back the rest of its aggregate until Unpark.
	// With several relays, whose batches interleave, or when one stuck
	// message must not stop every other, order per aggregate is the one
	// that keeps an order a consumer can rely on. Its price: a claim that
	// reads a batch's index entries twice (to tell whether it passed over a
	// row), a statement more when it passed over a row another relay holds,
	// and a row of an aggregate that another relay's pass holds waits for a
	// pass after that one's (REFERENCE.md measures it).
	WholeTable bool

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

	// StandbyCount, instead of Standbys, waits for standbys by number,
	// whichever they are: a pass publishes once at least StandbyCount of
	// the standbys streaming from the primary it is on (its
	// pg_stat_replication's physical ones) have flushed the log past the
	// commits of the rows it claimed. The primary is the one the pass's
	// connection reached: after a promotion, the new primary's standbys
	// count, with no setting to change and no restart, where names would
	// name a standby the new primary does not have. With fewer standbys
	// connected than StandbyCount, a pass publishes nothing and fails with
	// [ErrStandbyBehind], saying how many there are; PublishWithoutStandbys
	// changes that for a primary that has none at all. 0: wait by Standbys,
	// or for no standby. The role needs pg_read_all_stats, as with Standbys.
	StandbyCount int

	// PublishWithoutStandbys lets a pass with a StandbyCount publish while
	// the primary has no standby streaming at all (just promoted, its
	// standbys not yet attached), said at Warn when it starts and every 5
	// minutes while it goes on, and at Info when a standby is back: the
	// events go, and a failover before a standby catches up may leave
	// phantoms. False, the safe default, holds the events until a standby
	// is attached. A primary with some standbys, fewer than StandbyCount,
	// still waits.
	PublishWithoutStandbys bool

	// RetryDelay and MaxRetryDelay are a message's own backoff, with order
	// per aggregate: a message whose publish failed for a reason of its
	// own (the broker refused it, or any error but ErrBrokerUnavailable
	// and the end of the pass's budget) is not claimed again, nor are the
	// later messages of its aggregate, before RetryDelay after the first
	// failure, twice that after the second, and so on up to MaxRetryDelay,
	// each a random point in the upper half of that (0: DefaultRetryDelay,
	// DefaultMaxRetryDelay); the other aggregates' messages flow meanwhile.
	// Its next attempt is the first pass after that time: one woken by a
	// notification, or PollInterval later. A broker that is unavailable
	// fails every message alike, and Run backs off as a whole instead
	// (MaxBackoff); with WholeTable, where the message that failed is the
	// head of the whole table, so does every failure.
	RetryDelay    time.Duration
	MaxRetryDelay time.Duration

	// PollInterval is how long Run waits for a notification before it
	// passes anyway (0: DefaultPollInterval), MaxBackoff the longest it
	// waits after failed passes (0: DefaultMaxBackoff). PollOnly makes Run
	// poll without listening, behind a pooler that cannot keep LISTEN
	// (PgBouncer in transaction mode); the pool then needs two connections
	// instead of three.
	PollInterval time.Duration
	MaxBackoff   time.Duration
	PollOnly     bool

	// Logger is where Run logs failed passes and parked messages (nil:
	// nowhere).
	Logger *slog.Logger

	// TracerProvider and MeterProvider are where the relay reports (nil:
	// otel's global ones, no-ops until the application sets them). Each
	// pass that claimed rows is a span, "outbox relay pass" (an empty one
	// makes none), and each publish a producer span,
	// "send <type>", in the trace of the transaction that wrote the row
	// (Write stored it), linked to the pass; the broker gets the
	// publish's trace context in Message.TraceContext. The meter records
	// outbox.relay.pass.duration (seconds; its count is the passes) and
	// messaging.client.sent.messages (with error.type unavailable, rejected
	// or budget for the failed ones).
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// OnPass, if not nil, is called after each pass, in the pass's
	// goroutine, with what it did: for a live view of the relay. It must
	// return quickly.
	OnPass func(PassReport)
}

// DefaultRetryDelay and DefaultMaxRetryDelay are RelayConfig.RetryDelay and
// MaxRetryDelay when they are zero: a message the broker refused waits a
// second before its second attempt, and at most five minutes between any
// two, so that a refusal that passes (a permission granted, a stream
// created) costs at most that much delay once it has passed.
const (
	DefaultRetryDelay    = time.Second
	DefaultMaxRetryDelay = 5 * time.Minute
)

// MaxBatchSize is the largest RelayConfig.BatchSize: a pass holds its
// claim, and an open transaction, over no more rows than that.
const MaxBatchSize = 10_000

// DefaultParkAfter is RelayConfig.ParkAfter when it is zero: a message the
// broker refused five times is set aside, so that it does not hold back the
// rest for ever.
const DefaultParkAfter = 5

// ErrInvalidConfig is wrapped by the error of [Open] and [OpenDB] for a
// [Config] they refuse, and of [Outbox.NewRelay] for a [RelayConfig] it
// refuses: the error says which setting and why. Nothing is written,
// claimed or published.
var ErrInvalidConfig = errors.New("postgres: invalid configuration")

// NewRelay returns an OutboxRelay that publishes o's rows to broker, as cfg
// says, and listens on o's channel. It checks cfg and the database, and
// refuses, with an error wrapping [ErrInvalidConfig] that names the
// setting, no broker, a negative value, a BatchSize over MaxBatchSize, a
// ParkAfter with NeverPark, a MaxRetryDelay below RetryDelay, an empty name among the Standbys, and a pool
// too small: a pass takes one connection for its transaction and, while it
// makes the server flush its log, a second one; Run takes one more for good
// to listen on, unless PollOnly (MaxOpenConns, or MaxConns, of at least 3,
// or 2). Its passes run in pgx transactions, with no database/sql between
// them and the server: on an Outbox made by [OpenDB], each on the pgx
// connection beneath one of the *sql.DB's connections, taken from it for
// the pass; its settings (MaxOpenConns, ConnMaxLifetime) hold as for any.
func (o *Outbox[T]) NewRelay(broker MessageBroker, cfg RelayConfig) (*OutboxRelay, error) {
	if err := o.usable(); err != nil {
		return nil, err
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case broker == nil:
		return nil, bad("no broker")
	case cfg.BatchSize < 0 || cfg.BatchSize > MaxBatchSize:
		return nil, bad("RelayConfig.BatchSize %d: want 1 to %d, or 0 for %d", cfg.BatchSize, MaxBatchSize, DefaultBatchSize)
	case cfg.PassTimeout < 0:
		return nil, bad("RelayConfig.PassTimeout %v: a pass needs a budget (0 for %v)", cfg.PassTimeout, DefaultPassTimeout)
	case cfg.ParkAfter < 0:
		return nil, bad("RelayConfig.ParkAfter %d: n parks after n rejections (0 for %d; NeverPark never parks)", cfg.ParkAfter, DefaultParkAfter)
	case cfg.ParkAfter > 0 && cfg.NeverPark:
		return nil, bad("RelayConfig.ParkAfter %d with NeverPark: choose one", cfg.ParkAfter)
	case slices.Contains(cfg.Standbys, ""):
		return nil, bad("RelayConfig.Standbys holds an empty name")
	case cfg.StandbyCount < 0:
		return nil, bad("RelayConfig.StandbyCount %d: a number of standbys", cfg.StandbyCount)
	case cfg.StandbyCount > 0 && len(cfg.Standbys) > 0:
		return nil, bad("RelayConfig.StandbyCount %d with Standbys %v: wait by number or by name, not both", cfg.StandbyCount, cfg.Standbys)
	case cfg.PublishWithoutStandbys && cfg.StandbyCount == 0:
		return nil, bad("RelayConfig.PublishWithoutStandbys without a StandbyCount: there is no standby to wait for")
	case cfg.PollInterval < 0:
		return nil, bad("RelayConfig.PollInterval %v (0 for %v)", cfg.PollInterval, DefaultPollInterval)
	case cfg.MaxBackoff < 0:
		return nil, bad("RelayConfig.MaxBackoff %v (0 for %v)", cfg.MaxBackoff, DefaultMaxBackoff)
	case cfg.RetryDelay < 0:
		return nil, bad("RelayConfig.RetryDelay %v (0 for %v)", cfg.RetryDelay, DefaultRetryDelay)
	case cfg.MaxRetryDelay < 0:
		return nil, bad("RelayConfig.MaxRetryDelay %v (0 for %v)", cfg.MaxRetryDelay, DefaultMaxRetryDelay)
	case orDefault(cfg.MaxRetryDelay, DefaultMaxRetryDelay) < orDefault(cfg.RetryDelay, DefaultRetryDelay):
		return nil, bad("RelayConfig.MaxRetryDelay %v is below RetryDelay %v (zero stands for %v and %v)",
			orDefault(cfg.MaxRetryDelay, DefaultMaxRetryDelay), orDefault(cfg.RetryDelay, DefaultRetryDelay),
			DefaultMaxRetryDelay, DefaultRetryDelay)
	}
	if err := o.db.check(); err != nil {
		return nil, bad("%v", err)
	}
	need, what := 3, "Run (a pass's transaction, the flush of the server's log, and one to listen on)"
	if cfg.PollOnly {
		need, what = 2, "a pass (its transaction, and the flush of the server's log)"
	}
	if max := o.db.maxConns(); max > 0 && max < need {
		return nil, bad("the pool allows %d open connections, and %s needs %d at once: SetMaxOpenConns(%d), or MaxConns, or more (or RelayConfig.PollOnly, which needs 2)",
			max, what, need, need)
	}
	cfg.BatchSize = orDefault(cfg.BatchSize, DefaultBatchSize)
	cfg.PassTimeout = orDefault(cfg.PassTimeout, DefaultPassTimeout)
	if !cfg.NeverPark {
		cfg.ParkAfter = orDefault(cfg.ParkAfter, DefaultParkAfter)
	}
	cfg.PollInterval = orDefault(cfg.PollInterval, DefaultPollInterval)
	cfg.MaxBackoff = orDefault(cfg.MaxBackoff, DefaultMaxBackoff)
	cfg.RetryDelay = orDefault(cfg.RetryDelay, DefaultRetryDelay)
	cfg.MaxRetryDelay = orDefault(cfg.MaxRetryDelay, DefaultMaxRetryDelay)
	cfg.Standbys = slices.Clone(cfg.Standbys)
	return &OutboxRelay{db: o.db, broker: broker, outbox: o.t, cfg: cfg}, nil
}

// Config is r's configuration, with the defaults filled in.
func (r *OutboxRelay) Config() RelayConfig {
	c := r.cfg
	c.Standbys = slices.Clone(c.Standbys)
	return c
}

// usable reports a relay that NewRelay did not make.
func (r *OutboxRelay) usable() error {
	if r == nil || r.db == nil || r.broker == nil || r.outbox == nil {
		return fmt.Errorf("%w: an OutboxRelay made by no Outbox's NewRelay", ErrInvalidConfig)
	}
	return nil
}

// PublishPending makes one pass: it claims up to RelayConfig.BatchSize
// unsent rows,
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
// not store, the pass publishes its whole batch in one call, with with order
// per aggregate or WholeTable, and what follows the first message the broker
// did not accept in the same way as above, in a call of its own. With order per
// aggregate, through a [BatchPublisher], it publishes in one call as many rows
// as hold no aggregate twice (all of them, or else the broker is no
// SequencePublisher). Otherwise it publishes one message at a time, waiting for
// each ack: a batch's messages after a refused one may be stored all the same,
// ahead of it, which would break the table's order.
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
	if err := r.usable(); err != nil {
		return 0, err
	}
	res, err := r.pass(ctx)
	return res.marked, err
}

// PassReport is what one relay pass did, as [RelayConfig.OnPass] is told:
// the rows it claimed, the messages the broker accepted, those it marked
// sent and committed (its progress), the rows it parked, whether it made
// the server flush its log before it published (Flushed: see
// [OutboxRelay] on why), and its error.
type PassReport struct {
	Claimed, Published, Marked, Parked int
	Flushed                            bool
	Err                                error
}
