package minimum

// What every rung's tests share: a database of a test's own, on the server
// pgtest finds or starts, and a broker that keeps what it is given.

import (
	"context"
	"database/sql"
	"slices"
	"sync"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// newDB is a database of t's own with Schema, dropped when t ends.
func newDB(t *testing.T) *sql.DB {
	t.Helper()
	db := pgtest.Open(t, pgtest.NewBlankDatabase(t), "")
	if _, err := db.Exec(Schema); err != nil {
		t.Fatal(err)
	}
	return db
}

// recorder is a Broker that keeps every message it takes; fail, if not
// nil, says why it refuses one (nil: it takes it).
type recorder struct {
	mu   sync.Mutex
	got  []Message
	fail func(ctx context.Context, m Message) error
}

func (r *recorder) Publish(ctx context.Context, m Message) error {
	if r.fail != nil {
		if err := r.fail(ctx, m); err != nil {
			return err
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, m)
	return nil
}

func (r *recorder) published() []Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// count is the one number q selects.
func count(t *testing.T, db *sql.DB, q string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
