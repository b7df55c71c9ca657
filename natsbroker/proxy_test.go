package natsbroker_test

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"example.com/patterns/enterprise/outbox/natsbroker"
)

// ackDropper is a TCP proxy between NATS clients and a server that can lose
// the server's replies: armed, it drops the next ack the server sends to a
// client's inbox (a publish's ack goes there; a fast batch's flow acks,
// which go there too, pass), and forwards everything else as it came. The
// server has stored the message by then; only the ack is lost, as when a
// connection breaks right after the server answered. It counts the
// messages clients publish to the stream's subjects.
type ackDropper struct {
	ln        net.Listener
	armed     atomic.Bool
	dropped   atomic.Int64
	published atomic.Int64
	wg        sync.WaitGroup
}

// newAckDropper listens on a loopback port and forwards to target, until t
// ends.
func newAckDropper(t *testing.T, target string) *ackDropper {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &ackDropper{ln: ln}
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
			go func() { defer p.wg.Done(); p.serverToClient(client, srv); client.Close() }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		conns.Range(func(c, s any) bool { c.(net.Conn).Close(); s.(net.Conn).Close(); return true })
		p.wg.Wait()
	})
	return p
}

func (p *ackDropper) url() string { return "nats://" + p.ln.Addr().String() }

// dropNextAck arms the proxy.
func (p *ackDropper) dropNextAck() { p.armed.Store(true) }

// clientToServer copies the client's protocol to the server as it came,
// counting each PUB or HPUB to a subject under natsbroker.SubjectPrefix.
func (p *ackDropper) clientToServer(srv io.Writer, client io.Reader) {
	// PUB subject [reply] size; HPUB subject [reply] hdrsize size
	copyMessages(srv, client, "PUB", func(subject, body []byte) bool {
		if bytes.HasPrefix(subject, []byte(natsbroker.SubjectPrefix)) && len(body) > 2 {
			p.published.Add(1)
		}
		return true
	})
}

// serverToClient copies the server's protocol to the client, and leaves
// out the first ack to an inbox after the proxy was armed.
func (p *ackDropper) serverToClient(client io.Writer, srv io.Reader) {
	// MSG subject sid [reply] size; HMSG subject sid [reply] hdrsize size
	copyMessages(client, srv, "MSG", func(subject, body []byte) bool {
		if bytes.HasPrefix(subject, []byte("_INBOX.")) && !bytes.HasPrefix(body, []byte(`{"type":`)) && p.armed.CompareAndSwap(true, false) {
			p.dropped.Add(1)
			return false
		}
		return true
	})
}

// copyMessages copies NATS protocol from src to dst a line at a time; a
// line whose verb is verb or "H"+verb carries a message, whose size is its
// last field: copyMessages reads the message's body (and its \r\n) and
// forwards the two only if keep, given the message's subject and body, says
// so.
func copyMessages(dst io.Writer, src io.Reader, verb string, keep func(subject, body []byte) bool) {
	r := bufio.NewReader(src)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return
		}
		var body []byte
		fields := bytes.Fields(line)
		if len(fields) >= 3 && (string(fields[0]) == verb || string(fields[0]) == "H"+verb) {
			size, err := strconv.Atoi(string(fields[len(fields)-1]))
			if err != nil {
				return
			}
			body = make([]byte, size+2)
			if _, err := io.ReadFull(r, body); err != nil {
				return
			}
			if !keep(fields[1], body) {
				continue
			}
		}
		if _, err := dst.Write(append(line, body...)); err != nil {
			return
		}
	}
}
