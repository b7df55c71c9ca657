package postgres_test

// A backoff per message: a message the broker refused waits for its own
// next attempt, and holds back its aggregate alone, while the rest flow.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// TestARefusedMessageWaitsForItsNextAttemptWhileTheRestFlow runs on both
// drivers. A1 is refused: the pass records its next attempt RetryDelay
// later (a random point in the upper half); passes before then publish B's
// messages, written later, and neither A1 nor A2; the second refusal waits
// twice as long, and the delay stops at MaxRetryDelay. Once A1's time has
// come (the test moves it into the past, rather than waiting), A1, and on
// the pass after, A2.
// A refusal while the broker is unavailable sets no time: the loop backs
// off as a whole then. (Caught: today's relay before this change, which
// claimed A1 again on the very next pass.)
func TestARefusedMessageWaitsForItsNextAttemptWhileTheRestFlow(t *testing.T) {
	t.Run("pgx", func(t *testing.T) {
		name := newBlankDatabase(t)
		ob, err := postgres.Open(newPool(t, name, 4), postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		waitsForItsNextAttempt(t, ob, open(t, name, ""))
	})
	t.Run("database/sql", func(t *testing.T) {
		db := newDatabase(t)
		ob, err := postgres.OpenDB(db, postgres.Config{})
		if err != nil {
			t.Fatal(err)
		}
		waitsForItsNextAttempt(t, ob, db)
	})
}

func waitsForItsNextAttempt[T any](t *testing.T, ob *postgres.Outbox[T], db *sql.DB) {
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	insertEvents(t, db, "A", "B", "A") // ids 1 to 3: A1, B1, A2
	accepted := &recorder{}
	var mu sync.Mutex
	refuse := true
	attempts := map[int64]int{}
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		mu.Lock()
		attempts[m.ID]++
		r := refuse && m.ID == 1
		mu.Unlock()
		if r {
			return errFlaky
		}
		return accepted.Publish(ctx, m)
	})
	const delay, maxDelay = time.Hour, 3 * time.Hour
	relay := newRelayOn(t, ob, broker, postgres.RelayConfig{RetryDelay: delay, MaxRetryDelay: maxDelay})

	// waits is how long after its last failure A1's next attempt is.
	waits := func() time.Duration {
		t.Helper()
		var ms float64
		if err := db.QueryRow(`SELECT extract(epoch FROM retry_at - clock_timestamp()) * 1000 FROM outbox WHERE id = 1`).Scan(&ms); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ms * float64(time.Millisecond))
	}
	pass := func() {
		t.Helper()
		n, err := relay.PublishPending(ctx)
		t.Logf("pass: published %d, error %v", n, err)
	}
	within := func(d, lo, hi time.Duration) bool { return d > lo-time.Minute && d <= hi }

	pass()
	if w := waits(); !within(w, delay/2, delay) {
		t.Errorf("after the first refusal A1 waits %v, want between %v and %v", w, delay/2, delay)
	}
	insertEvents(t, db, "B") // id 4: B2, written after the refusal
	pass()
	pass()
	if got := accepted.IDs(); !slices.Equal(got, []int64{2, 4}) {
		t.Errorf("before A1's next attempt the broker accepted %v, want [2 4]: B flows, A waits", got)
	}
	if attempts[1] != 1 {
		t.Errorf("A1 was offered to the broker %d times before its next attempt, want once", attempts[1])
	}

	due := func() { retryNow(t, db) }
	due()
	pass() // A1's second refusal
	if w := waits(); !within(w, delay, 2*delay) {
		t.Errorf("after the second refusal A1 waits %v, want between %v and %v", w, delay, 2*delay)
	}
	for range 4 { // refusals 3 to 6: the delay stops at maxDelay
		due()
		pass()
	}
	if w := waits(); !within(w, maxDelay/2, maxDelay) {
		t.Errorf("after the sixth refusal A1 waits %v, want between %v and %v", w, maxDelay/2, maxDelay)
	}

	mu.Lock()
	refuse = false
	mu.Unlock()
	due()
	pass() // A1; A2 was held back by A1's failure as this pass's claim saw it
	pass() // A2
	if got := accepted.IDs(); !slices.Equal(got, []int64{2, 4, 1, 3}) {
		t.Errorf("once A1's time came the broker accepted %v, want [2 4 1 3]", got)
	}
	var waiting int
	if err := db.QueryRow(`SELECT count(*) FROM outbox WHERE retry_at IS NOT NULL AND sent_at IS NULL`).Scan(&waiting); err != nil {
		t.Fatal(err)
	}
	if waiting != 0 {
		t.Errorf("%d unsent rows still wait for a next attempt", waiting)
	}

	// A broker that is unavailable is the broker's state, not the message's:
	// no time is set, and the next pass tries again.
	insertEvents(t, db, "C") // id 5
	accepted.SetDown(true)
	pass()
	var retryAt sql.NullTime
	if err := db.QueryRow(`SELECT retry_at FROM outbox WHERE id = 5`).Scan(&retryAt); err != nil {
		t.Fatal(err)
	}
	if retryAt.Valid {
		t.Errorf("a publish that failed with the broker unavailable set retry_at %v, want none", retryAt.Time)
	}
	accepted.SetDown(false)
	pass()
	if got := accepted.IDs(); !slices.Equal(got, []int64{2, 4, 1, 3, 5}) {
		t.Errorf("after the broker came back it accepted %v, want [2 4 1 3 5]", got)
	}
}

