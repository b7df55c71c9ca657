package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"example.com/patterns/enterprise/outbox/postgres"
)

// health is what /healthz and /readyz answer from: the latest check of the
// database, the schema and the broker; whether the log relay stands by;
// how many rows wait; and when a pass last succeeded. It is safe for
// concurrent use.
type health struct {
	stallAfter time.Duration

	mu          sync.Mutex
	notReady    string // why the relay is not ready; "" when it is
	standby     string // why a log relay stands by; "" when it relays
	unsent      int64
	blocking    string // the first failing row and why, as lag says it; "" if none
	lastSuccess time.Time
}

// onPass records a pass of either relay.
func (h *health) onPass(r postgres.PassReport) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case errors.Is(r.Err, postgres.ErrSlotActive):
		h.standby, h.lastSuccess = "standby: another relay reads the slot; this one takes over when it stops", time.Now()
	case r.Err == nil:
		h.standby, h.lastSuccess = "", time.Now()
	}
}

// setReady records a check's outcome and reports whether it changed.
func (h *health) setReady(err error) (changed bool) {
	why := ""
	if err != nil {
		why = err.Error()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	changed = (h.notReady == "") != (why == "")
	h.notReady = why
	return changed
}

func (h *health) setLag(l postgres.Lag) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.unsent, h.blocking = l.Unsent, blockingText(l.Blocking)
}

func (h *health) healthz(w http.ResponseWriter, _ *http.Request) {
	h.mu.Lock()
	unsent, since := h.unsent, time.Since(h.lastSuccess)
	h.mu.Unlock()
	if unsent > 0 && since > h.stallAfter {
		http.Error(w, fmt.Sprintf("stalled: %d rows wait and no pass succeeded for %v (-stall-after %v)",
			unsent, since.Round(time.Second), h.stallAfter), http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintln(w, "ok")
}

func (h *health) readyz(w http.ResponseWriter, _ *http.Request) {
	h.mu.Lock()
	notReady, standby, blocking := h.notReady, h.standby, h.blocking
	h.mu.Unlock()
	switch {
	case notReady != "":
		http.Error(w, "not ready: "+notReady, http.StatusServiceUnavailable)
		return
	case standby != "":
		fmt.Fprintln(w, "ready: "+standby)
	default:
		fmt.Fprintln(w, "ready")
	}
	if blocking != "" { // ready, and what holds rows up
		fmt.Fprintln(w, blocking)
	}
}

// checkAll is run's check, bounded in time: the database answers, the
// schema is at its version, the role has what the relay needs, the broker
// answers and is as configured.
func checkAll(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], b broker) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	role, extra := part(c)
	return errors.Join(outbox.CheckSchema(ctx), outbox.CheckPrivileges(ctx, role, extra...), standbys(ctx, c, outbox), b.Check(ctx))
}

// standbys reports a primary with fewer standbys streaming than
// -standby-count wants, on which the relay publishes nothing: none at all
// is no error with -publish-without-standbys, which publishes.
func standbys(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx]) error {
	want := c.relay.StandbyCount
	if want == 0 {
		return nil
	}
	n, err := outbox.Standbys(ctx)
	switch {
	case err != nil:
		return err
	case n >= want || n == 0 && c.relay.PublishWithoutStandbys:
		return nil
	}
	return fmt.Errorf("the primary has %d standbys streaming, and -standby-count wants %d: nothing is published until they stream", n, want)
}

// relay serves the health endpoints, waits until the database and the
// broker check out, then relays and cleans up until ctx ends, checking them
// again every checkEvery for /readyz.
func relay(ctx context.Context, c config, pgcfg *pgx.ConnConfig, outbox *postgres.Outbox[postgres.SQLTx], b broker, log *slog.Logger) error {
	reg := prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(reg), otelprom.WithoutScopeInfo())
	if err != nil {
		return err
	}
	meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp))
	defer meters.Shutdown(context.WithoutCancel(ctx))
	h := &health{stallAfter: c.stallAfter, notReady: "not checked yet", lastSuccess: time.Now()}
	if c.http != "" {
		ln, err := net.Listen("tcp", c.http)
		if err != nil {
			return fmt.Errorf("-http: %w", err)
		}
		mux := http.NewServeMux()
		mux.HandleFunc("GET /healthz", h.healthz)
		mux.HandleFunc("GET /readyz", h.readyz)
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln)
		defer srv.Close()
		log.Info("outbox-relay: serving /healthz, /readyz and /metrics", "addr", ln.Addr().String())
	}

	for {
		err := checkAll(ctx, c, outbox, b)
		h.setReady(err)
		if err == nil {
			break
		}
		log.Warn("outbox-relay: not ready; checking again", "err", err, "in", c.checkEvery.String())
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(c.checkEvery):
		}
	}
	if err := b.CheckRetention(ctx, c.processedRetention); err != nil {
		return err
	}
	lag, err := outbox.ObserveLag(meters)
	if err != nil {
		return err
	}
	defer lag.Unregister()
	log.Info("outbox-relay: ready", "table", outbox.Table(), "broker", c.broker, "mode", c.mode)

	publisher := b.Publisher()
	done := make(chan error, 1)
	if c.mode == "log" {
		cfg := c.log
		cfg.Logger, cfg.MeterProvider, cfg.OnPass = log, meters, h.onPass
		r, err := outbox.NewLogRelayConfig(pgcfg.Config.Copy(), publisher, cfg)
		if err != nil {
			return err
		}
		go func() { done <- runLog(ctx, r, log) }()
		if c.sweepEvery > 0 {
			go sweep(ctx, c, outbox, publisher, h, log)
		}
	} else {
		cfg := c.relay
		cfg.Logger, cfg.MeterProvider, cfg.OnPass = log, meters, h.onPass
		r, err := outbox.NewRelay(publisher, cfg)
		if err != nil {
			return err
		}
		go func() { done <- r.Run(ctx) }()
	}
	go monitor(ctx, c, outbox, b, h, log)
	if c.retention > 0 || c.processedRetention > 0 {
		go cleanup(ctx, c, outbox, b, log)
	}
	err = <-done
	read, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if lag, lerr := outbox.ReadLag(read); lerr == nil {
		log.Info("outbox-relay: stopped", "err", err, "unsent", lag.Unsent, "parked", lag.Parked)
	} else {
		log.Info("outbox-relay: stopped", "err", err)
	}
	return err
}

