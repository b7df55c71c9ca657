package kafkabroker_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// outboxRow is what a row of the outbox says of its fate.
type outboxRow struct {
	sent, parked bool
	rejections   int
	lastError    string
}

func rowOf(t *testing.T, db *sql.DB, aggregate string) outboxRow {
	t.Helper()
	var r outboxRow
	var lastError sql.NullString
	if err := db.QueryRow(`SELECT sent_at IS NOT NULL, parked_at IS NOT NULL, rejections, last_error FROM outbox WHERE aggregate = $1`,
		aggregate).Scan(&r.sent, &r.parked, &r.rejections, &lastError); err != nil {
		t.Fatal(err)
	}
	r.lastError = lastError.String
	return r
}

// passes runs n relay passes, each free to try again what the one before
// refused (retry_at cleared, as its backoff would after a while).
func passes(t *testing.T, db *sql.DB, relay *postgres.OutboxRelay, n int) {
	t.Helper()
	for range n {
		relay.PublishPending(context.Background())
		if _, err := db.Exec(`UPDATE outbox SET retry_at = NULL`); err != nil {
			t.Fatal(err)
		}
	}
}

// writeEvent writes an event of aggregate with note in its payload.
func writeEvent(t *testing.T, db *sql.DB, ob *postgres.Outbox[postgres.SQLTx], aggregate, note string) {
	t.Helper()
	err := postgres.Transaction(context.Background(), db, func(ctx context.Context, tx *sql.Tx) error {
		_, err := ob.Write(ctx, tx, postgres.Event{Type: "ItemAdded", Payload: map[string]string{"note": note}, Aggregate: aggregate, Seq: 1})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Kafka's client batches a partition's records, and the broker refuses
// the whole batch with MESSAGE_TOO_LARGE for one record over the topic's
// limit. B1 (a few bytes) and A1 (8,000 bytes), in that order, share the
// topic's one partition and a pass: only A1 is refused, parked after its
// 3 refusals (ParkAfter); B1 is sent at the first pass, never refused.
// (Caught: B1 refused with A1 at every pass, and parked after three.)
func TestOnlyTheRecordOverTheLimitIsRefused(t *testing.T) {
	c := newCluster(t)
	topic := c.topic(1, map[string]string{"max.message.bytes": "2000"})
	db := newDatabase(t)
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var noise strings.Builder // incompressible: the topic's limit is on the compressed batch
	for noise.Len() < 8000 {
		noise.WriteString(rand.Text())
	}
	writeEvent(t, db, ob, "cart/B", "small")
	writeEvent(t, db, ob, "cart/A", noise.String())
	relay, err := ob.NewRelay(newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic}), postgres.RelayConfig{ParkAfter: 3})
	if err != nil {
		t.Fatal(err)
	}
	passes(t, db, relay, 1)
	if b := rowOf(t, db, "cart/B"); !b.sent || b.rejections != 0 || b.parked {
		t.Errorf("B1 after the first pass: %+v; want it sent, never refused", b)
	}
	passes(t, db, relay, 3)
	a := rowOf(t, db, "cart/A")
	if !a.parked || a.rejections != 3 || !strings.Contains(a.lastError, "sent alone") {
		t.Errorf("A1: %+v; want it parked after 3 refusals, each of it alone", a)
	}
	if got := c.records(topic, 1); len(got) != 1 || string(got[0].Key) != "cart/B" {
		t.Errorf("the topic holds %d records; want B1 alone", len(got))
	}
}

// A topic refuses a record whose time is outside what it takes
// (message.timestamp.before.max.ms: an old row replayed or put back): the
// broker answers INVALID_TIMESTAMP (made here by the Kafka-protocol
// cluster's control of produce requests), which comes again however often
// the row is sent. The Publisher calls it a refusal, so the relay parks it
// after its 3 refusals (ParkAfter), naming its time. (Caught: read as "unavailable",
// tried for ever, never parked.)
func TestARecordWhoseTimeTheTopicRefusesIsParked(t *testing.T) {
	c := newCluster(t)
	topic := c.topic(1, nil)
	fake := c.faults()
	fake.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		req := r.(*kmsg.ProduceRequest)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition, sp.ErrorCode = rp.Partition, kerr.InvalidTimestamp.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	db := newDatabase(t)
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		t.Fatal(err)
	}
	writeEvent(t, db, ob, "cart/A", "old")
	relay, err := ob.NewRelay(newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic}), postgres.RelayConfig{ParkAfter: 3})
	if err != nil {
		t.Fatal(err)
	}
	passes(t, db, relay, 3)
	if a := rowOf(t, db, "cart/A"); !a.parked || a.rejections != 3 || !strings.Contains(a.lastError, "outside what the topic takes") {
		t.Errorf("A1: %+v; want it parked after 3 refusals, naming its time", a)
	}
}

// CheckTopic says whether acks=all means what the Publisher promises:
// Provision's topics pass (two replicas get min.insync.replicas 2, not 1;
// one replica, a single broker's topic, 1); a topic of three replicas
// whose min.insync.replicas is 1 (the leader alone may acknowledge) or 4
// (no write succeeds) is ErrTopicUnsafe, naming the setting; a missing one
// ErrNoTopic. (Caught: Provision gave two replicas a minimum of one, and
// CheckTopic read neither setting.)
func TestCheckTopicSaysWhetherAcksAllKeepsARecord(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	admin := c.client()
	for _, replicas := range []int16{1, 2, 3} {
		name := fmt.Sprintf("%s-%d", c.topic(1, nil), replicas)
		if err := kafkabroker.Provision(ctx, admin, name, 2, replicas); err != nil {
			t.Fatal(err)
		}
		if err := kafkabroker.CheckTopic(ctx, admin, name); err != nil {
			t.Errorf("CheckTopic of a topic Provision made with %d replicas = %v; want nil", replicas, err)
		}
	}
	for _, minISR := range []string{"1", "4"} {
		name := c.topic(1, map[string]string{"min.insync.replicas": minISR})
		err := kafkabroker.CheckTopic(ctx, admin, name)
		if !errors.Is(err, kafkabroker.ErrTopicUnsafe) || !strings.Contains(fmt.Sprint(err), "min.insync.replicas "+minISR) {
			t.Errorf("CheckTopic of three replicas and min.insync.replicas %s = %v; want ErrTopicUnsafe naming it", minISR, err)
		}
	}
	if err := kafkabroker.CheckTopic(ctx, admin, "never-made"); !errors.Is(err, kafkabroker.ErrNoTopic) {
		t.Errorf("CheckTopic of a missing topic = %v; want ErrNoTopic", err)
	}
}
