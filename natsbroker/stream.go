// Package natsbroker is the outbox's broker side on NATS JetStream: a
// [Publisher] through which a [postgres.OutboxRelay] publishes, the stream it
// publishes to, and a [Consumer] that feeds the messages to a
// [postgres.Warehouse]. cmd/shop wires them into a shop that can be run.
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
	"slices"
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

// The headers a published message carries besides Nats-Msg-Id (the
// message's key): the outbox row's id, and the message's aggregate and seq
// when it has them.
const (
	HeaderID        = "Outbox-Id"
	HeaderAggregate = "Outbox-Aggregate"
	HeaderSeq       = "Outbox-Seq"
)

// StreamConfig is the stream the outbox publishes to: every subject under
// SubjectPrefix, kept on disk (file storage survives a restart of the
// server, and so does its record of the message ids it has seen), and
// duplicates dropped within window (zero or less means
// DefaultDuplicateWindow).
//
// The rule for the window: it must be longer than the longest delay before a
// relay publishes a message again. That delay is a relay pass's budget
// (postgres.OutboxRelay.PassTimeout) twice over when its session is lost,
// plus the relay's backoff, but also as long as the broker is unreachable
// after it stored a message whose acknowledgement was lost, and as long as
// a parked message waits before someone puts it back. A copy published
// after the window is stored again and reaches the consumers, who must still
// drop it by its key. A longer window costs the server memory for each id in
// it.
func StreamConfig(window time.Duration) jetstream.StreamConfig {
	if window <= 0 {
		window = DefaultDuplicateWindow
	}
	return jetstream.StreamConfig{
		Name:       Stream,
		Subjects:   []string{SubjectPrefix + ">"},
		Storage:    jetstream.FileStorage,
		Duplicates: window,
	}
}

// ConsumerConfig is a durable pull consumer, named name, of the whole stream,
// with explicit acks: a message is delivered again when its consumer does
// not ack it within ackWait (zero or less means 30 s), or asks for it again.
// MaxDeliver is left unlimited: a message that can never be applied is
// terminated by [Consumer], not dropped after some count of tries.
func ConsumerConfig(name string, ackWait time.Duration) jetstream.ConsumerConfig {
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
// replicas or duplicate window differ from want's. Provision the stream
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
	case got.Duplicates != want.Duplicates:
		return fmt.Errorf("%w: stream %s drops duplicates within %v, want %v", ErrStreamConfig, want.Name, got.Duplicates, want.Duplicates)
	}
	return nil
}
