package postgres

// Replay on demand: sent rows put back, to be published again.

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// MaxReplay is the most rows one [Outbox.Replay] puts back: a replay is one
// transaction, and a larger one is refused, to be cut into ranges.
const MaxReplay = 10_000

// ErrInvalidReplay is returned, wrapped, by [Outbox.Replay] for a [Replay]
// that selects nothing it can bound: neither an Aggregate nor a From, a To
// without a From, or a From not before its To. Nothing is written.
var ErrInvalidReplay = errors.New("postgres: invalid replay")

// ErrNotKept is returned, wrapped, by [Outbox.Replay] when the outbox no
// longer keeps what the replay asks for: no sent row in its range, a range
// that begins before the oldest row the table keeps, or at or before the
// newest row cleanup deleted (DeleteSent, or a log relay that deletes what
// it delivered, records it: migration 10), or an aggregate whose first
// events, or any between its first and last kept, are gone. The error says
// what the table keeps. Nothing is written: a replay with a hole in it
// would hand a consumer that lost its state events whose predecessors
// never come.
var ErrNotKept = errors.New("postgres: the outbox no longer keeps what the replay asks for")

// ErrInDuplicateWindow is returned, wrapped, by [Outbox.Replay] for a
// replay with the rows' old keys of rows the broker took less than its
// duplicate window ago ([Replay.DuplicateWindow]): it would drop them as
// copies before any consumer saw them, and the replay would do nothing for
// them. The error says how many and until when. Nothing is written:
// replay with [Replay.NewKeys], after the window, or with
// [Replay.AllowDropped].
var ErrInDuplicateWindow = errors.New("postgres: the broker would drop the replayed rows as copies")

// ErrReplayTooLarge is returned, wrapped, by [Outbox.Replay] for a range that
// holds more than [MaxReplay] sent rows, saying how many. Nothing is written.
var ErrReplayTooLarge = errors.New("postgres: replay too large")

// A Replay selects the sent rows of an outbox that [Outbox.Replay] puts back:
// those of Aggregate, if not empty, written (created_at) at or after From, if
// not zero, and before To, if not zero. It needs an Aggregate or a From.
type Replay struct {
	Aggregate string
	From, To  time.Time
	// NewKeys gives each row put back a new key, so that a consumer that
	// remembers the old keys does not drop the rows as copies. A row of
	// an aggregate is dropped all the same by a consumer whose position of
	// the aggregate is at or past its Seq: for such a consumer to apply an
	// aggregate again, forget its position first (Outbox.ForgetPosition,
	// on the consumer's database). Without NewKeys the rows keep their
	// keys: consumers that remember them drop them, and one that lost its
	// state (keys and positions) applies them. (JetStream drops a message
	// whose key it saw within its stream's duplicate window, Duplicates,
	// two minutes by default, before any consumer sees it: a replay with
	// the old keys reaches consumers once that window has passed; give
	// the window in DuplicateWindow.)
	NewKeys bool
	// DuplicateWindow is the broker's: how long after it took a message it
	// drops another with the same key as a copy (JetStream's stream
	// Duplicates, two minutes by default; 0 for a broker that drops none,
	// as RabbitMQ). Without NewKeys, a replay of rows sent within it is
	// refused with ErrInDuplicateWindow, unless AllowDropped.
	DuplicateWindow time.Duration
	// AllowDropped puts back rows sent within DuplicateWindow all the
	// same: the broker drops those it gets before the window has passed,
	// and the result counts them (ReplayResult.Dropped).
	AllowDropped bool
}

// A ReplayResult is what [Outbox.Replay] put back, and what of it the broker
// drops as copies.
type ReplayResult struct {
	// Rows is how many rows were put back, to be published again.
	Rows int64
	// Dropped is how many of them keep a key the broker took within its
	// duplicate window (Replay.DuplicateWindow): published again before
	// Until, the broker drops each as a copy, and no consumer sees it.
	// The broker takes the other Rows - Dropped. 0 with NewKeys.
	Dropped int64
	// Until is when the last of Dropped leaves the window; zero if none.
	Until time.Time
}

