package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/metric"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// messageBroker is the broker the shop runs on (-broker): JetStream,
// embedded in the shop's process (the default), or RabbitMQ, a node the
// shop starts as a child process. It is all the shop knows of either: what
// the relay publishes to, what the warehouse consumes from, and what the
// page, GET /outbox and the broker's controls ask of it. Its methods are
// safe for concurrent use.
type messageBroker interface {
	// Name is the broker's name as the page shows it.
	Name() string
	// URL is where its clients connect.
	URL() string
	// Provision creates (or updates) what the shop needs on the broker, and
	// says what, for migrate; Check refuses to serve without it.
	Provision(ctx context.Context) (string, error)
	Check(ctx context.Context) error
	// Publisher is what the relay publishes through.
	Publisher() postgres.MessageBroker
	// Warehouse is the consumer that feeds h the warehouse's messages.
	Warehouse(h handler, logger *slog.Logger, meters metric.MeterProvider) (runner, error)
	// Stored is how many messages the broker holds; Dropped, how many
	// copies it dropped itself by their key.
	Stored(ctx context.Context) (int64, error)
	Dropped() int64
	// ConsumerView is the warehouse consumer's state, for GET /outbox.
	ConsumerView(ctx context.Context) (map[string]any, error)
	// Replay delivers every message the broker keeps to h again, through a
	// consumer of its own, and returns once it has; errNoReplay if the
	// broker keeps none once acknowledged.
	Replay(ctx context.Context, h handler, meters metric.MeterProvider) error
	// Down stops the broker (one node of a cluster) and says what it did;
	// Up starts again what is down; State says "up", "down" or how many
	// nodes are up.
	Down() string
	Up() error
	State() string
	// Stop stops the broker for good.
	Stop()
}

// handler is the warehouse as both brokers' consumers call it
// (natsbroker.Handler, rabbitbroker.Handler).
type handler interface {
	Handle(ctx context.Context, msg postgres.Message) (applied bool, err error)
}

// runner is a consumer's loop.
type runner interface {
	Run(ctx context.Context) error
}

// errNoReplay is Replay's answer from a broker that keeps no message once
// its consumer acknowledged it.
var errNoReplay = errors.New("the broker keeps no message once the warehouse acknowledged it: there is nothing to replay")

// startMessageBroker starts the broker kind names, with its store in
// store: jetstream, rabbitmq or kafka.
func startMessageBroker(kind, store string, nodes int) (messageBroker, error) {
	switch kind {
	case "jetstream":
		return startJetStream(store, nodes)
	case "rabbitmq":
		return startRabbitMQ(store, nodes)
	case "kafka":
		return startKafka(store, nodes)
	}
	return nil, fmt.Errorf("-broker %q: want jetstream, rabbitmq or kafka", kind)
}

// jetStream is the shop's broker on JetStream: the embedded servers, a
// connection to them, the stream natsbroker.StreamConfig describes (a
// replica on each server) and the warehouse's durable consumer.
type jetStream struct {
	*embeddedBroker
	nc        *nats.Conn
	js        jetstream.JetStream
	publisher *natsbroker.Publisher
	nodes     int
	warehouse atomic.Pointer[natsbroker.Consumer] // the warehouse's consumer, once made
}

func startJetStream(store string, nodes int) (*jetStream, error) {
	broker, err := startBroker(store, nodes)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(broker.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		broker.Stop()
		return nil, err
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(time.Minute))
	if err != nil {
		nc.Close()
		broker.Stop()
		return nil, err
	}
	publisher, err := natsbroker.NewPublisher(js, natsbroker.PublisherOptions{})
	if err != nil {
		nc.Close()
		broker.Stop()
		return nil, err
	}
	return &jetStream{embeddedBroker: broker, nc: nc, js: js, publisher: publisher, nodes: nodes}, nil
}

func (b *jetStream) Name() string { return "JetStream" }

// streamConfig is the stream the shop provisions and checks: a replica on
// each server.
func (b *jetStream) streamConfig() jetstream.StreamConfig {
	cfg := natsbroker.StreamConfig(0)
	cfg.Replicas = b.nodes
	return cfg
}

