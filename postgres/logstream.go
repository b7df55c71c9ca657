package postgres

// The log relay's loop: a session on the replication connection, and the
// stream of its transactions, delivered and confirmed.

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/trace"
)

// Run streams the outbox's inserts and publishes them until ctx ends, then
// returns ctx's error. After a failure (the connection lost, the broker
// refusing or not answering) it connects again after a backoff, like
// [OutboxRelay.Run]'s, and the server sends again every transaction after
// the last one confirmed. It returns, with the error, when no retry can
// mend it: the slot does not exist ([ErrNoSlot]), was invalidated
// ([ErrSlotLost]), belongs to another database on the server
// ([ErrSlotOfAnotherDatabase]), or the role may not replicate; and at once,
// with [ErrInvalidConfig], for a LogRelay that no NewLogRelay made.
func (r *LogRelay) Run(ctx context.Context) error {
	if r == nil || r.connConfig == nil || r.broker == nil || r.outbox == nil {
		return fmt.Errorf("%w: a LogRelay made by no Outbox's NewLogRelay", ErrInvalidConfig)
	}
	r.tel = newRelayTelemetry(r.cfg.TracerProvider, r.cfg.MeterProvider, r.table, "log", messagingSystem(r.broker))
	maxBackoff := orDefault(r.cfg.MaxBackoff, DefaultMaxBackoff)
	wait := r.wait
	if wait == nil {
		wait = pause
	}
	var markIn *sql.DB // where the marks are written and the rejections counted, unless Unmarked
	if !r.cfg.Unmarked {
		db, release := r.sqldb()
		defer release()
		markIn = db
	}
	failures := 0
	recovering := false // a recovery failed: it goes again before any session
	for {
		var completed int
		var err error
		if !recovering {
			completed, err = r.session(ctx, markIn)
			if ctx.Err() != nil {
				return ctx.Err()
			}
		}
		if r.cfg.RecoverSlot && (recovering || errors.Is(err, ErrNoSlot) || errors.Is(err, ErrSlotLost)) {
			if r.cfg.Logger != nil && !recovering {
				r.cfg.Logger.Warn("outbox: the log relay's slot is gone: making it anew, and publishing what it may have missed", "slot", r.cfg.Slot, "err", err)
			}
			n, rerr := r.Recover(ctx)
			if rerr == nil {
				if r.cfg.Logger != nil {
					r.cfg.Logger.Info("outbox: log relay slot recovered", "slot", r.cfg.Slot, "published", n)
				}
				failures, recovering = 0, false
				continue
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			// Tried again, whole, after the backoff, and not a session
			// before it: the new slot streams only what committed after
			// it, and the rows before it are what the recovery publishes.
			recovering = true
			err = fmt.Errorf("recover the slot: %w", rerr)
		} else if errors.Is(err, ErrNoSlot) || errors.Is(err, ErrSlotLost) || errors.Is(err, ErrSlotOfAnotherDatabase) || sqlState(err) == "42501" || sqlState(err) == "28000" {
			if r.cfg.Logger != nil {
				r.cfg.Logger.Error("outbox: log relay stopped", "err", err)
			}
			return err
		}
		if completed > 0 { // progress of the slot, not messages sent again

			failures = 0
		}
		failures++
		d := backoff(failures, maxBackoff, rand.Float64)
		if r.cfg.OnPass != nil {
			r.cfg.OnPass(PassReport{Err: err})
		}
		switch {
		case errors.Is(err, ErrSlotActive): // a standby, behind the relay that reads the slot
			d = min(d, StandbyRetry)
			if r.cfg.Logger != nil {
				r.cfg.Logger.Info("outbox: log relay standing by: another relay reads the slot", "slot", r.cfg.Slot, "retry_in", d)
			}
		case r.cfg.Logger != nil:
			r.cfg.Logger.Error("outbox: log relay session failed", "err", err, "transactions_delivered", completed, "retry_in", d)
		}
		if !wait(ctx, d) {
			return ctx.Err()
		}
	}
}

// session streams from the slot's position on one replication connection
// until it fails, and reports how many messages it delivered. It marks in
// markIn, unless that is nil.
func (r *LogRelay) session(ctx context.Context, markIn *sql.DB) (completed int, err error) {
	cfg := r.connConfig.Copy()
	cfg.RuntimeParams["replication"] = "database"
	// The text form of the columns decodeRow reads depends on these: pinned
	// here, after whatever the role, the database or the connection
	// string's options set (bytea_output = escape wedged the relay).
	for name, value := range decodingSettings {
		cfg.RuntimeParams[name] = value
	}
	if cfg.RuntimeParams["application_name"] == "" {
		cfg.RuntimeParams["application_name"] = "outbox-log-relay"
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return 0, fmt.Errorf("log relay: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))

	slot, publication := r.cfg.Slot, r.cfg.Publication
	// Read before the stream starts: once it has, the connection takes no
	// more queries.
	every := orDefault(r.cfg.StatusInterval, 10*time.Second)
	if half := senderTimeout(ctx, conn) / 2; half > 0 && half < every {
		every = half
	}
	// The server refuses another database's slot with the SQLSTATE of an
	// invalidated one: ask first, so that the two are never taken for each
	// other.
	if theirs := slotElsewhere(ctx, conn, slot); theirs != "" {
		return 0, fmt.Errorf("%w: %s is database %q's", ErrSlotOfAnotherDatabase, slot, theirs)
	}
	var held map[string]uint32 // unless Unmarked, the aggregates held back as the session begins
	if markIn != nil {
		if held, err = heldAggregates(ctx, conn, r.table); err != nil {
			return 0, fmt.Errorf("log relay: read the aggregates held back: %w", err)
		}
	}
	// Position 0: from where the slot says the relay confirmed.
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + publication + "'"},
	})
	switch code := sqlState(err); {
	case code == "42704": // undefined_object
		return 0, fmt.Errorf("%w: %s: %w", ErrNoSlot, slot, err)
	case code == "55000": // object_not_in_prerequisite_state: "can no longer get changes"
		return 0, fmt.Errorf("%w: %s: %w", ErrSlotLost, slot, err)
	case code == "55006": // object_in_use: "is active for PID", another relay reads it
		return 0, fmt.Errorf("%w: %s: %w", ErrSlotActive, slot, err)
	case err != nil:
		return 0, fmt.Errorf("log relay: start replication from slot %s: %w", slot, err)
	}

	s := stream{
		relay:     r,
		conn:      conn,
		relations: map[uint32]*pglogrepl.RelationMessage{},
		types:     pgtype.NewMap(),
		every:     every,
		replyIn:   orDefault(r.cfg.ReplyTimeout, 10*time.Second),
	}
	if markIn != nil {
		s.marks, s.markIn, s.held = newMarks(r, markIn), markIn, held
	}
	err = s.run(ctx)
	// Whatever ended the session, the server hears how far the broker
	// accepted, so that a clean stop, or a failure after a delivery, sends
	// again at most the transaction in flight.
	// A connection that failed is being closed by pgconn, in a goroutine of
	// its own: nothing more may be written to it.
	if s.marks != nil {
		s.marks.finish(context.WithoutCancel(ctx)) // each mark bounded by PublishTimeout
	}
	if s.safe() > s.toldPos && !conn.IsClosed() {
		final, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		s.tell(final)
		cancel()
	}
	return s.completed, err
}

