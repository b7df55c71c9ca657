// Package natsbroker is the outbox's broker side on NATS JetStream: a
// [Publisher] through which a [postgres.OutboxRelay] publishes, the stream it
// publishes to, and a [Consumer] that feeds the messages to a [Handler],
// such as one built on [postgres.Outbox.ApplyOnce]. It imports the outbox
// package only; the shop program (shop/, at the top of the repository)
// wires it to the example (the postgres/shop package's shop and warehouse)
// into a shop that can be run.
//
// Delivery stays at least once, end to end. JetStream drops a message whose
// Nats-Msg-Id it has stored within the stream's duplicate window, which
// removes the copies a relay's re-send makes in the common case; the
// consumer still drops the rest by the message's key, since the window is
// a time, not a guarantee.
package natsbroker

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Stream is the name of the stream the outbox's messages are stored in, and
// SubjectPrefix the start of their subjects: a message of type OrderPlaced
// is published to "outbox.OrderPlaced".
const (
	Stream        = "OUTBOX"
	SubjectPrefix = "outbox."
)

// DefaultDuplicateWindow is JetStream's own default duplicate window.
const DefaultDuplicateWindow = 2 * time.Minute

// DefaultMaxAge is how long the stream StreamConfig describes keeps a
// message: a week. A consumer must remember the key of every message the
// stream still holds, or a replay applies it again (see [ForgetProcessed]).
const DefaultMaxAge = 7 * 24 * time.Hour

// The headers a published message carries besides Nats-Msg-Id (the
// message's key): the outbox row's id, the message's aggregate and seq
// when it has them, and its payload's media type when it is not JSON
// (postgres.Event.ContentType). The team's own headers (Event.Headers) go
// beside these, as they were written, and come back in Message.Headers.
const (
	HeaderID          = "Outbox-Id"
	HeaderAggregate   = "Outbox-Aggregate"
	HeaderSeq         = "Outbox-Seq"
	HeaderContentType = "content-type"
)

// StreamConfig is the stream the outbox publishes to: every subject under
// SubjectPrefix, kept on disk (file storage survives a restart of the
// server, and so does its record of the message ids it has seen), each
// message for DefaultMaxAge (the limits retention policy: a message stays
// whether or not it was consumed, so that a new or reset consumer can
// replay it; set MaxAge to change it), and duplicates dropped within window
// (zero or less means DefaultDuplicateWindow). It allows fast batches
// (server 2.14 and later), which Publisher.PublishSequence sends so that the
// relays publish a batch a round trip and keep its order. It has one replica; set
// Replicas to 3 on a cluster of three (see the README on what an ack then
// means).
//
// The rule for the window: it must be longer than the longest delay before a
// relay publishes a message again. That delay is a relay pass's budget
// (postgres.RelayConfig.PassTimeout) twice over when its session is lost,
// plus the relay's backoff, but also as long as the broker is unreachable
// after it stored a message whose acknowledgement was lost, and as long as
// a parked message waits before someone puts it back. A copy published
// after the window is stored again and reaches the consumers, who must still
// drop it by its key. A longer window costs the server memory for each id in
// it.
func StreamConfig(window time.Duration) jetstream.StreamConfig {
	return DefaultNames.StreamConfig(window)
}

// streamConfig is StreamConfig without its names.
func streamConfig(window time.Duration) jetstream.StreamConfig {
	if window <= 0 {
		window = DefaultDuplicateWindow
	}
	return jetstream.StreamConfig{
		Name:       Stream,
		Subjects:   []string{SubjectPrefix + ">"},
		Storage:    jetstream.FileStorage,
		Retention:  jetstream.LimitsPolicy,
		MaxAge:     DefaultMaxAge,
		Duplicates: window,

		AllowBatchPublish: true, // for Publisher.PublishSequence
	}
}

// ErrRetentionTooShort is returned, wrapped, by [ForgetProcessed] for a
// retention shorter than the stream keeps its messages.
var ErrRetentionTooShort = errors.New("natsbroker: consumer would forget keys of messages the stream still holds")

// Forgetter is what [ForgetProcessed] needs of the consumer's database: a
// *postgres.Outbox opened on it, on pgx or on database/sql.
type Forgetter interface {
	ForgetProcessed(ctx context.Context, retention time.Duration) (int64, error)
}

// ForgetProcessed is [postgres.Outbox.ForgetProcessed] of f, the consumer's
// database, under the rule that ties it to the stream: a consumer forgets a key only once the stream
// can no longer deliver its message. A message is stored before it is
// processed, so a key is never older than its message; with a retention at
// least the stream's MaxAge, every message the stream still holds has its
// key remembered, and a replay (a new consumer, or one reset to the start)
// applies nothing twice. ForgetProcessed reads the stream's MaxAge and
// refuses, with ErrRetentionTooShort and deleting nothing, a retention
// shorter than it, or any retention for a stream that keeps its messages
// for ever (MaxAge zero). The warehouse's own rule still holds beside it: a
// retention longer than the longest delay before a relay sends a message
// again.
func ForgetProcessed(ctx context.Context, js jetstream.JetStream, stream string, f Forgetter, retention time.Duration) (int64, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("forget processed messages: stream %s: %w", stream, err)
	}
	maxAge := s.CachedInfo().Config.MaxAge
	switch {
	case maxAge <= 0:
		return 0, fmt.Errorf("%w: stream %s keeps its messages for ever", ErrRetentionTooShort, stream)
	case retention < maxAge:
		return 0, fmt.Errorf("%w: retention %v, but stream %s keeps messages %v", ErrRetentionTooShort, retention, stream, maxAge)
	}
	return f.ForgetProcessed(ctx, retention)
}

