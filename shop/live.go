package main

import (
	"context"
	"database/sql"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/metric"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

// The live page: GET / is page.html, which opens GET /events, a stream of
// Server-Sent Events, each the whole state the page shows, sent whenever it
// changed. The page's controls call the API and the endpoints below.

//go:embed page.html
var page []byte

// live is what the page shows and what its controls act on.
type live struct {
	db        *sql.DB
	outbox    *postgres.Outbox[postgres.SQLTx]
	orders    *shop.OrderService
	broker    messageBroker
	lossy     *lossyPublisher
	warehouse *countingHandler
	relay     *relayRunner
	meters    metric.MeterProvider // the warehouse's, for a replay's counts too
	stopped   <-chan struct{}      // closed when the shop stops: the streams end

	mu     sync.Mutex
	passes []pass // the latest passes that did something, newest first

	state *snapshot[state] // read, one period old at most, for every viewer at once
}

// statePeriod is how often the page's state is read, for all viewers.
const statePeriod = 200 * time.Millisecond

// sentCountCap is how far the page counts the outbox's sent rows: beyond
// it, it says "at least", so that a table of sent rows kept a week costs
// the page no more than this.
const sentCountCap = 10000

// pass is a relay pass as the page lists it.
type pass struct {
	At        string `json:"at"`
	Claimed   int    `json:"claimed"`
	Published int    `json:"published"`
	Marked    int    `json:"marked"`
	Error     string `json:"error,omitempty"`
}

// onPass keeps the passes that claimed something or failed.
func (l *live) onPass(r postgres.PassReport) {
	if r.Claimed == 0 && r.Marked == 0 && r.Err == nil {
		return
	}
	p := pass{At: time.Now().Format("15:04:05.000"), Claimed: r.Claimed, Published: r.Published, Marked: r.Marked}
	if r.Err != nil {
		p.Error = r.Err.Error()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.passes = append([]pass{p}, l.passes...)
	if len(l.passes) > 8 {
		l.passes = l.passes[:8]
	}
}

// state is what the page shows, read from the database, the broker and the
// shop's parts at one moment.
type state struct {
	Orders []orderState `json:"orders"`
	Outbox struct {
		Unsent        int64   `json:"unsent"`
		Sent          int64   `json:"sent"`
		SentMore      bool    `json:"sentMore,omitempty"` // more than Sent, which is sentCountCap
		Parked        int64   `json:"parked"`
		OldestSeconds float64 `json:"oldestWaitSeconds"`
	} `json:"outbox"`
	Relay struct {
		Running bool   `json:"running"`
		Passes  []pass `json:"passes"`
	} `json:"relay"`
	Broker struct {
		Name       string `json:"name"`       // JetStream or RabbitMQ
		Up         string `json:"up"`         // "up", "down", "2 of 3 up", or "changing" while a RabbitMQ node stops or starts
		Stored     *int64 `json:"stored"`     // messages in the stream, or waiting in the queue; nil while it cannot be asked
		Duplicates int64  `json:"duplicates"` // copies the broker dropped (JetStream; RabbitMQ drops none)
		LoseNext   bool   `json:"loseNextAck"`
	} `json:"broker"`
	Warehouse struct {
		Applied    int64 `json:"applied"`
		Duplicates int64 `json:"duplicates"`
	} `json:"warehouse"`
}

// orderState is an order and how far its events went.
type orderState struct {
	ID         int64  `json:"orderId"`
	TotalCents int64  `json:"totalCents"`
	State      string `json:"state"` // waiting, sent, reserved, cancelled
}

// read reads the state.
func (l *live) read(ctx context.Context) (state, error) {
	var s state
	rows, err := l.db.QueryContext(ctx, `
		SELECT o.id, o.total_cents,
		       CASE WHEN o.cancelled_at IS NOT NULL THEN 'cancelled'
		            WHEN EXISTS (SELECT 1 FROM reservations r WHERE r.order_id = o.id) THEN 'reserved'
		            WHEN EXISTS (SELECT 1 FROM outbox WHERE aggregate = 'order/' || o.id AND sent_at IS NULL) THEN 'waiting'
		            ELSE 'sent' END
		FROM orders o ORDER BY o.id DESC LIMIT 12`)
	if err != nil {
		return s, err
	}
	defer rows.Close()
	for rows.Next() {
		var o orderState
		if err := rows.Scan(&o.ID, &o.TotalCents, &o.State); err != nil {
			return s, err
		}
		s.Orders = append(s.Orders, o)
	}
	if err := rows.Err(); err != nil {
		return s, err
	}
	lag, err := l.outbox.ReadLag(ctx)
	if err != nil {
		return s, err
	}
	s.Outbox.Unsent, s.Outbox.Parked, s.Outbox.OldestSeconds = lag.Unsent, lag.Parked, lag.Oldest.Seconds()
	if err := l.db.QueryRowContext(ctx, `SELECT count(*) FROM (SELECT FROM outbox WHERE sent_at IS NOT NULL LIMIT $1) s`,
		sentCountCap+1).Scan(&s.Outbox.Sent); err != nil {
		return s, err
	}
	if s.Outbox.Sent > sentCountCap {
		s.Outbox.Sent, s.Outbox.SentMore = sentCountCap, true
	}
	s.Relay.Running = l.relay.Running()
	l.mu.Lock()
	s.Relay.Passes = append([]pass{}, l.passes...)
	l.mu.Unlock()
	s.Broker.Name, s.Broker.Up = l.broker.Name(), l.broker.State()
	s.Broker.Duplicates = l.broker.Dropped()
	s.Broker.LoseNext = l.lossy.loseNext.Load()
	ictx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if n, err := l.broker.Stored(ictx); err == nil {
		s.Broker.Stored = &n
	}
	s.Warehouse.Applied, s.Warehouse.Duplicates = l.warehouse.applied.Load(), l.warehouse.duplicates.Load()
	return s, nil
}

// events streams the state to one page until it goes away: a first event at
// once, so that a page reloaded shows the state as it is, then one whenever
// the state changed, looked at every 200 ms.
func (l *live) events(w http.ResponseWriter, r *http.Request) {
	flusher, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	// The server's write timeout is for requests, not for a stream.
	if err := http.NewResponseController(w).SetWriteDeadline(time.Time{}); err != nil {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	var last []byte
	tick := time.NewTicker(statePeriod)
	defer tick.Stop()
	for {
		ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
		s, err := l.state.get(ctx)
		cancel()
		if err == nil {
			b, _ := json.Marshal(s)
			if string(b) != string(last) {
				fmt.Fprintf(w, "data: %s\n\n", b)
				flusher.Flush()
				last = b
			}
		}
		select {
		case <-r.Context().Done():
			return
		case <-l.stopped:
			return
		case <-tick.C:
		}
	}
}

// routes adds the page, its events and its controls to mux.
func (l *live) routes(mux *http.ServeMux) {
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Write(page)
	})
	mux.HandleFunc("GET /events", l.events)
	mux.HandleFunc("POST /orders/{id}/cancel", func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
		if err != nil {
			writeJSON(w, http.StatusBadRequest, problem("order id must be a whole number"))
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
		defer cancel()
		switch err := l.orders.CancelOrder(ctx, id); {
		case errors.Is(err, shop.ErrOrderNotFound):
			writeJSON(w, http.StatusNotFound, problem(fmt.Sprintf("no order %d", id)))
		case errors.Is(err, shop.ErrOrderCancelled):
			writeJSON(w, http.StatusConflict, problem(fmt.Sprintf("order %d is cancelled already", id)))
		case err != nil:
			writeJSON(w, http.StatusServiceUnavailable, problem("the order was not cancelled: "+err.Error()))
		default:
			writeJSON(w, http.StatusOK, map[string]any{"orderId": id, "cancelled": true})
		}
	})
	mux.HandleFunc("POST /warehouse/replay", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), time.Minute)
		defer cancel()
		replayed, duplicates, err := l.replay(ctx)
		if errors.Is(err, errNoReplay) {
			writeJSON(w, http.StatusConflict, problem(l.broker.Name()+": "+err.Error()))
			return
		}
		if err != nil {
			writeJSON(w, http.StatusServiceUnavailable, problem("replay: "+err.Error()))
			return
		}
		writeJSON(w, http.StatusOK, map[string]int64{"replayed": replayed, "duplicates": duplicates})
	})
	mux.HandleFunc("POST /broker/lose-next-ack", func(w http.ResponseWriter, r *http.Request) {
		l.lossy.loseNext.Store(true)
		writeJSON(w, http.StatusOK, map[string]bool{"loseNextAck": true})
	})
	mux.HandleFunc("POST /relay/stop", func(w http.ResponseWriter, r *http.Request) {
		l.relay.Stop()
		writeJSON(w, http.StatusOK, map[string]bool{"running": false})
	})
	mux.HandleFunc("POST /relay/start", func(w http.ResponseWriter, r *http.Request) {
		l.relay.Start()
		writeJSON(w, http.StatusOK, map[string]bool{"running": true})
	})
}

