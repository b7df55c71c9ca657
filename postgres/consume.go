package postgres

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// ApplyOptions is what a consumer says of a message it applies
// ([Outbox.ApplyOnce], [Outbox.ApplyOnceIn], and [Outbox.ApplyBatch], which
// asks for each message's). The zero ApplyOptions is an event like any
// other.
type ApplyOptions struct {
	// Last says that the message is its aggregate's last event (an order
	// cancelled, an account closed): applied, it closes the aggregate's
	// position, which ForgetProcessed may then forget after its retention.
	// Say it of the last event only: an aggregate whose position was
	// forgotten while it was still open refuses its next event as out of
	// order for ever.
	Last bool
}

// ErrOutOfOrder is returned, wrapped, by [Outbox.ApplyOnce] for a message that
// arrives before its predecessor in its aggregate: it is not applied, and
// applies once the predecessor has been.
var ErrOutOfOrder = errors.New("postgres: message arrived before its predecessor")

// ErrMalformedMessage is what a consumer's apply function wraps for a
// message whose payload it cannot read as its type's: delivered again, it
// fails again, so a consumer should drop it (and keep it for a person to
// look at) instead of asking for it again.
var ErrMalformedMessage = errors.New("postgres: message payload cannot be read")

// ErrPermanent is what a handler wraps for a message that can never be
// applied, for a reason of its own that no retry mends (a record it refers
// to that will never exist, say): the broker's consumers give up on it at
// once (dead-letter, terminate), with a log line. Any other error is taken
// for one that may pass, and the message waits and is tried again, however
// long it takes.
var ErrPermanent = errors.New("postgres: message can never be applied")

// ErrNoMessageKey is returned by [Outbox.ApplyOnce] for a message whose Key is
// empty, such as one published without an outbox: with no key there is no
// way to tell a duplicate from a new message.
var ErrNoMessageKey = errors.New("postgres: message has no key, so duplicates cannot be dropped")

