package rabbitbroker_test

import (
	"strings"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/rabbitbroker/rabbittest"
)

// A node of a cluster of three killed mid-drain (SIGKILL, as a crash):
// the quorum queue is declared on the first node, which leads it, and the
// relays and the consumer dial it first. Halfway through 120 orders the
// first node is killed; the clients dial the others, the queue elects a new
// leader among the two left (a majority), and every event a relay had
// marked sent reaches the warehouse, in seq order, once: nothing confirmed
// is lost. (Caught: a queue with one replica, on the killed node: the
// drain never ended. And a Publisher that kept its channel after a
// refusal: the relays whose channels had messages in flight to the killed
// leader were refused (basic.nack) every later message, though the queue
// had a new leader and took a new channel's, and the drain never ended, in
// about one CI run in three; TestRefusedMessageClosesItsChannel. If the
// test fails, it prints the nodes' logs.)
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
	// The queue's followers may still be starting when its declaration
	// returns; the leader is killed only once all three are online.
	ready := func(queue string) {
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
			out, err := c.Nodes[0].CtlOutput("list_queues", "-q", "--no-table-headers", "name", "online")
			if err != nil {
				t.Fatal(err)
			}
			for _, line := range strings.Split(out, "\n") {
				if name, online, ok := strings.Cut(line, "\t"); ok && name == queue && strings.Count(online, "@") == len(c.Nodes) {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("queue %s: not all %d members online within 2 minutes:\n%s", queue, len(c.Nodes), out)
			}
		}
	}
	drainThroughAFault(t, c.URLs(), 2, ready, func([]func(), func() func()) {
		c.Nodes[0].Kill()
	})
}
