package postgres

// One relay pass: claim, publish, mark, commit, and what it waits for
// between them.

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// passResult is what a pass did, for Run.
type passResult struct {
	published int       // accepted by the broker
	marked    int       // marked sent, and committed: the pass's progress
	claimed   int       // rows the pass claimed
	full      bool      // it claimed a whole batch
	flushed   bool      // it made the server flush its log
	parked    []int64   // ids of the rows it parked, if it committed
	failing   []failure // the rows whose attempts reached FailingAfter, if it committed
	// refusedOnly is set when the pass's only failures were publishes
	// that hold back their aggregates alone, each until its next attempt.
	refusedOnly bool
	// fatal is set when a statement failed in a way no retry mends: a
	// table or column that does not exist, a permission the relay lacks.
	fatal bool
}

// pass is PublishPending, reporting more.
func (r *OutboxRelay) pass(ctx context.Context) (res passResult, err error) {
	tel, start := r.telemetry(), time.Now()
	var span trace.Span // started once the claim found rows: an empty pass makes no trace
	defer func() { tel.endPass(ctx, span, start, res, err) }()
	if r.cfg.OnPass != nil {
		defer func() {
			r.cfg.OnPass(PassReport{Claimed: res.claimed, Published: res.published, Marked: res.marked, Parked: len(res.parked),
				Flushed: res.flushed, Err: err})
		}()
	}
	defer func() { res.fatal = err != nil && cannotPass(err) }()

	// Publishing stops at the budget or when the caller's ctx ends. The
	// transaction lives under a context that the caller cannot cancel, so
	// that what the broker accepted can still be marked, and that ends at
	// twice the budget whatever happens.
	pubCtx, cancelPub := context.WithTimeout(ctx, r.cfg.PassTimeout)
	defer cancelPub()
	txCtx, cancelTx := context.WithTimeout(context.WithoutCancel(ctx), 2*r.cfg.PassTimeout)
	defer cancelTx()

	// The pass's transaction is begun by pgx, even on a *sql.DB (pool.inTx).
	// Until it has begun nothing is published, so a stop ends the wait for
	// a connection (the pool's connections all busy) and for the BEGIN,
	// not the end of txCtx.
	beginCtx, cancelBegin := context.WithCancel(txCtx)
	defer cancelBegin()
	stopBegin := context.AfterFunc(ctx, cancelBegin)
	began := false
	err = r.db.inTx(beginCtx, func(tx txn) error {
		stopBegin()
		began = true
		res, err = r.passIn(ctx, pubCtx, txCtx, tx, start, &span)
		return err
	})
	if !began {
		return res, fmt.Errorf("begin relay pass: %w", err)
	}
	return res, err
}

