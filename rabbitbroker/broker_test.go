package rabbitbroker_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

// End to end: four clients place 200 orders, three relays publish them in
// batches with confirms in flight, two consumers attach to the queue (one
// active at a time): every order reserved once, and no copy applied.
func TestEveryOrderReservedOnceEndToEnd(t *testing.T) {
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	for range 3 {
		relay := postgres.NewOutboxRelay(db, newPublisher(t, node.URL(), top, 0))
		relay.PerAggregate, relay.BatchSize, relay.PollInterval = true, 20, 50*time.Millisecond
		goRun(t, relay.Run)
	}
	consumers := []*rabbitbroker.Consumer{
		rabbitbroker.NewConsumer(dialer(node.URL()), top.Queue, shop.NewWarehouse(db)),
		rabbitbroker.NewConsumer(dialer(node.URL()), top.Queue, shop.NewWarehouse(db)),
	}
	for _, c := range consumers {
		goRun(t, c.Run)
	}
	const clients, each = 4, 50
	service := shop.NewOrderService(db)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				if _, err := service.PlaceOrder(context.Background(), int64(100*(c+1)+i)); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	waitFor(t, "every order reserved and every row marked", func() bool {
		return count(t, db, `SELECT count(*) FROM reservations`) >= clients*each &&
			count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0
	})
	wantEachOrderReservedOnce(t, db, clients*each)
	var applied, dups int64
	for _, c := range consumers {
		applied, dups = applied+c.Applied(), dups+c.Duplicates()
	}
	if applied != clients*each || dups != 0 {
		t.Errorf("consumers applied %d and dropped %d copies, want %d and 0", applied, dups, clients*each)
	}
}

// A confirm lost on its way back: RabbitMQ has the message, and the
// connection breaks before its basic.ack reaches the relay. The pass marks
// nothing and says the outcome is unknown (ErrBrokerUnavailable, not a
// rejection); the next pass dials again and publishes the message again;
// RabbitMQ, with no duplicate window, queues both copies; the consumer
// applies the first and drops the second by its key: the order is
// reserved once, and the copy counted. (Caught: a Publisher that kept its
// broken connection: every later pass failed.)
func TestLostConfirmIsSentAgainAndTheCopyDropped(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	proxy := newConfirmBreaker(t, strings.TrimPrefix(strings.TrimSuffix(node.URL(), "/"), "amqp://guest:guest@"))
	relay := postgres.NewOutboxRelay(db, newPublisher(t, proxy.url(), top, 0))
	if _, err := shop.NewOrderService(db).PlaceOrder(ctx, 2500); err != nil {
		t.Fatal(err)
	}
	proxy.breakAtNextConfirm()
	if n, err := relay.PublishPending(ctx); n != 0 || !errors.Is(err, postgres.ErrBrokerUnavailable) || errors.Is(err, postgres.ErrRejected) {
		t.Fatalf("pass whose confirm was lost = %d, %v; want 0 and ErrBrokerUnavailable", n, err)
	}
	if proxy.broken.Load() != 1 {
		t.Fatalf("the proxy broke %d connections, want 1", proxy.broken.Load())
	}
	if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
		t.Fatalf("next pass = %d, %v; want 1, <nil>", n, err)
	}
	if n := queued(t, node.URL(), top.Queue); n != 2 {
		t.Errorf("the queue holds %d messages, want 2: the message and its copy", n)
	}
	c := rabbitbroker.NewConsumer(dialer(node.URL()), top.Queue, shop.NewWarehouse(db))
	goRun(t, c.Run)
	waitFor(t, "both copies handled", func() bool { return c.Applied()+c.Duplicates() == 2 })
	if c.Applied() != 1 || c.Duplicates() != 1 {
		t.Errorf("applied %d, dropped %d; want 1 and 1", c.Applied(), c.Duplicates())
	}
	wantEachOrderReservedOnce(t, db, 1)
}