// decodingSettings are the settings of the replication session that pgoutput's
// text form of a row depends on, as decodeRow reads it: bytea in hex, dates
// in ISO 8601 (with their offset, so any TimeZone reads alike), text in
// UTF-8. No other column it reads has a text form a setting changes.
var decodingSettings = map[string]string{"bytea_output": "hex", "DateStyle": "ISO, MDY", "client_encoding": "UTF8"}

// slotElsewhere is the name of the database the slot named slot belongs
// to, if it is not the one conn is on; empty if it is, or if it cannot be
// told. It is asked before the stream starts, on the replication
// connection, which takes plain queries until then.
func slotElsewhere(ctx context.Context, conn *pgconn.PgConn, slot string) string {
	q := `SELECT database FROM pg_replication_slots WHERE slot_name = '` + strings.ReplaceAll(slot, "'", "''") +
		`' AND database IS DISTINCT FROM current_database()`
	res, err := conn.Exec(ctx, q).ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 {
		return ""
	}
	return string(res[0].Rows[0][0])
}

// senderTimeout is the server's wal_sender_timeout, or 0 if it cannot be
// read or is off.
func senderTimeout(ctx context.Context, conn *pgconn.PgConn) time.Duration {
	res, err := conn.Exec(ctx, `SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout'`).ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 {
		return 0
	}
	ms, err := strconv.Atoi(string(res[0].Rows[0][0]))
	if err != nil || ms <= 0 {
		return 0
	}
	return time.Duration(ms) * time.Millisecond
}