// passIn is a pass in its transaction tx: its claim, its publishes under
// pubCtx and the rest under txCtx, and its span, started at start once the
// claim found rows.
func (r *OutboxRelay) passIn(ctx, pubCtx, txCtx context.Context, tx txn, start time.Time, span *trace.Span) (res passResult, err error) {
	batch, budget := r.cfg.BatchSize, r.cfg.PassTimeout
	defer tx.rollback() // after a commit this does nothing; otherwise it frees the claim

	query := r.outbox.sql.claimRows
	if !r.cfg.WholeTable {
		query = r.outbox.sql.claimRuns
	}
	// Until the claim is done nothing is published, so a stop may cut it
	// short: a claim that waits for a lock (a migration's, a VACUUM FULL)
	// ends at the stop, not at its lock_timeout.
	claimCtx, cancelClaim := context.WithCancel(txCtx)
	defer cancelClaim()
	defer context.AfterFunc(ctx, cancelClaim)()
	msgs, wal, head, err := claim(claimCtx, tx, query, batch, millis(budget), millis(2*budget), !r.cfg.WholeTable)
	if err == nil && !r.cfg.WholeTable && head.passedOver(msgs) {
		// Rows of an aggregate may have been claimed without its first:
		// those stay as they are, claimed by this pass and left unsent.
		msgs, err = r.runsOnly(claimCtx, tx, msgs)
	}
	if err != nil {
		if ctx.Err() != nil {
			return res, fmt.Errorf("relay pass stopped while it claimed: %w", ctx.Err())
		}
		return res, err
	}
	// The claim is done: from here on a stop lets the pass mark what the
	// broker accepted, under txCtx.
	res.claimed, res.full = len(msgs), len(msgs) == batch
	if len(msgs) > 0 {
		// The publishes' context carries the pass's span, their link.
		pubCtx, *span = r.telemetry().tracer.Start(pubCtx, "outbox relay pass", trace.WithTimestamp(start))
	}
	if len(msgs) > 0 && !wal.flushed {
		var err error
		if res.flushed, err = r.flush(pubCtx, tx, wal.inserted); err != nil {
			if ctx.Err() != nil {
				return res, fmt.Errorf("relay pass stopped: %w", ctx.Err())
			}
			return res, fmt.Errorf("relay pass: flush the server's log to %s, past the claimed rows' commits: %w", wal.inserted, err)
		}
	}
	// The standbys get only what the primary flushed: first the flush.
	if len(msgs) > 0 && (len(r.cfg.Standbys) > 0 || r.cfg.StandbyCount > 0) {
		if err := r.waitForStandbys(pubCtx, tx, wal.inserted); err != nil {
			if ctx.Err() != nil {
				return res, fmt.Errorf("relay pass stopped: %w", ctx.Err())
			}
			return res, fmt.Errorf("relay pass: %w", err)
		}
	}

	sent := make([]int64, 0, len(msgs))
	var failed []failure
	var stop error      // why publishing stopped before the end of the batch, if it matters
	var refused []error // with order per aggregate, the refusals the pass went on after
	checked := time.Now()
	for pending := msgs; len(pending) > 0; {
		if pubCtx.Err() != nil {
			if err := ctx.Err(); err != nil {
				stop = fmt.Errorf("relay pass stopped: %w", err)
			} // else the budget ran out: the rest wait for the next pass
			break
		}
		if time.Since(checked) >= ClaimCheckInterval {
			if err := tx.exec(txCtx, `SELECT 1`); err != nil {
				stop = fmt.Errorf("%w after %d published messages: %w", ErrClaimLost, len(sent), err)
				break
			}
			checked = time.Now()
		}
		n, err := r.publish(pubCtx, pending)
		for _, msg := range pending[:n] {
			sent = append(sent, msg.ID)
		}
		if err == nil {
			pending = pending[n:]
			continue
		}
		msg := pending[n] // the message the broker did not accept
		pending = pending[n+1:]
		if ctx.Err() != nil { // stopped: nothing is written to the row
			stop = fmt.Errorf("publish message %d: %w", msg.ID, err)
			break
		}
		// The broker's failure, or the end of the pass's budget (a publish
		// that hung): either way written to the row, so that it says why the
		// message is stuck. Only a refusal the broker made in time counts as
		// a rejection; a timeout never parks a row. Each context is read
		// once: a parent's Err is set before its children are cancelled.
		inTime := pubCtx.Err() == nil
		f := failure{id: msg.ID, key: msg.Key, err: err, rejected: inTime && errors.Is(err, ErrRejected)}
		f.park = f.rejected && r.cfg.ParkAfter > 0 && msg.rejections+1 >= r.cfg.ParkAfter
		if inTime { // the broker's own failure, not the end of the pass
			if f.park {
				failed = append(failed, f)
				res.parked = append(res.parked, msg.ID)
				if !r.cfg.WholeTable { // parked, it still holds back its aggregate
					pending = without(pending, msg.Aggregate)
				}
				continue // set aside: the rows after it go on
			}
			if !r.cfg.WholeTable && !errors.Is(err, ErrBrokerUnavailable) {
				// It holds back its aggregate alone, until its next
				// attempt: the pass goes on with the other aggregates' rows.
				f.backOff = true
				failed = append(failed, f)
				refused = append(refused, fmt.Errorf("publish message %d: %w", msg.ID, err))
				pending = without(pending, msg.Aggregate)
				continue
			}
		}
		failed = append(failed, f)
		stop = fmt.Errorf("publish message %d: %w", msg.ID, err)
		break
	}
	res.published = len(sent)
	res.refusedOnly = stop == nil && len(refused) > 0
	stop = errors.Join(stop, errors.Join(refused...))

	// Whatever fails from here on leaves every accepted message unsent, to
	// go again, and no row parked; but a commit whose outcome is unknown
	// may have kept the marks, and the progress is counted as none.
	unmarked := func(what string, err error) (passResult, error) {
		res.parked, res.failing, res.refusedOnly = nil, nil, false
		fate := "stay unsent and go again"
		if errors.Is(err, ErrCommitUnknown) {
			fate = "may be marked sent or not: those not marked go again"
		}
		return res, errors.Join(stop, fmt.Errorf("%s%s, so the %d messages the broker accepted %s: %w",
			what, why(txCtx, err), len(sent), fate, err))
	}
	if len(sent) > 0 {
		mark := r.outbox.sql.markSent
		if r.mark != "" {
			mark = r.mark
		}
		if err := tx.exec(txCtx, mark, sent); err != nil {
			return unmarked("mark the published messages sent", err)
		}
	}
	for _, f := range failed {
		var attempts int
		if err := tx.queryRow(txCtx, r.outbox.sql.recordFailure, f.id, b2i(f.rejected), f.err.Error(), f.park,
			f.backOff, r.cfg.RetryDelay.Seconds()*1000, r.cfg.MaxRetryDelay.Seconds()*1000).Scan(&attempts); err != nil {
			return unmarked(fmt.Sprintf("record the failure of message %d", f.id), err)
		}
		if attempts == FailingAfter && !f.park {
			res.failing = append(res.failing, f)
		}
	}
	if err := tx.commit(txCtx); err != nil {
		return unmarked("relay pass", err)
	}
	res.marked = len(sent)
	return res, stop
}

