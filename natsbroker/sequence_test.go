package natsbroker_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/postgres"
)

// PublishSequence stores a prefix of its messages, in their order, and
// says why it stopped where it did. Each case is a sequence into a stream
// whose MaxMsgSize refuses a big message: the stream stores the messages
// before the first it refuses and none after, wherever the refused one is:
// first (no batch is started), in the middle (the next message ends the
// batch), or last (only the batch's end, sent after the last message, ends
// it); a type that makes no subject is refused by the client before it is
// sent; messages the stream holds already within its duplicate window are
// skipped and count as stored. (Caught: a batch whose last message carried
// the commit: the stream, refusing that message, left the batch open, and
// the three it stored went unacknowledged until the context ended.)
func TestPublishSequenceStoresAPrefixAndSaysWhy(t *testing.T) {
	for _, tc := range []struct {
		name  string
		seq   string // a message a letter: o fits, B is over the size, S's type makes no subject, d was sent before
		wantN int
		why   string // in the error, which wraps ErrRejected; none if empty
	}{
		{"all fit", "oooooo", 6, ""},
		{"one", "o", 1, ""},
		{"first refused", "Booo", 0, "bytes"},
		{"middle refused", "ooBoo", 2, "bytes"},
		{"last refused", "oooB", 3, "bytes"},
		{"no subject", "ooSo", 2, "makes no valid subject"},
		{"copies first and between", "ddoodo", 6, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			b := startBroker(t, nil)
			_, stream := createStream(t, b.url(), func(cfg *jetstream.StreamConfig) { cfg.MaxMsgSize = 1 << 10 })
			pub := newPublisher(t, connect(t, b.url()))
			var msgs, before []postgres.Message
			for i, c := range tc.seq {
				m := postgres.Message{ID: int64(i + 1), Key: fmt.Sprintf("key-%d", i+1), Type: "OrderPlaced", Payload: `{"n":1}`}
				switch c {
				case 'B':
					m.Payload = `{"note":"` + strings.Repeat("x", 2048) + `"}`
				case 'S':
					m.Type = "Order Placed"
				case 'd':
					before = append(before, m)
				}
				msgs = append(msgs, m)
			}
			for _, m := range before {
				if err := pub.Publish(ctx, m); err != nil {
					t.Fatal(err)
				}
			}
			n, err := pub.PublishSequence(ctx, msgs)
			switch {
			case n != tc.wantN:
				t.Errorf("PublishSequence(%s) = %d, %v; want %d", tc.seq, n, err, tc.wantN)
			case tc.why == "" && err != nil:
				t.Errorf("PublishSequence(%s) = %d, %v; want no error", tc.seq, n, err)
			case tc.why != "" && (!errors.Is(err, postgres.ErrRejected) || !strings.Contains(err.Error(), tc.why) || !strings.Contains(err.Error(), msgs[n].Key)):
				t.Errorf("PublishSequence(%s) = %d, %v; want ErrRejected naming %s and saying %q", tc.seq, n, err, msgs[n].Key, tc.why)
			}
			if got := streamMessages(t, stream); got != uint64(tc.wantN) {
				t.Errorf("the stream holds %d messages, want %d: the prefix, each once", got, tc.wantN)
			}
			for i := range tc.wantN {
				got, err := stream.GetMsg(ctx, uint64(i+1))
				if err != nil || got.Header.Get(jetstream.MsgIDHeader) != msgs[i].Key && !strings.ContainsRune(tc.seq, 'd') {
					t.Errorf("stream message %d = %v, %v; want %s", i+1, got, err, msgs[i].Key)
				}
			}
		})
	}
}

// A fast batch whose ack is lost reports what the stream's flow acks said
// it stored: 250 messages, whose batch the stream acknowledges each 100
// stored, and a proxy drops the batch's final ack. PublishSequence returns
// 200, with ErrBrokerUnavailable (the outcome of the rest unknown), while
// the stream holds all 250. (Caught: a cut batch that reported none stored.)
func TestCutSequenceReportsWhatTheFlowAcksSaid(t *testing.T) {
	b := startBroker(t, nil)
	_, stream := setUp(t, connect(t, b.url()), 0, 0)
	proxy := newAckDropper(t, strings.TrimPrefix(b.url(), "nats://"))
	nc := connect(t, proxy.url())
	pub := newPublisher(t, nc)
	var msgs []postgres.Message
	for i := range 250 {
		msgs = append(msgs, postgres.Message{ID: int64(i + 1), Key: fmt.Sprintf("key-%d", i+1), Type: "OrderPlaced", Payload: "{}"})
	}
	proxy.dropNextAck()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	var n int
	var err error
	go func() { n, err = pub.PublishSequence(ctx, msgs); close(done) }()
	waitFor(t, "the batch's ack dropped", func() bool { return proxy.dropped.Load() == 1 })
	if err := nc.Flush(); err != nil { // the answers before the dropped ack have reached the client
		t.Fatal(err)
	}
	cancel()
	<-done
	if n != 200 || !errors.Is(err, postgres.ErrBrokerUnavailable) {
		t.Errorf("PublishSequence cut after its ack was lost = %d, %v; want 200 and ErrBrokerUnavailable", n, err)
	}
	if got := streamMessages(t, stream); got != 250 {
		t.Errorf("the stream holds %d messages, want 250", got)
	}
}