// stream is one session's state: the tables' descriptions the server sent,
// the transaction being read, and how far the relay has delivered.
type stream struct {
	relay     *LogRelay
	conn      *pgconn.PgConn
	relations map[uint32]*pglogrepl.RelationMessage
	types     *pgtype.Map   // decodes the text form of the columns; not safe for concurrent use
	txn       []Message     // the rows of the transaction being read, not yet published: at most streamRows
	tables    []string      // each txn row's table, as an SQL identifier
	txnBytes  int           // the payloads' bytes in txn: at most about streamBytes
	inTxn     bool          // a BEGIN was read and its COMMIT not yet
	xid       uint32        // the transaction being read (BEGIN's), for the marks
	commitLSN pglogrepl.LSN // its commit's position (BEGIN's final LSN), which StandbyCount standbys must have flushed
	onStandby bool          // they have, and the transaction's rows may go
	txnDone   int           // rows of the transaction being read published already
	sentIDs   []int64       // rows published and not yet handed to the marks, their keys and their tables
	sentKeys  []string
	sentIn    []string
	marks     *marks            // unless Unmarked, the marking of what was delivered
	markIn    *sql.DB           // unless Unmarked, where the marks go and rejections are counted
	held      map[string]uint32 // unless Unmarked, the aggregates held back, each by the transaction that last held it (0: before the session)
	confirmed pglogrepl.LSN     // the end of the last transaction delivered whole, or a keepalive's position past it
	toldPos   pglogrepl.LSN     // the position the server was last told
	told      time.Time         // when the server was last told where the relay is
	asked     time.Time         // when a status update asked for an answer that has not come; zero if none waits
	every     time.Duration
	replyIn   time.Duration
	delivered int
	completed int // transactions delivered whole and confirmed: the session's progress
}

// statusAfterDelivery is how soon after a delivered transaction the server
// hears of it, at the latest: often enough that a restart sends little
// again, seldom enough that a burst of small transactions costs few
// messages.
const statusAfterDelivery = 100 * time.Millisecond

func (s *stream) run(ctx context.Context) error {
	for {
		if s.marks != nil {
			s.marks.poll(ctx)
		}
		if time.Now().After(s.nextTell()) {
			if err := s.tell(ctx); err != nil {
				return err
			}
		}
		deadline := s.nextTell()
		if !s.asked.IsZero() && s.asked.Add(s.replyIn).Before(deadline) {
			deadline = s.asked.Add(s.replyIn)
		}
		rctx, cancel := context.WithDeadline(ctx, deadline)
		raw, err := s.conn.ReceiveMessage(rctx)
		cancel()
		switch {
		case err != nil && pgconn.Timeout(err) && ctx.Err() == nil:
			if !s.asked.IsZero() && time.Since(s.asked) >= s.replyIn {
				return fmt.Errorf("log relay: the server did not answer a status update within %v: the connection is taken for dead", s.replyIn)
			}
			continue // time to tell the server where the relay is
		case err != nil:
			return fmt.Errorf("log relay: receive: %w", err)
		}
		s.asked = time.Time{} // the server answers: the connection lives
		switch msg := raw.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("log relay: %w", pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.CopyData:
			if err := s.handle(ctx, msg.Data); err != nil {
				return err
			}
		}
	}
}

// nextTell is when the server is to hear next where the relay is: within
// statusAfterDelivery of a delivery it has not heard of, and every
// interval anyway.
func (s *stream) nextTell() time.Time {
	if s.confirmed > s.toldPos {
		return s.told.Add(statusAfterDelivery)
	}
	return s.told.Add(s.every)
}

