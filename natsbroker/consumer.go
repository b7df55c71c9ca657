package natsbroker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Handler applies a message and reports whether it did (false: a duplicate
// it had applied before). The example's shop.Warehouse is one.
type Handler interface {
	Handle(ctx context.Context, msg postgres.Message) (applied bool, err error)
}

// DefaultRetryDelay is how long a [Consumer] asks JetStream to wait before
// it delivers again a message whose handling failed, when
// [Consumer.RetryDelay] is zero.
const DefaultRetryDelay = time.Second

// pullExpiry is how long one of a Consumer's pull requests lasts.
const pullExpiry = 5 * time.Second

// DefaultPrefetch is how many messages a [Consumer] asks JetStream for at
// a time, when [Consumer.Prefetch] is zero.
const DefaultPrefetch = 10

// DefaultMaxOutOfOrder is how many deliveries a [Consumer] gives a message
// that arrives before its predecessor, when [Consumer.MaxOutOfOrder] is
// zero, before it terminates it; more if the rule on MaxOutOfOrder asks
// for more.
const DefaultMaxOutOfOrder = 20

// ErrOutOfOrderBound is returned, wrapped, by [Consumer.Run] for a
// MaxOutOfOrder too small for the consumer's AckWait and RetryDelay.
var ErrOutOfOrderBound = errors.New("natsbroker: MaxOutOfOrder would terminate a message whose predecessor is only late")

// Consumer feeds the messages of a JetStream pull consumer to a Handler, one
// at a time, and tells JetStream what became of each:
//   - handled (applied, or a duplicate): Ack, only after the handler has
//     returned, so after the warehouse's transaction committed. A consumer
//     that dies before its ack leaves the message to be delivered again
//     after the consumer's AckWait, and the handler drops that copy by its
//     key: the broker's duplicate window is not what keeps it from being
//     applied twice;
//   - failed for a reason that may pass (a database that is down, a message
//     that arrived before its predecessor): NakWithDelay(RetryDelay), to
//     be delivered again;
//   - never to be applied (a payload the handler cannot read, wrapping
//     [postgres.ErrMalformedMessage], or no key, an error the handler wraps
//     around [postgres.ErrPermanent], or headers that are not an outbox
//     message's), or still before its predecessor after
//     MaxOutOfOrder deliveries (its predecessor was terminated, or parked
//     in the outbox, and may never come; see MaxOutOfOrder for how many is
//     enough): Term, with the reason, and a log line at level Error; it is
//     not delivered again. JetStream publishes an advisory for each message
//     terminated
//     ($JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.<stream>.<consumer>), with
//     the reason, for an operator to find it by; the message stays in the
//     stream.
//
// The JetStream consumer's AckWait runs from a message's delivery, also
// while it waits in the client's buffer behind others. So a Consumer asks
// for Prefetch messages at a time, and gives each Handle a deadline of
// AckWait / (2 × Prefetch): a full buffer is handled within half of
// AckWait, and no message is delivered again only because the ones before
// it were slow. A Handle that runs out of time is asked for again, as any
// failure that may pass.
//
// A Consumer is not safe for concurrent use: run one Run at a time. Several
// Consumers, in one process or many, may share one JetStream consumer, which
// spreads the messages among them. Create one with [NewConsumer].
type Consumer struct {
	consumer jetstream.Consumer
	prefix   string // of its subjects, which decode takes off for the type
	handler  Handler

	// RetryDelay is how long a failed message waits before it is delivered
	// again; zero or less means DefaultRetryDelay.
	RetryDelay time.Duration

	// Prefetch is how many messages Run asks for at a time; zero or less
	// means DefaultPrefetch.
	Prefetch int

	// MaxOutOfOrder is how many deliveries a message that arrives before
	// its predecessor gets before it is terminated, counting those that
	// found it out of order only (a delivery that failed for another
	// reason, a database that was down, spends none); each Consumer counts
	// the deliveries it saw, in memory. The rule: MaxOutOfOrder
	// times RetryDelay must be at least twice the JetStream consumer's
	// AckWait, since a predecessor whose delivery was lost (a server that
	// died with it in flight, a consumer that died before its ack) comes
	// again only after AckWait, and its successor must not be terminated
	// before that. Zero or less means DefaultMaxOutOfOrder or the rule's
	// least, whichever is more (61 with the defaults: about a minute); a
	// value below the rule's least makes Run fail with ErrOutOfOrderBound.
	MaxOutOfOrder int

	// Logger, if not nil, is told of each message terminated.
	Logger *slog.Logger

	// TracerProvider and MeterProvider are where the consumer reports (nil:
	// otel's global ones). Each message is a consumer span, "process
	// <subject>", with a link to the relay's publish span whose context the
	// message carries in its traceparent header (its creation context, as
	// OpenTelemetry's messaging conventions ask), and also its child, which
	// the conventions allow when one message is processed at a time: so the
	// trace of the request that wrote the row goes on, in one trace, to its
	// Handle and the warehouse's transaction. The meter counts
	// messaging.client.consumed.messages by outbox.result: applied,
	// duplicate, retry, out_of_order or terminated. They are read when Run
	// starts.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	telemetry *postgres.ConsumerTelemetry

	// outOfOrder counts, by message key, the deliveries each message has
	// spent arriving before its predecessor: the bound counts those only,
	// not the deliveries an outage of the handler's database spent.
	outOfOrder map[string]int
}

// NewConsumer returns a Consumer that feeds the messages of c, a consumer
// created with ConsumerConfig (or Names.ConsumerConfig: the subject prefix
// it takes off for each message's type is c's filter's), to h.
func NewConsumer(c jetstream.Consumer, h Handler) *Consumer {
	return &Consumer{consumer: c, handler: h, prefix: prefixOf(c)}
}

// Run handles messages until ctx ends, and then returns ctx's error; or
// until it cannot tell JetStream what became of a message, or can receive
// no more (its connection is closed, its consumer deleted), and then
// returns that error. A server that goes down and comes back is not such
// an error: the client reconnects and Run goes on. A message whose
// handling ctx cut short is neither acked nor asked for again: it is
// delivered again after the consumer's AckWait. A MaxOutOfOrder below its
// rule's least makes Run return at once with an error wrapping
// ErrOutOfOrderBound.
func (c *Consumer) Run(ctx context.Context) error {
	prefetch := orDefault(c.Prefetch, DefaultPrefetch)
	ackWait := c.consumer.CachedInfo().Config.AckWait
	if ackWait <= 0 {
		ackWait = 30 * time.Second // the server's default
	}
	deadline := ackWait / time.Duration(2*prefetch)
	retry := orDefault(c.RetryDelay, DefaultRetryDelay)
	least := int(2*ackWait/retry) + 1
	maxOutOfOrder := c.MaxOutOfOrder
	switch {
	case maxOutOfOrder <= 0:
		maxOutOfOrder = max(DefaultMaxOutOfOrder, least)
	case maxOutOfOrder < least:
		return fmt.Errorf("%w: %d deliveries %v apart is less than twice AckWait, %v; want at least %d",
			ErrOutOfOrderBound, maxOutOfOrder, retry, ackWait, least)
	}
	// Each pull request lasts pullExpiry, with idle heartbeats from the
	// server every half of it: a pull parked on a server that died is given
	// up, and made again to whichever server leads the consumer now, within
	// about pullExpiry, not the client's default 30 s.
	c.telemetry = postgres.NewConsumerTelemetry(c.TracerProvider, c.MeterProvider, instrumentationName, "nats",
		"applied, duplicate, retry, out_of_order or terminated")
	c.outOfOrder = map[string]int{}
	it, err := c.consumer.Messages(jetstream.PullMaxMessages(prefetch), jetstream.PullExpiry(pullExpiry))
	if err != nil {
		return fmt.Errorf("consume: %w", err)
	}
	// When ctx ends the iterator drains: the messages prefetched and not
	// yet handled are handed back at once (Nak), instead of waiting out
	// AckWait in a buffer nobody reads.
	stop := context.AfterFunc(ctx, it.Drain)
	defer stop()
	defer it.Stop()
	for {
		msg, err := it.Next()
		if ctx.Err() != nil {
			if err != nil {
				return ctx.Err() // drained
			}
			msg.Nak() // a stop hands it back; if this fails, AckWait does
			continue
		}
		if errors.Is(err, jetstream.ErrNoHeartbeat) {
			continue // the server was silent a while; the iterator pulls again
		}
		if err != nil {
			return fmt.Errorf("consume: %w", err)
		}
		if err := c.handle(ctx, msg, deadline, maxOutOfOrder); err != nil && ctx.Err() == nil {
			return err
		} // after ctx ended, the loop hands the rest of the buffer back

	}
}

// handle handles msg, within deadline, and returns an error only when it
// could not tell JetStream what became of it.
func (c *Consumer) handle(ctx context.Context, msg jetstream.Msg, deadline time.Duration, maxOutOfOrder int) (ackErr error) {
	m, err := decode(msg, c.prefix)
	// The message's context is the span's parent and also its link: see
	// the doc of TracerProvider.
	sctx, done := c.telemetry.Process(ctx, m, msg.Subject())
	var applied bool
	result := "retry"
	defer func() { done(result, err) }()
	if err == nil {
		hctx, cancel := context.WithTimeout(sctx, deadline)
		applied, err = c.handler.Handle(hctx, m)
		cancel()
	}
	if errors.Is(err, postgres.ErrOutOfOrder) {
		result = "out_of_order"
		if len(c.outOfOrder) >= maxTracked {
			clear(c.outOfOrder) // a bound on memory: the counts start again
		}
		c.outOfOrder[m.Key]++
		if n := c.outOfOrder[m.Key]; n >= maxOutOfOrder {
			err = fmt.Errorf("%w after %d deliveries out of order: its predecessor may never come", err, n)
			result = "terminated"
			return c.terminate(msg, m, err)
		}
	}
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case err == nil:
		result = map[bool]string{true: "applied", false: "duplicate"}[applied]
		delete(c.outOfOrder, m.Key)
		return ack(msg.Ack(), "ack", msg)
	case errors.Is(err, postgres.ErrMalformedMessage), errors.Is(err, postgres.ErrNoMessageKey), errors.Is(err, postgres.ErrPermanent), errors.Is(err, errNotOutbox):
		result = "terminated"
		return c.terminate(msg, m, err)
	default:
		return ack(msg.NakWithDelay(orDefault(c.RetryDelay, DefaultRetryDelay)), "ask again for", msg)
	}
}

