package postgres

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// DefaultSlot and DefaultPublication are the Slot and Publication of the
// table outbox (an [Outbox] of another table has its own, named after it):
// the replication slot that [Outbox.CreateLogSlot] makes when given no name, and
// the publication of the outbox's inserts that migration 4 creates.
const (
	DefaultSlot        = "outbox"
	DefaultPublication = "outbox_inserts"
)

// ErrNoSlot is returned, wrapped, by [LogRelay.Run] when its replication
// slot does not exist: create it with [Outbox.CreateLogSlot] before the producers
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

// ErrSlotOfAnotherDatabase is returned, wrapped, by [Outbox.CreateLogSlot],
// [Outbox.DropLogSlot], [Outbox.RecoverLogSlot] and [LogRelay.Run] for a slot
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
// row with LogRelayConfig.Unmarked: no mark, no dead index entry, no vacuum
// debt; sent_at then stays NULL, so [Outbox.DeleteSent] does not touch the
// rows and [Outbox.ReadLag] counts them as unsent. By default what it
// delivered is marked, beside the stream, and the table is counted and
// cleaned up as the polling relay's; with LogRelayConfig.DeleteDelivered
// it is deleted instead.
//
// A row written with a time to deliver still to come (Event.DeliverAt) is
// passed over: the log carries it at its commit, too soon, and does not
// carry its release. A polling pass (OutboxRelay's PublishPending or Run,
// at least once a PollInterval; outbox-relay's sweep) releases it at its
// time and publishes it. Its aggregate is held back meanwhile, as behind a
// row the relay parked: the relay leaves the aggregate's later rows unsent,
// and the polling pass publishes them after it, in their order, as it keeps
// an aggregate behind its scheduled and parked rows; the relay lets go of
// the aggregate at its first row with no unsent row of the aggregate
// before it. So the order per aggregate is the polling relay's, at the
// cost of a polling pass's delay for a held aggregate. Unmarked, nothing is
// held back: the log relay publishes the aggregate's later events as they
// commit, before the scheduled one.
//
// Its place in the log is the slot's: the server keeps every record from the
// slot's position on, and sends again, after a reconnect or a restart, every
// transaction that committed after it. The relay moves the position (a standby
// status update) only past a transaction whose every row the broker accepted,
// so what a crash or a broker failure sends again is the transactions after the
// last one confirmed, at least once, with the same keys; consumers drop the
// copies. A transaction is published as it is read, in parts of at most 1,000
// rows or about 8 MiB of payload, so the relay's memory is bounded by a part,
// not by the transaction. The server hears of each delivery within 100 ms (of
// its mark, unless Unmarked) and when a session ends on a connection that still
// works, a clean stop included, so a restart sends again at most the
// transaction in flight. It holds no transaction on the server, but its slot
// holds log: as long as the relay is behind or gone, the server keeps the log
// it has not read, bounded only by max_slot_wal_keep_size (an invalidated slot
// is [ErrSlotLost]). Watch pg_replication_slots. A slot has one reader: one
// LogRelay per slot runs at a time (a second one waits, as Run retries, until
// the first is gone); and PostgreSQL 15 does not carry a slot over to a
// standby, so after a failover it must be created again.
//
// A LogRelay needs the server's wal_level = logical, a role with the
// REPLICATION attribute, and a connection string for a replication
// connection, which database/sql cannot make. Make one with
// [Outbox.NewLogRelay], which checks its [LogRelayConfig]; it is fixed from
// then on. A LogRelay is safe for concurrent use, but Run runs once at a
// time.
type LogRelay struct {
	cfg    LogRelayConfig           // with the defaults filled in
	sqldb  func() (*sql.DB, func()) // where it marks and parks, unless cfg.Unmarked: its Outbox's
	table  string                   // the outbox table, for the measurements' outbox.table
	outbox *tables                  // the outbox whose rows Recover publishes
	tel    *relayTelemetry          // made by Run

	connConfig *pgconn.Config
	broker     MessageBroker
	wait       func(ctx context.Context, d time.Duration) bool // a seam for the tests
	sent       func(commit, sent time.Time)                    // a seam for the measurements: each transaction's commit, and when the server sent it
	alone      aloneLog                                        // PublishWithoutStandbys, said once a state
}

