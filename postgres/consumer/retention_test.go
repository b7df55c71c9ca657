package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/consumer"
)

// forgetter records each ForgetProcessed and deletes n keys a call.
type forgetter struct {
	mu    sync.Mutex
	calls []time.Duration
	n     int64
	done  chan struct{} // closed after the third call
}

func (f *forgetter) ForgetProcessed(_ context.Context, retention time.Duration) (int64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, retention)
	if len(f.calls) == 3 {
		close(f.done)
	}
	return f.n, nil
}

// A Retention is checked whole; a Keeper refuses a Keep below its broker's
// window (or any Keep on a broker that keeps messages for ever), and
// deletes, every Every, the keys older than Keep, counting them. (Caught:
// a consumer's keys kept for ever, left for each team to delete on a
// schedule of its own.)
func TestAKeeperForgetsOnlyPastTheBrokersWindow(t *testing.T) {
	f := &forgetter{n: 4, done: make(chan struct{})}
	for _, bad := range []consumer.Retention{
		{Keep: -time.Second, Forget: f},
		{Keep: time.Hour},
		{Forget: f},
		{Keep: time.Hour, Forget: f, Every: -1},
	} {
		if _, err := consumer.NewKeeper(bad, nil, nil); !errors.Is(err, postgres.ErrInvalidConfig) {
			t.Errorf("NewKeeper(%+v) = %v; want ErrInvalidConfig", bad, err)
		}
	}
	ctx := context.Background()
	for _, c := range []struct {
		window time.Duration
		ok     bool
	}{{-1, false}, {2 * time.Hour, false}, {time.Hour, true}, {0, true}} {
		k, err := consumer.NewKeeper(consumer.Retention{Keep: time.Hour, Forget: f}, func(context.Context) (time.Duration, error) { return c.window, nil }, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := k.CheckWindow(ctx); (err == nil) != c.ok || (err != nil && !errors.Is(err, consumer.ErrRetentionTooShort)) {
			t.Errorf("Keep 1h on a window of %v: CheckWindow = %v; want ok %v", c.window, err, c.ok)
		}
	}
	k, err := consumer.NewKeeper(consumer.Retention{Keep: time.Hour, Every: time.Millisecond, Forget: f}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	stopped := make(chan struct{})
	go func() { k.Run(ctx); close(stopped) }()
	select {
	case <-f.done:
	case <-time.After(time.Minute):
		t.Fatal("three deletions: not within a minute")
	}
	cancel()
	<-stopped
	f.mu.Lock()
	defer f.mu.Unlock()
	if got := k.Forgotten(); got != f.n*int64(len(f.calls)) {
		t.Errorf("Forgotten = %d after %d deletions of %d", got, len(f.calls), f.n)
	}
	for _, r := range f.calls {
		if r != time.Hour {
			t.Errorf("ForgetProcessed with %v; want Keep, 1h", r)
		}
	}
}
