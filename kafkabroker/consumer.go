package kafkabroker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/consumer"
)

// Handler applies a message, and reports whether it was applied (false: a
// duplicate, dropped by its key). shop.Warehouse is one, through
// [postgres.Outbox.ApplyOnce]. It is the consumer core's, shared by every
// broker's Consumer.
type Handler = consumer.Handler

// BatchHandler is a Handler that can also apply several messages in one
// transaction, all or none: applied[i] reports whether msgs[i] was applied;
// on an error none was. shop.Warehouse is one, through
// [postgres.Outbox.ApplyBatch].
type BatchHandler = consumer.BatchHandler

// Defaults of [ConsumerOptions].
const (
	DefaultRetryDelay    = time.Second
	DefaultMaxRetryDelay = 30 * time.Second
	DefaultHandleTimeout = 30 * time.Second
	DefaultMaxPoll       = 100
	DefaultMaxOutOfOrder = 10
)

// ConsumerOptions configures a [Consumer]: [NewConsumer] checks it and
// refuses a bad value with an error wrapping [postgres.ErrInvalidConfig]
// that names it. Zero means the default in every field; a negative value
// is refused.
type ConsumerOptions struct {
	// RetryDelay is how long a message waits after a failure that may pass
	// before it is handled again, doubling after each up to MaxRetryDelay.
	RetryDelay, MaxRetryDelay time.Duration
	// HandleTimeout bounds each call of the Handler (and each HandleBatch):
	// one that runs out of time failed for a reason that may pass.
	HandleTimeout time.Duration
	// MaxPoll is the most records Run takes from one poll.
	MaxPoll int
	// MaxBatch is the most records of one partition, taken in a row from
	// a poll, that Run hands a BatchHandler at once: it never waits to fill
	// a batch. Zero, 1, or a handler that is no BatchHandler, means one
	// message at a time, the article's way.
	MaxBatch int
	// MaxOutOfOrder is how many times a message that arrives before its
	// predecessor (postgres.ErrOutOfOrder) is handled, RetryDelay apart,
	// before it is set aside: within a partition an aggregate's events come
	// in their order, so that one is out of order means its predecessor
	// went elsewhere (a topic repartitioned) or was never published.
	MaxOutOfOrder int
	// Logger, if not nil, is told of each message set aside, each step of
	// a backoff, and each failed fetch or commit.
	Logger *slog.Logger

	// TracerProvider and MeterProvider are where the consumer reports (nil:
	// otel's global ones), as the other brokers' Consumers do: each record
	// a span, "process <topic>", the child of the relay's publish span and
	// linked to it; messaging.client.consumed.messages counted by
	// outbox.result: applied, duplicate, retry or set_aside. They are read
	// when Run starts.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
}