// lossyPublisher is the shop's publisher with one fault a person can
// inject: the next publish reaches the broker, and its ack is lost, so the
// relay leaves the row unsent and publishes it again. JetStream drops the
// copy by its Nats-Msg-Id; RabbitMQ delivers it, and the warehouse drops it
// by its key.
type lossyPublisher struct {
	broker   postgres.MessageBroker
	loseNext atomic.Bool
}

// lossyBatches and lossySequences are a lossyPublisher of a broker that
// publishes batches, or sequences too: the relay asks which a broker is.
type (
	lossyBatches   struct{ *lossyPublisher }
	lossySequences struct{ lossyBatches }
)

// newLossyPublisher wraps broker in a lossyPublisher that is a
// postgres.BatchPublisher, or a SequencePublisher, if broker is.
func newLossyPublisher(broker postgres.MessageBroker) (*lossyPublisher, postgres.MessageBroker) {
	p := &lossyPublisher{broker: broker}
	if _, ok := broker.(postgres.BatchPublisher); !ok {
		return p, p
	}
	if _, ok := broker.(postgres.SequencePublisher); !ok {
		return p, lossyBatches{p}
	}
	return p, lossySequences{lossyBatches{p}}
}

var errAckLost = fmt.Errorf("the ack was lost on its way back (a fault the page injected): %w", postgres.ErrBrokerUnavailable)

