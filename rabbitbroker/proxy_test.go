package rabbitbroker_test

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// confirmBreaker is a TCP proxy between AMQP clients and a server that can
// lose a confirm on its way back: armed, when the server sends a basic.ack,
// it breaks the connection instead of forwarding it, as a network that
// fails right after the server answered. RabbitMQ has the message by then.
type confirmBreaker struct {
	ln     net.Listener
	armed  atomic.Bool
	broken atomic.Int64
	wg     sync.WaitGroup
}

// newConfirmBreaker listens on a loopback port and forwards to target,
// until t ends.
func newConfirmBreaker(t testing.TB, target string) *confirmBreaker {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &confirmBreaker{ln: ln}
	var conns sync.Map
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			srv, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			conns.Store(client, srv)
			p.wg.Add(2)
			go func() { defer p.wg.Done(); io.Copy(srv, client); srv.Close() }()
			go func() { defer p.wg.Done(); p.serverToClient(client, srv); client.Close(); srv.Close() }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		conns.Range(func(c, s any) bool { c.(net.Conn).Close(); s.(net.Conn).Close(); return true })
		p.wg.Wait()
	})
	return p
}

// url is the proxy's AMQP URL.
func (p *confirmBreaker) url() string { return "amqp://guest:guest@" + p.ln.Addr().String() + "/" }

// breakAtNextConfirm arms the proxy.
func (p *confirmBreaker) breakAtNextConfirm() { p.armed.Store(true) }

// serverToClient copies the server's frames to the client one at a time
// (type, channel, size, payload, end), and returns, breaking the
// connection, at the first basic.ack (class 60, method 80) once armed.
func (p *confirmBreaker) serverToClient(client io.Writer, srv io.Reader) {
	r := bufio.NewReader(srv)
	for {
		head := make([]byte, 7)
		if _, err := io.ReadFull(r, head); err != nil {
			return
		}
		rest := make([]byte, binary.BigEndian.Uint32(head[3:])+1) // the payload and the frame end
		if _, err := io.ReadFull(r, rest); err != nil {
			return
		}
		if head[0] == 1 && len(rest) >= 5 && binary.BigEndian.Uint16(rest) == 60 && binary.BigEndian.Uint16(rest[2:]) == 80 &&
			p.armed.CompareAndSwap(true, false) {
			p.broken.Add(1)
			return
		}
		if _, err := client.Write(append(head, rest...)); err != nil {
			return
		}
	}
}

// stallingProxy is a TCP proxy between AMQP clients and a server that can
// stop reading what clients send, as a server whose process hangs or
// whose TCP window stays shut, while what the server sends still flows.
type stallingProxy struct {
	ln      net.Listener
	mu      sync.Mutex
	resumed chan struct{} // closed while the proxy reads; open while it stalls
	wg      sync.WaitGroup
}

// newStallingProxy listens on a loopback port and forwards to target,
// until t ends.
func newStallingProxy(t testing.TB, target string) *stallingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallingProxy{ln: ln, resumed: make(chan struct{})}
	close(p.resumed)
	var conns sync.Map
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			srv, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			conns.Store(client, srv)
			p.wg.Add(2)
			go func() { defer p.wg.Done(); p.clientToServer(srv, client); srv.Close() }()
			go func() { defer p.wg.Done(); io.Copy(client, srv); client.Close(); srv.Close() }()
		}
	}()
	t.Cleanup(func() {
		p.resume()
		ln.Close()
		conns.Range(func(c, s any) bool { c.(net.Conn).Close(); s.(net.Conn).Close(); return true })
		p.wg.Wait()
	})
	return p
}

// url is the proxy's AMQP URL.
func (p *stallingProxy) url() string { return "amqp://guest:guest@" + p.ln.Addr().String() + "/" }

// stall stops the proxy reading from every client until resume.
func (p *stallingProxy) stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.resumed:
		p.resumed = make(chan struct{})
	default:
	}
}

// resume has the proxy read from clients again.
func (p *stallingProxy) resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.resumed:
	default:
		close(p.resumed)
	}
}

// clientToServer copies what client sends to srv, waiting before each read
// while the proxy stalls.
func (p *stallingProxy) clientToServer(srv io.Writer, client io.Reader) {
	buf := make([]byte, 32<<10)
	for {
		p.mu.Lock()
		resumed := p.resumed
		p.mu.Unlock()
		<-resumed
		n, err := client.Read(buf)
		if n > 0 {
			if _, werr := srv.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// watchedConn is a client's net.Conn that tells how many bytes its writes
// were offered and whether one is under way.
type watchedConn struct {
	net.Conn
	offered atomic.Int64
	writing atomic.Int32
}

func (c *watchedConn) Write(b []byte) (int, error) {
	c.writing.Add(1)
	defer c.writing.Add(-1)
	c.offered.Add(int64(len(b)))
	return c.Conn.Write(b)
}
