package kafkabroker_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// stuckFor is how long the stopped database of
// TestAWaitingPartitionHoldsOnlyItselfAndARebalanceTakesItCleanly stays
// stopped: the scenario's length, not a wait for anything.
const stuckFor = 30 * time.Second

// partitionOf is the partition of the topic's n that the publisher's
// client (kgo's default partitioner) gives a record keyed key.
func partitionOf(topic, key string, n int) int32 {
	return int32(kgo.StickyKeyPartitioner(nil).ForTopic(topic).Partition(&kgo.Record{Key: []byte(key)}, n))
}

// onceCounter counts, by key, the messages its handlers applied.
type onceCounter struct {
	mu      sync.Mutex
	applied map[string]int
}

func (o *onceCounter) wrap(h kafkabroker.Handler) kafkabroker.Handler {
	return handlerFunc(func(ctx context.Context, m postgres.Message) (bool, error) {
		applied, err := h.Handle(ctx, m)
		if applied && err == nil {
			o.mu.Lock()
			o.applied[m.Key]++
			o.mu.Unlock()
		}
		return applied, err
	})
}

// twice is the keys applied more than once, and how many keys were applied.
func (o *onceCounter) twice() (twice []string, keys int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for k, n := range o.applied {
		if n > 1 {
			twice = append(twice, k)
		}
	}
	return twice, len(o.applied)
}

