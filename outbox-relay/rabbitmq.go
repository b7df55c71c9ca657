package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/rabbitbroker"
)

func init() {
	registerBroker(brokerKind{name: "rabbitmq", rank: 2, module: "rabbitbroker", version: rabbitbroker.Version, flags: rabbitFlags})
}

// rabbitConfig is how the relay connects to RabbitMQ, in the shape of
// amqp091-go's Config.
type rabbitConfig struct {
	url, user, password, vhost, name string
	ca, cert, key, serverName        string
	topology                         rabbitbroker.Topology
	maxMessageSize                   int
}

// rabbitFlags registers the flags of rabbitConfig.
func rabbitFlags(s *settings) brokerFlags {
	b := &rabbitConfig{}
	s.str(&b.url, "rabbitmq", "OUTBOX_RABBITMQ_URL", "amqp://127.0.0.1:5672/", "the RabbitMQ server, amqp:// or amqps://, with no password in it")
	s.str(&b.user, "rabbitmq-user", "OUTBOX_RABBITMQ_USER", "", "the user; empty for the URL's (guest if none)")
	s.secret(&b.password, "rabbitmq-password-file", "OUTBOX_RABBITMQ_PASSWORD_FILE", "OUTBOX_RABBITMQ_PASSWORD", "a file holding the user's password")
	s.str(&b.vhost, "rabbitmq-vhost", "OUTBOX_RABBITMQ_VHOST", "", "the virtual host; empty for the URL's")
	s.str(&b.name, "rabbitmq-name", "OUTBOX_RABBITMQ_NAME", "outbox-relay", "the connection's name, as the server shows it")
	s.add("rabbitmq-ca", "OUTBOX_RABBITMQ_CA", "", "amqps: the CA certificates (PEM) the server's certificate must chain to", readable(&b.ca))
	s.add("rabbitmq-cert", "OUTBOX_RABBITMQ_CERT", "", "amqps: the client's certificate (PEM), with -rabbitmq-key", readable(&b.cert))
	s.add("rabbitmq-key", "OUTBOX_RABBITMQ_KEY", "", "amqps: the client certificate's key (PEM)", readable(&b.key))
	s.str(&b.serverName, "rabbitmq-server-name", "OUTBOX_RABBITMQ_SERVER_NAME", "", "amqps: the name the server's certificate must carry; empty for the URL's host")
	b.topology = rabbitbroker.DefaultTopology
	s.str(&b.topology.Exchange, "exchange", "OUTBOX_EXCHANGE", b.topology.Exchange, "the topic exchange the relay publishes to")
	s.str(&b.topology.Queue, "queue", "OUTBOX_QUEUE", b.topology.Queue, "the queue migrate binds to the exchange, and run checks")
	s.integer(&b.topology.DeliveryLimit, "delivery-limit", "OUTBOX_DELIVERY_LIMIT", b.topology.DeliveryLimit, 1, 1_000_000, "the queue's deliveries of a message before it is dead-lettered")
	s.integer(&b.maxMessageSize, "rabbitmq-max-message-size", "OUTBOX_RABBITMQ_MAX_MESSAGE_SIZE", 0, 0, 512<<20, "the server's max_message_size in bytes; 0 for its default")
	return b
}

func (r *rabbitConfig) dial(ctx context.Context, cloudEvents string) (broker, error) {
	return dialRabbit(ctx, *r, cloudEvents)
}

// check is what the flags of RabbitMQ's connection must say together.
func (r *rabbitConfig) check() []error {
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
