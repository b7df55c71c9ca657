package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// TestReplayPublishesAgainWhatIsKeptAndRefusesTheRest runs on both drivers.
// A1, B1 and A2 sent; a replay of A puts back A1 and A2, which the next pass
// publishes again in their order with their keys; with NewKeys, with keys
// never seen. A time range from the oldest row puts back all three. Refused,
// with nothing put back: no aggregate and no From, a To without a From, a
// From after its To, a From before the oldest row kept, an aggregate with no
// sent row, one whose first event cleanup removed, and more than MaxReplay
// rows. (Caught: a replay that put back part of an aggregate whose first
// events are gone, which handed consumers A2 without A1.)
func TestReplayPublishesAgainWhatIsKeptAndRefusesTheRest(t *testing.T) {
	t.Run("pgx", func(t *testing.T) {
		name := newBlankDatabase(t)
		ob, err := postgres.Open(newPool(t, name, 4), postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		replays(t, ob, open(t, name, ""))
	})
	t.Run("database/sql", func(t *testing.T) {
		db := newDatabase(t)
		ob, err := postgres.OpenDB(db, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		replays(t, ob, db)
	})
}

func replays[T any](t *testing.T, ob *postgres.Outbox[T], db *sql.DB) {
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	insertEvents(t, db, "A", "B", "A") // ids 1 to 3: A1, B1, A2
	broker := &recorder{}
	relay := newRelayOn(t, ob, broker)
	drain := func() []postgres.Message {
		t.Helper()
		before := len(broker.Published())
		for {
			n, err := relay.PublishPending(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if n == 0 {
				return broker.Published()[before:]
			}
		}
	}
	first := drain()
	keys := map[int64]string{}
	for _, m := range first {
		keys[m.ID] = m.Key
	}
	show := func(msgs []postgres.Message) (ids []int64, sameKeys int) {
		for _, m := range msgs {
			ids = append(ids, m.ID)
			if keys[m.ID] == m.Key {
				sameKeys++
			}
		}
		return ids, sameKeys
	}

	n, err := replayedRows(ob.Replay(ctx, postgres.Replay{Aggregate: "A"}))
	if n != 2 || err != nil {
		t.Fatalf("Replay of A = %d, %v; want 2", n, err)
	}
	if ids, same := show(drain()); !slices.Equal(ids, []int64{1, 3}) || same != 2 {
		t.Errorf("after the replay of A the broker got %v, %d with their keys; want [1 3], both", ids, same)
	}
	n, err = replayedRows(ob.Replay(ctx, postgres.Replay{Aggregate: "A", NewKeys: true}))
	if n != 2 || err != nil {
		t.Fatalf("Replay of A with new keys = %d, %v; want 2", n, err)
	}
	if ids, same := show(drain()); !slices.Equal(ids, []int64{1, 3}) || same != 0 {
		t.Errorf("after the replay of A with new keys the broker got %v, %d with their old keys; want [1 3], none", ids, same)
	}
	var oldest time.Time
	if err := db.QueryRow(`SELECT min(created_at) FROM outbox`).Scan(&oldest); err != nil {
		t.Fatal(err)
	}
	if n, err := replayedRows(ob.Replay(ctx, postgres.Replay{From: oldest, To: time.Now().Add(time.Hour)})); n != 3 || err != nil {
		t.Fatalf("Replay from the oldest row = %d, %v; want 3", n, err)
	}
	if ids, _ := show(drain()); !slices.Equal(ids, []int64{1, 2, 3}) {
		t.Errorf("after the replay from the oldest row the broker got %v, want [1 2 3]", ids)
	}

	insertEvents(t, db, "C", "C", "C") // ids 4 to 6: C1 to C3
	drain()
	if _, err := db.Exec(`DELETE FROM outbox WHERE id = 4`); err != nil { // what cleanup does to a sent row
		t.Fatal(err)
	}
	var bulkFrom time.Time
	if err := db.QueryRow(`SELECT clock_timestamp()`).Scan(&bulkFrom); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO outbox (type, payload, sent_at) SELECT 'Bulk', '{}', now() FROM generate_series(1, $1::int)`, postgres.MaxReplay+1); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		r    postgres.Replay
		want error
		says string
	}{
		{postgres.Replay{}, postgres.ErrInvalidReplay, "give an Aggregate or a From"},
		{postgres.Replay{Aggregate: "A", To: time.Now()}, postgres.ErrInvalidReplay, "a To"},
		{postgres.Replay{From: time.Now(), To: time.Now().Add(-time.Hour)}, postgres.ErrInvalidReplay, "is not before To"},
		{postgres.Replay{From: oldest.Add(-time.Hour)}, postgres.ErrNotKept, "the oldest row outbox keeps was written at"},
		{postgres.Replay{Aggregate: "Z"}, postgres.ErrNotKept, "no sent row in it"},
		{postgres.Replay{Aggregate: "C"}, postgres.ErrNotKept, "before seq 2 are gone"},
		{postgres.Replay{From: bulkFrom}, postgres.ErrReplayTooLarge, fmt.Sprintf("%d sent rows", postgres.MaxReplay+1)},
	} {
		n, err := replayedRows(ob.Replay(ctx, c.r))
		if n != 0 || !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("Replay(%v) = %d, %v; want %v saying %q", c.r, n, err, c.want, c.says)
		}
		t.Logf("Replay(%v): %v", c.r, err)
	}
	var unsent int
	if err := db.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&unsent); err != nil {
		t.Fatal(err)
	}
	if unsent != 0 {
		t.Errorf("%d rows unsent after the refused replays, want none put back", unsent)
	}
}

// replayedRows is Replay's result as the rows it put back.
func replayedRows(r postgres.ReplayResult, err error) (int64, error) { return r.Rows, err }

// A replay with the old keys of rows the broker took within its duplicate
// window is refused, naming how many and until when, and writes nothing;
// allowed, it counts them as dropped. Rows sent before the window, or a
// replay with new keys, go as usual.
func TestReplayInsideTheDuplicateWindowIsRefusedUnlessAllowed(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	ob := sqlOutbox(t, db, postgres.Config{})
	for seq := int64(1); seq <= 3; seq++ {
		written(ctx, t, db, "A", seq)
	}
	// A1 was sent an hour ago, A2 and A3 a moment ago.
	if _, err := db.Exec(`UPDATE outbox SET sent_at = CASE seq WHEN 1 THEN now() - interval '1 hour' ELSE now() END`); err != nil {
		t.Fatal(err)
	}
	window := 2 * time.Minute
	r := postgres.Replay{Aggregate: "A", DuplicateWindow: window}
	res, err := ob.Replay(ctx, r)
	if res != (postgres.ReplayResult{}) || !errors.Is(err, postgres.ErrInDuplicateWindow) || !strings.Contains(err.Error(), "2 of its 3 rows") {
		t.Fatalf("Replay inside the window = %+v, %v; want ErrInDuplicateWindow naming 2 of 3", res, err)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 0 {
		t.Fatalf("a refused replay put back %d rows", n)
	}
	r.AllowDropped = true
	before := time.Now()
	if res, err = ob.Replay(ctx, r); err != nil || res.Rows != 3 || res.Dropped != 2 || res.Until.Before(before.Add(window-time.Minute)) {
		t.Fatalf("Replay allowing copies dropped = %+v, %v; want 3 rows, 2 dropped, until about %v", res, err, before.Add(window))
	}
	if _, err := db.Exec(`UPDATE outbox SET sent_at = now()`); err != nil {
		t.Fatal(err)
	}
	r = postgres.Replay{Aggregate: "A", DuplicateWindow: window, NewKeys: true}
	if res, err = ob.Replay(ctx, r); err != nil || res.Rows != 3 || res.Dropped != 0 {
		t.Fatalf("Replay with new keys = %+v, %v; want 3 rows, none dropped", res, err)
	}
	if res, err = ob.Replay(ctx, postgres.Replay{Aggregate: "A", DuplicateWindow: -time.Second}); !errors.Is(err, postgres.ErrInvalidReplay) {
		t.Errorf("a negative window = %+v, %v; want ErrInvalidReplay", res, err)
	}
}