// why says, for an error of the pass's transaction, what happened to it
// when the error itself does not: the pass ran past twice its budget (its
// transaction's context ended), or its session is gone (the server ended
// it, or a pooler, or the network did: the server's error says so, or the
// driver could not send the statement, or the network failed) and with it
// everything the pass wrote.
// (A commit whose outcome is unknown says so itself.)
func why(txCtx context.Context, err error) string {
	code := sqlState(err)
	switch {
	case errors.Is(err, ErrCommitUnknown):
		return ""
	case txCtx.Err() != nil:
		return " (the pass ran past twice its budget, PassTimeout: a broker slower than the budget?)"
	case errors.Is(err, driver.ErrBadConn), pgconn.SafeToRetry(err), errors.As(err, new(net.Error)),
		sessionEnded(err), code == "25P03":
		return " (the pass's session is gone, ended by the server, a pooler or the network, and nothing it wrote was kept)"
	}
	return ""
}

// ErrStandbyBehind is returned, wrapped, by [OutboxRelay.PublishPending]
// when a pass's standbys (RelayConfig.Standbys) had not flushed the log
// past its rows' commits within its budget: it published nothing, and the
// rows wait for a later pass.
var ErrStandbyBehind = errors.New("postgres: a standby the relay waits for is behind")

// ErrStandbysUnreadable is returned, wrapped, by
// [OutboxRelay.PublishPending] when the relay has Standbys and its role
// cannot read their positions: pg_stat_replication shows a role without
// the privileges of pg_read_all_stats (nor superuser) a NULL flush_lsn,
// which would look like a standby for ever behind. Grant the role
// pg_read_all_stats. Run stops on it, as on any failure no retry mends.
var ErrStandbysUnreadable = errors.New("postgres: the relay's role cannot read its standbys' positions (it needs pg_read_all_stats)")

// standbysFlushed says whether every standby of $2, by application_name,
// is connected and has flushed the log up to $1, and whether the role may
// read the standbys' positions at all.
const standbysFlushed = `SELECT count(DISTINCT application_name) = cardinality($2::text[]),
       pg_has_role('pg_read_all_stats', 'USAGE')
FROM pg_stat_replication WHERE application_name = ANY($2::text[]) AND flush_lsn >= $1::pg_lsn`

// standbysCounted says how many physical standbys stream from this
// primary, how many of them have flushed the log up to $1, and whether the
// role may read their positions. A logical walsender (the log relay's
// slot) is no standby; nor is a WAL archiver (pg_receivewal, a backup
// tool's streaming), which flushes the log and reports it, but replays
// nothing, so its replay_lsn is NULL: no failover can promote it. A role
// that may not read the positions sees every one NULL, and every walsender
// counted, so that it is told so rather than shown none.
const standbysCounted = `SELECT count(*), count(*) FILTER (WHERE flush_lsn >= $1::pg_lsn),
       pg_has_role('pg_read_all_stats', 'USAGE')
FROM pg_stat_replication r
WHERE state = 'streaming' AND (replay_lsn IS NOT NULL OR flush_lsn IS NULL)
  AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical')`

