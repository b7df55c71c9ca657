package postgres

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
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
	outbox *Outbox         // the outbox whose rows Recover publishes
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
	return &LogRelay{connString: connString, broker: broker, table: DefaultOutbox.table, outbox: DefaultOutbox}
}

// NewLogRelayConfig is NewLogRelay with the connection as pgx's own
// configuration: TLS, a dialer, several hosts, whatever pgconn.ParseConfig
// and its fields allow. The relay uses a copy of cfg with replication =
// database set.
func NewLogRelayConfig(cfg *pgconn.Config, broker MessageBroker) *LogRelay {
	return &LogRelay{connConfig: cfg.Copy(), broker: broker, table: DefaultOutbox.table, outbox: DefaultOutbox}
}

// NewLogRelay is [NewLogRelay] for o: its Slot and Publication are o's.
func (o *Outbox) NewLogRelay(connString string, broker MessageBroker) *LogRelay {
	return &LogRelay{connString: connString, broker: broker, Slot: o.Slot(), Publication: o.Publication(), table: o.table, outbox: o}
}

// CreateLogSlot creates the replication slot slot (DefaultSlot if empty)
// of the database db is open on, with the pgoutput plugin, unless it exists.
// Create it as a provisioning step, before the producers write the rows the
// log relay must publish: the slot sees only what commits after it exists.
// It needs wal_level = logical, and says so.
func CreateLogSlot(ctx context.Context, db *sql.DB, slot string) error {
	if slot == "" {
		slot = DefaultSlot
	}
	if err := slotOfThisDatabase(ctx, db, slot); err != nil {
		return fmt.Errorf("create replication slot %s: %w", slot, err)
	}
	_, err := db.ExecContext(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')
		WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)`, slot)
	if err != nil {
		return fmt.Errorf("create replication slot %s (it needs wal_level = logical): %w", slot, err)
	}
	return nil
}

// slotOfThisDatabase is nil when the slot named slot does not exist or
// belongs to the database db is open on, and an error wrapping
// ErrSlotOfAnotherDatabase, naming that database, when it belongs to
// another.
func slotOfThisDatabase(ctx context.Context, db *sql.DB, slot string) error {
	var theirs, ours string
	err := db.QueryRowContext(ctx, `SELECT coalesce(database, ''), current_database()
		FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&theirs, &ours)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err != nil:
		return err
	case theirs != ours:
		return fmt.Errorf("%w: it is database %q's, and this is %q: name this one's slot apart", ErrSlotOfAnotherDatabase, theirs, ours)
	}
	return nil
}

// ErrSlotActive is returned, wrapped, by [DropLogSlot] for a slot that a
// log relay is reading: stop it first.
var ErrSlotActive = errors.New("postgres: the replication slot is in use")

// DropLogSlot drops the replication slot slot (DefaultSlot if empty) of the
// database db is open on, if it exists: a slot that no relay reads any more
// holds the server's log for ever, until the disk fills or
// max_slot_wal_keep_size invalidates it. A slot a relay is reading is
// refused with [ErrSlotActive], and kept; so is a slot of that name that
// belongs to another database on the server, with
// [ErrSlotOfAnotherDatabase].
func DropLogSlot(ctx context.Context, db *sql.DB, slot string) error {
	if slot == "" {
		slot = DefaultSlot
	}
	if err := slotOfThisDatabase(ctx, db, slot); err != nil {
		return fmt.Errorf("drop replication slot %s: %w", slot, err)
	}
	var active sql.NullBool
	err := db.QueryRowContext(ctx, `SELECT active FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&active)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err != nil:
		return fmt.Errorf("drop replication slot %s: %w", slot, err)
	case active.Bool:
		return fmt.Errorf("drop replication slot %s: %w", slot, ErrSlotActive)
	}
	if _, err := db.ExecContext(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
		WHERE slot_name = $1 AND database = current_database()`, slot); err != nil {
		if sqlState(err) == "55006" { // object_in_use: a relay took it meanwhile
			return fmt.Errorf("drop replication slot %s: %w: %w", slot, ErrSlotActive, err)
		}
		return fmt.Errorf("drop replication slot %s: %w", slot, err)
	}
	return nil
}

// slotReleaseWait is how long RecoverLogSlot waits for a slot's reader to
// let go of it before it gives up with ErrSlotActive.
const slotReleaseWait = 5 * time.Second

