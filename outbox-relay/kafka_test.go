package main

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"example.com/patterns/enterprise/outbox/kafkabroker"
)

// The relay process to a Kafka cluster (franz-go's kfake, three brokers)
// that takes only TLS with a client certificate and SASL: with
// SCRAM-SHA-256 and the password from a file, migrate makes the topic and
// run relays every row to it, each record carrying its row's key; a wrong
// password, or a certificate of another CA, is refused naming the flags,
// exit 1, the password in no output and nothing more published; PLAIN
// passes check. (Caught: a relay process for JetStream and RabbitMQ only.)
func TestRelayProcessToKafkaOverTLSWithSASL(t *testing.T) {
	e := newEnv(t)
	authority := newCA(t, "kafka")
	const password = "pw-kafka-3Rt-never-printed"
	fake, err := kfake.NewCluster(kfake.NumBrokers(3), kfake.TLS(authority.serverTLS()), kfake.EnableSASL(),
		kfake.Superuser("SCRAM-SHA-256", "admin", "admin-pw"), kfake.User("SCRAM-SHA-256", "relay", password),
		kfake.User("PLAIN", "plain", password))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fake.Close)
	cert, key := authority.issue("relay", false)
	tlsArgs := []string{"-broker", "kafka", "-kafka", strings.Join(fake.ListenAddrs(), ","), "-kafka-tls",
		"-kafka-ca", authority.File, "-kafka-cert", cert, "-kafka-key", key}
	scramArgs := append(append([]string(nil), tlsArgs...), "-kafka-sasl", "scram-sha-256", "-kafka-user", "relay",
		"-kafka-password-file", secretFile(t, password))
	e.args = scramArgs
	if code, out := e.runOnce("migrate"); code != 0 || !strings.Contains(out, "kafka: topic outbox") {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	e.writeOrders(5)
	addr := freeAddr(t)
	p := e.start("run", "-http", addr)
	waitFor(t, "/readyz 200", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })
	waitFor(t, "the five rows sent", func() bool { return e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`) == 5 })

	admin, err := kgo.NewClient(kgo.SeedBrokers(fake.ListenAddrs()...), kgo.DialTLSConfig(authority.clientTLS()),
		kgo.SASL(scram.Auth{User: "admin", Pass: "admin-pw"}.AsSha256Mechanism()),
		kgo.ConsumeTopics(kafkabroker.Topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	keys := map[string]bool{}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for len(keys) < 5 && ctx.Err() == nil {
		for _, r := range admin.PollFetches(ctx).Records() {
			for _, h := range r.Headers {
				if h.Key == kafkabroker.HeaderKey {
					keys[string(h.Value)] = true
				}
			}
		}
	}
	var inTopic int
	for k := range keys {
		if e.count(`SELECT count(*) FROM outbox WHERE message_key::text = '`+k+`'`) == 1 {
			inTopic++
		}
	}
	if inTopic != 5 {
		t.Errorf("%d of the 5 rows' keys in the topic", inTopic)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t); code != 0 {
		t.Errorf("run exited %d after SIGTERM:\n%s", code, p.stderr)
	}

	stranger := newCA(t, "stranger")
	strangerCert, strangerKey := stranger.issue("relay", false)
	e.writeOrders(1)
	for _, bad := range []struct {
		what string
		args []string
		want string
	}{
		{"a wrong password", append(append([]string(nil), tlsArgs...), "-kafka-sasl", "scram-sha-256", "-kafka-user", "relay",
			"-kafka-password-file", secretFile(t, "not-the-password")), "Kafka refused -kafka-sasl scram-sha-256, -kafka-user and its password"},
		{"a certificate of another CA", []string{"-broker", "kafka", "-kafka", strings.Join(fake.ListenAddrs(), ","), "-kafka-tls",
			"-kafka-ca", authority.File, "-kafka-cert", strangerCert, "-kafka-key", strangerKey, "-kafka-sasl", "scram-sha-256",
			"-kafka-user", "relay", "-kafka-password-file", secretFile(t, password)}, "Kafka TLS (-kafka-ca, -kafka-cert"},
	} {
		e.args = bad.args
		code, out := e.runOnce("run")
		if code != 1 || !strings.Contains(out, bad.want) || strings.Contains(out, password) {
			t.Errorf("run with %s exited %d; want 1, saying %q, and no password:\n%s", bad.what, code, bad.want, out)
		}
	}
	if n := e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`); n != 1 {
		t.Errorf("%d rows unsent after the refused runs; want the one written after the first run", n)
	}
	e.args = append(append([]string(nil), tlsArgs...), "-kafka-sasl", "plain", "-kafka-user", "plain")
	e.environ = append(e.environ, "OUTBOX_KAFKA_PASSWORD="+password)
	if code, out := e.runOnce("check"); code != 0 || !strings.Contains(out, "ok    broker: kafka") {
		t.Errorf("check with SASL PLAIN exited %d:\n%s", code, out)
	}
}

// Kafka's settings are refused with the flag's name and why.
func TestKafkaSettingsAreCheckedBeforeAnythingConnects(t *testing.T) {
	refusesEach(t, []refusedSetting{
		{[]string{"-broker", "kafka", "-kafka-sasl", "plain"}, "", "-kafka-sasl needs -kafka-user and a password"},
		{[]string{"-broker", "kafka", "-kafka-topic", "no spaces"}, "", "-kafka-topic"},
		{[]string{"-broker", "kafka", "-kafka-sasl", "gssapi"}, "", "-kafka-sasl \"gssapi\""},
		{[]string{"-broker", "kafka", "-kafka-ca", "x"}, "", "-kafka-ca"},
	})
}