// waitForStandbys waits until every standby of r.cfg.Standbys, or
// r.cfg.StandbyCount of the primary's standbys, have flushed the log up to
// lsn, looking again after 1 ms, then twice as long each time up to 50 ms,
// until ctx ends.
func (r *OutboxRelay) waitForStandbys(ctx context.Context, tx txn, lsn string) error {
	if r.cfg.StandbyCount > 0 {
		return r.waitForStandbyCount(ctx, tx, lsn)
	}
	names := slices.Compact(slices.Sorted(slices.Values(r.cfg.Standbys)))
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		var caught, readable bool
		err := tx.queryRow(ctx, standbysFlushed, lsn, names).Scan(&caught, &readable)
		switch {
		case err != nil && ctx.Err() == nil:
			return fmt.Errorf("read the standbys' positions: %w", err)
		case err == nil && caught:
			return nil
		case err == nil && !readable:
			return fmt.Errorf("%w: pg_stat_replication shows the role flush_lsn NULL for %v: GRANT pg_read_all_stats TO the relay's role",
				ErrStandbysUnreadable, names)
		}
		if err != nil || !pause(ctx, wait) {
			return fmt.Errorf("%w: %v had not all flushed the log to %s, past the claimed rows' commits, within the pass's budget",
				ErrStandbyBehind, names, lsn)
		}
	}
}

// waitForStandbyCount is waitForStandbys by number: StandbyCount of the
// primary's physical standbys, whichever they are.
func (r *OutboxRelay) waitForStandbyCount(ctx context.Context, tx txn, lsn string) error {
	return waitForStandbyCount(ctx, tx, lsn, r.cfg.StandbyCount, r.cfg.PublishWithoutStandbys, &r.alone, r.cfg.Logger, r.outbox.table)
}

// waitForStandbyCount waits until want of the physical standbys streaming
// from the primary q reaches (a relay pass's transaction, or the log
// relay's pool) have flushed the log up to lsn, looking again
// after 1 ms, then twice as long each time up to 50 ms, until ctx ends,
// and fails with ErrStandbyBehind then. A primary with none at all passes
// at once if withoutStandbys, logged at Warn through alone.
func waitForStandbyCount(ctx context.Context, q rowQuerier, lsn string, want int, withoutStandbys bool, alone *aloneLog, log *slog.Logger, table string) error {
	var streaming, caught int64
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		var readable bool
		err := q.queryRow(ctx, standbysCounted, lsn).Scan(&streaming, &caught, &readable)
		switch {
		case err != nil && ctx.Err() == nil:
			return fmt.Errorf("read the standbys' positions: %w", err)
		case err == nil && !readable && streaming > 0:
			return fmt.Errorf("%w: pg_stat_replication shows the role flush_lsn NULL: GRANT pg_read_all_stats TO the relay's role",
				ErrStandbysUnreadable)
		case err == nil && caught >= int64(want):
			alone.over(log, table)
			return nil
		case err == nil && streaming == 0 && withoutStandbys:
			alone.publishing(log, table, want)
			return nil
		}
		if err != nil || !pause(ctx, wait) {
			return fmt.Errorf("%w: %d of the %d standbys StandbyCount wants had flushed the log to %s, past the rows' commits, in time (%d streaming from this primary)",
				ErrStandbyBehind, caught, want, lsn, streaming)
		}
	}
}

// aloneEvery is how often, at most, a relay that goes on publishing with
// no standby (PublishWithoutStandbys) says so again.
const aloneEvery = 5 * time.Minute

// aloneLog says when a relay starts to publish with no standby streaming
// from its primary, again every aloneEvery while it goes on, and when a
// standby is back: a line a state, not one a pass (a promoted primary's
// relay logged 1,454 lines in 23 s). Its zero value says nothing yet; it
// is safe for concurrent use.
type aloneLog struct {
	mu          sync.Mutex
	since, said time.Time // zero: the relay has its standbys
}

