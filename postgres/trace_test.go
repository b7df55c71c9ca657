package postgres_test

import (
	"context"
	"database/sql"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// The trace context of the transaction that wrote a row is stored with it
// and reaches the broker in Message.TraceContext, also with no tracer
// provider set (the relay's spans are then no-ops, and the stored context
// passes through), tracestate too; a row written outside any trace stores
// NULL and carries nothing. (Caught: tracestate not stored.)
func TestTraceContextGoesFromTheTransactionToTheBroker(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	state, err := trace.ParseTraceState("vendor=opaque-value")
	if err != nil {
		t.Fatal(err)
	}
	traced := trace.ContextWithSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
		TraceState: state,
		Remote:     true,
	}))
	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	service := shop.NewOrderService(db)
	if _, err := service.PlaceOrder(traced, 2500); err != nil {
		t.Fatal(err)
	}
	if _, err := service.PlaceOrder(ctx, 4000); err != nil {
		t.Fatal(err)
	}
	var stored []sql.NullString
	rows, err := db.Query(`SELECT traceparent FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s sql.NullString
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		stored = append(stored, s)
	}
	if len(stored) != 2 || stored[0].String != traceparent || stored[1].Valid {
		t.Errorf("traceparent = %v, want the first order's and NULL", stored)
	}
	broker := &recorder{}
	if n, err := newRelay(t, db, broker).PublishPending(ctx); n != 2 || err != nil {
		t.Fatalf("pass = %d, %v; want 2", n, err)
	}
	got := broker.Published()
	if got[0].TraceContext["tracestate"] != "vendor=opaque-value" {
		t.Errorf("the broker got tracestate %q, want the transaction's, vendor=opaque-value", got[0].TraceContext["tracestate"])
	}
	if got[0].TraceContext["traceparent"] != traceparent || got[1].TraceContext != nil {
		t.Errorf("the broker got trace contexts %v and %v; want the first order's, and none", got[0].TraceContext, got[1].TraceContext)
	}
	if ctx := postgres.ContextWithTrace(ctx, got[0].TraceContext); trace.SpanContextFromContext(ctx).TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("ContextWithTrace gave trace %s", trace.SpanContextFromContext(ctx).TraceID())
	}
}