// RecoverLogSlot is [Outbox.RecoverLogSlot] for [DefaultOutbox].
func RecoverLogSlot(ctx context.Context, db *sql.DB, broker MessageBroker) (int, error) {
	return DefaultOutbox.RecoverLogSlot(ctx, db, broker)
}

// RecoverLogSlot makes the log relay's slot (o's Slot) anew and delivers
// every row that may not have been delivered: after the slot was lost
// ([ErrSlotLost]: the server removed log it had not read), or when there
// is none ([ErrNoSlot]: a promoted standby, since PostgreSQL 15 keeps slots
// on the primary only). It drops the slot if it is there (refusing, with
// [ErrSlotActive], one a relay still reads after 5 s: a relay that has just
// stopped lets go of it a moment later), creates it, and only then publishes,
// with a polling relay of o, every row not marked sent, in passes until
// none is left: a row committed before the new slot is in the table
// unmarked and goes now; one committed after it is streamed by the log
// relay, and may go both ways: at least once, the consumers drop the
// copies. It relies on the log relay's marks (LogRelay.MarkIn): without
// them every row ever written goes again. It returns how many rows it
// published; on an error, call it again.
func (o *Outbox) RecoverLogSlot(ctx context.Context, db *sql.DB, broker MessageBroker) (int, error) {
	return o.recoverLogSlot(ctx, db, o.Slot(), broker)
}

// Recover is [Outbox.RecoverLogSlot] for r: it makes r's Slot anew on
// MarkIn and publishes, to r's broker, the rows of r's outbox not marked
// sent. Without MarkIn it is refused with an error wrapping
// ErrInvalidConfig: every row ever written would go again. Call it when
// Run returned ErrSlotLost or ErrNoSlot, then Run again.
func (r *LogRelay) Recover(ctx context.Context) (int, error) {
	if r.MarkIn == nil || r.outbox == nil {
		return 0, fmt.Errorf("%w: Recover needs MarkIn, and a LogRelay made by NewLogRelay", ErrInvalidConfig)
	}
	return r.outbox.recoverLogSlot(ctx, r.MarkIn, cmp.Or(r.Slot, DefaultSlot), r.broker)
}

func (o *Outbox) recoverLogSlot(ctx context.Context, db *sql.DB, slot string, broker MessageBroker) (int, error) {
	// A relay that has just returned ErrSlotLost or ErrNoSlot closed its
	// connection, but the server's walsender lets go of the slot a moment
	// later: wait for that, a while.
	err := DropLogSlot(ctx, db, slot)
	for deadline := time.Now().Add(slotReleaseWait); errors.Is(err, ErrSlotActive) && time.Now().Before(deadline); {
		if !pause(ctx, 50*time.Millisecond) {
			return 0, ctx.Err()
		}
		err = DropLogSlot(ctx, db, slot)
	}
	if err != nil {
		return 0, err
	}
	if err := CreateLogSlot(ctx, db, slot); err != nil {
		return 0, err
	}
	relay := o.NewRelay(db, broker)
	total := 0
	for {
		n, err := relay.PublishPending(ctx)
		total += n
		switch {
		case err != nil && !errors.Is(err, ErrRejected):
			return total, fmt.Errorf("recover log slot %s: publish what it may have missed: %w", slot, err)
		case n == 0:
			return total, err // a refusal, if any, is said: the row stays in the table, parked in time
		}
	}
}

// Run streams the outbox's inserts and publishes them until ctx ends, then
// returns ctx's error. After a failure (the connection lost, the broker
// refusing or not answering) it connects again after a backoff, like
// [OutboxRelay.Run]'s, and the server sends again every transaction after
// the last one confirmed. It returns, with the error, when no retry can
// mend it: the slot does not exist ([ErrNoSlot]), was invalidated
// ([ErrSlotLost]), belongs to another database on the server
// ([ErrSlotOfAnotherDatabase]), or the role may not replicate.
func (r *LogRelay) Run(ctx context.Context) error {
	r.tel = newRelayTelemetry(r.TracerProvider, r.MeterProvider, r.table, "log")
	maxBackoff := orDefault(r.MaxBackoff, DefaultMaxBackoff)
	wait := r.wait
	if wait == nil {
		wait = pause
	}
	failures := 0
	for {
		completed, err := r.session(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, ErrNoSlot) || errors.Is(err, ErrSlotLost) || errors.Is(err, ErrSlotOfAnotherDatabase) || sqlState(err) == "42501" || sqlState(err) == "28000" {
			if r.Logger != nil {
				r.Logger.Error("outbox: log relay stopped", "err", err)
			}
			return err
		}
		if completed > 0 { // progress of the slot, not messages sent again

			failures = 0
		}
		failures++
		d := backoff(failures, maxBackoff, rand.Float64)
		if r.Logger != nil {
			r.Logger.Error("outbox: log relay session failed", "err", err, "transactions_delivered", completed, "retry_in", d)
		}
		if !wait(ctx, d) {
			return ctx.Err()
		}
	}
}

