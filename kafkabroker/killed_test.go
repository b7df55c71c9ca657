package kafkabroker_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/kafkabroker/kafkatest"
	"example.com/patterns/enterprise/outbox/postgres"
)

// The cluster's process killed with SIGKILL in the middle of the
// publishes, and started again on its data: every record it acknowledged
// is there, so every row a relay marked sent is in the topic. (Each
// produce is synced before it is acknowledged: kfake's SyncWrites, as a
// Kafka with log.flush.interval.messages=1 would.)
func TestTheClustersProcessKilledLosesNothingItAcknowledged(t *testing.T) {
	if os.Getenv(EnvBrokers) != "" {
		t.Skipf("%s names a real cluster, whose process this test cannot kill", EnvBrokers)
	}
	binary := filepath.Join(t.TempDir(), "kcluster")
	if out, err := exec.Command("go", "build", "-o", binary, "./testdata/kcluster").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	proc, err := kafkatest.Start(kafkatest.Options{Command: []string{binary}, Dir: t.TempDir(), Stderr: os.Stderr})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proc.Stop)
	cl, err := kgo.NewClient(kgo.SeedBrokers(proc.Seeds()...), kgo.RequestRetries(1000))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := kafkabroker.Provision(context.Background(), cl, "orders", 3, 3); err != nil {
		t.Fatal(err)
	}
	publisher, err := kafkabroker.NewPublisher(cl, kafkabroker.PublisherOptions{Topic: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	acked := map[string]bool{}
	for i := 1; i <= 130; i++ { // ten after the kill, which go unacknowledged
		if i == 120 {
			proc.Kill()
		}
		msg := postgres.Message{ID: int64(i), Key: fmt.Sprintf("7c0b8d54-0000-4000-8000-%012d", i), Type: "OrderPlaced",
			Payload: fmt.Sprintf(`{"orderId":%d}`, i), Aggregate: fmt.Sprintf("order/%d", i), Seq: 1}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		if err := publisher.Publish(ctx, msg); err == nil {
			acked[msg.Key] = true
		}
		cancel()
	}
	if len(acked) < 100 {
		t.Fatalf("%d publishes acknowledged before the kill; want the first 119", len(acked))
	}
	if err := proc.Up(); err != nil { // on the same ports and data
		t.Fatal(err)
	}
	reader, err := kgo.NewClient(kgo.SeedBrokers(proc.Seeds()...), kgo.ConsumeTopics("orders"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	found := map[string]bool{}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for missing := len(acked); missing > 0 && ctx.Err() == nil; {
		f := reader.PollFetches(ctx)
		for _, r := range f.Records() {
			k := header(r, kafkabroker.HeaderKey)
			if acked[k] && !found[k] {
				found[k] = true
				missing--
			}
		}
	}
	if len(found) != len(acked) {
		t.Errorf("after the kill and the start: %d of the %d acknowledged records in the topic", len(found), len(acked))
	}
	t.Logf("%d of 130 publishes acknowledged, the process killed at the 120th; all %d in the topic after it started again", len(acked), len(found))
}
