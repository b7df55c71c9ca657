package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/natsbroker"
	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

// broker is the relay's broker, whichever it is: what migrate provisions,
// what run checks and publishes to, and what cleanup must respect.
type broker interface {
	// Provision makes what the relay publishes to (a stream; exchanges and
	// queues) and says what it made.
	Provision(ctx context.Context) (string, error)
	// Check reports whether the broker answers and what the relay
	// publishes to is as configured, changing nothing.
	Check(ctx context.Context) error
	// Publisher is the relays' MessageBroker.
	Publisher() postgres.MessageBroker
	// CheckRetention refuses a -processed-retention shorter than the broker
	// may still deliver a message, where it can tell.
	CheckRetention(ctx context.Context, retention time.Duration) error
	// DuplicateWindow is how long after the broker took a message it drops
	// another with the same key as a copy: 0 for a broker that drops none.
	DuplicateWindow(ctx context.Context) (time.Duration, error)
	// ForgetProcessed forgets the consumers' keys older than retention.
	ForgetProcessed(ctx context.Context, outbox *postgres.Outbox[postgres.SQLTx], retention time.Duration) (int64, error)
	Close()
}

// refusal is the error of a broker that refused the relay's TLS handshake
// or credentials, or of a TLS file that cannot be used: no retry mends it,
// so the relay stops.
type refusal struct{ err error }

func (r refusal) Error() string { return r.err.Error() }
func (r refusal) Unwrap() error { return r.err }

// refused is fmt.Errorf's error, as a refusal.
func refused(format string, args ...any) error { return refusal{fmt.Errorf(format, args...)} }

// isRefused says whether err is, or wraps, a refusal.
func isRefused(err error) bool {
	var r refusal
	return errors.As(err, &r)
}

// dialBroker connects to c's broker once. A refusal (isRefused) is a
// certificate or a credential the server refused; any other error, a
// server that did not answer, worth trying again.
func dialBroker(ctx context.Context, c config) (broker, error) {
	switch c.broker {
	case "rabbitmq":
		return dialRabbit(ctx, c.rabbit, c.cloudEvents)
	case "kafka":
		return dialKafka(ctx, c.kafka, c.cloudEvents)
	}
	return dialNATS(c.nats, c.cloudEvents)
}

