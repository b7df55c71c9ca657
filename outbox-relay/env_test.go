package main

// The relay as operators run it: a process of its own, built here, against
// a throwaway PostgreSQL (pgtest) and, for most tests, a JetStream server
// embedded in the test with its store in a temporary folder
// (nats_env_test.go).

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// generous bounds every wait: the tests never assert on time, but never
// wait for ever either.
const generous = 60 * time.Second

// testBroker is the broker newEnv starts for each test, and the flags
// that point the relay at it.
type testBroker interface{ args() []string }

// startTestBroker starts the broker of newEnv's tests: JetStream, set by
// nats_env_test.go; nil in a copy of the relay without NATS (the kit's),
// whose tests name their broker themselves.
var startTestBroker func(t *testing.T) testBroker

// env is one test's database, broker and built relay.
type env struct {
	t        *testing.T
	binary   string
	database string // the connection string of the test's database
	name     string // the database's name
	db       *sql.DB
	outbox   *postgres.Outbox[postgres.SQLTx] // the table outbox of db
	broker   testBroker                       // the test's broker, if this copy has one (nats_env_test.go)
	environ  []string                         // added to the environment of the processes started
	args     []string                         // added to the flags of the processes started
	bare     bool                             // start with no -database and -nats of the test's: from the environment alone
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, binary: filepath.Join(t.TempDir(), "outbox-relay")}
	if out, err := exec.Command("go", "build", "-o", e.binary, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	name := pgtest.NewBlankDatabase(t)
	cfg := pgtest.Config
	e.database = fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, name)
	e.db = pgtest.Open(t, name, "")
	e.name = name
	ob, err := postgres.OpenDB(e.db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	e.outbox = ob
	if startTestBroker != nil {
		e.broker = startTestBroker(t)
	}
	return e
}

// process is a running outbox-relay.
type process struct {
	cmd    *exec.Cmd
	stderr *syncBuffer
	exited chan error
}

// start starts outbox-relay with args and the test's database and JetStream.
func (e *env) start(args ...string) *process {
	e.t.Helper()
	p := &process{stderr: &syncBuffer{}, exited: make(chan error, 1)}
	argv := []string{args[0], "-database", e.database}
	if e.broker != nil {
		argv = append(argv, e.broker.args()...)
	}
	if e.bare {
		argv = argv[:1]
	}
	argv = append(argv, e.args...)
	argv = append(argv, args[1:]...) // flags before the arguments
	p.cmd = exec.Command(e.binary, argv...)
	p.cmd.Env = append(os.Environ(), e.environ...)
	p.cmd.Stderr, p.cmd.Stdout = p.stderr, p.stderr
	if err := p.cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	go func() { p.exited <- p.cmd.Wait() }()
	e.t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.exited
	})
	return p
}

// wait waits for the process to exit, and returns its exit code.
func (p *process) wait(t *testing.T) int {
	t.Helper()
	select {
	case <-p.exited:
		p.exited <- nil // for the cleanup's receive
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(generous):
		t.Fatalf("outbox-relay did not exit within %v; it said:\n%s", generous, p.stderr)
		return -1
	}
}

// runOnce runs outbox-relay with args to its end, and returns its exit
// code and what it wrote.
func (e *env) runOnce(args ...string) (int, string) {
	e.t.Helper()
	p := e.start(args...)
	code := p.wait(e.t)
	return code, p.stderr.String()
}

// freeAddr is a loopback address with a port nothing listens on.
func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// get is GET url's status and body, or 0 if nothing answered.
func get(url string) (int, string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(generous); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, generous)
		}
	}
}

func (e *env) count(query string) int64 {
	var n int64
	if err := e.db.QueryRow(query).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// secretFile writes secret to a file of the test's, readable by its owner
// alone, and returns its name.
func secretFile(t *testing.T, secret string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(path, []byte(secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// writeOrders writes n OrderPlaced events, one transaction each.
func (e *env) writeOrders(n int) {
	e.t.Helper()
	for i := range n {
		if err := e.writeOrder(i + 1); err != nil {
			e.t.Fatal(err)
		}
	}
}

// writeOrder writes the OrderPlaced event of order id in a transaction of
// its own.
func (e *env) writeOrder(id int) error {
	return postgres.Transaction(context.Background(), e.db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := e.outbox.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"orderId": id}})
		return err
	})
}

// syncBuffer is a bytes.Buffer safe for a process's output and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
