package rabbitbroker

import amqp "github.com/rabbitmq/amqp091-go"

// This file is compiled only into the package's tests.

// ChannelOf is the channel p publishes on, or nil if it holds none.
func ChannelOf(p *Publisher) *amqp.Channel {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ch == nil {
		return nil
	}
	return p.ch.ch
}
