package rabbitbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
	"example.com/patterns/enterprise/outbox/rabbitbroker/rabbittest"
)

// maxMessageSize is the shared node's max_message_size.
const maxMessageSize = 8 << 10

// node is the RabbitMQ node the tests share, started by TestMain; a test
// that restarts or kills a node starts one of its own.
var node *rabbittest.Node

// The tests need a PostgreSQL server (OUTBOX_POSTGRES_URL, or one pgtest
// starts) and RabbitMQ installed (make rabbitbroker installs Debian's):
// TestMain starts a throwaway node, and stops and removes it after the
// tests.
func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	n, err := rabbittest.Start(rabbittest.Options{MaxMessageSize: maxMessageSize})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer n.Remove()
	node = n
	return pgtest.Run(m)
}

// newDatabase creates a database with the outbox's and the example's
// tables for t alone, dropped when t ends, and opens it.
func newDatabase(t testing.TB) *sql.DB {
	t.Helper()
	db := pgtest.Open(t, pgtest.NewBlankDatabase(t), "")
	if err := errors.Join(tableOutbox(db).Migrate(context.Background()), shop.Migrate(context.Background(), db)); err != nil {
		t.Fatal(err)
	}
	return db
}

// dialer dials url.
func dialer(url string) func() (*amqp.Connection, error) {
	return func() (*amqp.Connection, error) { return amqp.Dial(url) }
}

var topologies atomic.Int64

// declare declares a topology of t's own on the node at url, with the
// delivery limit given (zero: the default's), and returns it.
func declare(t testing.TB, url string, deliveryLimit int) rabbitbroker.Topology {
	t.Helper()
	n := topologies.Add(1)
	top := rabbitbroker.Topology{Exchange: fmt.Sprint("outbox", n), Queue: fmt.Sprint("warehouse", n), DeliveryLimit: deliveryLimit}
	if deliveryLimit == 0 {
		top.DeliveryLimit = rabbitbroker.DefaultTopology.DeliveryLimit
	}
	ch, closing := channel(t, url)
	defer closing()
	if err := top.Declare(ch); err != nil {
		t.Fatal(err)
	}
	return top
}

// channel opens a channel on a connection of its own to the node at url;
// closing it closes the connection.
func channel(t testing.TB, url string) (ch *amqp.Channel, closing func()) {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	ch, err = conn.Channel()
	if err != nil {
		conn.Close()
		t.Fatal(err)
	}
	return ch, func() { conn.Close() }
}

// newPublisher is a Publisher to top's exchange on the node at url, closed
// when t ends.
func newPublisher(t testing.TB, url string, top rabbitbroker.Topology, maxSize int) *rabbitbroker.Publisher {
	return publisherOf(t, dialer(url), rabbitbroker.PublisherOptions{Exchange: top.Exchange, MaxMessageSize: maxSize})
}

// publisherOf is rabbitbroker.NewPublisher, failing t on its error; the
// Publisher is closed when t ends.
func publisherOf(t testing.TB, dial func() (*amqp.Connection, error), opts rabbitbroker.PublisherOptions) *rabbitbroker.Publisher {
	t.Helper()
	p, err := rabbitbroker.NewPublisher(dial, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// queued is how many messages queue holds, ready or unacked.
func queued(t testing.TB, url, queue string) int {
	t.Helper()
	ch, closing := channel(t, url)
	defer closing()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// newConsumer is rabbitbroker.NewConsumer, failing tb on its error.
func newConsumer(tb testing.TB, dial func() (*amqp.Connection, error), queue string, h rabbitbroker.Handler, opts rabbitbroker.ConsumerOptions) *rabbitbroker.Consumer {
	tb.Helper()
	c, err := rabbitbroker.NewConsumer(dial, queue, h, opts)
	if err != nil {
		tb.Fatal(err)
	}
	return c
}

// goRun runs f in a goroutine until t ends or the returned stop is
// called, and fails t if f returns anything but the end of its context.
func goRun(t testing.TB, f func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := f(ctx); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("run: %v", err)
		}
	}()
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	return stop
}

// waitFor polls cond until it holds, failing t after a generous deadline.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 2m", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// count is the single integer query returns.
func count(t testing.TB, db *sql.DB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// wantEachOrderReservedOnce checks that every order has exactly one
// reservation, and that there are orders of them.
func wantEachOrderReservedOnce(t *testing.T, db *sql.DB, orders int) {
	t.Helper()
	if n := count(t, db, `SELECT count(*) FROM orders`); n != orders {
		t.Errorf("%d orders, want %d", n, orders)
	}
	if n := count(t, db, `SELECT count(*) FROM orders o
		WHERE (SELECT count(*) FROM reservations r WHERE r.order_id = o.id) <> 1`); n != 0 {
		t.Errorf("%d orders without exactly one reservation, want 0", n)
	}
}

// startNode starts a node of t's own, removed when t ends.
func startNode(t testing.TB) *rabbittest.Node {
	t.Helper()
	n, err := rabbittest.Start(rabbittest.Options{MaxMessageSize: maxMessageSize})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Remove() })
	return n
}

// newRelay is the relay cfg describes (none: the defaults) on the table
// outbox of db; a configuration NewOutboxRelay refuses fails tb.
func newRelay(tb testing.TB, db *sql.DB, broker postgres.MessageBroker, cfg ...postgres.RelayConfig) *postgres.OutboxRelay {
	tb.Helper()
	var c postgres.RelayConfig
	if len(cfg) > 0 {
		c = cfg[0]
	}
	r, err := tableOutbox(db).NewRelay(broker, c)
	if err != nil {
		tb.Fatal(err)
	}
	return r
}

// tableOutbox is the table outbox of db. pgtest opens db with pgx's stdlib
// driver, on which OpenDB of the zero Config cannot fail.
func tableOutbox(db *sql.DB) *postgres.Outbox[postgres.SQLTx] {
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		panic(err)
	}
	return ob
}
