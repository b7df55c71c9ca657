package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/metric"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/kafkabroker/kafkatest"
	"example.com/patterns/enterprise/outbox/postgres"
)

// kafkaBatch is the most records of a partition the warehouse applies in
// one transaction (kafkabroker.ConsumerOptions.MaxBatch).
const kafkaBatch = 20

// kafkaPartitions is how many partitions the shop's topic has: an order's
// events share one, by its aggregate.
const kafkaPartitions = 3

// kafka is the shop's broker on Kafka (-broker kafka): a Kafka-protocol
// cluster (franz-go's kfake, since no Kafka server can be installed here)
// of -nodes brokers, run as a process of its own, the shop's own binary
// as "shop kafka-cluster", its data in the store folder, each produce
// synced before it is acknowledged; the topic outbox, with a replica on
// each broker; and the warehouse, a member of the consumer group
// warehouse, applying each partition's records in batches through
// ApplyBatch. Down stops the cluster's process, Up starts it again on the
// same ports and data.
//
// Kafka drops no copy itself: the copy a lost ack makes the relay send
// again reaches the warehouse, which drops it by its key. And the topic
// keeps what the warehouse consumed, so a replay, a consumer group of its
// own from the topic's start, hands the warehouse every record again.
type kafka struct {
	cluster   *kafkatest.Cluster
	cl        *kgo.Client // the publisher's, and the page's questions
	nodes     int
	publisher *kafkabroker.Publisher
	warehouse atomic.Pointer[kafkabroker.Consumer]
}

// kafkaGroup is the warehouse's consumer group.
const kafkaGroup = "warehouse"

func startKafka(store string, nodes int) (*kafka, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cluster, err := kafkatest.Start(kafkatest.Options{Command: []string{exe, "kafka-cluster"},
		Dir: filepath.Join(store, "kafka"), Brokers: nodes, Stderr: os.Stderr})
	if err != nil {
		return nil, err
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(cluster.Seeds()...), kgo.ClientID("shop"), kgo.ProducerLinger(0))
	if err != nil {
		cluster.Stop()
		return nil, err
	}
	publisher, err := kafkabroker.NewPublisher(cl, kafkabroker.PublisherOptions{})
	if err != nil {
		cl.Close()
		cluster.Stop()
		return nil, err
	}
	return &kafka{cluster: cluster, cl: cl, nodes: nodes, publisher: publisher}, nil
}

func (b *kafka) Name() string { return "Kafka" }

func (b *kafka) URL() string { return strings.Join(b.cluster.Seeds(), ",") }

func (b *kafka) Provision(ctx context.Context) (string, error) {
	if err := kafkabroker.Provision(ctx, b.cl, kafkabroker.Topic, kafkaPartitions, int16(b.nodes)); err != nil {
		return "", err
	}
	return fmt.Sprintf("topic %s (%d partitions, replicas: %d)", kafkabroker.Topic, kafkaPartitions, b.nodes), nil
}

func (b *kafka) Check(ctx context.Context) error {
	if err := kafkabroker.CheckTopic(ctx, b.cl, kafkabroker.Topic); err != nil {
		return fmt.Errorf("%w: run shop migrate first", err)
	}
	return nil
}

func (b *kafka) Publisher() postgres.MessageBroker { return b.publisher }

// member is the options of a client in group consuming the topic from its
// start, for kafkabroker's Consumer, which makes the client.
func (b *kafka) member(group string) []kgo.Opt {
	return []kgo.Opt{kgo.SeedBrokers(b.cluster.Seeds()...), kgo.ClientID("shop-" + group),
		kgo.ConsumerGroup(group), kgo.ConsumeTopics(kafkabroker.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}
}

// Warehouse is kafkabroker's Consumer in the group warehouse, applying in
// batches. It closes its client when Run returns.
func (b *kafka) Warehouse(h handler, logger *slog.Logger, meters metric.MeterProvider) (runner, error) {
	c, err := kafkabroker.NewConsumer(h, kafkabroker.ConsumerOptions{MaxBatch: kafkaBatch, Logger: logger, MeterProvider: meters}, b.member(kafkaGroup)...)
	if err != nil {
		return nil, err
	}
	b.warehouse.Store(c)
	return c, nil
}

// Stored is how many records the topic holds.
func (b *kafka) Stored(ctx context.Context) (int64, error) {
	o, err := kafkabroker.TopicOffsets(ctx, b.cl, kafkabroker.Topic, "")
	return o.Stored(), err
}

// Dropped is zero: Kafka drops no copy a relay sends again (its idempotent
// producer drops its own retries only).
func (b *kafka) Dropped() int64 { return 0 }

func (b *kafka) ConsumerView(ctx context.Context) (map[string]any, error) {
	o, err := kafkabroker.TopicOffsets(ctx, b.cl, kafkabroker.Topic, kafkaGroup)
	if err != nil {
		return nil, err
	}
	view := map[string]any{"pending": o.Lag(), "committed": o.Committed}
	if c := b.warehouse.Load(); c != nil {
		view["setAside"] = c.SetAside()
		view["waiting"], view["oldestWaitingSeconds"] = c.Waiting(), c.OldestWaiting().Seconds()
	}
	return view, nil
}

// Replay hands the warehouse every record of the topic again, through a
// consumer group of its own that reads from the start, and returns once
// that group has committed past what the topic held when it began; the
// group is deleted after.
func (b *kafka) Replay(ctx context.Context, h handler, meters metric.MeterProvider) error {
	until, err := kafkabroker.TopicOffsets(ctx, b.cl, kafkabroker.Topic, "")
	if err != nil {
		return err
	}
	group := fmt.Sprintf("replay-%d", time.Now().UnixNano())
	c, err := kafkabroker.NewConsumer(h, kafkabroker.ConsumerOptions{MaxBatch: kafkaBatch, MeterProvider: meters}, b.member(group)...)
	if err != nil {
		return err
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	defer func() {
		stop()
		<-done // Run left the group and closed its client
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), brokerTimeout)
		defer cancel()
		req := kmsg.NewPtrDeleteGroupsRequest()
		req.Groups = []string{group}
		req.RequestWith(dctx, b.cl) // a group left behind holds nothing but its offsets
	}()
	for {
		o, err := kafkabroker.TopicOffsets(ctx, b.cl, kafkabroker.Topic, group)
		if err != nil {
			return err
		}
		caughtUp := true
		for p, end := range until.End {
			if end > until.Start[p] && o.Committed[p] < end { // a partition with nothing in it has nothing to commit
				caughtUp = false
			}
		}
		if caughtUp {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-done:
			done <- err // for the deferred wait
			return fmt.Errorf("the replay's consumer stopped: %w", err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (b *kafka) Down() string {
	b.cluster.Down()
	return "down"
}

func (b *kafka) Up() error { return b.cluster.Up() }

// State says "up" or "down" ("down" also while a Down or Up runs).
func (b *kafka) State() string {
	if b.cluster.IsUp() {
		return "up"
	}
	return "down"
}

func (b *kafka) Stop() {
	b.cl.Close()
	b.cluster.Stop()
}

var _ messageBroker = (*kafka)(nil)
