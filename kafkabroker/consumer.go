package kafkabroker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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

	// Retention, with its Keep set, has Run keep the consumer's records
	// bounded: every Retention.Every it deletes, in Retention.Forget (the
	// consumer's database), the keys of messages applied longer than Keep
	// ago, and Forgotten counts them. Keep must be at least the retention.ms
	// of each topic consumed, which Run reads: a topic delivers a record
	// again for as long as it holds it (a group reset to the start). Run
	// refuses to start, with an error wrapping
	// consumer.ErrRetentionTooShort, on a Keep below it, or on a topic that
	// keeps its records for ever (retention.ms -1, or compacted).
	Retention consumer.Retention
}

// Consumer is a member of a consumer group that feeds each partition's
// records to a Handler in their order, and commits a partition's offset
// only past records whose apply committed (or that were set aside):
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
// Each partition the member is assigned has a goroutine of its own, so a
// record that waits (its database down) holds back its own partition only:
// the member's other partitions go on, and the client stops fetching the
// waiting one meanwhile, so memory is bounded by a poll a partition. When
// a rebalance takes a partition away (or the member is evicted from the
// group), its goroutine is stopped before the rebalance goes on: a record
// waiting is given up where it is, the records applied before it are
// committed (not when the partition was lost), and the next owner starts
// at that record. So nothing is committed past what was applied, and
// nothing applied is handed to the next owner, but for a member that dies
// before its commit: its records go to the next owner, which drops each
// copy by its key.
//
// With MaxBatch above 1 and a [BatchHandler], the records of a partition
// taken in a row from one poll are applied in one HandleBatch: one
// transaction and one commit for them all. A batch that fails wrote
// nothing, and its records are then handled one at a time, each as above.
//
// A Consumer owns its client. It runs once: Run leaves the group and
// closes the client when it returns, and a second Run returns [ErrClosed].
// Its counters, Waiting and OldestWaiting are safe to call at any time.
// Create one with [NewConsumer].
type Consumer struct {
	cl   *kgo.Client
	opts ConsumerOptions // with the defaults filled in

	// core decides what becomes of each record, as every broker's
	// Consumer does; this one commits offsets past it.
	core *consumer.Core

	keeper *consumer.Keeper // the Retention, checked against the topics' retention.ms

	ran atomic.Bool // Run was called, or Close

	mu       sync.Mutex
	ctx      context.Context // Run's, the workers' parent; nil before Run
	workers  map[partition]*worker
	assigned map[string][]int32 // by the group, now
}

// partition names a topic's partition.
type partition struct {
	topic string
	id    int32
}

// worker handles one partition's records, in their order, in a goroutine
// of its own.
type worker struct {
	p      partition
	cancel context.CancelFunc
	done   chan struct{} // closed when the goroutine returns
	wake   chan struct{} // one buffered: records were queued
	lost   atomic.Bool   // the partition was lost: commit nothing

	mu    sync.Mutex
	queue []*kgo.Record
}

// ErrClosed is returned by [Consumer.Run] on a Consumer that has run, or
// was closed: its client has left the group. Make a new one.
var ErrClosed = errors.New("kafkabroker: the consumer has run and closed its client: a Consumer runs once")

// NewConsumer returns a Consumer that hands the records of its group to h,
// through a client of its own made of clientOpts (the seed brokers, TLS,
// SASL, and at least kgo.ConsumerGroup and kgo.ConsumeTopics). It adds
// what the Consumer's promise needs, over any of clientOpts:
// kgo.DisableAutoCommit, kgo.BlockRebalanceOnPoll, and its own
// OnPartitionsAssigned, OnPartitionsRevoked and OnPartitionsLost. It refuses, with an error
// wrapping [postgres.ErrInvalidConfig] naming it, no handler, a negative
// option, options the client refuses, and no group or no topic.
func NewConsumer(h Handler, opts ConsumerOptions, clientOpts ...kgo.Opt) (*Consumer, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: kafkabroker: %s", postgres.ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case h == nil:
		return nil, bad("NewConsumer: no handler")
	case opts.RetryDelay < 0, opts.MaxRetryDelay < 0, opts.HandleTimeout < 0:
		return nil, bad("ConsumerOptions: a negative duration (RetryDelay %v, MaxRetryDelay %v, HandleTimeout %v)",
			opts.RetryDelay, opts.MaxRetryDelay, opts.HandleTimeout)
	case opts.MaxPoll < 0, opts.MaxBatch < 0, opts.MaxOutOfOrder < 0:
		return nil, bad("ConsumerOptions: a negative count (MaxPoll %d, MaxBatch %d, MaxOutOfOrder %d)", opts.MaxPoll, opts.MaxBatch, opts.MaxOutOfOrder)
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
	c := &Consumer{opts: opts, core: core, workers: map[partition]*worker{}}
	if c.keeper, err = consumer.NewKeeper(opts.Retention, c.window, opts.Logger); err != nil {
		return nil, fmt.Errorf("kafkabroker: %w", err)
	}
	c.cl, err = kgo.NewClient(append(clientOpts[:len(clientOpts):len(clientOpts)],
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, ps map[string][]int32) { c.assign(ps, true) }),
		kgo.OnPartitionsRevoked(func(_ context.Context, _ *kgo.Client, ps map[string][]int32) { c.stop(ps, false) }),
		kgo.OnPartitionsLost(func(_ context.Context, _ *kgo.Client, ps map[string][]int32) { c.stop(ps, true) }))...)
	if err != nil {
		return nil, bad("the client's options: %v", err)
	}
	group, _ := c.cl.OptValue(kgo.ConsumerGroup).(string)
	topics, _ := c.cl.OptValue(kgo.ConsumeTopics).([]string)
	if group == "" || len(topics) == 0 {
		c.cl.Close()
		return nil, bad("the client's options name no consumer group (kgo.ConsumerGroup %q) or no topic (kgo.ConsumeTopics %q)", group, topics)
	}
	return c, nil
}

