// Package postgres is the Transactional Outbox on PostgreSQL, on pgx's
// pool or on database/sql: only the outbox, for a team to use on its own
// tables. It imports neither the root teaching package nor the example
// built on it (package shop, below this one), which reads as its first
// user, and its module requires neither. A team imports it, or copies its
// .go files (not the tests) and migrations/, which build alone.
//
// An [Outbox] is one outbox table of one database, made once by [Open]
// (a *pgxpool.Pool) or [OpenDB] (a *sql.DB opened with pgx's stdlib
// driver) from a [Config] that is checked there; its methods are the same
// whichever the driver. A producer writes its change and the [Event] in one
// transaction: its own INSERT or UPDATE, then [Outbox.Write] in the same
// transaction, a pgx.Tx or a *sql.Tx ([PgxTx], [SQLTx]), which a pool or a
// *sql.DB is not, so that the event cannot be written beside the
// transaction. An [OutboxRelay] ([Outbox.NewRelay]) publishes the unsent
// rows to a [MessageBroker] in id order and marks each sent only after the
// broker accepted it; [OutboxRelay.Run] is its loop, woken by NOTIFY at
// commit. A consumer applies each message once, by its key, in its own
// transaction ([Outbox.ApplyOnceIn]).
//
// What running it takes is on the Outbox too: [Outbox.Migrate] and
// [Outbox.CheckSchema] for its tables, by the numbered files of
// migrations/, as a step of its own before the services start;
// [Outbox.ReadLag] and [Outbox.ObserveLag] for a gauge; [Outbox.DeleteSent]
// and [Outbox.ForgetProcessed] for bounded cleanup; parking of the
// messages a broker rejects for ever ([ErrRejected],
// [RelayConfig.ParkAfter], [Outbox.ListParked], [Outbox.Unpark],
// [Outbox.DropParked]). Two Outboxes of different tables share a database,
// each with its own relays, lag and cleanup. [LogRelay] is the other relay,
// which reads the server's log. Package pgtest, below this one, gives tests
// a real server.
//
// Every operation on an outbox table is a method of its Outbox, and no
// event is written but by [Outbox.Write] in the caller's transaction. The
// package's other functions write no event: [Transaction] and
// [TransactionPgx] (a READ COMMITTED transaction on a *sql.DB or pgx's
// pool, its commit's unknown outcome said), [Commit] (the same reading of
// a commit, for a pgx transaction of the caller's own),
// [ContextWithTrace], [NewConsumerTelemetry] for a consumer's spans, and
// [NewMigrationSet] for a team's own numbered migrations.
//
// What a real database adds, and the in-memory one of the lesson cannot
// show, is in the doc comments of [OutboxRelay], [Transaction] and
// [Outbox.ApplyOnce]: ids are handed out when rows are inserted, not when
// transactions commit; several relays must claim rows, and a claim held by a
// connection must be bounded in time; a commit can fail with its outcome
// unknown ([ErrCommitUnknown]); a consumer must drop duplicates, by a key
// unique across producers ([Message.Key]); order holds per aggregate only if
// producers, relays and consumers each keep it ([Event.Aggregate],
// the relay's order per aggregate, [Outbox.ApplyOnce]).
package postgres

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// ErrCommitUnknown is wrapped by the error of a commit whose outcome is
// unknown: the request reached the server, or may have, and no answer came
// back (the connection died, the context ended). The transaction may have
// committed or not, and only a look at the database can tell; a caller that
// simply retries may write everything twice. An idempotency key, stored with
// the change under a unique constraint and looked up on the retry, makes a
// retry safe, as the example shop's idempotency key does.
var ErrCommitUnknown = errors.New("postgres: commit outcome unknown")