// monitor checks the database and the broker every checkEvery, for
// /readyz, logging each change, and reads the lag, for /healthz.
func monitor(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], b broker, h *health, log *slog.Logger) {
	t := time.NewTicker(c.checkEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := checkAll(ctx, c, outbox, b)
		if ctx.Err() != nil {
			return
		}
		if h.setReady(err) {
			if err != nil {
				log.Warn("outbox-relay: not ready", "err", err)
			} else {
				log.Info("outbox-relay: ready again")
			}
		}
		read, cancel := context.WithTimeout(ctx, 10*time.Second)
		lag, err := outbox.ReadLag(read)
		cancel()
		if err == nil {
			h.setLag(lag)
		}
	}
}

// runLog runs the log relay until ctx ends; when its slot is lost, or
// missing (a promoted standby), it makes it anew and publishes what the
// relay may have missed (LogRelay.Recover), then streams on. A slot of
// another database (postgres.ErrSlotOfAnotherDatabase) is never taken: Run
// returns it, and so does runLog.
func runLog(ctx context.Context, r *postgres.LogRelay, log *slog.Logger) error {
	for {
		err := r.Run(ctx)
		if !errors.Is(err, postgres.ErrSlotLost) && !errors.Is(err, postgres.ErrNoSlot) {
			return err
		}
		log.Warn("outbox-relay: the log relay's slot is gone: making it anew, and publishing what it may have missed", "err", err)
		n, err := r.Recover(ctx)
		if err != nil {
			log.Error("outbox-relay: recovering the slot failed; trying again in 2 s", "err", err, "published", n)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(2 * time.Second):
			}
			continue
		}
		log.Info("outbox-relay: slot recovered", "slot", r.Config().Slot, "published", n)
	}
}

// sweep publishes, with a polling pass, the unsent rows the log relay
// cannot carry, since the log holds only inserts it has not yet confirmed:
// rows put back with unpark (Outbox.Unpark) or a replay, rows committed
// before the slot existed, and rows written with a time to deliver
// (Event.DeliverAt), once it has come. Every sweepEvery, once the oldest
// unsent row has waited longer than that (the log relay marks what it
// delivers within a moment, so a row that old is one it missed, or it is
// behind; a scheduled row counts from its time), it runs passes until one
// after the first is not full: the first releases the scheduled rows whose
// time has come, which the next publishes. A row the log relay also sends goes twice, as at
// least once allows: consumers drop the copy by its key.
func sweep(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], publisher postgres.MessageBroker, h *health, log *slog.Logger) {
	// PollOnly: the sweep only passes, on the pool's connections.
	cfg := c.relay
	cfg.PollOnly, cfg.Logger, cfg.OnPass = true, log, h.onPass
	relay, err := outbox.NewRelay(publisher, cfg)
	if err != nil {
		log.Error("outbox-relay: sweep: no relay", "err", err)
		return
	}
	t := time.NewTicker(c.sweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		read, cancel := context.WithTimeout(ctx, 10*time.Second)
		lag, err := outbox.ReadLag(read)
		cancel()
		if err != nil {
			log.Warn("outbox-relay: sweep: reading the lag failed", "err", err)
			continue
		}
		if lag.Unsent == 0 || lag.Oldest < c.sweepEvery {
			continue
		}
		total := 0
		for pass := 1; ; pass++ {
			n, err := relay.PublishPending(ctx)
			total += n
			if err != nil {
				log.Warn("outbox-relay: sweep: a polling pass failed", "err", err, "published", total)
				break
			}
			if n < relay.Config().BatchSize && pass > 1 {
				break
			}
		}
		log.Info("outbox-relay: swept unsent rows the log relay had not delivered", "published", total,
			"oldest_waited", lag.Oldest, "unsent", lag.Unsent)
	}
}

// cleanup deletes the rows sent longer than the retention ago and, if
// asked, the consumers' keys older than processedRetention (never shorter
// than the stream keeps its messages, on JetStream), every cleanupEvery,
// until ctx ends.
func cleanup(ctx context.Context, c config, outbox *postgres.Outbox[postgres.SQLTx], b broker, log *slog.Logger) {
	t := time.NewTicker(c.cleanupEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if c.retention > 0 {
			n, err := outbox.DeleteSent(ctx, c.retention)
			switch {
			case err != nil && ctx.Err() == nil:
				log.Error("outbox-relay: cleanup failed", "err", err, "deleted", n)
			case n > 0:
				log.Info("outbox-relay: cleanup", "deleted", n, "retention", c.retention.String())
			}
		}
		if c.processedRetention > 0 {
			n, err := b.ForgetProcessed(ctx, outbox, c.processedRetention)
			switch {
			case err != nil && ctx.Err() == nil:
				log.Error("outbox-relay: forgetting processed keys failed", "err", err, "forgotten", n)
			case n > 0:
				log.Info("outbox-relay: processed keys forgotten", "forgotten", n, "retention", c.processedRetention.String())
			}
		}
	}
}
