package minimum_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres/minimum"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var databases atomic.Int64

// newDatabase creates a database with minimum.Schema on the tests' server;
// drop removes it.
func newDatabase() (db *sql.DB, drop func()) {
	admin := stdlib.OpenDB(*pgtest.Config)
	name := fmt.Sprintf("minimum_%d_%d", os.Getpid(), databases.Add(1))
	if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
		panic(err)
	}
	cfg := pgtest.Config.Copy()
	cfg.Database = name
	db = stdlib.OpenDB(*cfg)
	if _, err := db.Exec(minimum.Schema); err != nil {
		panic(err)
	}
	return db, func() {
		db.Close()
		admin.Exec("DROP DATABASE " + name + " WITH (FORCE)")
		admin.Close()
	}
}

// broker is an in-memory broker that can be down, or lose its next ack:
// it keeps the message, and the relay hears an error, as when the
// connection dies after the broker stored it.
type broker struct {
	mu            sync.Mutex
	down, loseAck bool
	got           []minimum.Message
}

var errUnavailable = errors.New("broker unavailable")

func (b *broker) Publish(_ context.Context, m minimum.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.down {
		return errUnavailable
	}
	b.got = append(b.got, m)
	if b.loseAck {
		b.loseAck = false
		return errors.New("ack lost")
	}
	return nil
}

// say prints a line of the example, and copies it to standard error when
// OUTBOX_TRANSCRIPT is set (make minimum sets it): go test checks an
// example's output and prints nothing of it when it passes.
func say(format string, args ...any) {
	line := fmt.Sprintf(format, args...)
	fmt.Print(line)
	if os.Getenv("OUTBOX_TRANSCRIPT") != "" {
		fmt.Fprint(os.Stderr, line)
	}
}

// The article's scenario on a real PostgreSQL: the broker down, the order
// saved and its event waiting; the broker back, the event sent; an ack
// lost between the publish and the mark, the message sent again and the
// warehouse dropping the copy.
func Example() {
	ctx := context.Background()
	db, drop := newDatabase()
	defer drop()
	b := &broker{down: true}
	reserve := func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `SELECT 1`) // the warehouse's own write would go here
		return err
	}
	unsent := func() (n int) {
		db.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&n)
		return n
	}

	id, _ := minimum.PlaceOrder(ctx, db, 2500)
	n, err := minimum.PublishPending(ctx, db, b)
	say("broker down: order %d saved; pass sent %d (%v); %d event waiting\n", id, n, err, unsent())

	b.down = false
	n, err = minimum.PublishPending(ctx, db, b)
	say("broker back: pass sent %d (%v); %d waiting\n", n, err, unsent())

	id, _ = minimum.PlaceOrder(ctx, db, 4000)
	b.loseAck = true
	n, err = minimum.PublishPending(ctx, db, b)
	say("order %d, ack lost: pass sent %d (%v); the broker holds %d messages; %d waiting\n", id, n, err, len(b.got), unsent())
	n, err = minimum.PublishPending(ctx, db, b)
	say("next pass sent %d (%v); the broker holds %d messages\n", n, err, len(b.got))

	for _, m := range b.got {
		applied, err := minimum.Consume(ctx, db, m, reserve)
		say("warehouse: message %d applied %v (%v)\n", m.ID, applied, err)
	}
	// Output:
	// broker down: order 1 saved; pass sent 0 (broker unavailable); 1 event waiting
	// broker back: pass sent 1 (<nil>); 0 waiting
	// order 2, ack lost: pass sent 0 (ack lost); the broker holds 2 messages; 1 waiting
	// next pass sent 1 (<nil>); the broker holds 3 messages
	// warehouse: message 1 applied true (<nil>)
	// warehouse: message 2 applied true (<nil>)
	// warehouse: message 2 applied false (<nil>)
}

// While the broker is down nothing is marked: every event waits and goes
// once the broker is back, in id order. (Break it: mark before the
// publish, and the event of the order placed while the broker was down is
// marked sent and lost.)
func TestBrokerDownLosesNothing(t *testing.T) {
	ctx := context.Background()
	db, drop := newDatabase()
	defer drop()
	b := &broker{down: true}
	for range 3 {
		if _, err := minimum.PlaceOrder(ctx, db, 100); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := minimum.PublishPending(ctx, db, b); n != 0 || !errors.Is(err, errUnavailable) {
		t.Fatalf("pass with the broker down = %d, %v; want 0 and its error", n, err)
	}
	b.down = false
	if n, err := minimum.PublishPending(ctx, db, b); n != 3 || err != nil {
		t.Fatalf("pass with the broker back = %d, %v; want 3", n, err)
	}
	for i, m := range b.got {
		if m.ID != int64(i+1) {
			t.Errorf("the broker got %v, want ids 1, 2, 3 in order", b.got)
			break
		}
	}
}

// A message delivered twice is applied once: the consumer records its id
// with its effect. (Break it: apply without recording, and the copy is
// applied twice.)
func TestCopyIsAppliedOnce(t *testing.T) {
	ctx := context.Background()
	db, drop := newDatabase()
	defer drop()
	if _, err := db.Exec(`CREATE TABLE reservations (order_id bigint)`); err != nil {
		t.Fatal(err)
	}
	msg := minimum.Message{ID: 1, Type: "OrderPlaced", Payload: `{"orderId":1,"totalCents":100}`}
	for range 2 {
		if _, err := minimum.Consume(ctx, db, msg, func(tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO reservations VALUES (1)`)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&n); err != nil || n != 1 {
		t.Errorf("%d reservations (%v), want 1", n, err)
	}
}

// Run says what each failed pass failed with, and goes on: with the broker
// down every pass is logged with its error, and once it is back the event
// goes. (Break it: call PublishPending and drop what it returns, and the
// relay fails in silence for ever.)
func TestRunLogsEveryFailedPass(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	db, drop := newDatabase()
	defer drop()
	if _, err := minimum.PlaceOrder(ctx, db, 100); err != nil {
		t.Fatal(err)
	}
	b := &broker{down: true}
	logged := &lines{}
	done := make(chan error, 1)
	go func() { done <- minimum.Run(ctx, db, b, time.Millisecond, slog.New(slog.NewTextHandler(logged, nil))) }()
	for deadline := time.Now().Add(time.Minute); logged.count("relay pass failed") < 2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("two failed passes not logged within a minute:\n%s", logged)
		}
	}
	if !strings.Contains(logged.String(), "err=\"broker unavailable\"") || !strings.Contains(logged.String(), "level=WARN") {
		t.Errorf("the failed passes' lines lack the error or the level:\n%s", logged)
	}
	b.mu.Lock()
	b.down = false
	b.mu.Unlock()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) {
		b.mu.Lock()
		sent := len(b.got)
		b.mu.Unlock()
		if sent == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the event did not go within a minute of the broker's return")
		}
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
}

// lines collects a logger's output, safe for Run's goroutine.
type lines struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *lines) count(s string) int { return strings.Count(l.String(), s) }
