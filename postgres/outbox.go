// Package postgres is the Transactional Outbox on PostgreSQL, through
// database/sql: only the outbox, for a team to use on its own tables. It
// imports neither the root teaching package nor the example built on it
// (package shop, below this one), which reads as its first user, and its
// module requires neither. A team imports it, or copies its .go files
// (not the tests) and migrations/, which build alone.
//
// A producer writes its change and the event in one transaction: its own
// INSERT or UPDATE, then [InsertOutbox] (or [InsertOutboxFor], for events
// that keep their aggregate's order) in the same transaction, any
// [Executor]. An [OutboxRelay] publishes the unsent rows to a
// [MessageBroker] in id order and marks each sent only after the broker
// accepted it; [OutboxRelay.Run] is its loop, woken by NOTIFY at commit. A
// consumer applies each message once, by its key, with [ApplyOnce].
//
// What running it takes is here too: [Migrate] and [CheckSchema] for the
// outbox's tables, by the numbered files of migrations/, as a step of its
// own before the services start; [ReadLag] for a gauge; [DeleteSent] and
// [ForgetProcessed] for bounded cleanup; parking of the messages a broker
// rejects for ever ([ErrRejected], [OutboxRelay.ParkAfter], [ListParked],
// [Unpark], [DropParked]). The package's functions work on the table
// outbox ([DefaultOutbox]); an [Outbox] of another name ([NewOutbox]) has
// the same as methods, so that two outboxes share a database. [LogRelay]
// is the other relay, which reads the server's log. Package pgtest, below
// this one, gives tests a real server.
//
// What a real database adds, and the in-memory one of the lesson cannot
// show, is in the doc comments of [OutboxRelay], [Transaction] and
// [ApplyOnce]: ids are handed out when rows are inserted, not when
// transactions commit; several relays must claim rows, and a claim held by a
// connection must be bounded in time; a commit can fail with its outcome
// unknown ([ErrCommitUnknown]); a consumer must drop duplicates, by a key
// unique across producers ([Message.Key]); order holds per aggregate only if
// producers, relays and consumers each keep it ([InsertOutboxFor],
// [OutboxRelay.PerAggregate], [ApplyOnce]).
//
// The functions take a *sql.DB opened with pgx's stdlib driver
// (github.com/jackc/pgx/v5/stdlib), as the tests do: the relay passes the
// ids it marks as a []int64, which pgx sends as a PostgreSQL array. A team
// on pgx itself writes its rows with [InsertOutboxPgx] in its pgx.Tx and
// runs the relay on its pgxpool.Pool ([NewOutboxRelayPgx]).
package postgres

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// ErrCommitUnknown is wrapped by the error of a commit whose outcome is
// unknown: the request reached the server, or may have, and no answer came
// back (the connection died, the context ended). The transaction may have
// committed or not, and only a look at the database can tell; a caller that
// simply retries may write everything twice. An idempotency key, stored with
// the change under a unique constraint and looked up on the retry, makes a
// retry safe, as the example shop's idempotency key does.
var ErrCommitUnknown = errors.New("postgres: commit outcome unknown")

// Transaction runs fn in a READ COMMITTED transaction on db and commits it if
// fn returns nil. The isolation level is asked for explicitly, so a
// database whose default is stricter does not turn this module's waits
// into serialization failures.
//
// If fn returns an error, or panics, the transaction is rolled back and the
// error is returned unchanged (the panic goes on). If the commit fails with
// the server's own error, or the server answers it with a rollback (a
// statement had failed and fn went on: [pgx.ErrTxCommitRollback]), nothing
// fn wrote is kept; any other commit error wraps [ErrCommitUnknown], and
// then what fn wrote may be kept or not.
func Transaction(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	defer tx.Rollback() // after a commit this does nothing; otherwise it undoes fn's writes
	if err := fn(tx); err != nil {
		return err
	}
	return commit(tx)
}

