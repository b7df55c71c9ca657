// Package rabbittest starts throwaway RabbitMQ nodes, for tests and for the
// example shop (shop/, -broker rabbitmq): each in a folder of
// its own (a temporary one unless given), on loopback ports of its own,
// with an Erlang port mapper (epmd) of its own on a port of its own, so
// that it never meets a server it did not start; Stop stops the node and
// its epmd, and Remove deletes the folder. Both processes are children of
// the program that started them, and are killed if it dies (Linux's
// parent-death signal).
package rabbittest

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Bin is the folder of Debian's rabbitmq-server, rabbitmqctl and their kin.
const Bin = "/usr/lib/rabbitmq/bin"

// ErrNotInstalled is returned by Start when RabbitMQ is not installed.
var ErrNotInstalled = errors.New("rabbittest: rabbitmq-server is not installed (make rabbitbroker installs Debian's)")

// Node is a RabbitMQ node a test started. It is not safe for concurrent
// use.
type Node struct {
	Dir      string // its folder: configuration, data, logs, HOME (the Erlang cookie)
	Name     string // its Erlang node name, name@localhost
	Port     int    // AMQP, on 127.0.0.1
	TLSPort  int    // AMQPS, on 127.0.0.1, if Options.TLS was given; else 0
	tls      *TLS
	distPort int
	epmdPort int
	maxSize  int // Options.MaxMessageSize
	cmd      *exec.Cmd
	exited   chan struct{}
	epmd     *exec.Cmd // its own, which Stop stops; nil on a cluster's node, whose epmd the cluster stops
}

// Options are what a node is configured with beyond its ports.
type Options struct {
	// MaxMessageSize is the largest message body the node takes (its
	// max_message_size); zero leaves the server's default, 128 MiB.
	MaxMessageSize int
	// Dir, if not empty, is the node's folder, made if missing and kept by
	// Stop: a node started again on the same Dir has the queues and
	// messages it stored before (its name is the same each time). Empty
	// means a new temporary folder. StartCluster takes no Dir.
	Dir string
	// TLS, if not nil, adds an AMQPS listener (Node.TLSPort) that asks
	// every client for a certificate signed by TLS.CACert, and refuses one
	// with none.
	TLS *TLS
}

// TLS names the PEM files of a node's AMQPS listener: the CA's
// certificate, which the clients' must chain to, and the node's own
// certificate and key.
type TLS struct {
	CACert, Cert, Key string
}

// Start starts a node in its folder and waits until it takes AMQP
// connections, for at most two minutes.
func Start(o Options) (*Node, error) {
	epmd, epmdPort, err := startEpmd()
	if err != nil {
		return nil, err
	}
	n, err := newNode(o, epmdPort, "")
	if err != nil {
		stopEpmd(epmd)
		return nil, err
	}
	n.epmd = epmd
	if err := n.start(); err != nil {
		n.Remove()
		return nil, err
	}
	return n, nil
}

// startEpmd checks that RabbitMQ is installed and starts an Erlang port
// mapper on a free port of 127.0.0.1, a child of this process.
func startEpmd() (cmd *exec.Cmd, port int, err error) {
	if _, err := os.Stat(filepath.Join(Bin, "rabbitmq-server")); err != nil {
		return nil, 0, ErrNotInstalled
	}
	ports, err := freePorts(1)
	if err != nil {
		return nil, 0, err
	}
	cmd = exec.Command("epmd", "-port", fmt.Sprint(ports[0]), "-address", "127.0.0.1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, 0, fmt.Errorf("rabbittest: epmd: %w", err)
	}
	return cmd, ports[0], nil
}

func stopEpmd(cmd *exec.Cmd) {
	if cmd != nil && cmd.Process != nil {
		cmd.Process.Kill()
		cmd.Wait()
	}
}

