package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

func init() {
	registerBroker(brokerKind{name: "kafka", rank: 3, module: "kafkabroker", version: kafkabroker.Version, flags: kafkaFlags})
}

// kafkaConfig is how the relay connects to Kafka, in the shape of kgo's
// options.
type kafkaConfig struct {
	brokers, topic            string
	ca, cert, key, serverName string // TLS
	mechanism, user           string // SASL: plain, scram-sha-256 or scram-sha-512, and its user
	password                  string // read from a file or the environment, never a flag's value
	tls                       bool
	partitions, replicas      int
}

// kafkaFlags registers the flags of kafkaConfig.
func kafkaFlags(s *settings) brokerFlags {
	k := &kafkaConfig{}
	s.str(&k.brokers, "kafka", "OUTBOX_KAFKA_BROKERS", "127.0.0.1:9092", "the Kafka seed brokers, host:port, comma-separated")
	s.str(&k.topic, "kafka-topic", "OUTBOX_KAFKA_TOPIC", kafkabroker.Topic, "the topic the relay publishes to")
	s.integer(&k.partitions, "kafka-partitions", "OUTBOX_KAFKA_PARTITIONS", 6, 1, 10_000, "provision: the topic's partitions")
	s.integer(&k.replicas, "kafka-replicas", "OUTBOX_KAFKA_REPLICAS", 3, 1, 16, "provision: the topic's replicas (min.insync.replicas one below, at least 2)")
	s.boolean(&k.tls, "kafka-tls", "OUTBOX_KAFKA_TLS", false, "connect to Kafka over TLS")
	s.add("kafka-ca", "OUTBOX_KAFKA_CA", "", "TLS: the CA certificates (PEM) the brokers' certificates must chain to", readable(&k.ca))
	s.add("kafka-cert", "OUTBOX_KAFKA_CERT", "", "TLS: the client's certificate (PEM), with -kafka-key", readable(&k.cert))
	s.add("kafka-key", "OUTBOX_KAFKA_KEY", "", "TLS: the client certificate's key (PEM)", readable(&k.key))
	s.str(&k.serverName, "kafka-server-name", "OUTBOX_KAFKA_SERVER_NAME", "", "TLS: the name the brokers' certificates must carry; empty for each broker's host")
	s.str(&k.mechanism, "kafka-sasl", "OUTBOX_KAFKA_SASL", "", "SASL: plain, scram-sha-256 or scram-sha-512; none if empty")
	s.str(&k.user, "kafka-user", "OUTBOX_KAFKA_USER", "", "SASL: the user")
	s.secret(&k.password, "kafka-password-file", "OUTBOX_KAFKA_PASSWORD_FILE", "OUTBOX_KAFKA_PASSWORD", "SASL: a file holding the user's password")
	return k
}

func (k *kafkaConfig) dial(ctx context.Context, cloudEvents string) (broker, error) {
	return dialKafka(ctx, *k, cloudEvents)
}

// check is what the flags of Kafka's connection must say together.
func (k *kafkaConfig) check() []error {
	var errs []error
	if strings.TrimSpace(k.brokers) == "" {
		errs = append(errs, errors.New("-kafka: want the seed brokers, host:port, comma-separated"))
	}
	if err := (kafkabroker.PublisherOptions{Topic: k.topic}).Check(); err != nil {
		errs = append(errs, fmt.Errorf("-kafka-topic: %w", err))
	}
	if (k.cert == "") != (k.key == "") {
		errs = append(errs, errors.New("-kafka-cert and -kafka-key: give both or neither"))
	}
	if !k.tls && (k.ca != "" || k.cert != "" || k.serverName != "") {
		errs = append(errs, errors.New("-kafka-ca, -kafka-cert, -kafka-server-name are for -kafka-tls"))
	}
	switch k.mechanism {
	case "":
		if k.user != "" || k.password != "" {
			errs = append(errs, errors.New("-kafka-user and its password need -kafka-sasl (plain, scram-sha-256 or scram-sha-512)"))
		}
	case "plain", "scram-sha-256", "scram-sha-512":
		if k.user == "" || k.password == "" {
			errs = append(errs, errors.New("-kafka-sasl needs -kafka-user and a password (-kafka-password-file or OUTBOX_KAFKA_PASSWORD)"))
		}
	default:
		errs = append(errs, fmt.Errorf("-kafka-sasl %q: want plain, scram-sha-256 or scram-sha-512", k.mechanism))
	}
	return errs
}