// Applied, Duplicates and SetAside count the messages the handler applied,
// the copies it dropped, and the records set aside.
func (c *Consumer) Applied() int64    { return c.core.Applied() }
func (c *Consumer) Duplicates() int64 { return c.core.Duplicates() }
func (c *Consumer) SetAside() int64   { return c.core.SetAside() }

// Forgotten is how many keys and positions Run deleted as its Retention
// says.
func (c *Consumer) Forgotten() int64 { return c.keeper.Forgotten() }

// window is how long the topics consumed keep a record: the longest
// retention.ms among them, negative for ever.
func (c *Consumer) window(ctx context.Context) (time.Duration, error) {
	topics, _ := c.cl.OptValue(kgo.ConsumeTopics).([]string)
	var longest time.Duration
	for _, topic := range topics {
		if policy, err := topicConfig(ctx, c.cl, topic, "cleanup.policy"); err == nil && strings.Contains(policy, "compact") {
			return -1, nil // a compacted topic keeps each key's last record for ever
		}
		v, err := topicConfig(ctx, c.cl, topic, "retention.ms")
		if err != nil {
			return 0, err
		}
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("kafkabroker: topic %s: retention.ms %q: %w", topic, v, err)
		}
		if ms < 0 {
			return -1, nil
		}
		longest = max(longest, time.Duration(ms)*time.Millisecond)
	}
	return longest, nil
}

// Waiting is how many records are being handled again in place now, after
// failures that may pass or for arriving before their predecessor, and
// OldestWaiting how long ago the oldest of them first failed (zero if none
// waits). Both are safe to call while Run runs.
func (c *Consumer) Waiting() int { return c.core.Waiting() }

// OldestWaiting: see Waiting.
func (c *Consumer) OldestWaiting() time.Duration { return c.core.OldestWaiting() }

// Assigned is the partitions of each topic that the group has assigned
// the Consumer now.
func (c *Consumer) Assigned() map[string][]int32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string][]int32{}
	for t, ps := range c.assigned {
		out[t] = slices.Sorted(slices.Values(ps))
	}
	return out
}

// assign notes ps as assigned to the Consumer, or, with in false, no
// longer.
func (c *Consumer) assign(ps map[string][]int32, in bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.assigned == nil {
		c.assigned = map[string][]int32{}
	}
	for t, ids := range ps {
		for _, id := range ids {
			c.assigned[t] = slices.DeleteFunc(c.assigned[t], func(x int32) bool { return x == id })
			if in {
				c.assigned[t] = append(c.assigned[t], id)
			}
		}
		if len(c.assigned[t]) == 0 {
			delete(c.assigned, t)
		}
	}
}

// commitTimeout bounds each commit of a partition's offset.
const commitTimeout = 10 * time.Second

