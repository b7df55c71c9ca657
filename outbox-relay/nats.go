package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

func init() {
	registerBroker(brokerKind{name: "nats", rank: 1, module: "natsbroker", version: natsbroker.Version, flags: natsFlags})
}

// natsConfig is how the relay connects to NATS, in the shape of nats.go's
// options and the nats CLI's flags.
type natsConfig struct {
	urls, name                string
	ca, cert, key, serverName string // TLS: the CA's certificates, the client's certificate and key
	creds, nkey, user         string // a credentials file, an NKEY seed file, a user
	password, token           string // read from a file or the environment, never a flag's value
	stream, prefix            string
	replicas                  int
}

// natsFlags registers the flags of natsConfig.
func natsFlags(s *settings) brokerFlags {
	n := &natsConfig{}
	s.str(&n.urls, "nats", "OUTBOX_NATS_URL", "nats://127.0.0.1:4222", "the NATS servers, comma-separated")
	s.str(&n.name, "nats-name", "OUTBOX_NATS_NAME", "outbox-relay", "the connection's name, as the server shows it")
	s.add("nats-ca", "OUTBOX_NATS_CA", "", "TLS: the CA certificates (PEM) the server's certificate must chain to", readable(&n.ca))
	s.add("nats-cert", "OUTBOX_NATS_CERT", "", "TLS: the client's certificate (PEM), with -nats-key", readable(&n.cert))
	s.add("nats-key", "OUTBOX_NATS_KEY", "", "TLS: the client certificate's key (PEM)", readable(&n.key))
	s.str(&n.serverName, "nats-server-name", "OUTBOX_NATS_SERVER_NAME", "", "TLS: the name the server's certificate must carry; empty for the URL's host")
	s.add("nats-creds", "OUTBOX_NATS_CREDS", "", "a credentials file (a user JWT and its NKEY seed)", readable(&n.creds))
	s.add("nats-nkey", "OUTBOX_NATS_NKEY", "", "an NKEY seed file", readable(&n.nkey))
	s.str(&n.user, "nats-user", "OUTBOX_NATS_USER", "", "the user, with a password")
	s.secret(&n.password, "nats-password-file", "OUTBOX_NATS_PASSWORD_FILE", "OUTBOX_NATS_PASSWORD", "a file holding the user's password")
	s.secret(&n.token, "nats-token-file", "OUTBOX_NATS_TOKEN_FILE", "OUTBOX_NATS_TOKEN", "a file holding the token")
	s.str(&n.stream, "stream", "OUTBOX_STREAM", natsbroker.Stream, "the stream")
	s.str(&n.prefix, "subject-prefix", "OUTBOX_SUBJECT_PREFIX", natsbroker.SubjectPrefix, "the subjects' prefix")
	s.integer(&n.replicas, "replicas", "OUTBOX_REPLICAS", 1, 1, 5, "the stream's replicas (3 on a cluster of three)")
	return n
}

// check is what the flags of NATS's connection must say together.
func (n *natsConfig) check() []error {
	var errs []error
	if (n.cert == "") != (n.key == "") {
		errs = append(errs, errors.New("-nats-cert and -nats-key: give both or neither"))
	}
	ways := 0
	for _, given := range []bool{n.creds != "", n.nkey != "", n.user != "" || n.password != "", n.token != ""} {
		if given {
			ways++
		}
	}
	if ways > 1 {
		errs = append(errs, errors.New("NATS: give one of -nats-creds, -nats-nkey, -nats-user with a password, or a token"))
	}
	if (n.user == "") != (n.password == "") {
		errs = append(errs, errors.New("-nats-user needs a password (-nats-password-file or OUTBOX_NATS_PASSWORD), and a password a user"))
	}
	if _, err := natsbroker.NewNames(n.stream, n.prefix); err != nil {
		errs = append(errs, fmt.Errorf("-stream, -subject-prefix: %w", err))
	}
	return errs
}

func (n *natsConfig) dial(_ context.Context, cloudEvents string) (broker, error) {
	return dialNATS(*n, cloudEvents)
}

// natsBroker is JetStream, over a connection that reconnects for ever once
// made.
type natsBroker struct {
	nc        *nats.Conn
	js        jetstream.JetStream
	names     natsbroker.Names
	stream    jetstream.StreamConfig
	publisher *natsbroker.Publisher
}

