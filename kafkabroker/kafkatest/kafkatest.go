// Package kafkatest runs a Kafka-protocol cluster as a process of its own,
// its data on disk, for the shop and the tests: franz-go's kfake, since no
// Kafka server can be installed where this repository is tested. The
// process is a program whose main calls [Serve] (the shop's own binary,
// as "shop kafka-cluster"); [Start] starts it and waits until it answers,
// [Cluster.Down] stops it and [Cluster.Up] starts it again on the same
// ports and data, as a cluster that goes down and comes back does.
//
// kfake is a test cluster, not Kafka: it speaks the protocol, keeps each
// partition on every broker in the one process, and syncs each produce to
// its data folder before it acknowledges it (Kafka's
// log.flush.interval.messages=1). Nothing here is for production.
package kafkatest

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

// Serve runs the cluster as args say (-dir, the data folder; -ports, the
// brokers' loopback ports, comma-separated), prints "ready" and the
// brokers' addresses on one line to stdout, and returns once it is sent
// SIGTERM or SIGINT, or, with -exit-with-stdin, once its stdin ends, after
// closing the cluster.
func Serve(args []string, stdout io.Writer) error {
	flags := flag.NewFlagSet("kafka-cluster", flag.ContinueOnError)
	dir := flags.String("dir", "", "the cluster's data folder")
	ports := flags.String("ports", "", "the brokers' ports, comma-separated")
	withStdin := flags.Bool("exit-with-stdin", false, "stop when stdin ends: when the process that started this one, holding the other end, is gone")
	if err := flags.Parse(args); err != nil {
		return err
	}
	if *dir == "" {
		return errors.New("kafka-cluster: -dir is not set: name the cluster's data folder")
	}
	var ps []int
	for p := range strings.SplitSeq(*ports, ",") {
		n, err := strconv.Atoi(p)
		if err != nil || n <= 0 || n > 65535 {
			return fmt.Errorf("kafka-cluster: -ports %q: want ports, comma-separated", *ports)
		}
		ps = append(ps, n)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(stop)
	c, err := kfake.NewCluster(kfake.NumBrokers(len(ps)), kfake.Ports(ps...), kfake.DataDir(*dir), kfake.SyncWrites())
	if err != nil {
		return fmt.Errorf("kafka-cluster: %w", err)
	}
	defer c.Close()
	fmt.Fprintln(stdout, "ready", strings.Join(c.ListenAddrs(), ","))
	if *withStdin {
		go func() {
			io.Copy(io.Discard, os.Stdin)
			stop <- syscall.SIGTERM
		}()
	}
	<-stop
	return nil
}

// Options says how to start a Cluster.
type Options struct {
	// Command is the program, and its first arguments, that calls Serve:
	// Start adds -dir and -ports. Required.
	Command []string
	// Dir is the cluster's data folder. Required.
	Dir string
	// Brokers is how many brokers the cluster has; zero means 3.
	Brokers int
	// Stderr, if not nil, is where the process's errors go.
	Stderr io.Writer
}

// startTimeout bounds a start of the process until it says it is ready,
// and a stop until it has exited.
const startTimeout = 30 * time.Second

// Cluster is the cluster's process, up or down. It is safe for
// concurrent use. Start one with Start.
type Cluster struct {
	opts  Options
	ports []string
	seeds []string // set by the first start, the same after each

	mu  sync.Mutex // held through a Down or Up
	cmd *exec.Cmd  // nil while down
}

// Start starts the cluster on loopback ports free a moment ago and waits,
// up to 30 s, until it is ready.
func Start(opts Options) (*Cluster, error) {
	if len(opts.Command) == 0 || opts.Dir == "" {
		return nil, errors.New("kafkatest: Start needs Options.Command and Options.Dir")
	}
	if opts.Brokers == 0 {
		opts.Brokers = 3
	}
	ports, err := freePorts(opts.Brokers)
	if err != nil {
		return nil, err
	}
	c := &Cluster{opts: opts, ports: ports}
	if err := c.Up(); err != nil {
		return nil, err
	}
	return c, nil
}

// freePorts are k loopback ports, each held until all are chosen.
func freePorts(k int) ([]string, error) {
	var ports []string
	for range k {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		ports = append(ports, strconv.Itoa(ln.Addr().(*net.TCPAddr).Port))
	}
	return ports, nil
}

// Seeds are the brokers' addresses, for kgo.SeedBrokers.
func (c *Cluster) Seeds() []string { return c.seeds }

// Up starts the process unless it runs, on the cluster's ports and data,
// and waits until it is ready.
func (c *Cluster) Up() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd != nil {
		return nil
	}
	args := append(c.opts.Command[1:len(c.opts.Command):len(c.opts.Command)],
		"-dir", c.opts.Dir, "-ports", strings.Join(c.ports, ","), "-exit-with-stdin")
	cmd := exec.Command(c.opts.Command[0], args...)
	cmd.Stderr = c.opts.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	// The process's stdin is a pipe this process holds the other end of,
	// never written: if this process dies without a Down, its end closes,
	// and the cluster stops with it, instead of running on, orphaned.
	if _, err := cmd.StdinPipe(); err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("kafkatest: start the cluster: %w", err)
	}
	ready := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		ready <- line
		io.Copy(io.Discard, out)
	}()
	select {
	case line := <-ready:
		addrs, ok := strings.CutPrefix(strings.TrimSpace(line), "ready ")
		if !ok {
			cmd.Process.Kill()
			cmd.Wait()
			return fmt.Errorf("kafkatest: the cluster's process said %q, not ready", line)
		}
		c.seeds = strings.Split(addrs, ",")
	case <-time.After(startTimeout):
		cmd.Process.Kill()
		cmd.Wait()
		return errors.New("kafkatest: the cluster was not ready within 30 s")
	}
	c.cmd = cmd
	return nil
}

// Down stops the process, SIGTERM first, SIGKILL if it has not exited
// within 30 s, and waits for it.
func (c *Cluster) Down() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd == nil {
		return
	}
	cmd := c.cmd
	c.cmd = nil
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(startTimeout):
		cmd.Process.Kill()
		<-done
	}
}

// Kill kills the process with SIGKILL, as a machine that loses power
// would, and waits for it.
func (c *Cluster) Kill() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd != nil {
		c.cmd.Process.Kill()
		c.cmd.Wait()
		c.cmd = nil
	}
}

// IsUp reports whether the process runs; false while a Down or Up is
// under way.
func (c *Cluster) IsUp() bool {
	if !c.mu.TryLock() {
		return false
	}
	defer c.mu.Unlock()
	return c.cmd != nil
}

// Stop stops the process for good: Down.
func (c *Cluster) Stop() { c.Down() }
