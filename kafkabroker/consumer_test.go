package kafkabroker_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// orderedHandler records what it is handed, failing the first handlings
// of some keys with an error that may pass, and others for good.
type orderedHandler struct {
	mu       sync.Mutex
	handled  []string
	failures map[string]int // key: failures that may pass still to come
	never    map[string]bool
}

func (h *orderedHandler) Handle(_ context.Context, m postgres.Message) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.never[m.Key] {
		return false, fmt.Errorf("message %s: %w", m.Key, postgres.ErrPermanent)
	}
	if h.failures[m.Key] > 0 {
		h.failures[m.Key]--
		return false, errors.New("the database is down")
	}
	h.handled = append(h.handled, m.Key)
	return true, nil
}

func (h *orderedHandler) done() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.handled...)
}

// The consumer's policy, on one partition: a record that is no outbox
// message and one the handler says can never apply are set aside, logged
// at Error with their offsets, and the partition goes on; one that fails
// for a reason that may pass is handled again in place, twice, so the
// records after it wait and the order holds; the group's committed offset
// ends past everything, so a member that starts after reads nothing again.
func TestTheConsumerSetsAsideWhatCanNeverApplyAndKeepsOrderThroughFailures(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(1, nil)
	publisher := newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic})
	var msgs []postgres.Message
	for i := 1; i <= 5; i++ {
		msgs = append(msgs, postgres.Message{ID: int64(i), Key: fmt.Sprintf("k%d", i), Type: "ItemAdded", Payload: `{}`, Aggregate: "cart/1", Seq: int64(i)})
	}
	if n, err := publisher.PublishBatch(ctx, msgs[:2]); n != 2 || err != nil {
		t.Fatal(n, err)
	}
	raw := c.client()
	if err := raw.ProduceSync(ctx, &kgo.Record{Topic: topic, Key: []byte("cart/1"), Value: []byte("no headers")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if n, err := publisher.PublishBatch(ctx, msgs[2:]); n != 3 || err != nil {
		t.Fatal(n, err)
	}
	h := &orderedHandler{failures: map[string]int{"k2": 2}, never: map[string]bool{"k4": true}}
	var logs logBuffer
	stop := runConsumer(t, c, "policy", topic, h, slog.New(slog.NewTextHandler(&logs, nil)))
	waitFor(t, "k5 handled", func() bool { d := h.done(); return len(d) > 0 && d[len(d)-1] == "k5" })
	stop()
	if got := strings.Join(h.done(), " "); got != "k1 k2 k3 k5" {
		t.Errorf("handled %s; want k1 k2 k3 k5, in order, k2 after its failures", got)
	}
	out := logs.String()
	if strings.Count(out, "message set aside") != 2 || !strings.Contains(out, "offset=2") || !strings.Contains(out, "key=k4") ||
		strings.Count(out, "message failed; trying it again in place") != 2 {
		t.Errorf("the log does not say two records set aside (offset 2, k4) and k2 handled again twice:\n%s", out)
	}
	after := &orderedHandler{}
	runConsumer(t, c, "policy", topic, after, nil)
	raw.ProduceSync(ctx, &kgo.Record{Topic: topic, Key: []byte("cart/2"), Value: []byte(`{}`), Headers: []kgo.RecordHeader{
		{Key: kafkabroker.HeaderKey, Value: []byte("k6")}, {Key: kafkabroker.HeaderID, Value: []byte("6")}, {Key: kafkabroker.HeaderType, Value: []byte("ItemAdded")}}})
	waitFor(t, "k6 handled by the next member", func() bool { return len(after.done()) > 0 })
	if got := strings.Join(after.done(), " "); got != "k6" {
		t.Errorf("the next member of the group handled %s; want k6 alone: the offset was committed past the rest", got)
	}
}
