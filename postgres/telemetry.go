package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The outbox reports through the OpenTelemetry API only, as a library
// should: the application chooses the SDK and its exporters, and without
// them every call here is a no-op. The trace of a request goes through the
// table: Outbox.Write stores the W3C trace context of its ctx with the row
// (the trace_context column), the relay's publish of the row is a span in
// that trace, and the broker carries the publish's context to the consumer.

// InstrumentationName names this package's tracer and meter.
const InstrumentationName = "example.com/patterns/enterprise/outbox/postgres"

// w3c is the propagator of the stored trace context: always W3C Trace
// Context, whatever the application's global propagator, so that a row
// written by one service is read the same way by a relay of another.
var w3c = propagation.TraceContext{}

// storedTraceContext is the trace context of ctx's span as Outbox.Write
// writes it to the row: its traceparent and tracestate headers, or nothing
// when ctx carries no span.
func storedTraceContext(ctx context.Context) (traceparent, tracestate string) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return "", ""
	}
	carrier := propagation.MapCarrier{}
	w3c.Inject(ctx, carrier)
	return carrier["traceparent"], carrier["tracestate"]
}

// claimedTraceContext is a claimed row's trace context as Message carries
// it, nil when the row has none.
func claimedTraceContext(traceparent, tracestate string) map[string]string {
	if traceparent == "" {
		return nil
	}
	if tracestate == "" {
		return map[string]string{"traceparent": traceparent}
	}
	return map[string]string{"traceparent": traceparent, "tracestate": tracestate}
}

// ContextWithTrace returns ctx with the remote span that carrier holds (the
// W3C headers traceparent and tracestate, such as Message.TraceContext), for
// a consumer to start its span as that span's child. A carrier with none
// returns ctx unchanged.
func ContextWithTrace(ctx context.Context, carrier map[string]string) context.Context {
	if len(carrier) == 0 {
		return ctx
	}
	return w3c.Extract(ctx, propagation.MapCarrier(carrier))
}

// ConsumerTelemetry is how a consumer of outbox messages reports, as
// natsbroker's and rabbitbroker's Consumers do: each message processed is a
// span, and a count of messaging.client.consumed.messages by outbox.result.
// It is safe for concurrent use. Create one with [NewConsumerTelemetry].
type ConsumerTelemetry struct {
	system   string
	tracer   trace.Tracer
	consumed metric.Int64Counter
}

// NewConsumerTelemetry returns the telemetry of a consumer whose broker is
// system (messaging.system: "nats", "rabbitmq"), its tracer and meter named
// scope, from tp and mp (nil: otel's global providers). results names the
// consumer's outbox.result values, for the counter's description.
func NewConsumerTelemetry(tp trace.TracerProvider, mp metric.MeterProvider, scope, system, results string) *ConsumerTelemetry {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	t := &ConsumerTelemetry{system: system, tracer: tp.Tracer(scope)}
	var err error
	t.consumed, err = mp.Meter(scope).Int64Counter("messaging.client.consumed.messages",
		metric.WithUnit("{message}"),
		metric.WithDescription("Messages the consumer handled, by outbox.result: "+results+"."))
	if err != nil {
		otel.Handle(err) // a no-op counter then; the consumer runs on
	}
	return t
}