// handle handles one message of the replication stream.
func (s *stream) handle(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		k, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("log relay: %w", err)
		}
		// Everything the server sent before the keepalive has been read;
		// with no transaction half read, the relay has delivered all of it,
		// and the log up to here holds nothing more for it (other tables'
		// changes, transactions with no outbox row). Confirming it lets the
		// server free that log.
		if !s.inTxn && k.ServerWALEnd > s.confirmed {
			s.confirmed = k.ServerWALEnd
		}
		if k.ReplyRequested {
			return s.tell(ctx)
		}
	case pglogrepl.XLogDataByteID:
		x, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("log relay: %w", err)
		}
		m, err := pglogrepl.Parse(x.WALData)
		if err != nil {
			return fmt.Errorf("log relay: decode: %w", err)
		}
		switch m := m.(type) {
		case *pglogrepl.RelationMessage:
			s.relations[m.RelationID] = m
		case *pglogrepl.BeginMessage:
			if s.relay.sent != nil {
				s.relay.sent(m.CommitTime, x.ServerTime)
			}
			s.txn, s.tables, s.txnBytes = s.txn[:0], s.tables[:0], 0
			s.inTxn, s.xid, s.txnDone, s.sentIDs, s.sentKeys, s.sentIn = true, m.Xid, 0, s.sentIDs[:0], s.sentKeys[:0], s.sentIn[:0]
			s.commitLSN, s.onStandby = m.FinalLSN, false
		case *pglogrepl.InsertMessage:
			rel, ok := s.relations[m.RelationID]
			if !ok {
				return fmt.Errorf("log relay: an insert into relation %d, which the server never described", m.RelationID)
			}
			table := pgx.Identifier{rel.Namespace, rel.RelationName}.Sanitize()
			msg, scheduled, err := decodeRow(s.types, rel, m.Tuple)
			if err != nil {
				// Read again, it fails again: parked, with the reason, it
				// no longer holds the log (a session before this one may
				// have parked it already, and failed later in the
				// transaction); where it cannot be, the session fails.
				if msg.ID == 0 || !s.parkUnreadable(ctx, table, msg, err) {
					return err
				}
				s.hold(msg.Aggregate)
				return nil
			}
			if scheduled {
				// Written with a time to deliver still to come: the log
				// carries it now, too soon. A polling pass releases it at
				// its time and publishes it (see LogRelay), and its
				// aggregate's later rows wait behind it.
				s.hold(msg.Aggregate)
				return nil
			}
			if held, err := s.heldBack(ctx, table, msg); err != nil {
				return err
			} else if held {
				return nil // left unsent, for a polling pass to publish after the row that holds it back
			}
			s.txn = append(s.txn, msg)
			s.tables = append(s.tables, table)
			s.txnBytes += len(msg.Payload)
			// pgoutput (proto_version 1) sends a transaction only once it
			// committed, so its rows may go before its COMMIT is read:
			// memory is bounded by these, not by the transaction. Its end
			// is confirmed only at the COMMIT, after its last row went.
			if len(s.txn) >= streamRows || s.txnBytes >= streamBytes {
				return s.deliver(ctx, 0)
			}
		case *pglogrepl.CommitMessage:
			return s.deliver(ctx, m.TransactionEndLSN)
		}
	}
	return nil
}

// streamRows and streamBytes bound the rows of a transaction the log relay
// holds before it publishes them: a transaction of a million rows goes in
// parts of at most streamRows rows, or about streamBytes of payload.
const (
	streamRows  = 1000
	streamBytes = 8 << 20
)

