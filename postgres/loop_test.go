package postgres_test

// The relay loop where a pass half-succeeds: the broker accepted and the
// mark failed, a refusal beside a failed mark, a budget cut, a pass that can
// never succeed; and the listener that Run keeps beside it.

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// A trigger stalls every mark of the outbox (a pg_sleep longer than the
// pass's budget, as a trigger that hangs on something of its own would):
// the claim goes through, the broker accepts, and the mark waits out the
// pass's limit (statement_timeout, the budget). Run counts
// no progress for such a pass: it backs off, doubling, and logs each failure
// at level Error with what the broker accepted and what was marked. After
// four failed passes the trigger goes, and the fifth pass marks: each message
// was published five times, once a backoff, and no more. With PerAggregate
// the same. (Caught: progress counted before the mark, which republished
// the claim in a loop with no wait and, with PerAggregate, no log line.)
func TestStuckMarkRepublishesOnceABackoffAndSaysWhy(t *testing.T) {
	for _, perAggregate := range []bool{false, true} {
		t.Run(fmt.Sprintf("PerAggregate=%v", perAggregate), func(t *testing.T) {
			db := newDatabase(t)
			place(t, db, 100, 200, 300)
			if _, err := db.Exec(`CREATE FUNCTION stall() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN PERFORM pg_sleep(10); RETURN NULL; END $$;
				CREATE TRIGGER stall BEFORE UPDATE OF sent_at ON outbox FOR EACH STATEMENT EXECUTE FUNCTION stall()`); err != nil {
				t.Fatal(err)
			}

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			inner := &recorder{}
			var publishes atomic.Int32
			broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
				if publishes.Add(1) > 100 { // a loop, not a backoff: stop it here
					cancel()
				}
				return inner.Publish(ctx, m)
			})
			var logs logBuffer
			relay := newRelay(t, db, broker, postgres.RelayConfig{WholeTable: !perAggregate,
				PassTimeout:  200 * time.Millisecond, // how long the mark waits
				PollInterval: time.Hour, PollOnly: true, Logger: slog.New(slog.NewTextHandler(&logs, nil))})

			const stuck = 4
			var backoffs []time.Duration
			postgres.SetRunWait(relay, func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
				if wake != nil { // the idle poll: everything went
					cancel()
					return false
				}
				if backoffs = append(backoffs, d); len(backoffs) == stuck {
					if _, err := db.Exec(`DROP TRIGGER stall ON outbox`); err != nil {
						t.Error(err)
					}
				}
				return true
			})
			if err := relay.Run(ctx); !errors.Is(err, context.Canceled) {
				t.Fatalf("Run = %v, want context.Canceled", err)
			}

			if n := publishes.Load(); n != 3*(stuck+1) {
				t.Errorf("the broker took %d publishes of 3 messages, want %d: each once a pass, %d failed passes and the one that marked",
					n, 3*(stuck+1), stuck)
			}
			wantSent(t, db, true, true, true)
			if len(backoffs) != stuck {
				t.Fatalf("Run backed off %d times (%v), want %d", len(backoffs), backoffs, stuck)
			}
			for i, d := range backoffs {
				hi := 100 * time.Millisecond << i
				if d < hi/2 || d >= hi {
					t.Errorf("backoff %d = %v, want [%v, %v): the count must grow while nothing is marked", i+1, d, hi/2, hi)
				}
			}
			failed := logs.lines(`level=ERROR msg="outbox: relay pass failed"`)
			if len(failed) != stuck {
				t.Fatalf("%d log lines of a failed pass, want %d:\n%s", len(failed), stuck, logs.String())
			}
			for _, line := range failed {
				if !strings.Contains(line, "mark the published messages sent") || !strings.Contains(line, "timeout") ||
					!strings.Contains(line, "published=3 marked=0") {
					t.Errorf("log line %q does not say that the mark timed out with 3 published and 0 marked", line)
				}
			}
			t.Logf("the log said: %s", failed[0])
		})
	}
}

