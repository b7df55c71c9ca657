package rabbitbroker_test

import (
	"context"
	"errors"
	"fmt"
	"net"
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
		relay := newRelay(t, db, newPublisher(t, node.URL(), top, 0), postgres.RelayConfig{BatchSize: 20, PollInterval: 50 * time.Millisecond})
		goRun(t, relay.Run)
	}
	consumers := []*rabbitbroker.Consumer{
		newConsumer(t, dialer(node.URL()), top.Queue, shop.NewWarehouse(db), rabbitbroker.ConsumerOptions{}),
		newConsumer(t, dialer(node.URL()), top.Queue, shop.NewWarehouse(db), rabbitbroker.ConsumerOptions{}),
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
	relay := newRelay(t, db, newPublisher(t, proxy.url(), top, 0))
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
	c := newConsumer(t, dialer(node.URL()), top.Queue, shop.NewWarehouse(db), rabbitbroker.ConsumerOptions{})
	goRun(t, c.Run)
	waitFor(t, "both copies handled", func() bool { return c.Applied()+c.Duplicates() == 2 })
	if c.Applied() != 1 || c.Duplicates() != 1 {
		t.Errorf("applied %d, dropped %d; want 1 and 1", c.Applied(), c.Duplicates())
	}
	wantEachOrderReservedOnce(t, db, 1)
}

// A message RabbitMQ refuses (over its max_message_size) is offered once
// and then waits for its next attempt, RetryDelay away, unparked, while the
// orders placed after it reach the queue pass after pass. (Caught: the
// relay before the backoff per message, which offered the refused row
// again on every pass.)
func TestARejectedMessageWaitsForItsNextAttempt(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	if _, err := db.Exec(`INSERT INTO outbox (type, payload, aggregate, seq) VALUES ('OrderPlaced', json_build_object('note', repeat('x', $1::int)), 'order/99', 1)`, maxMessageSize); err != nil {
		t.Fatal(err)
	}
	relay := newRelay(t, db, newPublisher(t, node.URL(), top, maxMessageSize), postgres.RelayConfig{RetryDelay: time.Hour, MaxRetryDelay: time.Hour})
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
	if n := queued(t, node.URL(), top.Queue); n != 3 {
		t.Errorf("the queue holds %d messages, want the 3 orders", n)
	}
}

