package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// An Outbox's database is either database/sql's *sql.DB, opened with pgx's
// stdlib driver (OpenDB), or pgx's own *pgxpool.Pool (Open), and so is the
// caller's transaction: the statements are the same on both, and this file
// is all that differs.

// pool is what a relay, and an [Outbox]'s operations, need of the
// database.
type pool interface {
	begin(ctx context.Context) (txn, error) // a READ COMMITTED transaction
	// inTx runs f in a READ COMMITTED transaction begun by pgx (a relay
	// pass's), which f commits or rolls back, and returns f's error or
	// the one that kept the transaction from beginning. ctx bounds the
	// wait for a connection and the BEGIN only: f's statements take
	// contexts of their own.
	inTx(ctx context.Context, f func(tx txn) error) error
	exec(ctx context.Context, query string) error
	stmts // one statement, in a transaction of its own
	listen(ctx context.Context, channel string, wake chan<- struct{}) (listened bool, err error)
	check() error // the pool's configuration, as validate checks it
	maxConns() int
}

// txn is a transaction: a pass's, a migration's, or the caller's own.
type txn interface {
	stmts
	exec(ctx context.Context, query string, args ...any) error
	commit(ctx context.Context) error
	rollback()
}

// stmts runs statements, in a transaction or on a pool.
type stmts interface {
	query(ctx context.Context, query string, args ...any) (rows, error)
	queryRow(ctx context.Context, query string, args ...any) rowScanner
	execN(ctx context.Context, query string, args ...any) (int64, error) // rows affected
}

// rows is a query's result, to be closed once read.
type rows interface {
	Next() bool
	Scan(...any) error
	Err() error
	Close()
}

// sqlPool is a *sql.DB as a relay's pool.
type sqlPool struct{ db *sql.DB }

func (p sqlPool) begin(ctx context.Context) (txn, error) {
	tx, err := p.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	return sqlTxn{tx}, err
}

// inTx runs f in a transaction that pgx begins on the connection beneath
// one of the database's connections (Conn.Raw), held for f's duration. A
// relay pass's statements, and the rows of its claim, then go through pgx
// as on a *pgxpool.Pool, not through database/sql, which hands each column
// over as a driver.Value and converts it again: that made a pass's client
// CPU a third more (BenchmarkPassCPU). A connection found broken as the
// transaction begins (one the server ended while it sat in the pool, whose
// FATAL error the BEGIN reads) is dropped and another taken, up to
// beginTries in all: a BEGIN on a connection that broke has done nothing,
// so trying it again on another is safe whatever the server had read. The
// connection goes back to the database after f, which closes it there and
// then if it broke, and before its next use if it was left in a
// transaction (the stdlib driver reports either as bad).
func (p sqlPool) inTx(ctx context.Context, f func(tx txn) error) error {
	return tryBegin(func(retry bool) (again bool, err error) {
		err = p.onPgx(ctx, func(conn *pgx.Conn) error {
			again, err = beginOn(ctx, conn, f, retry)
			if again {
				return driver.ErrBadConn // database/sql closes this one
			}
			return err
		})
		return again, err
	})
}

// onPgx runs f on the pgx connection beneath one of the database's
// connections, which goes back to the database after f: closed there and
// then if f returned driver.ErrBadConn. A database of another driver than
// pgx's stdlib gets an error wrapping errNotStdlib.
func (p sqlPool) onPgx(ctx context.Context, f func(conn *pgx.Conn) error) error {
	conn, err := p.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	return conn.Raw(func(driverConn any) error {
		sc, ok := driverConn.(*stdlib.Conn)
		if !ok { // check refuses such a database; listen meets it
			return fmt.Errorf("%w: the driver's connection is a %T", errNotStdlib, driverConn)
		}
		return f(sc.Conn())
	})
}

// errNotStdlib is onPgx's error for a database of another driver.
var errNotStdlib = errors.New("not a connection of pgx's stdlib driver")