// ConsumerConfig is a durable pull consumer, named name, of the whole stream,
// with explicit acks: a message is delivered again when its consumer does
// not ack it within ackWait (zero or less means 30 s), or asks for it again.
// MaxDeliver is left unlimited: a message that can never be applied is
// terminated by [Consumer], not dropped after some count of tries.
func ConsumerConfig(name string, ackWait time.Duration) jetstream.ConsumerConfig {
	return DefaultNames.ConsumerConfig(name, ackWait)
}

// consumerConfig is ConsumerConfig without its filter.
func consumerConfig(name string, ackWait time.Duration) jetstream.ConsumerConfig {
	if ackWait <= 0 {
		ackWait = 30 * time.Second
	}
	return jetstream.ConsumerConfig{
		Durable:       name,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		FilterSubject: SubjectPrefix + ">",
	}
}

// ErrStreamConfig is wrapped by [CheckStream]'s error: the stream is
// missing, or not as the configuration the publisher relies on says.
var ErrStreamConfig = errors.New("natsbroker: stream missing or not as configured")

// CheckStream reports, with an error wrapping [ErrStreamConfig], a stream
// named want.Name that does not exist, or whose subjects, storage,
// replicas, retention, age limit or duplicate window differ from want's, or
// that does not allow the fast batches want allows. Provision the stream
// apart, as the shop's migrate command does with CreateOrUpdateStream, and
// have a service check it at start-up: a service that creates or updates
// the stream itself at every start would undo an operator's change to it
// each time.
func CheckStream(ctx context.Context, js jetstream.JetStream, want jetstream.StreamConfig) error {
	stream, err := js.Stream(ctx, want.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("%w: no stream %s: provision it first", ErrStreamConfig, want.Name)
	}
	if err != nil {
		return fmt.Errorf("check stream %s: %w", want.Name, err)
	}
	got := stream.CachedInfo().Config
	switch {
	case !slices.Equal(got.Subjects, want.Subjects):
		return fmt.Errorf("%w: stream %s takes subjects %v, want %v", ErrStreamConfig, want.Name, got.Subjects, want.Subjects)
	case got.Storage != want.Storage:
		return fmt.Errorf("%w: stream %s has %v storage, want %v", ErrStreamConfig, want.Name, got.Storage, want.Storage)
	case max(got.Replicas, 1) != max(want.Replicas, 1):
		return fmt.Errorf("%w: stream %s has %d replicas, want %d", ErrStreamConfig, want.Name, got.Replicas, want.Replicas)
	case got.Retention != want.Retention || got.MaxAge != want.MaxAge:
		return fmt.Errorf("%w: stream %s keeps messages by %v for %v, want %v for %v",
			ErrStreamConfig, want.Name, got.Retention, got.MaxAge, want.Retention, want.MaxAge)
	case got.Duplicates != want.Duplicates:
		return fmt.Errorf("%w: stream %s drops duplicates within %v, want %v", ErrStreamConfig, want.Name, got.Duplicates, want.Duplicates)
	case want.AllowBatchPublish && !got.AllowBatchPublish:
		return fmt.Errorf("%w: stream %s does not allow batch publishing, which the relays' batches need to keep their order", ErrStreamConfig, want.Name)
	}
	return nil
}

// ErrPublishRefused is wrapped by [CheckPublish]'s error when the server
// did not let a publish to the subject reach a stream.
var ErrPublishRefused = errors.New("natsbroker: a publish to the subject does not reach a stream")

// CheckPublish reports whether js's connection may publish to subject and a
// stream takes it, storing nothing: it publishes an empty message that
// expects the stream's last sequence to be one no stream reaches, which a
// stream that takes the subject refuses as out of sequence, having checked
// everything else. Any other answer, or none before ctx ends (a user the
// server does not allow to publish there gets none), is an error wrapping
// ErrPublishRefused that says what the server said, a permission it
// refused included. The relay process's check runs it on a subject of the
// relay's prefix.
func CheckPublish(ctx context.Context, js jetstream.JetStream, subject string) error {
	_, err := js.Publish(ctx, subject, nil, jetstream.WithExpectLastSequence(math.MaxUint64))
	var apiErr *jetstream.APIError
	switch {
	case errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant):
		return nil // it reached the stream, which stored nothing
	case err == nil:
		return fmt.Errorf("%w: a publish to %s expecting no stream's sequence was stored", ErrPublishRefused, subject)
	}
	if last := js.Conn().LastError(); last != nil && strings.Contains(strings.ToLower(last.Error()), "permissions violation") {
		return fmt.Errorf("%w: %s: the server refused it: %w", ErrPublishRefused, subject, last)
	}
	return fmt.Errorf("%w: %s: %w", ErrPublishRefused, subject, err)
}