// publishing notes a publish with no standby, and says so if it is the
// first of a run of them or aloneEvery has passed.
func (a *aloneLog) publishing(log *slog.Logger, table string, want int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	if a.since.IsZero() {
		a.since = now
	}
	if log != nil && (a.said.IsZero() || now.Sub(a.said) >= aloneEvery) {
		a.said = now
		log.Warn("outbox: relay publishes with no standby streaming from the primary (PublishWithoutStandbys): a failover before one catches up may leave phantom events",
			"table", table, "standbyCount", want, "since", a.since.Format(time.RFC3339), "next_said_in", aloneEvery)
	}
}

// over notes that the standbys are back, and says so if the relay had
// published without them.
func (a *aloneLog) over(log *slog.Logger, table string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.since.IsZero() {
		return
	}
	if log != nil {
		log.Info("outbox: a standby streams from the primary again: the relay waits for its standbys", "table", table, "alone_for", time.Since(a.since).Round(time.Second))
	}
	a.since, a.said = time.Time{}, time.Time{}
}

// pause waits for d, and reports false if ctx ended first.
func pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// flushLooks is how often a pass looks again whether the server has
// flushed its log far enough before it makes it flush: each look is a
// round trip on the pass's connection, and with producers that commit
// synchronously the log is flushed far enough within a few of them in all
// but a few passes in a hundred (make measure-relays, flushed-%).
const flushLooks = 5

// flushLookAfter is the wait before the second look; each next one waits
// twice as long (all five looks: 3.75 ms at most).
const flushLookAfter = 250 * time.Microsecond

// flush makes sure the server has flushed its log up to lsn before the pass
// publishes, and reports whether it had to make it flush. The log that was
// not flushed as the claim began is mostly that of producers still in their
// transactions, whose synchronous commits flush it a moment later: so it
// first looks again, flushLooks times at most, on the pass's connection.
// Only if the log is still not flushed that far does it commit flushWAL on
// a second connection of the relay's pool (the pass's is inside its
// transaction), then check again. That is needed when some producer commits
// asynchronously, or when nothing commits after a write to the log (a
// transaction still open, vacuum).
func (r *OutboxRelay) flush(ctx context.Context, tx txn, lsn string) (flushed bool, err error) {
	var done bool
	for look := range flushLooks {
		if look > 0 && !pause(ctx, flushLookAfter<<(look-1)) {
			return false, ctx.Err()
		}
		if err := tx.queryRow(ctx, walFlushed, lsn).Scan(&done); err != nil || done {
			return false, err
		}
	}
	if err := r.db.exec(ctx, flushWAL); err != nil {
		return true, err
	}
	if err := tx.queryRow(ctx, walFlushed, lsn).Scan(&done); err != nil {
		return true, err
	}
	if !done {
		return true, errors.New("the server's log is still not flushed after a synchronous commit: is the pool's every connection to the same server?")
	}
	return true, nil
}

// cannotPass reports whether err holds a server error that the same
// statement would meet again however often it is retried: SQLSTATE class 42
// (a table, column or function that does not exist, a permission denied)
// or 3D000 (a database that does not exist).
func cannotPass(err error) bool {
	if errors.Is(err, ErrStandbysUnreadable) {
		return true
	}
	code := sqlState(err)
	return strings.HasPrefix(code, "42") || code == "3D000"
}

// publish publishes msgs from the first, as many at once as the broker and
// the relay's order allow (see send), and returns how many the broker
// accepted and, if it did not accept them all, the error of the first it did
// not accept.
//
// A pass with order per aggregate holds only runs of each aggregate from its
// first unsent row, and the next row of an aggregate is claimed only once
// the rows before it are marked: so a batch that holds no aggregate twice
// breaks no order a consumer relies on, whatever the broker stores after a
// message it refused. Over the whole table it would: so without
// order per aggregate the relay sends a batch only to a [SequencePublisher].
func (r *OutboxRelay) publish(ctx context.Context, msgs []claimed) (int, error) {
	_, batches := r.broker.(BatchPublisher)
	if _, sequences := r.broker.(SequencePublisher); !sequences && !(batches && !r.cfg.WholeTable) {
		return sendOne(ctx, r.telemetry(), r.broker, msgs[0].Message) // one at a time: nothing to copy
	}
	batch := make([]Message, len(msgs))
	for i, m := range msgs {
		batch[i] = m.Message
	}
	return send(ctx, r.telemetry(), r.broker, batch, !r.cfg.WholeTable)
}