// tryBegin calls try, on a connection of its own each time, until it
// reports that its connection did not break as the transaction began, at
// most beginTries times; retry tells try whether another try may follow.
func tryBegin(try func(retry bool) (again bool, err error)) error {
	for n := 1; ; n++ {
		if again, err := try(n < beginTries); !again {
			return err
		}
	}
}

// beginOn begins a READ COMMITTED transaction on conn and runs f in it,
// and reports whether to try again on another connection: conn broke as
// the transaction began, the context is still live, and retry allows it.
func beginOn(ctx context.Context, conn *pgx.Conn, f func(tx txn) error, retry bool) (again bool, err error) {
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return retry && conn.IsClosed() && ctx.Err() == nil, err
	}
	return false, f(pgxTxn{tx})
}

// beginTries is how many of a *sql.DB's connections a relay pass tries
// before it gives up beginning its transaction, each found broken as it
// began: database/sql's BeginTx tries as many, though only on connections
// it finds broken before it sends anything.
const beginTries = 3

func (p sqlPool) exec(ctx context.Context, query string) error {
	_, err := p.db.ExecContext(ctx, query)
	return err
}

func (p sqlPool) query(ctx context.Context, query string, args ...any) (rows, error) {
	r, err := p.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return sqlRows{r}, nil
}

func (p sqlPool) queryRow(ctx context.Context, query string, args ...any) rowScanner {
	return p.db.QueryRowContext(ctx, query, args...)
}

func (p sqlPool) execN(ctx context.Context, query string, args ...any) (int64, error) {
	return rowsAffected(p.db.ExecContext(ctx, query, args...))
}

