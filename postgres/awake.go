package postgres

// Whether a relay is awake, so that producers notify only while none is
// (migration 11): a commit that notified takes a lock for the whole server,
// and with many producers such commits happen one at a time.

import (
	"context"
	"time"
)

// awakePoll is how soon Run passes again when it would sleep but a
// producer that did not notify, counting on it, is still writing: the
// wait of a row written while the relay is busy.
const awakePoll = 5 * time.Millisecond

// flagTimeout bounds each change of the flag.
const flagTimeout = 2 * time.Second

// setAwake says to the producers, through the table's outbox_awake,
// whether a relay is awake: while one is, they do not notify.
func (r *OutboxRelay) setAwake(ctx context.Context, awake bool) error {
	ctx, cancel := context.WithTimeout(ctx, flagTimeout)
	defer cancel()
	v := 0
	if awake {
		v = 1
	}
	var got int64
	return r.db.queryRow(ctx, r.outbox.named(`SELECT setval('outbox_awake', $1)`), v).Scan(&got)
}

// mayRest lets the producers notify again, and reports whether the relay
// may go to sleep after one more pass: true once no transaction that wrote
// a row without notifying is still open, so that the next pass sees every
// row such a transaction wrote, and any later one notifies. False: one is
// still open, and the relay should pass again soon (awakePoll).
func (r *OutboxRelay) mayRest(ctx context.Context) (bool, error) {
	if err := r.setAwake(ctx, false); err != nil {
		return false, err
	}
	ctx, cancel := context.WithTimeout(ctx, flagTimeout)
	defer cancel()
	var free bool
	// The lock of a statement in a transaction of its own: taken and let
	// go at once, and only if no writer holds it shared.
	err := r.db.queryRow(ctx, r.outbox.named(`SELECT pg_try_advisory_xact_lock(hashtext('outbox'), 2)`)).Scan(&free)
	return free, err
}
