package rabbitbroker_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/rabbitbroker"
	"example.com/patterns/enterprise/outbox/rabbitbroker/rabbittest"
)

// A node of a cluster of three killed mid-drain (SIGKILL, as a crash):
// the quorum queue is declared on the first node, which leads it, and the
// relays and the consumer dial it first. Halfway through 120 orders the
// first node is killed; the clients dial the others, the queue elects a new
// leader among the two left (a majority), and every event a relay had
// marked sent reaches the warehouse, in seq order, once: nothing confirmed
// is lost. (Caught: a queue with one replica, on the killed node: the
// drain never ended.)
func TestQueueLeaderKilledMidDrainLosesNothingConfirmed(t *testing.T) {
	c, err := rabbittest.StartCluster(3, rabbittest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Remove() })
	t.Cleanup(func() { // before Remove: what the nodes saw, if the test failed
		if t.Failed() {
			for _, n := range c.Nodes {
				t.Logf("node %s's log, its end:\n%s", n.Name, n.Log())
			}
		}
	})
	drainThroughAFault(t, c.URLs(), 2, func() rabbitbroker.Topology { return workingQueue(t, c) }, func([]func(), func() func()) {
		c.Nodes[0].Kill()
	})
}

// workingQueue declares a topology on c's first node and returns it once
// its quorum queue works: all of c's nodes hold a member of it, online
// (rabbitmqctl list_queues), and it took a message, publisher-confirmed,
// which is then purged. A queue that does not, within half a minute, is
// deleted and another declared, three times at most. Under load (CI: the
// race detector, other tests' nodes) this test twice met a queue of
// RabbitMQ 3.10 that, its three members online, confirmed not one publish
// in five minutes, every one refused (basic.nack), the first refusals
// within a second of the fault: what the drain then showed was not what
// the fault does to a working queue. A probe tells such a queue from one
// that worked before the fault; the nodes' logs, printed if the test
// fails, say more. (The relays meet a refusing queue as unavailable, and
// retry.)
func workingQueue(t *testing.T, c *rabbittest.Cluster) rabbitbroker.Topology {
	for attempt := 1; ; attempt++ {
		top := declare(t, c.Nodes[0].URL(), 0)
		why := queueWorks(t, c, top.Queue)
		if why == "" {
			return top
		}
		if attempt == 3 {
			t.Fatalf("queue %s, the third declared: %s", top.Queue, why)
		}
		t.Logf("queue %s: %s; declaring another", top.Queue, why)
		ch, closing := channel(t, c.Nodes[0].URL())
		if _, err := ch.QueueDelete(top.Queue, false, false, false); err != nil {
			t.Logf("delete queue %s: %v", top.Queue, err)
		}
		closing()
	}
}

// queueWorks says why queue does not work, or "" if it does: see
// workingQueue.
func queueWorks(t *testing.T, c *rabbittest.Cluster, queue string) string {
	deadline := time.Now().Add(30 * time.Second)
	for online := false; !online; time.Sleep(100 * time.Millisecond) {
		out, err := c.Nodes[0].CtlOutput("list_queues", "-q", "--no-table-headers", "name", "online")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(out, "\n") {
			if name, members, ok := strings.Cut(line, "\t"); ok && name == queue && strings.Count(members, "@") == len(c.Nodes) {
				online = true
			}
		}
		if !online && time.Now().After(deadline) {
			return fmt.Sprintf("not all %d members online within half a minute:\n%s", len(c.Nodes), out)
		}
	}
	ch, closing := channel(t, c.Nodes[0].URL())
	defer closing()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 1))
	for {
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		err := ch.PublishWithContext(ctx, "", queue, true, false, amqp.Publishing{Body: []byte("probe")})
		if err != nil {
			cancel()
			return fmt.Sprintf("probe not sent: %v", err)
		}
		select {
		case confirm := <-confirms:
			cancel()
			if confirm.Ack {
				if _, err := ch.QueuePurge(queue, false); err != nil {
					t.Fatal(err)
				}
				return ""
			}
			if time.Now().After(deadline) {
				return "every probe refused (basic.nack) for half a minute"
			}
			time.Sleep(500 * time.Millisecond)
		case <-ctx.Done():
			cancel()
			return "a probe unconfirmed for half a minute"
		}
	}
}