// Transaction runs fn in a READ COMMITTED transaction on db and commits it
// if fn returns nil; fn gets ctx, for its statements. The isolation level is
// asked for explicitly, so a database whose default is stricter does not
// turn this module's waits into serialization failures.
//
// If fn returns an error, or panics, the transaction is rolled back and the
// error is returned unchanged (the panic goes on). The commit's error is
// read as [Commit] reads it: wrapping [ErrCommitUnknown] when what fn
// wrote may be kept or not.
func Transaction(ctx context.Context, db *sql.DB, fn func(ctx context.Context, tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	defer tx.Rollback() // after a commit this does nothing; otherwise it undoes fn's writes
	if err := fn(ctx, tx); err != nil {
		return err
	}
	return commitError(tx.Commit())
}

// TransactionPgx is [Transaction] on pgx's pool: fn runs in a READ
// COMMITTED transaction of p, committed if fn returns nil, rolled back
// otherwise (fn's error returned unchanged, a panic going on), and the
// commit's error read as [Commit] reads it.
func TransactionPgx(ctx context.Context, p *pgxpool.Pool, fn func(ctx context.Context, tx pgx.Tx) error) error {
	tx, err := p.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return err
	}
	defer (pgxTxn{tx}).rollback() // after a commit this does nothing; otherwise it undoes fn's writes
	if err := fn(ctx, tx); err != nil {
		return err
	}
	return Commit(ctx, tx)
}

// Commit commits the caller's pgx transaction tx and says what became of
// it. nil: it committed. An error that does not wrap [ErrCommitUnknown]:
// nothing tx wrote is kept, since the server answered the COMMIT with an
// error of its own (a deferred constraint, a serialization failure) or
// with a rollback (a statement had failed and the caller went on:
// [pgx.ErrTxCommitRollback]), or the server said it had ended the session
// while it sat idle in its transaction (25P03), rolling it back. An error
// wrapping ErrCommitUnknown: the
// COMMIT was sent, or may have been, and the answer says only that the
// session ended (the connection broke, the context ended, or the server or
// a pooler ended the session: a FATAL, a code of class 08 such as
// PgBouncer's "server conn crashed?", 08P01, or 57P01 to 57P03), which
// the server may say after it committed. Only a look at the database can
// tell then, or a retry that an idempotency key makes safe. [Transaction]
// and [TransactionPgx] read their commits so, and so does every commit of
// this package.
func Commit(ctx context.Context, tx PgxTx) error {
	if tx == nil {
		return errNoTx
	}
	return commitError(tx.Commit(ctx))
}

// commitError reads the error of a commit, as Commit says.
func commitError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, pgx.ErrTxCommitRollback), sqlState(err) != "" && !sessionEnded(err):
		return fmt.Errorf("commit: %w", err)
	default:
		return fmt.Errorf("commit: %w: %w", ErrCommitUnknown, err)
	}
}

// sessionEnded reports whether err is the word of a server, or of a pooler
// in front of it, that the session has ended, which may come after the
// server committed: a FATAL or PANIC, or a code of class 08 (connection
// exception) or 57P01 to 57P03 (the server shutting down, crashed, or not
// yet taking connections). A session ended while it sat idle in its
// transaction (25P03) had its transaction rolled back before any COMMIT.
func sessionEnded(err error) bool {
	code := sqlState(err)
	if code == "25P03" {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC") {
		return true
	}
	return strings.HasPrefix(code, "08") || code == "57P01" || code == "57P02" || code == "57P03"
}

// sqlState is the SQLSTATE code of the server's error in err's chain, or ""
// if the server sent none. pgx's *pgconn.PgError, like other drivers' errors,
// has a SQLState method.
func sqlState(err error) string {
	var server interface{ SQLState() string }
	if errors.As(err, &server) {
		return server.SQLState()
	}
	return ""
}

// DefaultTable is the outbox table of a [Config] whose Table is empty,
// and the one the package's functions use.
const DefaultTable = "outbox"