// deliver publishes the rows of the transaction read so far in their order
// and, at its COMMIT (end is then the transaction's end; 0 for a part of
// it), once the broker accepted every row of the transaction, hands them to
// the marks and confirms its end.
func (s *stream) deliver(ctx context.Context, end pglogrepl.LSN) (err error) {
	timeout := orDefault(s.relay.cfg.PublishTimeout, DefaultPassTimeout)
	tel, start := s.relay.tel, time.Now()
	var span trace.Span // a transaction's delivery, or a part's, is the log relay's pass
	if len(s.txn) > 0 {
		ctx, span = tel.tracer.Start(ctx, "outbox log relay transaction", trace.WithTimestamp(start))
	}
	res := passResult{claimed: len(s.txn)}
	defer func() {
		tel.endPass(ctx, span, start, res, err)
		if s.relay.cfg.OnPass != nil {
			s.relay.cfg.OnPass(PassReport{Claimed: res.claimed, Published: res.published, Marked: res.marked, Err: err})
		}
	}()
	if cfg := s.relay.cfg; len(s.txn) > 0 && cfg.StandbyCount > 0 && !s.onStandby && s.markIn != nil {
		wctx, cancel := context.WithTimeout(ctx, timeout)
		err := waitForStandbyCount(wctx, sqlPool{s.markIn}, s.commitLSN.String(), cfg.StandbyCount, cfg.PublishWithoutStandbys, &s.relay.alone, cfg.Logger, s.relay.table)
		cancel()
		if err != nil {
			return fmt.Errorf("transaction %d, committed at %s: %w", s.xid, s.commitLSN, err)
		}
		s.onStandby = true
	}
	for i := 0; i < len(s.txn); {
		pctx, cancel := context.WithTimeout(ctx, timeout)
		accepted, err := send(pctx, s.relay.tel, s.relay.broker, s.txn[i:min(len(s.txn), i+DefaultBatchSize)], true)
		cancel()
		for j := i; j < i+accepted; j++ {
			s.sentIn, s.sentIDs, s.sentKeys = append(s.sentIn, s.tables[j]), append(s.sentIDs, s.txn[j].ID), append(s.sentKeys, s.txn[j].Key)
		}
		s.delivered += accepted
		res.published += accepted
		i += accepted
		if err != nil && errors.Is(err, ErrRejected) && s.park(ctx, i, err) {
			// Set aside: the rest of the transaction goes on, but for the
			// rows of its aggregate, which it holds back.
			s.hold(s.txn[i].Aggregate)
			s.leaveOut(i+1, s.txn[i].Aggregate)
			i++
			continue
		}
		if err != nil {
			return fmt.Errorf("publish message %d, row %d of a transaction, which goes again whole: %w",
				s.txn[i].ID, s.txnDone+i+1, err)
		}
		// A large transaction takes long to publish: the server hears from
		// the relay all the same, at the old position, so that it does not
		// end the session at its wal_sender_timeout.
		if time.Since(s.told) >= s.every {
			if err := s.tell(ctx); err != nil {
				return err
			}
		}
	}
	s.txnDone += len(s.txn)
	s.txn, s.tables, s.txnBytes = s.txn[:0], s.tables[:0], 0
	if s.marks != nil && (len(s.sentIDs) > 0 || end != 0 && s.txnDone > 0) {
		s.marks.delivered(ctx, s.sentIn, s.sentIDs, s.sentKeys, s.xid, end)           // a part's (end 0) moves no position
		s.sentIn, s.sentIDs, s.sentKeys = s.sentIn[:0], s.sentIDs[:0], s.sentKeys[:0] // the marks copied them
	}
	if end == 0 {
		return nil // a part: the rest of the transaction, and its COMMIT, to come
	}
	if s.marks == nil {
		res.marked = res.published // confirmed, as far as the relay goes
	}
	s.inTxn = false
	s.confirmed = end
	s.completed++
	if time.Since(s.told) >= statusAfterDelivery {
		return s.tell(ctx)
	}
	return nil
}

// batchOf is how many of msgs, from the first and at most limit, go in one
// batch: up to the first message whose aggregate is already in it. A batch
// is sent before any of its acks is read, so the broker may store a message
// after one it refused; with no aggregate twice in a batch, that breaks no
// order a consumer relies on (rows with no aggregate are in no order).
func batchOf(msgs []Message, limit int) int {
	seen := map[string]bool{}
	n := 0
	for _, m := range msgs[:min(len(msgs), limit)] {
		if m.Aggregate != "" {
			if seen[m.Aggregate] {
				break
			}
			seen[m.Aggregate] = true
		}
		n++
	}
	return n
}

