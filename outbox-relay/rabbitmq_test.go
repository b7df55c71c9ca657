package main

import (
	"os"
	"testing"
)

// RabbitMQ's settings are refused with the flag's name and why.
func TestRabbitMQSettingsAreCheckedBeforeAnythingConnects(t *testing.T) {
	refusesEach(t, []refusedSetting{
		{[]string{"-broker", "rabbitmq", "-rabbitmq", "http://x/"}, "", "-rabbitmq: want amqp://"},
		{[]string{"-broker", "rabbitmq", "-rabbitmq-cert", os.Args[0]}, "", "-rabbitmq-ca, -rabbitmq-cert, -rabbitmq-server-name are for amqps://"},
		{[]string{"-broker", "rabbitmq", "-exchange", ""}, "", "-exchange and -queue must not be empty"},
		{[]string{"-delivery-limit", "0"}, "", "-delivery-limit (OUTBOX_DELIVERY_LIMIT)"},
	})
}