// session streams from the slot's position on one replication connection
// until it fails, and reports how many messages it delivered.
func (r *LogRelay) session(ctx context.Context) (completed int, err error) {
	var cfg *pgconn.Config
	if r.connConfig != nil {
		cfg = r.connConfig.Copy()
	} else if cfg, err = pgconn.ParseConfig(r.connString); err != nil {
		return 0, fmt.Errorf("log relay: %w", err)
	}
	cfg.RuntimeParams["replication"] = "database"
	if cfg.RuntimeParams["application_name"] == "" {
		cfg.RuntimeParams["application_name"] = "outbox-log-relay"
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return 0, fmt.Errorf("log relay: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))

	slot, publication := r.Slot, r.Publication
	if slot == "" {
		slot = DefaultSlot
	}
	if publication == "" {
		publication = DefaultPublication
	}
	// Read before the stream starts: once it has, the connection takes no
	// more queries.
	every := orDefault(r.StatusInterval, 10*time.Second)
	if half := senderTimeout(ctx, conn) / 2; half > 0 && half < every {
		every = half
	}
	// The server refuses another database's slot with the SQLSTATE of an
	// invalidated one: ask first, so that the two are never taken for each
	// other.
	if theirs := slotElsewhere(ctx, conn, slot); theirs != "" {
		return 0, fmt.Errorf("%w: %s is database %q's", ErrSlotOfAnotherDatabase, slot, theirs)
	}
	// Position 0: from where the slot says the relay confirmed.
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + publication + "'"},
	})
	switch code := sqlState(err); {
	case code == "42704": // undefined_object
		return 0, fmt.Errorf("%w: %s: %w", ErrNoSlot, slot, err)
	case code == "55000": // object_not_in_prerequisite_state: "can no longer get changes"
		return 0, fmt.Errorf("%w: %s: %w", ErrSlotLost, slot, err)
	case err != nil:
		return 0, fmt.Errorf("log relay: start replication from slot %s: %w", slot, err)
	}

	s := stream{
		relay:     r,
		conn:      conn,
		relations: map[uint32]*pglogrepl.RelationMessage{},
		every:     every,
		replyIn:   orDefault(r.ReplyTimeout, 10*time.Second),
	}
	if r.MarkIn != nil {
		s.marks = newMarks(r)
	}
	err = s.run(ctx)
	// Whatever ended the session, the server hears how far the broker
	// accepted, so that a clean stop, or a failure after a delivery, sends
	// again at most the transaction in flight.
	// A connection that failed is being closed by pgconn, in a goroutine of
	// its own: nothing more may be written to it.
	if s.marks != nil {
		s.marks.finish(context.WithoutCancel(ctx)) // each mark bounded by PublishTimeout
	}
	if s.safe() > s.toldPos && !conn.IsClosed() {
		final, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		s.tell(final)
		cancel()
	}
	return s.completed, err
}

// slotElsewhere is the name of the database the slot named slot belongs
// to, if it is not the one conn is on; empty if it is, or if it cannot be
// told. It is asked before the stream starts, on the replication
// connection, which takes plain queries until then.
func slotElsewhere(ctx context.Context, conn *pgconn.PgConn, slot string) string {
	q := `SELECT database FROM pg_replication_slots WHERE slot_name = '` + strings.ReplaceAll(slot, "'", "''") +
		`' AND database IS DISTINCT FROM current_database()`
	res, err := conn.Exec(ctx, q).ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 {
		return ""
	}
	return string(res[0].Rows[0][0])
}

// senderTimeout is the server's wal_sender_timeout, or 0 if it cannot be
// read or is off.
func senderTimeout(ctx context.Context, conn *pgconn.PgConn) time.Duration {
	res, err := conn.Exec(ctx, `SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout'`).ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 {
		return 0
	}
	ms, err := strconv.Atoi(string(res[0].Rows[0][0]))
	if err != nil || ms <= 0 {
		return 0
	}
	return time.Duration(ms) * time.Millisecond
}

