package kafkabroker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Handler applies a message, and reports whether it was applied (false: a
// duplicate, dropped by its key). shop.Warehouse is one, through
// [postgres.Outbox.ApplyOnce].
type Handler interface {
	Handle(ctx context.Context, msg postgres.Message) (applied bool, err error)
}

// Defaults of [ConsumerOptions].
const (
	DefaultRetryDelay    = time.Second
	DefaultMaxRetryDelay = 30 * time.Second
	DefaultMaxPoll       = 100
	DefaultMaxOutOfOrder = 10
)

// ConsumerOptions configures a [Consumer]: [NewConsumer] checks it and
// refuses a bad value with an error wrapping [postgres.ErrInvalidConfig]
// that names it. Zero means the default in every field.
type ConsumerOptions struct {
	// RetryDelay is how long a message waits after a failure that may pass
	// before it is handled again, doubling after each up to MaxRetryDelay.
	RetryDelay, MaxRetryDelay time.Duration
	// MaxPoll is the most records Run takes from one poll.
	MaxPoll int
	// MaxOutOfOrder is how many times a message that arrives before its
	// predecessor (postgres.ErrOutOfOrder) is handled again, RetryDelay
	// apart, before it is set aside: within a partition an aggregate's
	// events come in their order, so that one is out of order means its
	// predecessor went elsewhere (a topic repartitioned) or was never
	// published.
	MaxOutOfOrder int
	// Logger, if not nil, is told of each failure and each message set
	// aside.
	Logger *slog.Logger
}

// Consumer feeds the records of a consumer group member to a Handler, one
// at a time, each partition's in their order, and commits a partition's
// offset only past records whose apply committed (or that were set
// aside):
//   - applied, or a duplicate: done;
//   - failed for a reason that may pass (a database down, a lock
//     timeout): handled again in place, after RetryDelay, doubling up to
//     MaxRetryDelay, for as long as it takes, so that the partition keeps
//     its order; the Logger hears of each failure;
//   - out of order (postgres.ErrOutOfOrder): handled again, MaxOutOfOrder
//     times, then set aside;
//   - never to be applied (a record that is not an outbox message, a
//     payload the handler cannot read, postgres.ErrMalformedMessage,
//     postgres.ErrPermanent, postgres.ErrNoMessageKey): set aside, logged
//     at Error with its partition and offset, and done.
//
// The client must be a consumer group member with DisableAutoCommit and
// BlockRebalanceOnPoll: partitions move between members (a rebalance) only
// between polls, after the records handled are committed, so a member that
// takes a partition over starts past them; one that dies before its commit
// leaves its records to the next member, which drops each copy by its key.
// A Consumer is not safe for concurrent use: run one Run at a time.
type Consumer struct {
	cl   *kgo.Client
	h    Handler
	opts ConsumerOptions
}

// NewConsumer returns a Consumer of cl's group that hands its records to h.
// It refuses, with an error wrapping [postgres.ErrInvalidConfig] naming
// it, no client or handler, a negative option, and a client that is no
// group member or that commits by itself or lets partitions move during a
// poll's handling (kgo's ConsumerGroup, DisableAutoCommit and
// BlockRebalanceOnPoll are needed).
func NewConsumer(cl *kgo.Client, h Handler, opts ConsumerOptions) (*Consumer, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: kafkabroker: %s", postgres.ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case cl == nil:
		return nil, bad("NewConsumer: no client")
	case h == nil:
		return nil, bad("NewConsumer: no handler")
	case opts.RetryDelay < 0 || opts.MaxRetryDelay < 0 || opts.MaxPoll < 0 || opts.MaxOutOfOrder < 0:
		return nil, bad("ConsumerOptions %+v: a negative value", opts)
	}
	if group, _ := cl.OptValue(kgo.ConsumerGroup).(string); group == "" {
		return nil, bad("the client is no consumer group member (kgo.ConsumerGroup)")
	}
	if off, _ := cl.OptValue(kgo.DisableAutoCommit).(bool); !off {
		return nil, bad("the client commits by itself: it would commit past records not yet applied (kgo.DisableAutoCommit)")
	}
	if block, _ := cl.OptValue(kgo.BlockRebalanceOnPoll).(bool); !block {
		return nil, bad("the client lets partitions move while a poll's records are handled (kgo.BlockRebalanceOnPoll)")
	}
	opts.RetryDelay = orDefault(opts.RetryDelay, DefaultRetryDelay)
	opts.MaxRetryDelay = max(orDefault(opts.MaxRetryDelay, DefaultMaxRetryDelay), opts.RetryDelay)
	opts.MaxPoll = orDefault(opts.MaxPoll, DefaultMaxPoll)
	opts.MaxOutOfOrder = orDefault(opts.MaxOutOfOrder, DefaultMaxOutOfOrder)
	return &Consumer{cl: cl, h: h, opts: opts}, nil
}

