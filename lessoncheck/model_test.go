package lessoncheck_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"example.com/patterns/enterprise/outbox"
)

// ---- Beyond the article: a model ----
// FuzzModel and TestModelExhaustive drive one harness, runHistory: a history
// of operations runs on the library and on a plain reference model; after
// every step the tables, the broker's log and every result must match the
// model, and a final drain must leave nothing unsent.

// The model on random histories, read from pairs of bytes: make test runs the
// seed corpus below, make fuzz searches further.
func FuzzModel(f *testing.F) {
	f.Add([]byte{opPlace, 10, opRelayPass, 0})
	f.Add([]byte{opPlace, 1, opPlaceFailed, 2, opBadInput, 0, opBadInput, 7, opPlace, 3, opRelayPass, 0})
	f.Add([]byte{opBrokerDown, 0, opPlace, 1, opPlace, 2, opRelayPass, 0, opBrokerUp, 0, opRelayPass, 0, opRelayPass, 0})
	f.Add([]byte{opPlace, 1, opPlace, 2, opPlace, 3, opFailNth, 1, opRelayPass, 0, opRelayReboot, 0, opRelayPass, 0})
	f.Add([]byte{opPlace, 1, opPlace, 2, opLoseAck, 0, opRelayPass, 0, opRelayPass, 0, opLoseAck, 0, opRelayPass, 0})
	f.Add([]byte{opLoseAck, 0, opBrokerDown, 0, opPlace, 9, opRelayPass, 0, opFailNth, 0, opBrokerUp, 0,
		opRelayPass, 0, opRelayReboot, 0, opRelayPass, 0, opPlaceFailed, 1, opRelayPass, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		var history history
		for i := 0; i+1 < len(ops) && len(history) < 128; i += 2 { // the checks cost O(steps)
			history = append(history, step{ops[i] % opCount, ops[i+1]})
		}
		if err := runHistory(history, 0); err != nil {
			t.Fatalf("history %v: %v", history, err)
		}
	})
}

// Every history of up to maxSteps operations over a small alphabet, shortest
// first, so that the first failure reported is a shortest counterexample.
// Every proper prefix of a history was checked as a history of its own, so
// only the last step and the drain are compared again. A plain loop: the
// 111,110 histories take about 3.5 s with -race on two cores.
func TestModelExhaustive(t *testing.T) {
	maxSteps := 5
	if testing.Short() {
		maxSteps = 3
	}
	alphabet := []step{
		{opPlace, 24}, {opPlaceFailed, 0}, {opBadInput, 0}, {opBrokerDown, 0}, {opBrokerUp, 0},
		{opFailNth, 0}, {opFailNth, 1}, {opLoseAck, 0}, {opRelayPass, 0}, {opRelayReboot, 0},
	}
	checked := 0
	for length, count := 1, len(alphabet); length <= maxSteps; length, count = length+1, count*len(alphabet) {
		history := make(history, length)
		for n := range count {
			for i, rest := length-1, n; i >= 0; i, rest = i-1, rest/len(alphabet) { // n in base len(alphabet), a digit a step
				history[i] = alphabet[rest%len(alphabet)]
			}
			if err := runHistory(history, length-1); err != nil {
				t.Fatalf("after %d shorter histories, this one fails: %v\n%v", checked, history, err)
			}
		}
		checked += count
	}
	t.Logf("checked %d histories of up to %d operations", checked, maxSteps)
}

// Operations of the model. A step is an operation and its argument;
// FuzzModel reads them from pairs of bytes.
const (
	opPlace       = iota // an order of arg+1 cents through OrderService
	opPlaceFailed        // the same two writes in a transaction that fails
	opBadInput           // a total of -arg (0 or less) through both services
	opBrokerDown
	opBrokerUp
	opFailNth     // the (arg%4+1)th publish from now is refused
	opLoseAck     // the next acknowledgement is lost
	opRelayPass   // one PublishPending
	opRelayReboot // a new OutboxRelay over the same database and broker
	opCount
)

type step struct{ op, arg byte }