// tlsConfig is a client's TLS configuration from PEM files: the CA's
// certificates (the system's if ""), the client's certificate and key (none
// if ""), and the name the server's certificate must carry ("" for the
// URL's host). The flags named in its errors are prefix's.
func tlsConfig(prefix, ca, cert, key, serverName string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName}
	if ca != "" {
		pem, err := os.ReadFile(ca)
		if err != nil {
			return nil, fmt.Errorf("-%s-ca: cannot read the file", prefix)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("-%s-ca: no PEM certificate in the file", prefix)
		}
	}
	if cert != "" {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return nil, fmt.Errorf("-%s-cert, -%s-key: %w", prefix, prefix, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// refusedTLS says whether err is a TLS handshake that failed: a server
// certificate the relay does not trust, or a client certificate the server
// does not.
func refusedTLS(err error) bool {
	var verify *tls.CertificateVerificationError
	var alert tls.AlertError
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	return errors.As(err, &verify) || errors.As(err, &alert) || errors.As(err, &unknown) || errors.As(err, &host) ||
		strings.Contains(err.Error(), "tls: ") || strings.Contains(err.Error(), "tls error")
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

// check is what the flags of RabbitMQ's connection must say together.
func (r rabbitConfig) check() []error {
	var errs []error
	u, err := url.Parse(r.url)
	switch {
	case err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "":
		errs = append(errs, errors.New("-rabbitmq: want amqp://host:port/vhost or amqps://host:port/vhost"))
	default:
		if _, has := u.User.Password(); has {
			errs = append(errs, errors.New("-rabbitmq: the URL holds a password; give it in -rabbitmq-password-file or OUTBOX_RABBITMQ_PASSWORD, which are never printed"))
		}
		if u.Scheme == "amqp" && (r.ca != "" || r.cert != "" || r.serverName != "") {
			errs = append(errs, errors.New("-rabbitmq-ca, -rabbitmq-cert, -rabbitmq-server-name are for amqps://"))
		}
	}
	if (r.cert == "") != (r.key == "") {
		errs = append(errs, errors.New("-rabbitmq-cert and -rabbitmq-key: give both or neither"))
	}
	if r.password != "" && r.user == "" {
		errs = append(errs, errors.New("a RabbitMQ password needs -rabbitmq-user"))
	}
	if r.topology.Exchange == "" || r.topology.Queue == "" {
		errs = append(errs, errors.New("-exchange and -queue must not be empty"))
	}
	return errs
}

// rabbitBroker is RabbitMQ: a connection of its own for migrate's declares
// and run's checks, made again once it closes, and the Publisher's, which
// redials on its own.
type rabbitBroker struct {
	dial      func() (*amqp.Connection, error)
	topology  rabbitbroker.Topology
	publisher *rabbitbroker.Publisher

	mu   sync.Mutex
	conn *amqp.Connection
}

func dialRabbit(ctx context.Context, r rabbitConfig, cloudEvents string) (broker, error) {
	cfg := amqp.Config{Heartbeat: 10 * time.Second, Locale: "en_US", Vhost: r.vhost, Properties: amqp.NewConnectionProperties()}
	cfg.Properties.SetClientConnectionName(r.name)
	if strings.HasPrefix(r.url, "amqps://") {
		tc, err := tlsConfig("rabbitmq", r.ca, r.cert, r.key, r.serverName)
		if err != nil {
			return nil, refusal{err}
		}
		cfg.TLSClientConfig = tc
	}
	if r.user != "" {
		cfg.SASL = []amqp.Authentication{&amqp.PlainAuth{Username: r.user, Password: r.password}}
	}
	cfg.Dial = amqp.DefaultDial(5 * time.Second)
	b := &rabbitBroker{topology: r.topology}
	b.dial = func() (*amqp.Connection, error) { return amqp.DialConfig(r.url, cfg) }
	conn, err := b.dial()
	if err != nil {
		return nil, rabbitError(err)
	}
	b.conn = conn
	b.publisher, err = rabbitbroker.NewPublisher(b.dial, rabbitbroker.PublisherOptions{Exchange: r.topology.Exchange,
		MaxMessageSize: r.maxMessageSize, CloudEventsSource: cloudEvents})
	if err != nil {
		conn.Close()
		return nil, refusal{fmt.Errorf("-cloudevents-source, -rabbitmq-max-message-size: %w", err)}
	}
	return b, nil
}

// rabbitError says what a failed dial means: refused credentials, a
// refused virtual host, a TLS handshake that failed, or a server that did
// not answer.
func rabbitError(err error) error {
	var amqpErr *amqp.Error
	switch {
	case errors.Is(err, amqp.ErrCredentials):
		return refused("RabbitMQ refused -rabbitmq-user and its password: %w", err)
	case errors.Is(err, amqp.ErrVhost) || (errors.As(err, &amqpErr) && (amqpErr.Code == amqp.AccessRefused || amqpErr.Code == amqp.NotAllowed)):
		return refused("RabbitMQ refused the user or the virtual host (-rabbitmq-user, -rabbitmq-vhost): %w", err)
	case refusedTLS(err):
		return refused("RabbitMQ TLS (-rabbitmq-ca, -rabbitmq-cert, -rabbitmq-key, -rabbitmq-server-name): %w", err)
	}
	return fmt.Errorf("-rabbitmq: %w", err)
}

// connection is b's own connection, dialled again if it closed.
func (b *rabbitBroker) connection() (*amqp.Connection, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.conn == nil || b.conn.IsClosed() {
		conn, err := b.dial()
		if err != nil {
			return nil, rabbitError(err)
		}
		b.conn = conn
	}
	return b.conn, nil
}

func (b *rabbitBroker) Provision(context.Context) (string, error) {
	conn, err := b.connection()
	if err != nil {
		return "", err
	}
	ch, err := conn.Channel()
	if err != nil {
		return "", err
	}
	defer ch.Close()
	if err := b.topology.Declare(ch); err != nil {
		return "", err
	}
	return fmt.Sprintf("exchange %s, queue %s", b.topology.Exchange, b.topology.Queue), nil
}

func (b *rabbitBroker) Check(context.Context) error {
	conn, err := b.connection()
	if err != nil {
		return err
	}
	return b.topology.Check(conn)
}

func (b *rabbitBroker) Publisher() postgres.MessageBroker { return b.publisher }

// CheckRetention has nothing to check: a queue keeps a message until it is
// consumed, with no age limit the relay can read, so a retention is the
// operator's word that no copy of a message waits in the queue longer.
func (b *rabbitBroker) CheckRetention(context.Context, time.Duration) error { return nil }

// DuplicateWindow is none: RabbitMQ keeps no record of what it took, and
// its consumers drop copies by key.
func (b *rabbitBroker) DuplicateWindow(context.Context) (time.Duration, error) { return 0, nil }

func (b *rabbitBroker) ForgetProcessed(ctx context.Context, outbox *postgres.Outbox[postgres.SQLTx], retention time.Duration) (int64, error) {
	return outbox.ForgetProcessed(ctx, retention)
}

func (b *rabbitBroker) Close() {
	b.publisher.Close()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.conn != nil {
		b.conn.Close()
	}
}