// Run handles records until ctx ends, then commits what it handled and
// returns ctx's error; a poll's fatal error (the group gone, the client
// closed) ends it too.
func (c *Consumer) Run(ctx context.Context) error {
	for {
		fetches := c.cl.PollRecords(ctx, c.opts.MaxPoll)
		if fetches.IsClientClosed() {
			return errors.New("kafkabroker: the client was closed")
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			if ctx.Err() == nil && c.opts.Logger != nil {
				c.opts.Logger.Warn("kafkabroker: fetch failed", "topic", topic, "partition", partition, "err", err)
			}
		})
		var done []*kgo.Record
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			for _, r := range p.Records {
				if !c.handle(ctx, r) {
					return // ctx ended: the rest of this poll goes to whoever reads the partition next
				}
				done = append(done, r)
			}
		})
		if len(done) > 0 {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			if err := c.cl.CommitRecords(cctx, done...); err != nil && c.opts.Logger != nil {
				c.opts.Logger.Warn("kafkabroker: commit failed: the records handled come again, and are dropped by key", "records", len(done), "err", err)
			}
			cancel()
		}
		c.cl.AllowRebalance()
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// handle hands r to the handler until it is applied, dropped as a copy or
// set aside, and reports false if ctx ended first.
func (c *Consumer) handle(ctx context.Context, r *kgo.Record) bool {
	msg, err := decode(r)
	if err != nil {
		c.setAside(r, msg, err)
		return true
	}
	outOfOrder := 0
	for failures := 0; ; {
		if ctx.Err() != nil {
			return false
		}
		_, err := c.h.Handle(ctx, msg)
		switch {
		case err == nil:
			return true
		case ctx.Err() != nil:
			return false
		case errors.Is(err, postgres.ErrMalformedMessage), errors.Is(err, postgres.ErrPermanent), errors.Is(err, postgres.ErrNoMessageKey):
			c.setAside(r, msg, err)
			return true
		case errors.Is(err, postgres.ErrOutOfOrder):
			if outOfOrder++; outOfOrder > c.opts.MaxOutOfOrder {
				c.setAside(r, msg, err)
				return true
			}
		default:
			failures++
		}
		d := c.delay(max(failures, 1))
		if c.opts.Logger != nil {
			c.opts.Logger.Warn("kafkabroker: message failed; handling it again", "key", msg.Key, "aggregate", msg.Aggregate, "seq", msg.Seq,
				"partition", r.Partition, "offset", r.Offset, "next_in", d, "err", err)
		}
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
	}
}

// delay is the wait after the n-th failure: RetryDelay doubled n-1 times,
// at most MaxRetryDelay, and of that a random point in the upper half.
func (c *Consumer) delay(n int) time.Duration {
	d := c.opts.RetryDelay << min(n-1, 20)
	if d <= 0 || d > c.opts.MaxRetryDelay {
		d = c.opts.MaxRetryDelay
	}
	return d/2 + rand.N(d/2+1)
}

// setAside logs a record that can never apply, with where it is, so that
// someone may look at it; the partition goes on past it.
func (c *Consumer) setAside(r *kgo.Record, msg postgres.Message, err error) {
	if c.opts.Logger != nil {
		c.opts.Logger.Error("kafkabroker: message set aside: it can never apply", "topic", r.Topic, "partition", r.Partition,
			"offset", r.Offset, "key", msg.Key, "type", msg.Type, "err", err)
	}
}

// errNotOutbox is the error of a record that is not an outbox message.
var errNotOutbox = errors.New("not an outbox message")

// decode is r as the Publisher published it.
func decode(r *kgo.Record) (postgres.Message, error) {
	m := postgres.Message{Payload: string(r.Value), Time: r.Timestamp}
	var id, seq string
	for _, h := range r.Headers {
		v := string(h.Value)
		switch h.Key {
		case HeaderKey:
			m.Key = v
		case HeaderID:
			id = v
		case HeaderType:
			m.Type = v
		case HeaderAggregate:
			m.Aggregate = v
		case HeaderSeq:
			seq = v
		case HeaderContentType:
			if v != "application/json" { // which a CloudEvent carries
				m.ContentType = v
			}
		case "traceparent", "tracestate":
			if m.TraceContext == nil {
				m.TraceContext = map[string]string{}
			}
			m.TraceContext[h.Key] = v
		default:
			if !postgres.ReservedHeader(h.Key) {
				if m.Headers == nil {
					m.Headers = map[string]string{}
				}
				m.Headers[h.Key] = v
			}
		}
	}
	var err error
	if m.ID, err = strconv.ParseInt(id, 10, 64); err != nil || m.Type == "" {
		return m, fmt.Errorf("%w: header %s %q, %s %q", errNotOutbox, HeaderID, id, HeaderType, m.Type)
	}
	if m.Aggregate != "" {
		if m.Seq, err = strconv.ParseInt(seq, 10, 64); err != nil {
			return m, fmt.Errorf("%w: header %s: %w", errNotOutbox, HeaderSeq, err)
		}
	}
	return m, nil
}

func orDefault[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}
