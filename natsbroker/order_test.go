package natsbroker_test

// Past the broker's door: the order the relay promises holds through what
// the stream stores, and a message is a rejection only when the message
// itself is at fault.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// A stream whose MaxMsgSize refuses row 2 of 4. The relay that keeps the
// whole table's order sends the four in a fast batch, which the stream ends
// at the refused row, so in three passes the stream stores row 1 and
// nothing after the refused row; with
// PerAggregate, where each order is an aggregate of its own and a batch
// breaks no order, rows 1, 3 and 4 are stored and marked in the first pass,
// and the refused row never makes the stream grow; and when the four rows are
// a run of one aggregate, which goes as a fast batch too, row 1 alone. (Caught: a batch over
// the whole table, which stored rows 3 and 4 ahead of row 2, and stored them
// again after each duplicate window.)
func TestRefusedRowNeverHasLaterRowsStoredAheadOfItsOrder(t *testing.T) {
	for _, tc := range []struct {
		name         string
		perAggregate bool
		oneAggregate bool // the four rows a run of one aggregate, seq 1 to 4
	}{{"whole table", false, false}, {"per aggregate", true, false}, {"one aggregate", true, true}} {
		perAggregate := tc.perAggregate
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			db := newDatabase(t)
			b := startBroker(t, nil)
			_, stream := createStream(t, b.url(), func(cfg *jetstream.StreamConfig) { cfg.MaxMsgSize = 1 << 10 })
			service := shop.NewOrderService(db)
			for _, total := range []int64{100, 200, 300, 400} {
				if _, err := service.PlaceOrder(ctx, total); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := db.Exec(`UPDATE outbox SET payload = json_build_object('orderId', 2, 'totalCents', 200, 'note', repeat('x', 2048)) WHERE id = 2`); err != nil {
				t.Fatal(err)
			}
			if tc.oneAggregate {
				if _, err := db.Exec(`UPDATE outbox SET aggregate = 'hot', seq = id`); err != nil {
					t.Fatal(err)
				}
			}
			relay := newRelay(t, db, newPublisher(t, connect(t, b.url())), postgres.RelayConfig{WholeTable: !perAggregate})
			var marked []int
			for range 3 {
				// Row 2's next attempt, after a refusal, is now: each pass
				// tries it again.
				if _, err := db.Exec(`UPDATE outbox SET retry_at = now() - interval '1 second' WHERE retry_at IS NOT NULL`); err != nil {
					t.Fatal(err)
				}
				n, err := relay.PublishPending(ctx)
				if !errors.Is(err, postgres.ErrRejected) {
					t.Fatalf("pass = %d, %v; want the refusal of row 2", n, err)
				}
				marked = append(marked, n)
			}
			want, stored := []int{1, 0, 0}, uint64(1)
			if perAggregate && !tc.oneAggregate {
				want, stored = []int{3, 0, 0}, 3
			}
			if !slices.Equal(marked, want) {
				t.Errorf("three passes marked %v, want %v", marked, want)
			}
			if got := streamMessages(t, stream); got != stored {
				t.Errorf("the stream holds %d messages, want %d: nothing stored ahead of the refused row in the order kept", got, stored)
			}
		})
	}
}

// A stream that is missing is a broker not provisioned, not a message at
// fault: the pass fails with ErrBrokerUnavailable, the row records the
// attempt and is not parked, even with ParkAfter 1; once the stream is
// there again, the row goes. (Caught: a missing stream taken for a
// rejection, which parked every row it met.)
func TestMissingStreamIsAnUnavailableBrokerAndParksNothing(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	js, _ := setUp(t, connect(t, b.url()), 0, 0)
	if err := js.DeleteStream(ctx, natsbroker.Stream); err != nil {
		t.Fatal(err)
	}
	if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 2500); err != nil {
		t.Fatal(err)
	}
	relay := newRelay(t, db, newPublisher(t, connect(t, b.url())), postgres.RelayConfig{ParkAfter: 1})
	for range 2 {
		if n, err := relay.PublishPending(ctx); n != 0 || !errors.Is(err, postgres.ErrBrokerUnavailable) || errors.Is(err, postgres.ErrRejected) {
			t.Fatalf("pass with no stream = %d, %v; want 0 and ErrBrokerUnavailable, not ErrRejected", n, err)
		}
	}
	if parked := count(t, db, `SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL`); parked != 0 {
		t.Errorf("%d rows parked while the stream was missing, want 0", parked)
	}
	if attempts := count(t, db, `SELECT attempts FROM outbox WHERE id = 1`); attempts != 2 {
		t.Errorf("row 1 records %d attempts, want 2", attempts)
	}
	setUp(t, connect(t, b.url()), 0, 0)
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Errorf("pass once the stream is back = %d, %v; want 1, <nil>", n, err)
	}
}