// LogRelayConfig configures a [LogRelay]: [Outbox.NewLogRelay] checks it,
// refuses a bad value with an error that names it, and keeps a copy. The
// zero LogRelayConfig is the relay as a team should run it: it marks what it
// delivered and parks a message the broker refused DefaultParkAfter times,
// as the polling relay does. Zero means the default in every field.
type LogRelayConfig struct {
	// Slot and Publication name the replication slot and the publication;
	// empty means the Outbox's (Outbox.Slot, Outbox.Publication).
	Slot, Publication string

	// PublishTimeout bounds each publish, a batch's too, and each mark;
	// 0 means DefaultPassTimeout. A publish that runs out fails as any
	// other.
	PublishTimeout time.Duration

	// StatusInterval is how often, at most, the relay tells the server how
	// far it has delivered while the stream is idle, and while it publishes
	// a transaction; 0 means 10 s. Each session uses no more than half the
	// server's wal_sender_timeout, so that the server never takes a relay
	// that is publishing a large transaction for a dead one.
	StatusInterval time.Duration

	// ReplyTimeout is how long the relay waits for the server to answer a
	// status update (each asks for an answer) before it takes the
	// connection for dead and starts a new session; 0 means 10 s. A
	// connection that went silent (a frozen network path, a server gone
	// without a FIN) is so given up within StatusInterval plus
	// ReplyTimeout, instead of when TCP gives up.
	ReplyTimeout time.Duration

	// MaxBackoff is the longest Run waits before it connects again after a
	// failure; 0 means DefaultMaxBackoff.
	MaxBackoff time.Duration

	// Logger, if not nil, is told of each failed session.
	Logger *slog.Logger

	// Unmarked makes the relay mark nothing. Otherwise it marks the rows
	// it delivered sent (sent_at) in the Outbox's database, beside the
	// stream, so that it never waits for the write: one mark at a time,
	// each of every row delivered since the one before began, in one
	// statement a table. The server hears of a transaction only once its
	// rows are marked, and a session's end waits for its marks. So ReadLag
	// counts only the rows not yet delivered (or delivered a moment ago),
	// and DeleteSent cleans up the delivered ones, as for the polling
	// relay. A mark that fails, or that finds fewer rows than it was given
	// (a row the log carried can be invisible to other sessions for a
	// moment after its commit), is logged and tried again, after a
	// backoff, before the slot moves past its rows; a row still not found
	// after MarkRetries marks (deleted meanwhile) is given up on, logged
	// and reported as ErrNotMarked, so that it does not hold the log for
	// ever. Unmarked, every row stays unsent: lag for ReadLag, never
	// cleaned up, sent again by a recovery; and none is parked.
	Unmarked bool

	// StandbyCount has the log relay publish a transaction only once that
	// many of the physical standbys streaming from the primary it is on
	// have flushed the log past the transaction's commit, as
	// RelayConfig.StandbyCount does for a pass: a failover to one of them
	// then never loses a change whose event went out. It reads their
	// positions where it marks (its role needs pg_read_all_stats), so it
	// needs the marks (refused with Unmarked). Waiting longer than
	// PublishTimeout ends the session with ErrStandbyBehind; the next one,
	// after Run's backoff, reads the transaction again. 0: no standby is
	// waited for, and a failover to an asynchronous standby may leave
	// phantom events (PostgreSQL 17's synchronized_standby_slots makes the
	// server wait instead; 15 has none).
	StandbyCount int

	// PublishWithoutStandbys lets the log relay with a StandbyCount publish
	// while its primary has no standby streaming at all (just promoted),
	// said at Warn once and every 5 minutes while it goes on, as
	// RelayConfig.PublishWithoutStandbys does.
	PublishWithoutStandbys bool

	// RecoverSlot has Run make the slot anew, and publish what it may have
	// missed, when it finds the slot gone: ErrNoSlot (a standby promoted
	// under the relay, since PostgreSQL 15 keeps logical slots on the
	// primary only) or ErrSlotLost (the server removed log the slot had
	// not read). Run then calls Recover, logged, and goes on streaming from
	// the new slot, with no restart; a Recover that fails is tried again
	// after Run's backoff. Recover publishes every row not marked sent, so
	// an event delivered before the promotion whose mark the new primary
	// lacks goes again: a copy, which consumers drop by its key. Off, Run
	// returns those errors, for the caller to call Recover. It needs the
	// marks: refused with Unmarked.
	RecoverSlot bool

	// DeleteDelivered makes the marks delete the rows they are given
	// instead of setting their sent_at: the article's cleanup done at
	// once, for the cheapest mark. A deleted row's record in the log is
	// its key, where an updated row's is the whole new row, which the
	// server writes and its walsender decodes before it sends the next
	// transaction; on a machine whose cores the producers keep busy that
	// is what holds the log relay's tail back (REFERENCE.md measures it).
	// The table then keeps no row the log relay sent: Replay finds none
	// of them to put back (ErrNotKept), DeleteSent has none of them to
	// delete, and ReadLag counts what is still there. A parked row stays, as a row already sent does. A
	// delivered row that a mark cannot find though it sees the row's
	// transaction is gone, and counted done: deleted by a mark before,
	// when the server sends a transaction again after a restart, or by
	// anyone. Unmarked must then be false.
	DeleteDelivered bool

	// ParkAfter is how many rejections (broker errors wrapping
	// ErrRejected, counted in the row's rejections as the polling relay
	// counts them) set a row aside, parked: 0 means DefaultParkAfter. The
	// relay then skips it and delivers the rest of its transaction, and
	// those after it, but for its aggregate's later rows, which it holds
	// back behind it (see LogRelay), until a polling pass has published
	// it, put back. A parked row is listed by ListParked; put back
	// (Unpark), it is published by a polling pass (OutboxRelay's, or
	// RecoverLogSlot's), since the log relay has gone past it. A row the
	// relay cannot read at all (headers that are not an object of
	// strings, written past migration 8's check) is parked at its first
	// reading, whatever ParkAfter and NeverPark say, since every reading
	// fails alike, and its aggregate held back; a session that parked it
	// and then failed leaves it parked, and the next passes over it.
	// Unmarked, it fails every session. The session's
	// settings that the rows' text form depends on (bytea_output,
	// DateStyle) are pinned, whatever the role or database sets.
	ParkAfter int

	// NeverPark makes a message the broker can never take stop the relay,
	// which tries its transaction again after a backoff, for ever. ParkAfter
	// must then be 0. Unmarked implies it.
	NeverPark bool

	// TracerProvider and MeterProvider are where the relay reports (nil:
	// otel's global ones): the polling relay's instruments and spans, with
	// outbox.relay "log"; a transaction's delivery is its pass.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// OnPass, if not nil, is called after each transaction's delivery, in
	// Run's goroutine, with what it did (Claimed, Published, Err), as
	// RelayConfig.OnPass is after a pass: for a live view of the relay.
	// It is called too after each mark, with Marked and Err alone, and
	// after a replication session failed, with Err alone (wrapping
	// [ErrSlotActive] while another relay reads the slot). It must return
	// quickly.
	OnPass func(PassReport)
}