func (s step) String() string {
	switch s.op {
	case opPlace:
		return fmt.Sprintf("place %d", int(s.arg)+1)
	case opPlaceFailed:
		return "failed transaction"
	case opBadInput:
		return fmt.Sprintf("place %d, through both services", -int(s.arg))
	case opFailNth:
		return fmt.Sprintf("refuse publish #%d from now", s.arg%4+1)
	}
	return [...]string{opBrokerDown: "broker down", opBrokerUp: "broker up", opLoseAck: "lose next ack",
		opRelayPass: "relay pass", opRelayReboot: "relay restart"}[s.op]
}

// history is a list of steps, printed as "place 25, relay pass, ...".
type history []step

func (h history) String() string {
	names := make([]string, len(h))
	for i, s := range h {
		names[i] = s.String()
	}
	return strings.Join(names, ", ")
}

// model is the reference: what a correct library must have done, kept in
// the plainest way.
type model struct {
	orders  []outbox.Order
	rows    []outbox.OutboxMessage
	sent    int              // rows 1..sent are sent: always a prefix
	log     []outbox.Message // what the broker received, duplicates included
	down    bool
	calls   int // Publish calls that reached the fault brokers
	failAt  int // the call that failOnNth refuses; 0 for none
	loseAck bool
}

// pass is the reference relay pass over the broker chain of the harness:
// failOnNth, then lostAck, then InMemoryBroker.
func (m *model) pass() (published int, err error) {
	for ; m.sent < len(m.rows); m.sent++ {
		m.calls++
		if m.calls == m.failAt || m.down {
			return published, outbox.ErrBrokerUnavailable
		}
		m.log = append(m.log, m.rows[m.sent].Message)
		if m.loseAck {
			m.loseAck = false
			return published, errAckLost
		}
		m.rows[m.sent].Sent = true
		published++
	}
	return published, nil
}

type harness struct {
	m      model
	db     *outbox.Database
	broker *outbox.InMemoryBroker
	lost   *lostAck
	fail   *failOnNth
	relay  *outbox.OutboxRelay
}

// runHistory runs history on a new library and a new model, compares them
// after every step from step checkFrom+1 on, then drains (broker up, no
// faults, one more pass), compares them again and checks that nothing stays
// unsent. It returns the first difference.
func runHistory(history history, checkFrom int) error {
	h := &harness{db: new(outbox.Database), broker: new(outbox.InMemoryBroker)}
	h.lost = &lostAck{next: h.broker}
	h.fail = &failOnNth{next: h.lost}
	h.relay = outbox.NewOutboxRelay(h.db, h.fail)
	for i, s := range history {
		if err := h.do(s, i >= checkFrom); err != nil {
			return fmt.Errorf("step %d, %v: %w", i+1, s, err)
		}
	}
	h.m.down, h.m.failAt, h.m.loseAck = false, 0, false
	h.broker.SetDown(false)
	h.fail.n, h.lost.lose = 0, false
	if err := h.do(step{op: opRelayPass}, true); err != nil {
		return fmt.Errorf("final drain: %w", err)
	}
	if pending := h.db.Pending(); len(pending) != 0 {
		return fmt.Errorf("after the final drain Pending still returns %v", pending)
	}
	return nil
}

