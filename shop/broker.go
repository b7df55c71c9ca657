package main

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"example.com/patterns/enterprise/outbox/natsbroker"
)

// embeddedBroker is JetStream run inside the shop's process on loopback
// ports: one server, or a cluster of several, each with its store in a
// folder of the shop's. Down stops the one server, or one node of the
// cluster (the stream's leader), and Up starts what is down again on the
// same ports and stores, as a broker or a node that goes down and comes
// back does: the stream, its messages and its record of message ids
// survive. Safe for concurrent use.
//
// What an ack means is chosen here: every server syncs its store to disk
// before it acks (sync_interval: always), at the cost natsbroker/REFERENCE.md
// measures. A single server has no other copy: an acknowledged message
// survives a power cut of its machine. A cluster's stream has a replica on
// each node, and acks once two of the three hold the message, each synced
// to its disk: it survives a node killed (the natsbroker tests kill the
// stream's leader with SIGKILL); an operating-system crash or a power cut
// no test here makes, and a synced store is what NATS offers against them.
// With the default, a sync every two minutes, a quorum holds it only in
// memory and page cache, and Jepsen found of NATS 2.12.1 that an
// operating-system crash of a node, together with delays or pauses, can
// lose acknowledged messages.
type embeddedBroker struct {
	mu    sync.Mutex
	nodes []*node
}

type node struct {
	opts server.Options
	srv  *server.Server // nil while down
}

// startBroker starts n servers (1, or 3 for a cluster) with their stores
// under storeDir, and waits until JetStream is ready.
func startBroker(storeDir string, n int) (*embeddedBroker, error) {
	if n != 1 && n != 3 {
		return nil, fmt.Errorf("a broker of %d nodes: want 1 or 3", n)
	}
	b := &embeddedBroker{}
	ports, err := freePorts(2 * n) // a client port and a route port a node
	if err != nil {
		return nil, err
	}
	var routes []*url.URL
	for i := range n {
		port := ports[2*i]
		opts := server.Options{
			ServerName: fmt.Sprintf("n%d", i+1), Host: "127.0.0.1", Port: port, JetStream: true,
			StoreDir: filepath.Join(storeDir, fmt.Sprintf("n%d", i+1)), NoSigs: true, NoLog: true,
			SyncAlways: true,
		}
		if n > 1 {
			routePort := ports[2*i+1]
			opts.Cluster = server.ClusterOpts{Name: "shop", Host: "127.0.0.1", Port: routePort}
			routes = append(routes, &url.URL{Scheme: "nats", Host: fmt.Sprintf("127.0.0.1:%d", routePort)})
		}
		b.nodes = append(b.nodes, &node{opts: opts})
	}
	for _, nd := range b.nodes {
		nd.opts.Routes = routes
	}
	if err := b.Up(); err != nil {
		b.Stop()
		return nil, err
	}
	return b, nil
}

// freePorts returns k loopback ports, all different, that were free a
// moment ago, kept across Down and Up. Each is held until all are chosen:
// a port closed at once may be handed out again by the next, and a node
// whose port another node took is never ready.
func freePorts(k int) ([]int, error) {
	var ports []int
	for range k {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// Nodes is how many servers the broker has.
func (b *embeddedBroker) Nodes() int { return len(b.nodes) }

// URL is where clients connect: every node, so that a client goes on
// through another when one is down.
func (b *embeddedBroker) URL() string {
	var us []string
	for _, nd := range b.nodes {
		us = append(us, fmt.Sprintf("nats://127.0.0.1:%d", nd.opts.Port))
	}
	return strings.Join(us, ",")
}

// Up starts every node that is down, and waits until JetStream has a
// leader again.
func (b *embeddedBroker) Up() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, nd := range b.nodes {
		if nd.srv != nil {
			continue
		}
		srv, err := server.NewServer(nd.opts.Clone())
		if err != nil {
			return err
		}
		srv.Start()
		if !srv.ReadyForConnections(30 * time.Second) {
			srv.Shutdown()
			return fmt.Errorf("JetStream server %s not ready within 30 s", nd.opts.ServerName)
		}
		nd.srv = srv
	}
	if len(b.nodes) == 1 {
		return nil
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		for _, nd := range b.nodes {
			if nd.srv.JetStreamIsLeader() {
				return nil
			}
		}
	}
	return errors.New("the JetStream cluster elected no leader within 30 s")
}

// Down stops the one server, or, in a cluster, the node that leads the
// outbox's stream (another if none does), and waits until it has stopped.
// It says which.
func (b *embeddedBroker) Down() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.nodes) == 1 {
		b.nodes[0].stop()
		return "down"
	}
	var victim *node
	up := 0
	for _, nd := range b.nodes {
		if nd.srv == nil {
			continue
		}
		up++
		if victim == nil || nd.srv.JetStreamIsStreamLeader(server.DEFAULT_GLOBAL_ACCOUNT, natsbroker.Stream) {
			victim = nd
		}
	}
	if victim == nil {
		return "down"
	}
	victim.stop()
	return fmt.Sprintf("node %s down, %d of %d up", victim.opts.ServerName, up-1, len(b.nodes))
}

// State says whether the broker is up: "up", "down", or, in a cluster,
// how many nodes are.
func (b *embeddedBroker) State() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	up := 0
	for _, nd := range b.nodes {
		if nd.srv != nil {
			up++
		}
	}
	switch {
	case up == len(b.nodes):
		return "up"
	case up == 0:
		return "down"
	default:
		return fmt.Sprintf("%d of %d up", up, len(b.nodes))
	}
}

// Stop stops every node.
func (b *embeddedBroker) Stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, nd := range b.nodes {
		nd.stop()
	}
}

func (nd *node) stop() {
	if nd.srv != nil {
		nd.srv.Shutdown()
		nd.srv.WaitForShutdown()
		nd.srv = nil
	}
}
