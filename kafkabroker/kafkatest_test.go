package kafkabroker_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/kafkabroker/kafkatest"
	"example.com/patterns/enterprise/outbox/postgres"
)

// kafkatest starts, when asked, a cluster that takes TLS only, with a
// certificate of a CA it makes, and authenticated users only, as a
// production cluster would: an admin provisions the topic, the relay's
// user publishes over TLS with SCRAM-SHA-512, and the record is read back;
// a client without TLS, and one with a wrong password, get nothing in.
// (Caught: a team that wrote its own cluster program, from the relay's
// tests, to test its TLS and SASL settings.)
func TestKafkatestStartsAClusterWithTLSAndSASLWhenAsked(t *testing.T) {
	if os.Getenv(EnvBrokers) != "" {
		t.Skipf("%s names a real cluster; this test starts kafkatest's", EnvBrokers)
	}
	binary := filepath.Join(t.TempDir(), "kcluster")
	if out, err := exec.Command("go", "build", "-o", binary, "./testdata/kcluster").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	proc, err := kafkatest.Start(kafkatest.Options{Command: []string{binary}, Dir: filepath.Join(t.TempDir(), "data"), Stderr: os.Stderr,
		TLS: true, Users: []kafkatest.User{
			{Mechanism: "SCRAM-SHA-256", Name: "admin", Password: "admin-pw", Superuser: true},
			{Mechanism: "SCRAM-SHA-512", Name: "relay", Password: "relay-pw"},
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proc.Stop)
	if proc.CA() == "" || proc.ClientTLS() == nil {
		t.Fatalf("a cluster with TLS names no CA (%q)", proc.CA())
	}
	client := func(opts ...kgo.Opt) *kgo.Client {
		t.Helper()
		cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(proc.Seeds()...), kgo.RequestRetries(2)}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		return cl
	}
	ctx := context.Background()
	admin := client(kgo.DialTLSConfig(proc.ClientTLS()),
		kgo.SASL(scram.Auth{User: "admin", Pass: "admin-pw"}.AsSha256Mechanism()))
	if err := kafkabroker.Provision(ctx, admin, "orders", 1, 3); err != nil {
		t.Fatalf("Provision as the admin, over TLS with SCRAM-SHA-256: %v", err)
	}
	relay := client(kgo.DialTLSConfig(proc.ClientTLS()),
		kgo.SASL(scram.Auth{User: "relay", Pass: "relay-pw"}.AsSha512Mechanism()))
	publisher, err := kafkabroker.NewPublisher(relay, kafkabroker.PublisherOptions{Topic: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	msg := postgres.Message{ID: 1, Key: "7c0b8d54-0000-4000-8000-000000000001", Type: "OrderPlaced", Payload: `{"orderId":1}`}
	if err := publisher.Publish(ctx, msg); err != nil {
		t.Fatalf("Publish as the relay's user, over TLS with SCRAM-SHA-512: %v", err)
	}
	reader := client(kgo.DialTLSConfig(proc.ClientTLS()), kgo.SASL(scram.Auth{User: "admin", Pass: "admin-pw"}.AsSha256Mechanism()),
		kgo.ConsumeTopics("orders"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if rs := reader.PollFetches(rctx).Records(); len(rs) != 1 || header(rs[0], kafkabroker.HeaderKey) != msg.Key {
		t.Fatalf("read back %d records; want the one published", len(rs))
	}
	for name, cl := range map[string]*kgo.Client{
		"without TLS": client(kgo.SASL(scram.Auth{User: "relay", Pass: "relay-pw"}.AsSha512Mechanism())),
		"with a wrong password": client(kgo.DialTLSConfig(proc.ClientTLS()),
			kgo.SASL(scram.Auth{User: "relay", Pass: "not-the-pw"}.AsSha512Mechanism())),
	} {
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := cl.Ping(pctx)
		cancel()
		if err == nil {
			t.Errorf("a client %s got in", name)
		} else {
			t.Logf("a client %s: %v", name, err)
		}
	}
}
