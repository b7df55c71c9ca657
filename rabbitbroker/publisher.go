package rabbitbroker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/postgres"
)

// The headers a Publisher puts on each message beside its properties (the
// key is its message_id, the type its routing key and its type property,
// the payload's media type its content_type: application/json unless the
// event said otherwise). The team's own headers (postgres.Event.Headers)
// go beside these, as they were written, and come back in Message.Headers.
const (
	HeaderID        = "outbox-id"        // the row's id
	HeaderAggregate = "outbox-aggregate" // the row's aggregate, if any
	HeaderSeq       = "outbox-seq"       // its seq within the aggregate
)

// Publisher publishes outbox messages to a RabbitMQ exchange, with
// publisher confirms: it is a [postgres.MessageBroker] and a
// [postgres.BatchPublisher] for the relays.
//
// Each message is persistent, published with mandatory to the exchange with
// its type as routing key, its key as message_id, its id, aggregate and seq
// in headers (HeaderID, HeaderAggregate, HeaderSeq), and its trace context
// (traceparent, tracestate) too. Publish and PublishBatch return only once
// RabbitMQ confirmed the messages: for a quorum queue, once a majority of
// its replicas wrote the message to disk.
//
// What the server says comes back as the relay needs it:
//   - a confirm (basic.ack): accepted;
//   - a message over the size the server takes (the Publisher's
//     maxSize, or the server's, which closes the channel): an error
//     wrapping [postgres.ErrRejected], which a relay may park;
//   - everything else may pass, errors wrapping
//     [postgres.ErrBrokerUnavailable]: a message no queue takes (returned,
//     NO_ROUTE: nothing is bound to its type, a topology fault that a
//     re-declare mends, so the row waits rather than being parked), a
//     basic.nack, no confirm before the context ended, a channel or
//     connection closed (a node down, a queue with no quorum), no
//     connection to be had, a server that blocks publishers
//     (connection.blocked: its memory or disk alarm), which fails at once
//     rather than leave a write hanging past the context. After such an
//     error RabbitMQ may hold the message all the same; the relay publishes
//     it again, and RabbitMQ, which keeps no record of what it took, delivers
//     both copies: the consumer drops the second by its key.
//
// A Publisher holds one connection and one channel in confirm mode, dialled
// when first needed and again after either closed; it closes the channel
// itself, and opens another for the next message, after a message on it was
// refused (basic.nack). (With RabbitMQ 3.10, a quorum queue's leader killed
// while a channel had messages in flight to it left that channel refusing
// every later message, for as long as it lived, while a new channel's went
// through to the new leader; messages still in flight on a closed channel
// fail as unknown, and go again.)
//
// Publish and PublishBatch are bounded by their context at every step: a
// channel being opened, the network write and the confirm. The client's
// writes do not heed a context, so each message is handed to the server on
// a goroutine of its own; if the context ends first (a server that stopped
// reading, its TCP window full), the call returns an error wrapping
// [postgres.ErrBrokerUnavailable] that says the outcome is unknown, and the
// Publisher closes that connection at once (a deadline on its socket ends
// the stuck write); the next message dials a new one. A dial is bounded by
// the dial function's own timeout (amqp.Dial's is 30 s); a caller whose
// context ends meanwhile returns all the same.
//
// It is safe for concurrent use by multiple goroutines; Close it when done.
// Create one with [NewPublisher].
type Publisher struct {
	dial     func() (*amqp.Connection, error)
	exchange string
	maxSize  int
	ceSource string // CloudEvents' source, if it publishes CloudEvents

	opening sync.Mutex // held while a connection is dialled or a channel opened

	mu      sync.Mutex // guards conn, blocked and ch; never held across network I/O
	conn    *amqp.Connection
	blocked *atomic.Pointer[string] // conn's, set by watchBlocked
	ch      *confirmChannel         // a channel on conn, or nil
}

var (
	_ postgres.BatchPublisher  = (*Publisher)(nil)
	_ postgres.MessagingSystem = (*Publisher)(nil)
)

