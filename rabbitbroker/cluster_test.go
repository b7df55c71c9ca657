package rabbitbroker_test

import (
	"testing"

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
	drainThroughAFault(t, c.URLs(), 2, func([]func(), func() func()) {
		c.Nodes[0].Kill()
	})
}