// stream is one session's state: the tables' descriptions the server sent,
// the transaction being read, and how far the relay has delivered.
type stream struct {
	relay     *LogRelay
	conn      *pgconn.PgConn
	relations map[uint32]*pglogrepl.RelationMessage
	txn       []Message // the rows of the transaction being read, not yet published: at most streamRows
	tables    []string  // each txn row's table, as an SQL identifier
	txnBytes  int       // the payloads' bytes in txn: at most about streamBytes
	inTxn     bool      // a BEGIN was read and its COMMIT not yet
	txnDone   int       // rows of the transaction being read published already
	sentIDs   []int64   // rows published and not yet handed to the marks, and their tables
	sentIn    []string
	marks     *marks        // with MarkIn, the marking of what was delivered
	confirmed pglogrepl.LSN // the end of the last transaction delivered whole, or a keepalive's position past it
	toldPos   pglogrepl.LSN // the position the server was last told
	told      time.Time     // when the server was last told where the relay is
	asked     time.Time     // when a status update asked for an answer that has not come; zero if none waits
	every     time.Duration
	replyIn   time.Duration
	delivered int
	completed int // transactions delivered whole and confirmed: the session's progress
}

// statusAfterDelivery is how soon after a delivered transaction the server
// hears of it, at the latest: often enough that a restart sends little
// again, seldom enough that a burst of small transactions costs few
// messages.
const statusAfterDelivery = 100 * time.Millisecond

func (s *stream) run(ctx context.Context) error {
	for {
		if s.marks != nil {
			s.marks.poll(ctx)
		}
		if time.Now().After(s.nextTell()) {
			if err := s.tell(ctx); err != nil {
				return err
			}
		}
		deadline := s.nextTell()
		if !s.asked.IsZero() && s.asked.Add(s.replyIn).Before(deadline) {
			deadline = s.asked.Add(s.replyIn)
		}
		rctx, cancel := context.WithDeadline(ctx, deadline)
		raw, err := s.conn.ReceiveMessage(rctx)
		cancel()
		switch {
		case err != nil && pgconn.Timeout(err) && ctx.Err() == nil:
			if !s.asked.IsZero() && time.Since(s.asked) >= s.replyIn {
				return fmt.Errorf("log relay: the server did not answer a status update within %v: the connection is taken for dead", s.replyIn)
			}
			continue // time to tell the server where the relay is
		case err != nil:
			return fmt.Errorf("log relay: receive: %w", err)
		}
		s.asked = time.Time{} // the server answers: the connection lives
		switch msg := raw.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("log relay: %w", pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.CopyData:
			if err := s.handle(ctx, msg.Data); err != nil {
				return err
			}
		}
	}
}

// nextTell is when the server is to hear next where the relay is: within
// statusAfterDelivery of a delivery it has not heard of, and every
// interval anyway.
func (s *stream) nextTell() time.Time {
	if s.confirmed > s.toldPos {
		return s.told.Add(statusAfterDelivery)
	}
	return s.told.Add(s.every)
}

// handle handles one message of the replication stream.
func (s *stream) handle(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		k, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("log relay: %w", err)
		}
		// Everything the server sent before the keepalive has been read;
		// with no transaction half read, the relay has delivered all of it,
		// and the log up to here holds nothing more for it (other tables'
		// changes, transactions with no outbox row). Confirming it lets the
		// server free that log.
		if !s.inTxn && k.ServerWALEnd > s.confirmed {
			s.confirmed = k.ServerWALEnd
		}
		if k.ReplyRequested {
			return s.tell(ctx)
		}
	case pglogrepl.XLogDataByteID:
		x, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("log relay: %w", err)
		}
		m, err := pglogrepl.Parse(x.WALData)
		if err != nil {
			return fmt.Errorf("log relay: decode: %w", err)
		}
		switch m := m.(type) {
		case *pglogrepl.RelationMessage:
			s.relations[m.RelationID] = m
		case *pglogrepl.BeginMessage:
			s.txn, s.tables, s.txnBytes = s.txn[:0], s.tables[:0], 0
			s.inTxn, s.txnDone, s.sentIDs, s.sentIn = true, 0, s.sentIDs[:0], s.sentIn[:0]
		case *pglogrepl.InsertMessage:
			rel, ok := s.relations[m.RelationID]
			if !ok {
				return fmt.Errorf("log relay: an insert into relation %d, which the server never described", m.RelationID)
			}
			msg, err := decodeRow(rel, m.Tuple)
			if err != nil {
				return err
			}
			s.txn = append(s.txn, msg)
			s.tables = append(s.tables, pgx.Identifier{rel.Namespace, rel.RelationName}.Sanitize())
			s.txnBytes += len(msg.Payload)
			// pgoutput (proto_version 1) sends a transaction only once it
			// committed, so its rows may go before its COMMIT is read:
			// memory is bounded by these, not by the transaction. Its end
			// is confirmed only at the COMMIT, after its last row went.
			if len(s.txn) >= streamRows || s.txnBytes >= streamBytes {
				return s.deliver(ctx, 0)
			}
		case *pglogrepl.CommitMessage:
			return s.deliver(ctx, m.TransactionEndLSN)
		}
	}
	return nil
}