// PublisherOptions configures a [Publisher]: [NewPublisher] checks it and
// refuses a bad value with an error wrapping [postgres.ErrInvalidConfig]
// that names it. Zero means the default in every field.
type PublisherOptions struct {
	// Exchange is the topic exchange the Publisher publishes to, as
	// Topology declares it; "" means DefaultTopology's.
	Exchange string

	// MaxMessageSize is the largest body the server takes (its
	// max_message_size); 0 means DefaultMaxMessageSize. A larger message is
	// refused before it is sent, since the server would close the channel
	// on it, and with it every other message in flight.
	MaxMessageSize int

	// CloudEventsSource, if not empty, makes the Publisher publish each
	// message as a CloudEvent too, in the binary content mode of the
	// CloudEvents AMQP protocol binding (spec 1.0), as AMQP 0-9-1 carries
	// it: beside its own headers, a message carries the headers
	// cloudEvents:specversion 1.0, cloudEvents:id its key, cloudEvents:type
	// its type, cloudEvents:source this source, cloudEvents:subject its
	// aggregate (if any) and cloudEvents:time when it was written, and its
	// content_type says its payload's media type, as it always does. It
	// names the producer: a URI-reference such as "/shop" or
	// "https://shop.example.com".
	CloudEventsSource string
}

// Check reports, with an error wrapping [postgres.ErrInvalidConfig] that
// names it, what [NewPublisher] would refuse of o: a negative
// MaxMessageSize, a CloudEventsSource that is not a URI-reference. It
// connects to nothing.
func (o PublisherOptions) Check() error {
	switch source := o.CloudEventsSource; {
	case o.MaxMessageSize < 0:
		return fmt.Errorf("%w: rabbitbroker: PublisherOptions.MaxMessageSize %d: want a size, or 0 for %d",
			postgres.ErrInvalidConfig, o.MaxMessageSize, DefaultMaxMessageSize)
	case source == "":
		return nil
	case func() bool { _, err := url.Parse(source); return err != nil }(),
		strings.ContainsFunc(source, func(r rune) bool { return r <= ' ' || r == 0x7f }):
		return fmt.Errorf("%w: rabbitbroker: PublisherOptions.CloudEventsSource %q: want a URI-reference, such as /shop",
			postgres.ErrInvalidConfig, source)
	}
	return nil
}

// CloudEventsPrefix begins the name of each CloudEvents attribute's header,
// as the AMQP binding names its application properties.
const CloudEventsPrefix = "cloudEvents:"

// DefaultMaxMessageSize is RabbitMQ's own max_message_size, 128 MiB.
const DefaultMaxMessageSize = 128 << 20

// NewPublisher returns a Publisher that publishes over connections dial
// makes, such as func() (*amqp.Connection, error) { return amqp.Dial(url) },
// as opts says. It refuses no dial, and what opts.Check refuses, with an
// error wrapping [postgres.ErrInvalidConfig]. It connects to nothing.
func NewPublisher(dial func() (*amqp.Connection, error), opts PublisherOptions) (*Publisher, error) {
	if dial == nil {
		return nil, fmt.Errorf("%w: rabbitbroker: NewPublisher: no dial", postgres.ErrInvalidConfig)
	}
	if err := opts.Check(); err != nil {
		return nil, err
	}
	return &Publisher{dial: dial, exchange: cmp.Or(opts.Exchange, DefaultTopology.Exchange),
		maxSize: cmp.Or(opts.MaxMessageSize, DefaultMaxMessageSize), ceSource: opts.CloudEventsSource}, nil
}

// MessagingSystem is "rabbitmq", the relay's messaging.system for the spans
// of its sends ([postgres.MessagingSystem]).
func (p *Publisher) MessagingSystem() string { return "rabbitmq" }

// Close closes the Publisher's connection; messages in flight get no
// confirm, and their Publish returns an error wrapping
// postgres.ErrBrokerUnavailable.
// It waits at most CloseTimeout for the server's answer.
func (p *Publisher) Close() error {
	p.mu.Lock()
	conn := p.conn
	p.conn, p.ch = nil, nil
	p.mu.Unlock()
	if conn == nil {
		return nil
	}
	err := conn.CloseDeadline(time.Now().Add(CloseTimeout))
	if errors.Is(err, amqp.ErrClosed) {
		return nil
	}
	return err
}

// CloseTimeout bounds how long Close waits for the server to answer.
const CloseTimeout = 5 * time.Second

// Publish publishes msg and waits for its confirm, or for ctx to end.
func (p *Publisher) Publish(ctx context.Context, msg postgres.Message) error {
	f, err := p.send(ctx, msg)
	if err != nil {
		return err
	}
	return p.wait(ctx, msg, f)
}

