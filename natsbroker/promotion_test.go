package natsbroker_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// A consumer whose database is promoted under it keeps applying, with no
// restart: the warehouse's pool names the primary and its synchronous
// standby with target_session_attrs=read-write; 400 OrderPlaced events go
// to JetStream, the primary is killed after 100 are applied and the
// standby promoted. The applies that failed meanwhile are delivered again
// and applied on the new primary: every order reserved once, each event's
// key recorded once. (An asynchronous standby's tail, an apply that was
// acknowledged and lost with it, is not applied again: see the README.)
func TestConsumerKeepsApplyingThroughAPromotion(t *testing.T) {
	ctx := context.Background()
	primary, err := pgtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { primary.Remove() })
	conn := func(hosts ...string) *pgx.ConnConfig {
		cfg, err := pgx.ParseConfig(fmt.Sprintf("host=%s user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write connect_timeout=2",
			strings.Join(hosts, ",")))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	admin := stdlib.OpenDB(*conn(primary.Dir))
	ob, err := postgres.OpenDB(admin, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.MigrateConsumer(ctx); err != nil {
		t.Fatal(err)
	}
	if err := shop.Migrate(ctx, admin); err != nil {
		t.Fatal(err)
	}
	standby, err := primary.StartStandby("standby")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Remove() })
	for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = 'standby'`, `SELECT pg_reload_conf()`} {
		if _, err := admin.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the standby streaming, synchronous", func() bool {
		var state string
		return admin.QueryRow(`SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby'`).Scan(&state) == nil && state == "sync"
	})
	admin.Close()

	b := startBroker(t, nil)
	nc := connect(t, b.url())
	setUp(t, nc, 0, 0)
	db := stdlib.OpenDB(*conn(primary.Dir, standby.Dir))
	t.Cleanup(func() { db.Close() })
	var applied atomic.Int64
	stop := runConsumer(t, nc, countApplied{shop.NewWarehouse(db), &applied})
	publisher := newPublisher(t, connect(t, b.url()))
	const orders = 400
	for i := 1; i <= orders; i++ {
		msg := postgres.Message{ID: int64(i), Key: fmt.Sprintf("00000000-0000-4000-8000-%012d", i), Type: shop.OrderPlaced,
			Payload: fmt.Sprintf(`{"orderId":%d,"totalCents":%d}`, i, 100*i), Aggregate: shop.OrderAggregate(int64(i)), Seq: 1}
		if err := publisher.Publish(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "100 applied", func() bool { return applied.Load() >= 100 })
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := standby.Ctl("promote"); err != nil {
		t.Fatal(err)
	}
	newPrimary := stdlib.OpenDB(*conn(standby.Dir))
	t.Cleanup(func() { newPrimary.Close() })
	waitFor(t, "every order reserved on the new primary", func() bool { return count(t, newPrimary, `SELECT count(*) FROM reservations`) == orders })
	if err := stop(); err != nil && err != context.Canceled {
		t.Errorf("the consumer, run through the promotion: %v", err)
	}
	if n := count(t, newPrimary, `SELECT count(*) FROM processed_messages`); n != orders {
		t.Errorf("%d keys recorded on the new primary; want %d, each once", n, orders)
	}
	t.Logf("%d applies reported through the promotion for %d orders", applied.Load(), orders)
}

// countApplied is a Handler that counts what it applied.
type countApplied struct {
	natsbroker.Handler
	n *atomic.Int64
}

func (c countApplied) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	applied, err := c.Handler.Handle(ctx, msg)
	if applied {
		c.n.Add(1)
	}
	return applied, err
}
