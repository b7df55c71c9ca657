package postgres

// The log relay's replication slot: made, dropped, and recovered when lost.

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// CreateLogSlot creates the replication slot slot (o's Slot if empty) of
// o's database, with the pgoutput plugin, unless it exists. Create it as a
// provisioning step, before the producers write the rows the log relay must
// publish: the slot sees only what commits after it exists. It needs
// wal_level = logical, and says so. A slot of that name that belongs to
// another database on the server is refused with
// [ErrSlotOfAnotherDatabase]. It first creates the publication of the
// outbox's inserts (o's Publication) if the database has none: migration 4
// skips it for a migrator that may not create one, as a polling
// deployment's need not ([PrivilegePublication]).
func (o *Outbox[T]) CreateLogSlot(ctx context.Context, slot string) error {
	if err := o.usable(); err != nil {
		return err
	}
	db, release := o.sqldb()
	defer release()
	// The names are the outbox's own, checked when it was opened.
	_, err := db.ExecContext(ctx, `DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = '`+o.Publication()+`') THEN
        CREATE PUBLICATION `+o.Publication()+` FOR TABLE `+o.t.table+` WITH (publish = 'insert');
    END IF;
END
$$`)
	if err != nil {
		return fmt.Errorf("create the publication %s: %w", o.Publication(), err)
	}
	return createLogSlot(ctx, db, cmp.Or(slot, o.Slot()))
}

// DropLogSlot drops the replication slot slot (o's Slot if empty) of o's
// database, if it exists: a slot that no relay reads any more holds the
// server's log for ever, until the disk fills or max_slot_wal_keep_size
// invalidates it. A slot a relay is reading is refused with
// [ErrSlotActive], and kept; so is a slot of that name that belongs to
// another database on the server, with [ErrSlotOfAnotherDatabase].
func (o *Outbox[T]) DropLogSlot(ctx context.Context, slot string) error {
	if err := o.usable(); err != nil {
		return err
	}
	db, release := o.sqldb()
	defer release()
	return dropLogSlot(ctx, db, cmp.Or(slot, o.Slot()))
}

// createLogSlot is [Outbox.CreateLogSlot] on db, DefaultSlot if slot is
// empty.
func createLogSlot(ctx context.Context, db *sql.DB, slot string) error {
	if slot == "" {
		slot = DefaultSlot
	}
	if err := slotOfThisDatabase(ctx, db, slot); err != nil {
		return fmt.Errorf("create replication slot %s: %w", slot, err)
	}
	_, err := db.ExecContext(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')
		WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)`, slot)
	if err != nil {
		return fmt.Errorf("create replication slot %s (it needs wal_level = logical): %w", slot, err)
	}
	return nil
}

// slotOfThisDatabase is nil when the slot named slot does not exist or
// belongs to the database db is open on, and an error wrapping
// ErrSlotOfAnotherDatabase, naming that database, when it belongs to
// another.
func slotOfThisDatabase(ctx context.Context, db *sql.DB, slot string) error {
	var theirs, ours string
	err := db.QueryRowContext(ctx, `SELECT coalesce(database, ''), current_database()
		FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&theirs, &ours)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err != nil:
		return err
	case theirs != ours:
		return fmt.Errorf("%w: it is database %q's, and this is %q: name this one's slot apart", ErrSlotOfAnotherDatabase, theirs, ours)
	}
	return nil
}

// ErrSlotActive is returned, wrapped, by [Outbox.DropLogSlot] for a slot that a
// log relay is reading: stop it first. A [LogRelay] whose slot another
// relay reads stands by: each session fails with it (logged at Info,
// reported to OnPass), and the relay tries again every [StandbyRetry] at
// most, to take over once the other stops.
var ErrSlotActive = errors.New("postgres: the replication slot is in use")

// StandbyRetry is the longest a standby [LogRelay] waits before it tries
// the slot again.
const StandbyRetry = 5 * time.Second

// dropLogSlot is [Outbox.DropLogSlot] on db, DefaultSlot if slot is
// empty.
func dropLogSlot(ctx context.Context, db *sql.DB, slot string) error {
	if slot == "" {
		slot = DefaultSlot
	}
	if err := slotOfThisDatabase(ctx, db, slot); err != nil {
		return fmt.Errorf("drop replication slot %s: %w", slot, err)
	}
	var active sql.NullBool
	err := db.QueryRowContext(ctx, `SELECT active FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&active)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err != nil:
		return fmt.Errorf("drop replication slot %s: %w", slot, err)
	case active.Bool:
		return fmt.Errorf("drop replication slot %s: %w", slot, ErrSlotActive)
	}
	if _, err := db.ExecContext(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
		WHERE slot_name = $1 AND database = current_database()`, slot); err != nil {
		if sqlState(err) == "55006" { // object_in_use: a relay took it meanwhile
			return fmt.Errorf("drop replication slot %s: %w: %w", slot, ErrSlotActive, err)
		}
		return fmt.Errorf("drop replication slot %s: %w", slot, err)
	}
	return nil
}

