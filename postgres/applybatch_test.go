package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres"
)

// TestApplyBatchCommitsOnceAndDropsDuplicates runs ApplyBatch on both
// drivers: a batch applies in one transaction (its rows share one xmin),
// each aggregate in the order of its Seq whatever the delivery order,
// copies dropped (within the batch and after it); a batch with one message
// that cannot apply now writes nothing at all, and says which message.
func TestApplyBatchCommitsOnceAndDropsDuplicates(t *testing.T) {
	t.Run("pgx", func(t *testing.T) {
		name := newBlankDatabase(t)
		ob, err := postgres.Open(newPool(t, name, 4), postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		applyBatch(t, ob, open(t, name, ""), func(ctx context.Context, tx postgres.PgxTx, key string) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, key)
			return err
		})
	})
	t.Run("database/sql", func(t *testing.T) {
		name := newBlankDatabase(t)
		db := open(t, name, "")
		ob, err := postgres.OpenDB(db, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		applyBatch(t, ob, db, func(ctx context.Context, tx postgres.SQLTx, key string) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO effects (key) VALUES ($1)`, key)
			return err
		})
	})
}

func applyBatch[T any](t *testing.T, ob *postgres.Outbox[T], check *sql.DB, effect func(context.Context, T, string) error) {
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := check.Exec(`CREATE TABLE effects (n bigserial, key text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	msg := func(key, aggregate string, seq int64) postgres.Message {
		return postgres.Message{Type: "Moved", Payload: "{}", Key: key, Aggregate: aggregate, Seq: seq}
	}
	var refuse string    // apply fails for this key, as a malformed payload would
	var calls [][]string // the keys apply was given, call by call
	apply := func(ctx context.Context, tx T, msgs []postgres.Message) error {
		var keys []string
		for _, m := range msgs {
			keys = append(keys, m.Key)
		}
		calls = append(calls, keys)
		for _, m := range msgs {
			if m.Key == refuse {
				return fmt.Errorf("message %s: decode: %w", m.Key, postgres.ErrMalformedMessage)
			}
			if err := effect(ctx, tx, m.Key); err != nil {
				return err
			}
		}
		return nil
	}
	effects := func() []string {
		t.Helper()
		rows, err := check.Query(`SELECT key FROM effects ORDER BY n`)
		if err != nil {
			t.Fatal(err)
		}
		keys, err := scanStrings(rows)
		if err != nil {
			t.Fatal(err)
		}
		return keys
	}
	state := func() string {
		return fmt.Sprint(effects(), count(t, check, `SELECT count(*) FROM processed_messages`),
			count(t, check, `SELECT coalesce(sum(seq), 0) FROM aggregate_positions`))
	}

	// a-2 arrives before a-1, and b-1 twice: a-1 applies first, b-1 once.
	batch := []postgres.Message{msg("a-2", "a", 2), msg("b-1", "b", 1), msg("a-1", "a", 1), msg("b-1", "b", 1), msg("c", "", 0)}
	applied, err := ob.ApplyBatch(ctx, batch, nil, apply)
	if err != nil {
		t.Fatal(err)
	}
	if want := []bool{true, true, true, false, true}; !slices.Equal(applied, want) {
		t.Fatalf("applied = %v, want %v", applied, want)
	}
	if got, want := effects(), []string{"c", "a-1", "a-2", "b-1"}; !slices.Equal(got, want) {
		t.Fatalf("effects in the order %v, want %v (each aggregate by its Seq)", got, want)
	}
	if n := count(t, check, `SELECT count(DISTINCT xmin::text) FROM effects`); n != 1 {
		t.Fatalf("the batch's effects were written by %d transactions, want 1", n)
	}
	if want := [][]string{{"c", "a-1", "a-2", "b-1"}}; fmt.Sprint(calls) != fmt.Sprint(want) {
		t.Fatalf("apply was called with %v, want once, with %v (the copy of b-1 left out)", calls, want)
	}

	// Delivered again, every message is a duplicate, apply is not called,
	// and nothing changes.
	before, calls := state(), nil
	applied, err = ob.ApplyBatch(ctx, batch, nil, apply)
	if err != nil || slices.Contains(applied, true) || len(applied) != len(batch) {
		t.Fatalf("the batch again: applied %v, %v; want all false", applied, err)
	}
	if calls != nil {
		t.Fatalf("the batch again: apply called with %v, want not at all", calls)
	}
	if after := state(); after != before {
		t.Fatalf("the batch again changed %s into %s", before, after)
	}

	// One message that cannot apply now, or ever, and the batch writes
	// nothing: the error names the message.
	for _, tc := range []struct {
		name   string
		batch  []postgres.Message
		refuse string
		want   error
		key    string
	}{
		{"out of order", []postgres.Message{msg("d", "", 0), msg("a-4", "a", 4)}, "", postgres.ErrOutOfOrder, "a-4"},
		{"malformed", []postgres.Message{msg("e", "", 0), msg("b-2", "b", 2)}, "b-2", postgres.ErrMalformedMessage, "b-2"},
		{"seq below 1", []postgres.Message{msg("f", "", 0), msg("g-0", "g", 0)}, "", postgres.ErrMalformedMessage, "g-0"},
		{"no key", []postgres.Message{msg("h", "", 0), msg("", "", 0)}, "", postgres.ErrNoMessageKey, "2 of 2"},
	} {
		refuse = tc.refuse
		applied, err := ob.ApplyBatch(ctx, tc.batch, nil, apply)
		if !errors.Is(err, tc.want) || applied != nil || err == nil || !strings.Contains(err.Error(), tc.key) {
			t.Errorf("%s: applied %v, %v; want nil and an error wrapping %v naming %q", tc.name, applied, err, tc.want, tc.key)
		}
		if after := state(); after != before {
			t.Errorf("%s: the refused batch changed %s into %s", tc.name, before, after)
		}
	}
	refuse = ""

	// Last closes the aggregate, as ApplyOnce's does.
	applied, err = ob.ApplyBatch(ctx, []postgres.Message{msg("a-3", "a", 3)},
		func(m postgres.Message) postgres.ApplyOptions { return postgres.ApplyOptions{Last: m.Key == "a-3"} }, apply)
	if err != nil || !slices.Equal(applied, []bool{true}) {
		t.Fatalf("a-3: applied %v, %v", applied, err)
	}
	if n := count(t, check, `SELECT count(*) FROM aggregate_positions WHERE closed`); n != 1 {
		t.Fatalf("%d closed positions after a-3 was applied as the last, want 1", n)
	}
	// A key recorded before, on a message whose aggregate position is
	// behind it, leaves the position where it was, as ApplyOnce does: alone
	// a duplicate, with its successor in the batch out of order.
	if applied, err := ob.ApplyBatch(ctx, []postgres.Message{msg("x", "", 0)}, nil, apply); err != nil || !applied[0] {
		t.Fatalf("x: %v, %v", applied, err)
	}
	if _, err := ob.ApplyBatch(ctx, []postgres.Message{msg("x", "z", 1), msg("z-2", "z", 2)}, nil, apply); !errors.Is(err, postgres.ErrOutOfOrder) || !strings.Contains(err.Error(), "z-2") {
		t.Fatalf("z-2 behind a copy whose key was recorded: %v, want ErrOutOfOrder naming z-2", err)
	}
	applied, err = ob.ApplyBatch(ctx, []postgres.Message{msg("x", "z", 1)}, nil, apply)
	if err != nil || applied[0] || count(t, check, `SELECT coalesce(max(seq), -1) FROM aggregate_positions WHERE aggregate = 'z'`) != 0 {
		t.Fatalf("x of z alone: %v, %v; want a duplicate, z's position left at 0", applied, err)
	}

	if applied, err := ob.ApplyBatch(ctx, nil, nil, apply); applied != nil || err != nil {
		t.Fatalf("an empty batch: %v, %v; want nothing", applied, err)
	}
	if _, err := ob.ApplyBatch(ctx, batch, nil, nil); err == nil {
		t.Fatal("ApplyBatch with no apply function: no error")
	}
}

// TestApplyBatchWritesAPositionItStartsOnce: an aggregate whose first
// message is in the batch gets its position row inserted once, with the
// Seq the batch takes it to, not inserted, locked and moved (three writes);
// one seen before is locked and moved. The counts are the batch's own
// transaction's, read in apply (pg_stat_xact_user_tables), each batch on
// a connection of its own, since a session's counts not yet reported add
// up. A key recorded before stops an aggregate the batch starts where its
// message is, as it does one seen before. (Before, every position was
// made at 0 and then moved: "1 inserted, 1 updated" for c.)
func TestApplyBatchWritesAPositionItStartsOnce(t *testing.T) {
	name := newBlankDatabase(t)
	db := open(t, name, "")
	fresh := open(t, name, "")
	fresh.SetMaxIdleConns(0) // a connection for each batch
	ob, err := postgres.OpenDB(fresh, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	msg := func(key, aggregate string, seq int64) postgres.Message {
		return postgres.Message{Type: "Moved", Payload: "{}", Key: key, Aggregate: aggregate, Seq: seq}
	}
	var written string // the batch's inserts and updates of positions, as apply saw them
	apply := func(ctx context.Context, tx postgres.SQLTx, msgs []postgres.Message) error {
		var ins, upd int64
		err := tx.QueryRowContext(ctx, `SELECT coalesce(sum(n_tup_ins), 0), coalesce(sum(n_tup_upd), 0)
			FROM pg_stat_xact_user_tables WHERE relname = 'aggregate_positions'`).Scan(&ins, &upd)
		written = fmt.Sprintf("%d inserted, %d updated", ins, upd)
		return err
	}
	positions := func() string {
		t.Helper()
		rows, err := db.Query(`SELECT aggregate || '=' || seq || CASE WHEN closed THEN ' closed' ELSE '' END
			FROM aggregate_positions ORDER BY aggregate`)
		if err != nil {
			t.Fatal(err)
		}
		got, err := scanStrings(rows)
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(got, ", ")
	}
	last := func(m postgres.Message) postgres.ApplyOptions { return postgres.ApplyOptions{Last: m.Key == "b-1"} }

	if _, err := ob.ApplyBatch(ctx, []postgres.Message{msg("c-1", "c", 1), msg("c-2", "c", 2)}, nil, apply); err != nil {
		t.Fatal(err)
	}
	if want := "1 inserted, 0 updated"; written != want {
		t.Fatalf("a batch starting c wrote its position %s, want %s", written, want)
	}
	// a starts, with two messages, b starts and ends, c goes on.
	applied, err := ob.ApplyBatch(ctx, []postgres.Message{msg("a-2", "a", 2), msg("c-3", "c", 3), msg("b-1", "b", 1), msg("a-1", "a", 1)}, last, apply)
	if err != nil || !slices.Equal(applied, []bool{true, true, true, true}) {
		t.Fatalf("applied %v, %v; want all", applied, err)
	}
	if want := "2 inserted, 1 updated"; written != want {
		t.Errorf("positions %s, want %s: a and b each inserted once, c moved", written, want)
	}
	if got, want := positions(), "a=2, b=1 closed, c=3"; got != want {
		t.Errorf("positions %s, want %s", got, want)
	}

	// d-1's key was recorded before, for a message of no aggregate: d stops
	// at 0, and e-2 behind the copy whose key was recorded is refused.
	if _, err := ob.ApplyBatch(ctx, []postgres.Message{msg("k", "", 0)}, nil, apply); err != nil {
		t.Fatal(err)
	}
	applied, err = ob.ApplyBatch(ctx, []postgres.Message{msg("e-1", "e", 1), msg("k", "d", 1)}, nil, apply)
	if err != nil || !slices.Equal(applied, []bool{true, false}) {
		t.Fatalf("e-1 and a recorded key starting d: applied %v, %v; want e-1 alone", applied, err)
	}
	if got, want := positions(), "a=2, b=1 closed, c=3, d=0, e=1"; got != want {
		t.Errorf("positions %s, want %s: d left at 0", got, want)
	}
	if _, err := ob.ApplyBatch(ctx, []postgres.Message{msg("f-1", "f", 1), msg("k", "f", 2), msg("f-3", "f", 3)}, nil, apply); !errors.Is(err, postgres.ErrOutOfOrder) || !strings.Contains(err.Error(), "f-3") {
		t.Fatalf("f-3 behind a copy whose key was recorded: %v, want ErrOutOfOrder naming f-3", err)
	}
	applied, err = ob.ApplyBatch(ctx, []postgres.Message{msg("f-1", "f", 1), msg("k", "f", 2)}, nil, apply)
	if err != nil || !slices.Equal(applied, []bool{true, false}) {
		t.Fatalf("f-1 and a recorded key: applied %v, %v; want f-1 alone", applied, err)
	}
	if got, want := positions(), "a=2, b=1 closed, c=3, d=0, e=1, f=1"; got != want {
		t.Errorf("positions %s, want %s: f stopped at f-1", got, want)
	}
}

// Two consumers apply the same messages of ten aggregates at once, one in
// the order of the aggregates and one in reverse, twenty rounds: neither
// fails (a deadlock would be an error) and each message applies once.
// (Caught: positions locked in delivery order: "deadlock detected" in
// one of the rounds.)
func TestApplyBatchesThatShareAggregatesDoNotDeadlock(t *testing.T) {
	name := newBlankDatabase(t)
	db := open(t, name, "")
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	applied := map[string]int{}
	apply := func(ctx context.Context, tx postgres.SQLTx, msgs []postgres.Message) error {
		// Hold the locks a while, as a real effect does.
		_, err := tx.ExecContext(ctx, `SELECT pg_sleep(0.01)`)
		return err
	}
	for round := int64(1); round <= 20; round++ {
		var batch []postgres.Message
		for a := range 10 {
			batch = append(batch, postgres.Message{Type: "Moved", Payload: "{}", Key: fmt.Sprintf("%d-%d", a, round),
				Aggregate: fmt.Sprintf("agg-%d", a), Seq: round})
		}
		reversed := slices.Clone(batch)
		slices.Reverse(reversed)
		var wg sync.WaitGroup
		for _, b := range [][]postgres.Message{batch, reversed} {
			wg.Go(func() {
				got, err := ob.ApplyBatch(ctx, b, nil, apply)
				if err != nil {
					t.Errorf("round %d: %v", round, err)
					return
				}
				mu.Lock()
				defer mu.Unlock()
				for i, ok := range got {
					if ok {
						applied[b[i].Key]++
					}
				}
			})
		}
		wg.Wait()
	}
	if len(applied) != 200 {
		t.Errorf("%d messages applied, want 200", len(applied))
	}
	for k, n := range applied {
		if n != 1 {
			t.Errorf("%s applied %d times", k, n)
		}
	}
}

func scanStrings(rows *sql.Rows) ([]string, error) {
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}
