package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// While a relay is awake, producers do not notify (migration 11), and no
// row is left behind for it: eight producers write 1,200 rows in bursts
// (seeded, logged), some holding their transaction open a while before
// they commit, so that the relay goes to sleep between bursts with writers
// still open; the relay polls once an hour, so only a notification or its
// own pass after the last open writer can find a row. Every row reaches
// the broker, fewer notifications come than rows, and a stopped relay
// leaves the flag saying asleep. (Caught: a relay that went to sleep while
// a writer that counted on it was still open; its row waited for the next
// poll.)
func TestNoRowIsLeftBehindWhileProducersCountOnAnAwakeRelay(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	broker := &recorder{}
	relay := newRelay(t, db, broker, postgres.RelayConfig{PollInterval: time.Hour})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(runCtx) }()

	// A listener of our own counts the notifications.
	listener := connectTo(t, name)
	if _, err := listener.Exec(ctx, `LISTEN outbox`); err != nil {
		t.Fatal(err)
	}

	const seed, producers, perProducer = 81, 8, 150
	t.Logf("seed %d", seed)
	ob := sqlOutbox(t, db, postgres.Config{})
	var wg sync.WaitGroup
	for p := range producers {
		random := rand.New(rand.NewPCG(seed, uint64(p)))
		wg.Go(func() {
			for i := range perProducer {
				err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
					if _, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: map[string]int{"p": p, "i": i}}); err != nil {
						return err
					}
					if random.IntN(10) == 0 { // open a while after its row: the relay may try to sleep meanwhile
						time.Sleep(time.Duration(random.IntN(20)) * time.Millisecond)
					}
					return nil
				})
				if err != nil {
					t.Error(err)
					return
				}
				if random.IntN(25) == 0 { // a pause between bursts: the relay goes to sleep
					time.Sleep(time.Duration(10+random.IntN(30)) * time.Millisecond)
				}
			}
		})
	}
	wg.Wait()
	const rows = producers * perProducer
	waitUntil(t, "every row published, with no poll to find a row left behind", func() bool { return len(broker.IDs()) >= rows })
	stop()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v", err)
	}
	notifications := 0
	for {
		wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		_, err := listener.WaitForNotification(wctx)
		cancel()
		if err != nil {
			break // none left: they were all queued by now
		}
		notifications++
	}
	t.Logf("%d rows, %d notifications", rows, notifications)
	if notifications >= rows {
		t.Errorf("%d notifications for %d rows: producers notified while the relay was awake", notifications, rows)
	}
	var awake int64
	if err := db.QueryRow(`SELECT last_value FROM outbox_awake`).Scan(&awake); err != nil || awake != 0 {
		t.Errorf("after Run stopped, outbox_awake = %d (%v); want 0: producers notify", awake, err)
	}
}

// A writer that read "a relay is awake", and so did not notify, is waited
// for: the relay, busy publishing row A, lets writer W write row B and
// hold its transaction open; once A is done the relay would sleep, but W
// is still open, so it stays awake, passing every few milliseconds; W
// commits, and the relay's next pass publishes B, with no notification
// and no poll for an hour. (Caught: a relay that slept at once, and B
// waited for the hourly poll.)
func TestARelayGoingToSleepWaitsForTheWriterThatCountedOnIt(t *testing.T) {
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	gate := make(chan struct{})
	publishing := make(chan struct{}, 1)
	var mu sync.Mutex
	var published []int64
	broker := brokerFunc(func(_ context.Context, m postgres.Message) error {
		select {
		case publishing <- struct{}{}:
		default:
		}
		<-gate
		mu.Lock()
		defer mu.Unlock()
		published = append(published, m.ID)
		return nil
	})
	passes := make(chan struct{}, 1000)
	relay := newRelay(t, db, broker, postgres.RelayConfig{PollInterval: time.Hour,
		OnPass: func(postgres.PassReport) { passes <- struct{}{} }})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(runCtx) }()
	defer func() {
		stop()
		<-done
	}()

	for range 2 { // its first pass, and the one after it let the producers notify: it sleeps
		select {
		case <-passes:
		case <-time.After(time.Minute):
			t.Fatal("the relay did not pass within a minute")
		}
	}
	ob := sqlOutbox(t, db, postgres.Config{})
	write := func(tx *sql.Tx) int64 {
		t.Helper()
		id, err := ob.Write(ctx, tx, postgres.Event{Type: "OrderPlaced", Payload: "{}"})
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	if err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error { write(tx); return nil }); err != nil {
		t.Fatal(err)
	}
	select { // the relay is awake, publishing A
	case <-publishing:
	case <-time.After(time.Minute):
		t.Fatal("row A not published within a minute")
	}
	var awake int64
	if err := db.QueryRow(`SELECT last_value FROM outbox_awake`).Scan(&awake); err != nil || awake != 1 {
		t.Fatalf("outbox_awake while the relay publishes = %d (%v); want 1", awake, err)
	}
	w, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	b := write(w) // reads "awake": no notification
	for len(passes) > 0 {
		<-passes
	}
	close(gate)
	for range 3 { // the relay finishes A and passes on while W is open
		select {
		case <-passes:
		case <-time.After(time.Minute):
			t.Fatal("the relay stopped passing while W was open")
		}
	}
	if err := w.Commit(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "row B published, with no notification and no poll", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(published) == 2 && published[1] == b
	})
}