// NewLogRelay returns a LogRelay that reads the log of o's database through
// connString (a libpq connection string or URL, as pgx parses it; the relay
// adds replication=database) and publishes o's rows to broker, as cfg says.
// It checks both and refuses, with an error wrapping [ErrInvalidConfig]
// that names it, a connection string pgx cannot parse, no broker, a slot
// or publication name PostgreSQL would not take, a negative value,
// ParkAfter with NeverPark or Unmarked, and DeleteDelivered with Unmarked.
// It connects to nothing. On an Outbox made by [Open], it marks through
// stdlib.OpenDBFromPool of o's pool, which Run opens and closes.
func (o *Outbox[T]) NewLogRelay(connString string, broker MessageBroker, cfg LogRelayConfig) (*LogRelay, error) {
	conn, err := pgconn.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("%w: the log relay's connection string: %w", ErrInvalidConfig, err)
	}
	return o.NewLogRelayConfig(conn, broker, cfg)
}

// NewLogRelayConfig is NewLogRelay with the connection as pgx's own
// configuration: TLS, a dialer, several hosts, whatever pgconn.ParseConfig
// and its fields allow. The relay uses a copy of conn with replication =
// database set.
func (o *Outbox[T]) NewLogRelayConfig(conn *pgconn.Config, broker MessageBroker, cfg LogRelayConfig) (*LogRelay, error) {
	if err := o.usable(); err != nil {
		return nil, err
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case conn == nil:
		return nil, bad("no connection configuration")
	case broker == nil:
		return nil, bad("no broker")
	case cfg.Slot != "" && !slotName.MatchString(cfg.Slot):
		return nil, bad("LogRelayConfig.Slot %q: want lowercase letters, digits and '_', at most 63 bytes", cfg.Slot)
	case cfg.Publication != "" && !identifier(cfg.Publication):
		return nil, bad("LogRelayConfig.Publication %q: want letters, digits and '_', at most 63 bytes", cfg.Publication)
	case cfg.PublishTimeout < 0, cfg.StatusInterval < 0, cfg.ReplyTimeout < 0, cfg.MaxBackoff < 0:
		return nil, bad("LogRelayConfig: a negative duration (PublishTimeout %v, StatusInterval %v, ReplyTimeout %v, MaxBackoff %v)",
			cfg.PublishTimeout, cfg.StatusInterval, cfg.ReplyTimeout, cfg.MaxBackoff)
	case cfg.ParkAfter < 0:
		return nil, bad("LogRelayConfig.ParkAfter %d: n parks after n rejections (0 for %d)", cfg.ParkAfter, DefaultParkAfter)
	case cfg.ParkAfter > 0 && (cfg.NeverPark || cfg.Unmarked):
		return nil, bad("LogRelayConfig.ParkAfter %d with NeverPark or Unmarked (parking needs the marks): choose one", cfg.ParkAfter)
	case cfg.DeleteDelivered && cfg.Unmarked:
		return nil, bad("LogRelayConfig.DeleteDelivered with Unmarked (the deletes are the marks): choose one")
	case cfg.StandbyCount < 0:
		return nil, bad("LogRelayConfig.StandbyCount %d: a number of standbys", cfg.StandbyCount)
	case cfg.StandbyCount > 0 && cfg.Unmarked:
		return nil, bad("LogRelayConfig.StandbyCount with Unmarked: the standbys are read where the relay marks")
	case cfg.PublishWithoutStandbys && cfg.StandbyCount == 0:
		return nil, bad("LogRelayConfig.PublishWithoutStandbys without a StandbyCount: there is no standby to wait for")
	case cfg.RecoverSlot && cfg.Unmarked:
		return nil, bad("LogRelayConfig.RecoverSlot with Unmarked: a recovery publishes what is not marked, which would be every row")
	}
	cfg.Slot, cfg.Publication = cmp.Or(cfg.Slot, o.Slot()), cmp.Or(cfg.Publication, o.Publication())
	cfg.PublishTimeout = orDefault(cfg.PublishTimeout, DefaultPassTimeout)
	cfg.StatusInterval = orDefault(cfg.StatusInterval, 10*time.Second)
	cfg.ReplyTimeout = orDefault(cfg.ReplyTimeout, 10*time.Second)
	cfg.MaxBackoff = orDefault(cfg.MaxBackoff, DefaultMaxBackoff)
	cfg.NeverPark = cfg.NeverPark || cfg.Unmarked
	if !cfg.NeverPark {
		cfg.ParkAfter = orDefault(cfg.ParkAfter, DefaultParkAfter)
	}
	r := &LogRelay{cfg: cfg, table: o.t.table, outbox: o.t, connConfig: conn.Copy(), broker: broker}
	r.sqldb = o.sqldb
	return r, nil
}

// Config is r's configuration, with the defaults filled in.
func (r *LogRelay) Config() LogRelayConfig { return r.cfg }

// slotName is what PostgreSQL allows in a replication slot's name.
var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)