// streamRows and streamBytes bound the rows of a transaction the log relay
// holds before it publishes them: a transaction of a million rows goes in
// parts of at most streamRows rows, or about streamBytes of payload.
const (
	streamRows  = 1000
	streamBytes = 8 << 20
)

// deliver publishes the rows of the transaction read so far in their order
// and, at its COMMIT (end is then the transaction's end; 0 for a part of
// it), once the broker accepted every row of the transaction, hands them to
// the marks and confirms its end.
func (s *stream) deliver(ctx context.Context, end pglogrepl.LSN) (err error) {
	timeout := orDefault(s.relay.PublishTimeout, DefaultPassTimeout)
	tel, start := s.relay.tel, time.Now()
	var span trace.Span // a transaction's delivery, or a part's, is the log relay's pass
	if len(s.txn) > 0 {
		ctx, span = tel.tracer.Start(ctx, "outbox log relay transaction", trace.WithTimestamp(start))
	}
	res := passResult{claimed: len(s.txn)}
	defer func() {
		tel.endPass(ctx, span, start, res, err)
		if s.relay.OnPass != nil {
			s.relay.OnPass(PassReport{Claimed: res.claimed, Published: res.published, Marked: res.marked, Err: err})
		}
	}()
	for i := 0; i < len(s.txn); {
		pctx, cancel := context.WithTimeout(ctx, timeout)
		accepted, err := send(pctx, s.relay.tel, s.relay.broker, s.txn[i:min(len(s.txn), i+DefaultBatchSize)], true)
		cancel()
		for j := i; j < i+accepted; j++ {
			s.sentIn, s.sentIDs = append(s.sentIn, s.tables[j]), append(s.sentIDs, s.txn[j].ID)
		}
		s.delivered += accepted
		res.published += accepted
		i += accepted
		if err != nil && errors.Is(err, ErrRejected) && s.park(ctx, i, err) {
			i++
			continue // set aside: the rest of the transaction goes on
		}
		if err != nil {
			return fmt.Errorf("publish message %d, row %d of a transaction, which goes again whole: %w",
				s.txn[i].ID, s.txnDone+i+1, err)
		}
		// A large transaction takes long to publish: the server hears from
		// the relay all the same, at the old position, so that it does not
		// end the session at its wal_sender_timeout.
		if time.Since(s.told) >= s.every {
			if err := s.tell(ctx); err != nil {
				return err
			}
		}
	}
	s.txnDone += len(s.txn)
	s.txn, s.tables, s.txnBytes = s.txn[:0], s.tables[:0], 0
	if s.marks != nil && (len(s.sentIDs) > 0 || end != 0 && s.txnDone > 0) {
		s.marks.delivered(ctx, s.sentIn, s.sentIDs, end)  // a part's (end 0) moves no position
		s.sentIn, s.sentIDs = s.sentIn[:0], s.sentIDs[:0] // the marks copied them
	}
	if end == 0 {
		return nil // a part: the rest of the transaction, and its COMMIT, to come
	}
	if s.marks == nil {
		res.marked = res.published // confirmed, as far as the relay goes
	}
	s.inTxn = false
	s.confirmed = end
	s.completed++
	if time.Since(s.told) >= statusAfterDelivery {
		return s.tell(ctx)
	}
	return nil
}

