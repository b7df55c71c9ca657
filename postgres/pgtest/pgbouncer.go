package pgtest

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// PgBouncerBin is Debian's PgBouncer, which make postgres and make
// outbox-relay install where it is missing.
const PgBouncerBin = "/usr/sbin/pgbouncer"

// StartPgBouncer starts a PgBouncer of tb's own, in transaction pooling, in
// a temporary folder, listening on a loopback port of its own, in front of
// the PostgreSQL at host (a socket's folder, or an address) and port, for
// every database there and each of users (trusted, as the test servers
// trust them). It is stopped and its folder removed when tb ends. It
// returns its port. Run as root, it runs as the postgres user (PgBouncer
// refuses root), as the servers do. Clients behind it in transaction
// pooling use pgx's simple protocol (default_query_exec_mode =
// simple_protocol): PgBouncer 1.18 keeps no prepared statement across
// transactions.
func StartPgBouncer(tb testing.TB, host string, port uint16, users ...string) int {
	tb.Helper()
	if _, err := os.Stat(PgBouncerBin); err != nil {
		tb.Fatalf("PgBouncer is not installed (%v): make postgres and make outbox-relay install Debian's pgbouncer", err)
	}
	dir, err := os.MkdirTemp("", "outbox-pgbouncer-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	listen := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%d

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
max_client_conn = 200
default_pool_size = 10
logfile = %s
pidfile = %s
`, host, port, listen, filepath.Join(dir, "users.txt"), filepath.Join(dir, "pgbouncer.log"), filepath.Join(dir, "pgbouncer.pid"))
	var list bytes.Buffer
	for _, u := range users {
		fmt.Fprintf(&list, "%q \"\"\n", u)
	}
	for name, text := range map[string][]byte{"pgbouncer.ini": []byte(ini), "users.txt": list.Bytes()} {
		if err := os.WriteFile(filepath.Join(dir, name), text, 0o644); err != nil {
			tb.Fatal(err)
		}
	}
	cmd := exec.Command(PgBouncerBin, filepath.Join(dir, "pgbouncer.ini"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			tb.Fatal(err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			tb.Fatal(err)
		}
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	out := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	tb.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(time.Minute):
			cmd.Process.Kill()
			<-exited
		}
	})
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		select {
		case err := <-exited:
			log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
			tb.Fatalf("PgBouncer exited: %v\n%s\n%s", err, out.String(), log)
		default:
		}
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", listen))
		if err == nil {
			c.Close()
			return listen
		}
		if time.Now().After(deadline) {
			tb.Fatalf("PgBouncer does not listen on 127.0.0.1:%d after a minute: %v", listen, err)
		}
	}
}

// lockedBuffer is a bytes.Buffer that a process's output and a test may
// use at once.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
