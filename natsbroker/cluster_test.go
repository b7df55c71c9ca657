package natsbroker_test

// A replicated broker: three JetStream servers in one cluster, embedded in
// the test process, routes on loopback, each with its own store folder; the
// stream and the warehouse's durable consumer with three replicas. An ack
// then means a quorum, two of the three, stored the message.

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
	"example.com/patterns/enterprise/outbox/postgres/shop/shoptest"
)

// cluster is three JetStream servers routed to each other.
type cluster struct {
	t     testing.TB
	nodes []*broker
}

// startCluster starts a cluster of n servers on free loopback ports, and
// waits until JetStream has a meta leader; they stop when t ends.
func startCluster(t testing.TB, n int) *cluster {
	t.Helper()
	return startClusterWith(t, n, nil)
}

// startClusterWith is startCluster with each server's options edited by
// edit, if not nil.
func startClusterWith(t testing.TB, n int, edit func(*server.Options)) *cluster {
	t.Helper()
	routePorts := make([]int, n)
	var routes []string
	for i := range routePorts {
		routePorts[i] = freePort(t)
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", routePorts[i]))
	}
	c := &cluster{t: t}
	for i := range n {
		c.nodes = append(c.nodes, &broker{t: t, opts: server.Options{
			ServerName: fmt.Sprintf("n%d", i+1),
			Host:       "127.0.0.1",
			Port:       freePort(t),
			JetStream:  true,
			StoreDir:   t.TempDir(),
			NoSigs:     true,
			NoLog:      true,
			Cluster:    server.ClusterOpts{Name: "outbox", Host: "127.0.0.1", Port: routePorts[i]},
			Routes:     urls(t, routes),
		}})
	}
	for _, b := range c.nodes {
		if edit != nil {
			edit(&b.opts)
		}
	}
	for _, b := range c.nodes {
		b.start() // ready once it listens; its routes connect as the others start
		t.Cleanup(b.stop)
	}
	waitFor(t, "a JetStream meta leader", func() bool {
		for _, b := range c.nodes {
			if b.srv != nil && b.srv.JetStreamIsLeader() {
				return true
			}
		}
		return false
	})
	return c
}

func urls(t testing.TB, list []string) []*url.URL {
	var us []*url.URL
	for _, s := range list {
		u, err := url.Parse(s)
		if err != nil {
			t.Fatal(err)
		}
		us = append(us, u)
	}
	return us
}

// url is every node's client URL, for a client that may connect to any.
func (c *cluster) url() string {
	var us []string
	for _, b := range c.nodes {
		us = append(us, b.url())
	}
	return strings.Join(us, ",")
}

// streamLeader is the node that leads the outbox's stream, or nil.
func (c *cluster) streamLeader() *broker {
	for _, b := range c.nodes {
		if b.srv != nil && b.srv.JetStreamIsStreamLeader(server.DEFAULT_GLOBAL_ACCOUNT, natsbroker.Stream) {
			return b
		}
	}
	return nil
}

