package main

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Ten viewers asking for the page's state at once cost one read; the next
// period, one more; a read that failed is not kept. (Caught: each viewer's
// stream reading the whole state itself, every 200 ms: ten viewers, ten
// times the queries.)
func TestSnapshotReadsOnceAPeriodForEveryViewer(t *testing.T) {
	var reads atomic.Int64
	var fail atomic.Bool
	now := time.Unix(1000, 0)
	var clock sync.Mutex
	s := &snapshot[int64]{
		period: 200 * time.Millisecond,
		read: func(context.Context) (int64, error) {
			if fail.Load() {
				return 0, errors.New("database down")
			}
			return reads.Add(1), nil
		},
		now: func() time.Time { clock.Lock(); defer clock.Unlock(); return now },
	}
	ask := func() {
		t.Helper()
		var wg sync.WaitGroup
		for range 10 {
			wg.Go(func() {
				if _, err := s.get(context.Background()); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
	}
	advance := func(d time.Duration) { clock.Lock(); now = now.Add(d); clock.Unlock() }
	ask()
	if n := reads.Load(); n != 1 {
		t.Fatalf("ten viewers at once: %d reads, want 1", n)
	}
	advance(199 * time.Millisecond)
	ask()
	if n := reads.Load(); n != 1 {
		t.Fatalf("within the period: %d reads, want still 1", n)
	}
	advance(time.Millisecond)
	ask()
	if n := reads.Load(); n != 2 {
		t.Fatalf("the next period: %d reads, want 2", n)
	}
	advance(time.Second)
	fail.Store(true)
	if _, err := s.get(context.Background()); err == nil {
		t.Fatal("a failed read was answered from the old value")
	}
	fail.Store(false)
	if v, err := s.get(context.Background()); v != 3 || err != nil {
		t.Errorf("after a failed read: %d, %v; want a new read, 3", v, err)
	}
}