// park counts the broker's refusal of the transaction's row i in its database,
// within PublishTimeout, and, once the row's rejections reach ParkAfter, parks
// it, logs it and reports true: the relay then skips it. Unmarked, with
// NeverPark, or if the count cannot be written, it reports false, and the
// refusal stops the session as any failure does.
func (s *stream) park(ctx context.Context, i int, refusal error) bool {
	r := s.relay
	if s.markIn == nil || r.cfg.ParkAfter <= 0 {
		return false
	}
	msg := s.txn[i]
	var parked bool
	ctx, cancel := context.WithTimeout(ctx, orDefault(r.cfg.PublishTimeout, DefaultPassTimeout))
	defer cancel()
	var counted sql.NullBool
	var otherKey bool
	err := s.markIn.QueryRowContext(ctx, fmt.Sprintf(countRejection, s.tables[i]),
		msg.ID, refusal.Error(), r.cfg.ParkAfter, msg.Key).Scan(&counted, &otherKey)
	switch {
	case err == nil && otherKey:
		// As a mark does (logMark): the row the log carried is not in the
		// table, and another row holds its id (a failover handed it out
		// again). That row is not the refused one; nothing is left to
		// park, nor ever to publish.
		if r.cfg.Logger != nil {
			r.cfg.Logger.Warn("outbox: log relay left a refused message: the table no longer has its row, and another row holds its id",
				"id", msg.ID, "key", msg.Key, "err", refusal)
		}
		return true
	case err != nil || !counted.Valid:
		if r.cfg.Logger != nil {
			r.cfg.Logger.Error("outbox: log relay could not count a rejection", "id", msg.ID, "key", msg.Key, "err", err)
		}
		return false
	}
	parked = counted.Bool
	if parked && r.cfg.Logger != nil {
		r.cfg.Logger.Warn("outbox: message parked after too many rejections", "id", msg.ID, "key", msg.Key, "err", refusal)
	}
	return parked
}

// countRejection counts a broker's refusal of the row $1 of a table (%s)
// whose key is $4 (any, if empty), with the reason $2, and parks it at its
// $3rd; it returns whether the row is parked now (NULL if there is no such
// row, or it is not visible yet), and whether a row of another key holds
// the id instead, as the marks find a row (logMark).
const countRejection = `
WITH counted AS (
	UPDATE %[1]s SET attempts = attempts + 1, rejections = rejections + 1, last_error = $2,
	    parked_at = CASE WHEN rejections + 1 >= $3 THEN clock_timestamp() END
	WHERE id = $1 AND ($4 = '' OR message_key::text = $4)
	RETURNING parked_at IS NOT NULL AS parked)
SELECT (SELECT parked FROM counted),
       EXISTS (SELECT FROM %[1]s WHERE id = $1 AND $4 <> '' AND message_key::text <> $4)`

// parkUnreadableRow parks the row $1 of a table (%s) whose key is $2 (any,
// if empty), unsent and not parked, with the reason $3, and returns
// whether it did; whether the row was parked, or sent, already (by a
// session before, which failed after it parked the row and before the
// server heard it was past the row's transaction); and whether a row of
// another key holds the id instead, as the marks find a row (logMark).
const parkUnreadableRow = `
WITH parked AS (
	UPDATE %[1]s SET attempts = attempts + 1, last_error = $3, parked_at = clock_timestamp()
	WHERE id = $1 AND ($2 = '' OR message_key::text = $2) AND sent_at IS NULL AND parked_at IS NULL
	RETURNING 1)
SELECT EXISTS (SELECT FROM parked),
       EXISTS (SELECT FROM %[1]s WHERE id = $1 AND ($2 = '' OR message_key::text = $2)
               AND coalesce(parked_at, sent_at) IS NOT NULL),
       EXISTS (SELECT FROM %[1]s WHERE id = $1 AND $2 <> '' AND message_key::text <> $2)`

// An aggregate with a row parked, scheduled for later, or left unsent
// behind one, is held back: the log relay leaves its later rows unsent, in
// the table, where a polling pass (OutboxRelay's, outbox-relay's sweep)
// publishes them after the row that holds them, in their order, as it keeps
// an aggregate behind its parked and scheduled rows. The relay lets go of
// an aggregate at its next row that no unsent row of the aggregate comes
// before, in a snapshot that sees the transaction that last held it.

// heldAggregates reads the aggregates of table that a row holds back as
// the session begins, as the polling relay's claim reads them
// (outbox_held): a row not sent that is parked, scheduled for later, or
// was tried and failed, which an unparked row still is until a polling
// pass publishes it. It reads them on the replication connection conn,
// which takes plain queries until the stream starts.
func heldAggregates(ctx context.Context, conn *pgconn.PgConn, table string) (map[string]uint32, error) {
	res, err := conn.Exec(ctx, `SELECT DISTINCT aggregate FROM `+pgx.Identifier{table}.Sanitize()+`
		WHERE sent_at IS NULL AND aggregate IS NOT NULL AND (parked_at IS NOT NULL OR attempts > 0 OR deliver_at IS NOT NULL)`).ReadAll()
	if err != nil {
		return nil, err
	}
	held := map[string]uint32{}
	for _, r := range res {
		for _, row := range r.Rows {
			held[string(row[0])] = 0
		}
	}
	return held, nil
}