// send publishes msgs from the first, each in a send span: through a
// [BatchPublisher], if byAggregate, as many as hold no aggregate twice
// (batchOf), unless that is fewer than all of them and the broker is a
// [SequencePublisher] too; through a [SequencePublisher], all of them;
// otherwise the first alone. An asynchronous batch costs the broker no more
// than a sequence (natsbroker's REFERENCE.md measures both), so it goes
// first where it keeps the order. send returns how many the
// broker accepted, from the first, and, if not all it sent, the error of the
// first it did not accept.
func send(ctx context.Context, tel *relayTelemetry, broker MessageBroker, msgs []Message, byAggregate bool) (int, error) {
	sp, sequences := broker.(SequencePublisher)
	if bp, ok := broker.(BatchPublisher); ok && byAggregate {
		if n := batchOf(msgs, len(msgs)); n > 1 && (n == len(msgs) || !sequences) {
			return publishBatch(ctx, tel, broker, bp.PublishBatch, msgs[:n])
		}
	}
	if sequences && len(msgs) > 1 {
		return publishBatch(ctx, tel, broker, sp.PublishSequence, msgs)
	}
	return sendOne(ctx, tel, broker, msgs[0])
}

// sendOne publishes msg in a send span, and returns 1 if the broker
// accepted it, or 0 and its error.
func sendOne(ctx context.Context, tel *relayTelemetry, broker MessageBroker, msg Message) (int, error) {
	msg, span := tel.startSend(ctx, messagingSystem(broker), msg)
	err := broker.Publish(ctx, msg)
	tel.endSend(ctx, span, err)
	if err != nil {
		return 0, err
	}
	return 1, nil
}

// without is msgs without the rows of aggregate (none if it is empty).
func without(msgs []claimed, aggregate string) []claimed {
	if aggregate == "" {
		return msgs
	}
	var rest []claimed
	for _, m := range msgs {
		if m.Aggregate != aggregate {
			rest = append(rest, m)
		}
	}
	return rest
}

// publishBatch publishes msgs with publish (a BatchPublisher's PublishBatch
// or an SequencePublisher's PublishSequence), each in a send span, and returns how many the broker accepted, from the first, and, if not all, the error
// of the first it did not accept. A broker that misreports is taken for one
// that is down.
func publishBatch(ctx context.Context, tel *relayTelemetry, broker MessageBroker,
	publish func(context.Context, []Message) (int, error), msgs []Message) (int, error) {
	batch := make([]Message, len(msgs))
	spans := make([]trace.Span, len(msgs))
	for i, m := range msgs {
		batch[i], spans[i] = tel.startSend(ctx, messagingSystem(broker), m)
	}
	n, err := publish(ctx, batch)
	switch {
	case n < 0 || n > len(msgs):
		err = fmt.Errorf("broker says it accepted %d of %d messages: %w", n, len(msgs), ErrBrokerUnavailable)
		n = 0
	case n < len(msgs) && err == nil:
		err = fmt.Errorf("broker accepted %d of %d messages and gave no error for the next: %w", n, len(msgs), ErrBrokerUnavailable)
	case n == len(msgs):
		err = nil
	}
	for i, span := range spans {
		switch {
		case i < n:
			tel.endSend(ctx, span, nil)
		case i == n:
			tel.endSend(ctx, span, err)
		default: // sent after the first failure: goes again, whatever the broker did with it
			span.SetAttributes(attribute.Bool("outbox.acknowledged", false))
			span.End()
		}
	}
	return n, err
}

// claimed is a claimed row: its message, and how often the broker rejected
// it before.
type claimed struct {
	Message
	rejections int
}

// failure is a failed publish, to be written to its row.
type failure struct {
	id             int64
	key            string
	err            error
	rejected, park bool
	backOff        bool // its row is not claimed again before its retry_at
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// orDefault is v, or def where v is zero or less: how every field and
// argument of this package that says "zero or less means the default" reads.
func orDefault[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

// millis is d in whole milliseconds, at least 1, as the server's timeout
// settings take it (0 would turn the timeout off).
func millis(d time.Duration) string {
	return strconv.FormatInt(max(1, int64((d+time.Millisecond-1)/time.Millisecond)), 10)
}