// setUpReplicated creates the stream and the warehouse's durable consumer
// with three replicas each.
func setUpReplicated(t testing.TB, c interface{ url() string }) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	ctx := context.Background()
	js, err := jetstream.New(connect(t, c.url()))
	if err != nil {
		t.Fatal(err)
	}
	cfg := natsbroker.StreamConfig(0)
	cfg.Replicas = 3
	// A meta leader that was just elected may not yet count every node as
	// online: it then refuses a stream of three replicas ("no suitable
	// peers for placement", 10005) until it hears from them.
	var stream jetstream.Stream
	var apiErr *jetstream.APIError
	waitFor(t, "the cluster to place a stream of three replicas", func() bool {
		stream, err = js.CreateOrUpdateStream(ctx, cfg)
		if errors.As(err, &apiErr) && apiErr.ErrorCode == clusterNoPeers {
			return false
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	// AckWait 5 s: a delivery lost with a server comes again within it.
	cons := natsbroker.ConsumerConfig("warehouse", 5*time.Second)
	cons.Replicas = 3
	if _, err := stream.CreateOrUpdateConsumer(ctx, cons); err != nil {
		t.Fatal(err)
	}
	return js, stream
}

// clusterNoPeers is JetStream's error code for a stream it cannot place on
// enough servers (nats-server's JSClusterNoPeersErrF).
const clusterNoPeers jetstream.ErrorCode = 10005

// drainThroughAFault places orders from two clients, cancelling every third
// right after it is placed, while two relays (PerAggregate, so that they
// batch) publish to the cluster and a consumer feeds the warehouse; fault
// runs once half of them are placed. Then it checks what the outbox
// promises past the broker's door: every row marked sent is in the stream,
// nothing is stored twice, each aggregate's events reached the warehouse in
// seq order and once, and the durable consumer went on.
func drainThroughAFault(t *testing.T, c interface{ url() string }, fault func()) {
	ctx := context.Background()
	db := newDatabase(t)
	_, stream := setUpReplicated(t, c)
	var pubs []*natsbroker.Publisher
	for range 2 {
		pub := newPublisher(t, connect(t, c.url()))
		pubs = append(pubs, pub)
		relay := newRelay(t, db, pub, postgres.RelayConfig{BatchSize: 20, PassTimeout: 2 * time.Second, PollInterval: 50 * time.Millisecond, MaxBackoff: 500 * time.Millisecond})
		goRun(t, relay.Run)
	}
	h := shoptest.NewOrdered(shop.NewWarehouse(db))
	runConsumer(t, connect(t, c.url()), h)

	const clients, each = 2, 60
	service := shop.NewOrderService(db)
	var placed atomic.Int64
	half := make(chan struct{})
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for i := range each {
				id, err := service.PlaceOrder(ctx, 100)
				if err != nil {
					t.Error(err)
					return
				}
				if i%3 == 0 {
					if err := service.CancelOrder(ctx, id); err != nil {
						t.Error(err)
						return
					}
				}
				if placed.Add(1) == clients*each/2 {
					close(half)
				}
			}
		})
	}
	<-half
	fault() // on the test's goroutine, with the clients still placing orders
	wg.Wait()
	var events, unsent int
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		events = count(t, db, `SELECT count(*) FROM outbox`)
		unsent = count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`)
		if unsent == 0 && int(h.Applied()) == events {
			break
		}
		if time.Now().After(deadline) {
			state := "unknown"
			if info, err := stream.Info(ctx); err == nil {
				state = fmt.Sprintf("%+v", info.State)
			} else {
				state = err.Error()
			}
			if cons, err := stream.Consumer(ctx, "warehouse"); err == nil {
				if ci, err := cons.Info(ctx); err == nil {
					state += fmt.Sprintf("; consumer: %d pending, %d awaiting an ack, %d redelivered, %d pulls waiting",
						ci.NumPending, ci.NumAckPending, ci.NumRedelivered, ci.NumWaiting)
				}
			}
			t.Fatalf("after 90 s: %d of %d events unsent, %d applied; stream: %s", unsent, events, h.Applied(), state)
		}
	}
	var dups int64
	for _, p := range pubs {
		dups += p.Duplicates()
	}
	t.Logf("%d events for %d orders; %d duplicate acks", events, clients*each, dups)

	stored := map[string]int{}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("stream message %d: %v", seq, err)
		}
		stored[m.Header.Get(jetstream.MsgIDHeader)]++
	}
	for key, n := range stored {
		if n != 1 {
			t.Errorf("message %s stored %d times, want once", key, n)
		}
	}
	rows, err := db.Query(`SELECT message_key FROM outbox WHERE sent_at IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	marked := 0
	for rows.Next() {
		var key string
		if err := rows.Scan(&key); err != nil {
			t.Fatal(err)
		}
		marked++
		if stored[key] == 0 {
			t.Errorf("row %s marked sent, but not in the stream", key)
		}
	}
	if marked != events || len(stored) != events {
		t.Errorf("%d rows marked, %d distinct messages stored; want %d each", marked, len(stored), events)
	}
	for _, w := range h.Wrong() {
		t.Error(w)
	}
}

// The stream's leader is shut down in the middle of a drain, with orders
// still being placed: the cluster elects another, the relays' passes fail
// meanwhile and back off, and then everything goes on. (Caught: a stream of
// one replica, whose messages, and whose consumer, go with its only node.)
func TestStreamLeaderKilledMidDrainLosesNothing(t *testing.T) {
	c := startCluster(t, 3)
	drainThroughAFault(t, c, func() {
		leader := c.streamLeader()
		if leader == nil {
			t.Error("no stream leader to kill")
			return
		}
		t.Logf("killing the stream's leader, %s", leader.opts.ServerName)
		leader.stop()
	})
}

// A node that is not the leader is stopped and started again from its
// store folder, in the middle of a drain: it catches up, and the same holds.
func TestNodeRestartedFromItsStoreMidDrainLosesNothing(t *testing.T) {
	c := startCluster(t, 3)
	drainThroughAFault(t, c, func() {
		leader := c.streamLeader()
		for _, b := range c.nodes {
			if b != leader {
				t.Logf("restarting %s from its store", b.opts.ServerName)
				b.stop()
				b.start()
				return
			}
		}
	})
}