// What can never be published is a rejection, and what follows it flows:
// a message no queue takes (an exchange with nothing bound: returned), and
// one over the node's max_message_size, refused by the Publisher before it
// is sent when it knows the limit, and by the server, which closes the
// channel, when it does not; the Publisher opens a new channel for the
// next message. Through a relay with ParkAfter 1, the big row is parked
// and the order after it reserved.
func TestUnroutableAndOversizedAreRejectionsAndTheRestFlows(t *testing.T) {
	ctx := context.Background()
	top := declare(t, node.URL(), 0)
	msg := postgres.Message{ID: 1, Key: "k1", Type: "OrderPlaced", Payload: `{"orderId":1,"totalCents":100}`}
	big := postgres.Message{ID: 2, Key: "k2", Type: "OrderPlaced", Payload: `{"note":"` + strings.Repeat("x", maxMessageSize) + `"}`}
	unbound := declare(t, node.URL(), 0)
	ch, closing := channel(t, node.URL())
	if err := ch.QueueUnbind(unbound.Queue, "#", unbound.Exchange, nil); err != nil {
		t.Fatal(err)
	}
	closing()
	for _, tc := range []struct {
		name string
		pub  *rabbitbroker.Publisher
		msg  postgres.Message
		why  string
	}{
		{"unroutable", newPublisher(t, node.URL(), unbound, 0), msg, "no queue takes routing key OrderPlaced"},
		{"over the size the publisher knows", newPublisher(t, node.URL(), top, maxMessageSize), big, "over the"},
		{"over the size the server takes", newPublisher(t, node.URL(), top, 0), big, "larger than configured max size"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.pub.Publish(ctx, tc.msg)
			if !errors.Is(err, postgres.ErrRejected) || !strings.Contains(err.Error(), tc.why) {
				t.Fatalf("Publish = %v; want ErrRejected saying %q", err, tc.why)
			}
			if err := tc.pub.Publish(ctx, postgres.Message{ID: 3, Key: "k3", Type: "OrderPlaced", Payload: "{}"}); err != nil && tc.name != "unroutable" {
				t.Errorf("the next Publish = %v; want <nil>", err)
			}
		})
	}
	t.Run("relay", func(t *testing.T) {
		db := newDatabase(t)
		top := declare(t, node.URL(), 0)
		service := shop.NewOrderService(db)
		for _, total := range []int64{100, 200} {
			if _, err := service.PlaceOrder(ctx, total); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := db.Exec(`UPDATE outbox SET payload = json_build_object('orderId', 1, 'totalCents', 100, 'note', repeat('x', $1::int)) WHERE id = 1`, maxMessageSize); err != nil {
			t.Fatal(err)
		}
		relay := postgres.NewOutboxRelay(db, newPublisher(t, node.URL(), top, 0))
		relay.ParkAfter = 1
		if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
			t.Fatalf("pass = %d, %v; want 1 (row 1 parked, row 2 sent), <nil>", n, err)
		}
		parked, err := postgres.ListParked(ctx, db, 0)
		if err != nil || len(parked) != 1 || parked[0].ID != 1 {
			t.Errorf("parked = %+v, %v; want row 1", parked, err)
		}
		// Row 2 may be there twice: sent in the batch behind row 1 on a
		// channel the server had not closed yet (or on the next one, if it
		// had), and sent again by the pass, since a batch answers for its
		// first refusal only. Row 1, never.
		n := queued(t, node.URL(), top.Queue)
		ch, closing := channel(t, node.URL())
		defer closing()
		deliveries, err := ch.Consume(top.Queue, "", true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for range n {
			ids = append(ids, fmt.Sprint((<-deliveries).Headers[rabbitbroker.HeaderID]))
		}
		t.Logf("the queue held rows %v", ids)
		if len(ids) == 0 || len(ids) > 2 || slices.ContainsFunc(ids, func(id string) bool { return id != "2" }) {
			t.Errorf("the queue held rows %v, want row 2, once or twice", ids)
		}
	})
}

