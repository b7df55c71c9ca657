package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// The tests of a hot aggregate: many rows of one aggregate waiting, which a
// relay with PerAggregate publishes as runs from the aggregate's first
// unsent row.

// insertRun writes n events of aggregate, seq from first on, in one
// statement, so that their ids are consecutive.
func insertRun(t testing.TB, db *sql.DB, aggregate string, first, n int) {
	t.Helper()
	if _, err := db.ExecContext(context.Background(), `INSERT INTO outbox (type, payload, aggregate, seq)
		SELECT 'Changed', '{}', $1, g FROM generate_series($2::bigint, $2::bigint + $3 - 1) g ORDER BY g`,
		aggregate, first, n); err != nil {
		t.Fatal(err)
	}
}

// A relay with PerAggregate publishes a hot aggregate's backlog a batch a
// pass, in its order: 250 rows of one aggregate go in passes of 100, 100 and
// 50. (Caught: the claim of one row of each aggregate a pass, which
// published 1, 1, 1.)
func TestHotAggregateGoesABatchAPass(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertRun(t, db, "hot", 1, 250)
	broker := &recorder{}
	relay := newRelay(t, db, broker)
	var passes []int
	for range 3 {
		n, err := relay.PublishPending(ctx)
		if err != nil {
			t.Fatal(err)
		}
		passes = append(passes, n)
	}
	if want := []int{100, 100, 50}; !slices.Equal(passes, want) {
		t.Errorf("passes published %v, want %v", passes, want)
	}
	for i, m := range broker.Published() {
		if m.Seq != int64(i+1) {
			t.Fatalf("message %d of the broker has seq %d, want %d", i, m.Seq, i+1)
		}
	}
}

// While one relay's pass holds the first run of a hot aggregate, another
// relay's pass publishes none of that aggregate's later rows, which it could
// claim (nothing locks them) but which would overtake the held ones; it
// publishes the other aggregate's row after them. (Caught: a claim that
// checks only the rows it claimed, which published rows 101 to 150 ahead of
// 1 to 100.)
func TestAnotherRelaysRunHoldsBackTheRestOfItsAggregate(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertRun(t, db, "hot", 1, 150) // ids 1 to 150
	insertRun(t, db, "cold", 1, 1)  // id 151
	held, release := make(chan struct{}), make(chan struct{})
	first := newRelay(t, db, brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 1 {
			close(held)
			<-release
		}
		return nil
	}))
	done := make(chan error, 1)
	go func() { _, err := first.PublishPending(ctx); done <- err }()
	<-held
	broker := &recorder{}
	second := newRelay(t, db, broker, postgres.RelayConfig{BatchSize: 200})
	n, err := second.PublishPending(ctx)
	close(release)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := broker.IDs(); n != 1 || !slices.Equal(got, []int64{151}) {
		t.Errorf("while the first relay held rows 1 to 100, the second published %d: %v, want only 151", n, got)
	}
}

// A message that failed holds back the rest of its aggregate without
// filling later passes' batches: with batches of 3, A1 refused every time,
// A2 to A5 behind it and B1 last, the second pass claims A1 and B1 and
// publishes B1. (Caught: a claim that takes a stuck aggregate's later rows,
// which claimed A1, A2, A3 pass after pass and never reached B1.)
func TestAStuckAggregateLeavesTheBatchToTheOthers(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertRun(t, db, "A", 1, 5) // ids 1 to 5
	insertRun(t, db, "B", 1, 1) // id 6
	accepted := &recorder{}
	var claims []int
	relay := newRelay(t, db, brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 1 {
			return errors.New("cannot take it now")
		}
		return accepted.Publish(ctx, m)
	}), postgres.RelayConfig{BatchSize: 3, NeverPark: true, OnPass: func(r postgres.PassReport) { claims = append(claims, r.Claimed) }})
	for range 2 {
		retryNow(t, db) // A1's backoff passed
		if _, err := relay.PublishPending(ctx); err == nil {
			t.Fatal("a pass whose broker refused A1 returned no error")
		}
	}
	if got := accepted.IDs(); !slices.Equal(got, []int64{6}) {
		t.Errorf("after two passes the broker accepted %v, want [6] (B1); passes claimed %v", got, claims)
	}
	if !slices.Equal(claims, []int{3, 2}) {
		t.Errorf("passes claimed %v rows, want [3 2]: A1 to A3, then A1 and B1", claims)
	}
}

