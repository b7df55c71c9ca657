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
	seen      map[string]bool
	wrong     []string
}

// NewOrdered returns an Ordered that hands deliveries to w.
func NewOrdered(w *shop.Warehouse) *Ordered {
	return &Ordered{warehouse: w, last: map[string]int64{}, seen: map[string]bool{}}
}

// Handle hands msg to the warehouse and, if it applied msg, checks that
// msg's key was not applied before and that msg comes next in its
// aggregate.
func (o *Ordered) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	applied, err := o.warehouse.Handle(ctx, msg)
	if !applied {
		return applied, err
	}
	o.applied.Add(1)
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.seen[msg.Key] {
		o.wrong = append(o.wrong, fmt.Sprintf("%s applied twice", msg.Key))
	}
	o.seen[msg.Key] = true
	if msg.Seq != o.last[msg.Aggregate]+1 {
		o.wrong = append(o.wrong, fmt.Sprintf("%s seq %d applied after seq %d", msg.Aggregate, msg.Seq, o.last[msg.Aggregate]))
	}
	o.last[msg.Aggregate] = msg.Seq
	return applied, err
}

// Applied is how many messages the warehouse applied.
func (o *Ordered) Applied() int64 { return o.applied.Load() }

// Wrong lists what was applied out of order or twice, in the order found.
func (o *Ordered) Wrong() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.wrong...)
}
