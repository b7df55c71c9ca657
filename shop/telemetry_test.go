package main

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"example.com/patterns/enterprise/outbox/postgres"
)

// startShop migrates a database and a broker store of t's own and serves
// the shop on loopback until t ends; it returns the shop's base URL, the
// database, and what the shop printed.
func startShop(t *testing.T) (string, *sql.DB, *syncBuffer) {
	t.Helper()
	return startShopWith(t, "polling")
}

// startShopWith is startShop with the relay of relayKind, polling or log.
func startShopWith(t *testing.T, relayKind string) (string, *sql.DB, *syncBuffer) {
	t.Helper()
	return startShopOn(t, "jetstream", relayKind)
}

// startShopOn is startShop on broker, jetstream or rabbitmq, with the relay
// of relayKind.
func startShopOn(t *testing.T, broker, relayKind string) (string, *sql.DB, *syncBuffer) {
	t.Helper()
	db, dbs := newDatabase(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	store := t.TempDir()
	s := setup{store: store, broker: broker, nodes: 1, relay: relayKind}
	if err := migrate(ctx, dbs.shop, s, out); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- serve(ctx, ln, dbs, s, out) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
		if relayKind == "log" { // its slot, before the database goes: the replication session ends a moment after the shop
			waitFor(t, "the log relay's slot dropped", func() bool {
				ob, err := postgres.OpenDB(db, postgres.Config{})
				return err == nil && !errors.Is(ob.DropLogSlot(context.Background(), ob.Slot()), postgres.ErrSlotActive)
			})
		}
	})
	base := "http://" + ln.Addr().String()
	waitFor(t, "the shop to listen", func() bool { return strings.Contains(out.String(), "shop: listening on "+base) })
	return base, db, out
}

// One order placed over HTTP, through the outbox and a real JetStream (or
// RabbitMQ), to the warehouse, is one trace: the request's span,
// PlaceOrder's (whose transaction stored its context in the row), the
// relay's publish of the row, the consumer's processing and ApplyOnce, each
// the child of the one before; the relay's pass is a trace of its own,
// linked from the publish. (Caught: InsertOutbox not storing the context,
// and a Publisher not sending its headers: the publish, or the processing,
// starts a trace of its own; on RabbitMQ, a Consumer that started no span.)
func TestOneTraceFromTheRequestToTheReservation(t *testing.T) {
	for _, b := range []struct{ broker, process, system string }{
		{"jetstream", "process outbox.OrderPlaced", "nats"},
		{"rabbitmq", "process warehouse", "rabbitmq"},
	} {
		t.Run(b.broker, func(t *testing.T) { oneTrace(t, b.broker, b.process, b.system) })
	}
}

// oneTrace is TestOneTraceFromTheRequestToTheReservation on broker, whose
// consumer's span is named process and whose messaging.system is system.
func oneTrace(t *testing.T, broker, process, system string) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	prev, prevProp := otel.GetTracerProvider(), otel.GetTextMapPropagator()
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	t.Cleanup(func() { otel.SetTracerProvider(prev); otel.SetTextMapPropagator(prevProp) })

	base, _, _ := startShopOn(t, broker, "polling")
	call(t, "POST", base+"/orders", `{"totalCents":2500}`, 201, `{"orderId":1}`)
	waitFor(t, "order 1 reserved", func() bool {
		return get(t, base+"/orders/1") == `{"orderId":1,"totalCents":2500,"sent":true,"reserved":true}`
	})
	want := []string{"POST /orders", "PlaceOrder", "send OrderPlaced", process, "apply OrderPlaced"}
	byName := map[string]sdktrace.ReadOnlySpan{}
	var pass sdktrace.ReadOnlySpan
	waitFor(t, "the consumer's span to end", func() bool {
		for _, s := range rec.Ended() {
			if _, seen := byName[s.Name()]; !seen {
				byName[s.Name()] = s
			}
			if s.Name() == "outbox relay pass" && pass == nil {
				pass = s
			}
		}
		_, ok := byName[want[len(want)-1]]
		_, processed := byName[process]
		return ok && processed && pass != nil
	})
	var parent trace.SpanContext
	for i, name := range want {
		s, ok := byName[name]
		if !ok {
			t.Fatalf("no span %q among %d", name, len(rec.Ended()))
		}
		t.Logf("%-28s trace %s span %s parent %s", name, s.SpanContext().TraceID(), s.SpanContext().SpanID(), s.Parent().SpanID())
		if i > 0 && (s.Parent().SpanID() != parent.SpanID() || s.SpanContext().TraceID() != parent.TraceID()) {
			t.Errorf("span %q has parent %s in trace %s, want %q's span %s in trace %s", name,
				s.Parent().SpanID(), s.SpanContext().TraceID(), want[i-1], parent.SpanID(), parent.TraceID())
		}
		parent = s.SpanContext()
	}
	send := byName["send OrderPlaced"]
	if pass.SpanContext().TraceID() == send.SpanContext().TraceID() {
		t.Error("the relay's pass is in the request's trace; want a trace of its own")
	}
	if links := send.Links(); len(links) != 1 || links[0].SpanContext.SpanID() != pass.SpanContext().SpanID() {
		t.Errorf("the publish's links = %v, want the pass %s", links, pass.SpanContext().SpanID())
	}
	processed := byName[process]
	if links := processed.Links(); len(links) != 1 || links[0].SpanContext.SpanID() != send.SpanContext().SpanID() {
		t.Errorf("the process span's links = %v, want the publish %s, its creation context", links, send.SpanContext().SpanID())
	}
	for _, s := range []sdktrace.ReadOnlySpan{send, processed} {
		if got := attributeOf(s, "messaging.system"); got != system {
			t.Errorf("%s: messaging.system = %q, want %s", s.Name(), got, system)
		}
	}
	if send.SpanKind() != trace.SpanKindProducer || processed.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("kinds: send %v, process %v; want producer and consumer", send.SpanKind(), processed.SpanKind())
	}
}

