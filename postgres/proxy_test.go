package postgres_test

import (
	"bytes"
	"database/sql"
	"encoding/binary"
	"io"
	"net"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// proxy stands between a client and the test server: it listens on TCP on
// loopback and forwards each connection to the server's Unix socket, so that
// a test can make the network fail in ways a killed backend does not.
//
//   - freeze: forward nothing more, in either direction, and close nothing, as
//     when the client's host vanishes or the network splits: the server sees
//     neither data nor a FIN.
//   - cutNextCommit: forward the next COMMIT a client sends, then drop the
//     server's answer and close the connection, as when the connection dies
//     with the COMMIT in flight: the server committed, the client cannot know.
type proxy struct {
	ln     net.Listener
	socket string

	frozen   chan struct{} // closed by freeze
	freezeMu sync.Once
	cut      atomic.Bool // the next COMMIT is to be cut
	done     chan struct{}

	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

func startProxy(tb testing.TB) *proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &proxy{
		ln:     ln,
		socket: filepath.Join(pgtest.Config.Host, ".s.PGSQL."+strconv.Itoa(int(pgtest.Config.Port))),
		frozen: make(chan struct{}),
		done:   make(chan struct{}),
	}
	p.wg.Go(p.accept)
	tb.Cleanup(p.close)
	return p
}

// open is the test's open, through the proxy.
func (p *proxy) open(tb testing.TB, database, app string) *sql.DB {
	cfg := pgtest.Config.Copy()
	cfg.Host = "127.0.0.1"
	cfg.Port = uint16(p.ln.Addr().(*net.TCPAddr).Port)
	cfg.Database = database
	cfg.Fallbacks = nil
	cfg.RuntimeParams["application_name"] = app
	db := stdlib.OpenDB(*cfg)
	tb.Cleanup(func() { db.Close() })
	return db
}

func (p *proxy) freeze()        { p.freezeMu.Do(func() { close(p.frozen) }) }
func (p *proxy) cutNextCommit() { p.cut.Store(true) }

func (p *proxy) close() {
	close(p.done)
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *proxy) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		srv, err := net.Dial("unix", p.socket)
		if err != nil {
			client.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, client, srv)
		p.mu.Unlock()
		var cut atomic.Bool // this connection's COMMIT was forwarded and its answer is to be dropped
		p.wg.Go(func() { p.toServer(client, srv, &cut) })
		p.wg.Go(func() { p.toClient(srv, client, &cut) })
	}
}

// hold blocks, if the proxy is frozen, until it closes, and reports whether
// it was frozen.
func (p *proxy) hold() bool {
	select {
	case <-p.frozen:
		<-p.done
		return true
	default:
		return false
	}
}

// toServer forwards the client's messages one by one, so that it can tell a
// COMMIT: the startup packets first (a length and a body), then messages of
// a type byte, a length and a body. The simple query protocol, which pgx uses
// for COMMIT, sends 'Q' and the text.
func (p *proxy) toServer(client, srv net.Conn, cut *atomic.Bool) {
	defer srv.Close()
	startup := true
	for {
		var head []byte
		if startup {
			head = make([]byte, 4)
		} else {
			head = make([]byte, 5)
		}
		if _, err := io.ReadFull(client, head); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(head[len(head)-4:])) - 4
		if n < 0 || n > 1<<26 {
			return
		}
		body := make([]byte, n)
		if _, err := io.ReadFull(client, body); err != nil {
			return
		}
		if startup {
			// An SSL or GSS request (codes 80877103, 80877104) is followed by
			// another startup packet; anything else is the startup message.
			code := binary.BigEndian.Uint32(body)
			startup = code == 80877103 || code == 80877104
		} else if head[0] == 'Q' && bytes.HasPrefix(bytes.ToLower(body), []byte("commit")) && p.cut.CompareAndSwap(true, false) {
			cut.Store(true) // before the COMMIT goes, so its answer is the next thing the server sends
		}
		if p.hold() {
			return
		}
		if _, err := srv.Write(append(head, body...)); err != nil {
			return
		}
	}
}

func (p *proxy) toClient(srv, client net.Conn, cut *atomic.Bool) {
	defer client.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := srv.Read(buf)
		if n > 0 {
			if cut.Load() || p.hold() {
				srv.Close()
				return
			}
			if _, err := client.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