func (b *jetStream) Provision(ctx context.Context) (string, error) {
	// A cluster that starts again from its stores answers only once it has
	// elected its leaders, as Check waits for them too.
	cfg := b.streamConfig()
	var stream jetstream.Stream
	if err := whileStarting(ctx, func() (err error) { stream, err = b.js.CreateOrUpdateStream(ctx, cfg); return err }, refused); err != nil {
		return "", fmt.Errorf("provision stream %s: %w", cfg.Name, err)
	}
	if err := whileStarting(ctx, func() error {
		_, err := stream.CreateOrUpdateConsumer(ctx, natsbroker.ConsumerConfig("warehouse", 0))
		return err
	}, refused); err != nil {
		return "", fmt.Errorf("provision consumer warehouse: %w", err)
	}
	return fmt.Sprintf("stream %s (replicas: %d) and consumer warehouse", cfg.Name, cfg.Replicas), nil
}

func (b *jetStream) Check(ctx context.Context) error {
	if err := whileStarting(ctx, func() error { return natsbroker.CheckStream(ctx, b.js, b.streamConfig()) },
		func(err error) bool { return errors.Is(err, natsbroker.ErrStreamConfig) }); err != nil {
		return fmt.Errorf("%w: run shop migrate first", err)
	}
	if err := whileStarting(ctx, func() error { _, err := b.consumer(ctx); return err },
		func(err error) bool { return errors.Is(err, jetstream.ErrConsumerNotFound) }); err != nil {
		return fmt.Errorf("consumer warehouse: %w: run shop migrate first", err)
	}
	return nil
}

func (b *jetStream) consumer(ctx context.Context) (jetstream.Consumer, error) {
	return b.js.Consumer(ctx, natsbroker.Stream, "warehouse")
}

func (b *jetStream) Publisher() postgres.MessageBroker { return b.publisher }

func (b *jetStream) Warehouse(h handler, logger *slog.Logger, meters metric.MeterProvider) (runner, error) {
	ctx, cancel := context.WithTimeout(context.Background(), brokerTimeout)
	defer cancel()
	cons, err := b.consumer(ctx)
	if err != nil {
		return nil, err
	}
	c, err := natsbroker.NewConsumer(cons, h, natsbroker.ConsumerOptions{Logger: logger, MeterProvider: meters})
	if err != nil {
		return nil, err
	}
	b.warehouse.Store(c)
	return c, nil
}

func (b *jetStream) Stored(ctx context.Context) (int64, error) {
	stream, err := b.js.Stream(ctx, natsbroker.Stream)
	if err != nil {
		return 0, err
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, err
	}
	return int64(info.State.Msgs), nil
}

// Dropped counts the copies JetStream's duplicate window dropped.
func (b *jetStream) Dropped() int64 { return b.publisher.Duplicates() }

func (b *jetStream) ConsumerView(ctx context.Context) (map[string]any, error) {
	cons, err := b.consumer(ctx) // asks for its info: one request
	if err != nil {
		return nil, err
	}
	info := cons.CachedInfo()
	view := map[string]any{"pending": info.NumPending, "ackPending": info.NumAckPending, "redelivered": info.NumRedelivered}
	if c := b.warehouse.Load(); c != nil { // messages asked for again after failures that may pass, and the oldest's wait
		view["waiting"], view["oldestWaitingSeconds"] = c.Waiting(), c.OldestWaiting().Seconds()
	}
	return view, nil
}

// Replay delivers the whole stream again to h, through a consumer of its
// own that lives for the replay: what a consumer reset to the start, or a
// copy that came after the broker's duplicate window, makes the warehouse
// see.
func (b *jetStream) Replay(ctx context.Context, h handler, meters metric.MeterProvider) error {
	stream, err := b.js.Stream(ctx, natsbroker.Stream)
	if err != nil {
		return err
	}
	cfg := natsbroker.ConsumerConfig("", 30*time.Second)
	cfg.InactiveThreshold = time.Minute // ephemeral: gone a minute after the replay, whatever happens
	cons, err := stream.CreateConsumer(ctx, cfg)
	if err != nil {
		return err
	}
	defer stream.DeleteConsumer(context.WithoutCancel(ctx), cons.CachedInfo().Name)
	c, err := natsbroker.NewConsumer(cons, h, natsbroker.ConsumerOptions{MeterProvider: meters})
	if err != nil {
		return err
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	defer func() { stop(); <-done }()
	for {
		info, err := cons.Info(ctx)
		if err != nil {
			return err
		}
		if info.NumPending == 0 && info.NumAckPending == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-done:
			return fmt.Errorf("the replay's consumer stopped: %w", err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (b *jetStream) Stop() {
	b.nc.Close()
	b.embeddedBroker.Stop()
}
