package postgres

import (
	"context"
	"encoding/binary"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"example.com/patterns/enterprise/outbox/postgres/pgtest"
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

// testStream is a stream of a LogRelay of the table outbox publishing to
// broker, as cfg says, that is never due to tell the server anything (there
// is none), and feed, which hands it one message of the protocol.
func testStream(t *testing.T, broker MessageBroker, cfg LogRelayConfig) (s *stream, feed func([]byte)) {
	r := &LogRelay{broker: broker, table: defaultTables.table, outbox: defaultTables, cfg: cfg}
	r.tel = newRelayTelemetry(nil, nil, r.table, "log", "unknown")
	s = &stream{relay: r, relations: map[uint32]*pglogrepl.RelationMessage{}, every: time.Hour, told: time.Now().Add(time.Hour)}
	return s, func(data []byte) {
		t.Helper()
		if err := s.handle(context.Background(), data); err != nil {
			t.Fatal(err)
		}
	}
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
	broker := &syncRecorder{}
	s, feed := testStream(t, broker, LogRelayConfig{NeverPark: true, Unmarked: true})
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

func insertWithPayload(id, payload string) []byte {
	return xlog(wire{}.u8('I').u32(1).u8('N').u16(4).text(id).text("key-" + id).text("ItemPicked").text(payload))
}

// A large transaction goes out as it is read, in parts, not held whole:
// of a transaction of 2,500 rows, the first streamRows are published before
// the rest are read, the relay never holds more than streamRows, and a
// keepalive between parts moves nothing; its end is confirmed only at its
// COMMIT, once all 2,500 went, in order. Rows of large payloads go once
// about streamBytes are held. (Caught: the whole transaction held in
// memory before its first publish.)
func TestLargeTransactionIsPublishedInPartsAsItIsRead(t *testing.T) {
	broker := &syncRecorder{}
	s, handle := testStream(t, broker, LogRelayConfig{NeverPark: true, Unmarked: true})
	most := 0
	feed := func(data []byte) {
		t.Helper()
		handle(data)
		most = max(most, len(s.txn))
	}
	published := func() int { broker.mu.Lock(); defer broker.mu.Unlock(); return len(broker.ids) }
	feed(outboxRelation())
	feed(xlog(wire{}.u8('B').u64(0x3f0).u64(0).u32(700)))
	for id := 1; id <= streamRows+1; id++ {
		feed(insertMessage(strconv.Itoa(id)))
	}
	if n := published(); n != streamRows {
		t.Fatalf("after %d rows read, before the COMMIT: %d published, want the first part, %d", streamRows+1, n, streamRows)
	}
	feed(keepalive(0x500, false))
	if s.confirmed != 0 {
		t.Fatalf("a keepalive between parts moved the position to %v", s.confirmed)
	}
	for id := streamRows + 2; id <= 2500; id++ {
		feed(insertMessage(strconv.Itoa(id)))
	}
	feed(xlog(wire{}.u8('C').u8(0).u64(0x3f0).u64(0x400).u64(0)))
	if most > streamRows {
		t.Errorf("the relay held %d rows at once, want at most %d", most, streamRows)
	}
	if s.confirmed != 0x400 {
		t.Errorf("after the COMMIT the position is %v, want the transaction's end 0/400", s.confirmed)
	}
	if len(broker.ids) != 2500 {
		t.Fatalf("published %d, want 2500", len(broker.ids))
	}
	for i, id := range broker.ids {
		if id != int64(i+1) {
			t.Fatalf("published %d at %d, want the rows in their order", id, i)
		}
	}

	big := `"` + strings.Repeat("x", 1<<20) + `"` // 1 MiB
	feed(xlog(wire{}.u8('B').u64(0x4f0).u64(0).u32(701)))
	rows := 0
	for id := 3001; published() == 2500; id++ {
		feed(insertWithPayload(strconv.Itoa(id), big))
		if rows++; rows > streamBytes>>20+1 {
			t.Fatalf("%d rows of 1 MiB held and none published, want a part at about %d bytes", rows, streamBytes)
		}
	}
	t.Logf("rows of 1 MiB: the first part went after %d", rows)
}

// Each delivered row reaches the marks with the transaction that wrote it
// (its BEGIN's xid), which a relay that deletes needs to tell a row gone
// from one not visible yet: rows of two transactions, and the first part of
// a large one, before its COMMIT. (Caught: rows handed to the marks with
// xid 0, which every snapshot sees, so that a row not visible yet would be
// counted deleted and stay unsent.)
func TestDeliveredRowsReachTheMarksWithTheirTransaction(t *testing.T) {
	s, feed := testStream(t, &syncRecorder{}, LogRelayConfig{NeverPark: true, DeleteDelivered: true})
	m := newMarks(s.relay, nil)
	m.busy = true // no mark starts (there is no database): the rows stay pending
	s.marks = m
	feed(outboxRelation())
	feed(xlog(wire{}.u8('B').u64(0x3f0).u64(0).u32(700)))
	feed(insertMessage("7"))
	feed(xlog(wire{}.u8('C').u8(0).u64(0x3f0).u64(0x400).u64(0)))
	feed(xlog(wire{}.u8('B').u64(0x4f0).u64(0).u32(701)))
	feed(insertMessage("8"))
	feed(insertMessage("9"))
	feed(xlog(wire{}.u8('C').u8(0).u64(0x4f0).u64(0x500).u64(0)))
	feed(xlog(wire{}.u8('B').u64(0x5f0).u64(0).u32(702)))
	for id := 100; id < 100+streamRows; id++ {
		feed(insertMessage(strconv.Itoa(id)))
	}
	feed(insertMessage("99999")) // one past a part: the part goes, its COMMIT still to come

	want := []markRow{{7, 700, "key-7"}, {8, 701, "key-8"}, {9, 701, "key-9"}}
	for id := int64(100); id < 100+streamRows; id++ {
		want = append(want, markRow{id, 702, "key-" + strconv.FormatInt(id, 10)})
	}
	if len(m.pending) != 1 {
		t.Fatalf("rows pending in %d tables, want 1", len(m.pending))
	}
	var got []markRow
	for table, rows := range m.pending {
		t.Logf("%d rows pending in %s", len(rows), table)
		got = rows
	}
	if len(got) != len(want) {
		t.Fatalf("%d rows pending, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("pending row %d is %+v, want %+v", i, got[i], want[i])
		}
	}
	if m.pendingTo != 0x500 {
		t.Errorf("pending up to %v, want the second transaction's end 0/500 (a part moves no position)", m.pendingTo)
	}
}

// The snapshot guard of stillHeld: an aggregate held back by a transaction
// that the marks' snapshot cannot see yet (the log carries a commit a
// moment before other sessions see it; here, a transaction still open) is
// still held, though no unsent row of it comes before: the query cannot
// tell yet. Once that transaction has ended, the aggregate is free.
// (Without the guard, the aggregate was let go at once: a row of it
// published ahead of the one that held it.)
func TestHeldBackKeepsAnAggregateWhoseHolderItCannotSeeYet(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Open(t, pgtest.NewBlankDatabase(t), "")
	ob, err := OpenDB(db, Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	holder, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback()
	var xid int64
	if err := holder.QueryRowContext(ctx, `SELECT txid_current()`).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	var reading int64 // the transaction the stream reads, committed
	if err := db.QueryRowContext(ctx, `SELECT txid_current()`).Scan(&reading); err != nil {
		t.Fatal(err)
	}
	s, _ := testStream(t, &syncRecorder{}, LogRelayConfig{})
	s.markIn, s.xid = db, uint32(reading)
	s.held = map[string]uint32{"cart/A": uint32(xid)}
	table := pgx.Identifier{"public", "outbox"}.Sanitize()
	if held, err := s.heldBack(ctx, table, Message{ID: 10, Aggregate: "cart/A"}); err != nil || !held {
		t.Fatalf("heldBack while the holding transaction is invisible = %v, %v; want held", held, err)
	}
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT txid_current()`).Scan(&reading); err != nil { // the next transaction read
		t.Fatal(err)
	}
	s.xid = uint32(reading)
	if held, err := s.heldBack(ctx, table, Message{ID: 11, Aggregate: "cart/A"}); err != nil || held {
		t.Errorf("heldBack once the holder ended, with no unsent row before = %v, %v; want free", held, err)
	}
}