// An event type that makes no valid subject ("Order Placed", with a space)
// can never be published: a rejection, parked under ParkAfter, and the rows
// after it flow. (Caught: "nats: invalid subject" taken for an unavailable
// broker, which held every later row for ever.)
func TestTypeThatMakesNoSubjectIsARejection(t *testing.T) {
	for _, perAggregate := range []bool{false, true} {
		t.Run(fmt.Sprintf("PerAggregate=%v", perAggregate), func(t *testing.T) {
			ctx := context.Background()
			db := newDatabase(t)
			b := startBroker(t, nil)
			setUp(t, connect(t, b.url()), 0, 0)
			if _, err := db.Exec(`INSERT INTO outbox (type, payload) VALUES ('Order Placed', '{}')`); err != nil {
				t.Fatal(err)
			}
			if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 2500); err != nil {
				t.Fatal(err)
			}
			relay := newRelay(t, db, newPublisher(t, connect(t, b.url())), postgres.RelayConfig{ParkAfter: 1, WholeTable: !perAggregate})
			if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
				t.Fatalf("pass = %d, %v; want 1 (row 1 parked, row 2 sent), <nil>", n, err)
			}
			parked, err := tableOutbox(db).ListParked(ctx, 0)
			if err != nil || len(parked) != 1 || parked[0].ID != 1 || !strings.Contains(parked[0].LastError, "makes no valid subject") {
				t.Errorf("parked = %+v, %v; want row 1, saying its type makes no valid subject", parked, err)
			}
		})
	}
}

