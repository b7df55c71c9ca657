// Package shoptest has what the tests of the shop's brokers share.
package shoptest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// Ordered is a handler that hands each delivery to a warehouse and checks
// what the warehouse applied: each aggregate's seqs in order from 1, and no
// key twice. It is safe for concurrent use. Create one with [NewOrdered].
type Ordered struct {
	warehouse *shop.Warehouse
	applied   atomic.Int64
	mu        sync.Mutex
	last      map[string]int64
	seen      map[string]bool // applied, as far as Ordered learned
	late      map[string]bool // of seen, learned from a copy: true until its own delivery returns
	wrong     []string
}

// NewOrdered returns an Ordered that hands deliveries to w.
func NewOrdered(w *shop.Warehouse) *Ordered {
	return &Ordered{warehouse: w, last: map[string]int64{}, seen: map[string]bool{}, late: map[string]bool{}}
}

// Handle hands msg to the warehouse and, if it applied msg, checks that
// msg's key was not applied before and that msg comes next in its
// aggregate.
//
// A copy the warehouse drops, of a key Ordered never saw applied, counts as
// applied then, late: the delivery that applied it heard an error after its
// commit (a consumer stopped mid-commit, the outcome unknown to it), and the
// copy is the first Ordered learns of it. If that delivery's own return
// comes after the copy's, it is not counted again. Late counts them.
func (o *Ordered) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	applied, err := o.warehouse.Handle(ctx, msg)
	if !applied && err != nil {
		return applied, err
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case !applied && o.seen[msg.Key]: // a copy of what was applied
		return applied, err
	case !applied:
		o.late[msg.Key] = true
	case o.late[msg.Key]: // counted when its copy came; once only
		o.late[msg.Key] = false
		return applied, err
	case o.seen[msg.Key]:
		o.wrong = append(o.wrong, fmt.Sprintf("%s applied twice", msg.Key))
	}
	o.applied.Add(1)
	o.seen[msg.Key] = true
	if msg.Seq != o.last[msg.Aggregate]+1 {
		o.wrong = append(o.wrong, fmt.Sprintf("%s seq %d applied after seq %d", msg.Aggregate, msg.Seq, o.last[msg.Aggregate]))
	}
	o.last[msg.Aggregate] = msg.Seq
	return applied, err
}

// Applied is how many messages the warehouse applied, as far as Ordered
// learned.
func (o *Ordered) Applied() int64 { return o.applied.Load() }

// Late is how many of Applied Ordered learned of only from a copy.
func (o *Ordered) Late() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.late)
}

// Wrong lists what was applied out of order or twice, in the order found.
func (o *Ordered) Wrong() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.wrong...)
}
