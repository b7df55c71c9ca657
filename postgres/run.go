package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"
)

// NotifyChannel is the channel that migrations/0001_outbox.sql's trigger
// notifies when a transaction that inserted outbox rows commits, and that
// [OutboxRelay.Run] listens on: the table outbox's ([DefaultTable]; an
// [Outbox] of another table has its own, [Outbox.Channel]).
const NotifyChannel = "outbox"

// DefaultPollInterval is how long [OutboxRelay.Run] waits for a
// notification before it passes anyway when [RelayConfig.PollInterval] is
// zero.
const DefaultPollInterval = time.Second

// DefaultMaxBackoff is the longest [OutboxRelay.Run] waits after failed
// passes when [RelayConfig.MaxBackoff] is zero.
const DefaultMaxBackoff = 30 * time.Second

// minBackoff is the wait after the first failed pass; it doubles with each
// failure in a row, up to MaxBackoff.
const minBackoff = 100 * time.Millisecond

// Run is the background process of the article's «Как это собирается»: it
// makes relay passes until ctx ends, and then returns ctx's error, after the
// pass in progress has marked what the broker accepted. A failed pass is
// logged to Logger (if set) and tried again, with one exception: a pass
// that fails in a way no retry mends (a table or column that does not
// exist, a permission the relay lacks: SQLSTATE class 42, or a database
// that does not exist) stops Run, which logs it and returns that error.
//
// After a pass that claimed a full batch, or that left rows it claimed
// unpublished because its budget ran out, Run passes again at once: more
// rows may be waiting. After a short pass it waits for a wake-up: a
// notification on [NotifyChannel], which PostgreSQL delivers when a
// transaction that wrote outbox rows commits, never before, so a wake-up
// never looks for a row that is not yet visible. A short pass does not mean
// the outbox is empty: SKIP LOCKED passes over the rows other relays hold,
// and no notification comes when a relay that held them dies and frees
// them. So Run also passes every PollInterval without a notification; that
// also covers a notification lost while the listening connection was down,
// which Run opens again, and passes once each time it does.
//
// Progress is what a pass marked sent and committed, not what the broker
// accepted. After a failed pass (the broker refused or is down, the mark or
// the commit failed, the database failed) Run logs the error at level Error,
// with how many messages the broker accepted and how many were marked, and
// waits, not woken by notifications: 100 ms after the first failure,
// doubling with each failure in a row up to MaxBackoff, each wait a random point in the upper half of that, so that
// relays that failed together do not retry together. Only a pass that
// marked something starts the count again. So a mark that fails pass after
// pass (a lock held on the table, a trigger that fails) republishes the
// claimed messages once a backoff, not in a loop; consumers drop the
// copies. With order per aggregate, a pass that marked anything, or whose
// only failures were messages that failed for reasons of their own, is no
// failure of the loop: each such message holds back its aggregate alone,
// until its next attempt (RetryDelay), and Run goes on with the rest at
// once, logging each failure at level Error.
//
// While Run passes, producers do not notify: a commit that notified takes
// a lock for the whole server, so with many producers such commits happen
// one at a time. Run says it is awake through the table's outbox_awake
// (migration 11), and before it sleeps it says it is not, waits until no
// transaction that wrote a row without notifying is still open (passing
// again every few milliseconds meanwhile), and passes once more: a row
// written while it was awake is published by that pass, and one written
// after it notifies. A relay that only polls (PollOnly) leaves the flag,
// and producers notify.
//
// Run holds one connection of the relay's pool for listening, and needs
// pgx's stdlib driver for it. With PollOnly set it does not listen and only
// polls, for a connection pooler that cannot keep a LISTEN, such as
// PgBouncer in transaction mode. Any number of Runs, in one process or many,
// may share a database. A relay that no Outbox's NewRelay made is refused
// at once, with an error wrapping [ErrInvalidConfig].
func (r *OutboxRelay) Run(ctx context.Context) error {
	if err := r.usable(); err != nil {
		return err
	}
	poll, maxBackoff := r.cfg.PollInterval, r.cfg.MaxBackoff
	log := r.cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	wait := r.wait
	if wait == nil {
		wait = sleep
	}
	listenWait := r.listenWait
	if listenWait == nil {
		listenWait = sleep
	}

	wake := make(chan struct{}, 1) // one pending wake-up stands for any number
	var listener sync.WaitGroup
	defer listener.Wait()
	listenCtx, stopListening := context.WithCancel(ctx)
	defer stopListening()
	if !r.cfg.PollOnly {
		listener.Go(func() { r.listen(listenCtx, wake, maxBackoff, listenWait, log) })
	}

	// While Run passes, producers do not notify (awake.go); before it
	// sleeps, it lets them, and passes once more once none that did not
	// is still writing. A relay that only polls keeps no flag: producers
	// notify.
	keepsFlag := !r.cfg.PollOnly
	resting := false // the flag says asleep: the pass that sees the last writers, or the wait after it
	if keepsFlag {
		if err := r.setAwake(ctx, true); err != nil {
			log.Warn("outbox: relay could not say it is awake; producers notify", "err", err)
		}
		defer func() {
			if err := r.setAwake(context.WithoutCancel(ctx), false); err != nil {
				log.Warn("outbox: relay could not say it stopped; producers notify once the next relay passes", "err", err)
			}
		}()
	}

	failures := 0
	for {
		res, err := r.pass(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if resting && res.claimed > 0 {
			resting = false // rows came in: awake again
			if err := r.setAwake(ctx, true); err != nil {
				log.Warn("outbox: relay could not say it is awake; producers notify", "err", err)
			}
		}
		if res.fatal {
			log.Error("outbox: relay stopped: its pass can never succeed as the database stands", "err", err)
			return fmt.Errorf("outbox relay stopped: %w", err)
		}
		for _, id := range res.parked {
			log.Warn("outbox: message parked after too many rejections", "id", id)
		}
		for _, f := range res.failing {
			log.Warn("outbox: message keeps failing", "id", f.id, "key", f.key, "attempts", FailingAfter, "err", f.err)
		}
		if res.marked > 0 {
			failures = 0
		}
		switch {
		case err != nil && !(!r.cfg.WholeTable && (res.marked > 0 || res.refusedOnly)):
			failures++
			d := backoff(failures, maxBackoff, rand.Float64)
			log.Error("outbox: relay pass failed", "err", err,
				"published", res.published, "marked", res.marked, "retry_in", d)
			if !wait(ctx, d, nil) {
				return ctx.Err()
			}
		case err != nil:
			// With order per aggregate, the broker refused messages that hold back
			// their aggregates alone, each until its next attempt: the
			// others go on at once.
			log.Error("outbox: broker refused messages; each holds back its aggregate", "err", err,
				"published", res.published, "marked", res.marked)
		case res.full, res.marked+len(res.parked) < res.claimed:
			// more may be waiting: pass again at once
		case keepsFlag && !resting:
			// About to sleep: once no writer that counted on this relay is
			// still open, one more pass sees all they wrote.
			free, err := r.mayRest(ctx)
			if err == nil && free {
				resting = true
				continue
			}
			if err != nil && ctx.Err() == nil {
				log.Warn("outbox: relay could not tell whether it may sleep; passing again soon", "err", err)
			}
			if err := r.setAwake(ctx, true); err != nil && ctx.Err() == nil {
				log.Warn("outbox: relay could not say it is awake; producers notify", "err", err)
			}
			if !wait(ctx, awakePoll, nil) {
				return ctx.Err()
			}
		default:
			if !wait(ctx, poll, wake) {
				return ctx.Err()
			}
			if keepsFlag {
				resting = false
				if err := r.setAwake(ctx, true); err != nil {
					log.Warn("outbox: relay could not say it is awake; producers notify", "err", err)
				}
			}
		}
	}
}

// sleep waits for d, or for a wake-up if wake is not nil, and reports false
// if ctx ended first.
func sleep(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-wake:
		return true
	case <-ctx.Done():
		return false
	}
}

