package main

import (
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// embeddedBroker is a NATS server with JetStream, run inside the shop's
// process on a loopback port, with its store in a folder of the shop's.
// Down stops it and Up starts it again on the same port and store, as a
// broker that goes down and comes back does: the stream, its messages and
// its record of message ids survive. Safe for concurrent use.
type embeddedBroker struct {
	mu   sync.Mutex
	opts server.Options
	srv  *server.Server // nil while down
}

func startBroker(storeDir string) (*embeddedBroker, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0") // a free port, kept across Down and Up
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	b := &embeddedBroker{opts: server.Options{
		Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: storeDir, NoSigs: true, NoLog: true,
	}}
	return b, b.Up()
}

// URL is where clients connect.
func (b *embeddedBroker) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", b.opts.Port) }

// Up starts the server, if it is down.
func (b *embeddedBroker) Up() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.srv != nil {
		return nil
	}
	srv, err := server.NewServer(b.opts.Clone())
	if err != nil {
		return err
	}
	srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		return fmt.Errorf("JetStream server not ready within 30 s")
	}
	b.srv = srv
	return nil
}

// Down stops the server, if it is up, and waits until it has.
func (b *embeddedBroker) Down() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.srv != nil {
		b.srv.Shutdown()
		b.srv.WaitForShutdown()
		b.srv = nil
	}
}