// slotReleaseWait is how long RecoverLogSlot waits for a slot's reader to
// let go of it before it gives up with ErrSlotActive.
const slotReleaseWait = 5 * time.Second

// RecoverLogSlot makes the log relay's slot (o's Slot) anew and delivers
// every row that may not have been delivered: after the slot was lost
// ([ErrSlotLost]: the server removed log it had not read), or when there
// is none ([ErrNoSlot]: a promoted standby, since PostgreSQL 15 keeps slots
// on the primary only). It drops the slot if it is there (refusing, with
// [ErrSlotActive], one a relay still reads after 5 s: a relay that has just
// stopped lets go of it a moment later), creates it, and only then publishes,
// with a polling relay of o, every row not marked sent, in passes until
// none is left: a row committed before the new slot is in the table
// unmarked and goes now; one committed after it is streamed by the log
// relay, and may go both ways: at least once, the consumers drop the
// copies. It relies on the log relay's marks (unless LogRelayConfig.Unmarked): without
// them every row ever written goes again. It returns how many rows it
// published; on an error, call it again. A recovery whose publishing fails
// drops the slot it made, so that a log relay started meanwhile finds none
// (ErrNoSlot) rather than stream past the rows the recovery owes; the
// error says so if that drop failed too.
func (o *Outbox[T]) RecoverLogSlot(ctx context.Context, broker MessageBroker) (int, error) {
	if err := o.usable(); err != nil {
		return 0, err
	}
	db, release := o.sqldb()
	defer release()
	return o.t.recoverLogSlot(ctx, db, o.Slot(), broker)
}

// Recover is [Outbox.RecoverLogSlot] for r: it makes r's Slot anew and
// publishes, to r's broker, the rows of r's outbox not marked sent. A relay
// that marks nothing (LogRelayConfig.Unmarked) is refused with an error
// wrapping ErrInvalidConfig: every row ever written would go again. Call it
// when Run returned ErrSlotLost or ErrNoSlot, then Run again.
func (r *LogRelay) Recover(ctx context.Context) (int, error) {
	if r == nil || r.sqldb == nil || r.cfg.Unmarked || r.outbox == nil {
		return 0, fmt.Errorf("%w: Recover needs a LogRelay made by NewLogRelay that marks what it delivers", ErrInvalidConfig)
	}
	db, release := r.sqldb()
	defer release()
	return r.outbox.recoverLogSlot(ctx, db, r.cfg.Slot, r.broker)
}

func (o *tables) recoverLogSlot(ctx context.Context, db *sql.DB, slot string, broker MessageBroker) (int, error) {
	// A relay that has just returned ErrSlotLost or ErrNoSlot closed its
	// connection, but the server's walsender lets go of the slot a moment
	// later: wait for that, a while.
	err := dropLogSlot(ctx, db, slot)
	for deadline := time.Now().Add(slotReleaseWait); errors.Is(err, ErrSlotActive) && time.Now().Before(deadline); {
		if !pause(ctx, 50*time.Millisecond) {
			return 0, ctx.Err()
		}
		err = dropLogSlot(ctx, db, slot)
	}
	if err != nil {
		return 0, err
	}
	if err := createLogSlot(ctx, db, slot); err != nil {
		return 0, err
	}
	// PollOnly: it only passes, and needs no connection to listen on.
	relay, err := (&Outbox[SQLTx]{t: o, db: sqlPool{db}, sqldb: callersDB(db)}).NewRelay(broker, RelayConfig{PollOnly: true})
	if err != nil {
		return 0, err
	}
	total := 0
	for {
		n, err := relay.PublishPending(ctx)
		total += n
		switch {
		case err != nil && !errors.Is(err, ErrRejected):
			// The new slot would stream only what commits after it: a
			// relay started again on it would never publish the rows
			// before it. Dropped, it leaves the next start ErrNoSlot, and
			// so the recovery to do again.
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), slotReleaseWait)
			derr := dropLogSlot(dctx, db, slot)
			cancel()
			if derr != nil {
				return total, fmt.Errorf("recover log slot %s: publish what it may have missed: %w; and the new slot could not be dropped, so call RecoverLogSlot again before a log relay reads it: %w",
					slot, err, derr)
			}
			return total, fmt.Errorf("recover log slot %s: publish what it may have missed: %w (the new slot dropped again)", slot, err)
		case n == 0:
			return total, err // a refusal, if any, is said: the row stays in the table, parked in time
		}
	}
}