// newNode makes a node's folder and configuration, not yet started, with
// its epmd on epmdPort and, if not empty, the Erlang cookie given.
func newNode(o Options, epmdPort int, cookie string) (*Node, error) {
	dir, err := o.Dir, error(nil)
	if dir == "" {
		dir, err = os.MkdirTemp("", "rabbittest-")
	} else {
		err = os.MkdirAll(dir, 0o700)
	}
	if err != nil {
		return nil, err
	}
	ports, err := freePorts(3)
	if err != nil {
		if o.Dir == "" {
			os.RemoveAll(dir)
		}
		return nil, err
	}
	name := fmt.Sprintf("outbox%d@localhost", ports[0])
	if o.Dir != "" {
		name = "outbox@localhost" // its data is kept under its name: the same name each start
	}
	n := &Node{Dir: dir, Name: name, Port: ports[0], distPort: ports[1], epmdPort: epmdPort, maxSize: o.MaxMessageSize, tls: o.TLS}
	if o.TLS != nil {
		n.TLSPort = ports[2]
	}
	files := map[string]string{"rabbitmq.conf": n.config(), "enabled_plugins": "[].\n"}
	if cookie != "" {
		files[".erlang.cookie"] = cookie
	}
	for file, text := range files {
		path := filepath.Join(dir, file)
		os.Remove(path) // a kept folder's, written for the ports of its last start
		if err := os.WriteFile(path, []byte(text), 0o400); err != nil {
			if o.Dir == "" {
				os.RemoveAll(dir)
			}
			return nil, err
		}
	}
	return n, nil
}

// Cluster is nodes that a test started and joined in one RabbitMQ cluster,
// sharing one epmd. It is not safe for concurrent use.
type Cluster struct {
	Nodes []*Node
	epmd  *exec.Cmd
}

// StartCluster starts k nodes, joins the others to the first, and waits
// until each takes AMQP connections and the first sees all k running.
func StartCluster(k int, o Options) (*Cluster, error) {
	if o.Dir != "" {
		return nil, errors.New("rabbittest: a cluster's nodes each make a folder of their own: Options.Dir is for Start")
	}
	epmd, epmdPort, err := startEpmd()
	if err != nil {
		return nil, err
	}
	c := &Cluster{epmd: epmd}
	cookie := strings.Repeat(fmt.Sprint(epmdPort), 4)
	for range k {
		n, err := newNode(o, epmdPort, cookie)
		if err != nil {
			c.Remove()
			return nil, err
		}
		c.Nodes = append(c.Nodes, n)
	}
	errs := make(chan error, k)
	for _, n := range c.Nodes {
		go func() { errs <- n.start() }()
	}
	var failed []error
	for range k { // every start ended before any node is removed
		if err := <-errs; err != nil {
			failed = append(failed, err)
		}
	}
	if failed != nil {
		c.Remove()
		return nil, errors.Join(failed...)
	}
	for _, n := range c.Nodes[1:] {
		for _, args := range [][]string{{"stop_app"}, {"join_cluster", c.Nodes[0].Name}, {"start_app"}} {
			if err := n.Ctl(args...); err != nil {
				c.Remove()
				return nil, err
			}
		}
	}
	// start_app may return before the first node counts the others as
	// running, and a quorum queue declared then gets as members only the
	// nodes running: one node's loss may take its quorum with it.
	if err := c.Nodes[0].Ctl("-t", "120", "await_online_nodes", strconv.Itoa(k)); err != nil {
		c.Remove()
		return nil, err
	}
	return c, nil
}

// URLs are the nodes' AMQP URLs.
func (c *Cluster) URLs() []string {
	var urls []string
	for _, n := range c.Nodes {
		urls = append(urls, n.URL())
	}
	return urls
}

// Remove stops and removes every node, then the cluster's epmd.
func (c *Cluster) Remove() error {
	var errs []error
	for _, n := range c.Nodes {
		errs = append(errs, n.Remove())
	}
	stopEpmd(c.epmd)
	return errors.Join(errs...)
}

