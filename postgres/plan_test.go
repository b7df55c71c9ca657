package postgres_test

import (
	"context"
	"database/sql"
	"fmt"
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
	relay := postgres.NewOutboxRelay(db, discard{})
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