// kafkaBroker is a Kafka cluster, over a client that reconnects by itself.
type kafkaBroker struct {
	cl        *kgo.Client
	k         kafkaConfig
	publisher *kafkabroker.Publisher
}

// dialKafka makes the client and asks the cluster for its metadata once,
// so that a certificate or a credential it refuses ends the command at
// once.
func dialKafka(ctx context.Context, k kafkaConfig, cloudEvents string) (broker, error) {
	opts := []kgo.Opt{kgo.SeedBrokers(strings.Split(k.brokers, ",")...), kgo.ClientID("outbox-relay"),
		kgo.ProducerLinger(0)} // a pass's batch goes at once; a linger only delays it (kafkabroker's figures)
	if k.tls {
		cfg, err := tlsConfig("kafka", k.ca, k.cert, k.key, k.serverName)
		if err != nil {
			return nil, refusal{err}
		}
		opts = append(opts, kgo.DialTLSConfig(cfg))
	}
	var mech sasl.Mechanism
	switch k.mechanism {
	case "plain":
		mech = plain.Auth{User: k.user, Pass: k.password}.AsMechanism()
	case "scram-sha-256":
		mech = scram.Auth{User: k.user, Pass: k.password}.AsSha256Mechanism()
	case "scram-sha-512":
		mech = scram.Auth{User: k.user, Pass: k.password}.AsSha512Mechanism()
	}
	if mech != nil {
		opts = append(opts, kgo.SASL(mech))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, refusal{fmt.Errorf("-kafka: %w", err)}
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := cl.Ping(pctx); err != nil {
		cl.Close()
		switch {
		case errors.Is(err, kerr.SaslAuthenticationFailed), errors.Is(err, kerr.IllegalSaslState), errors.Is(err, kerr.UnsupportedSaslMechanism),
			mech != nil && closedOnUs(err) && answers(k.brokers):
			// A broker that answers and closes the connection during SASL has
			// refused the credentials (some say so first, some only close).
			return nil, refused("Kafka refused -kafka-sasl %s, -kafka-user and its password: %w", k.mechanism, err)
		case refusedTLS(err):
			return nil, refused("Kafka TLS (-kafka-ca, -kafka-cert, -kafka-key, -kafka-server-name): %w", err)
		}
		return nil, fmt.Errorf("-kafka: %w", err)
	}
	publisher, err := kafkabroker.NewPublisher(cl, kafkabroker.PublisherOptions{Topic: k.topic, CloudEventsSource: cloudEvents})
	if err != nil {
		cl.Close()
		return nil, err
	}
	return &kafkaBroker{cl: cl, k: k, publisher: publisher}, nil
}

// closedOnUs says whether err is a connection the other end closed.
func closedOnUs(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

// answers says whether the first seed broker takes a TCP connection.
func answers(brokers string) bool {
	seed, _, _ := strings.Cut(brokers, ",")
	conn, err := net.DialTimeout("tcp", strings.TrimSpace(seed), 2*time.Second)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

func (b *kafkaBroker) Provision(ctx context.Context) (string, error) {
	if err := kafkabroker.Provision(ctx, b.cl, b.k.topic, int32(b.k.partitions), int16(b.k.replicas)); err != nil {
		return "", err
	}
	return "topic " + b.k.topic, nil
}

// Check asks the cluster for the topic's metadata: it must exist, every
// partition with a leader.
func (b *kafkaBroker) Check(ctx context.Context) error {
	if err := kafkabroker.CheckTopic(ctx, b.cl, b.k.topic); err != nil {
		return fmt.Errorf("kafka: %w", err)
	}
	return nil
}

func (b *kafkaBroker) Publisher() postgres.MessageBroker { return b.publisher }

// CheckRetention has nothing to check: the topic's retention is the
// cluster's to say, and consumers drop what comes again by key.
func (b *kafkaBroker) CheckRetention(context.Context, time.Duration) error { return nil }

// DuplicateWindow is none: Kafka drops no copy a relay sends again.
func (b *kafkaBroker) DuplicateWindow(context.Context) (time.Duration, error) { return 0, nil }

func (b *kafkaBroker) ForgetProcessed(ctx context.Context, outbox *postgres.Outbox[postgres.SQLTx], retention time.Duration) (int64, error) {
	return outbox.ForgetProcessed(ctx, retention)
}

func (b *kafkaBroker) Close() { b.cl.Close() }
