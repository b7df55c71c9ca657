package main

import (
	"context"
	"sync"
	"time"
)

// snapshot is a value read at most once a period, however many callers ask
// for it: the live page's state, which each viewer's stream asks for every
// 200 ms, is read from the database once for all of them. A read that
// fails is not kept. Safe for concurrent use.
type snapshot[T any] struct {
	period time.Duration
	read   func(context.Context) (T, error)
	now    func() time.Time // time.Now; a seam for the tests

	mu sync.Mutex // held through a read, so that callers wait for it rather than read again
	at time.Time  // when v was read; zero before the first read
	v  T
}

// get returns the value read less than a period ago, or reads it now.
func (s *snapshot[T]) get(ctx context.Context) (T, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.at.IsZero() && s.now().Sub(s.at) < s.period {
		return s.v, nil
	}
	v, err := s.read(ctx)
	if err != nil {
		return v, err
	}
	s.v, s.at = v, s.now()
	return v, nil
}