// Config is what an [Outbox] is made of. The zero Config is the table
// outbox with every default; [Open] and [OpenDB] check it and refuse a
// bad value with an error that names it. An Outbox keeps a copy: changing
// a Config afterwards changes nothing.
type Config struct {
	// Table is the outbox's table, "" for DefaultTable: a name of
	// lowercase letters, digits and '_' that starts with a letter, at most
	// 40 bytes, so that the names made from it (its indexes, trigger,
	// channel, publication, slot, and <table>_migrations) fit
	// PostgreSQL's 63.
	Table string
	// CleanupBatch is how many rows DeleteSent and ForgetProcessed delete
	// in one transaction; 0 means DefaultCleanupBatch. At most 100,000.
	CleanupBatch int
	// Consumer names the consumer whose records ApplyOnce, ApplyOnceIn,
	// ApplyBatch, ForgetProcessed and ForgetPosition read and write: the
	// keys it applied and the positions of the aggregates it follows, in
	// the database's processed_messages and aggregate_positions. "" is the
	// default consumer, whose records are all those written before
	// migration 9. Two consumers of the same events in one database (a
	// mailer beside the billing) each need a name of their own: with
	// one name, the second finds the first's records and drops every
	// message as a copy. At most 63 bytes of letters, digits, '_', '-' and
	// '.'.
	Consumer string
}

// maxCleanupBatch bounds Config.CleanupBatch, so that no cleanup holds a
// transaction over more rows than that.
const maxCleanupBatch = 100_000

// An Outbox is one outbox table of one database: the table, and what is
// named after it (its indexes, its NOTIFY trigger and channel, the
// publication and slot of the log relay, the record of its migrations).
// T is the caller's transaction in which events are written and messages
// applied: [PgxTx] for an Outbox made by [Open], [SQLTx] for one made by
// [OpenDB]. Its methods are the same whichever the driver.
//
// An Outbox is immutable and safe for concurrent use. The zero Outbox is
// not usable: make one with Open or OpenDB.
type Outbox[T any] struct {
	t            *tables
	db           pool
	sqldb        func() (*sql.DB, func())         // db as database/sql, for the log relay's marks and slot, and what releases it
	tx           func(T) txn                      // the caller's transaction, as the statements take it
	begin        func(context.Context) (T, error) // a READ COMMITTED transaction of the Outbox's own
	cleanupBatch int
	consumer     string // Config.Consumer
}

// PgxTx is the caller's pgx transaction, as [Outbox.Write] and
// [Outbox.ApplyOnceIn] need it: pgx.Tx has it (pgxpool's transactions
// too), and so has what wraps one. A *pgxpool.Pool, a *pgxpool.Conn and a
// *pgx.Conn do not (they have no Commit), so that an event cannot be
// written in a transaction of its own by mistake.
type PgxTx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Commit(ctx context.Context) error
	Rollback(ctx context.Context) error
}

// SQLTx is the caller's database/sql transaction, as [Outbox.Write] and
// [Outbox.ApplyOnceIn] need it: *sql.Tx has it, and so has what embeds one
// (sqlx's *Tx). A *sql.DB and a *sql.Conn do not (they have no Commit), so
// that an event cannot be written in a transaction of its own by mistake.
type SQLTx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	Commit() error
	Rollback() error
}

// Open returns the Outbox that cfg describes on p, whose events are
// written in the caller's pgx transactions. It checks cfg, and refuses a bad
// value, or a nil p, with an error wrapping [ErrInvalidConfig] that names
// it; it sends nothing to the server ([Outbox.CheckSchema] does).
func Open(p *pgxpool.Pool, cfg Config) (*Outbox[PgxTx], error) {
	if p == nil {
		return nil, fmt.Errorf("%w: Open: no pool", ErrInvalidConfig)
	}
	o, err := newOutbox(pgxPool{p}, cfg, func(tx PgxTx) txn { return pgxTxn{tx} })
	if err != nil {
		return nil, err
	}
	o.begin = func(ctx context.Context) (PgxTx, error) {
		return p.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	}
	o.sqldb = func() (*sql.DB, func()) {
		// A *sql.DB runs a goroutine of its own until it is closed; closed,
		// this one leaves p open (its connector does not close p).
		db := stdlib.OpenDBFromPool(p)
		return db, func() { db.Close() }
	}
	return o, nil
}