// rowsAffected is how many rows a database/sql statement changed.
func rowsAffected(res sql.Result, err error) (int64, error) {
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (p sqlPool) check() error {
	if _, ok := p.db.Driver().(*stdlib.Driver); !ok {
		return fmt.Errorf("the database is opened with %T; the relay needs pgx's stdlib driver (stdlib.OpenDB, or sql.Open(\"pgx\", …))", p.db.Driver())
	}
	return nil
}

func (p sqlPool) maxConns() int { return p.db.Stats().MaxOpenConnections }

// listen listens on one of the pool's connections, taken out of the pool
// for good, until it fails.
func (p sqlPool) listen(ctx context.Context, channel string, wake chan<- struct{}) (listened bool, err error) {
	err = p.onPgx(ctx, func(pc *pgx.Conn) error {
		// Closed here whatever happens, so that the pool never hands out a
		// connection that is still listening.
		defer closeListener(pc)
		listened, err = listenOn(ctx, pc, channel, wake)
		return err
	})
	if errors.Is(err, errNotStdlib) {
		return false, fmt.Errorf("%w (%w)", errCannotListen, err)
	}
	return listened, err
}

// sqlTxn is a database/sql transaction as a txn: the relay's, or the
// caller's own ([SQLTx]).
type sqlTxn struct{ tx SQLTx }

func (t sqlTxn) query(ctx context.Context, query string, args ...any) (rows, error) {
	r, err := t.tx.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return sqlRows{r}, nil
}

func (t sqlTxn) queryRow(ctx context.Context, query string, args ...any) rowScanner {
	return t.tx.QueryRowContext(ctx, query, args...)
}

func (t sqlTxn) execN(ctx context.Context, query string, args ...any) (int64, error) {
	return rowsAffected(t.tx.ExecContext(ctx, query, args...))
}

func (t sqlTxn) exec(ctx context.Context, query string, args ...any) error {
	_, err := t.tx.ExecContext(ctx, query, args...)
	return err
}

func (t sqlTxn) commit(context.Context) error { return commitError(t.tx.Commit()) }
func (t sqlTxn) rollback()                    { _ = t.tx.Rollback() } // after a commit this does nothing

// sqlRows is *sql.Rows as rows.
type sqlRows struct{ *sql.Rows }

func (r sqlRows) Close() { _ = r.Rows.Close() }

// pgxPool is a *pgxpool.Pool as a relay's pool.
type pgxPool struct{ p *pgxpool.Pool }

func (p pgxPool) begin(ctx context.Context) (txn, error) {
	tx, err := p.p.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	return pgxTxn{tx}, err
}

// inTx runs f in a transaction on a connection of the pool. As on a
// *sql.DB, a connection found broken as the transaction begins is dropped
// (the pool destroys a closed connection released to it) and another
// taken, up to beginTries in all: pgxpool pings only a connection idle for
// over a second before it hands it out.
func (p pgxPool) inTx(ctx context.Context, f func(tx txn) error) error {
	return tryBegin(func(retry bool) (bool, error) {
		c, err := p.p.Acquire(ctx)
		if err != nil {
			return false, err
		}
		defer c.Release()
		return beginOn(ctx, c.Conn(), f, retry)
	})
}

func (p pgxPool) exec(ctx context.Context, query string) error {
	_, err := p.p.Exec(ctx, query)
	return err
}

func (p pgxPool) query(ctx context.Context, query string, args ...any) (rows, error) {
	r, err := p.p.Query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return r, nil
}

func (p pgxPool) queryRow(ctx context.Context, query string, args ...any) rowScanner {
	return p.p.QueryRow(ctx, query, args...)
}

func (p pgxPool) execN(ctx context.Context, query string, args ...any) (int64, error) {
	tag, err := p.p.Exec(ctx, query, args...)
	return tag.RowsAffected(), err
}

func (p pgxPool) check() error  { return nil }
func (p pgxPool) maxConns() int { return int(p.p.Config().MaxConns) }

// listen listens on one of the pool's connections, taken out of the pool
// for good (Hijack), until it fails.
func (p pgxPool) listen(ctx context.Context, channel string, wake chan<- struct{}) (listened bool, err error) {
	c, err := p.p.Acquire(ctx)
	if err != nil {
		return false, err
	}
	conn := c.Hijack()
	defer closeListener(conn)
	return listenOn(ctx, conn, channel, wake)
}

// pgxTxn is a pgx transaction as a txn: the relay's, or the caller's
// own ([PgxTx]).
type pgxTxn struct{ tx PgxTx }

func (t pgxTxn) query(ctx context.Context, query string, args ...any) (rows, error) {
	r, err := t.tx.Query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return r, nil
}

func (t pgxTxn) queryRow(ctx context.Context, query string, args ...any) rowScanner {
	return t.tx.QueryRow(ctx, query, args...)
}

func (t pgxTxn) execN(ctx context.Context, query string, args ...any) (int64, error) {
	tag, err := t.tx.Exec(ctx, query, args...)
	return tag.RowsAffected(), err
}

func (t pgxTxn) exec(ctx context.Context, query string, args ...any) error {
	_, err := t.tx.Exec(ctx, query, args...)
	return err
}

// commit commits as [Commit] says.
func (t pgxTxn) commit(ctx context.Context) error { return commitError(t.tx.Commit(ctx)) }

// rollback ends the transaction unless it was committed; it gets a second
// of its own, since the pass's context may have ended.
func (t pgxTxn) rollback() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = t.tx.Rollback(ctx)
}

// listenOn listens on conn for channel, wakes wake at each notification
// (and once as it starts listening, for what came while nothing listened),
// and returns when conn fails or ctx ends.
func listenOn(ctx context.Context, conn *pgx.Conn, channel string, wake chan<- struct{}) (listened bool, err error) {
	if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
		return false, fmt.Errorf("LISTEN %s: %w", channel, err)
	}
	notify(wake)
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return true, fmt.Errorf("wait for a notification: %w", err)
		}
		notify(wake)
	}
}

// closeListener closes a connection that listened, within a second.
func closeListener(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	conn.Close(ctx)
}
