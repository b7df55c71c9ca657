package natsbroker_test

// JetStream servers as processes of their own, built from the module's
// nats-server, so that a node can be killed as a machine dies: SIGKILL, no
// shutdown, nothing flushed by the process.

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
)

// procCluster is three nats-server processes routed to each other, each
// with its store folder and a configuration file.
type procCluster struct {
	t     testing.TB
	bin   string
	nodes []*procNode
}

type procNode struct {
	name, conf string
	port       int
	cmd        *exec.Cmd // nil while down
	exited     chan struct{}
}

// startProcCluster builds nats-server into a folder of t's and starts
// three nodes with sync_interval syncInterval; they are killed when t ends,
// or when the test process dies (Pdeathsig).
func startProcCluster(t testing.TB, syncInterval string) *procCluster {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "nats-server")
	build := exec.Command("go", "build", "-o", bin, "github.com/nats-io/nats-server/v2")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build nats-server: %v\n%s", err, out)
	}
	c := &procCluster{t: t, bin: bin}
	var routes []string
	routePorts := []int{freePort(t), freePort(t), freePort(t)}
	for _, p := range routePorts {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", p))
	}
	for i := range 3 {
		n := &procNode{name: fmt.Sprintf("n%d", i+1), port: freePort(t), conf: filepath.Join(dir, fmt.Sprintf("n%d.conf", i+1))}
		conf := fmt.Sprintf(`server_name: %s
listen: 127.0.0.1:%d
jetstream { store_dir: %q, sync_interval: %s }
cluster { name: outbox, listen: 127.0.0.1:%d, routes: [%s] }
`, n.name, n.port, filepath.Join(dir, n.name), syncInterval, routePorts[i], strings.Join(routes, ", "))
		if err := os.WriteFile(n.conf, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		c.nodes = append(c.nodes, n)
	}
	for _, n := range c.nodes {
		c.start(n)
	}
	for _, n := range c.nodes {
		waitFor(t, n.name+" listening", func() bool {
			conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", n.port))
			if err == nil {
				conn.Close()
			}
			return err == nil
		})
	}
	t.Cleanup(func() {
		for _, n := range c.nodes {
			c.kill(n)
		}
	})
	js, err := jetstream.New(connect(t, c.url()))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a JetStream meta leader", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := js.AccountInfo(ctx)
		return err == nil
	})
	return c
}

func (c *procCluster) start(n *procNode) {
	c.t.Helper()
	cmd := exec.Command(c.bin, "-c", n.conf)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	n.cmd, n.exited = cmd, make(chan struct{})
	go func(done chan struct{}) { cmd.Wait(); close(done) }(n.exited)
}

// kill kills n's process with SIGKILL and waits until it is gone.
func (c *procCluster) kill(n *procNode) {
	if n.cmd == nil {
		return
	}
	n.cmd.Process.Kill()
	<-n.exited
	n.cmd = nil
}

func (c *procCluster) url() string {
	var us []string
	for _, n := range c.nodes {
		us = append(us, fmt.Sprintf("nats://127.0.0.1:%d", n.port))
	}
	return strings.Join(us, ",")
}

// streamCluster is the outbox stream's cluster as a live node says, or nil.
func streamCluster(js jetstream.JetStream) *jetstream.ClusterInfo {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	s, err := js.Stream(ctx, natsbroker.Stream)
	if err != nil {
		return nil
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil
	}
	return info.Cluster
}

// leader is the node that leads the outbox's stream, as a live node says.
func (c *procCluster) leader(js jetstream.JetStream) *procNode {
	c.t.Helper()
	var leader *procNode
	waitFor(c.t, "the stream to have a leader", func() bool {
		cluster := streamCluster(js)
		for _, n := range c.nodes {
			if cluster != nil && n.name == cluster.Leader && n.cmd != nil {
				leader = n
			}
		}
		return leader != nil
	})
	return leader
}

// The stream's leader is killed with SIGKILL in the middle of a drain, as
// its machine might die, and started again from its store; then the new
// leader the same way. The servers run as processes of their own, with
// sync_interval: always, as the shop's cluster does, and with the default
// (2 minutes): a process killed loses nothing the operating system has,
// only a crash of the operating system or a power cut could, which no test
// here makes. Every row marked sent is in the stream, once, and the
// warehouse applies each aggregate's events in order. (Caught: a publisher
// that took a message for sent once it was written to the connection, 102
// of 160 rows marked sent and not in the stream.)
func TestNodesKilledHardMidDrainLoseNothing(t *testing.T) {
	for _, sync := range []string{"always", "2m"} {
		t.Run("sync_interval="+sync, func(t *testing.T) { killLeadersMidDrain(t, sync) })
	}
}

func killLeadersMidDrain(t *testing.T, syncInterval string) {
	c := startProcCluster(t, syncInterval)
	js, err := jetstream.New(connect(t, c.url()))
	if err != nil {
		t.Fatal(err)
	}
	drainThroughAFault(t, c, func() {
		for range 2 {
			leader := c.leader(js)
			t.Logf("killing %s, the stream's leader, with SIGKILL", leader.name)
			c.kill(leader)
			next := c.leader(js) // the others elected one
			t.Logf("%s leads; starting %s again from its store", next.name, leader.name)
			c.start(leader)
			waitFor(t, leader.name+" current again", func() bool {
				cluster := streamCluster(js)
				if cluster == nil {
					return false
				}
				for _, r := range cluster.Replicas {
					if r.Name == leader.name {
						return r.Current
					}
				}
				return false
			})
		}
	})
}