// commit commits tx and tells an error the server sent, or a commit it
// turned into a rollback (the transaction was rolled back), from one it did
// not send (the outcome is unknown).
func commit(tx *sql.Tx) error {
	err := tx.Commit()
	switch {
	case err == nil:
		return nil
	case sqlState(err) != "", errors.Is(err, pgx.ErrTxCommitRollback):
		return fmt.Errorf("commit: %w", err)
	default:
		return fmt.Errorf("commit: %w: %w", ErrCommitUnknown, err)
	}
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

// Executor is what [InsertOutbox] and [InsertOutboxFor] need of the
// caller's transaction: the methods that database/sql's *sql.Tx, *sql.Conn
// and *sql.DB share, as do sqlc's generated DBTX and the transaction types
// of libraries built on database/sql. So a team's own transaction, however
// its code opens it, writes the outbox row beside its own change. Give it
// the transaction that writes the change: a *sql.DB would write the row in
// a transaction of its own, which is the dual write again.
type Executor interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// ErrInvalidEventType is returned, wrapped, by [InsertOutbox] and
// [InsertOutboxFor] for an event type that a broker could not route: one
// that is not words of letters, digits, '_' and '-' joined by single dots
// ("UserRegistered", "user.registered"), or is longer than [MaxEventTypeLen]
// bytes. A broker names its destination after the type (JetStream's
// subject outbox.<type>), and a space or a wildcard there would hold the
// row in the outbox for ever; refused at insert, the caller's transaction
// learns of it while it can still roll back.
var ErrInvalidEventType = errors.New("postgres: event type no broker can route")

// MaxEventTypeLen is the longest event type, in bytes.
const MaxEventTypeLen = 200

// ErrInvalidPayload is returned, wrapped, by [InsertOutbox] and
// [InsertOutboxFor] for a payload given as JSON text ([]byte or
// json.RawMessage) that is not valid JSON: stored, it would reach every
// consumer as a message none can read. Nothing is written.
var ErrInvalidPayload = errors.New("postgres: payload is not valid JSON")

// ErrInvalidSeq is returned, wrapped, by [InsertOutboxFor] for a seq below
// 1: an aggregate's events are numbered from 1, and a consumer
// ([ApplyOnce]) refuses any other as malformed. Nothing is written.
var ErrInvalidSeq = errors.New("postgres: an aggregate's seq starts at 1")

// InsertOutbox adds an unsent message of the given type to the outbox table,
// with payload encoded as JSON (a []byte or json.RawMessage is taken as JSON
// text already, and stored as it is), inside tx (the caller's transaction, any
// [Executor]), and returns the new row's id. The row is written, and seen
// by the relay, only if tx commits. The row keeps the W3C trace context of
// ctx's span, if it has one, for the relay's publish to join its trace. A
// type no broker can route is refused with [ErrInvalidEventType] before any
// statement is sent, and so is JSON text that is not valid, with
// [ErrInvalidPayload].
func InsertOutbox(ctx context.Context, tx Executor, eventType string, payload any) (int64, error) {
	return DefaultOutbox.Insert(ctx, tx, eventType, payload)
}

// InsertOutboxFor is InsertOutbox for an event that must keep its place
// among the events of its aggregate, such as "account/17": the row carries the
// aggregate and seq, the event's number among them (1 for the first); a seq
// below 1 is refused with [ErrInvalidSeq] before any statement is sent.
//
// The caller must hold the aggregate's row lock in tx (SELECT ... FOR UPDATE,
// or an UPDATE of its row) from before this insert until tx ends: then a later event of the aggregate takes its id only
// after this one committed, so one aggregate's ids follow its commits, and
// the seq read under the lock is not taken twice.
func InsertOutboxFor(ctx context.Context, tx Executor, aggregate string, seq int64, eventType string, payload any) (int64, error) {
	return DefaultOutbox.InsertFor(ctx, tx, aggregate, seq, eventType, payload)
}

// PgxQuerier is what [InsertOutboxPgx] and [InsertOutboxForPgx] need of
// the caller's transaction when it is pgx's own rather than database/sql's:
// pgx.Tx has it, and so have *pgx.Conn and pgxpool's pool and connection.
// As with [Executor], give it the transaction that writes the change.
type PgxQuerier interface {
	QueryRow(ctx context.Context, query string, args ...any) pgx.Row
}

// InsertOutboxPgx is [InsertOutbox] in a transaction of pgx's own (a
// pgx.Tx), for a team that uses pgx or pgxpool directly.
func InsertOutboxPgx(ctx context.Context, tx PgxQuerier, eventType string, payload any) (int64, error) {
	return DefaultOutbox.InsertPgx(ctx, tx, eventType, payload)
}

// InsertOutboxForPgx is [InsertOutboxFor] in a transaction of pgx's own.
func InsertOutboxForPgx(ctx context.Context, tx PgxQuerier, aggregate string, seq int64, eventType string, payload any) (int64, error) {
	return DefaultOutbox.InsertForPgx(ctx, tx, aggregate, seq, eventType, payload)
}

// rowScanner is a row that a statement returned: *sql.Row, or pgx.Row.
type rowScanner interface{ Scan(dest ...any) error }

// queryRow runs a statement that returns one row, in the caller's
// transaction, database/sql's or pgx's.
type queryRow func(ctx context.Context, query string, args ...any) rowScanner

func sqlQueryRow(tx Executor) queryRow {
	return func(ctx context.Context, query string, args ...any) rowScanner {
		return tx.QueryRowContext(ctx, query, args...)
	}
}

func pgxQueryRow(tx PgxQuerier) queryRow {
	return func(ctx context.Context, query string, args ...any) rowScanner {
		return tx.QueryRow(ctx, query, args...)
	}
}

func (o *Outbox) insert(ctx context.Context, tx queryRow, aggregate sql.NullString, seq int64, eventType string, payload any) (int64, error) {
	if !routable(eventType) {
		return 0, fmt.Errorf("%w: %q", ErrInvalidEventType, eventType)
	}
	if aggregate.Valid && seq < 1 {
		return 0, fmt.Errorf("%w: %s seq %d", ErrInvalidSeq, aggregate.String, seq)
	}
	data, err := encodePayload(payload)
	if err != nil {
		return 0, fmt.Errorf("encode %s payload: %w", eventType, err)
	}
	var id int64
	// Without a trace the row's trace columns are NULL, their default: the
	// statement then names only the columns of migration 1, and writes on
	// a database that migration 3 has not reached yet.
	if parent, state := storedTraceContext(ctx); parent != "" {
		err = tx(ctx, o.sql.insertTracedRow, eventType, string(data), aggregate, seq,
			parent, sql.NullString{String: state, Valid: state != ""}).Scan(&id)
	} else {
		err = tx(ctx, o.sql.insertRow, eventType, string(data), aggregate, seq).Scan(&id)
	}
	if err != nil {
		return 0, fmt.Errorf("insert into %s: %w", o.table, err)
	}
	return id, nil
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
		return nil, fmt.Errorf("%w: %.40q", ErrInvalidPayload, raw)
	}
	return raw, nil
}

// insertRow and insertTracedRow write an outbox row, the second with the
// trace context of the transaction that writes it.
const (
	insertRow       = `INSERT INTO outbox (type, payload, aggregate, seq) VALUES ($1, $2, $3, NULLIF($4, 0)) RETURNING id`
	insertTracedRow = `INSERT INTO outbox (type, payload, aggregate, seq, traceparent, tracestate) VALUES ($1, $2, $3, NULLIF($4, 0), $5, $6) RETURNING id`
)

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