// With PerAggregate, a refusal that comes with a failed mark stays in the
// error beside the mark's failure, and the pass counts nothing marked.
// (Caught: the refusals dropped from the error when the mark fails.)
func TestRefusalsStayInTheErrorWhenTheMarkFails(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200)
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 1 {
			return fmt.Errorf("too large: %w: %w", postgres.ErrRejected, errRefused)
		}
		return nil
	})
	relay := newRelay(t, db, broker)
	postgres.SetMark(relay, `SELECT 1/0 WHERE $1::bigint[] IS NOT NULL`) // a mark that fails: division by zero
	n, err := relay.PublishPending(ctx)
	var pgErr *pgconn.PgError
	if n != 0 || !errors.Is(err, errRefused) || !errors.As(err, &pgErr) || pgErr.Code != "22012" {
		t.Fatalf("pass = %d, %v; want 0 marked, and an error with the refusal of message 1 and the failed mark", n, err)
	}
	if !strings.Contains(err.Error(), "the 1 messages the broker accepted stay unsent") {
		t.Errorf("the pass's error %q does not say how many accepted messages go again", err)
	}
	wantSent(t, db, false, false)
}

// A pass that fails in a way no retry mends stops Run with the server's
// error, and says so in the log: the outbox table dropped (42P01), and a
// role that may read the outbox but not update it (42501). (Caught: Run
// logging the same error at every pass for ever.)
func TestRunStopsOnAFailureNoRetryMends(t *testing.T) {
	for _, tc := range []struct {
		name, code string
		setup      func(t *testing.T, name string, db *sql.DB) *sql.DB
	}{
		{"missing table", "42P01", func(t *testing.T, _ string, db *sql.DB) *sql.DB {
			if _, err := db.Exec(`DROP TABLE outbox`); err != nil {
				t.Fatal(err)
			}
			return db
		}},
		{"permission denied", "42501", func(t *testing.T, name string, db *sql.DB) *sql.DB {
			return openAsReader(t, name, db)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := newDatabaseName(t)
			db := open(t, name, "")
			insertPending(t, db, 1)
			relayDB := tc.setup(t, name, db)
			var logs logBuffer
			relay := newRelay(t, relayDB, &recorder{}, postgres.RelayConfig{PollOnly: true, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			ctx, cancel := context.WithTimeout(context.Background(), generous)
			defer cancel()
			err := relay.Run(ctx)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != tc.code {
				t.Fatalf("Run = %v, want it to stop with SQLSTATE %s", err, tc.code)
			}
			if lines := logs.lines(`level=ERROR msg="outbox: relay stopped`); len(lines) != 1 {
				t.Errorf("log lines of the stop: %d, want 1:\n%s", len(lines), logs.String())
			}
		})
	}
}

// openAsReader opens database name as a new role that may read the outbox
// and nothing more, dropped when t ends.
func openAsReader(t *testing.T, name string, db *sql.DB) *sql.DB {
	t.Helper()
	role := name + "_reader"
	for _, stmt := range []string{
		`CREATE ROLE ` + role + ` LOGIN`,
		`GRANT SELECT ON outbox TO ` + role,
	} {
		if _, err := db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	cfg := pgtest.Config.Copy()
	cfg.Database, cfg.User = name, role
	reader := stdlib.OpenDB(*cfg)
	t.Cleanup(func() {
		reader.Close()
		db.Exec(`DROP OWNED BY ` + role)
		if _, err := db.Exec(`DROP ROLE ` + role); err != nil {
			t.Error(err)
		}
	})
	return reader
}

// A pass whose budget ran out between two publishes, before it published
// all it claimed, is followed at once by another: with an hour between
// polls and no notification, six rows at 40 ms a publish (each one accepted
// however late) through passes of 100 ms all go. (Caught: a loop that waits
// a whole poll after such a pass.)
func TestRunPassesAgainAtOnceAfterItsBudgetRanOut(t *testing.T) {
	db := newDatabase(t)
	insertPending(t, db, 6)
	broker := &recorder{}
	slow := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		time.Sleep(40 * time.Millisecond) // the fault: a slow broker that finishes what it started
		return broker.Publish(ctx, m)
	})
	relay := newRelay(t, db, slow, postgres.RelayConfig{PassTimeout: 100 * time.Millisecond, PollInterval: time.Hour, PollOnly: true})
	runRelay(t, relay)
	waitUntil(t, "six rows marked sent", func() bool {
		var n int
		db.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`).Scan(&n)
		return n == 6
	})
}

// A broker that returns half a budget after its context ended (it should
// return soon after) still gets the message it accepted before marked: the
// server lets the pass's session idle twice the budget, not once. (Caught:
// an idle limit of one budget, which ends the session before the mark.)
func TestBrokerThatReturnsLateStillGetsItsAcceptedMessagesMarked(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertPending(t, db, 2)
	const budget = 2 * time.Second
	late := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 2 {
			<-ctx.Done()
			time.Sleep(budget / 2) // the fault: a broker slow to give up
			return postgres.ErrBrokerUnavailable
		}
		return nil
	})
	relay := newRelay(t, db, late, postgres.RelayConfig{PassTimeout: budget})
	if n, err := relay.PublishPending(ctx); n != 1 || !errors.Is(err, postgres.ErrBrokerUnavailable) {
		t.Fatalf("pass = %d, %v; want 1 marked and the broker's error", n, err)
	}
	wantSent(t, db, true, false)

	// A broker later still, past twice the budget: nothing is marked, and
	// the error says the pass ran past it, not only "context deadline
	// exceeded".
	if _, err := db.Exec(`UPDATE outbox SET sent_at = NULL`); err != nil {
		t.Fatal(err)
	}
	later := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 2 {
			<-ctx.Done()
			time.Sleep(2 * budget) // the fault: past the transaction's own deadline
			return postgres.ErrBrokerUnavailable
		}
		return nil
	})
	relay = newRelay(t, db, later, postgres.RelayConfig{PassTimeout: budget})
	n, err := relay.PublishPending(ctx)
	if n != 0 || !strings.Contains(fmt.Sprint(err), "the pass ran past twice its budget") {
		t.Errorf("pass with a broker past twice the budget = %d, %v; want 0, saying the pass ran past twice its budget", n, err)
	}
}

// When its connection dies, Run's listener listens again, and Run passes
// once then: a row committed while nothing listened, whose notification no
// one heard, goes without waiting for the hour's poll. (Caught: no pass
// after LISTEN.)
func TestRunPassesOnceItListensAgain(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	relay := newRelay(t, open(t, name, "listening-relay"), broker, postgres.RelayConfig{PollInterval: time.Hour})
	var idle atomic.Bool // Run waits for a wake-up
	postgres.SetRunWait(relay, func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
		idle.Store(wake != nil)
		defer idle.Store(false)
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-wake:
		case <-ctx.Done():
			return false
		}
		return true
	})
	down, resume := make(chan struct{}), make(chan struct{})
	postgres.SetListenWait(relay, func(ctx context.Context, _ time.Duration, _ <-chan struct{}) bool {
		close(down)
		select {
		case <-resume:
			return true
		case <-ctx.Done():
			return false
		}
	})
	runRelay(t, relay)
	waitUntil(t, "the relay listening", func() bool { return listenerPID(t, db, "listening-relay") != 0 })
	terminateListener(t, db, "listening-relay")
	<-down
	waitUntil(t, "Run idle, waiting for a wake-up", idle.Load)
	insertPending(t, db, 1) // its notification goes to no one
	close(resume)
	waitUntil(t, "the row published", func() bool { return len(broker.Published()) == 1 })
}

// The listener's backoff starts again each time it listened: three deaths
// of its connection, each after it listened again, are each followed by a
// first backoff, 50 to 100 ms. The backoff's length is what the relay
// computes, handed to the seam that waits, not a measured time. Each death
// is of a connection whose LISTEN the server had answered (the backend is
// idle after it), and the next one waits until that backend is gone, so
// that no kill lands on a listener before its LISTEN returned, and no kill
// hits a backend that was already dying. (Caught: a count never reset, 100
// to 200 ms after the second death, 200 to 400 after the third.)
func TestListenerBackoffStartsAgainOnceItListened(t *testing.T) {
	name := newDatabaseName(t)
	db := open(t, name, "")
	relay := newRelay(t, open(t, name, "listening-relay"), &recorder{}, postgres.RelayConfig{PollInterval: time.Hour})
	waits := make(chan time.Duration, 3)
	postgres.SetListenWait(relay, func(ctx context.Context, d time.Duration, _ <-chan struct{}) bool {
		waits <- d
		return true
	})
	runRelay(t, relay)
	for i := range 3 {
		var pid int32
		waitUntil(t, "the relay listening again", func() bool {
			pid = listenerPID(t, db, "listening-relay")
			return pid != 0
		})
		if _, err := db.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, "the killed listener's backend gone", func() bool {
			var n int
			if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 0
		})
		select {
		case d := <-waits:
			if d < 50*time.Millisecond || d >= 100*time.Millisecond {
				t.Errorf("backoff after death %d = %v, want [50ms, 100ms)", i+1, d)
			}
		case <-time.After(generous):
			t.Fatalf("death %d: the listener did not back off within %v", i+1, generous)
		}
	}
}

// listenerPID is the backend of app's connection that listens, whose
// LISTEN the server has answered, or 0.
func listenerPID(t *testing.T, db *sql.DB, app string) int32 {
	var pid int32
	err := db.QueryRow(`SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle'
		AND query = 'LISTEN `+postgres.NotifyChannel+`' ORDER BY backend_start DESC LIMIT 1`, app).Scan(&pid)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		t.Fatal(err)
	}
	return pid
}

func terminateListener(t *testing.T, db *sql.DB, app string) {
	t.Helper()
	if _, err := db.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = $1 AND query = 'LISTEN `+postgres.NotifyChannel+`'`, app); err != nil {
		t.Fatal(err)
	}
}

// A commit that the server refuses, a deferred unique constraint checked at
// COMMIT, is a rollback the server reported: Transaction's error is the
// server's, not ErrCommitUnknown, and nothing fn wrote is kept. (Caught:
// every commit error taken for an unknown outcome.)
func TestServerErrorAtCommitIsARollbackNotAnUnknownOutcome(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	if _, err := db.Exec(`CREATE TABLE deferred_unique (k integer UNIQUE DEFERRABLE INITIALLY DEFERRED)`); err != nil {
		t.Fatal(err)
	}
	err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO deferred_unique VALUES (1), (1)`) // checked at COMMIT
		return err
	})
	var pgErr *pgconn.PgError
	if errors.Is(err, postgres.ErrCommitUnknown) || !errors.As(err, &pgErr) || pgErr.Code != "23505" {
		t.Fatalf("Transaction = %v; want the server's unique_violation at commit, not ErrCommitUnknown", err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM deferred_unique`).Scan(&n); err != nil || n != 0 {
		t.Errorf("rows kept: %d, %v; want 0", n, err)
	}
}

// A commit the server answers with a rollback (a statement failed and fn
// went on, so the transaction was aborted) is a rollback known for certain:
// Transaction's error wraps pgx.ErrTxCommitRollback, not ErrCommitUnknown,
// on database/sql as on pgx, and nothing fn wrote is kept. (Caught: the
// database/sql path took it for an unknown outcome.)
func TestCommitTheServerTurnedIntoARollbackIsNotAnUnknownOutcome(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	if _, err := db.Exec(`CREATE TABLE aborted (k integer)`); err != nil {
		t.Fatal(err)
	}
	err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO aborted VALUES (1)`); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `SELECT 1/0`); err == nil {
			return errors.New("SELECT 1/0 did not fail")
		}
		return nil // the error swallowed: the transaction is aborted, and COMMIT rolls it back
	})
	if errors.Is(err, postgres.ErrCommitUnknown) || !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Fatalf("Transaction = %v; want pgx.ErrTxCommitRollback, not ErrCommitUnknown", err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM aborted`).Scan(&n); err != nil || n != 0 {
		t.Errorf("rows kept: %d, %v; want 0", n, err)
	}
}