// replayCheck counts, in one read of the table, the sent rows a replay
// selects ($1 its aggregate or ”, $2 and $3 its bounds or NULL), those
// sent within the broker's duplicate window ($4 µs) and the last of them,
// the lowest
// and highest seq among the rows it selects and how many of them have one,
// when the oldest row the table keeps was written, and the newest row
// cleanup deleted (NULL if none).
const replayCheck = `
SELECT count(*) FILTER (WHERE selected AND sent_at IS NOT NULL),
       count(*) FILTER (WHERE selected AND sent_at > clock_timestamp() - $4 * interval '1 microsecond'),
       max(sent_at) FILTER (WHERE selected AND sent_at > clock_timestamp() - $4 * interval '1 microsecond'),
       COALESCE(min(seq) FILTER (WHERE selected), 0),
       COALESCE(max(seq) FILTER (WHERE selected), 0),
       count(seq) FILTER (WHERE selected),
       min(created_at),
       (SELECT NULLIF(deleted_through, '-infinity') FROM outbox_cleanup)
FROM (SELECT sent_at, seq, created_at,
             ($1 = '' OR aggregate = $1)
             AND ($2::timestamptz IS NULL OR created_at >= $2::timestamptz)
             AND ($3::timestamptz IS NULL OR created_at < $3::timestamptz) AS selected
      FROM outbox) r`

// replayRows puts back the sent rows replayCheck counted, with new keys if
// $4, each as a row never tried.
const replayRows = `
WITH back AS (
    UPDATE outbox
    SET sent_at = NULL, attempts = 0, rejections = 0, last_error = NULL, retry_at = NULL,
        message_key = CASE WHEN $4 THEN gen_random_uuid() ELSE message_key END
    WHERE sent_at IS NOT NULL
      AND ($1 = '' OR aggregate = $1)
      AND ($2::timestamptz IS NULL OR created_at >= $2::timestamptz)
      AND ($3::timestamptz IS NULL OR created_at < $3::timestamptz)
    RETURNING id)
SELECT count(*) FROM back`

// replayNotify wakes the relays that listen, at the replay's commit.
const replayNotify = `SELECT pg_notify('outbox', '')`