// backoff is how long Run waits after the nth failed pass in a row: a delay
// that doubles from minBackoff up to max, and of that a random point in the
// upper half (random returns a number in [0, 1)).
func backoff(n int, max time.Duration, random func() float64) time.Duration {
	d := max
	if n >= 1 && n < 32 && minBackoff<<(n-1) < max {
		d = minBackoff << (n - 1)
	}
	return d/2 + time.Duration(random()*float64(d/2))
}

// errCannotListen stops the listener for good: the driver is not pgx.
var errCannotListen = errors.New("postgres: LISTEN needs pgx's stdlib driver; Run only polls")

// listen keeps a connection listening on NotifyChannel and turns each
// notification into a wake-up, until ctx ends. When the connection fails it
// opens another, after a backoff like a failed pass's.
func (r *OutboxRelay) listen(ctx context.Context, wake chan<- struct{}, maxBackoff time.Duration,
	wait func(context.Context, time.Duration, <-chan struct{}) bool, log *slog.Logger) {
	failures := 0
	for {
		listened, err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errCannotListen) {
			log.Warn("outbox: relay cannot listen", "err", err)
			return
		}
		if listened {
			failures = 0
		}
		failures++
		d := backoff(failures, maxBackoff, rand.Float64)
		log.Warn("outbox: listening for notifications failed; polling until it listens again", "err", err, "retry_in", d)
		if !wait(ctx, d, nil) {
			return
		}
	}
}

// listenOnce listens on one connection until it fails, and reports whether
// LISTEN went through.
func (r *OutboxRelay) listenOnce(ctx context.Context, wake chan<- struct{}) (listened bool, err error) {
	return r.db.listen(ctx, r.outbox.table, wake)
}

// notify leaves a wake-up unless one is pending already.
func notify(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}
