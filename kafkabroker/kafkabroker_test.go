package kafkabroker_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// EnvBrokers names a real Kafka cluster's brokers, comma-separated, for the
// suite to run against instead of the Kafka-protocol cluster it starts in
// Go (franz-go's kfake, three brokers), which it uses when this is unset.
const EnvBrokers = "OUTBOX_KAFKA_BROKERS"

// cluster is the suite's Kafka: its seed brokers, and a client of the
// test's for setting it up.
type cluster struct {
	t     testing.TB
	seeds []string
	admin *kgo.Client
	fake  *kfake.Cluster // nil on a real cluster
}

var topics atomic.Int64

// newCluster is a cluster of t's own (kfake's three brokers), or the real
// one EnvBrokers names.
func newCluster(t testing.TB) *cluster {
	t.Helper()
	c := &cluster{t: t}
	if env := os.Getenv(EnvBrokers); env != "" {
		c.seeds = strings.Split(env, ",")
	} else {
		fake, err := kfake.NewCluster(kfake.NumBrokers(3))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(fake.Close)
		c.seeds, c.fake = fake.ListenAddrs(), fake
	}
	c.admin = c.client()
	return c
}

// faults is the kfake cluster, for a test that makes a fault; on a real
// cluster the test cannot, and says so.
func (c *cluster) faults() *kfake.Cluster {
	c.t.Helper()
	if c.fake == nil {
		c.t.Skipf("%s names a real cluster, on which this test cannot make its fault", EnvBrokers)
	}
	return c.fake
}

// client is a client of the cluster with opts, closed when the test ends.
func (c *cluster) client(opts ...kgo.Opt) *kgo.Client {
	c.t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(c.seeds...)}, opts...)...)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(cl.Close)
	return cl
}

// topic creates a topic of the test's own with partitions partitions and
// configs, and returns its name.
func (c *cluster) topic(partitions int32, configs map[string]string) string {
	c.t.Helper()
	name := fmt.Sprintf("outbox-test-%d-%d", os.Getpid(), topics.Add(1))
	req := kmsg.NewPtrCreateTopicsRequest()
	tp := kmsg.NewCreateTopicsRequestTopic()
	tp.Topic, tp.NumPartitions, tp.ReplicationFactor = name, partitions, 3
	for k, v := range configs {
		cfg := kmsg.NewCreateTopicsRequestTopicConfig()
		cfg.Name, cfg.Value = k, &v
		tp.Configs = append(tp.Configs, cfg)
	}
	req.Topics = append(req.Topics, tp)
	resp, err := req.RequestWith(context.Background(), c.admin)
	if err != nil {
		c.t.Fatal(err)
	}
	if err := kerr.ErrorForCode(resp.Topics[0].ErrorCode); err != nil {
		c.t.Fatal(err)
	}
	return name
}

// setTopicConfig sets one config of a topic.
func (c *cluster) setTopicConfig(topic, name, value string) {
	c.t.Helper()
	req := kmsg.NewPtrIncrementalAlterConfigsRequest()
	r := kmsg.NewIncrementalAlterConfigsRequestResource()
	r.ResourceType, r.ResourceName = kmsg.ConfigResourceTypeTopic, topic
	cfg := kmsg.NewIncrementalAlterConfigsRequestResourceConfig()
	cfg.Name, cfg.Value, cfg.Op = name, &value, kmsg.IncrementalAlterConfigOpSet
	r.Configs = append(r.Configs, cfg)
	req.Resources = append(req.Resources, r)
	resp, err := req.RequestWith(context.Background(), c.admin)
	if err != nil {
		c.t.Fatal(err)
	}
	if err := kerr.ErrorForCode(resp.Resources[0].ErrorCode); err != nil {
		c.t.Fatal(err)
	}
}

// records reads every record of topic from its start, until it has read
// n, within the generous deadline.
func (c *cluster) records(topic string, n int) []*kgo.Record {
	c.t.Helper()
	cl := c.client(kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		f := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			c.t.Fatalf("read %d records of %s, want %d", len(out), topic, n)
		}
		out = append(out, f.Records()...)
	}
	return out
}

// memberOptions are the options of a member of group consuming topic
// from its start, for a Consumer's client.
func (c *cluster) memberOptions(group, topic string) []kgo.Opt {
	return []kgo.Opt{kgo.SeedBrokers(c.seeds...), kgo.ConsumerGroup(group), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(10 * time.Second)}
}

// newDatabase is a database of t's own with the outbox's, the consumer's
// and the shop's tables.
func newDatabase(t testing.TB) *sql.DB {
	t.Helper()
	db := pgtest.Open(t, pgtest.NewBlankDatabase(t), "")
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(ob.Migrate(context.Background()), ob.MigrateConsumer(context.Background()), shop.Migrate(context.Background(), db)); err != nil {
		t.Fatal(err)
	}
	return db
}

// waitFor polls cond until it holds, failing t after a minute.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within a minute", what)
		}
	}
}

func count(t testing.TB, db *sql.DB, q string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// logBuffer collects a logger's lines; safe for concurrent use.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// runConsumer runs a Consumer of group on topic over a client of its own,
// handing h its records, until the returned stop is called or t ends.
func runConsumer(t *testing.T, c *cluster, group, topic string, h kafkabroker.Handler, log *slog.Logger) (stop func()) {
	t.Helper()
	stop, _ = runConsumerWith(t, c, group, topic, h, kafkabroker.ConsumerOptions{Logger: log})
	return stop
}

// runConsumerWith is runConsumer with opts (RetryDelay and MaxRetryDelay,
// if zero, short) and, after the member's own, the client options more,
// and returns the Consumer too.
func runConsumerWith(t testing.TB, c *cluster, group, topic string, h kafkabroker.Handler, opts kafkabroker.ConsumerOptions, more ...kgo.Opt) (stop func(), _ *kafkabroker.Consumer) {
	t.Helper()
	if opts.RetryDelay == 0 {
		opts.RetryDelay, opts.MaxRetryDelay = 50*time.Millisecond, 200*time.Millisecond
	}
	consumer, err := kafkabroker.NewConsumer(h, opts, append(c.memberOptions(group, topic), more...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- consumer.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Errorf("Run = %v; want it stopped", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop, consumer
}