// Consumer feeds the records of a consumer group member to a Handler, each
// partition's in their order, and commits a partition's offset only past
// records whose apply committed (or that were set aside):
//   - applied, or a duplicate dropped by its key: done;
//   - failed for a reason that may pass (a database down, a lock
//     timeout): handled again in place, after RetryDelay, doubling up to
//     MaxRetryDelay, for as long as it takes, so that the partition keeps
//     its order; Waiting and OldestWaiting say how many wait so and since
//     when, and the Logger hears of each step of the backoff;
//   - out of order (postgres.ErrOutOfOrder): handled again in place,
//     RetryDelay apart, MaxOutOfOrder times, then set aside;
//   - never to be applied (a record that is not an outbox message, a
//     payload the handler cannot read, postgres.ErrMalformedMessage,
//     postgres.ErrPermanent, postgres.ErrNoMessageKey): set aside, logged
//     at Error with its partition and offset, and done. Kafka has no
//     dead-letter of its own: the record stays in the topic, where the
//     log line says.
//
// With MaxBatch above 1 and a [BatchHandler], the records of a partition
// taken in a row from one poll are applied in one HandleBatch: one
// transaction and one commit for them all. A batch that fails wrote
// nothing, and its records are then handled one at a time, each as above.
//
// The client must be a consumer group member with DisableAutoCommit and
// BlockRebalanceOnPoll: partitions move between members (a rebalance) only
// between polls, after the records handled are committed, so a member that
// takes a partition over starts past them; one that dies before its commit
// leaves its records to the next member, which drops each copy by its key.
// A member handles its partitions one after another: a record that waits
// (its database down) holds back the member's other partitions, and a
// rebalance, meanwhile; more members, up to one a partition, keep
// partitions apart.
//
// A Consumer is not safe for concurrent use, but for its counters, Waiting
// and OldestWaiting: run one Run at a time. Create one with [NewConsumer].
type Consumer struct {
	cl   *kgo.Client
	opts ConsumerOptions // with the defaults filled in

	// core decides what becomes of each record, as every broker's
	// Consumer does; this one commits offsets past it.
	core *consumer.Core
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
	case opts.RetryDelay < 0, opts.MaxRetryDelay < 0, opts.HandleTimeout < 0:
		return nil, bad("ConsumerOptions: a negative duration (RetryDelay %v, MaxRetryDelay %v, HandleTimeout %v)",
			opts.RetryDelay, opts.MaxRetryDelay, opts.HandleTimeout)
	case opts.MaxPoll < 0, opts.MaxBatch < 0, opts.MaxOutOfOrder < 0:
		return nil, bad("ConsumerOptions: a negative count (MaxPoll %d, MaxBatch %d, MaxOutOfOrder %d)", opts.MaxPoll, opts.MaxBatch, opts.MaxOutOfOrder)
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
	opts.MaxRetryDelay = orDefault(opts.MaxRetryDelay, max(DefaultMaxRetryDelay, opts.RetryDelay))
	if opts.MaxRetryDelay < opts.RetryDelay {
		return nil, bad("ConsumerOptions.MaxRetryDelay %v is below RetryDelay %v", opts.MaxRetryDelay, opts.RetryDelay)
	}
	opts.HandleTimeout = orDefault(opts.HandleTimeout, DefaultHandleTimeout)
	opts.MaxPoll = orDefault(opts.MaxPoll, DefaultMaxPoll)
	opts.MaxOutOfOrder = orDefault(opts.MaxOutOfOrder, DefaultMaxOutOfOrder)
	core, err := consumer.New(h, consumer.Policy{
		RetryDelay: opts.RetryDelay, MaxRetryDelay: opts.MaxRetryDelay, HandleTimeout: opts.HandleTimeout,
		MaxBatch: opts.MaxBatch, MaxOutOfOrder: opts.MaxOutOfOrder, SetAsideAs: "set aside", Logger: opts.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("kafkabroker: %w", err)
	}
	opts.MaxBatch = core.MaxBatch()
	return &Consumer{cl: cl, opts: opts, core: core}, nil
}

// Applied, Duplicates and SetAside count the messages the handler applied,
// the copies it dropped, and the records set aside.
func (c *Consumer) Applied() int64    { return c.core.Applied() }
func (c *Consumer) Duplicates() int64 { return c.core.Duplicates() }
func (c *Consumer) SetAside() int64   { return c.core.SetAside() }

// Waiting is how many records are being handled again in place now, after
// failures that may pass or for arriving before their predecessor, and
// OldestWaiting how long ago the oldest of them first failed (zero if none
// waits). Both are safe to call while Run runs.
func (c *Consumer) Waiting() int { return c.core.Waiting() }

// OldestWaiting: see Waiting.
func (c *Consumer) OldestWaiting() time.Duration { return c.core.OldestWaiting() }

// commitTimeout bounds the commit of a poll's offsets.
const commitTimeout = 10 * time.Second

// Run handles records until ctx ends, then commits what it handled and
// returns ctx's error; a poll's fatal error (the group gone, the client
// closed) ends it too. A Consumer that NewConsumer did not make is refused
// at once, with an error wrapping postgres.ErrInvalidConfig.
func (c *Consumer) Run(ctx context.Context) error {
	if c == nil || c.cl == nil || c.core == nil {
		return fmt.Errorf("%w: kafkabroker: a Consumer that NewConsumer did not make", postgres.ErrInvalidConfig)
	}
	c.core.Start(postgres.NewConsumerTelemetry(c.opts.TracerProvider, c.opts.MeterProvider, instrumentationName, "kafka",
		"applied, duplicate, retry or set_aside"))
	defer c.core.Stop()
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
			done = append(done, c.handlePartition(ctx, p.Records)...)
		})
		if len(done) > 0 {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
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

// handlePartition has the core handle rs, one partition's records in
// their order, in batches when it takes them, and returns those done
// (applied, dropped or set aside), up to the first that ctx cut short: the
// rest go to whoever reads the partition next.
func (c *Consumer) handlePartition(ctx context.Context, rs []*kgo.Record) []*kgo.Record {
	for i := 0; i < len(rs); {
		batch := rs[i:min(i+c.opts.MaxBatch, len(rs))]
		ds := make([]consumer.Delivery, len(batch))
		for j, r := range batch {
			ds[j] = delivery(r)
		}
		if len(batch) > 1 {
			if _, ok := c.core.Batch(ctx, ds, 0); ok {
				i += len(batch)
				continue
			}
			// Nothing was applied: each record on its own says what it is.
		}
		for _, d := range ds {
			if ctx.Err() != nil || c.core.Handle(ctx, d).Outcome == consumer.Stopped {
				return rs[:i]
			}
			i++
		}
	}
	return rs
}

// delivery is r as the core takes it.
func delivery(r *kgo.Record) consumer.Delivery {
	m, err := decode(r)
	return consumer.Delivery{Message: m, Err: err, Destination: r.Topic,
		Where: []any{"topic", r.Topic, "partition", r.Partition, "offset", r.Offset},
		Attrs: []attribute.KeyValue{attribute.Int("messaging.destination.partition.id", int(r.Partition)),
			attribute.Int64("messaging.kafka.offset", r.Offset)}}
}

// instrumentationName names this package's tracer and meter.
const instrumentationName = "example.com/patterns/enterprise/outbox/kafkabroker"

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