// ApplyOnce is the consumer's side of the outbox: it runs apply for msg
// in a READ COMMITTED transaction of its own on o's database (a pgx.Tx or a
// *sql.Tx, as o was opened), unless a message with msg's key was applied
// before, and reports whether apply ran and committed. Delivery is at least
// once, so every consumer needs it; apply writes the message's effect in tx,
// and the effect and the key's record in processed_messages commit together
// or not at all, durably whatever the session's synchronous_commit (the
// consumer acks the message after it). apply gets ctx with ApplyOnce's
// span, so that its statements join the trace.
//
// The key, not the id, because a consumer that hears two producers, or one
// whose sequence was reset, sees the same id on different messages. A
// message with no key is refused with [ErrNoMessageKey].
//
// A message of an aggregate must carry the Seq after the last one applied
// for that aggregate (kept in aggregate_positions): one that skips ahead is
// refused with [ErrOutOfOrder], to be delivered again later; one at or
// below it was applied before (a copy that came after its key was
// forgotten, or a replay of the stream) and is a duplicate, whatever its
// key says. opts says what the consumer knows of msg: that it is its
// aggregate's last event ([ApplyOptions]), say.
//
// ApplyOnce is a span, "apply <type>", of otel's global tracer provider, in
// the trace ctx carries: a consumer starts ctx from the message's
// TraceContext ([ContextWithTrace]) so that it joins the producer's trace.
//
// An error from apply rolls everything back and is returned unchanged: wrap
// [ErrMalformedMessage] for a payload that can never apply, [ErrPermanent]
// for a message that never will for a reason of the handler's own. A
// commit whose outcome is unknown wraps [ErrCommitUnknown]: delivered again,
// the message is applied or found a duplicate. Two deliveries of one
// message at the same time apply it once: the second waits for the first's
// transaction and comes back as a duplicate, not as an error. The tables
// are the outbox migrations' ([Outbox.Migrate]), and the records in them
// are o's consumer's ([Config.Consumer]): two consumers of the same events
// in one database each need a name of their own. In a real system they
// live in the consumer's database.
// [Outbox.ApplyOnceIn] does the same in a transaction the caller already
// has.
func (o *Outbox[T]) ApplyOnce(ctx context.Context, msg Message, opts ApplyOptions, apply func(ctx context.Context, tx T) error) (applied bool, err error) {
	if err := o.usable(); err != nil {
		return false, err
	}
	if msg.Key == "" {
		return false, ErrNoMessageKey
	}
	if apply == nil {
		return false, errors.New("postgres: ApplyOnce needs an apply function")
	}
	ctx, span := tracer().Start(ctx, "apply "+msg.Type, trace.WithAttributes(
		attribute.String("messaging.message.id", msg.Key), attribute.Int64("outbox.id", msg.ID)))
	defer func() {
		span.SetAttributes(attribute.Bool("outbox.applied", applied))
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	tx, err := o.begin(ctx)
	if err != nil {
		return false, err
	}
	t := o.tx(tx)
	defer t.rollback() // after a commit this does nothing; otherwise it undoes apply's writes
	fresh, err := applyOnceIn(ctx, t, o.consumer, msg, opts.Last, true)
	if err != nil || !fresh {
		return false, err // !fresh: a duplicate, and nothing was written
	}
	if err := apply(ctx, tx); err != nil {
		return false, err
	}
	if err := t.commit(ctx); err != nil {
		return false, err
	}
	return true, nil
}

// ApplyBatch is [Outbox.ApplyOnce] for several messages in one transaction:
// it drops each message whose key (or aggregate position) was applied
// before, calls apply once with all the others, and commits once, so a
// consumer pays one durable commit for the batch instead of one a message,
// at most four statements for the batch's records instead of four a
// message, and as many statements for its effects as apply makes: write
// them in bulk (one INSERT for all the rows the batch adds, not one a
// message). The position of an aggregate whose first message (Seq 1) is
// in the batch is written once, where ApplyOnce makes, locks and moves
// it. apply is not called when every message is a duplicate.
// applied[i] reports whether msgs[i] was applied (false: a duplicate,
// also of a copy earlier in the same batch). opts, if not nil, gives each
// message's [ApplyOptions], as ApplyOnce takes them.
//
// It is all or nothing: an error (a message out of order, a malformed one,
// apply's, the database's) rolls the whole batch back and is returned,
// with applied nil; ApplyBatch's own name the message at fault by its key,
// and apply's should too (a statement for many messages may not know which
// one failed). The caller then handles the messages one at a time, with
// ApplyOnce, to learn what became of each. A commit whose outcome is unknown wraps
// [ErrCommitUnknown], as ApplyOnce's does. A message with no key, or of an
// aggregate with a Seq below 1, is refused ([ErrNoMessageKey],
// [ErrMalformedMessage]) before anything is written.
//
// apply gets the messages to apply with each aggregate's in the order of
// their Seq. The batch makes the positions of the aggregates it starts,
// then locks the others, each in the order of their names, then records
// the keys in the order of their bytes: two batches that share aggregates
// or keys, in whatever order they came, wait for each other instead of
// deadlocking. Delivery order between different aggregates carries no
// meaning, so nothing is lost by it. apply gets ctx with
// ApplyBatch's span, "apply batch", with messaging.batch.message_count.
func (o *Outbox[T]) ApplyBatch(ctx context.Context, msgs []Message, opts func(Message) ApplyOptions, apply func(ctx context.Context, tx T, msgs []Message) error) (applied []bool, err error) {
	if err := o.usable(); err != nil {
		return nil, err
	}
	if apply == nil {
		return nil, errors.New("postgres: ApplyBatch needs an apply function")
	}
	for i, m := range msgs {
		if m.Key == "" {
			return nil, fmt.Errorf("message %d of %d: %w", i+1, len(msgs), ErrNoMessageKey)
		}
		if m.Aggregate != "" && m.Seq < 1 {
			return nil, fmt.Errorf("message %s: %s seq %d, below the first, 1: %w", m.Key, m.Aggregate, m.Seq, ErrMalformedMessage)
		}
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	ctx, span := tracer().Start(ctx, "apply batch", trace.WithAttributes(
		attribute.Int("messaging.batch.message_count", len(msgs))))
	defer func() {
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	var last func(Message) bool // a message its aggregate's last event
	if opts != nil {
		last = func(m Message) bool { return opts(m).Last }
	}
	order := make([]int, len(msgs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		ma, mb := msgs[a], msgs[b]
		return cmp.Or(cmp.Compare(ma.Aggregate, mb.Aggregate), cmp.Compare(ma.Seq, mb.Seq))
	})
	tx, err := o.begin(ctx)
	if err != nil {
		return nil, err
	}
	t := o.tx(tx)
	defer t.rollback() // after a commit this does nothing; otherwise it undoes the batch
	// Durable, as applyOnceIn explains.
	if _, err := t.execN(ctx, `SET LOCAL synchronous_commit = on`); err != nil {
		return nil, err
	}
	positions, made, err := lockPositions(ctx, t, o.consumer, msgs, order, last)
	if err != nil {
		return nil, err
	}
	// Each aggregate's messages, by Seq: at or below its position, a
	// duplicate; just past it, a candidate that moves it; further on, out
	// of order. A message of no aggregate is a candidate once.
	var candidates []int
	seen := map[string]bool{}
	for _, i := range order {
		m := msgs[i]
		if m.Aggregate == "" {
			if !seen[m.Key] {
				seen[m.Key] = true
				candidates = append(candidates, i)
			}
			continue
		}
		switch pos := positions[m.Aggregate]; {
		case m.Seq <= pos:
		case m.Seq == pos+1:
			positions[m.Aggregate] = m.Seq
			candidates = append(candidates, i)
		default:
			return nil, fmt.Errorf("message %s: %s seq %d, but the last applied is %d: %w",
				m.Key, m.Aggregate, m.Seq, pos, ErrOutOfOrder)
		}
	}
	fresh, err := recordKeys(ctx, t, o.consumer, msgs, candidates)
	if err != nil {
		return nil, err
	}
	// A candidate whose key was recorded before leaves its aggregate's
	// position where it was, as ApplyOnce does: a later message of that
	// aggregate in the batch is then out of order.
	moved := map[string]Message{}
	stuck := map[string]int64{}
	for _, i := range candidates {
		m := msgs[i]
		if m.Aggregate == "" {
			continue
		}
		if _, ok := stuck[m.Aggregate]; ok {
			return nil, fmt.Errorf("message %s: %s seq %d, but the last applied is %d: %w",
				m.Key, m.Aggregate, m.Seq, stuck[m.Aggregate], ErrOutOfOrder)
		}
		if !fresh[m.Key] {
			stuck[m.Aggregate] = m.Seq - 1
			continue
		}
		moved[m.Aggregate] = m
	}
	if err := movePositions(ctx, t, o.consumer, moved, made, last); err != nil {
		return nil, err
	}
	applied = make([]bool, len(msgs))
	var toApply []Message
	for _, i := range candidates {
		if fresh[msgs[i].Key] {
			toApply = append(toApply, msgs[i])
			applied[i] = true
		}
	}
	if len(toApply) > 0 {
		if err := apply(ctx, tx, toApply); err != nil {
			return nil, fmt.Errorf("apply %d of %d messages: %w", len(toApply), len(msgs), err)
		}
	}
	if err := t.commit(ctx); err != nil {
		return nil, err
	}
	return applied, nil
}

// lockPositions returns the last seq applied by consumer of each aggregate
// of msgs (0 for one never seen), holding their row locks in tx. An aggregate with
// no row yet whose first message is in the batch (Seq 1) gets its row
// here, written once with the Seq the batch takes it to if every message
// applies, instead of made, locked and moved (three writes); made holds
// the message each such row was written for. The rows are made, then the
// others locked, each in the order of the aggregates' names.
func lockPositions(ctx context.Context, tx stmts, consumer string, msgs []Message, order []int, last func(Message) bool) (positions map[string]int64, made map[string]Message, err error) {
	var aggregates []string       // each aggregate once, by name
	reach := map[string]Message{} // an aggregate the batch starts: the message it reaches
	for _, i := range order {     // sorted by aggregate, then Seq
		m := msgs[i]
		if m.Aggregate == "" {
			continue
		}
		if len(aggregates) == 0 || aggregates[len(aggregates)-1] != m.Aggregate {
			aggregates = append(aggregates, m.Aggregate)
			if m.Seq == 1 {
				reach[m.Aggregate] = m
			}
			continue
		}
		if r, ok := reach[m.Aggregate]; ok && m.Seq == r.Seq+1 {
			reach[m.Aggregate] = m
		}
	}
	positions = make(map[string]int64, len(aggregates))
	made = make(map[string]Message, len(reach))
	if len(aggregates) == 0 {
		return positions, made, nil
	}
	if len(reach) > 0 {
		var names []string
		var seqs []int64
		var closed []bool
		for _, a := range aggregates {
			if m, ok := reach[a]; ok {
				names, seqs, closed = append(names, a), append(seqs, m.Seq), append(closed, last != nil && last(m))
			}
		}
		// A row another transaction is making waits here for it, and is
		// then locked below as one made before.
		got, err := queryStrings(ctx, tx, `INSERT INTO aggregate_positions (consumer, aggregate, seq, applied_at, closed)
			SELECT $4, a, s, clock_timestamp(), c FROM unnest($1::text[], $2::bigint[], $3::bool[]) AS v(a, s, c) ORDER BY a
			ON CONFLICT DO NOTHING RETURNING aggregate`, names, seqs, closed, consumer)
		if err != nil {
			return nil, nil, fmt.Errorf("positions of %d aggregates: %w", len(names), err)
		}
		for _, a := range got {
			made[a], positions[a] = reach[a], 0
		}
	}
	var rest []string
	for _, a := range aggregates {
		if _, ok := made[a]; !ok {
			rest = append(rest, a)
		}
	}
	if len(rest) == 0 {
		return positions, made, nil
	}
	rows, err := tx.query(ctx, `SELECT aggregate, seq FROM aggregate_positions
		WHERE consumer = $2 AND aggregate = ANY($1::text[]) ORDER BY aggregate FOR UPDATE`, rest, consumer)
	if err != nil {
		return nil, nil, fmt.Errorf("positions of %d aggregates: %w", len(rest), err)
	}
	defer rows.Close()
	for rows.Next() {
		var a string
		var seq int64
		if err := rows.Scan(&a, &seq); err != nil {
			return nil, nil, err
		}
		positions[a] = seq
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("positions of %d aggregates: %w", len(rest), err)
	}
	return positions, made, nil
}

// recordKeys records the keys of msgs[candidates] as consumer's in
// processed_messages, in one statement, and returns those that were not
// there before.
func recordKeys(ctx context.Context, tx stmts, consumer string, msgs []Message, candidates []int) (map[string]bool, error) {
	keys := make([]string, len(candidates))
	for j, i := range candidates {
		keys[j] = msgs[i].Key
	}
	fresh := make(map[string]bool, len(keys))
	if len(keys) == 0 {
		return fresh, nil
	}
	// Under READ COMMITTED a key another transaction is recording waits
	// here for it, then counts as recorded before. The keys go in in the
	// order of their bytes (COLLATE "C"), whatever the batch's order: two
	// batches that share keys then wait for each other, where two that
	// took them in opposite orders would deadlock (40P01).
	got, err := queryStrings(ctx, tx, `INSERT INTO processed_messages (consumer, message_key)
		SELECT $2, k FROM unnest($1::text[]) AS v(k) ORDER BY k COLLATE "C"
		ON CONFLICT DO NOTHING RETURNING message_key`, keys, consumer)
	if err != nil {
		return nil, fmt.Errorf("record %d messages: %w", len(keys), err)
	}
	for _, k := range got {
		fresh[k] = true
	}
	return fresh, nil
}

// queryStrings runs query in tx and returns the text column of its rows.
func queryStrings(ctx context.Context, tx stmts, query string, args ...any) ([]string, error) {
	rows, err := tx.query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// movePositions sets each aggregate's position to the Seq of its message
// in moved, in one statement: the rows locked, and those lockPositions
// made whose message is not the one moved (a key recorded before stopped
// the aggregate short of it), which go back to where the batch left them.
func movePositions(ctx context.Context, tx stmts, consumer string, moved, made map[string]Message, last func(Message) bool) error {
	var aggregates []string
	var seqs []int64
	var closed []bool
	set := func(a string, seq int64, m Message, ok bool) {
		aggregates, seqs, closed = append(aggregates, a), append(seqs, seq), append(closed, ok && last != nil && last(m))
	}
	for a, m := range moved {
		if r, ok := made[a]; !ok || r.Key != m.Key {
			set(a, m.Seq, m, true)
		}
	}
	for a := range made {
		if _, ok := moved[a]; !ok {
			set(a, 0, Message{}, false)
		}
	}
	if len(aggregates) == 0 {
		return nil
	}
	if _, err := tx.execN(ctx, `UPDATE aggregate_positions p
		SET seq = v.seq, applied_at = clock_timestamp(), closed = v.closed
		FROM unnest($1::text[], $2::bigint[], $3::bool[]) AS v(aggregate, seq, closed)
		WHERE p.consumer = $4 AND p.aggregate = v.aggregate`, aggregates, seqs, closed, consumer); err != nil {
		return fmt.Errorf("move %d positions: %w", len(aggregates), err)
	}
	return nil
}

// ApplyOnceIn is [Outbox.ApplyOnce] in the caller's transaction tx, a pgx.Tx or
// a *sql.Tx as o was opened: it records msg as applied in tx and reports
// fresh, or reports a duplicate (false) and writes nothing. The caller
// writes the message's effect in tx only if fresh, and commits; the record
// and the effect are kept together or not at all. On an error (no key,
// [ErrOutOfOrder], the database's) the caller rolls tx back. It makes tx's
// commit durable (synchronous_commit = on, for tx alone), so that what the
// consumer acks after the commit survives a crash of the server. A message
// of an aggregate whose Seq is below 1 is refused with
// [ErrMalformedMessage], never taken for a duplicate. It starts no span:
// the caller's ctx carries its own. The records are o's consumer's
// ([Config.Consumer]).
func (o *Outbox[T]) ApplyOnceIn(ctx context.Context, tx T, msg Message, opts ApplyOptions) (fresh bool, err error) {
	if err := o.usable(); err != nil {
		return false, err
	}
	if any(tx) == nil {
		return false, errNoTx
	}
	return applyOnceIn(ctx, o.tx(tx), o.consumer, msg, opts.Last, true)
}

// applyOnceIn records msg as applied by consumer in tx, or reports a
// duplicate; with setDurable it first makes tx's commit durable.
func applyOnceIn(ctx context.Context, tx stmts, consumer string, msg Message, last, setDurable bool) (fresh bool, err error) {
	if msg.Key == "" {
		return false, ErrNoMessageKey
	}
	if msg.Aggregate != "" && msg.Seq < 1 {
		return false, fmt.Errorf("message %s: %s seq %d, below the first, 1: %w", msg.Key, msg.Aggregate, msg.Seq, ErrMalformedMessage)
	}
	if msg.Aggregate != "" {
		// The aggregate's position first, under its row lock: a second
		// delivery of the message waits here for the first one's
		// transaction, and then finds the position past it.
		seq, err := lockPosition(ctx, tx, consumer, msg)
		if err != nil {
			return false, err
		}
		if msg.Seq <= seq {
			return false, nil // applied before: a copy whose key was forgotten, or a replay
		}
		if msg.Seq != seq+1 {
			return false, fmt.Errorf("message %s: %s seq %d, but the last applied is %d: %w",
				msg.Key, msg.Aggregate, msg.Seq, seq, ErrOutOfOrder)
		}
	}
	// The consumer acks the message once this commits, and the broker then
	// never delivers it again: the commit must last, whatever the
	// session's synchronous_commit (off would let a crash of the server
	// erase an effect already acked). With synchronous standbys, it also
	// waits for them, as on requires.
	if setDurable {
		if _, err := tx.execN(ctx, `SET LOCAL synchronous_commit = on`); err != nil {
			return false, fmt.Errorf("message %s: %w", msg.Key, err)
		}
	}
	// Under READ COMMITTED a second delivery waits here for the first
	// one's transaction, then finds the key and inserts nothing.
	n, err := tx.execN(ctx,
		`INSERT INTO processed_messages (consumer, message_key) VALUES ($2, $1) ON CONFLICT DO NOTHING`, msg.Key, consumer)
	if err != nil {
		return false, fmt.Errorf("record message %s: %w", msg.Key, err)
	}
	if n == 0 {
		return false, nil // applied before, a duplicate
	}
	if msg.Aggregate != "" {
		if _, err := tx.execN(ctx,
			`UPDATE aggregate_positions SET seq = $2, applied_at = clock_timestamp(), closed = $3 WHERE consumer = $4 AND aggregate = $1`,
			msg.Aggregate, msg.Seq, last, consumer); err != nil {
			return false, fmt.Errorf("message %s: %w", msg.Key, err)
		}
	}
	return true, nil
}

// lockPosition returns the last seq of msg's aggregate that consumer
// applied (0 for an aggregate never seen), holding its row lock in tx.
func lockPosition(ctx context.Context, tx stmts, consumer string, msg Message) (int64, error) {
	if _, err := tx.execN(ctx,
		`INSERT INTO aggregate_positions (consumer, aggregate, seq) VALUES ($2, $1, 0) ON CONFLICT DO NOTHING`, msg.Aggregate, consumer); err != nil {
		return 0, fmt.Errorf("message %s: %w", msg.Key, err)
	}
	var seq int64
	if err := tx.queryRow(ctx,
		`SELECT seq FROM aggregate_positions WHERE consumer = $2 AND aggregate = $1 FOR UPDATE`, msg.Aggregate, consumer).Scan(&seq); err != nil {
		return 0, fmt.Errorf("message %s: %w", msg.Key, err)
	}
	return seq, nil
}

// ForgetProcessed deletes the keys of messages that [Outbox.ApplyOnce] applied
// longer than retention ago, and the positions of the aggregates whose last
// event it applied longer than retention ago, at most [Config.CleanupBatch]
// rows a transaction, and returns how many keys and positions it deleted:
// o's consumer's alone ([Config.Consumer]), each consumer keeping its own
// retention. It is safe to run beside ApplyOnce.
// The position of an aggregate that is still open is kept, however old:
// forgotten, the aggregate's next event would find no predecessor and be
// refused as out of order for ever.
//
// The rule: forget a key only once no copy of its message can still arrive.
// A copy comes as late as the longest delay before a relay sends again (a
// broker down for hours, a parked message put back) plus the broker's own
// redelivery delay; a retention shorter than that applies a late duplicate
// as a new message. Keep it generous: a key is a few dozen bytes.
func (o *Outbox[T]) ForgetProcessed(ctx context.Context, retention time.Duration) (int64, error) {
	if err := o.usable(); err != nil {
		return 0, err
	}
	keys, err := deleteInBatches(ctx, o.db, forgetProcessed, retention, o.cleanupBatch, o.consumer)
	if err != nil {
		return keys, err
	}
	positions, err := deleteInBatches(ctx, o.db, forgetClosedPositions, retention, o.cleanupBatch, o.consumer)
	return keys + positions, err
}

// ForgetPosition deletes the position of aggregate that o's consumer
// ([Config.Consumer]) keeps, and reports whether there was one: the
// consumer then takes the aggregate's events again from the first (Seq 1).
// It is how a consumer has an aggregate applied again. A consumer drops
// every event of an aggregate at or below its position, whatever the
// event's key, and every event whose key it remembers: so forget the
// position here, on the consumer's database, and then replay the
// aggregate with new keys on the producer's ([Outbox.Replay] with
// Replay.NewKeys). Do it while no event of the aggregate is on its way to
// the consumer: one past the forgotten position waits, out of order, for
// the replay's first.
func (o *Outbox[T]) ForgetPosition(ctx context.Context, aggregate string) (bool, error) {
	if err := o.usable(); err != nil {
		return false, err
	}
	if aggregate == "" {
		return false, errors.New("postgres: ForgetPosition needs an aggregate")
	}
	n, err := o.db.execN(ctx, `DELETE FROM aggregate_positions WHERE consumer = $1 AND aggregate = $2`, o.consumer, aggregate)
	if err != nil {
		return false, fmt.Errorf("forget the position of %s: %w", aggregate, err)
	}
	return n > 0, nil
}

// forgetProcessed deletes up to $2 of consumer $3's keys older than $1
// microseconds.
const forgetProcessed = `
WITH gone AS (
    DELETE FROM processed_messages
    WHERE consumer = $3 AND message_key IN (
        SELECT message_key FROM processed_messages
        WHERE consumer = $3 AND processed_at < clock_timestamp() - $1 * interval '1 microsecond'
        ORDER BY processed_at
        LIMIT $2)
    RETURNING 1)
SELECT count(*) FROM gone`

// forgetClosedPositions deletes up to $2 of consumer $3's positions of
// closed aggregates last moved more than $1 microseconds ago.
const forgetClosedPositions = `
WITH gone AS (
    DELETE FROM aggregate_positions
    WHERE consumer = $3 AND aggregate IN (
        SELECT aggregate FROM aggregate_positions
        WHERE consumer = $3 AND closed AND applied_at < clock_timestamp() - $1 * interval '1 microsecond'
        ORDER BY applied_at
        LIMIT $2)
    RETURNING 1)
SELECT count(*) FROM gone`