// maxTracked is the most messages whose out-of-order deliveries a Consumer
// counts at once; past it the counts start again, which delays a
// termination and never hastens one.
const maxTracked = 100_000

// instrumentationName names this package's tracer and meter.
const instrumentationName = "example.com/patterns/enterprise/outbox/natsbroker"

// terminate tells JetStream never to deliver msg again, with err as the
// reason, and logs it.
func (c *Consumer) terminate(msg jetstream.Msg, m postgres.Message, err error) error {
	delete(c.outOfOrder, m.Key)
	if c.Logger != nil {
		c.Logger.Error("message terminated: it can never be applied", "subject", msg.Subject(), "key", m.Key,
			"aggregate", m.Aggregate, "seq", m.Seq, "error", err)
	}
	return ack(msg.TermWithReason(err.Error()), "terminate", msg)
}

func ack(err error, what string, msg jetstream.Msg) error {
	if err != nil {
		return fmt.Errorf("%s message %s: %w", what, msg.Headers().Get(jetstream.MsgIDHeader), err)
	}
	return nil
}

// errNotOutbox is what decode wraps: the message was not published by a
// Publisher.
var errNotOutbox = errors.New("not an outbox message")

// decode is msg as the relay published it, under the subject prefix.
func decode(msg jetstream.Msg, prefix string) (postgres.Message, error) {
	h := msg.Headers()
	m := postgres.Message{
		Type:      strings.TrimPrefix(msg.Subject(), prefix),
		Payload:   string(msg.Data()),
		Key:       h.Get(jetstream.MsgIDHeader),
		Aggregate: h.Get(HeaderAggregate),
	}
	for _, k := range []string{"traceparent", "tracestate"} { // as the relay's span put them
		if v := h.Get(k); v != "" {
			if m.TraceContext == nil {
				m.TraceContext = map[string]string{}
			}
			m.TraceContext[k] = v
		}
	}
	var err error
	if m.ID, err = strconv.ParseInt(h.Get(HeaderID), 10, 64); err != nil {
		return m, fmt.Errorf("%w: header %s: %w", errNotOutbox, HeaderID, err)
	}
	if m.Aggregate != "" {
		if m.Seq, err = strconv.ParseInt(h.Get(HeaderSeq), 10, 64); err != nil {
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