// Replay puts back the sent rows that r selects, in one transaction, and
// returns how many, and how many of them the broker will drop as copies
// (those sent within r.DuplicateWindow, with their old keys, allowed by
// r.AllowDropped): relays publish them again, each aggregate's in its
// order, and, since they keep their ids, before the rows written after
// them. It is for a consumer that lost its state: the events of an
// aggregate, or of a time range, again. Each row keeps its key unless
// r.NewKeys.
//
// It reads the whole table twice (no index serves a replay, and one would
// cost every write), under ctx: give it a deadline. It refuses, writing
// nothing, a Replay it cannot bound ([ErrInvalidReplay]), one that asks for
// what the table no longer keeps ([ErrNotKept]), one of more than
// [MaxReplay] rows ([ErrReplayTooLarge]), and one the broker would drop in
// part as copies, unless allowed ([ErrInDuplicateWindow]). A log relay with
// LogRelayConfig.Unmarked marks no row sent, so there is nothing to put
// back; and the log relay does not see rows put back, which are updates:
// a polling pass publishes them (outbox-relay's sweep).
func (o *Outbox[T]) Replay(ctx context.Context, r Replay) (ReplayResult, error) {
	if err := o.usable(); err != nil {
		return ReplayResult{}, err
	}
	switch {
	case r.Aggregate == "" && r.From.IsZero():
		return ReplayResult{}, fmt.Errorf("%w: give an Aggregate or a From: the whole outbox is not replayed", ErrInvalidReplay)
	case r.From.IsZero() && !r.To.IsZero():
		return ReplayResult{}, fmt.Errorf("%w: a To (%s) without a From", ErrInvalidReplay, r.To.Format(time.RFC3339Nano))
	case !r.To.IsZero() && !r.From.Before(r.To):
		return ReplayResult{}, fmt.Errorf("%w: From %s is not before To %s", ErrInvalidReplay, r.From.Format(time.RFC3339Nano), r.To.Format(time.RFC3339Nano))
	case r.DuplicateWindow < 0:
		return ReplayResult{}, fmt.Errorf("%w: DuplicateWindow %v is negative", ErrInvalidReplay, r.DuplicateWindow)
	}
	bound := func(t time.Time) any {
		if t.IsZero() {
			return nil
		}
		return t
	}
	what := r.String()
	tx, err := o.db.begin(ctx)
	if err != nil {
		return ReplayResult{}, fmt.Errorf("replay %s: %w", what, err)
	}
	defer tx.rollback()
	var sent, recent, firstSeq, lastSeq, seqs int64
	var lastRecent, oldest, cut *time.Time // cut: nil until cleanup deletes a row
	if err := tx.queryRow(ctx, o.t.sql.replayCheck, r.Aggregate, bound(r.From), bound(r.To), r.DuplicateWindow.Microseconds()).Scan(
		&sent, &recent, &lastRecent, &firstSeq, &lastSeq, &seqs, &oldest, &cut); err != nil {
		return ReplayResult{}, fmt.Errorf("replay %s: %w", what, err)
	}
	switch {
	case oldest == nil:
		return ReplayResult{}, fmt.Errorf("replay %s: %w: the table %s is empty", what, ErrNotKept, o.t.table)
	case !r.From.IsZero() && r.From.Before(*oldest):
		return ReplayResult{}, fmt.Errorf("replay %s: %w: the oldest row %s keeps was written at %s; replay from then on",
			what, ErrNotKept, o.t.table, oldest.Format(time.RFC3339Nano))
	case !r.From.IsZero() && cut != nil && !r.From.After(*cut):
		return ReplayResult{}, fmt.Errorf("replay %s: %w: cleanup deleted rows of %s written up to %s; replay from after then",
			what, ErrNotKept, o.t.table, cut.Format(time.RFC3339Nano))
	case r.Aggregate != "" && r.From.IsZero() && firstSeq > 1:
		return ReplayResult{}, fmt.Errorf("replay %s: %w: its events before seq %d are gone (cleanup); replay a range from the oldest kept, %s",
			what, ErrNotKept, firstSeq, oldest.Format(time.RFC3339Nano))
	case r.Aggregate != "" && seqs > 0 && lastSeq-firstSeq+1 != seqs:
		return ReplayResult{}, fmt.Errorf("replay %s: %w: %d of its events from seq %d to %d are kept, and the others are gone (cleanup)",
			what, ErrNotKept, seqs, firstSeq, lastSeq)
	case sent == 0:
		return ReplayResult{}, fmt.Errorf("replay %s: %w: no sent row in it (rows not yet sent go anyway)", what, ErrNotKept)
	case sent > MaxReplay:
		return ReplayResult{}, fmt.Errorf("replay %s: %w: %d sent rows, at most %d a replay: cut the range", what, ErrReplayTooLarge, sent, MaxReplay)
	}
	res := ReplayResult{}
	if recent > 0 && !r.NewKeys {
		res.Dropped, res.Until = recent, lastRecent.Add(r.DuplicateWindow)
		if !r.AllowDropped {
			return ReplayResult{}, fmt.Errorf("replay %s: %w: %d of its %d rows were sent within the broker's duplicate window (%v), the last until %s; replay with new keys, after then, or allowing them dropped",
				what, ErrInDuplicateWindow, recent, sent, r.DuplicateWindow, res.Until.Format(time.RFC3339))
		}
	}
	if err := tx.queryRow(ctx, o.t.sql.replayRows, r.Aggregate, bound(r.From), bound(r.To), r.NewKeys).Scan(&res.Rows); err != nil {
		return ReplayResult{}, fmt.Errorf("replay %s: %w", what, err)
	}
	if err := tx.exec(ctx, o.t.sql.replayNotify); err != nil {
		return ReplayResult{}, fmt.Errorf("replay %s: %w", what, err)
	}
	if err := tx.commit(ctx); err != nil {
		return ReplayResult{}, fmt.Errorf("replay %s: %w", what, err)
	}
	return res, nil
}

// String says what r selects, for errors and logs.
func (r Replay) String() string {
	s := "the sent rows"
	if r.Aggregate != "" {
		s += fmt.Sprintf(" of %q", r.Aggregate)
	}
	if !r.From.IsZero() {
		s += " written from " + r.From.Format(time.RFC3339Nano)
	}
	if !r.To.IsZero() {
		s += " to " + r.To.Format(time.RFC3339Nano)
	}
	if r.NewKeys {
		s += ", with new keys"
	}
	return s
}