// env is the environment of the node's commands: its folder for all it
// writes, its ports, and its own epmd.
func (n *Node) env() []string {
	return append(os.Environ(),
		"HOME="+n.Dir,
		"ERL_CRASH_DUMP="+filepath.Join(n.Dir, "erl_crash.dump"), // never in the folder the test runs in
		"RABBITMQ_NODENAME="+n.Name,
		"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
		fmt.Sprint("RABBITMQ_NODE_PORT=", n.Port),
		fmt.Sprint("RABBITMQ_DIST_PORT=", n.distPort),
		fmt.Sprint("ERL_EPMD_PORT=", n.epmdPort),
		"ERL_EPMD_ADDRESS=127.0.0.1",
		"RABBITMQ_CONFIG_FILE="+filepath.Join(n.Dir, "rabbitmq.conf"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(n.Dir, "enabled_plugins"),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(n.Dir, "data"),
		"RABBITMQ_LOG_BASE="+filepath.Join(n.Dir, "log"),
		"RABBITMQ_PID_FILE="+filepath.Join(n.Dir, "node.pid"),
		"RABBITMQ_PLUGINS_EXPAND_DIR="+filepath.Join(n.Dir, "plugins-expand"),
		"RABBITMQ_FEATURE_FLAGS_FILE="+filepath.Join(n.Dir, "feature_flags"),
		"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(n.Dir, "advanced.config"),
		"RUNNING_UNDER_SYSTEMD=1", // the script execs the Erlang VM: one process, which SIGTERM stops cleanly
	)
}

// config is the node's rabbitmq.conf.
func (n *Node) config() string {
	conf := []string{
		"listeners.tcp.default = 127.0.0.1:" + fmt.Sprint(n.Port),
		"log.console = false",
		"log.file.level = warning",
	}
	if n.maxSize > 0 {
		conf = append(conf, fmt.Sprintf("max_message_size = %d", n.maxSize))
	}
	if n.tls != nil {
		conf = append(conf,
			"listeners.ssl.default = 127.0.0.1:"+fmt.Sprint(n.TLSPort),
			"ssl_options.cacertfile = "+n.tls.CACert,
			"ssl_options.certfile = "+n.tls.Cert,
			"ssl_options.keyfile = "+n.tls.Key,
			"ssl_options.verify = verify_peer",
			"ssl_options.fail_if_no_peer_cert = true")
	}
	return strings.Join(conf, "\n") + "\n"
}

// errPortTaken is start's error when the node found one of its ports taken.
var errPortTaken = errors.New("rabbittest: a port of the node was taken")

// start runs the node's server and waits for its AMQP port. A port that
// was free when chosen may be taken by the time the node listens (another
// process's connection given it as its own end): then the node is started
// again on new ports, its name kept, up to five times.
func (n *Node) start() error {
	for attempt := 1; ; attempt++ {
		err := n.startOnce()
		if !errors.Is(err, errPortTaken) || attempt == 5 {
			return err
		}
		ports, err := freePorts(3)
		if err != nil {
			return err
		}
		n.Port, n.distPort = ports[0], ports[1]
		if n.tls != nil {
			n.TLSPort = ports[2]
		}
		path := filepath.Join(n.Dir, "rabbitmq.conf")
		os.Remove(path)
		if err := os.WriteFile(path, []byte(n.config()), 0o400); err != nil {
			return err
		}
	}
}

func (n *Node) startOnce() error {
	out, err := os.OpenFile(filepath.Join(n.Dir, "server.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer out.Close()
	info, err := out.Stat()
	if err != nil {
		return err
	}
	from := info.Size() // where this start's output begins
	n.cmd = exec.Command(filepath.Join(Bin, "rabbitmq-server"))
	n.cmd.Env, n.cmd.Stdout, n.cmd.Stderr, n.cmd.Dir = n.env(), out, out, n.Dir
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL} // its own group, so that Stop reaches what it spawned
	if err := n.cmd.Start(); err != nil {
		return err
	}
	cmd, exited := n.cmd, make(chan struct{})
	n.exited = exited
	go func() { cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if conn, err := amqp.DialConfig(n.URL(), amqp.Config{Dial: amqp.DefaultDial(2 * time.Second)}); err == nil { // bounded: a port taken may be another's listener
			conn.Close()
			return nil
		}
		if taken(filepath.Join(n.Dir, "server.out"), from) { // it takes half a minute to exit: stop it now
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
			n.cmd = nil
			return fmt.Errorf("%w: node %s could not listen: %s", errPortTaken, n.Name, n.tail())
		}
		select {
		case <-exited:
			n.cmd = nil
			if taken(filepath.Join(n.Dir, "server.out"), from) {
				return fmt.Errorf("%w: node %s could not listen: %s", errPortTaken, n.Name, n.tail())
			}
			return fmt.Errorf("rabbittest: node %s exited while starting: %s", n.Name, n.tail())
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("rabbittest: node %s not up within 2m: %s", n.Name, n.tail())
		}
	}
}

// URL is the node's AMQP URL, as the default user guest, whom RabbitMQ
// lets in on loopback only.
func (n *Node) URL() string { return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", n.Port) }

// TLSURL is the node's AMQPS listener, with no user: amqps://127.0.0.1:port/.
// It is empty for a node started with no Options.TLS.
func (n *Node) TLSURL() string {
	if n.tls == nil {
		return ""
	}
	return fmt.Sprintf("amqps://127.0.0.1:%d/", n.TLSPort)
}

// Restart stops the node, as Down does, and starts it again on the same
// folder and ports: what it stored survives.
func (n *Node) Restart() error {
	n.Down()
	return n.start()
}

// Down stops the node's server as Stop does, keeping its epmd, folder and
// ports, so that Up starts it again: a node that goes down and comes back.
// It is safe to call on a node that is down.
func (n *Node) Down() { n.stopServer() }

// Up starts the node again after Down or Kill (or its server's exit), on
// the same folder and ports, and waits until it takes AMQP connections. It
// does nothing on a node that is up.
func (n *Node) Up() error {
	if n.IsUp() {
		return nil
	}
	return n.start()
}

// Stop stops the node (SIGTERM to its process group, SIGKILL after a
// minute) and then its epmd. It is safe to call more than once.
func (n *Node) Stop() {
	n.stopServer()
	stopEpmd(n.epmd)
	n.epmd = nil
}

// Kill stops the node's server at once (SIGKILL to its process group), as
// a crash would, keeping its epmd.
func (n *Node) Kill() {
	if n.cmd == nil || n.cmd.Process == nil {
		return
	}
	syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
	<-n.exited
	n.cmd = nil
}

func (n *Node) stopServer() {
	if n.cmd == nil || n.cmd.Process == nil {
		return
	}
	syscall.Kill(-n.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-n.exited:
	case <-time.After(time.Minute):
		syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
		<-n.exited
	}
	n.cmd = nil
}

// Ctl runs rabbitmqctl with args against the node.
func (n *Node) Ctl(args ...string) error {
	_, err := n.CtlOutput(args...)
	return err
}

// CtlOutput is Ctl, returning what rabbitmqctl printed.
func (n *Node) CtlOutput(args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(Bin, "rabbitmqctl"), append([]string{"-n", n.Name}, args...)...)
	cmd.Env = n.env()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// IsUp reports whether the node's server runs: started, not exited, and
// neither Down, Kill nor Stop since.
func (n *Node) IsUp() bool {
	if n.cmd == nil {
		return false
	}
	select {
	case <-n.exited:
		return false
	default:
		return true
	}
}

// Remove stops the node and deletes its folder, Options.Dir's too.
func (n *Node) Remove() error {
	n.Stop()
	return os.RemoveAll(n.Dir)
}

// taken reports whether the node's output in file, from the offset from,
// says that a port it would listen on was in use.
func taken(file string, from int64) bool {
	b, err := os.ReadFile(file)
	if err != nil || int64(len(b)) <= from {
		return false
	}
	out := string(b[from:])
	// eaddrinuse: a listener's port; dist_port_already_used: the
	// distribution port, which the node checks before it starts.
	return strings.Contains(out, "eaddrinuse") || strings.Contains(out, "dist_port_already_used")
}

// Log is the end of the node's log file, at most the last 4 KB: its
// warnings and errors (the node logs nothing below warning), for a test
// that failed to say what the server saw.
func (n *Node) Log() string {
	files, _ := filepath.Glob(filepath.Join(n.Dir, "log", "*.log"))
	var b []byte
	for _, f := range files {
		text, _ := os.ReadFile(f)
		b = append(b, text...)
	}
	if len(b) > 4096 {
		b = b[len(b)-4096:]
	}
	return string(b)
}

// tail is the end of what the node printed, for an error.
func (n *Node) tail() string {
	b, _ := os.ReadFile(filepath.Join(n.Dir, "server.out"))
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// freePorts returns k loopback ports that were free a moment ago.
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
