package lessoncheck_test

import (
	"fmt"
	"testing"

	"example.com/patterns/enterprise/outbox"
)

// ---- Benchmarks ----

// What the pattern costs in this package («Плюсы и минусы», measured). make
// bench runs each pair below side by side in ten rounds and compares it with
// benchstat; what should hold on any machine is the claim, not the number.
// Nothing that is measured grows with b.N: a PlaceOrder or Deliver op gets a
// fixture of its own, made with the timer stopped, and a Transaction op rolls
// back, so its tables keep their size. The fake measures nothing of what an
// outbox table costs a real database: postgres/ measures that.

// PlaceOrder on an empty database, where the snapshot copies nothing: the
// outbox's extra row against the direct service's publish to a slice in
// memory. The claim: they cost the same here (benchstat reports ~). The
// direct publish is cheap only because this broker is a slice; a real one is
// a network round trip on the request path, which the outbox takes off it.
func BenchmarkPlaceOrder(b *testing.B) {
	b.Run("write=outbox", func(b *testing.B) {
		loopFresh(b, 1000, func() *outbox.OrderService { return outbox.NewOrderService(new(outbox.Database)) },
			func(shop *outbox.OrderService) error { _, err := shop.PlaceOrder(2500); return err })
	})
	b.Run("write=direct", func(b *testing.B) {
		loopFresh(b, 1000, func() *outbox.DirectOrderService {
			return outbox.NewDirectOrderService(new(outbox.Database), new(outbox.InMemoryBroker))
		}, func(shop *outbox.DirectOrderService) error { _, err := shop.PlaceOrder(2500); return err })
	})
}

// Delivering messages: one relay pass over a fixed batch of pending rows
// (read them, publish each, mark each sent) against Publish alone, per
// message (ns/msg), each into a broker of its own. The claim: a relayed
// message costs a few times a bare publish (between 1.5x and 10x), work that
// the background relay pays, not the customer.
func BenchmarkDeliver(b *testing.B) {
	for _, batch := range []int{1, 100} {
		b.Run(fmt.Sprintf("batch=%d/via=relay", batch), func(b *testing.B) {
			loopFresh(b, 10_000/batch, func() *outbox.OutboxRelay {
				db := new(outbox.Database)
				fill(b, db, batch)
				return outbox.NewOutboxRelay(db, new(outbox.InMemoryBroker))
			}, func(relay *outbox.OutboxRelay) error {
				if n, err := relay.PublishPending(); n != batch || err != nil {
					return fmt.Errorf("published %d, error %v; want %d, nil", n, err, batch)
				}
				return nil
			})
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/msg")
		})
		b.Run(fmt.Sprintf("batch=%d/via=publish", batch), func(b *testing.B) {
			msg := orderPlaced(1, 2500)
			loopFresh(b, 10_000/batch, func() *outbox.InMemoryBroker { return new(outbox.InMemoryBroker) },
				func(broker *outbox.InMemoryBroker) error {
					for range batch {
						if err := broker.Publish(msg); err != nil {
							return err
						}
					}
					return nil
				})
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/msg")
		})
	}
}

// One transaction (an order and its outbox row, rolled back so that the
// size stays put) over tables of 100 and of 10,000 rows each: the snapshot
// copies both tables, so its cost grows with them (more than 10x for 100x
// the rows). That is the price of "rollback is real" in a few lines of Go,
// and the reason not to copy the snapshot trick into anything that holds
// real data. PostgreSQL copies nothing: its write-ahead log is redo-only, and
// a rollback marks the transaction aborted, leaving the row versions it wrote
// for vacuum to remove, so a transaction costs what it writes.
func BenchmarkTransaction(b *testing.B) {
	for _, rows := range []int{100, 10_000} {
		b.Run(fmt.Sprintf("rows=%d", rows), func(b *testing.B) {
			db := new(outbox.Database)
			fill(b, db, rows)
			for b.Loop() {
				if err := rollBack(db, 2500); err != errRolledBack {
					b.Fatalf("Transaction returned %v", err)
				}
			}
		})
	}
}

// loopFresh runs op once per b.Loop iteration, each time on a fixture of its
// own. It makes the fixtures chunk at a time with the timer stopped.
func loopFresh[F any](b *testing.B, chunk int, fixture func() F, op func(F) error) {
	b.Helper()
	var fixtures []F
	for b.Loop() {
		if len(fixtures) == 0 {
			b.StopTimer()
			for range chunk {
				fixtures = append(fixtures, fixture())
			}
			b.StartTimer()
		}
		f := fixtures[len(fixtures)-1]
		fixtures = fixtures[:len(fixtures)-1]
		if err := op(f); err != nil {
			b.Fatal(err)
		}
	}
}

// fill commits n orders with their outbox rows in one transaction.
func fill(tb testing.TB, db *outbox.Database, n int) {
	tb.Helper()
	err := db.Transaction(func(tx *outbox.Tx) error {
		for range n {
			if err := insertOrderAndMessage(tx, 2500); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
}