func dialNATS(n natsConfig, cloudEvents string) (broker, error) {
	names, err := natsbroker.NewNames(n.stream, n.prefix)
	if err != nil {
		return nil, err
	}
	publisherOptions := natsbroker.PublisherOptions{CloudEventsSource: cloudEvents}
	if err := publisherOptions.Check(); err != nil {
		return nil, refusal{fmt.Errorf("-cloudevents-source: %w", err)}
	}
	opts := []nats.Option{nats.Name(n.name), nats.MaxReconnects(-1), nats.Timeout(5 * time.Second)}
	secured := n.ca != "" || n.cert != "" || n.serverName != "" || strings.Contains(n.urls, "tls://")
	if secured {
		cfg, err := tlsConfig("nats", n.ca, n.cert, n.key, n.serverName)
		if err != nil {
			return nil, refusal{err}
		}
		opts = append(opts, nats.Secure(cfg))
	}
	auth := "no credentials"
	switch {
	case n.creds != "":
		opts, auth = append(opts, nats.UserCredentials(n.creds)), "-nats-creds"
	case n.nkey != "":
		opt, err := nats.NkeyOptionFromSeed(n.nkey)
		if err != nil {
			return nil, refused("-nats-nkey: not an NKEY seed file")
		}
		opts, auth = append(opts, opt), "-nats-nkey"
	case n.user != "":
		opts, auth = append(opts, nats.UserInfo(n.user, n.password)), "-nats-user and its password"
	case n.token != "":
		opts, auth = append(opts, nats.Token(n.token)), "the token"
	}
	nc, err := nats.Connect(n.urls, opts...)
	switch {
	case err != nil && (errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || strings.Contains(strings.ToLower(err.Error()), "authorization")):
		return nil, refused("NATS refused %s: %w", auth, err)
	case err != nil && refusedTLS(err):
		return nil, refused("NATS TLS (-nats-ca, -nats-cert, -nats-key, -nats-server-name): %w", err)
	case err != nil:
		return nil, fmt.Errorf("-nats: %w", err)
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(time.Minute))
	if err != nil {
		nc.Close()
		return nil, err
	}
	publisher, err := names.NewPublisher(js, publisherOptions)
	if err != nil {
		nc.Close()
		return nil, err
	}
	stream := names.StreamConfig(0)
	stream.Replicas = n.replicas
	return &natsBroker{nc: nc, js: js, names: names, stream: stream, publisher: publisher}, nil
}

func (b *natsBroker) Provision(ctx context.Context) (string, error) {
	if _, err := b.js.CreateOrUpdateStream(ctx, b.stream); err != nil {
		return "", fmt.Errorf("provision stream %s: %w", b.stream.Name, err)
	}
	return "stream " + b.stream.Name, nil
}

func (b *natsBroker) Check(ctx context.Context) error {
	if !b.nc.IsConnected() {
		return fmt.Errorf("NATS: not connected (%s)", b.nc.Status())
	}
	if err := natsbroker.CheckStream(ctx, b.js, b.stream); err != nil {
		return err
	}
	// A publish allowed and taken by the stream, storing nothing; a user
	// the server does not allow gets no answer, so a bound of its own.
	probe, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return natsbroker.CheckPublish(probe, b.js, b.names.SubjectPrefix()+"OutboxRelayCheck")
}

func (b *natsBroker) Publisher() postgres.MessageBroker { return b.publisher }

func (b *natsBroker) CheckRetention(ctx context.Context, retention time.Duration) error {
	if retention == 0 {
		return nil
	}
	s, err := b.js.Stream(ctx, b.stream.Name)
	if err != nil {
		return err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return err
	}
	if age := info.Config.MaxAge; age == 0 || retention < age {
		return fmt.Errorf("-processed-retention %v: shorter than stream %s keeps its messages (%v; 0 is for ever), so a replay would apply them again: %w",
			retention, b.stream.Name, age, natsbroker.ErrRetentionTooShort)
	}
	return nil
}

// DuplicateWindow is the stream's own, as the server reports it.
func (b *natsBroker) DuplicateWindow(ctx context.Context) (time.Duration, error) {
	s, err := b.js.Stream(ctx, b.stream.Name)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", b.stream.Name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", b.stream.Name, err)
	}
	return info.Config.Duplicates, nil
}

func (b *natsBroker) ForgetProcessed(ctx context.Context, outbox *postgres.Outbox[postgres.SQLTx], retention time.Duration) (int64, error) {
	return natsbroker.ForgetProcessed(ctx, b.js, b.stream.Name, outbox, retention)
}

func (b *natsBroker) Close() { b.nc.Close() }