// OpenDB returns the Outbox that cfg describes on db, whose events are
// written in the caller's database/sql transactions. db must be opened with
// pgx's stdlib driver (github.com/jackc/pgx/v5/stdlib: stdlib.OpenDB,
// stdlib.OpenDBFromPool, or sql.Open("pgx", …)): the relay sends the ids it
// marks as a []int64, which pgx alone turns into a PostgreSQL array, and
// listens on pgx's own connection. It checks cfg and the driver, and
// refuses a bad value, or a nil db, with an error wrapping
// [ErrInvalidConfig] that names it; it sends nothing to the server.
func OpenDB(db *sql.DB, cfg Config) (*Outbox[SQLTx], error) {
	if db == nil {
		return nil, fmt.Errorf("%w: OpenDB: no database", ErrInvalidConfig)
	}
	if err := (sqlPool{db}).check(); err != nil {
		return nil, fmt.Errorf("%w: OpenDB: %w", ErrInvalidConfig, err)
	}
	o, err := newOutbox(sqlPool{db}, cfg, func(tx SQLTx) txn { return sqlTxn{tx} })
	if err != nil {
		return nil, err
	}
	o.begin = sqlBegin(db)
	o.sqldb = callersDB(db)
	return o, nil
}

func newOutbox[T any](db pool, cfg Config, tx func(T) txn) (*Outbox[T], error) {
	t := defaultTables
	if cfg.Table != "" && cfg.Table != DefaultTable {
		var err error
		if t, err = newTables(cfg.Table); err != nil {
			return nil, err
		}
	}
	if cfg.CleanupBatch < 0 || cfg.CleanupBatch > maxCleanupBatch {
		return nil, fmt.Errorf("%w: Config.CleanupBatch %d: want 1 to %d, or 0 for %d", ErrInvalidConfig,
			cfg.CleanupBatch, maxCleanupBatch, DefaultCleanupBatch)
	}
	if cfg.Consumer != "" && !consumerName.MatchString(cfg.Consumer) {
		return nil, fmt.Errorf("%w: Config.Consumer %q: want letters, digits, '_', '-' and '.', at most 63 bytes", ErrInvalidConfig, cfg.Consumer)
	}
	return &Outbox[T]{t: t, db: db, tx: tx, cleanupBatch: orDefault(cfg.CleanupBatch, DefaultCleanupBatch), consumer: cfg.Consumer}, nil
}