// flaky is a broker that refuses each message it is given with a
// probability, with an error that holds back only its aggregate, and keeps,
// per aggregate, the seqs of every message it stored, copies too: what a
// consumer of the aggregate would see.
type flaky struct {
	mu     sync.Mutex
	random *rand.Rand
	refuse float64
	stored map[string][]int64
}

func newFlaky(seed uint64, refuse float64) *flaky {
	return &flaky{random: rand.New(rand.NewPCG(seed, seed)), refuse: refuse, stored: map[string][]int64{}}
}

// take stores m unless the broker refuses it, and says which.
func (f *flaky) take(m postgres.Message) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.random.Float64() < f.refuse {
		return fmt.Errorf("message %d: refused this time", m.ID)
	}
	f.stored[m.Aggregate] = append(f.stored[m.Aggregate], m.Seq)
	return nil
}

func (f *flaky) Publish(_ context.Context, m postgres.Message) error { return f.take(m) }

// flakyBatch is flaky as a BatchPublisher: it stores the messages after one
// it refused too, as an asynchronous publish may.
type flakyBatch struct{ *flaky }

func (f flakyBatch) PublishBatch(_ context.Context, msgs []postgres.Message) (int, error) {
	accepted, first := len(msgs), error(nil)
	for i, m := range msgs {
		if err := f.take(m); err != nil && first == nil {
			accepted, first = i, err
		}
	}
	return accepted, first
}

// flakySequence is flaky as a SequencePublisher: it stores nothing after a
// message it refused.
type flakySequence struct{ *flaky }

func (f flakySequence) PublishSequence(_ context.Context, msgs []postgres.Message) (int, error) {
	for i, m := range msgs {
		if err := f.take(m); err != nil {
			return i, err
		}
	}
	return len(msgs), nil
}

// Four relays with PerAggregate, in batches of 5, drain three hot
// aggregates (60 rows each, and 40 more each written while they run) and 60
// aggregates of one row, interleaved, through a broker that refuses a fifth
// of what it is given; each aggregate reaches the broker in its order, every
// row once at least: the seqs a consumer sees, copies dropped, are 1, 2, 3…
// with no gap. Through a plain broker, a BatchPublisher that stores messages
// after one it refused, and a SequencePublisher; and the relays on pgx
// pools. (Caught: a pass that
// publishes the rest of a run after one of its rows was refused, which
// stored seq 7 before seq 6; a claim that does not check its runs start at
// the aggregate's first unsent row, which stored a run of another relay's
// ahead of the one before it.)
func TestRelaysKeepEachHotAggregatesOrder(t *testing.T) {
	for _, tc := range []struct{ kind, pool string }{
		{"publish", "sql"}, {"batch", "sql"}, {"sequence", "sql"}, {"batch", "pgx"},
	} {
		kind := tc.kind
		t.Run("broker="+kind+"/pool="+tc.pool, func(t *testing.T) {
			const seed = 38
			t.Logf("seed %d", seed)
			ctx := context.Background()
			name := newDatabaseName(t)
			db := open(t, name, "")
			random := rand.New(rand.NewPCG(seed, 1))
			left := map[string]int{"hot/1": 60, "hot/2": 60, "hot/3": 60}
			for i := range 60 {
				left[fmt.Sprintf("cold/%d", i)] = 1
			}
			next := map[string]int{}
			for len(left) > 0 { // one row at a time, of an aggregate picked at random
				keys := make([]string, 0, len(left))
				for k := range left {
					keys = append(keys, k)
				}
				slices.Sort(keys)
				k := keys[random.IntN(len(keys))]
				next[k]++
				insertRun(t, db, k, next[k], 1)
				if left[k]--; left[k] == 0 {
					delete(left, k)
				}
			}
			base := newFlaky(seed, 0.2)
			var broker postgres.MessageBroker = base
			switch kind {
			case "batch":
				broker = flakyBatch{base}
			case "sequence":
				broker = flakySequence{base}
			}
			runCtx, stop := context.WithCancel(ctx)
			var wg sync.WaitGroup
			for range 4 {
				cfg := postgres.RelayConfig{BatchSize: 5, NeverPark: true, PollInterval: 5 * time.Millisecond, MaxBackoff: 10 * time.Millisecond,
					RetryDelay: time.Millisecond, MaxRetryDelay: 10 * time.Millisecond} // a refused row tried again soon: the test is of order, not of waits
				relay := newRelay(t, db, broker, cfg)
				if tc.pool == "pgx" {
					relay = newRelayOn(t, pgxOutbox(t, newPool(t, name, 4)), broker, cfg)
				}
				wg.Go(func() { _ = relay.Run(runCtx) })
			}
			for n := 61; n <= 100; n++ { // the producer goes on while they run
				for _, k := range []string{"hot/1", "hot/2", "hot/3"} {
					insertRun(t, db, k, n, 1)
				}
			}
			waitUntil(t, "every row sent", func() bool {
				var unsent int
				if err := db.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&unsent); err != nil {
					t.Fatal(err)
				}
				return unsent == 0
			})
			stop()
			wg.Wait()
			base.mu.Lock()
			defer base.mu.Unlock()
			copies := 0
			for aggregate, seqs := range base.stored {
				var seen []int64 // as a consumer applies them: copies of what it has dropped
				for _, s := range seqs {
					if s <= int64(len(seen)) {
						copies++
						continue
					}
					seen = append(seen, s)
				}
				for i, s := range seen {
					if s != int64(i+1) {
						t.Fatalf("aggregate %s reached the broker as %v: seq %d where %d was due", aggregate, seqs, s, i+1)
					}
				}
				want := map[bool]int{true: 100, false: 1}[len(aggregate) > 3 && aggregate[:3] == "hot"]
				if len(seen) != want {
					t.Errorf("aggregate %s: %d of its %d rows reached the broker", aggregate, len(seen), want)
				}
			}
			if len(base.stored) != 63 {
				t.Errorf("%d aggregates reached the broker, want 63", len(base.stored))
			}
			t.Logf("%d copies stored", copies)
		})
	}
}