// batchOf is how many of msgs, from the first and at most limit, go in one
// batch: up to the first message whose aggregate is already in it. A batch
// is sent before any of its acks is read, so the broker may store a message
// after one it refused; with no aggregate twice in a batch, that breaks no
// order a consumer relies on (rows with no aggregate are in no order).
func batchOf(msgs []Message, limit int) int {
	seen := map[string]bool{}
	n := 0
	for _, m := range msgs[:min(len(msgs), limit)] {
		if m.Aggregate != "" {
			if seen[m.Aggregate] {
				break
			}
			seen[m.Aggregate] = true
		}
		n++
	}
	return n
}

// park counts the broker's refusal of the transaction's row i in MarkIn,
// within PublishTimeout, and, once the row's rejections reach ParkAfter,
// parks it, logs it and reports true: the relay then skips it. Without MarkIn or ParkAfter, or if
// the count cannot be written, it reports false, and the refusal stops the
// session as any failure does.
func (s *stream) park(ctx context.Context, i int, refusal error) bool {
	r := s.relay
	if r.MarkIn == nil || r.ParkAfter <= 0 {
		return false
	}
	msg := s.txn[i]
	var parked bool
	ctx, cancel := context.WithTimeout(ctx, orDefault(r.PublishTimeout, DefaultPassTimeout))
	defer cancel()
	err := r.MarkIn.QueryRowContext(ctx, `UPDATE `+s.tables[i]+`
		SET attempts = attempts + 1, rejections = rejections + 1, last_error = $2,
		    parked_at = CASE WHEN rejections + 1 >= $3 THEN clock_timestamp() END
		WHERE id = $1 RETURNING parked_at IS NOT NULL`, msg.ID, refusal.Error(), r.ParkAfter).Scan(&parked)
	if err != nil {
		if r.Logger != nil {
			r.Logger.Error("outbox: log relay could not count a rejection", "id", msg.ID, "err", err)
		}
		return false
	}
	if parked && r.Logger != nil {
		r.Logger.Warn("outbox: message parked after too many rejections", "id", msg.ID, "key", msg.Key, "err", refusal)
	}
	return parked
}

// safe is the position the server may hear of: how far the relay
// delivered, or, with MarkIn, how far it delivered and marked.
func (s *stream) safe() pglogrepl.LSN {
	if s.marks == nil || s.marks.idle() {
		return s.confirmed
	}
	return s.marks.markedTo
}

// tell sends the server the position the relay has delivered up to (safe,
// or the position it told before if that is further): the server may
// forget the log before it, and starts there next time. Before the relay
// delivered anything the position is 0, which the server takes for none:
// the slot keeps its own. Each update asks the server for an answer, so
// that a connection that went silent is noticed (ReplyTimeout).
func (s *stream) tell(ctx context.Context) error {
	if s.marks != nil {
		s.marks.poll(ctx)
	}
	pos := max(s.safe(), s.toldPos)
	s.told = time.Now()
	if s.asked.IsZero() {
		s.asked = s.told
	}
	if err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn,
		pglogrepl.StandbyStatusUpdate{WALWritePosition: pos, ReplyRequested: true}); err != nil {
		return fmt.Errorf("log relay: tell the server its position: %w", err)
	}
	s.toldPos = pos
	return nil
}

// decodeRow is an inserted outbox row as a Message, from pgoutput's text
// form of its columns.
func decodeRow(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) (Message, error) {
	var msg Message
	if tuple == nil || len(tuple.Columns) != len(rel.Columns) {
		return msg, fmt.Errorf("log relay: a row of %s.%s that does not match its description", rel.Namespace, rel.RelationName)
	}
	var traceparent, tracestate string
	for i, col := range tuple.Columns {
		if col.DataType != pglogrepl.TupleDataTypeText {
			continue // NULL ('n'); an insert sends no unchanged TOAST ('u')
		}
		v := string(col.Data)
		var err error
		switch rel.Columns[i].Name {
		case "id":
			msg.ID, err = strconv.ParseInt(v, 10, 64)
		case "message_key":
			msg.Key = v
		case "type":
			msg.Type = v
		case "payload":
			msg.Payload = v
		case "aggregate":
			msg.Aggregate = v
		case "seq":
			msg.Seq, err = strconv.ParseInt(v, 10, 64)
		case "traceparent":
			traceparent = v
		case "tracestate":
			tracestate = v
		}
		if err != nil {
			return msg, fmt.Errorf("log relay: column %s: %w", rel.Columns[i].Name, err)
		}
	}
	msg.TraceContext = claimedTraceContext(traceparent, tracestate)
	return msg, nil
}