// consumerName is what Config.Consumer may be.
var consumerName = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,63}$`)

// Consumer is the consumer whose records o's consumer methods keep
// (Config.Consumer): "" for the default one.
func (o *Outbox[T]) Consumer() string { return o.consumer }

// sqlOutbox is the table outbox of db, as the package's functions use it.
func sqlOutbox(db *sql.DB, cleanupBatch int) *Outbox[SQLTx] {
	var p pool
	if db != nil {
		p = sqlPool{db}
	}
	return &Outbox[SQLTx]{t: defaultTables, db: p, sqldb: callersDB(db), tx: func(tx SQLTx) txn { return sqlTxn{tx} },
		begin: sqlBegin(db), cleanupBatch: orDefault(cleanupBatch, DefaultCleanupBatch)}
}

// callersDB is db, the caller's own, as an Outbox's sqldb: its release
// leaves it open.
func callersDB(db *sql.DB) func() (*sql.DB, func()) {
	return func() (*sql.DB, func()) { return db, func() {} }
}

// sqlBegin begins READ COMMITTED transactions on db.
func sqlBegin(db *sql.DB) func(context.Context) (SQLTx, error) {
	return func(ctx context.Context) (SQLTx, error) {
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			return nil, err // not a nil *sql.Tx in a non-nil SQLTx
		}
		return tx, nil
	}
}

// errNotOpened is the error of an Outbox's methods on one not made by
// Open or OpenDB.
var errNotOpened = fmt.Errorf("%w: an Outbox made neither by Open nor by OpenDB", ErrInvalidConfig)

// errNoTx is the error of a method given no transaction.
var errNoTx = errors.New("postgres: no transaction: the event and the message are written in the caller's")

// usable reports errNotOpened for an Outbox not made by Open or OpenDB.
func (o *Outbox[T]) usable() error {
	if o == nil || o.db == nil || o.t == nil {
		return errNotOpened
	}
	return nil
}

// Table is the outbox's table; Channel the channel its trigger notifies at
// each commit that inserted rows, which [OutboxRelay.Run] listens on;
// Publication the publication of its inserts, which the log relay reads;
// Slot the log relay's default replication slot.
func (o *Outbox[T]) Table() string       { return o.t.table }
func (o *Outbox[T]) Channel() string     { return o.t.table }
func (o *Outbox[T]) Publication() string { return o.t.table + "_inserts" }
func (o *Outbox[T]) Slot() string        { return o.t.table }

// An Event is what a producer writes to the outbox in its transaction
// ([Outbox.Write]): a message of type Type whose body is Payload.
type Event struct {
	// Type names the event, such as "UserRegistered" or "user.registered":
	// words of letters, digits, '_' and '-' joined by single dots, at most
	// MaxEventTypeLen bytes, since a broker names its destination after it.
	Type string
	// Payload is the event's body, stored as JSON: a []byte or
	// json.RawMessage is taken as JSON text already (and must be valid),
	// anything else goes through json.Marshal. With a ContentType that is
	// not JSON's, it is bytes instead, a []byte or a string, stored and
	// delivered byte for byte.
	Payload any
	// ContentType is the payload's media type, such as
	// "application/x-protobuf" or "application/avro": empty means JSON
	// ("application/json"). The brokers carry it (RabbitMQ's content_type,
	// a NATS header content-type) and Message.ContentType gives it back.
	ContentType string
	// Headers are the team's own headers, such as a tenant or a schema
	// version, which every broker carries unchanged beside the payload and
	// Message.Headers gives back: at most MaxHeaders, each name 1 to
	// MaxHeaderNameLen bytes of letters, digits, '-', '_' and '.', none of
	// the brokers' own names, each value UTF-8 text of at most
	// MaxHeaderValueLen bytes (see ErrInvalidHeader).
	Headers map[string]string
	// Aggregate, if not empty, is the entity whose events must keep their
	// order, such as "account/17", and Seq the event's number among them,
	// from 1. Without an Aggregate, Seq must be 0.
	Aggregate string
	Seq       int64
	// DeliverAt, if not zero and still to come when the row is written, is
	// the earliest time the event may go to the broker: no relay claims the
	// row before it. A relay with order per aggregate (the default), and
	// the log relay unless Unmarked, hold the aggregate's later events
	// behind it too, so they go out after it; a relay with WholeTable
	// publishes them as they come (see LogRelay). The first relay pass after its time releases the row,
	// at its place by id, and the next publishes it: Run passes at least
	// every PollInterval, and at once after a release. A time already
	// passed is no time at all.
	DeliverAt time.Time
}

// Write adds e to the outbox as an unsent row, inside tx (the caller's
// transaction, which writes the change the event tells of), and returns the
// row's id. The row is written, and seen by a relay, only if tx commits.
// The row keeps the W3C trace context of ctx's span, if it has one, for the
// relay's publish to join its trace.
//
// An event that is not valid is refused before any statement is sent, and
// nothing is written: a type no broker can route ([ErrInvalidEventType]),
// JSON text that is not valid ([ErrInvalidPayload]), a Seq below 1 with an
// Aggregate, or one without ([ErrInvalidSeq]), a header a broker cannot
// carry ([ErrInvalidHeader]), a content type that is not a media type
// ([ErrInvalidContentType]), a time to deliver out of range
// ([ErrInvalidDeliverAt]).
//
// With an Aggregate, the caller must hold the aggregate's row lock in tx
// (SELECT ... FOR UPDATE, or an UPDATE of its row) from before this write
// until tx ends: then a later event of the aggregate takes its id only
// after this one committed, so one aggregate's ids follow its commits, and
// the Seq read under the lock is not taken twice.
func (o *Outbox[T]) Write(ctx context.Context, tx T, e Event) (int64, error) {
	if err := o.usable(); err != nil {
		return 0, err
	}
	if any(tx) == nil {
		return 0, errNoTx
	}
	return o.t.insert(ctx, o.tx(tx), e)
}

// ErrInvalidEventType is returned, wrapped, by [Outbox.Write] for an event type
// that a broker could not route: one that is not words of letters, digits, '_'
// and '-' joined by single dots ("UserRegistered", "user.registered"), or is
// longer than [MaxEventTypeLen] bytes. A broker names its destination after the
// type (JetStream's subject outbox.<type>), and a space or a wildcard there
// would hold the row in the outbox for ever; refused at insert, the caller's
// transaction learns of it while it can still roll back.
var ErrInvalidEventType = errors.New("postgres: event type no broker can route")

// MaxEventTypeLen is the longest event type, in bytes.
const MaxEventTypeLen = 200

// ErrInvalidPayload is returned, wrapped, by [Outbox.Write] for a payload given
// as JSON text ([]byte or json.RawMessage) that is not valid JSON: stored, it
// would reach every consumer as a message none can read; and for a payload
// of a content type that is not JSON's that is neither a []byte nor a
// string. Nothing is written.
var ErrInvalidPayload = errors.New("postgres: invalid payload")

// ErrInvalidSeq is returned, wrapped, by [Outbox.Write] for a seq below 1 with
// an aggregate, or any seq without one: an aggregate's events are numbered from
// 1, and a consumer ([Outbox.ApplyOnce]) refuses any other as malformed. Nothing is
// written.
var ErrInvalidSeq = errors.New("postgres: an aggregate's seq starts at 1")

// ErrInvalidDeliverAt is returned, wrapped, by [Outbox.Write] for an
// Event.DeliverAt outside the years 1 to 9999, which RFC 3339 cannot write.
// Nothing is written.
var ErrInvalidDeliverAt = errors.New("postgres: time to deliver out of range")

// rowQuerier runs a statement that returns one row: all that writing an
// event needs.
type rowQuerier interface {
	queryRow(ctx context.Context, query string, args ...any) rowScanner
}

// rowScanner is a row that a statement returned: *sql.Row, or pgx.Row.
type rowScanner interface{ Scan(dest ...any) error }

func (o *tables) insert(ctx context.Context, tx rowQuerier, e Event) (int64, error) {
	query, args, err := o.statement(ctx, e)
	if err != nil {
		return 0, err
	}
	var id int64
	if err := tx.queryRow(ctx, query, args...).Scan(&id); err != nil {
		return 0, fmt.Errorf("insert into %s: %w", o.table, err)
	}
	return id, nil
}

// statement is the insert of e's row and its arguments, or what e breaks
// of Write's rules.
func (o *tables) statement(ctx context.Context, e Event) (string, []any, error) {
	if !routable(e.Type) {
		return "", nil, fmt.Errorf("%w: %q", ErrInvalidEventType, e.Type)
	}
	if e.Aggregate != "" && e.Seq < 1 {
		return "", nil, fmt.Errorf("%w: %s seq %d", ErrInvalidSeq, e.Aggregate, e.Seq)
	}
	if e.Aggregate == "" && e.Seq != 0 {
		return "", nil, fmt.Errorf("%w: seq %d of no aggregate", ErrInvalidSeq, e.Seq)
	}
	if y := e.DeliverAt.Year(); !e.DeliverAt.IsZero() && (y < 1 || y > 9999) {
		return "", nil, fmt.Errorf("%w: %s", ErrInvalidDeliverAt, e.DeliverAt)
	}
	if err := checkContentType(e.ContentType); err != nil {
		return "", nil, err
	}
	headers, err := checkHeaders(e.Headers)
	if err != nil {
		return "", nil, err
	}
	var data, body []byte
	contentType := e.ContentType
	if isJSON(contentType) {
		contentType = "" // JSON's, the default
		if data, err = encodePayload(e.Payload); err != nil {
			return "", nil, fmt.Errorf("encode %s payload: %w", e.Type, err)
		}
	} else if body, err = bytesPayload(e.Payload, e.ContentType); err != nil {
		return "", nil, err
	}
	aggregate := sql.NullString{String: e.Aggregate, Valid: e.Aggregate != ""}
	// Without a trace the row's trace columns are NULL, their default: the
	// statement then names only the columns of migration 1, and writes on
	// a database that migration 3 has not reached yet; and only an event
	// with a time to deliver, headers or bytes needs the columns of
	// migrations 7 and 8.
	parent, state := storedTraceContext(ctx)
	switch {
	case !e.DeliverAt.IsZero() || headers != nil || body != nil:
		var deliverAt any // NULL
		if !e.DeliverAt.IsZero() {
			deliverAt = e.DeliverAt
		}
		return o.sql.insertFullRow, []any{e.Type, nullString(string(data)), body,
			nullString(contentType), nullString(string(headers)), aggregate, e.Seq,
			nullString(parent), nullString(state), deliverAt}, nil
	case parent != "":
		return o.sql.insertTracedRow, []any{e.Type, string(data), aggregate, e.Seq, parent, nullString(state)}, nil
	}
	return o.sql.insertRow, []any{e.Type, string(data), aggregate, e.Seq}, nil
}

// encodePayload is payload as JSON text: a []byte or json.RawMessage as it
// is, if it is valid JSON, anything else through json.Marshal.
func encodePayload(payload any) ([]byte, error) {
	var raw []byte
	switch p := payload.(type) {
	case json.RawMessage:
		raw = p
	case []byte:
		raw = p
	default:
		return json.Marshal(payload)
	}
	if !json.Valid(raw) {
		return nil, fmt.Errorf("%w: not valid JSON: %.40q", ErrInvalidPayload, raw)
	}
	return raw, nil
}

// insertRow and insertTracedRow write an outbox row, the second with the
// trace context of the transaction that writes it; insertFullRow writes
// every column an Event can fill: a payload that is bytes (body, with its
// content_type), the team's headers, and a time to deliver, which it keeps
// only if the time is still to come.
const (
	insertRow       = `INSERT INTO outbox (type, payload, aggregate, seq) VALUES ($1, $2, $3, NULLIF($4, 0)) RETURNING id`
	insertTracedRow = `INSERT INTO outbox (type, payload, aggregate, seq, traceparent, tracestate) VALUES ($1, $2, $3, NULLIF($4, 0), $5, $6) RETURNING id`
	insertFullRow   = `INSERT INTO outbox (type, payload, body, content_type, headers, aggregate, seq, traceparent, tracestate, deliver_at)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, NULLIF($7, 0), $8, $9,
        CASE WHEN $10::timestamptz > clock_timestamp() THEN $10::timestamptz END) RETURNING id`
)

// nullString is s, or NULL if empty.
func nullString(s string) sql.NullString { return sql.NullString{String: s, Valid: s != ""} }

// bytesPayload is payload as the bytes of a content type that is not JSON:
// a []byte or a string, as it is.
func bytesPayload(payload any, contentType string) ([]byte, error) {
	switch p := payload.(type) {
	case []byte:
		if p == nil {
			p = []byte{}
		}
		return p, nil
	case string:
		return []byte(p), nil
	default:
		return nil, fmt.Errorf("%w: a %T for content type %s, which takes a []byte or a string", ErrInvalidPayload, payload, contentType)
	}
}

// routable reports whether t is words of letters, digits, '_' and '-'
// joined by single dots, at most MaxEventTypeLen bytes.
func routable(t string) bool {
	if t == "" || len(t) > MaxEventTypeLen {
		return false
	}
	for word := range strings.SplitSeq(t, ".") {
		if word == "" {
			return false
		}
		for _, c := range word {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
				return false
			}
		}
	}
	return true
}