// do runs one step on the library and on the model. It compares every result
// as it goes, and if compare is set, the tables and the broker's log after it.
func (h *harness) do(s step, compare bool) error {
	m := &h.m
	switch s.op {
	case opPlace:
		total := int64(s.arg) + 1
		id, err := outbox.NewOrderService(h.db).PlaceOrder(total)
		want := int64(len(m.orders)) + 1
		m.orders = append(m.orders, outbox.Order{ID: want, TotalCents: total})
		m.rows = append(m.rows, outbox.OutboxMessage{Message: orderPlaced(want, total)})
		if id != want || err != nil {
			return fmt.Errorf("PlaceOrder(%d) = %d, %v; want %d, nil", total, id, err, want)
		}
	case opPlaceFailed:
		if err := rollBack(h.db, int64(s.arg)+1); err != errRolledBack {
			return fmt.Errorf("failed transaction returned %v", err)
		}
	case opBadInput:
		if _, err := outbox.NewOrderService(h.db).PlaceOrder(-int64(s.arg)); !errors.Is(err, outbox.ErrInvalidTotal) {
			return fmt.Errorf("OrderService.PlaceOrder(%d): %v, want ErrInvalidTotal", -int64(s.arg), err)
		}
		if _, err := outbox.NewDirectOrderService(h.db, h.fail).PlaceOrder(-int64(s.arg)); !errors.Is(err, outbox.ErrInvalidTotal) {
			return fmt.Errorf("DirectOrderService.PlaceOrder(%d): %v, want ErrInvalidTotal", -int64(s.arg), err)
		}
	case opBrokerDown, opBrokerUp:
		m.down = s.op == opBrokerDown
		h.broker.SetDown(m.down)
	case opFailNth:
		m.failAt = m.calls + int(s.arg%4) + 1
		h.fail.n = h.fail.calls + int(s.arg%4) + 1
	case opLoseAck:
		m.loseAck, h.lost.lose = true, true
	case opRelayPass:
		wantN, wantErr := m.pass()
		if n, err := h.relay.PublishPending(); n != wantN || !errors.Is(err, wantErr) {
			return fmt.Errorf("PublishPending = %d, %v; the model says %d, %v", n, err, wantN, wantErr)
		}
	case opRelayReboot:
		h.relay = outbox.NewOutboxRelay(h.db, h.fail)
	}
	if !compare {
		return nil
	}
	if got := h.db.Orders(); !slices.Equal(got, m.orders) {
		return fmt.Errorf("orders table %v, the model has %v", got, m.orders)
	}
	if got := h.db.Outbox(); !slices.Equal(got, m.rows) {
		return fmt.Errorf("outbox table %v, the model has %v", got, m.rows)
	}
	if got := h.broker.Published(); !slices.Equal(got, m.log) {
		return fmt.Errorf("the broker received %v, the model says %v", got, m.log)
	}
	return nil
}

// ---- Helpers ----

// The fault brokers and helpers below are the lesson's tests' own
// (outbox_test.go), copied: test code is not imported across modules.

// failOnNth is a broker that goes down for one call: it refuses its nth
// Publish and passes every other one to next.
type failOnNth struct {
	mu       sync.Mutex
	next     outbox.MessageBroker
	n, calls int // the call to refuse, counting from 1 (0 refuses none); calls so far
}

func (b *failOnNth) Publish(msg outbox.Message) error {
	b.mu.Lock()
	b.calls++
	refuse := b.calls == b.n
	b.mu.Unlock()
	if refuse {
		return fmt.Errorf("refused this once: %w", outbox.ErrBrokerUnavailable)
	}
	return b.next.Publish(msg)
}

// errAckLost is what the producer sees when the broker took a message but
// its acknowledgement never arrived, such as a timeout.
var errAckLost = errors.New("acknowledgement lost")

// lostAck is a broker whose acknowledgement goes missing once: when lose is
// set, the next message that next accepts is delivered, and then Publish
// reports errAckLost.
type lostAck struct {
	mu   sync.Mutex
	next outbox.MessageBroker
	lose bool
}

func (b *lostAck) Publish(msg outbox.Message) error {
	if err := b.next.Publish(msg); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.lose {
		b.lose = false
		return errAckLost
	}
	return nil
}

// insertOrderAndMessage makes the two writes of OrderService.PlaceOrder in
// tx: an order of total cents and its OrderPlaced outbox row.
func insertOrderAndMessage(tx *outbox.Tx, total int64) error {
	order, err := tx.InsertOrder(total)
	if err != nil {
		return err
	}
	_, err = tx.InsertOutbox(outbox.OrderPlaced, order)
	return err
}

// errRolledBack is the error with which rollBack fails its transactions.
var errRolledBack = errors.New("rolled back")

// rollBack makes the two writes of an order of total cents in a transaction
// that then fails with errRolledBack, and returns what Transaction returned.
func rollBack(db *outbox.Database, total int64) error {
	return db.Transaction(func(tx *outbox.Tx) error {
		if err := insertOrderAndMessage(tx, total); err != nil {
			return err
		}
		return errRolledBack
	})
}

// orderPlaced is the message that order id of total cents must produce.
func orderPlaced(id, total int64) outbox.Message {
	return outbox.Message{
		ID:      id,
		Type:    "OrderPlaced",
		Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":%d}`, id, total),
	}
}