// hold holds back aggregate (none if empty), by the transaction being read.
// Unmarked, nothing is held back.
func (s *stream) hold(aggregate string) {
	if aggregate != "" && s.held != nil {
		s.held[aggregate] = s.xid
	}
}

// leaveOut takes the rows of aggregate, from the transaction's row from on,
// out of those to publish: they stay unsent.
func (s *stream) leaveOut(from int, aggregate string) {
	if aggregate == "" {
		return
	}
	n := from
	for j := from; j < len(s.txn); j++ {
		if s.txn[j].Aggregate != aggregate {
			s.txn[n], s.tables[n] = s.txn[j], s.tables[j]
			n++
		}
	}
	s.txn, s.tables = s.txn[:n], s.tables[:n]
}

// stillHeld reports whether an unsent row of aggregate comes before id in
// table, or the transaction xid (0: none) that last held the aggregate is
// not yet visible to the query's snapshot, which then cannot tell.
var stillHeld = `
SELECT ($3 <> 0 AND NOT pg_visible_in_snapshot(` + fullXid("snap.xmax", "$3::bigint") + `::text::xid8, snap.s))
       OR EXISTS (SELECT FROM %s WHERE aggregate = $1 AND id < $2 AND sent_at IS NULL)
FROM (SELECT s, pg_snapshot_xmax(s)::text::bigint AS xmax FROM pg_current_snapshot() AS s) snap`

// heldBack reports whether msg, a row of table, is held back behind an
// earlier row of its aggregate, and if so holds the aggregate by it;
// otherwise it lets go of the aggregate. Within PublishTimeout.
func (s *stream) heldBack(ctx context.Context, table string, msg Message) (bool, error) {
	by, ok := s.held[msg.Aggregate]
	switch {
	case msg.Aggregate == "" || !ok:
		return false, nil
	case by != 0 && by == s.xid: // held by a row of this very transaction
		return true, nil
	}
	ctx, cancel := context.WithTimeout(ctx, orDefault(s.relay.cfg.PublishTimeout, DefaultPassTimeout))
	defer cancel()
	var held bool
	if err := s.markIn.QueryRowContext(ctx, fmt.Sprintf(stillHeld, table), msg.Aggregate, msg.ID, int64(by)).Scan(&held); err != nil {
		return false, fmt.Errorf("log relay: is %s held back before row %d: %w", msg.Aggregate, msg.ID, err)
	}
	if !held {
		delete(s.held, msg.Aggregate)
		return false, nil
	}
	s.held[msg.Aggregate] = s.xid
	if l := s.relay.cfg.Logger; l != nil {
		l.Info("outbox: log relay left a row unsent behind an earlier one of its aggregate", "id", msg.ID, "aggregate", msg.Aggregate)
	}
	return true, nil
}

// parkUnreadable parks msg's row of table, which the relay could not read
// (err says why; msg holds what could be read of it, its id and key), by
// its id and key, within PublishTimeout, logs it and reports true: the
// relay then skips it. A row parked (or sent) already, by a session that
// failed after it parked it, is skipped too; so is one the table no longer
// has, another row of another key holding its id. Unmarked, or if the row
// cannot be parked (the mark's snapshot does not see it yet, or the
// statement fails), it reports false.
func (s *stream) parkUnreadable(ctx context.Context, table string, msg Message, err error) bool {
	r := s.relay
	if s.markIn == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, orDefault(r.cfg.PublishTimeout, DefaultPassTimeout))
	defer cancel()
	var parked, before, otherKey bool
	perr := s.markIn.QueryRowContext(ctx, fmt.Sprintf(parkUnreadableRow, table), msg.ID, msg.Key, err.Error()).Scan(&parked, &before, &otherKey)
	switch {
	case perr == nil && otherKey:
		if r.cfg.Logger != nil {
			r.cfg.Logger.Warn("outbox: log relay left a row it cannot read: the table no longer has it, and another row holds its id",
				"id", msg.ID, "key", msg.Key, "err", err)
		}
		return true
	case perr == nil && parked:
		if r.cfg.Logger != nil {
			r.cfg.Logger.Warn("outbox: message parked: the log relay cannot read it", "id", msg.ID, "key", msg.Key, "err", err)
		}
		return true
	case perr == nil && before:
		if r.cfg.Logger != nil {
			r.cfg.Logger.Info("outbox: log relay passed over a row it cannot read, parked before", "id", msg.ID, "key", msg.Key)
		}
		return true
	}
	if r.cfg.Logger != nil {
		r.cfg.Logger.Error("outbox: log relay could not park a row it cannot read", "id", msg.ID, "key", msg.Key, "err", err, "park_err", perr)
	}
	return false
}

