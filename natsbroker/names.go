package natsbroker

import (
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/postgres"
)

// Names name one outbox on JetStream, in one place: the stream its
// messages are stored in, and the start of their subjects (a message of
// type T goes to the prefix followed by T). So two outboxes, each relayed
// by its own Publisher, live side by side on one JetStream, each in its
// own stream. [DefaultNames] are [Stream] and [SubjectPrefix], which the
// package's functions use; the consumer's name is ConsumerConfig's
// argument. Names are a value, safe to copy and share; create them with
// [NewNames].
type Names struct {
	stream, prefix string
}

// DefaultNames are the stream OUTBOX and the subjects outbox.<type>.
var DefaultNames = Names{stream: Stream, prefix: SubjectPrefix}

var (
	streamPattern = regexp.MustCompile(`^[A-Za-z0-9_-]{1,32}$`)
	prefixPattern = regexp.MustCompile(`^([A-Za-z0-9_-]+\.)+$`)
)

// NewNames returns the Names of the stream named stream (letters, digits,
// '_' and '-', at most 32 bytes, as JetStream allows in a name) whose
// messages' subjects start with subjectPrefix (words of letters, digits,
// '_' and '-', each followed by a dot: "billing." or "acme.billing.").
// Anything else is refused with an error.
func NewNames(stream, subjectPrefix string) (Names, error) {
	if !streamPattern.MatchString(stream) {
		return Names{}, fmt.Errorf("natsbroker: stream name %q: want letters, digits, '_' and '-', at most 32 bytes", stream)
	}
	if !prefixPattern.MatchString(subjectPrefix) {
		return Names{}, fmt.Errorf("natsbroker: subject prefix %q: want words of letters, digits, '_' and '-', each followed by a dot", subjectPrefix)
	}
	return Names{stream: stream, prefix: subjectPrefix}, nil
}

// Stream is the stream's name; SubjectPrefix the start of the messages'
// subjects.
func (n Names) Stream() string        { return n.stream }
func (n Names) SubjectPrefix() string { return n.prefix }

// StreamConfig is [StreamConfig] for n: the stream n names, taking every
// subject under n's prefix.
func (n Names) StreamConfig(window time.Duration) jetstream.StreamConfig {
	cfg := streamConfig(window)
	cfg.Name = n.stream
	cfg.Subjects = []string{n.prefix + ">"}
	return cfg
}

// ConsumerConfig is [ConsumerConfig] for n: a durable consumer of every
// subject under n's prefix.
func (n Names) ConsumerConfig(name string, ackWait time.Duration) jetstream.ConsumerConfig {
	cfg := consumerConfig(name, ackWait)
	cfg.FilterSubject = n.prefix + ">"
	return cfg
}

// NewPublisher is [NewPublisher] for n: it publishes each message to n's
// prefix followed by its type.
func (n Names) NewPublisher(js jetstream.JetStream, opts PublisherOptions) (*Publisher, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: natsbroker: NewPublisher: no JetStream", postgres.ErrInvalidConfig)
	}
	if err := opts.Check(); err != nil {
		return nil, err
	}
	return &Publisher{js: js, prefix: n.prefix, ceSource: opts.CloudEventsSource}, nil
}

// prefixOf is the subject prefix of a consumer created with a
// ConsumerConfig: its filter without the final ">"; SubjectPrefix for a
// consumer without one.
func prefixOf(c jetstream.Consumer) string {
	if f := c.CachedInfo().Config.FilterSubject; strings.HasSuffix(f, ".>") {
		return strings.TrimSuffix(f, ">")
	}
	return SubjectPrefix
}
