package natsbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// The tests need a PostgreSQL server: the one OUTBOX_POSTGRES_URL names
// (make natsbroker starts one), or else one pgtest.Main starts for them.
// They start their own JetStream servers in process, each with its store
// in a temporary folder of the test's.
func TestMain(m *testing.M) { pgtest.Main(m) }

// newDatabase creates a database with the outbox's and the example's tables for t alone,
// dropped when t ends, and opens it.
func newDatabase(t testing.TB) *sql.DB {
	t.Helper()
	db := pgtest.Open(t, pgtest.NewBlankDatabase(t), "")
	if err := errors.Join(tableOutbox(db).Migrate(context.Background()), shop.Migrate(context.Background(), db)); err != nil {
		t.Fatal(err)
	}
	return db
}

// broker is an embedded JetStream server that a test can stop and start
// again on the same store and port, as a server restarts.
type broker struct {
	t    testing.TB
	opts server.Options
	srv  *server.Server
}

// startBroker starts a JetStream server on a free loopback port with its
// store in a temporary folder, and stops it when t ends. edit, if not nil,
// changes its options first.
func startBroker(t testing.TB, edit func(*server.Options)) *broker {
	t.Helper()
	b := &broker{t: t, opts: server.Options{
		Host:      "127.0.0.1",
		Port:      freePort(t),
		JetStream: true,
		StoreDir:  t.TempDir(),
		NoSigs:    true,
		NoLog:     true,
	}}
	if edit != nil {
		edit(&b.opts)
	}
	b.start()
	t.Cleanup(b.stop)
	return b
}

func (b *broker) start() {
	b.t.Helper()
	srv, err := server.NewServer(b.opts.Clone())
	if err != nil {
		b.t.Fatal(err)
	}
	srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		b.t.Fatal("JetStream server not ready within 30 s")
	}
	b.srv = srv
}

func (b *broker) stop() {
	if b.srv != nil {
		b.srv.Shutdown()
		b.srv.WaitForShutdown()
		b.srv = nil
	}
}

func (b *broker) url() string {
	return "nats://" + net.JoinHostPort(b.opts.Host, strconv.Itoa(b.opts.Port))
}

// freePort is a loopback port that was free a moment ago, and that it has
// not handed out before in this process: a server that is stopped and
// started again needs the same one, and the system may hand out a port
// again as soon as its listener is closed (here, a few sets of six ports in
// a thousand held one twice), which would give two servers of a cluster
// one port.
func freePort(t testing.TB) int {
	t.Helper()
	for {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close() // held until a new port is found, so that the next try gets another
		port := ln.Addr().(*net.TCPAddr).Port
		if _, given := handedOut.LoadOrStore(port, true); !given {
			return port
		}
	}
}

// handedOut are the ports freePort has handed out.
var handedOut sync.Map

// connect opens a client connection to url that reconnects for ever, a
// tenth of a second apart, and closes it when t ends.
func connect(t testing.TB, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// setUp creates the outbox's stream, with the duplicate window given, and
// the warehouse's durable consumer on it, whose AckWait is ackWait.
func setUp(t testing.TB, nc *nats.Conn, window, ackWait time.Duration) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	ctx := context.Background()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.CreateOrUpdateStream(ctx, natsbroker.StreamConfig(window))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.CreateOrUpdateConsumer(ctx, natsbroker.ConsumerConfig("warehouse", ackWait)); err != nil {
		t.Fatal(err)
	}
	return js, stream
}

// createStream creates the outbox's stream on the server at url, as
// StreamConfig says and then edit changes it, with no consumer.
func createStream(t testing.TB, url string, edit func(*jetstream.StreamConfig)) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	js, err := jetstream.New(connect(t, url))
	if err != nil {
		t.Fatal(err)
	}
	cfg := natsbroker.StreamConfig(0)
	edit(&cfg)
	stream, err := js.CreateOrUpdateStream(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return js, stream
}

// newPublisher is a Publisher over nc, as opts (if given) says.
func newPublisher(t testing.TB, nc *nats.Conn, opts ...natsbroker.PublisherOptions) *natsbroker.Publisher {
	t.Helper()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	return publisherOf(t, natsbroker.DefaultNames, js, opts...)
}

// publisherOf is names.NewPublisher(js, opts[0]), failing t on its error.
func publisherOf(t testing.TB, names natsbroker.Names, js jetstream.JetStream, opts ...natsbroker.PublisherOptions) *natsbroker.Publisher {
	t.Helper()
	var o natsbroker.PublisherOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	p, err := names.NewPublisher(js, o)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// runConsumer runs a Consumer of the warehouse's durable consumer over nc,
// feeding h, until the returned stop is called or t ends; stop returns
// Run's error.
func runConsumer(t testing.TB, nc *nats.Conn, h natsbroker.Handler) (stop func() error) {
	stop, _ = runConsumerDone(t, nc, h)
	return stop
}

// runConsumerDone is runConsumer, and a channel closed when Run returns.
func runConsumerDone(t testing.TB, nc *nats.Conn, h natsbroker.Handler) (stop func() error, done <-chan struct{}) {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.Consumer(context.Background(), natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, cons, h, natsbroker.ConsumerOptions{RetryDelay: 100 * time.Millisecond, MaxRetryDelay: 400 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testLog{t}, nil))}) // a termination is said in the test's log
	exited := make(chan struct{})
	stop = goRun(t, func(ctx context.Context) error {
		defer close(exited)
		err := c.Run(ctx)
		if ctx.Err() == nil {
			t.Logf("the consumer's Run returned before its stop: %v", err) // said, for a test that then waits in vain
		}
		return err
	})
	return stop, exited
}

// newConsumer is natsbroker.NewConsumer, failing tb on its error.
func newConsumer(tb testing.TB, c jetstream.Consumer, h natsbroker.Handler, opts natsbroker.ConsumerOptions) *natsbroker.Consumer {
	tb.Helper()
	consumer, err := natsbroker.NewConsumer(c, h, opts)
	if err != nil {
		tb.Fatal(err)
	}
	return consumer
}

// goRun runs f in a goroutine until the returned stop is called or t ends;
// stop cancels f's context, waits for f and returns its error.
func goRun(t testing.TB, f func(context.Context) error) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f(ctx) }()
	var err error
	var stopped bool
	stop = func() error {
		if !stopped {
			stopped = true
			cancel()
			err = <-done
		}
		return err
	}
	t.Cleanup(func() { stop() })
	return stop
}

// waitFor polls cond every 20 ms until it holds, and fails t if it does not
// within 60 s.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting after 60 s for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// count is the single number query returns, or -1 on error.
func count(t testing.TB, db *sql.DB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRowContext(context.Background(), query, args...).Scan(&n); err != nil {
		t.Error(err)
		return -1
	}
	return n
}

// streamMessages is how many messages the outbox's stream holds.
func streamMessages(t testing.TB, stream jetstream.Stream) uint64 {
	t.Helper()
	info, err := stream.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// testLog writes a logger's lines to the test's log.
type testLog struct{ t testing.TB }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
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

// must is a relay, or tb failed with its error.
func must(tb testing.TB) func(*postgres.OutboxRelay, error) *postgres.OutboxRelay {
	return func(r *postgres.OutboxRelay, err error) *postgres.OutboxRelay {
		tb.Helper()
		if err != nil {
			tb.Fatal(err)
		}
		return r
	}
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