// attributeOf is the string value of s's attribute key, or "".
func attributeOf(s sdktrace.ReadOnlySpan, key string) string {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value.String()
		}
	}
	return ""
}

// GET /metrics, while the broker is down and after it is back: the lag
// gauge rises with the order that waits, the failure counter counts the
// publishes that found the broker unavailable, and once the broker is back
// the gauge falls to zero, the message counts as sent and the warehouse's
// consumer counts it applied: on JetStream and on RabbitMQ.
func TestMetricsShowTheLagWhileTheBrokerIsDown(t *testing.T) {
	for _, broker := range []string{"jetstream", "rabbitmq"} {
		t.Run(broker, func(t *testing.T) { metricsWhileDown(t, broker) })
	}
}

// metricsWhileDown is TestMetricsShowTheLagWhileTheBrokerIsDown on broker.
func metricsWhileDown(t *testing.T, broker string) {
	base, _, _ := startShopOn(t, broker, "polling")
	call(t, "POST", base+"/broker/down", "", 200, `{"broker":"down"}`)
	call(t, "POST", base+"/orders", `{"totalCents":4000}`, 201, `{"orderId":1}`)
	var down map[string]float64
	waitFor(t, "the lag and the failures to show", func() bool {
		down = scrape(t, base)
		return down["outbox_unsent"] == 1 && down["outbox_oldest_unsent_age_seconds"] > 0.1 &&
			down[`messaging_client_sent_messages_total{error_type="unavailable"}`] >= 2
	})
	t.Logf("broker down: %v", down)
	call(t, "POST", base+"/broker/up", "", 200, `{"broker":"up"}`)
	var up map[string]float64
	waitFor(t, "the lag to fall and the message to be applied", func() bool {
		up = scrape(t, base)
		return up["outbox_unsent"] == 0 && up["outbox_oldest_unsent_age_seconds"] == 0 &&
			up["messaging_client_sent_messages_total"] == 1 &&
			up[`messaging_client_consumed_messages_total{outbox_result="applied"}`] == 1
	})
	t.Logf("broker up: %v", up)
	// Every send counted names the broker's system, as the messaging
	// conventions require of messaging.client.sent.messages.
	system := map[string]string{"jetstream": "nats", "rabbitmq": "rabbitmq"}[broker]
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	sends := 0
	for line := range strings.SplitSeq(string(body), "\n") {
		if strings.HasPrefix(line, "messaging_client_sent_messages_total{") {
			sends++
			if !strings.Contains(line, `messaging_system="`+system+`"`) {
				t.Errorf("a send counted without messaging_system=%q: %s", system, line)
			}
		}
	}
	if sends == 0 {
		t.Error("no messaging_client_sent_messages_total line in /metrics")
	}
	if up[`messaging_client_sent_messages_total{error_type="unavailable"}`] < down[`messaging_client_sent_messages_total{error_type="unavailable"}`] {
		t.Error("the failure counter went down")
	}
	if up["outbox_relay_pass_duration_seconds_count"] <= down["outbox_relay_pass_duration_seconds_count"] {
		t.Error("no pass counted after the broker came back")
	}
	// The pass's histogram has buckets in seconds, from 5 ms to 10 s, so
	// that a pass near PassTimeout (5 s) stands apart from a quick one; the
	// SDK's default boundaries (0, 5, 10 … 10000) are for milliseconds.
	resp, err = http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	text, _ := io.ReadAll(resp.Body)
	var les []string
	for line := range strings.Lines(string(text)) {
		if strings.HasPrefix(line, "outbox_relay_pass_duration_seconds_bucket{") {
			if m := regexp.MustCompile(`[{,]le="([^"]*)"`).FindStringSubmatch(line); m != nil {
				les = append(les, m[1])
			}
		}
	}
	if got, want := strings.Join(les, " "), "0.005 0.01 0.025 0.05 0.075 0.1 0.25 0.5 0.75 1 2.5 5 7.5 10 +Inf"; got != want {
		t.Errorf("outbox.relay.pass.duration's buckets: %s, want %s", got, want)
	}
}

// scrape reads GET /metrics into its samples, each named with the labels
// that tell them apart here (error_type, outbox_result), the others
// dropped.
func scrape(t *testing.T, base string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	samples := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		name, labels, _ := strings.Cut(line[:i], "{")
		for _, l := range strings.Split(strings.TrimSuffix(labels, "}"), ",") {
			if strings.HasPrefix(l, "error_type=") || strings.HasPrefix(l, "outbox_result=") {
				name += "{" + l + "}"
			}
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		samples[name] += v
	}
	return samples
}