// An event written for an hour from now stays in the outbox while the
// orders placed after it reach the queue; once its time has come (the test
// moves it into the past), a pass releases it and the next confirms it into
// the queue, last, with its row's key as MessageId. (Caught: the relay
// before the time to deliver, which had no DeliverAt.)
func TestAScheduledEventReachesTheQueueAtItsTime(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	top := declare(t, node.URL(), 0)
	id, key := writeEvent(t, db, postgres.Event{Type: "ReminderDue", Payload: map[string]int{"orderId": 7},
		DeliverAt: time.Now().Add(time.Hour)})
	relay := newRelay(t, db, newPublisher(t, node.URL(), top, maxMessageSize))
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
	if n := queued(t, node.URL(), top.Queue); n != 2 {
		t.Fatalf("the queue holds %d messages before the reminder's time, want the 2 orders", n)
	}
	if _, err := db.Exec(`UPDATE outbox SET deliver_at = now() - interval '1 second' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := relay.PublishPending(ctx); err != nil {
			t.Fatal(err)
		}
	}
	ch, closing := channel(t, node.URL())
	defer closing()
	if n := queued(t, node.URL(), top.Queue); n != 3 {
		t.Fatalf("the queue holds %d messages after the reminder's time, want 3", n)
	}
	deliveries, err := ch.Consume(top.Queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var got []amqp.Delivery
	for len(got) < 3 {
		select {
		case d := <-deliveries:
			got = append(got, d)
		case <-time.After(2 * time.Minute):
			t.Fatalf("%d of the queue's 3 messages delivered within 2m", len(got))
		}
	}
	last := got[2]
	t.Logf("last: %s %s %s", last.Type, last.MessageId, last.Body)
	if last.Type != "ReminderDue" || last.MessageId != key || !strings.Contains(string(last.Body), `"orderId":7`) {
		t.Errorf("the last message is %s %s %s, want ReminderDue with the row's key %s and its payload", last.Type, last.MessageId, last.Body, key)
	}
}

// What can never be published is a rejection, and what follows it flows: a
// message over the node's max_message_size, refused by the Publisher before
// it is sent when it knows the limit, and by the server, which closes the
// channel, when it does not; the Publisher opens a new channel for the next
// message. Through a relay with ParkAfter 1, the big row is parked and the
// order after it reserved. A message no queue takes (an exchange with
// nothing bound: returned, NO_ROUTE) is a topology fault, which a
// re-declare mends, so it may pass: ErrBrokerUnavailable, and once the
// queue is bound again the same message goes through. (Caught: NO_ROUTE as
// a rejection, which parks rows a binding would have taken.)
func TestUnroutableMayPassAndOversizedIsARejection(t *testing.T) {
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
		{"over the size the publisher knows", newPublisher(t, node.URL(), top, maxMessageSize), big, "over the"},
		{"over the size the server takes", newPublisher(t, node.URL(), top, 0), big, "larger than configured max size"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.pub.Publish(ctx, tc.msg)
			if !errors.Is(err, postgres.ErrRejected) || !strings.Contains(err.Error(), tc.why) {
				t.Fatalf("Publish = %v; want ErrRejected saying %q", err, tc.why)
			}
			if err := tc.pub.Publish(ctx, postgres.Message{ID: 3, Key: "k3", Type: "OrderPlaced", Payload: "{}"}); err != nil {
				t.Errorf("the next Publish = %v; want <nil>", err)
			}
		})
	}
	t.Run("unroutable", func(t *testing.T) {
		pub := newPublisher(t, node.URL(), unbound, 0)
		err := pub.Publish(ctx, msg)
		if !errors.Is(err, postgres.ErrBrokerUnavailable) || errors.Is(err, postgres.ErrRejected) || !strings.Contains(err.Error(), "no queue takes routing key OrderPlaced") {
			t.Fatalf("Publish = %v; want ErrBrokerUnavailable, not ErrRejected, saying no queue takes routing key OrderPlaced", err)
		}
		ch, closing := channel(t, node.URL())
		defer closing()
		if err := ch.QueueBind(unbound.Queue, "#", unbound.Exchange, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish(ctx, msg); err != nil {
			t.Fatalf("Publish once the queue is bound again = %v; want <nil>", err)
		}
		if n := queued(t, node.URL(), unbound.Queue); n != 1 {
			t.Errorf("the queue holds %d messages, want 1", n)
		}
	})
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
		relay := newRelay(t, db, newPublisher(t, node.URL(), top, 0), postgres.RelayConfig{ParkAfter: 1})
		if n, err := relay.PublishPending(ctx); n != 1 || err != nil {
			t.Fatalf("pass = %d, %v; want 1 (row 1 parked, row 2 sent), <nil>", n, err)
		}
		parked, err := tableOutbox(db).ListParked(ctx, 0)
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
	pub := publisherOf(t, dialer(node.URL()), rabbitbroker.PublisherOptions{Exchange: name})
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

// A server that stops reading (here a proxy that stalls, while what the
// server sends still flows, heartbeats too): a publish stuck in its write
// returns when its context ends, with ErrBrokerUnavailable and the
// context's error, saying the outcome is unknown, and so does a small one
// queued behind it on the same connection (or, if the big one's end closes
// the connection first, ErrBrokerUnavailable with the client's ErrClosed,
// sent nothing, or with its cut write, the outcome unknown, said so); the
// Publisher then drops the connection, and the next publish dials a new
// one and goes through.
// (Caught: a Publisher that held its lock across the write, and a client
// whose write does not heed the context: both calls returned only when
// the connection failed, with the write's error, not the context's.)
func TestPublishToAServerThatStopsReadingEndsWithItsContext(t *testing.T) {
	top := declare(t, node.URL(), 0)
	proxy := newStallingProxy(t, strings.TrimPrefix(strings.TrimSuffix(node.URL(), "/"), "amqp://guest:guest@"))
	var conns []*watchedConn
	var connsMu sync.Mutex
	dial := func() (*amqp.Connection, error) {
		return amqp.DialConfig(proxy.url(), amqp.Config{Dial: func(network, addr string) (net.Conn, error) {
			c, err := net.DialTimeout(network, addr, 30*time.Second)
			if err != nil {
				return nil, err
			}
			w := &watchedConn{Conn: c}
			connsMu.Lock()
			conns = append(conns, w)
			connsMu.Unlock()
			return w, nil
		}})
	}
	const big = 32 << 20
	pub := publisherOf(t, dial, rabbitbroker.PublisherOptions{Exchange: top.Exchange, MaxMessageSize: 2 * big})
	publish := func(ctx context.Context, id int64, size int) error {
		return pub.Publish(ctx, postgres.Message{ID: id, Key: fmt.Sprint("k", id), Type: "OrderPlaced", Payload: strings.Repeat("x", size)})
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := publish(ctx, 1, 2); err != nil {
		t.Fatal(err)
	}
	connsMu.Lock()
	first := conns[0]
	connsMu.Unlock()

	proxy.stall()
	type result struct {
		id  int64
		err error
	}
	results := make(chan result, 2)
	bigCtx, cancelBig := context.WithCancel(context.Background())
	defer cancelBig()
	before := first.offered.Load()
	go func() { results <- result{2, publish(bigCtx, 2, big)} }()
	// The big message's write is under way and stuck: more of it offered
	// than the kernel's buffers hold, and less than all of it.
	waitFor(t, "the big message's write stuck", func() bool {
		offered := first.offered.Load() - before
		return first.writing.Load() > 0 && offered > 1<<20 && offered < big
	})
	smallCtx, cancelSmall := context.WithCancel(context.Background())
	defer cancelSmall()
	go func() { results <- result{3, publish(smallCtx, 3, 2)} }()
	cancelBig()
	cancelSmall()
	for range 2 {
		var r result
		select {
		case r = <-results:
		case <-time.After(2 * time.Minute):
			t.Fatal("a publish to a server that stopped reading did not return within 2m of its context's end")
		}
		t.Logf("message %d: %v", r.id, r.err)
		// The small one may meet the big one's end before its own context
		// ends: the connection closed before its write began (sent
		// nothing: amqp's ErrClosed), or its write cut by the deadline
		// that closes it (the outcome unknown, said so).
		switch {
		case r.id == 3 && errors.Is(r.err, postgres.ErrBrokerUnavailable) &&
			(errors.Is(r.err, amqp.ErrClosed) || strings.Contains(r.err.Error(), "write failed, so whether RabbitMQ took it is unknown")):
		case !errors.Is(r.err, postgres.ErrBrokerUnavailable) || !errors.Is(r.err, context.Canceled) || !strings.Contains(r.err.Error(), "unknown"):
			t.Errorf("message %d: %v; want ErrBrokerUnavailable and context.Canceled, the outcome unknown", r.id, r.err)
		}
	}
	proxy.resume()
	waitFor(t, "the stuck connection closed", func() bool { return first.writing.Load() == 0 })
	if err := publish(ctx, 4, 2); err != nil {
		t.Fatalf("a publish after the stall: %v", err)
	}
	connsMu.Lock()
	n := len(conns)
	connsMu.Unlock()
	if n != 2 {
		t.Errorf("%d connections dialled, want 2 (the stuck one dropped, one new)", n)
	}
}

// Check finds a topology that was never declared, naming what is missing,
// and passes once Declare has made it; it declares nothing itself.
// (Caught: the relay process had no way to check the topology it
// publishes to, short of declaring it.)
func TestTopologyCheckFindsWhatIsMissing(t *testing.T) {
	url := node.URL()
	n := topologies.Add(1)
	top := rabbitbroker.Topology{Exchange: fmt.Sprint("outbox", n), Queue: fmt.Sprint("warehouse", n), DeliveryLimit: 3}
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for range 2 { // and again: the first check declared nothing
		if err := top.Check(conn); err == nil || !strings.Contains(err.Error(), "exchange "+top.Exchange) {
			t.Fatalf("Check before Declare = %v, want an error naming exchange %s", err, top.Exchange)
		}
	}
	if err := (rabbitbroker.Topology{}).Check(conn); !errors.Is(err, rabbitbroker.ErrTopology) {
		t.Errorf("Check of the zero Topology = %v, want ErrTopology", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := top.Declare(ch); err != nil {
		t.Fatal(err)
	}
	if err := top.Check(conn); err != nil {
		t.Errorf("Check after Declare = %v, want nil", err)
	}
}