// Run handles records until ctx ends, then stops every partition's
// goroutine (each commits what it applied), leaves the group, closes the
// client and returns ctx's error; a poll's fatal error (the client closed)
// ends it too. It runs once: a Consumer that has run, or that NewConsumer
// did not make, is refused at once (ErrClosed; an error wrapping
// postgres.ErrInvalidConfig).
func (c *Consumer) Run(ctx context.Context) error {
	if c == nil || c.cl == nil || c.core == nil {
		return fmt.Errorf("%w: kafkabroker: a Consumer that NewConsumer did not make", postgres.ErrInvalidConfig)
	}
	if c.ran.Swap(true) {
		return ErrClosed
	}
	if err := c.keeper.CheckWindow(ctx); err != nil {
		c.cl.Close()
		return fmt.Errorf("kafkabroker: %w", err)
	}
	keeping, stopKeeping := context.WithCancel(ctx)
	kept := make(chan struct{})
	go func() { defer close(kept); c.keeper.Run(keeping) }()
	defer func() { stopKeeping(); <-kept }()
	c.core.Start(postgres.NewConsumerTelemetry(c.opts.TracerProvider, c.opts.MeterProvider, instrumentationName, "kafka",
		"applied, duplicate, retry or set_aside"))
	defer c.core.Stop()
	wctx, cancel := context.WithCancel(ctx)
	c.mu.Lock()
	c.ctx = wctx
	c.mu.Unlock()
	defer func() {
		cancel()
		c.stop(nil, false)    // every worker, each committing what it applied
		c.cl.AllowRebalance() // a poll's records not handed out are not ours to hold
		c.cl.Close()          // leaves the group
	}()
	for {
		fetches := c.cl.PollRecords(ctx, c.opts.MaxPoll)
		if fetches.IsClientClosed() {
			return errors.New("kafkabroker: the client was closed")
		}
		if ctx.Err() != nil {
			return ctx.Err() // what the poll took is not handed out: the next owner reads it
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			if c.opts.Logger != nil {
				c.opts.Logger.Warn("kafkabroker: fetch failed", "topic", topic, "partition", partition, "err", err)
			}
		})
		byPartition := map[partition][]*kgo.Record{}
		fetches.EachRecord(func(r *kgo.Record) {
			p := partition{r.Topic, r.Partition}
			byPartition[p] = append(byPartition[p], r)
		})
		for p, rs := range byPartition {
			c.hand(p, rs)
		}
		c.cl.AllowRebalance()
	}
}

// hand queues rs, records of p in their order, to p's worker, started if
// there is none, and stops fetching p until the worker has handled them:
// a partition whose record waits takes no more of the member's memory.
// It is called between a poll and AllowRebalance, so no rebalance runs
// meanwhile.
func (c *Consumer) hand(p partition, rs []*kgo.Record) {
	c.cl.PauseFetchPartitions(map[string][]int32{p.topic: {p.id}})
	c.mu.Lock()
	w := c.workers[p]
	if w == nil {
		ctx, cancel := context.WithCancel(c.ctx)
		w = &worker{p: p, cancel: cancel, done: make(chan struct{}), wake: make(chan struct{}, 1)}
		c.workers[p] = w
		go c.work(ctx, w)
	}
	c.mu.Unlock()
	w.mu.Lock()
	w.queue = append(w.queue, rs...)
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// work handles w's queued records until ctx ends: each poll's in their
// order, then commits past those done and lets the client fetch the
// partition again. Cut short, it commits past those done (unless the
// partition was lost) and returns.
func (c *Consumer) work(ctx context.Context, w *worker) {
	defer close(w.done)
	for {
		select {
		case <-w.wake:
		case <-ctx.Done():
			return
		}
		w.mu.Lock()
		rs := w.queue
		w.queue = nil
		w.mu.Unlock()
		if len(rs) == 0 {
			continue
		}
		done := c.handlePartition(ctx, rs)
		if len(done) > 0 && !w.lost.Load() {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
			if err := c.cl.CommitRecords(cctx, done...); err != nil && c.opts.Logger != nil {
				c.opts.Logger.Warn("kafkabroker: commit failed: the records handled come again, and are dropped by key",
					"topic", w.p.topic, "partition", w.p.id, "records", len(done), "err", err)
			}
			cancel()
		}
		if len(done) < len(rs) {
			return // stopped: the rest go to whoever reads the partition next
		}
		c.cl.ResumeFetchPartitions(map[string][]int32{w.p.topic: {w.p.id}})
	}
}

// stop stops the workers of ps (every worker if ps is nil) and waits for
// each to return, having committed what it applied (lost: not), and lets
// the client fetch those partitions again should they come back. The
// client calls it before a rebalance takes partitions away, and when the
// member lost them.
func (c *Consumer) stop(ps map[string][]int32, lost bool) {
	if ps != nil {
		c.assign(ps, false)
	}
	c.mu.Lock()
	var stopping []*worker
	for p, w := range c.workers {
		if ps == nil || slices.Contains(ps[p.topic], p.id) {
			w.lost.Store(lost)
			w.cancel()
			stopping = append(stopping, w)
			delete(c.workers, p)
		}
	}
	c.mu.Unlock()
	resume := map[string][]int32{}
	for _, w := range stopping {
		<-w.done
		resume[w.p.topic] = append(resume[w.p.topic], w.p.id)
		if lost && c.opts.Logger != nil {
			c.opts.Logger.Warn("kafkabroker: partition lost: what was applied and not committed comes again to its next owner, and is dropped by key",
				"topic", w.p.topic, "partition", w.p.id)
		}
	}
	if len(resume) > 0 {
		c.cl.ResumeFetchPartitions(resume)
	}
}

// Close leaves the group and closes the client of a Consumer that never
// ran; after Run it does nothing.
func (c *Consumer) Close() {
	if c != nil && c.cl != nil && !c.ran.Swap(true) {
		c.cl.Close()
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
