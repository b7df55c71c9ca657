package natsbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// typesSeen is a Handler that records each message's type and applies
// nothing.
type typesSeen struct {
	mu    sync.Mutex
	types []string
}

func (h *typesSeen) Handle(_ context.Context, msg postgres.Message) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.types = append(h.types, msg.Type)
	return true, nil
}

func (h *typesSeen) seen() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.types)
}

// Two outboxes of one database, the default one and billing_outbox, each
// relayed to a stream of its own on one JetStream (OUTBOX with outbox.<type>,
// BILLING with billing.<type>): each stream stores its outbox's messages
// only, and each consumer gets its own, their types read back whole, a
// dotted one too. Names that JetStream would refuse are refused first.
// (Caught: the stream, the subject prefix and the consumer's decoding fixed
// to OUTBOX and outbox.)
func TestTwoOutboxesThroughTwoStreams(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	billingOutbox, err := postgres.OpenDB(db, postgres.Config{Table: "billing_outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := billingOutbox.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	billing, err := natsbroker.NewNames("BILLING", "billing.")
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][2]string{{"", "billing."}, {"BILL ING", "billing."}, {"BILLING", "billing"}, {"BILLING", "bill*."}, {"BILLING", ".billing."}} {
		if _, err := natsbroker.NewNames(bad[0], bad[1]); err == nil {
			t.Errorf("NewNames(%q, %q) = nil error, want a refusal", bad[0], bad[1])
		}
	}

	b := startBroker(t, nil)
	js, err := jetstream.New(connect(t, b.url()))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]*typesSeen{}
	for _, n := range []natsbroker.Names{natsbroker.DefaultNames, billing} {
		stream, err := js.CreateOrUpdateStream(ctx, n.StreamConfig(0))
		if err != nil {
			t.Fatal(err)
		}
		if err := natsbroker.CheckStream(ctx, js, n.StreamConfig(0)); err != nil {
			t.Fatal(err)
		}
		cons, err := stream.CreateOrUpdateConsumer(ctx, n.ConsumerConfig("reader", 5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		seen[n.Stream()] = &typesSeen{}
		goRun(t, newConsumer(t, cons, seen[n.Stream()], natsbroker.ConsumerOptions{}).Run)
	}

	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		for _, typ := range []string{"InvoiceIssued", "invoice.paid"} {
			if _, err := billingOutbox.Write(ctx, tx, postgres.Event{Type: typ, Payload: map[string]int{"invoice": 1}}); err != nil {
				return err
			}
		}
		_, err := tableOutbox(db).Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"order": 1}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	for _, relay := range []*postgres.OutboxRelay{
		must(t)(billingOutbox.NewRelay(publisherOf(t, billing, js), postgres.RelayConfig{})),
		newRelay(t, db, publisherOf(t, natsbroker.DefaultNames, js)),
	} {
		for {
			n, err := relay.PublishPending(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if n == 0 {
				break
			}
		}
	}
	waitFor(t, "both consumers to get their messages", func() bool {
		return len(seen["BILLING"].seen()) == 2 && len(seen["OUTBOX"].seen()) == 1
	})
	if got := seen["BILLING"].seen(); !slices.Equal(slices.Sorted(slices.Values(got)), []string{"InvoiceIssued", "invoice.paid"}) {
		t.Errorf("billing's consumer got %v", got)
	}
	if got := seen["OUTBOX"].seen(); !slices.Equal(got, []string{"OrderPlaced"}) {
		t.Errorf("the default consumer got %v", got)
	}
	for name, want := range map[string]uint64{"BILLING": 2, "OUTBOX": 1} {
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.Msgs != want {
			t.Errorf("stream %s holds %d messages, want %d", name, info.State.Msgs, want)
		}
	}
}

// CheckStream refuses a stream that is not as configured, each difference
// named: its subjects, storage, replicas, age limit and duplicate window,
// and whether it allows batch publishing.
// (Caught: a CheckStream that ignored the duplicate window, so a stream
// whose window an operator shortened passed, and copies past it reached
// the consumers.)
func TestCheckStreamRefusesAStreamNotAsConfigured(t *testing.T) {
	ctx := context.Background()
	b := startBroker(t, nil)
	js, err := jetstream.New(connect(t, b.url()))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateOrUpdateStream(ctx, natsbroker.StreamConfig(2*time.Minute)); err != nil {
		t.Fatal(err)
	}
	if err := natsbroker.CheckStream(ctx, js, natsbroker.StreamConfig(2*time.Minute)); err != nil {
		t.Fatalf("CheckStream of the stream as made = %v", err)
	}
	for what, edit := range map[string]func(*jetstream.StreamConfig){
		"drops duplicates within": func(c *jetstream.StreamConfig) { c.Duplicates = 5 * time.Minute },
		"takes subjects":          func(c *jetstream.StreamConfig) { c.Subjects = []string{"other.>"} },
		"storage":                 func(c *jetstream.StreamConfig) { c.Storage = jetstream.MemoryStorage },
		"replicas":                func(c *jetstream.StreamConfig) { c.Replicas = 3 },
		"keeps messages":          func(c *jetstream.StreamConfig) { c.MaxAge = time.Hour },
	} {
		want := natsbroker.StreamConfig(2 * time.Minute)
		edit(&want)
		if err := natsbroker.CheckStream(ctx, js, want); !errors.Is(err, natsbroker.ErrStreamConfig) || !strings.Contains(err.Error(), what) {
			t.Errorf("CheckStream against a stream that differs in %q = %v, want ErrStreamConfig saying so", what, err)
		}
	}
	old := natsbroker.StreamConfig(2 * time.Minute) // as made before the relays sent fast batches
	old.AllowBatchPublish = false
	if _, err := js.UpdateStream(ctx, old); err != nil {
		t.Fatal(err)
	}
	if err := natsbroker.CheckStream(ctx, js, natsbroker.StreamConfig(2*time.Minute)); !errors.Is(err, natsbroker.ErrStreamConfig) || !strings.Contains(err.Error(), "batch publishing") {
		t.Errorf("CheckStream of a stream that does not allow batch publishing = %v, want ErrStreamConfig saying so", err)
	}
}
