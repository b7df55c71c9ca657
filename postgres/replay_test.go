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

	n, err := ob.Replay(ctx, postgres.Replay{Aggregate: "A"})
	if n != 2 || err != nil {
		t.Fatalf("Replay of A = %d, %v; want 2", n, err)
	}
	if ids, same := show(drain()); !slices.Equal(ids, []int64{1, 3}) || same != 2 {
		t.Errorf("after the replay of A the broker got %v, %d with their keys; want [1 3], both", ids, same)
	}
	n, err = ob.Replay(ctx, postgres.Replay{Aggregate: "A", NewKeys: true})
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
	if n, err := ob.Replay(ctx, postgres.Replay{From: oldest, To: time.Now().Add(time.Hour)}); n != 3 || err != nil {
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
		n, err := ob.Replay(ctx, c.r)
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
