package rabbittest

import (
	"fmt"
	"net"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// A node whose AMQP port was taken between its choice and the node's
// listen (as another process's connection may take a free port for its own
// end) starts all the same, on another port. (Caught: the node exited,
// "eaddrinuse", and Start failed: make measure-rabbitbroker once did.)
func TestStartMovesOffAPortTaken(t *testing.T) {
	epmd, epmdPort, err := startEpmd()
	if err != nil {
		t.Fatal(err)
	}
	n, err := newNode(Options{}, epmdPort, "")
	if err != nil {
		stopEpmd(epmd)
		t.Fatal(err)
	}
	n.epmd = epmd
	defer n.Remove()
	taken, err := net.Listen("tcp", fmt.Sprint("127.0.0.1:", n.Port))
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	was := n.Port
	if err := n.start(); err != nil {
		t.Fatalf("start with its port taken: %v", err)
	}
	if n.Port == was {
		t.Fatalf("the node says it listens on %d, the port taken", was)
	}
	conn, err := amqp.Dial(n.URL())
	if err != nil {
		t.Fatalf("dial the node on its new port: %v", err)
	}
	conn.Close()
}