// TestRunGoesOnWhileARefusedMessageWaits: under Run, a message the broker
// refuses is offered once and then waits for its next attempt (an hour
// away), while the messages written after it, of other aggregates, are
// published as they come, and Run logs no failed pass. (Caught: the relay
// before the backoff per message, which offered the refused message on
// every pass, and after a pass that marked nothing backed off as a whole.)
func TestRunGoesOnWhileARefusedMessageWaits(t *testing.T) {
	db := newDatabase(t)
	insertEvents(t, db, "A") // id 1, refused
	accepted := &recorder{}
	var mu sync.Mutex
	offered := 0
	broker := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 1 {
			mu.Lock()
			offered++
			mu.Unlock()
			return errFlaky
		}
		return accepted.Publish(ctx, m)
	})
	var logs logBuffer
	relay := newRelay(t, db, broker, postgres.RelayConfig{
		RetryDelay: time.Hour, MaxRetryDelay: time.Hour, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	waitUntil(t, "the first offer of the refused message", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return offered > 0
	})
	for i := range 10 {
		insertEvents(t, db, fmt.Sprintf("B%d", i)) // ids 2 to 11
		waitUntil(t, fmt.Sprintf("B%d published", i), func() bool { return len(accepted.IDs()) == i+1 })
	}
	stop()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if offered != 1 {
		t.Errorf("the refused message was offered %d times while it waited, want once", offered)
	}
	if got, want := accepted.IDs(), []int64{2, 3, 4, 5, 6, 7, 8, 9, 10, 11}; !slices.Equal(got, want) {
		t.Errorf("the broker accepted %v, want %v", got, want)
	}
	if out := logs.String(); strings.Contains(out, "relay pass failed") || !strings.Contains(out, "each holds back its aggregate") {
		t.Errorf("Run logged:\n%s\nwant the refusal logged once as holding back its aggregate, and no failed pass", out)
	}
}

// retryNow brings forward the next attempt of every row of db's outbox that
// waits for one, as the clock would: for the tests of what a relay does on
// a message's second attempt, which do not wait for it.
func retryNow(t *testing.T, db *sql.DB) {
	t.Helper()
	if _, err := db.Exec(`UPDATE outbox SET retry_at = now() - interval '1 second' WHERE retry_at IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
}