// A server that blocks publishers (its memory alarm, set here by a
// watermark of 0, sends connection.blocked): a Publish fails at once with
// ErrBrokerUnavailable, saying so, instead of waiting out its context on a
// write the server does not read; once the alarm clears, publishing goes
// on. (Caught: a Publisher that ignored connection.blocked: each Publish
// waited out its context and never said why.)
func TestServerThatBlocksPublishersIsUnavailable(t *testing.T) {
	top := declare(t, node.URL(), 0)
	pub := newPublisher(t, node.URL(), top, 0)
	msg := postgres.Message{ID: 1, Key: "k1", Type: "OrderPlaced", Payload: "{}"}
	if err := pub.Publish(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	if err := node.Ctl("set_vm_memory_high_watermark", "0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := node.Ctl("set_vm_memory_high_watermark", "0.4"); err != nil {
			t.Error(err)
		}
	})
	waitFor(t, "the Publisher told it is blocked", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		err := pub.Publish(ctx, msg)
		return err != nil && strings.Contains(err.Error(), "blocks publishers")
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := pub.Publish(ctx, msg); !errors.Is(err, postgres.ErrBrokerUnavailable) || ctx.Err() != nil || !strings.Contains(err.Error(), "blocks publishers") {
		t.Fatalf("Publish while blocked = %v (context: %v); want ErrBrokerUnavailable at once, saying the server blocks publishers", err, ctx.Err())
	}
	if err := node.Ctl("set_vm_memory_high_watermark", "0.4"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "publishing again", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return pub.Publish(ctx, msg) == nil
	})
}

// A message refused (basic.nack) closes the channel it went on, and the
// next message goes on a new one; a message taken keeps it. With RabbitMQ
// 3.10 a channel that had messages in flight to a quorum queue whose leader
// was killed refused every later message for as long as it lived, while a
// new channel's went through to the new leader
// (TestQueueLeaderKilledMidDrainLosesNothingConfirmed met it). Here a
// queue refuses by design: it holds two messages at most and refuses more
// (x-overflow reject-publish). (Caught: a Publisher that kept the refusing
// channel: the fourth message went on it.)
func TestRefusedMessageClosesItsChannel(t *testing.T) {
	ch, closing := channel(t, node.URL())
	defer closing()
	const name = "limited"
	if err := ch.ExchangeDeclare(name, amqp.ExchangeFanout, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(name, false, true, false, false, amqp.Table{"x-max-length": 2, "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	defer func() { // the node outlives the test: go test -count=2 declares them again
		if _, err := ch.QueueDelete(name, false, false, false); err != nil {
			t.Error(err)
		}
		if err := ch.ExchangeDelete(name, false, false); err != nil {
			t.Error(err)
		}
	}()
	if err := ch.QueueBind(name, "", name, false, nil); err != nil {
		t.Fatal(err)
	}
	pub := rabbitbroker.NewPublisher(dialer(node.URL()), name, 0)
	defer pub.Close()
	publish := func(id int64) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return pub.Publish(ctx, postgres.Message{ID: id, Key: fmt.Sprint("k", id), Type: "OrderPlaced", Payload: "{}"})
	}
	if err := publish(1); err != nil {
		t.Fatal(err)
	}
	first := rabbitbroker.ChannelOf(pub)
	if err := publish(2); err != nil {
		t.Fatal(err)
	}
	if got := rabbitbroker.ChannelOf(pub); got != first {
		t.Fatal("a message taken changed the Publisher's channel")
	}
	if err := publish(3); !errors.Is(err, postgres.ErrBrokerUnavailable) || !strings.Contains(err.Error(), "basic.nack") {
		t.Fatalf("the third message, over the queue's length: %v; want a refusal (basic.nack) wrapping ErrBrokerUnavailable", err)
	}
	if rabbitbroker.ChannelOf(pub) != nil {
		t.Fatal("the channel that refused a message is still the Publisher's")
	}
	waitFor(t, "the channel that refused a message closed", first.IsClosed)
	if _, err := ch.QueuePurge(name, false); err != nil {
		t.Fatal(err)
	}
	if err := publish(4); err != nil {
		t.Fatal(err)
	}
	if got := rabbitbroker.ChannelOf(pub); got == nil || got == first || got.IsClosed() {
		t.Fatal("the message after the refusal did not go on a new channel")
	}
}