// A message JetStream refuses (a type that makes no subject) is offered
// once and then waits for its next attempt, RetryDelay away, unparked,
// while the orders placed after it reach the stream pass after pass.
// (Caught: the relay before the backoff per message, which offered the
// refused row again on every pass.)
func TestARejectedMessageWaitsForItsNextAttempt(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	_, stream := setUp(t, connect(t, b.url()), 0, 0)
	if _, err := db.Exec(`INSERT INTO outbox (type, payload, aggregate, seq) VALUES ('Order Placed', '{}', 'order/99', 1)`); err != nil {
		t.Fatal(err)
	}
	relay := newRelay(t, db, newPublisher(t, connect(t, b.url())), postgres.RelayConfig{RetryDelay: time.Hour, MaxRetryDelay: time.Hour})
	for pass := 1; pass <= 3; pass++ {
		if _, err := shop.NewOrderService(db).PlaceOrder(ctx, int64(pass*100)); err != nil {
			t.Fatal(err)
		}
		n, err := relay.PublishPending(ctx)
		t.Logf("pass %d: published %d, error %v", pass, n, err)
		if n != 1 || (pass == 1) != errors.Is(err, postgres.ErrRejected) {
			t.Errorf("pass %d = %d, %v; want 1, and the rejection on the first pass only", pass, n, err)
		}
	}
	if got := count(t, db, `SELECT attempts FROM outbox WHERE id = 1 AND parked_at IS NULL
		AND retry_at > clock_timestamp() + interval '29 minutes'`); got != 1 {
		t.Errorf("the refused row: %d attempts (or parked, or no next attempt half an hour away), want 1 attempt, unparked, waiting", got)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := info.State.Msgs; got != 3 {
		t.Errorf("the stream holds %d messages, want the 3 orders", got)
	}
}

// An event written for an hour from now stays in the outbox while the
// orders placed after it reach the stream; once its time has come (the test
// moves it into the past), a pass releases it and the next stores it in
// the stream, with its row's key as Nats-Msg-Id. (Caught: the relay before
// the time to deliver, which had no DeliverAt.)
func TestAScheduledEventReachesTheStreamAtItsTime(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	b := startBroker(t, nil)
	_, stream := setUp(t, connect(t, b.url()), 0, 0)
	id, key := writeEvent(t, db, postgres.Event{Type: "ReminderDue", Payload: map[string]int{"orderId": 7},
		DeliverAt: time.Now().Add(time.Hour)})
	relay := newRelay(t, db, newPublisher(t, connect(t, b.url())))
	stored := func() uint64 {
		t.Helper()
		info, err := stream.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Msgs
	}
	for pass := 1; pass <= 2; pass++ {
		if _, err := shop.NewOrderService(db).PlaceOrder(ctx, int64(pass*100)); err != nil {
			t.Fatal(err)
		}
		n, err := relay.PublishPending(ctx)
		t.Logf("pass %d: published %d, error %v", pass, n, err)
		if n != 1 || err != nil {
			t.Fatalf("pass %d = %d, %v; want the order alone", pass, n, err)
		}
	}
	if got := stored(); got != 2 {
		t.Fatalf("the stream holds %d messages before the reminder's time, want the 2 orders", got)
	}
	if _, err := db.Exec(`UPDATE outbox SET deliver_at = now() - interval '1 second' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := relay.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := stored(); got != 3 {
		t.Fatalf("the stream holds %d messages after the reminder's time, want 3", got)
	}
	m, err := stream.GetLastMsgForSubject(ctx, "outbox.ReminderDue")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stored: %s %s", m.Header.Get("Nats-Msg-Id"), m.Data)
	if m.Header.Get("Nats-Msg-Id") != key || !strings.Contains(string(m.Data), `"orderId":7`) {
		t.Errorf("the stream stored %s %s, want the row's key %s and its payload", m.Header.Get("Nats-Msg-Id"), m.Data, key)
	}
}

// What a shutdown sends again, by how the relay publishes. The relay's
// context ends while the first message's ack is lost on its way (a proxy
// drops it): the pass marks nothing, and the next pass sends again what
// was in flight. One message at a time (a broker with Publish alone), that
// is the one message: one duplicate ack. Through an asynchronous batch
// (PerAggregate and PublishBatch), it is the whole unacknowledged part of
// the batch, all five: five duplicate acks; through a fast batch
// (PublishSequence, over the whole table), the batch, five too, which the
// stream skips as duplicates (a fast batch's ack does not say how many).
// Either way the stream holds each message once. (Caught: a fast batch that
// took what it had sent, when its context ended, for stored: the cut pass
// marked all five.)
func TestShutdownSendsAgainWhatWasInFlight(t *testing.T) {
	for _, tc := range []struct {
		name         string
		perAggregate bool
		broker       func(*natsbroker.Publisher) postgres.MessageBroker
		again        int64
		duplicates   bool // whether the stream's acks say which were duplicates
	}{
		{"one at a time", false, func(p *natsbroker.Publisher) postgres.MessageBroker { return publishOnly{p} }, 1, true},
		{"batch", true, func(p *natsbroker.Publisher) postgres.MessageBroker { return batchOnly{p} }, 5, true},
		{"sequence", false, func(p *natsbroker.Publisher) postgres.MessageBroker { return p }, 5, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			db := newDatabase(t)
			b := startBroker(t, nil)
			_, stream := setUp(t, connect(t, b.url()), 0, 0)
			proxy := newAckDropper(t, strings.TrimPrefix(b.url(), "nats://"))
			pub := newPublisher(t, connect(t, proxy.url()))
			for range 5 {
				if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 100); err != nil {
					t.Fatal(err)
				}
			}
			relay := newRelay(t, db, tc.broker(pub), postgres.RelayConfig{WholeTable: !(tc.perAggregate)})
			proxy.dropNextAck()
			shutdown, cancel := context.WithCancel(ctx)
			done := make(chan int, 1)
			go func() { n, _ := relay.PublishPending(shutdown); done <- n }()
			waitFor(t, "the first ack dropped", func() bool { return proxy.dropped.Load() == 1 })
			cancel()
			if n := <-done; n != 0 {
				t.Fatalf("the pass cut by the shutdown marked %d, want 0", n)
			}
			if n, err := relay.PublishPending(ctx); n != 5 || err != nil {
				t.Fatalf("the next pass = %d, %v; want 5", n, err)
			}
			if again := proxy.published.Load() - 5; again != tc.again {
				t.Errorf("the next pass sent %d messages again, want %d", again, tc.again)
			}
			if d := pub.Duplicates(); tc.duplicates && d != tc.again {
				t.Errorf("the stream acknowledged %d duplicates, want %d", d, tc.again)
			}
			if n := streamMessages(t, stream); n != 5 {
				t.Errorf("the stream holds %d messages, want 5", n)
			}
		})
	}
}

// publishOnly is a Publisher that offers the relay Publish alone, and
// batchOnly one that offers Publish and PublishBatch, not PublishSequence.
type (
	publishOnly struct{ p *natsbroker.Publisher }
	batchOnly   struct{ p *natsbroker.Publisher }
)

func (b publishOnly) Publish(ctx context.Context, m postgres.Message) error {
	return b.p.Publish(ctx, m)
}
func (b batchOnly) Publish(ctx context.Context, m postgres.Message) error { return b.p.Publish(ctx, m) }
func (b batchOnly) PublishBatch(ctx context.Context, msgs []postgres.Message) (int, error) {
	return b.p.PublishBatch(ctx, msgs)
}
