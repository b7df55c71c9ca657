package main

// JetStream, embedded, as the broker of newEnv's tests.

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
)

func init() { startTestBroker = startNATS }

// natsEnv is a test's JetStream server and a client of it.
type natsEnv struct {
	url string
	js  jetstream.JetStream
}

func (n *natsEnv) args() []string { return []string{"-nats", n.url} }

// startNATS starts a JetStream server for t, and connects to it.
func startNATS(t *testing.T) testBroker {
	t.Helper()
	n := &natsEnv{url: startJetStream(t, server.Options{}).ClientURL()}
	nc, err := nats.Connect(n.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if n.js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	return n
}

// nats is e's JetStream.
func (e *env) nats() *natsEnv { return e.broker.(*natsEnv) }

// startJetStream starts an embedded JetStream server of opts on a free
// loopback port, its store in a temporary folder, stopped when t ends,
// and waits until it takes connections.
func startJetStream(t *testing.T, opts server.Options) *server.Server {
	t.Helper()
	opts.Host, opts.Port, opts.JetStream, opts.StoreDir, opts.NoSigs = "127.0.0.1", -1, true, t.TempDir(), true
	srv, err := server.NewServer(&opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	t.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("the JetStream server did not start")
	}
	return srv
}

// streamMsgs is how many messages the stream holds.
func (e *env) streamMsgs() uint64 {
	s, err := e.nats().js.Stream(context.Background(), natsbroker.Stream)
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		e.t.Fatal(err)
	}
	return info.State.Msgs
}