// A member gives each partition a goroutine of its own. Partition 2's
// orders reserve their stock in a database of their own, stopped for 30 s
// (it refuses connections): partition 2's first record waits, handled again
// in place, while partitions 0 and 1 keep being applied. A second member
// joins during the wait; the rebalance (whose timeout, 60 s, is longer than
// the wait, so nothing but the member's own goroutines could let it
// through) completes while the database is still stopped and takes the
// waiting partition to the second member (kgo's cooperative-sticky
// balancer moves the last partition; should it move another, the first
// member leaves, which moves them all). The orders placed after it reach
// whichever member now owns their partition. Once the database is back,
// partition 2's orders are applied by their new owner: every order once,
// nothing applied twice, no copy dropped (nothing was committed short).
func TestAWaitingPartitionHoldsOnlyItselfAndARebalanceTakesItCleanly(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(3, nil)
	db := newDatabase(t)
	stuckName := pgtest.NewBlankDatabase(t)
	stuck := pgtest.Open(t, stuckName, "")
	ob, err := postgres.OpenDB(stuck, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(ob.MigrateConsumer(ctx), shop.Migrate(ctx, stuck)); err != nil {
		t.Fatal(err)
	}
	admin := pgtest.Open(t, "postgres", "")
	setStopped := func(stopped bool) {
		t.Helper()
		if _, err := admin.Exec(fmt.Sprintf(`ALTER DATABASE %q ALLOW_CONNECTIONS %t`, stuckName, !stopped)); err != nil {
			t.Fatal(err)
		}
		if stopped {
			if _, err := admin.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1`, stuckName); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Cleanup(func() { admin.Exec(fmt.Sprintf(`ALTER DATABASE %q ALLOW_CONNECTIONS true`, stuckName)) })

	const waits = 2 // the partition whose database stops
	counter := &onceCounter{applied: map[string]int{}}
	main, other := shop.NewWarehouse(db), shop.NewWarehouse(stuck)
	h := counter.wrap(handlerFunc(func(ctx context.Context, m postgres.Message) (bool, error) {
		if partitionOf(topic, m.Aggregate, 3) == waits {
			return other.Handle(ctx, m)
		}
		return main.Handle(ctx, m)
	}))

	outbox, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic}), postgres.RelayConfig{})
	if err != nil {
		t.Fatal(err)
	}
	orders := shop.NewOrderService(db)
	var onWaiting, elsewhere int
	place := func(n int) {
		t.Helper()
		for range n {
			id, err := orders.PlaceOrder(ctx, 2500)
			if err != nil {
				t.Fatal(err)
			}
			if partitionOf(topic, shop.OrderAggregate(id), 3) == waits {
				onWaiting++
			} else {
				elsewhere++
			}
		}
		drain(t, relay)
	}
	reserved := func(db *sql.DB) int { return count(t, db, `SELECT count(*) FROM reservations`) }

	place(30)
	if onWaiting == 0 || elsewhere == 0 {
		t.Fatalf("%d orders on partition 2 and %d elsewhere; want some of each", onWaiting, elsewhere)
	}
	setStopped(true)
	began := time.Now()
	opts := kafkabroker.ConsumerOptions{RetryDelay: 50 * time.Millisecond, MaxRetryDelay: 500 * time.Millisecond}
	member := func() (*kafkabroker.Consumer, func()) {
		stop, consumer := runConsumerWith(t, c, "warehouse", topic, h, opts, kgo.RebalanceTimeout(time.Minute))
		return consumer, stop
	}
	first, stopFirst := member()
	waitFor(t, "partitions 0 and 1 applied while partition 2 waits", func() bool {
		return reserved(db) == elsewhere && first.Waiting() == 1
	})
	second, _ := member()
	waitFor(t, "the rebalance done while the database is stopped", func() bool {
		a, b := first.Assigned()[topic], second.Assigned()[topic]
		return len(b) > 0 && len(a)+len(b) == 3
	})
	t.Logf("after the rebalance, %.1f s into the wait: the first member has partitions %v, the second %v",
		time.Since(began).Seconds(), first.Assigned()[topic], second.Assigned()[topic])
	if !slices.Contains(second.Assigned()[topic], waits) {
		stopFirst()
		waitFor(t, "the second member has every partition", func() bool { return len(second.Assigned()[topic]) == 3 })
		t.Logf("the waiting partition stayed; the first member left, %.1f s into the wait", time.Since(began).Seconds())
	}
	place(30)
	waitFor(t, "the orders placed after the rebalance applied on partitions 0 and 1", func() bool { return reserved(db) == elsewhere })
	time.Sleep(time.Until(began.Add(stuckFor))) // the scenario's length
	if _, keys := counter.twice(); keys != elsewhere {
		t.Fatalf("%d orders applied while partition 2's database was stopped; want the %d elsewhere", keys, elsewhere)
	}
	if first.Waiting() != 0 || second.Waiting() != 1 {
		t.Errorf("%d and %d records waiting after %v on the first member and the second; want partition 2's first on the second",
			first.Waiting(), second.Waiting(), stuckFor)
	}
	setStopped(false)
	waitFor(t, "partition 2's orders applied once its database is back", func() bool { return reserved(stuck) == onWaiting })
	twice, keys := counter.twice()
	if len(twice) > 0 || keys != onWaiting+elsewhere || first.Duplicates()+second.Duplicates() != 0 {
		t.Errorf("applied twice: %v; %d keys applied of %d; %d copies dropped; want each once and no copy",
			twice, keys, onWaiting+elsewhere, first.Duplicates()+second.Duplicates())
	}
	t.Logf("%d orders on partition 2 waited %v; %d elsewhere applied meanwhile; applied %d + %d", onWaiting,
		time.Since(began).Round(time.Second), elsewhere, first.Applied(), second.Applied())
}

// A Consumer stopped while a record waits commits past the records it
// applied, on a context of its own (Run's has ended), and no further: the
// next member of the group starts at the waiting record. A Consumer runs
// once: Run again is ErrClosed, since the first left the group.
func TestAStoppedConsumerCommitsWhatItAppliedAndRunsOnce(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(1, nil)
	publisher := newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic})
	for i := 1; i <= 6; i++ {
		if err := publisher.Publish(ctx, postgres.Message{ID: int64(i), Key: fmt.Sprintf("k%d", i), Type: "Noted", Payload: `{}`}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	var handled []string
	reached := make(chan struct{})
	h := handlerFunc(func(ctx context.Context, m postgres.Message) (bool, error) {
		if m.Key == "k4" {
			close(reached)
			<-ctx.Done() // k4's database never answers
			return false, ctx.Err()
		}
		mu.Lock()
		handled = append(handled, m.Key)
		mu.Unlock()
		return true, nil
	})
	consumer, err := kafkabroker.NewConsumer(h, kafkabroker.ConsumerOptions{}, c.memberOptions("stopped", topic)...)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- consumer.Run(runCtx) }()
	<-reached
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v; want context.Canceled", err)
	}
	if err := consumer.Run(ctx); !errors.Is(err, kafkabroker.ErrClosed) {
		t.Errorf("a second Run = %v; want ErrClosed", err)
	}
	after := &orderedHandler{}
	runConsumer(t, c, "stopped", topic, after, nil)
	waitFor(t, "k6 handled by the next member", func() bool { d := after.done(); return len(d) > 0 && d[len(d)-1] == "k6" })
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(handled) != "[k1 k2 k3]" || fmt.Sprint(after.done()) != "[k4 k5 k6]" {
		t.Errorf("the stopped member handled %v and the next %v; want k1-k3, then k4-k6", handled, after.done())
	}
}