// MessagingSystem is the broker's, for the relay's spans.
func (p *lossyPublisher) MessagingSystem() string {
	if m, ok := p.broker.(postgres.MessagingSystem); ok {
		return m.MessagingSystem()
	}
	return ""
}

func (p *lossyPublisher) Publish(ctx context.Context, msg postgres.Message) error {
	err := p.broker.Publish(ctx, msg)
	if err == nil && p.loseNext.CompareAndSwap(true, false) {
		return errAckLost
	}
	return err
}

// lose is a batch's or a sequence's answer with the next ack lost: the
// first message's, and so all after it.
func (p *lossyPublisher) lose(n int, err error) (int, error) {
	if n > 0 && p.loseNext.CompareAndSwap(true, false) {
		return 0, errAckLost
	}
	return n, err
}

func (p lossyBatches) PublishBatch(ctx context.Context, msgs []postgres.Message) (int, error) {
	return p.lose(p.broker.(postgres.BatchPublisher).PublishBatch(ctx, msgs))
}

func (p lossySequences) PublishSequence(ctx context.Context, msgs []postgres.Message) (int, error) {
	return p.lose(p.broker.(postgres.SequencePublisher).PublishSequence(ctx, msgs))
}

// countingHandler is the warehouse, counting what it applied and the
// copies it dropped.
type countingHandler struct {
	handler
	applied, duplicates atomic.Int64
	since               time.Time // when the counts began: the process's start
}

func (c *countingHandler) Handle(ctx context.Context, msg postgres.Message) (bool, error) {
	applied, err := c.handler.Handle(ctx, msg)
	switch {
	case err != nil:
	case applied:
		c.applied.Add(1)
	default:
		c.duplicates.Add(1)
	}
	return applied, err
}

// HandleBatch applies msgs in one transaction if the warehouse takes
// batches (shop.Warehouse does, through ApplyBatch), counting each; a
// warehouse that does not is refused, and the consumer then hands it the
// messages one at a time.
func (c *countingHandler) HandleBatch(ctx context.Context, msgs []postgres.Message) ([]bool, error) {
	b, ok := c.handler.(interface {
		HandleBatch(context.Context, []postgres.Message) ([]bool, error)
	})
	if !ok {
		return nil, errors.New("the warehouse applies one message at a time")
	}
	applied, err := b.HandleBatch(ctx, msgs)
	if err != nil {
		return nil, err
	}
	for _, a := range applied {
		if a {
			c.applied.Add(1)
		} else {
			c.duplicates.Add(1)
		}
	}
	return applied, nil
}

// relayRunner runs the relay's loop, and stops and starts it again when the
// page asks: a relay killed and started again resumes from the table.
type relayRunner struct {
	relay interface{ Run(context.Context) error } // the polling relay or the log relay
	ctx   context.Context                         // the shop's: a relay outlives no shop
	errs  chan<- error                            // where a relay that stopped on its own says why

	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
}

// Start starts the loop unless it runs.
func (r *relayRunner) Start() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done != nil {
		return
	}
	ctx, cancel := context.WithCancel(r.ctx)
	done := make(chan struct{})
	r.cancel, r.done = cancel, done
	go func() {
		defer close(done)
		err := r.relay.Run(ctx)
		if ctx.Err() == nil || r.ctx.Err() != nil { // not a stop the page asked for
			select {
			case r.errs <- fmt.Errorf("relay: %w", err):
			default: // serve heard of a stop already
			}
		}
	}()
}

// Stop stops the loop, once its pass in progress has marked what the
// broker accepted, and waits for it.
func (r *relayRunner) Stop() {
	r.mu.Lock()
	cancel, done := r.cancel, r.done
	r.cancel, r.done = nil, nil
	r.mu.Unlock()
	if done != nil {
		cancel()
		<-done
	}
}

// Running reports whether the loop runs.
func (r *relayRunner) Running() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.done != nil
}

// replay delivers every message the broker keeps again to the warehouse
// (messageBroker.Replay): what a consumer reset to the start, or a copy
// that came after the broker's duplicate window, makes the warehouse see.
// Each message it applied before is dropped by its key and counted as a
// duplicate, on the page, in /outbox and in /metrics. It returns how many
// messages went through, and how many of those were duplicates.
func (l *live) replay(ctx context.Context) (replayed, duplicates int64, err error) {
	applied, dups := l.warehouse.applied.Load(), l.warehouse.duplicates.Load()
	if err := l.broker.Replay(ctx, l.warehouse, l.meters); err != nil {
		return 0, 0, err
	}
	duplicates = l.warehouse.duplicates.Load() - dups
	return l.warehouse.applied.Load() - applied + duplicates, duplicates, nil
}
