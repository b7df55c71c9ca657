package postgres_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres"
)

// A relay whose statements were prepared while the outbox was nearly empty
// still finds its rows by index once the table has grown: the server keeps
// one generic plan per prepared statement after five runs, and the mark's,
// made on a table of a page or two, is a sequential scan unless the pass
// turns those off. The test counts the tuples that sequential scans of the
// outbox read (pg_stat_user_tables) while 20 passes of 100 drain a table of
// 4,000 rows: none.
func TestMarkFindsItsRowsByIndexAfterTheTableGrew(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	// Two connections: a pass may flush the server's log on a second one.
	// The pool hands out the connection returned last, so every pass runs on
	// the same one, and its prepared statements are the ones measured.
	db.SetMaxOpenConns(2)
	relay := newRelay(t, db, discard{}, postgres.RelayConfig{PollOnly: true}) // passes alone, on two connections
	insert := func(n int) {
		t.Helper()
		if _, err := db.ExecContext(ctx, `INSERT INTO outbox (type, payload)
			SELECT 'OrderPlaced', '{}' FROM generate_series(1, $1)`, n); err != nil {
			t.Fatal(err)
		}
	}
	pass := func(want int) {
		t.Helper()
		if n, err := relay.PublishPending(ctx); n != want || err != nil {
			t.Fatalf("pass = %d, %v; want %d, <nil>", n, err, want)
		}
	}
	for range 10 { // on a table of a page: the plans the server keeps are made here
		insert(3)
		pass(3)
	}
	insert(4000 - 30)
	pass(100)
	pass(100)
	before := seqTuplesRead(t, db, 230)
	for range 20 {
		pass(100)
	}
	if read := seqTuplesRead(t, db, 2230) - before; read != 0 {
		t.Errorf("sequential scans of the outbox read %d tuples during 20 passes of 100, want 0", read)
	}
}

// seqTuplesRead is how many tuples sequential scans of the outbox have read,
// once the statistics count the marks of updated rows (each backend sends
// its counts a while after its transactions end).
func seqTuplesRead(t *testing.T, db *sql.DB, updated int64) int64 {
	t.Helper()
	var n int64
	query := fmt.Sprintf(`SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = 'outbox' AND n_tup_upd >= %d`, updated)
	n = waitForQuery(t, db, query)
	return n
}

// A relay's claim has no parameters (its batch size and limits are written
// into its text), so that the server plans it once per connection and
// keeps that plan: with parameters it planned each of a connection's first
// five claims afresh, and went on doing so for claimRuns while the outbox
// grew. The test runs 20 passes of each claim, with rows written between
// them, and reads the pool's two connections' prepared statements
// (pg_prepared_statements): the claim's runs all on its one plan.
func TestClaimIsPlannedOncePerConnection(t *testing.T) {
	ctx := context.Background()
	for _, perAggregate := range []bool{false, true} {
		t.Run(fmt.Sprintf("PerAggregate=%v", perAggregate), func(t *testing.T) {
			db := newDatabase(t)
			db.SetMaxOpenConns(2) // a pass may flush the server's log on a second one
			relay := newRelay(t, db, discard{}, postgres.RelayConfig{WholeTable: !perAggregate, PollOnly: true})
			for i := range 20 {
				insertRun(t, db, "hot", 10*i+1, 10)
				if n, err := relay.PublishPending(ctx); n != 10 || err != nil {
					t.Fatalf("pass %d = %d, %v; want 10, <nil>", i+1, n, err)
				}
			}
			var generic, custom int
			for range 2 { // both connections, held at once
				conn, err := db.Conn(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close()
				var g, c int
				if err := conn.QueryRowContext(ctx, `SELECT COALESCE(sum(generic_plans), 0), COALESCE(sum(custom_plans), 0)
					FROM pg_prepared_statements
					WHERE statement LIKE '%SKIP LOCKED%' AND statement NOT LIKE '%pg_prepared_statements%'`).Scan(&g, &c); err != nil {
					t.Fatal(err)
				}
				generic, custom = generic+g, custom+c
			}
			if custom != 0 || generic != 20 {
				t.Errorf("the claim ran %d times on a plan of its own and %d on a kept plan, want 0 and 20", custom, generic)
			}
		})
	}
}

// The log relay's mark finds the rows it is given by their ids. Its check
// that a row is still unsent once matched the partial indexes of unsent
// rows, and a plan made while the statistics said that next to no row is
// unsent (the usual state of an outbox whose relay keeps up) read one of
// them whole for each mark: before a vacuum it holds an entry for every row
// written since the last, sent or not, so that a mark grew slower as the
// table did. The test takes the statistics of 2,000 rows all sent, writes
// 20,000 unsent, marks 1,000 of them in ten marks of 100 on one connection,
// on the generic plan (which the server chose for the marks under make
// measure-relays' load, and is made to choose here), and counts the entries
// any index but the primary key gave (pg_stat_user_indexes): none, where
// the check as it was read 196,400.
func TestLogMarkFindsItsRowsByID(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	db.SetMaxOpenConns(1)
	for _, q := range []string{
		`INSERT INTO outbox (type, payload, sent_at) SELECT 'OrderPlaced', '{}', now() FROM generate_series(1, 2000)`,
		`ANALYZE outbox`,
		`INSERT INTO outbox (type, payload) SELECT 'OrderPlaced', '{}' FROM generate_series(1, 20000)`,
		`SET plan_cache_mode = force_generic_plan`,
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	for i := range int64(10) {
		ids := make([]int64, 100)
		for j := range ids {
			ids[j] = 2001 + 100*i + int64(j)
		}
		var marked int
		var unseen, keys string
		if err := db.QueryRowContext(ctx, `SELECT string_agg(message_key::text, ',' ORDER BY id) FROM outbox WHERE id = ANY($1)`, ids).Scan(&keys); err != nil {
			t.Fatal(err)
		}
		if err := db.QueryRowContext(ctx, postgres.LogMarkQuery, ids, strings.Split(keys, ",")).Scan(&marked, &unseen, new(string)); err != nil || marked != 100 || unseen != "" {
			t.Fatalf("mark %d = %d, %q, %v; want 100, \"\", <nil>", i+1, marked, unseen, err)
		}
	}
	// Read once the statistics hold the marks' 1,000 lookups of the primary
	// key (each backend sends its counts a while after its transactions end).
	read := waitForQuery(t, db, `SELECT sum(idx_tup_read) FILTER (WHERE indexrelname <> 'outbox_pkey')
		FROM pg_stat_user_indexes WHERE relname = 'outbox'
		HAVING sum(idx_scan) FILTER (WHERE indexrelname = 'outbox_pkey') >= 1000`)
	if read != 0 {
		t.Errorf("ten marks of 100 rows read %d entries of the outbox's other indexes, want 0", read)
	}
}
