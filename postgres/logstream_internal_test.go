package postgres

import (
	"context"
	"encoding/binary"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
)

// These tests feed a log relay's stream the protocol's messages as a
// server sends them, byte for byte: what no server of ours can be made to
// send on cue.

// wire builds the replication protocol's messages.
type wire []byte

func (w wire) u8(b byte) wire      { return append(w, b) }
func (w wire) u16(v uint16) wire   { return binary.BigEndian.AppendUint16(w, v) }
func (w wire) u32(v uint32) wire   { return binary.BigEndian.AppendUint32(w, v) }
func (w wire) u64(v uint64) wire   { return binary.BigEndian.AppendUint64(w, v) }
func (w wire) str(s string) wire   { return append(append(w, s...), 0) }
func (w wire) text(s string) wire  { return append(w.u8('t').u32(uint32(len(s))), s...) }
func (w wire) bytes(b []byte) wire { return append(w, b...) }

// xlog wraps a pgoutput message in XLogData.
func xlog(data wire) []byte { return wire{}.u8('w').u64(0).u64(0).u64(0).bytes(data) }

func keepalive(end pglogrepl.LSN, reply bool) []byte {
	w := wire{}.u8('k').u64(uint64(end)).u64(0)
	if reply {
		return w.u8(1)
	}
	return w.u8(0)
}

// outboxRelation describes relation 1 as the outbox, with the columns a
// Message needs.
func outboxRelation() []byte {
	cols := []string{"id", "message_key", "type", "payload"}
	w := wire{}.u8('R').u32(1).str("public").str("outbox").u8('d').u16(uint16(len(cols)))
	for _, c := range cols {
		w = w.u8(0).str(c).u32(25).u32(0xffffffff)
	}
	return xlog(w)
}

func insertMessage(id string) []byte {
	return xlog(wire{}.u8('I').u32(1).u8('N').u16(4).text(id).text("key-" + id).text("ItemPicked").text(`{}`))
}

// syncRecorder keeps what it is given; safe for concurrent use.
type syncRecorder struct {
	mu  sync.Mutex
	ids []int64
}

func (r *syncRecorder) Publish(_ context.Context, m Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ids = append(r.ids, m.ID)
	return nil
}

// A keepalive that comes while a transaction is half read does not move
// the relay's position: the transaction is not delivered yet, and a
// position past it, told to the server, would have it never sent again
// after a crash. Once the transaction is delivered, the position is its
// end, and a keepalive after it moves it on. (Caught: a keepalive taken
// whatever was half read, which confirmed 0/500 with the transaction of
// row 7, ending at 0/400, not yet published.)
func TestKeepaliveInsideATransactionMovesNothing(t *testing.T) {
	ctx := context.Background()
	broker := &syncRecorder{}
	r := NewLogRelay("", broker)
	r.tel = newRelayTelemetry(nil, nil, r.table, "log")
	s := &stream{relay: r, relations: map[uint32]*pglogrepl.RelationMessage{}, every: time.Hour, told: time.Now()}
	feed := func(data []byte) {
		t.Helper()
		if err := s.handle(ctx, data); err != nil {
			t.Fatal(err)
		}
	}
	feed(outboxRelation())
	feed(xlog(wire{}.u8('B').u64(0x3f0).u64(0).u32(700)))
	feed(insertMessage("7"))
	feed(keepalive(0x500, false))
	if s.confirmed != 0 {
		t.Fatalf("a keepalive inside a transaction moved the position to %v", s.confirmed)
	}
	feed(xlog(wire{}.u8('C').u8(0).u64(0x3f0).u64(0x400).u64(0)))
	if len(broker.ids) != 1 || broker.ids[0] != 7 {
		t.Fatalf("published %v, want row 7", broker.ids)
	}
	if s.confirmed != 0x400 {
		t.Errorf("after the transaction was delivered the position is %v, want its end 0/400", s.confirmed)
	}
	feed(keepalive(0x500, false))
	if s.confirmed != 0x500 {
		t.Errorf("a keepalive between transactions left the position at %v, want 0/500", s.confirmed)
	}
}
