package rabbittest

import (
	"fmt"
	"net"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// A node whose AMQP port, or distribution port, was taken between its
// choice and the node's listen (as another process's connection may take a
// free port for its own end) starts all the same, on other ports.
// (Caught: the node exited, "eaddrinuse", and Start failed: make
// measure-rabbitbroker once did; and "dist_port_already_used", which a CI
// run met, was not taken for a port taken.)
func TestStartMovesOffAPortTaken(t *testing.T) {
	for _, port := range []string{"amqp", "distribution"} {
		t.Run(port, func(t *testing.T) {
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
			was := map[string]*int{"amqp": &n.Port, "distribution": &n.distPort}[port]
			wasPort := *was
			taken, err := net.Listen("tcp", fmt.Sprint("127.0.0.1:", wasPort))
			if err != nil {
				t.Fatal(err)
			}
			defer taken.Close()
			if err := n.start(); err != nil {
				t.Fatalf("start with its %s port taken: %v", port, err)
			}
			if *was == wasPort {
				t.Fatalf("the node says its %s port is %d, the port taken", port, wasPort)
			}
			conn, err := amqp.Dial(n.URL())
			if err != nil {
				t.Fatalf("dial the node on its new ports: %v", err)
			}
			conn.Close()
		})
	}
}
