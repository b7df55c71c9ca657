package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Forgetter is the consumer's database, where it remembers what it
// applied: a *postgres.Outbox opened on it, on pgx or on database/sql.
type Forgetter interface {
	ForgetProcessed(ctx context.Context, retention time.Duration) (int64, error)
}

// ErrRetentionTooShort is returned, wrapped, for a Retention whose Keep is
// shorter than its broker may still deliver a message again.
var ErrRetentionTooShort = errors.New("consumer: retention shorter than the broker may deliver a message again")

// Retention keeps a consumer's records bounded: every Every, the keys and
// positions it applied longer than Keep ago are deleted
// ([postgres.Outbox.ForgetProcessed]), as the relay's cleanup deletes the
// sent rows on the producer's side. Its zero value keeps everything.
//
// The rule is the producer's: forget a key only once no copy of its
// message can still arrive. A copy comes from the broker within its own
// window (a stream's MaxAge, a topic's retention.ms: a consumer replayed
// from the start), which the adapter reads and refuses Keep below, with
// ErrRetentionTooShort; and from the relay, as late as its longest delay
// before it sends again (a broker down for hours, a parked row put back),
// which Keep must also cover. Keep it generous: a key is a few dozen
// bytes.
type Retention struct {
	// Forget is the consumer's database. Keep needs it.
	Forget Forgetter
	// Keep is how long a key is kept after its message applied; zero
	// keeps every key.
	Keep time.Duration
	// Every is how often the old keys are deleted; zero means Keep / 10,
	// within a minute and an hour.
	Every time.Duration
}

// Check refuses, with an error wrapping postgres.ErrInvalidConfig, a
// Retention that cannot keep its promise: a negative duration, a Keep
// without Forget, or a Forget without Keep.
func (r Retention) Check() error {
	switch {
	case r.Keep < 0 || r.Every < 0:
		return fmt.Errorf("%w: Retention: Keep %v and Every %v must not be negative", postgres.ErrInvalidConfig, r.Keep, r.Every)
	case r.Keep > 0 && r.Forget == nil:
		return fmt.Errorf("%w: Retention: Keep %v needs Forget, the consumer's database", postgres.ErrInvalidConfig, r.Keep)
	case r.Keep == 0 && r.Forget != nil:
		return fmt.Errorf("%w: Retention: Forget needs Keep, how long a key is kept", postgres.ErrInvalidConfig)
	}
	return nil
}

// every is how often Keep runs.
func (r Retention) every() time.Duration {
	if r.Every > 0 {
		return r.Every
	}
	return min(max(r.Keep/10, time.Minute), time.Hour)
}

// Window reads how long the broker may still deliver a message again after
// it took it: negative for ever. An adapter passes its broker's to Keep.
type Window func(ctx context.Context) (time.Duration, error)

// Keeper runs a Retention for an adapter's consumer, and counts what it
// deleted. Its methods are safe for concurrent use.
type Keeper struct {
	r         Retention
	window    Window
	logger    *slog.Logger
	forgotten atomic.Int64
}

// NewKeeper is a Keeper of r, whose Keep is checked against window (nil:
// the broker keeps nothing once a message is acknowledged). It refuses a
// Retention that Check refuses.
func NewKeeper(r Retention, window Window, logger *slog.Logger) (*Keeper, error) {
	if err := r.Check(); err != nil {
		return nil, err
	}
	if window == nil {
		window = func(context.Context) (time.Duration, error) { return 0, nil }
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Keeper{r: r, window: window, logger: logger}, nil
}

// Forgotten is how many keys and positions the Keeper deleted.
func (k *Keeper) Forgotten() int64 { return k.forgotten.Load() }

// CheckWindow refuses, with ErrRetentionTooShort, a Keep shorter than the
// broker's window, or any Keep for a broker that may deliver a message
// again for ever. An adapter calls it when its Run starts, and refuses to
// run on its error.
func (k *Keeper) CheckWindow(ctx context.Context) error {
	if k == nil || k.r.Keep == 0 {
		return nil
	}
	w, err := k.window(ctx)
	switch {
	case err != nil:
		return fmt.Errorf("consumer: reading the broker's window for Retention: %w", err)
	case w < 0:
		return fmt.Errorf("%w: the broker keeps its messages for ever, so a replay could bring any of them; keep every key (Keep 0)", ErrRetentionTooShort)
	case k.r.Keep < w:
		return fmt.Errorf("%w: Keep %v, but the broker may deliver a message again for %v", ErrRetentionTooShort, k.r.Keep, w)
	}
	return nil
}

// Run deletes the old keys every Every until ctx ends, checking the
// broker's window each time: a window grown past Keep deletes nothing, at
// level Error, until it is mended. Each deletion is logged at Info with
// how many went.
func (k *Keeper) Run(ctx context.Context) {
	if k == nil || k.r.Keep == 0 {
		return
	}
	t := time.NewTicker(k.r.every())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := k.CheckWindow(ctx); err != nil {
			if ctx.Err() == nil {
				k.logger.Error("consumer: retention: kept every key", "err", err)
			}
			continue
		}
		n, err := k.r.Forget.ForgetProcessed(ctx, k.r.Keep)
		k.forgotten.Add(n)
		switch {
		case err != nil && ctx.Err() == nil:
			k.logger.Error("consumer: retention: forgetting processed keys failed", "err", err, "forgotten", n)
		case n > 0:
			k.logger.Info("consumer: retention: processed keys forgotten", "forgotten", n, "keep", k.r.Keep.String())
		}
	}
}