// BenchmarkHotAggregate times 50 passes of 100 of a relay (after a first,
// untimed, which connects) over one aggregate's backlog of 1,000 and of
// 100,000 rows, kept at that size by 100 rows more written after each pass
// (untimed), with PerAggregate (order=aggregate) and over the whole table
// (order=table), each on a database of its own, vacuumed and analyzed at
// the start; it reports the time a pass and the messages a second, and, with
// -test.v, logs the plans of the claims over the larger backlog after the
// passes (EXPLAIN ANALYZE, BUFFERS), as REFERENCE.md shows them. make
// measure-hot runs it.
func BenchmarkHotAggregate(b *testing.B) {
	once(b)
	ctx := context.Background()
	for _, backlog := range []int{1000, 100_000} {
		for _, perAggregate := range []bool{false, true} {
			order := map[bool]string{false: "table", true: "aggregate"}[perAggregate]
			b.Run(fmt.Sprintf("backlog=%d/order=%s", backlog, order), func(b *testing.B) {
				db := newDatabase(b)
				insertRun(b, db, "hot", 1, backlog)
				if _, err := db.ExecContext(ctx, `VACUUM ANALYZE outbox`); err != nil {
					b.Fatal(err)
				}
				flushed := 0
				relay := newRelay(b, db, discard{}, postgres.RelayConfig{WholeTable: !perAggregate,
					OnPass: func(r postgres.PassReport) { flushed += b2i(r.Flushed) }})
				const passes = 50 // after one that connects and prepares the statements
				var elapsed time.Duration
				for i := range passes + 1 {
					if i == 1 {
						elapsed, flushed = 0, 0
					}
					start := time.Now()
					if n, err := relay.PublishPending(ctx); n != postgres.DefaultBatchSize || err != nil {
						b.Fatalf("pass = %d, %v", n, err)
					}
					elapsed += time.Since(start)
					insertRun(b, db, "hot", backlog+i*postgres.DefaultBatchSize+1, postgres.DefaultBatchSize) // the backlog stays as it was
				}
				if backlog > 1000 && testing.Verbose() {
					query := map[bool]string{false: postgres.ClaimQuery, true: postgres.ClaimRunsQuery}[perAggregate]
					b.Logf("the claim (order=%s), %d rows of one aggregate waiting, after the passes:\n%s", order, backlog, explain(b, db, query))
				}
				b.ReportMetric(float64(elapsed.Microseconds())/passes, "µs/pass")
				b.ReportMetric(passes*postgres.DefaultBatchSize/elapsed.Seconds(), "msgs/s")
				b.ReportMetric(float64(flushed), "flushed-passes")
			})
		}
	}
}

// explain is the plan of query, run in a transaction that is rolled back.
func explain(b *testing.B, db *sql.DB, query string) string {
	tx, err := db.Begin()
	if err != nil {
		b.Fatal(err)
	}
	defer tx.Rollback()
	rows, err := tx.Query(`EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY ON) ` + query)
	if err != nil {
		b.Fatal(err)
	}
	defer rows.Close()
	var plan string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			b.Fatal(err)
		}
		plan += "    " + line + "\n"
	}
	if err := rows.Err(); err != nil {
		b.Fatal(err)
	}
	return plan
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
