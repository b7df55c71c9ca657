package outbox

import (
	"errors"
	"slices"
	"sync"
)

// OrderPlaced is the type of the event that tells the warehouse about a new
// order. Its payload is the [Order] as JSON: {"orderId":1,"totalCents":2500}.
const OrderPlaced = "OrderPlaced"

// ErrBrokerUnavailable is returned by [InMemoryBroker.Publish] while the broker
// is down, as a network error would be when a real broker cannot be reached.
var ErrBrokerUnavailable = errors.New("outbox: message broker unavailable")

// Message is an event as the broker carries it.
type Message struct {
	// ID is the id of the outbox row the message was relayed from. A message
	// that is published again after a failure keeps its id, so a consumer
	// can drop the duplicates that at-least-once delivery brings. It is zero
	// for a message published without an outbox, by DirectOrderService.
	ID      int64
	Type    string // the event type, such as OrderPlaced
	Payload string // the event as JSON
}

// MessageBroker is the producer side of a message broker.
//
// Implementations must be safe for concurrent use by multiple goroutines: an
// application shares one broker client between its request handlers and its
// relay, as real broker clients allow.
type MessageBroker interface {
	// Publish hands msg to the broker. A nil error means the broker has
	// accepted the message; an error means it may not have.
	Publish(msg Message) error
}

// InMemoryBroker is a [MessageBroker] that keeps published messages in a list,
// in the order they were published. Its zero value is a broker that is up.
//
// An InMemoryBroker is safe for concurrent use by multiple goroutines.
type InMemoryBroker struct {
	mu        sync.Mutex
	down      bool
	published []Message
}

// Publish appends msg to the list of published messages. While the broker is
// down it keeps nothing and returns [ErrBrokerUnavailable].
func (b *InMemoryBroker) Publish(msg Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.down {
		return ErrBrokerUnavailable
	}
	b.published = append(b.published, msg)
	return nil
}

// SetDown takes the broker down (true) or brings it back up (false).
func (b *InMemoryBroker) SetDown(down bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.down = down
}

// Published returns a copy of the messages published so far, oldest first.
func (b *InMemoryBroker) Published() []Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.published)
}