// logBuffer collects a logger's lines; safe for the relay's goroutines.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// lines are the lines that hold s.
func (l *logBuffer) lines(s string) []string {
	var found []string
	for line := range strings.Lines(l.String()) {
		if strings.Contains(line, s) {
			found = append(found, strings.TrimSpace(line))
		}
	}
	return found
}

// A publish that hangs until the pass's budget ends is written to its row,
// attempt after attempt, with the deadline as its error, and never parks it,
// even with ParkAfter 1: a timeout is not a rejection. (Caught: a budget cut
// left unrecorded, the row at attempts 0 and no error while it held up the
// outbox.)
func TestPublishThatHangsIsWrittenToItsRowAndNeverParks(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertPending(t, db, 1)
	hang := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		<-ctx.Done()
		return fmt.Errorf("no ack: %w: %w", postgres.ErrRejected, ctx.Err()) // even a broker that says "rejected" late
	})
	relay := newRelay(t, db, hang, postgres.RelayConfig{PassTimeout: 200 * time.Millisecond, ParkAfter: 1})
	for range 3 {
		if n, err := relay.PublishPending(ctx); n != 0 || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("pass = %d, %v; want 0 and the deadline", n, err)
		}
	}
	var attempts, rejections int
	var lastError string
	var parked bool
	if err := db.QueryRow(`SELECT attempts, rejections, last_error, parked_at IS NOT NULL FROM outbox WHERE id = 1`).
		Scan(&attempts, &rejections, &lastError, &parked); err != nil {
		t.Fatal(err)
	}
	if attempts != 3 || rejections != 0 || parked || !strings.Contains(lastError, "deadline exceeded") {
		t.Errorf("row 1: %d attempts, %d rejections, parked %v, last error %q; want 3, 0, false and the deadline",
			attempts, rejections, parked, lastError)
	}
}

