// Package kafkatest runs a Kafka-protocol cluster as a process of its own,
// its data on disk, for the shop and the tests: franz-go's kfake, since no
// Kafka server can be installed where this repository is tested. The
// process is a program whose main calls [Serve] (the shop's own binary,
// as "shop kafka-cluster"); [Start] starts it and waits until it answers,
// [Cluster.Down] stops it and [Cluster.Up] starts it again on the same
// ports and data, as a cluster that goes down and comes back does.
//
// Asked (Options.TLS, Options.Users), the cluster takes only TLS, with a
// certificate of a CA made for it ([Cluster.CA], [Cluster.ClientTLS]), and
// only users who authenticate with SASL (PLAIN, SCRAM-SHA-256 or
// SCRAM-SHA-512), as a production cluster would: the relay's and the
// consumer's TLS and SASL options are tested against it.
//
// kfake is a test cluster, not Kafka: it speaks the protocol, keeps each
// partition on every broker in the one process, and syncs each produce to
// its data folder before it acknowledges it (Kafka's
// log.flush.interval.messages=1). Nothing here is for production.
package kafkatest

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
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
	certFile := flags.String("tls-cert", "", "the brokers' certificate (PEM), with -tls-key: take TLS only")
	keyFile := flags.String("tls-key", "", "the certificate's key (PEM)")
	usersFile := flags.String("users", "", "a JSON file of the SASL users ([{Mechanism, Name, Password, Superuser}]): take authenticated clients only")
	if err := flags.Parse(args); err != nil {
		return err
	}
	opts := []kfake.Opt{kfake.DataDir(*dir), kfake.SyncWrites()}
	if *certFile != "" || *keyFile != "" {
		pair, err := tls.LoadX509KeyPair(*certFile, *keyFile)
		if err != nil {
			return fmt.Errorf("kafka-cluster: -tls-cert, -tls-key: %w", err)
		}
		opts = append(opts, kfake.TLS(&tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}))
	}
	if *usersFile != "" {
		b, err := os.ReadFile(*usersFile)
		if err != nil {
			return fmt.Errorf("kafka-cluster: -users: %w", err)
		}
		var users []User
		if err := json.Unmarshal(b, &users); err != nil {
			return fmt.Errorf("kafka-cluster: -users %s: %w", *usersFile, err)
		}
		if err := checkUsers(users); err != nil {
			return fmt.Errorf("kafka-cluster: -users %s: %w", *usersFile, err)
		}
		opts = append(opts, kfake.EnableSASL())
		for _, u := range users {
			if u.Superuser {
				opts = append(opts, kfake.Superuser(u.Mechanism, u.Name, u.Password))
			} else {
				opts = append(opts, kfake.User(u.Mechanism, u.Name, u.Password))
			}
		}
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
	c, err := kfake.NewCluster(append(opts, kfake.NumBrokers(len(ps)), kfake.Ports(ps...))...)
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
	// TLS has the cluster take TLS connections only, with a certificate for
	// 127.0.0.1 and localhost of a CA Start makes ([Cluster.CA]).
	TLS bool
	// Users, if any, have the cluster take only clients that authenticate
	// as one of them with SASL. Give one a Superuser to create topics.
	Users []User
}

// User is a SASL user of the cluster.
type User struct {
	// Mechanism is PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
	Mechanism string
	// Name and Password are the user's.
	Name, Password string
	// Superuser may do anything: create topics, read and write any.
	Superuser bool
}

// checkUsers refuses a user of no known mechanism, or with no name or
// password.
func checkUsers(users []User) error {
	for _, u := range users {
		switch {
		case u.Mechanism != "PLAIN" && u.Mechanism != "SCRAM-SHA-256" && u.Mechanism != "SCRAM-SHA-512":
			return fmt.Errorf("user %q: mechanism %q: want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", u.Name, u.Mechanism)
		case u.Name == "" || u.Password == "":
			return fmt.Errorf("a user of %s with no name or no password", u.Mechanism)
		}
	}
	return nil
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
	extra []string // the process's flags for TLS and the users
	ca    string   // the CA's certificate file, with TLS
	pool  *x509.CertPool

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
	if err := checkUsers(opts.Users); err != nil {
		return nil, fmt.Errorf("kafkatest: Options.Users: %w", err)
	}
	c := &Cluster{opts: opts, ports: ports}
	// Beside the data folder, readable by its owner alone: the CA, the
	// brokers' certificate and the users, which the process reads at each
	// start.
	secrets := strings.TrimSuffix(opts.Dir, string(filepath.Separator)) + ".auth"
	if opts.TLS || len(opts.Users) > 0 {
		if err := os.MkdirAll(secrets, 0o700); err != nil {
			return nil, fmt.Errorf("kafkatest: %w", err)
		}
	}
	if opts.TLS {
		caFile, certFile, keyFile, pool, err := makeCertificates(secrets)
		if err != nil {
			return nil, fmt.Errorf("kafkatest: the cluster's certificates: %w", err)
		}
		c.ca, c.pool = caFile, pool
		c.extra = append(c.extra, "-tls-cert", certFile, "-tls-key", keyFile)
	}
	if len(opts.Users) > 0 {
		b, err := json.Marshal(opts.Users)
		if err != nil {
			return nil, err
		}
		file := filepath.Join(secrets, "users.json")
		if err := os.WriteFile(file, b, 0o600); err != nil {
			return nil, fmt.Errorf("kafkatest: %w", err)
		}
		c.extra = append(c.extra, "-users", file)
	}
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

// CA is the file (PEM) of the CA that signed the brokers' certificate,
// with Options.TLS; "" without.
func (c *Cluster) CA() string { return c.ca }

// ClientTLS is a client's TLS configuration that trusts the brokers'
// certificate, for kgo.DialTLSConfig; nil without Options.TLS.
func (c *Cluster) ClientTLS() *tls.Config {
	if c.pool == nil {
		return nil
	}
	return &tls.Config{RootCAs: c.pool, MinVersion: tls.VersionTLS12}
}

// makeCertificates makes a CA and the brokers' certificate, for 127.0.0.1
// and localhost, signed by it, valid a day, written into dir: the CA's
// certificate, the brokers' and its key, and a pool of the CA.
func makeCertificates(dir string) (caFile, certFile, keyFile string, pool *x509.CertPool, err error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", "", nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kafkatest CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return "", "", "", nil, err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return "", "", "", nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", "", nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kafkatest broker"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		return "", "", "", nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return "", "", "", nil, err
	}
	caFile, certFile, keyFile = filepath.Join(dir, "ca.pem"), filepath.Join(dir, "broker.pem"), filepath.Join(dir, "broker-key.pem")
	for _, f := range []struct {
		file, kind string
		der        []byte
	}{{caFile, "CERTIFICATE", caDER}, {certFile, "CERTIFICATE", der}, {keyFile, "EC PRIVATE KEY", keyDER}} {
		if err := os.WriteFile(f.file, pem.EncodeToMemory(&pem.Block{Type: f.kind, Bytes: f.der}), 0o600); err != nil {
			return "", "", "", nil, err
		}
	}
	pool = x509.NewCertPool()
	pool.AddCert(caCert)
	return caFile, certFile, keyFile, pool, nil
}

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
	args = append(args, c.extra...)
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