// PublishBatch publishes every message of msgs without waiting for the
// confirms in between, then waits for them in order, and returns how many,
// from the first, were confirmed before the first that was not, with that
// one's error. The messages after it were sent too and may be in the
// queue: a relay publishes them again in a later pass, and the consumer
// drops those copies.
func (p *Publisher) PublishBatch(ctx context.Context, msgs []postgres.Message) (int, error) {
	inflight := make([]*inflight, 0, len(msgs))
	var sendErr error
	for _, msg := range msgs {
		f, err := p.send(ctx, msg)
		if err != nil {
			sendErr = err
			break
		}
		inflight = append(inflight, f)
	}
	for i, f := range inflight {
		if err := p.wait(ctx, msgs[i], f); err != nil {
			return i, err
		}
	}
	return len(inflight), sendErr
}

// send hands msg to the channel, in confirm mode, and returns what will
// tell of its confirm.
func (p *Publisher) send(ctx context.Context, msg postgres.Message) (*inflight, error) {
	if len(msg.Payload) > p.maxSize {
		return nil, fmt.Errorf("message %s: %d bytes, over the %d the server takes: %w", msg.Key, len(msg.Payload), p.maxSize, postgres.ErrRejected)
	}
	headers := amqp.Table{HeaderID: strconv.FormatInt(msg.ID, 10)}
	if msg.Aggregate != "" {
		headers[HeaderAggregate] = msg.Aggregate
		headers[HeaderSeq] = strconv.FormatInt(msg.Seq, 10)
	}
	for k, v := range msg.TraceContext { // traceparent, tracestate: W3C's names
		headers[k] = v
	}
	for k, v := range msg.Headers { // the team's own, none of the names above (postgres.ErrInvalidHeader)
		headers[k] = v
	}
	if p.ceSource != "" {
		id := msg.Key
		if id == "" { // a message published without an outbox
			id = strconv.FormatInt(msg.ID, 10)
		}
		headers[CloudEventsPrefix+"specversion"] = "1.0"
		headers[CloudEventsPrefix+"id"] = id
		headers[CloudEventsPrefix+"type"] = msg.Type
		headers[CloudEventsPrefix+"source"] = p.ceSource
		if msg.Aggregate != "" {
			headers[CloudEventsPrefix+"subject"] = msg.Aggregate
		}
		if !msg.Time.IsZero() {
			headers[CloudEventsPrefix+"time"] = msg.Time.UTC().Format(time.RFC3339Nano)
		}
	}
	contentType := msg.ContentType
	if contentType == "" {
		contentType = "application/json"
	}
	pub := amqp.Publishing{
		Headers:      headers,
		ContentType:  contentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    msg.Key,
		Type:         msg.Type,
		Body:         []byte(msg.Payload),
	}
	type handed struct {
		f   *inflight
		err error
	}
	done := make(chan handed, 1)
	var using atomic.Pointer[amqp.Connection] // the connection the goroutine writes to
	go func() {
		f, err := p.hand(ctx, msg, pub, &using)
		done <- handed{f, err}
	}()
	select {
	case h := <-done:
		return h.f, h.err
	case <-ctx.Done():
	}
	select {
	case h := <-done: // handed over as the context ended
		return h.f, h.err
	default:
	}
	if conn := using.Load(); conn != nil {
		// The write, or the channel's opening, is stuck: the server does not
		// read. The next message dials anew, and a deadline on the socket
		// ends the stuck write; nothing else sent on this connection can be
		// trusted to arrive.
		p.mu.Lock()
		if p.conn == conn {
			p.conn, p.ch = nil, nil
		}
		p.mu.Unlock()
		go conn.CloseDeadline(time.Now())
	}
	return nil, fmt.Errorf("message %s: not handed to RabbitMQ before the context ended, so whether it took it is unknown; the connection is closed: %w: %w",
		msg.Key, postgres.ErrBrokerUnavailable, ctx.Err())
}

