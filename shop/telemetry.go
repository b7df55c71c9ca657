package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// The shop is the application, so it chooses the OpenTelemetry SDK and its
// exporters; the outbox and the broker packages use the API only.

// setUpTracing sets otel's global tracer provider as the OpenTelemetry
// environment variables ask: OTEL_TRACES_EXPORTER=console writes each span
// to out, as a line of JSON; otlp, or an OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) that is set, sends them over OTLP/HTTP
// to that endpoint; none, or nothing set, records no span. It returns what
// flushes and stops the provider.
func setUpTracing(ctx context.Context, out io.Writer) (shutdown func(context.Context) error, err error) {
	otel.SetTextMapPropagator(propagation.TraceContext{})
	var exp sdktrace.SpanExporter
	switch name := os.Getenv("OTEL_TRACES_EXPORTER"); {
	case name == "console":
		exp, err = stdouttrace.New(stdouttrace.WithWriter(out))
	case name == "none":
	case name == "otlp", os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "", os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "":
		exp, err = otlptracehttp.New(ctx)
	case name != "":
		return nil, fmt.Errorf("OTEL_TRACES_EXPORTER=%s: the shop knows console, otlp and none", name)
	}
	if err != nil {
		return nil, fmt.Errorf("trace exporter: %w", err)
	}
	if exp == nil {
		return func(context.Context) error { return nil }, nil
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "shop"))))
	otel.SetTracerProvider(tp)
	return tp.Shutdown, nil
}

// metrics is the shop's meter provider and what serves it: the OpenTelemetry
// Prometheus exporter, on a registry of its own, at GET /metrics. The
// exporter, rather than client_golang's own instruments, because the
// outbox's instruments are the OpenTelemetry API's: the exporter turns them
// into Prometheus's names (outbox.oldest_unsent.age in seconds becomes
// outbox_oldest_unsent_age_seconds) and the same instruments can go over
// OTLP instead.
type metrics struct {
	provider *sdkmetric.MeterProvider
	handler  http.Handler
}

func newMetrics() (*metrics, error) {
	reg := prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(reg), otelprom.WithoutScopeInfo())
	if err != nil {
		return nil, fmt.Errorf("metrics exporter: %w", err)
	}
	return &metrics{
		provider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp)),
		handler:  promhttp.HandlerFor(reg, promhttp.HandlerOpts{}),
	}, nil
}

// traced makes each request to h a server span of otel's global tracer
// provider, named by its route ("POST /orders"), in the trace of its
// traceparent header if it has one.
func traced(h http.Handler) http.Handler {
	tracer := otel.Tracer("example.com/patterns/enterprise/outbox/shop")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := otel.GetTextMapPropagator().Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		ctx, span := tracer.Start(ctx, r.Method, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path)))
		defer span.End()
		rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		r = r.WithContext(ctx)
		h.ServeHTTP(rec, r)
		if r.Pattern != "" {
			span.SetName(r.Pattern)
			span.SetAttributes(attribute.String("http.route", r.Pattern))
		}
		span.SetAttributes(attribute.Int("http.response.status_code", rec.status))
		if rec.status >= 500 {
			span.SetStatus(codes.Error, http.StatusText(rec.status))
		}
	})
}

// statusRecorder remembers the status a handler wrote.
type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (s *statusRecorder) WriteHeader(code int) {
	s.status = code
	s.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController reach the connection underneath: a
// handler's SetWriteDeadline (POST /broker/up's) would otherwise fail, and
// the server's WriteTimeout cut its answer off.
func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }
