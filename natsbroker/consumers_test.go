package natsbroker_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// effectOnce is a Handler of one named consumer (postgres.Config.Consumer)
// that applies each message once into its own table, and whose first
// delivery fails after its apply committed, as an ack lost on the way, so
// that JetStream delivers that message again.
type effectOnce struct {
	ob    *postgres.Outbox[postgres.SQLTx]
	table string
	mu    sync.Mutex
	lost  bool           // the first ack was lost
	seen  map[string]int // deliveries by key
	dups  int            // deliveries dropped as copies
}

func (e *effectOnce) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	applied, err := e.ob.ApplyOnce(ctx, msg, postgres.ApplyOptions{}, func(ctx context.Context, tx postgres.SQLTx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO `+e.table+` (message_key) VALUES ($1)`, msg.Key)
		return err
	})
	e.mu.Lock()
	defer e.mu.Unlock()
	e.seen[msg.Key]++
	if err == nil && !applied {
		e.dups++
	}
	if err == nil && applied && !e.lost {
		e.lost = true
		return false, errors.New("the ack was lost after the apply committed")
	}
	return applied, err
}

// Two consumers of the same events in one database, a mailer beside the
// warehouse, each a durable consumer of the stream and an Outbox of its
// own name: each applies all 20 orders' events once, and each drops the
// copy JetStream delivers again after an ack lost past its commit. (With
// one name for both, the second consumer applied none: it found the first's
// keys and positions and dropped every message as a copy.)
func TestTwoConsumersInOneDatabaseEachApplyEveryEventOnce(t *testing.T) {
	ctx := context.Background()
	b := startBroker(t, nil)
	nc := connect(t, b.url())
	js, stream := setUp(t, nc, 0, 5*time.Second)
	if _, err := stream.CreateOrUpdateConsumer(ctx, natsbroker.ConsumerConfig("mailer", 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	db := newDatabase(t)
	for _, table := range []string{"reserved", "mailed"} {
		if _, err := db.Exec(`CREATE TABLE ` + table + ` (message_key text PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
	}
	placeAndPublish(t, db, b.url(), 20)
	handlers := map[string]*effectOnce{}
	for durable, table := range map[string]string{"warehouse": "reserved", "mailer": "mailed"} {
		ob, err := postgres.OpenDB(db, postgres.Config{Consumer: durable})
		if err != nil {
			t.Fatal(err)
		}
		h := &effectOnce{ob: ob, table: table, seen: map[string]int{}}
		handlers[table] = h
		runNamedConsumer(t, js, durable, h)
	}
	for table, h := range handlers {
		waitFor(t, fmt.Sprintf("20 events applied into %s and a copy dropped", table), func() bool {
			h.mu.Lock()
			defer h.mu.Unlock()
			return count(t, db, `SELECT count(*) FROM `+table) == 20 && h.dups >= 1
		})
	}
	for table, h := range handlers {
		if n := count(t, db, `SELECT count(*) FROM `+table); n != 20 {
			t.Errorf("%s holds %d effects; want the 20 events once", table, n)
		}
		h.mu.Lock()
		t.Logf("%s: %d keys delivered, %d copies dropped", table, len(h.seen), h.dups)
		h.mu.Unlock()
	}
	if n := count(t, db, `SELECT count(DISTINCT consumer) FROM processed_messages`); n != 2 {
		t.Errorf("keys recorded under %d consumers; want 2", n)
	}
}

// runNamedConsumer runs a Consumer of the durable consumer durable, feeding
// h, until t ends.
func runNamedConsumer(t *testing.T, js jetstream.JetStream, durable string, h natsbroker.Handler) {
	t.Helper()
	cons, err := js.Consumer(context.Background(), natsbroker.Stream, durable)
	if err != nil {
		t.Fatal(err)
	}
	goRun(t, newConsumer(t, cons, h, natsbroker.ConsumerOptions{RetryDelay: 100 * time.Millisecond, MaxRetryDelay: 400 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testLog{t}, nil))}).Run)
}

// NewConsumer checks its options when it makes the Consumer and refuses a
// bad one with an error wrapping postgres.ErrInvalidConfig that names it;
// the zero options are every default. (The options used to be fields set
// after NewConsumer, read when Run began, a negative one taken for zero.)
func TestNewConsumerChecksItsOptions(t *testing.T) {
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 5*time.Second)
	cons, err := js.Consumer(context.Background(), natsbroker.Stream, "warehouse")
	if err != nil {
		t.Fatal(err)
	}
	h := &effectOnce{}
	for _, tc := range []struct {
		cons jetstream.Consumer
		h    natsbroker.Handler
		opts natsbroker.ConsumerOptions
		want string
	}{
		{nil, h, natsbroker.ConsumerOptions{}, "no JetStream consumer"},
		{cons, nil, natsbroker.ConsumerOptions{}, "no handler"},
		{cons, h, natsbroker.ConsumerOptions{RetryDelay: -time.Second}, "RetryDelay -1s"},
		{cons, h, natsbroker.ConsumerOptions{Prefetch: -1}, "Prefetch -1"},
		{cons, h, natsbroker.ConsumerOptions{MaxBatch: -2}, "MaxBatch -2"},
		{cons, h, natsbroker.ConsumerOptions{RetryDelay: time.Minute, MaxRetryDelay: time.Second}, "MaxRetryDelay 1s is below RetryDelay 1m0s"},
		{cons, h, natsbroker.ConsumerOptions{RetryDelay: time.Second, MaxOutOfOrder: 2}, "MaxOutOfOrder 2"},
	} {
		c, err := natsbroker.NewConsumer(tc.cons, tc.h, tc.opts)
		if c != nil || !errors.Is(err, postgres.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewConsumer(%+v) = %v, %v; want ErrInvalidConfig saying %q", tc.opts, c, err, tc.want)
		}
	}
	if _, err := natsbroker.NewConsumer(cons, h, natsbroker.ConsumerOptions{}); err != nil {
		t.Errorf("the zero options: %v", err)
	}
}