// hand gets the Publisher's channel and writes msg to it, as pub, telling
// using of the connection before any network I/O on it. It runs on a
// goroutine of its own: the client's writes do not heed ctx.
func (p *Publisher) hand(ctx context.Context, msg postgres.Message, pub amqp.Publishing, using *atomic.Pointer[amqp.Connection]) (*inflight, error) {
	cc, err := p.channel(using)
	if err != nil {
		return nil, fmt.Errorf("message %s: %w: %w", msg.Key, postgres.ErrBrokerUnavailable, err)
	}
	if reason := cc.blocked.Load(); reason != nil {
		return nil, fmt.Errorf("message %s: the server blocks publishers (%s): %w", msg.Key, *reason, postgres.ErrBrokerUnavailable)
	}
	f := &inflight{key: msg.Key, size: len(pub.Body), cc: cc, done: make(chan struct{})}
	// The delivery tag the client gives the message and its write go
	// together, so that tags follow the order of writes on the channel.
	cc.sending.Lock()
	defer cc.sending.Unlock()
	cc.mu.Lock()
	tag := cc.ch.GetNextPublishSeqNo()
	cc.pending[tag] = f
	cc.mu.Unlock()
	if err := cc.ch.PublishWithContext(ctx, p.exchange, msg.Type, true, false, pub); err != nil {
		cc.mu.Lock()
		delete(cc.pending, tag)
		cc.mu.Unlock()
		return nil, p.failed(ctx, msg, err)
	}
	return f, nil
}

// wait waits for f's confirm and says what it means for msg.
func (p *Publisher) wait(ctx context.Context, msg postgres.Message, f *inflight) error {
	select {
	case <-f.done:
	case <-ctx.Done():
		return fmt.Errorf("message %s: no confirm before the context ended, so whether RabbitMQ took it is unknown: %w: %w",
			msg.Key, postgres.ErrBrokerUnavailable, ctx.Err())
	}
	switch {
	case f.returned != nil:
		return fmt.Errorf("message %s: no queue takes routing key %s on exchange %s (%d %s; a binding missing, which a re-declare of the topology mends): %w",
			msg.Key, msg.Type, p.exchange, f.returned.ReplyCode, f.returned.ReplyText, postgres.ErrBrokerUnavailable)
	case f.acked:
		return nil
	case f.closed != nil && f.closed.Code == amqp.PreconditionFailed && f.tooLarge():
		return fmt.Errorf("message %s: %d bytes: %w: %w", msg.Key, f.size, postgres.ErrRejected, f.closed)
	case f.closed != nil:
		return fmt.Errorf("message %s: the channel closed before its confirm, so whether RabbitMQ took it is unknown: %w: %w",
			msg.Key, postgres.ErrBrokerUnavailable, f.closed)
	}
	p.drop(f.cc)
	return fmt.Errorf("message %s: RabbitMQ refused it (basic.nack): %w", msg.Key, postgres.ErrBrokerUnavailable)
}

// drop closes cc, if it is still the Publisher's channel, so that the next
// message goes on a new one: see Publisher on why. The connection stays.
// The close waits for the server's answer, so it runs on its own, never
// under p.mu: a server that stopped reading (a blocked connection) would
// hold every Publish behind it.
func (p *Publisher) drop(cc *confirmChannel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ch == cc {
		p.ch = nil
		go cc.ch.Close()
	}
}

// failed says what err, from handing msg to the channel, means: it may pass.
func (p *Publisher) failed(ctx context.Context, msg postgres.Message, err error) error {
	switch {
	case errors.Is(err, amqp.ErrClosed): // closed before the write began
		return fmt.Errorf("message %s: not sent, its channel closed: %w: %w", msg.Key, postgres.ErrBrokerUnavailable, err)
	case ctx.Err() != nil && errors.Is(err, ctx.Err()): // the client looks at ctx before it writes
		return fmt.Errorf("message %s: not sent before the context ended: %w: %w", msg.Key, postgres.ErrBrokerUnavailable, err)
	default: // the write failed on its way: part of it may have gone
		return fmt.Errorf("message %s: its write failed, so whether RabbitMQ took it is unknown: %w: %w", msg.Key, postgres.ErrBrokerUnavailable, err)
	}
}