// A row whose publish fails pass after pass is surfaced: when its attempts
// reach FailingAfter, Run logs it once at level Warn, with its id and key,
// and ReadLag counts it as failing, however many more passes fail. (Caught:
// a stuck row that only its own attempts column could tell of.)
func TestRowThatKeepsFailingIsLoggedOnceAndCounted(t *testing.T) {
	db := newDatabase(t)
	insertPending(t, db, 2)
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		return fmt.Errorf("connection refused: %w", postgres.ErrBrokerUnavailable)
	})
	var logs logBuffer
	relay := newRelay(t, db, broker, postgres.RelayConfig{PollOnly: true, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const passes = postgres.FailingAfter + 3
	waits := 0
	postgres.SetRunWait(relay, func(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
		if waits++; waits == passes {
			cancel()
			return false
		}
		return true
	})
	if err := relay.Run(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want context.Canceled", err)
	}
	var key string
	if err := db.QueryRow(`SELECT message_key FROM outbox WHERE id = 1`).Scan(&key); err != nil {
		t.Fatal(err)
	}
	lines := logs.lines(`level=WARN msg="outbox: message keeps failing"`)
	if len(lines) != 1 || !strings.Contains(lines[0], "id=1 key="+key) || !strings.Contains(lines[0], "connection refused") {
		t.Errorf("log lines of a failing message: %q; want one, for row 1 with its key and error", lines)
	}
	lag, err := postgres.ReadLag(context.Background(), db)
	if err != nil || lag.Failing != 1 || lag.Unsent != 2 {
		t.Errorf("ReadLag = %+v, %v; want 2 unsent, 1 of them failing", lag, err)
	}
}

// Write refuses, before any statement, a type that no broker could
// route (a space, a wildcard, an empty word, too long), and the caller's
// transaction goes on: the valid row after it commits alone. (Caught: a
// type with a space inserted, and held in the outbox for ever.)
func TestWriteRefusesATypeNoBrokerCanRoute(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	ob := sqlOutbox(t, db, postgres.Config{})
	tx := begin(t, db)
	for _, typ := range []string{"Order Placed", "", "order..placed", ".placed", "placed.", "order.*", "order.>", "Ordér", strings.Repeat("x", postgres.MaxEventTypeLen+1)} {
		if _, err := ob.Write(ctx, tx, postgres.Event{Type: typ, Payload: map[string]int64{"orderId": 1}}); !errors.Is(err, postgres.ErrInvalidEventType) {
			t.Errorf("Write(%q) = %v, want ErrInvalidEventType", typ, err)
		}
	}
	for _, typ := range []string{"OrderPlaced", "order.placed", "Order_Placed-v2"} {
		if _, err := ob.Write(ctx, tx, postgres.Event{Type: typ, Payload: map[string]int64{"orderId": 1}}); err != nil {
			t.Errorf("Write(%q) = %v, want nil", typ, err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	wantUnsent(t, db, 3)
}