// Process starts the span of msg's processing, "process <destination>", a
// consumer span with the messaging attributes and attrs. Its parent is the
// relay's publish span, whose context msg carries (TraceContext), and it
// is linked to it too, its creation context, as OpenTelemetry's messaging
// conventions ask (the parent they allow when one message is processed at
// a time): the trace of the request that wrote the row goes on to the
// handler. The context returned carries the span, for the handler; done
// ends it with result (outbox.result) and err, the error of its processing
// if any, and counts it.
func (t *ConsumerTelemetry) Process(ctx context.Context, msg Message, destination string, attrs ...attribute.KeyValue) (context.Context, func(result string, err error)) {
	created := ContextWithTrace(ctx, msg.TraceContext)
	var links []trace.Link
	if sc := trace.SpanContextFromContext(created); sc.IsValid() {
		links = append(links, trace.Link{SpanContext: sc})
	}
	sctx, span := t.tracer.Start(created, "process "+destination,
		trace.WithLinks(links...),
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
			attribute.String("messaging.system", t.system),
			attribute.String("messaging.operation.name", "process"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.destination.name", destination),
			attribute.String("messaging.message.id", msg.Key)),
		trace.WithAttributes(attrs...))
	return sctx, func(result string, err error) {
		t.consumed.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(attribute.String("outbox.result", result)))
		span.SetAttributes(attribute.String("outbox.result", result))
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// ProcessBatch starts the span of a batch's processing, "process
// <destination>", a consumer span with messaging.batch.message_count and a
// link to each message's creation context (a batch has no one parent, so
// the conventions ask for links only). done ends it with err, and counts
// each message by its result (outbox.result), results[i] for msgs[i]; nil
// results count nothing (the messages are then handled, and counted, one
// at a time).
func (t *ConsumerTelemetry) ProcessBatch(ctx context.Context, msgs []Message, destination string, attrs ...attribute.KeyValue) (context.Context, func(results []string, err error)) {
	links := make([]trace.Link, 0, len(msgs))
	for _, m := range msgs {
		if sc := trace.SpanContextFromContext(ContextWithTrace(ctx, m.TraceContext)); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	sctx, span := t.tracer.Start(ctx, "process "+destination,
		trace.WithLinks(links...),
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
			attribute.String("messaging.system", t.system),
			attribute.String("messaging.operation.name", "process"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.destination.name", destination),
			attribute.Int("messaging.batch.message_count", len(msgs))),
		trace.WithAttributes(attrs...))
	return sctx, func(results []string, err error) {
		for _, r := range results {
			t.consumed.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(attribute.String("outbox.result", r)))
		}
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// relayTelemetry is what a relay reports through, made once per relay.
type relayTelemetry struct {
	table, kind  attribute.KeyValue // outbox.table and outbox.relay, on every measurement
	system       attribute.KeyValue // messaging.system, on every send counted
	sentOK       metric.AddOption   // a send's attributes when it succeeded, made once: a set costs a sort and allocations
	tracer       trace.Tracer
	passDuration metric.Float64Histogram
	sent         metric.Int64Counter
}

func (r *OutboxRelay) telemetry() *relayTelemetry {
	r.telemetryOnce.Do(func() {
		r.tel = newRelayTelemetry(r.cfg.TracerProvider, r.cfg.MeterProvider, r.outbox.table, "polling", messagingSystem(r.broker))
	})
	return r.tel
}

// newRelayTelemetry makes a relay's tracer and instruments from tp and mp
// (nil: otel's global ones); every measurement carries the outbox's table
// and the relay's kind, outbox.relay: polling or log; every send counted,
// the broker's messaging.system too, as the conventions require.
func newRelayTelemetry(tp trace.TracerProvider, mp metric.MeterProvider, table, kind, system string) *relayTelemetry {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(InstrumentationName)
	t := &relayTelemetry{tracer: tp.Tracer(InstrumentationName),
		table: attribute.String("outbox.table", table), kind: attribute.String("outbox.relay", kind),
		system: attribute.String("messaging.system", system)}
	t.sentOK = metric.WithAttributeSet(attribute.NewSet(attribute.String("messaging.operation.name", "send"), t.system, t.table, t.kind))
	var err1, err2 error
	t.passDuration, err1 = meter.Float64Histogram("outbox.relay.pass.duration", metric.WithUnit("s"),
		metric.WithDescription("How long a relay pass took, from its BEGIN to its COMMIT (the log relay: a transaction's delivery); its count is the passes made."),
		metric.WithExplicitBucketBoundaries(PassDurationBuckets...))
	t.sent, err2 = meter.Int64Counter("messaging.client.sent.messages", metric.WithUnit("{message}"),
		metric.WithDescription("Messages the relay handed to the broker: accepted, or failed with error.type unavailable, rejected or budget."))
	if err := errors.Join(err1, err2); err != nil {
		otel.Handle(err) // the instruments are then no-ops; the relay runs on
	}
	return t
}

// PassDurationBuckets are the bucket boundaries, in seconds, of the
// histogram outbox.relay.pass.duration: OpenTelemetry's advice for
// durations in seconds, from 5 ms to 10 s, which holds a pass that ran into
// [DefaultPassTimeout] (5 s) apart from one that took a second. The SDK's
// default boundaries (0, 5, 10 … 10000) are made for milliseconds: every
// pass would land below 5 seconds, in one bucket.
var PassDurationBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10}

// MessagingSystem is what a [MessageBroker] may also implement to name its
// system as OpenTelemetry's messaging conventions do ("nats", "rabbitmq",
// "kafka"): the relay's send spans carry it as messaging.system, which the
// conventions require. A broker without it is "unknown".
type MessagingSystem interface {
	MessagingSystem() string
}

// messagingSystem is b's messaging.system.
func messagingSystem(b MessageBroker) string {
	if s, ok := b.(MessagingSystem); ok {
		if name := s.MessagingSystem(); name != "" {
			return name
		}
	}
	return "unknown"
}

// errorType is the error.type of a failed publish: unavailable (it may
// pass), rejected (never), or budget (the pass's budget, or its caller's
// context, ended first).
func errorType(pubCtx context.Context, err error) string {
	switch {
	case pubCtx.Err() != nil:
		return "budget"
	case errors.Is(err, ErrRejected):
		return "rejected"
	default:
		return "unavailable"
	}
}

// startSend starts the span of one message's publish: a producer span in
// the trace of the transaction that wrote the row, linked to the pass, or
// in the pass's trace for a row written outside any trace. It returns msg
// carrying the span's context, for the broker to pass on.
func (t *relayTelemetry) startSend(passCtx context.Context, system string, msg Message) (Message, trace.Span) {
	if !trace.SpanContextFromContext(passCtx).IsValid() {
		// A tracer that gave the pass, a root, no span context makes no
		// spans at all (the API's no-op): the stored context goes on as it
		// is, at no cost.
		return msg, trace.SpanFromContext(context.Background())
	}
	parent := passCtx
	var opts []trace.SpanStartOption
	if len(msg.TraceContext) > 0 {
		parent = ContextWithTrace(context.Background(), msg.TraceContext)
		opts = append(opts, trace.WithLinks(trace.LinkFromContext(passCtx)))
	}
	opts = append(opts, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		attribute.String("messaging.system", system),
		attribute.String("messaging.operation.name", "send"),
		attribute.String("messaging.operation.type", "send"),
		attribute.String("messaging.message.id", msg.Key),
		attribute.Int64("outbox.id", msg.ID),
	))
	ctx, span := t.tracer.Start(parent, "send "+msg.Type, opts...)
	if span.IsRecording() { // else the span is the stored context, passed on as it is
		carrier := propagation.MapCarrier{}
		w3c.Inject(ctx, carrier)
		msg.TraceContext = carrier
	}
	return msg, span
}

// endSend ends a publish's span and counts it; pubCtx is the publish's
// context, ended if the pass's budget or its caller's context did.
func (t *relayTelemetry) endSend(pubCtx context.Context, span trace.Span, err error) {
	ctx := context.WithoutCancel(pubCtx)
	if err == nil {
		t.sent.Add(ctx, 1, t.sentOK)
		span.End()
		return
	}
	kind := errorType(pubCtx, err)
	t.sent.Add(ctx, 1, metric.WithAttributes(attribute.String("messaging.operation.name", "send"), attribute.String("error.type", kind), t.system, t.table, t.kind))
	span.SetAttributes(attribute.String("error.type", kind))
	span.SetStatus(codes.Error, err.Error())
	span.End()
}

// endPass records the pass's duration and ends its span, if it has one.
func (t *relayTelemetry) endPass(ctx context.Context, span trace.Span, start time.Time, res passResult, err error) {
	t.passDuration.Record(context.WithoutCancel(ctx), time.Since(start).Seconds(), metric.WithAttributes(t.table, t.kind))
	if span == nil {
		return
	}
	span.SetAttributes(attribute.Int("outbox.claimed", res.claimed), attribute.Int("outbox.published", res.published),
		attribute.Int("outbox.marked", res.marked), attribute.Bool("outbox.flushed", res.flushed))
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// ObserveLag reports [Outbox.ReadLag]'s figures as five observable gauges of
// the meter provider mp (nil means otel's global one), each read by one query
// per collection: outbox.oldest_unsent.age in seconds, the one to alert on, and
// outbox.unsent, outbox.parked, outbox.failing and outbox.scheduled in messages, each with the
// attribute outbox.table. Unregister the returned Registration to stop. A
// collection whose query fails reports nothing, and the error goes to otel's
// error handler. The attribute outbox.table sets two outboxes' gauges apart.
func (o *Outbox[T]) ObserveLag(mp metric.MeterProvider) (metric.Registration, error) {
	if err := o.usable(); err != nil {
		return nil, err
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(InstrumentationName)
	age, err1 := meter.Float64ObservableGauge("outbox.oldest_unsent.age", metric.WithUnit("s"),
		metric.WithDescription("How long the oldest unsent, unparked outbox row has waited; 0 when none waits."))
	unsent, err2 := meter.Int64ObservableGauge("outbox.unsent", metric.WithUnit("{message}"),
		metric.WithDescription("Outbox rows waiting to be published: not sent, not parked, not scheduled for later."))
	parked, err3 := meter.Int64ObservableGauge("outbox.parked", metric.WithUnit("{message}"),
		metric.WithDescription("Outbox rows parked after too many rejections."))
	failing, err4 := meter.Int64ObservableGauge("outbox.failing", metric.WithUnit("{message}"),
		metric.WithDescription("Unsent rows that failed FailingAfter publishes or more."))
	scheduled, err5 := meter.Int64ObservableGauge("outbox.scheduled", metric.WithUnit("{message}"),
		metric.WithDescription("Outbox rows waiting for a time to deliver still to come."))
	if err := errors.Join(err1, err2, err3, err4, err5); err != nil {
		return nil, fmt.Errorf("outbox lag gauges: %w", err)
	}
	return meter.RegisterCallback(func(ctx context.Context, obs metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		lag, err := o.ReadLag(ctx)
		if err != nil {
			return err
		}
		table := metric.WithAttributes(attribute.String("outbox.table", o.t.table))
		obs.ObserveFloat64(age, lag.Oldest.Seconds(), table)
		obs.ObserveInt64(unsent, lag.Unsent, table)
		obs.ObserveInt64(parked, lag.Parked, table)
		obs.ObserveInt64(failing, lag.Failing, table)
		obs.ObserveInt64(scheduled, lag.Scheduled, table)
		return nil
	}, age, unsent, parked, failing, scheduled)
}

// tracer is the package's tracer from otel's global provider, for the
// functions that have no relay to configure: ApplyOnce.
func tracer() trace.Tracer { return otel.GetTracerProvider().Tracer(InstrumentationName) }