// safe is the position the server may hear of: how far the relay
// delivered, or, unless Unmarked, how far it delivered and marked.
func (s *stream) safe() pglogrepl.LSN {
	if s.marks == nil || s.marks.idle() {
		return s.confirmed
	}
	return s.marks.markedTo
}

// tell sends the server the position the relay has delivered up to (safe,
// or the position it told before if that is further): the server may
// forget the log before it, and starts there next time. Before the relay
// delivered anything the position is 0, which the server takes for none:
// the slot keeps its own. Each update asks the server for an answer, so
// that a connection that went silent is noticed (ReplyTimeout).
func (s *stream) tell(ctx context.Context) error {
	if s.marks != nil {
		s.marks.poll(ctx)
	}
	pos := max(s.safe(), s.toldPos)
	s.told = time.Now()
	if s.asked.IsZero() {
		s.asked = s.told
	}
	if err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn,
		pglogrepl.StandbyStatusUpdate{WALWritePosition: pos, ReplyRequested: true}); err != nil {
		return fmt.Errorf("log relay: tell the server its position: %w", err)
	}
	s.toldPos = pos
	return nil
}

// decodeRow is an inserted outbox row as a Message, from pgoutput's text
// form of its columns, and whether it was written with a time to deliver
// (migration 7's deliver_at, set only for a time still to come).
func decodeRow(types *pgtype.Map, rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) (msg Message, scheduled bool, err error) {
	if tuple == nil || len(tuple.Columns) != len(rel.Columns) {
		return msg, false, fmt.Errorf("log relay: a row of %s.%s that does not match its description", rel.Namespace, rel.RelationName)
	}
	var traceparent, tracestate string
	var first error // the first column that could not be read
	for i, col := range tuple.Columns {
		if col.DataType != pglogrepl.TupleDataTypeText {
			continue // NULL ('n'); an insert sends no unchanged TOAST ('u')
		}
		v := string(col.Data)
		switch rel.Columns[i].Name {
		case "id":
			msg.ID, err = strconv.ParseInt(v, 10, 64)
		case "message_key":
			msg.Key = v
		case "type":
			msg.Type = v
		case "payload":
			msg.Payload = v
		case "aggregate":
			msg.Aggregate = v
		case "seq":
			msg.Seq, err = strconv.ParseInt(v, 10, 64)
		case "traceparent":
			traceparent = v
		case "tracestate":
			tracestate = v
		case "deliver_at":
			scheduled = true
		case "body": // bytea's text form: \x and two hex digits a byte (bytea_output = hex, the default)
			hexDigits, ok := strings.CutPrefix(v, `\x`)
			var b []byte
			if b, err = hex.DecodeString(hexDigits); err == nil && !ok {
				err = errors.New("not in bytea's hex form (is the server's bytea_output escape?)")
			}
			msg.Payload = string(b)
		case "content_type":
			msg.ContentType = v
		case "created_at": // timestamptz's text form; in a DateStyle other than ISO, none
			if types.Scan(pgtype.TimestamptzOID, pgtype.TextFormatCode, col.Data, &msg.Time) != nil {
				msg.Time = time.Time{}
			}
		case "headers":
			msg.Headers, err = decodeHeaders(v)
		}
		if err != nil && first == nil {
			// Read on: the id and key in the columns after it name the
			// row to park.
			first = fmt.Errorf("log relay: column %s: %w", rel.Columns[i].Name, err)
		}
		err = nil
	}
	if first != nil {
		return msg, false, first
	}
	msg.TraceContext = claimedTraceContext(traceparent, tracestate)
	return msg, scheduled, nil
}