// channel returns the open confirm channel, dialling and opening one if
// there is none; it stores in using the connection it is about to do
// network I/O on, so that a caller whose context ends can close it.
func (p *Publisher) channel(using *atomic.Pointer[amqp.Connection]) (*confirmChannel, error) {
	p.mu.Lock()
	cc := p.ch
	p.mu.Unlock()
	if cc != nil && !cc.ch.IsClosed() {
		using.Store(cc.conn)
		return cc, nil
	}
	p.opening.Lock()
	defer p.opening.Unlock()
	p.mu.Lock()
	conn, cc := p.conn, p.ch
	p.mu.Unlock()
	if cc != nil && !cc.ch.IsClosed() { // another goroutine opened it meanwhile
		using.Store(cc.conn)
		return cc, nil
	}
	blocked := p.blocked
	if conn == nil || conn.IsClosed() {
		c, err := p.dial()
		if err != nil {
			return nil, fmt.Errorf("dial: %w", err)
		}
		conn, blocked = c, new(atomic.Pointer[string])
		go watchBlocked(blocked, conn.NotifyBlocked(make(chan amqp.Blocking, 1)))
		p.mu.Lock()
		p.conn, p.blocked, p.ch = conn, blocked, nil
		p.mu.Unlock()
	}
	using.Store(conn)
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open a channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		ch.Close()
		return nil, fmt.Errorf("confirm mode: %w", err)
	}
	cc = newConfirmChannel(conn, ch, blocked)
	p.mu.Lock()
	p.ch = cc
	p.mu.Unlock()
	return cc, nil
}

// watchBlocked records in blocked what the server says of blocking a
// connection, until the connection closes.
func watchBlocked(blocked *atomic.Pointer[string], blockings <-chan amqp.Blocking) {
	for b := range blockings {
		if b.Active {
			blocked.Store(&b.Reason)
		} else {
			blocked.Store(nil)
		}
	}
}

// inflight is a message handed to a channel, until its confirm.
type inflight struct {
	key  string
	size int
	cc   *confirmChannel // the channel it was sent on
	done chan struct{}   // closed once one of the three below is known

	acked    bool
	returned *amqp.Return // set before the confirm, when no queue took it
	closed   *amqp.Error  // the channel closed first, with this error
}

// maxSizeText reads the server's limit from the error that closes a channel
// on a message over it.
var maxSizeText = regexp.MustCompile(`larger than configured max size (\d+)`)

// tooLarge reports whether f's message was over the size whose refusal
// closed its channel.
func (f *inflight) tooLarge() bool {
	m := maxSizeText.FindStringSubmatch(f.closed.Reason)
	if m == nil {
		return false
	}
	limit, err := strconv.Atoi(m[1])
	return err == nil && f.size > limit
}

// confirmChannel is a channel in confirm mode with the messages it holds in
// flight, by delivery tag, and a goroutine that tells each of its confirm.
type confirmChannel struct {
	conn *amqp.Connection // the connection ch is on
	ch   *amqp.Channel

	// blocked holds the reason the server gave when it stopped reading
	// from conn (connection.blocked: a memory or disk alarm), or nil.
	blocked *atomic.Pointer[string]

	sending sync.Mutex // held from a message's delivery tag to its write
	mu      sync.Mutex // guards pending
	pending map[uint64]*inflight
}

func newConfirmChannel(conn *amqp.Connection, ch *amqp.Channel, blocked *atomic.Pointer[string]) *confirmChannel {
	cc := &confirmChannel{conn: conn, ch: ch, blocked: blocked, pending: map[uint64]*inflight{}}
	// Unbuffered: the client hands over a message's return before it reads
	// that message's confirm, so listen has every return before the
	// confirm it precedes.
	returns := ch.NotifyReturn(make(chan amqp.Return))
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation))
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	go cc.listen(returns, confirms, closed)
	return cc
}

// listen matches returns and confirms with the messages in flight until
// the channel closes, then tells those left that it did.
func (cc *confirmChannel) listen(returns <-chan amqp.Return, confirms <-chan amqp.Confirmation, closed <-chan *amqp.Error) {
	for returns != nil || confirms != nil {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			cc.mu.Lock()
			var first uint64 // the earliest in flight with its key: its confirm comes next
			for tag, f := range cc.pending {
				if f.key == r.MessageId && f.returned == nil && (first == 0 || tag < first) {
					first = tag
				}
			}
			if first != 0 {
				cc.pending[first].returned = &r
			}
			cc.mu.Unlock()
		case c, ok := <-confirms:
			if !ok {
				confirms = nil
				continue
			}
			cc.mu.Lock()
			if f := cc.pending[c.DeliveryTag]; f != nil {
				f.acked = c.Ack
				delete(cc.pending, c.DeliveryTag)
				close(f.done)
			}
			cc.mu.Unlock()
		}
	}
	err := <-closed
	if err == nil {
		err = amqp.ErrClosed
	}
	cc.mu.Lock()
	defer cc.mu.Unlock()
	for tag, f := range cc.pending {
		f.closed = err
		delete(cc.pending, tag)
		close(f.done)
	}
}
