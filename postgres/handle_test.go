package postgres_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
)

// One Outbox, the same methods on pgx's pool and on database/sql: on a
// blank database each driver's Outbox migrates, writes events in the
// caller's transaction (kept only if it commits; bad events refused and
// nothing written), reads its lag, relays, cleans up, parks and puts back,
// and applies a message once in the caller's transaction, a duplicate
// dropped. (Caught: pgx stopped at writing a row and the polling relay;
// every operation took a *sql.DB.)
func TestOneOutboxOnEitherDriver(t *testing.T) {
	t.Run("pgx", func(t *testing.T) {
		name := newBlankDatabase(t)
		pool := newPool(t, name, 4)
		ob, err := postgres.Open(pool, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		begin := func(ctx context.Context) (postgres.PgxTx, func() error, func()) {
			tx, err := pool.BeginTx(ctx, pgx.TxOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return tx, func() error { return tx.Commit(ctx) }, func() { _ = tx.Rollback(ctx) }
		}
		operations(t, ob, begin, open(t, name, ""))
	})
	t.Run("database/sql", func(t *testing.T) {
		name := newBlankDatabase(t)
		db := open(t, name, "")
		ob, err := postgres.OpenDB(db, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		begin := func(ctx context.Context) (postgres.SQLTx, func() error, func()) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			return tx, tx.Commit, func() { _ = tx.Rollback() }
		}
		operations(t, ob, begin, db)
	})
}

// operations runs every operation of ob on its blank database, whose
// transactions begin makes, and looks at the tables through check.
func operations[T any](t *testing.T, ob *postgres.Outbox[T], begin func(context.Context) (T, func() error, func()), check *sql.DB) {
	ctx := context.Background()
	if err := ob.CheckSchema(ctx); !errors.Is(err, postgres.ErrSchemaVersion) {
		t.Fatalf("CheckSchema before Migrate = %v, want ErrSchemaVersion", err)
	}
	for range 2 { // the second applies nothing
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := ob.CheckSchema(ctx); err != nil {
		t.Fatal(err)
	}
	rows := func() int64 { return count(t, check, `SELECT count(*) FROM outbox`) }
	lag := func() postgres.Lag {
		t.Helper()
		l, err := ob.ReadLag(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}

	// Rolled back, the event is not written.
	tx, _, rollback := begin(ctx)
	if _, err := ob.Write(ctx, tx, postgres.Event{Type: "ItemPicked", Payload: map[string]int{"item": 1}}); err != nil {
		t.Fatal(err)
	}
	rollback()
	if n := rows(); n != 0 {
		t.Fatalf("%d rows after a rollback, want 0", n)
	}

	// Bad events are refused before any statement, and the transaction
	// goes on to commit the good ones.
	tx, commit, rollback := begin(ctx)
	defer rollback()
	for _, bad := range []struct {
		e    postgres.Event
		want error
	}{
		{postgres.Event{Type: "bad type", Payload: "{}"}, postgres.ErrInvalidEventType},
		{postgres.Event{Type: "", Payload: "{}"}, postgres.ErrInvalidEventType},
		{postgres.Event{Type: "Opened", Payload: []byte(`{"account":`)}, postgres.ErrInvalidPayload},
		{postgres.Event{Type: "Opened", Payload: "{}", Aggregate: "account/7"}, postgres.ErrInvalidSeq},
		{postgres.Event{Type: "Opened", Payload: "{}", Aggregate: "account/7", Seq: -1}, postgres.ErrInvalidSeq},
		{postgres.Event{Type: "Opened", Payload: "{}", Seq: 3}, postgres.ErrInvalidSeq},
	} {
		if id, err := ob.Write(ctx, tx, bad.e); id != 0 || !errors.Is(err, bad.want) {
			t.Errorf("Write(%+v) = %d, %v; want %v", bad.e, id, err, bad.want)
		}
	}
	first, err := ob.Write(ctx, tx, postgres.Event{Type: "Opened", Payload: []byte(`{"account":7}`), Aggregate: "account/7", Seq: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.Write(ctx, tx, postgres.Event{Type: "ItemPicked", Payload: map[string]int{"item": 2}}); err != nil {
		t.Fatal(err)
	}
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	if n, l := rows(), lag(); n != 2 || l.Unsent != 2 {
		t.Fatalf("after the commit: %d rows, lag %+v; want the 2 good events, unsent", n, l)
	}

	broker := &recorder{}
	if n, err := newRelayOn(t, ob, broker).PublishPending(ctx); n != 2 || err != nil {
		t.Fatalf("pass = %d, %v; want the 2 rows", n, err)
	}
	if m := broker.Published()[0]; m.ID != first || m.Aggregate != "account/7" || m.Seq != 1 || m.Payload != `{"account":7}` {
		t.Errorf("published %+v; want row %d of account/7, seq 1, as written", m, first)
	}
	if l := lag(); l.Unsent != 0 {
		t.Errorf("lag after the pass %+v, want none unsent", l)
	}
	if _, err := ob.DeleteSent(ctx, -1); err == nil {
		t.Error("DeleteSent with a negative retention: no error")
	}
	if n, err := ob.DeleteSent(ctx, 0); n != 2 || err != nil {
		t.Errorf("DeleteSent = %d, %v; want the 2 sent rows", n, err)
	}

	// A row the broker refuses is parked, listed, put back, parked again
	// and dropped.
	tx, commit, rollback = begin(ctx)
	defer rollback()
	refused, err := ob.Write(ctx, tx, postgres.Event{Type: "TooLarge", Payload: "{}"})
	if err != nil {
		t.Fatal(err)
	}
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	refusing := newRelayOn(t, ob, brokerFunc(func(context.Context, postgres.Message) error {
		return fmt.Errorf("too large: %w", postgres.ErrRejected)
	}), postgres.RelayConfig{ParkAfter: 1})
	for range 2 {
		if _, err := refusing.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
		parked, err := ob.ListParked(ctx, 0)
		if err != nil || len(parked) != 1 || parked[0].ID != refused || !strings.Contains(parked[0].LastError, "too large") {
			t.Fatalf("parked %+v, %v; want row %d, its error kept", parked, err, refused)
		}
		if l := lag(); l.Parked != 1 || l.Unsent != 0 {
			t.Errorf("lag %+v, want 1 parked", l)
		}
		if err := ob.Unpark(ctx, refused); err != nil {
			t.Fatal(err)
		}
		if err := ob.Unpark(ctx, refused); !errors.Is(err, postgres.ErrNotParked) {
			t.Errorf("a second Unpark = %v, want ErrNotParked", err)
		}
	}
	if _, err := refusing.PublishPending(ctx); err != nil {
		t.Fatal(err)
	}
	if p, err := ob.DropParked(ctx, refused); err != nil || p.ID != refused || p.Type != "TooLarge" {
		t.Errorf("DropParked = %+v, %v; want row %d", p, err, refused)
	}
	if _, err := ob.DropParked(ctx, refused); !errors.Is(err, postgres.ErrNotParked) {
		t.Errorf("a second DropParked = %v, want ErrNotParked", err)
	}
	if n := rows(); n != 0 {
		t.Errorf("%d rows left, want 0", n)
	}

	// The consumer's side, in the caller's transaction: once, a duplicate
	// dropped, an aggregate's events in their order.
	apply := func(msg postgres.Message) (bool, error) {
		t.Helper()
		tx, commit, rollback := begin(ctx)
		defer rollback()
		fresh, err := ob.ApplyOnceIn(ctx, tx, msg, postgres.ApplyOptions{})
		if err != nil {
			return false, err
		}
		return fresh, commit()
	}
	plain := postgres.Message{ID: 1, Key: "producer-a/1", Type: "ItemPicked", Payload: "{}"}
	if fresh, err := apply(plain); !fresh || err != nil {
		t.Errorf("first delivery = %v, %v; want applied", fresh, err)
	}
	if fresh, err := apply(plain); fresh || err != nil {
		t.Errorf("second delivery = %v, %v; want a duplicate, dropped", fresh, err)
	}
	second := postgres.Message{ID: 3, Key: "producer-a/3", Type: "Closed", Payload: "{}", Aggregate: "account/7", Seq: 2}
	if _, err := apply(second); !errors.Is(err, postgres.ErrOutOfOrder) {
		t.Errorf("seq 2 before seq 1 = %v, want ErrOutOfOrder", err)
	}
	for _, m := range []postgres.Message{{ID: 2, Key: "producer-a/2", Type: "Opened", Payload: "{}", Aggregate: "account/7", Seq: 1}, second} {
		if fresh, err := apply(m); !fresh || err != nil {
			t.Errorf("seq %d = %v, %v; want applied", m.Seq, fresh, err)
		}
	}

	// Or in a transaction of ob's own around the caller's effect: an effect
	// that fails records nothing and is tried again; a duplicate does not
	// call it.
	calls := 0
	failed := errors.New("the effect failed")
	mail := postgres.Message{ID: 4, Key: "producer-a/4", Type: "Welcomed", Payload: "{}"}
	if applied, err := ob.ApplyOnce(ctx, mail, postgres.ApplyOptions{}, func(context.Context, T) error { calls++; return failed }); applied || !errors.Is(err, failed) {
		t.Errorf("ApplyOnce, its effect failing = %v, %v; want not applied, the effect's error", applied, err)
	}
	for i, want := range []bool{true, false} {
		applied, err := ob.ApplyOnce(ctx, mail, postgres.ApplyOptions{}, func(context.Context, T) error { calls++; return nil })
		if applied != want || err != nil {
			t.Errorf("ApplyOnce, delivery %d = %v, %v; want applied %v", i+1, applied, err, want)
		}
	}
	if calls != 2 {
		t.Errorf("the effect ran %d times, want 2 (the failure and the first delivery after it)", calls)
	}
	if _, err := ob.ApplyOnce(ctx, postgres.Message{Key: "producer-a/5"}, postgres.ApplyOptions{}, nil); err == nil {
		t.Error("ApplyOnce with no apply function: no error")
	}
	if n := count(t, check, `SELECT count(*) FROM processed_messages`); n != 4 {
		t.Errorf("%d keys recorded, want 4", n)
	}
	if n, err := ob.ForgetProcessed(ctx, 0); n != 4 || err != nil {
		t.Errorf("ForgetProcessed = %d, %v; want the 4 keys (the open aggregate's position kept)", n, err)
	}
	if n := count(t, check, `SELECT count(*) FROM aggregate_positions`); n != 1 {
		t.Errorf("%d positions, want the open aggregate's", n)
	}
}

// Open and OpenDB check what they are given and refuse, with an error
// wrapping ErrInvalidConfig that names it, a bad value; an Outbox they did
// not make refuses every method the same way, and a nil transaction is an
// error, not a panic. (Caught: configuration checked at the first pass, or
// never.)
func TestOpenChecksItsConfig(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	pool := newPool(t, name, 2)
	for _, c := range []struct {
		cfg  postgres.Config
		says string
	}{
		{postgres.Config{Table: "Billing"}, "Config.Table"},
		{postgres.Config{Table: strings.Repeat("a", 41)}, "Config.Table"},
		{postgres.Config{CleanupBatch: -1}, "Config.CleanupBatch"},
		{postgres.Config{CleanupBatch: 100_001}, "Config.CleanupBatch"},
	} {
		if ob, err := postgres.Open(pool, c.cfg); ob != nil || !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(fmt.Sprint(err), c.says) {
			t.Errorf("Open(%+v) = %v, %v; want ErrInvalidConfig naming %s", c.cfg, ob, err, c.says)
		}
		if ob, err := postgres.OpenDB(db, c.cfg); ob != nil || !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(fmt.Sprint(err), c.says) {
			t.Errorf("OpenDB(%+v) = %v, %v; want ErrInvalidConfig naming %s", c.cfg, ob, err, c.says)
		}
	}
	if _, err := postgres.Open(nil, postgres.Config{}); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("Open(nil) = %v, want ErrInvalidConfig", err)
	}
	if _, err := postgres.OpenDB(nil, postgres.Config{}); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("OpenDB(nil) = %v, want ErrInvalidConfig", err)
	}
	other := sql.OpenDB(otherConnector{})
	defer other.Close()
	if _, err := postgres.OpenDB(other, postgres.Config{}); !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(fmt.Sprint(err), "stdlib") {
		t.Errorf("OpenDB on another driver = %v, want ErrInvalidConfig naming pgx's stdlib", err)
	}

	var zero postgres.Outbox[postgres.SQLTx]
	if _, err := zero.ReadLag(ctx); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("ReadLag of a zero Outbox = %v, want ErrInvalidConfig", err)
	}
	if err := zero.Migrate(ctx); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("Migrate of a zero Outbox = %v, want ErrInvalidConfig", err)
	}
	if r, err := zero.NewRelay(&recorder{}, postgres.RelayConfig{}); r != nil || !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("a zero Outbox's NewRelay = %v, %v; want ErrInvalidConfig", r, err)
	}
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.Write(ctx, nil, postgres.Event{Type: "ItemPicked", Payload: "{}"}); err == nil {
		t.Error("Write with no transaction: no error")
	}
	if _, err := ob.ApplyOnceIn(ctx, nil, postgres.Message{Key: "k"}, postgres.ApplyOptions{}); err == nil {
		t.Error("ApplyOnceIn with no transaction: no error")
	}
	if n := count(t, db, `SELECT count(*) FROM outbox`) + count(t, db, `SELECT count(*) FROM processed_messages`); n != 0 {
		t.Errorf("%d rows written by refused calls", n)
	}
}

// otherConnector is a database/sql connector of a driver that is not
// pgx's, which never connects.
type otherConnector struct{}

func (otherConnector) Connect(context.Context) (driver.Conn, error) {
	return nil, errors.New("not a real driver")
}
func (otherConnector) Driver() driver.Driver { return otherDriver{} }

type otherDriver struct{}

func (otherDriver) Open(string) (driver.Conn, error) { return nil, errors.New("not a real driver") }

// Passing a pool, a connection or a *sql.DB where the caller's transaction
// belongs does not compile: the event cannot be written in a transaction
// of its own, which would be the dual write again. Each call is built in a
// package of its own, in a module outside the repository that requires
// this one; the same calls given a transaction (a pgx.Tx, a *sql.Tx, and
// a type that embeds one, as sqlx's Tx does) build, and so does the
// README's block of a write in a pgx transaction. (Caught: PgxQuerier
// asked only for QueryRow, which a pool has.)
func TestAPoolWhereATransactionBelongsDoesNotCompile(t *testing.T) {
	const header = `package p

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
)

var (
	_ *pgx.Conn
	_ *pgxpool.Pool
	_ *sql.DB
)

type wrappedTx struct{ *sql.Tx } // as sqlx's Tx embeds *sql.Tx

func f(ctx context.Context, ob *postgres.Outbox[postgres.PgxTx], sob *postgres.Outbox[postgres.SQLTx],
	pool *pgxpool.Pool, pconn *pgxpool.Conn, conn *pgx.Conn, ptx pgx.Tx,
	db *sql.DB, sconn *sql.Conn, stx *sql.Tx) {
	e, m := postgres.Event{Type: "Placed", Payload: "{}"}, postgres.Message{Key: "k"}
	_, _ = e, m
`
	good := []string{
		`ob.Write(ctx, ptx, e)`,
		`ob.ApplyOnceIn(ctx, ptx, m, postgres.ApplyOptions{})`,
		`sob.Write(ctx, stx, e)`,
		`sob.Write(ctx, wrappedTx{stx}, e)`,
		`sob.ApplyOnceIn(ctx, stx, m, postgres.ApplyOptions{})`,
		`ob.ApplyOnce(ctx, m, postgres.ApplyOptions{}, func(ctx context.Context, tx postgres.PgxTx) error { return nil })`,
		`sob.ApplyOnce(ctx, m, postgres.ApplyOptions{}, func(ctx context.Context, tx postgres.SQLTx) error { return nil })`,
	}
	bad := []string{
		`ob.Write(ctx, pool, e)`,
		`ob.Write(ctx, pconn, e)`,
		`ob.Write(ctx, conn, e)`,
		`ob.ApplyOnceIn(ctx, pool, m, postgres.ApplyOptions{})`,
		`sob.Write(ctx, db, e)`,
		`sob.Write(ctx, sconn, e)`,
		`sob.ApplyOnceIn(ctx, db, m, postgres.ApplyOptions{})`,
	}
	dir := t.TempDir()
	write := func(pkg, call string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Join(dir, pkg), 0o755); err != nil {
			t.Fatal(err)
		}
		src := header + "\t" + call + "\n}\n"
		if err := os.WriteFile(filepath.Join(dir, pkg, "p.go"), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for i, call := range good {
		write(fmt.Sprintf("good%d", i), call)
	}
	// The README's block of a write in a pgx transaction, as a team copies it.
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, _ := strings.Cut(string(readme), "**2. The change and its event")
	_, block, _ = strings.Cut(block, "```go\n")
	block, _, ok := strings.Cut(block, "```")
	if !ok || !strings.Contains(block, "ob.Write(ctx, tx,") {
		t.Fatalf("README.md has no block of Write after its step 2:\n%s", block)
	}
	// And its block of a consumer, step 5.
	_, consumer, _ := strings.Cut(string(readme), "**5. A consumer that drops duplicates")
	_, consumer, _ = strings.Cut(consumer, "```go\n")
	consumer, _, ok = strings.Cut(consumer, "```")
	if !ok || !strings.Contains(consumer, "ob.ApplyOnce(ctx, msg,") {
		t.Fatalf("README.md has no block of ApplyOnce after its step 5:\n%s", consumer)
	}
	if err := os.MkdirAll(filepath.Join(dir, "readme"), 0o755); err != nil {
		t.Fatal(err)
	}
	src := `package readme

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
)

func register(ctx context.Context, pool *pgxpool.Pool, id int64, name string) error {
` + block + `}

func welcome(ctx context.Context, ob *postgres.Outbox[postgres.PgxTx], msg postgres.Message, customerID int64) (bool, error) {
` + consumer + `	return applied, err
}
`
	if err := os.WriteFile(filepath.Join(dir, "readme", "readme.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	for i, call := range bad {
		write(fmt.Sprintf("bad%d", i), call)
	}
	teamModule(t, dir)

	cmd := exec.Command("go", "build", "-gcflags=-e", "./...")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("every call built, a pool where a transaction belongs too:\n%s", out)
	}
	t.Logf("go build:\n%s", out)
	for i, call := range good {
		if strings.Contains(string(out), fmt.Sprintf("good%d/", i)) {
			t.Errorf("%s, given a transaction, does not build", call)
		}
	}
	if strings.Contains(string(out), "readme/") {
		t.Error("the README's blocks of a write in a pgx transaction and of a consumer do not build")
	}
	for i, call := range bad {
		pkg := fmt.Sprintf("bad%d/", i)
		line := ""
		for l := range strings.SplitSeq(string(out), "\n") {
			if strings.Contains(l, pkg) {
				line = l
				break
			}
		}
		if !strings.Contains(line, "missing method Commit") {
			t.Errorf("%s: want it refused for having no Commit, got %q", call, line)
		}
	}
}

// A log relay made from an Outbox is safe by default, on pgx as on
// database/sql: it marks what it delivered (so its rows are not lag) and
// parks a row the broker refuses for ever, the rest of its transaction
// delivered. Its slot is made and dropped through the Outbox, and a slot
// the relay reads is not dropped. (Caught: made with NewLogRelay it marked
// nothing and parked nothing, so a refused row held it up for ever and
// every row it delivered counted as lag.)
func TestLogRelayFromAnOutboxMarksAndParksByDefault(t *testing.T) {
	ctx := context.Background()
	name, pool, ob := logRelayOutbox(t)
	broker := &recorder{}
	relay, err := ob.NewLogRelay(logConnString(name), brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.Type == "TooLarge" {
			return fmt.Errorf("too large: %w", postgres.ErrRejected)
		}
		return broker.Publish(ctx, m)
	}), postgres.LogRelayConfig{Slot: name, MaxBackoff: 200 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if got := relay.Config(); got.Unmarked || got.ParkAfter != postgres.DefaultParkAfter || got.Publication != ob.Publication() {
		t.Fatalf("the Outbox's log relay: Unmarked %v, ParkAfter %d, Publication %q; want marks, %d, %q",
			got.Unmarked, got.ParkAfter, got.Publication, postgres.DefaultParkAfter, ob.Publication())
	}
	stop := runLog(t, relay)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, typ := range []string{"ItemPicked", "TooLarge", "ItemPacked"} {
		if _, err := ob.Write(ctx, tx, postgres.Event{Type: typ, Payload: "{}"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// The transaction goes again whole after each refusal: the row before
	// the refused one is published again each time (at least once).
	delivered := func() []string {
		var types []string
		for _, m := range broker.Published() {
			if !slices.Contains(types, m.Type) {
				types = append(types, m.Type)
			}
		}
		return types
	}
	waitUntil(t, "two rows delivered and marked, the refused one parked", func() bool {
		lag, err := ob.ReadLag(ctx)
		return err == nil && lag.Unsent == 0 && lag.Parked == 1 && len(delivered()) == 2
	})
	if err := ob.DropLogSlot(ctx, name); !errors.Is(err, postgres.ErrSlotActive) {
		t.Errorf("DropLogSlot of the slot the relay reads = %v, want ErrSlotActive", err)
	}
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v", err)
	}
	if got := delivered(); !slices.Equal(got, []string{"ItemPicked", "ItemPacked"}) {
		t.Errorf("published %v; want ItemPicked, ItemPacked", got)
	}
}

// testWriter writes a test's log lines to t.Log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// A second log relay on a slot that another reads stands by: it reports
// ErrSlotActive to OnPass and logs it at Info, never at Error, and takes
// over once the first stops, delivering what was written after. (Caught:
// a standby logged "slot is active" at ERROR, its backoff growing to 30 s,
// and told no one it was a standby.)
func TestASecondLogRelayOnTheSlotStandsBy(t *testing.T) {
	ctx := context.Background()
	name, pool, ob := logRelayOutbox(t)
	write := func(typ string) {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := ob.Write(ctx, tx, postgres.Event{Type: typ, Payload: "{}"}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	first, second := &recorder{}, &recorder{}
	active, err := ob.NewLogRelay(logConnString(name), first, postgres.LogRelayConfig{Slot: name, MaxBackoff: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	stopActive := runLog(t, active)
	write("ItemPicked")
	waitUntil(t, "the first relay to deliver", func() bool { return len(first.Published()) == 1 })

	var logged logBuffer
	standingBy := make(chan error, 100)
	standby, err := ob.NewLogRelay(logConnString(name), second, postgres.LogRelayConfig{Slot: name,
		Logger: slog.New(slog.NewTextHandler(&logged, nil)),
		OnPass: func(r postgres.PassReport) {
			if r.Err != nil {
				select {
				case standingBy <- r.Err:
				default:
				}
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	stopStandby := runLog(t, standby)
	select {
	case err := <-standingBy:
		if !errors.Is(err, postgres.ErrSlotActive) {
			t.Errorf("the standby's session failed with %v, want ErrSlotActive", err)
		}
	case <-time.After(generous):
		t.Fatal("the standby reported nothing")
	}
	if err := stopActive(); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("the first relay's Run = %v", err)
	}
	write("ItemPacked")
	waitUntil(t, "the standby to take over and deliver", func() bool {
		for _, m := range second.Published() {
			if m.Type == "ItemPacked" {
				return true
			}
		}
		return false
	})
	if err := stopStandby(); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("the standby's Run = %v", err)
	}
	out := logged.String()
	if !strings.Contains(out, "level=INFO") || !strings.Contains(out, "standing by") || strings.Contains(out, "level=ERROR") {
		t.Errorf("the standby's log, want standing by at INFO and nothing at ERROR:\n%s", out)
	}
}

// logRelayOutbox is a database of t's own, migrated, a pgx pool on it, its
// Outbox, and a slot named after the database, dropped when t ends.
func logRelayOutbox(t *testing.T) (name string, pool *pgxpool.Pool, ob *postgres.Outbox[postgres.PgxTx]) {
	t.Helper()
	name = newDatabaseName(t)
	pool = newPool(t, name, 4)
	ob = pgxOutbox(t, pool)
	if err := ob.CreateLogSlot(context.Background(), name); err != nil {
		t.Fatal(err)
	}
	db := open(t, name, "")
	t.Cleanup(func() { dropSlot(t, db, name) })
	return name, pool, ob
}
