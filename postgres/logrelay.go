package postgres

import (
	"context"
	"database/sql"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// DefaultSlot and DefaultPublication name what a [LogRelay] reads when its
// Slot and Publication are empty: the replication slot that [CreateLogSlot]
// makes, and the publication of the outbox's inserts that migration 4
// creates; [DefaultOutbox]'s Slot and Publication (another [Outbox]'s are
// named after its table).
const (
	DefaultSlot        = "outbox"
	DefaultPublication = "outbox_inserts"
)

// ErrNoSlot is returned, wrapped, by [LogRelay.Run] when its replication
// slot does not exist: create it with [CreateLogSlot] before the producers
// write rows it must see.
var ErrNoSlot = errors.New("postgres: the log relay's replication slot does not exist")

// ErrSlotLost is returned, wrapped, by [LogRelay.Run] when the server has
// invalidated the relay's replication slot: the slot fell further behind
// than max_slot_wal_keep_size allows and the server removed log it had not
// yet read, so the inserts in that log can no longer be streamed. The rows
// are still in the table: [Outbox.RecoverLogSlot] makes the slot anew and
// publishes the rows the relay did not mark (consumers drop what goes
// twice, by key), and the log relay takes over again.
var ErrSlotLost = errors.New("postgres: the log relay's replication slot was invalidated")

// ErrSlotOfAnotherDatabase is returned, wrapped, by [CreateLogSlot],
// [DropLogSlot], [Outbox.RecoverLogSlot] and [LogRelay.Run] for a slot
// whose name is taken by a slot of another database on the same server:
// slot names are the server's, not a database's, so two services whose
// outbox tables share a name on one server must give their slots names of
// their own (Outbox's Slot, LogRelay's Slot). The other database's slot is
// never dropped, nor taken for lost.
var ErrSlotOfAnotherDatabase = errors.New("postgres: the replication slot belongs to another database")

// LogRelay is the other relay: instead of polling the table it reads the
// outbox's inserts from PostgreSQL's log, by logical decoding (the pgoutput
// plugin, through a publication of the outbox's inserts), and publishes each
// committed transaction's rows in commit order (through a [BatchPublisher],
// in batches that hold no aggregate twice; through a [SequencePublisher], in
// batches of up to 100). A row that committed after a
// higher id is published after it, as it committed, so the trap of the
// polling relay (ids are not commit order) cannot happen. It never updates a
// row unless MarkIn is set: no mark, no dead index entry, no vacuum debt;
// sent_at then stays NULL, so [DeleteSent] does not touch the rows and
// [ReadLag] counts them as unsent. With MarkIn, what it delivered is
// marked, beside the stream, and the table is counted and cleaned up as
// the polling relay's.
//
// Its place in the log is the slot's: the server keeps every record from
// the slot's position on, and sends again, after a reconnect or a restart,
// every transaction that committed after it. The relay moves the position
// (a standby status update) only past a transaction whose every row the
// broker accepted, so what a crash or a broker failure sends again is the
// transactions after the last one confirmed, at least once, with the same
// keys; consumers drop the copies. A transaction is published as it is
// read, in parts of at most 1,000 rows or about 8 MiB of payload, so the
// relay's memory is bounded by a part, not by the transaction. The server hears of each delivery within
// 100 ms (with MarkIn, of its mark) and when a session ends on a connection
// that still works, a clean stop included, so a restart sends again at most
// the transaction in flight. It holds no transaction on the server, but its
// slot holds log: as long as the relay is behind or gone, the server
// keeps the log it has not read, bounded only by max_slot_wal_keep_size (an
// invalidated slot is [ErrSlotLost]). Watch pg_replication_slots. A slot has
// one reader: one LogRelay per slot runs at a time (a second one waits, as
// Run retries, until the first is gone); and PostgreSQL 15 does not carry a
// slot over to a standby, so after a failover it must be created again.
//
// A LogRelay needs the server's wal_level = logical, a role with the
// REPLICATION attribute, and a connection string for a replication
// connection, which database/sql cannot make. Create one with
// [NewLogRelay]; do not change its fields while Run runs.
type LogRelay struct {
	// Slot and Publication name the replication slot and the publication;
	// empty means DefaultSlot and DefaultPublication.
	Slot, Publication string

	// PublishTimeout bounds each publish, a batch's too, and each mark;
	// zero or less means DefaultPassTimeout. A publish that runs out
	// fails as any other.
	PublishTimeout time.Duration

	// StatusInterval is how often, at most, the relay tells the server how
	// far it has delivered while the stream is idle, and while it publishes
	// a transaction; zero or less means 10 s. Each session uses no more than
	// half the server's wal_sender_timeout, so that the server never takes
	// a relay that is publishing a large transaction for a dead one.
	StatusInterval time.Duration

	// ReplyTimeout is how long the relay waits for the server to answer a
	// status update (each asks for an answer) before it takes the
	// connection for dead and starts a new session; zero or less means 10
	// s. A connection that went silent (a frozen network path, a server
	// gone without a FIN) is so given up within StatusInterval plus
	// ReplyTimeout, instead of when TCP gives up.
	ReplyTimeout time.Duration

	// MaxBackoff is the longest Run waits before it connects again after a
	// failure; zero or less means DefaultMaxBackoff.
	MaxBackoff time.Duration

	// Logger, if not nil, is told of each failed session.
	Logger *slog.Logger

	// MarkIn, if not nil, is the outbox's database opened with pgx's
	// stdlib driver: the relay then marks the rows it delivered sent
	// (sent_at), beside the stream, so that it never waits for the write:
	// one mark at a time, each of every row delivered since the one before
	// began, in one statement a table. The server hears of a transaction
	// only once its rows are marked, and a session's end waits for its
	// marks. So ReadLag counts only the rows not yet delivered (or
	// delivered a moment ago), and DeleteSent cleans up the delivered
	// ones, as for the polling relay. A mark that fails, or that finds
	// fewer rows than it was given (a row the log carried can be invisible
	// to other sessions for a moment after its commit), is logged and
	// tried again, after a backoff, before the slot moves past its rows; a
	// row still not found after MarkRetries marks (deleted meanwhile) is
	// given up on, logged and reported as ErrNotMarked, so that it does
	// not hold the log for ever.
	MarkIn *sql.DB

	// ParkAfter, with MarkIn, is how many rejections (broker errors
	// wrapping ErrRejected, counted in the row's rejections as the polling
	// relay counts them) set a row aside, parked: the relay then skips it
	// and delivers the rest of its transaction, and those after it. Zero
	// never parks: a message the broker can never take stops the relay,
	// which tries its transaction again once a backoff. A parked row is
	// listed by ListParked; put back (Unpark), it is published by a
	// polling pass (OutboxRelay.PublishPending, or RecoverLogSlot), since
	// the log relay has gone past it.
	ParkAfter int

	// TracerProvider and MeterProvider are where the relay reports (nil:
	// otel's global ones): the polling relay's instruments and spans, with
	// outbox.relay "log"; a transaction's delivery is its pass. They are
	// read when Run starts.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// OnPass, if not nil, is called after each transaction's delivery, in
	// Run's goroutine, with what it did (Claimed, Published, Err), as
	// OutboxRelay.OnPass is after a pass: for a live view of the relay.
	// With MarkIn it is called too after each mark, with Marked and Err
	// alone. It must return quickly.
	OnPass func(PassReport)

	table  string          // the outbox table, for the measurements' outbox.table
	outbox *tables         // the outbox whose rows Recover publishes
	tel    *relayTelemetry // made by Run

	connString string
	connConfig *pgconn.Config // if not nil, used instead of connString
	broker     MessageBroker
	wait       func(ctx context.Context, d time.Duration) bool // a seam for the tests
}

// NewLogRelay returns a LogRelay that reads the log of the database that
// connString names (a libpq connection string or URL, as pgx parses it;
// the relay adds replication=database) and publishes to broker.
func NewLogRelay(connString string, broker MessageBroker) *LogRelay {
	return &LogRelay{connString: connString, broker: broker, table: defaultTables.table, outbox: defaultTables}
}

// NewLogRelayConfig is NewLogRelay with the connection as pgx's own
// configuration: TLS, a dialer, several hosts, whatever pgconn.ParseConfig
// and its fields allow. The relay uses a copy of cfg with replication =
// database set.
func NewLogRelayConfig(cfg *pgconn.Config, broker MessageBroker) *LogRelay {
	return &LogRelay{connConfig: cfg.Copy(), broker: broker, table: defaultTables.table, outbox: defaultTables}
}

// NewLogRelay is [NewLogRelay] for o, and safe by default: its Slot and
// Publication are o's, it marks what it delivered in o's database (MarkIn)
// and parks a row after DefaultParkAfter rejections, as the polling relay
// does. On an Outbox made by [Open], MarkIn is o's pool seen through
// stdlib.OpenDBFromPool.
func (o *Outbox[T]) NewLogRelay(connString string, broker MessageBroker) *LogRelay {
	r := &LogRelay{connString: connString, broker: broker, ParkAfter: DefaultParkAfter}
	if o != nil && o.t != nil {
		r.Slot, r.Publication, r.table, r.outbox, r.MarkIn = o.Slot(), o.Publication(), o.t.table, o.t, o.sqldb
	}
	return r
}
