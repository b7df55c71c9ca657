package main

import (
	"os"
	"testing"
)

// NATS's settings (the default broker's) are refused with the flag's name and why.
func TestNATSSettingsAreCheckedBeforeAnythingConnects(t *testing.T) {
	refusesEach(t, []refusedSetting{
		{[]string{"-replicas", "0"}, "", "-replicas (OUTBOX_REPLICAS)"},
		{[]string{"-stream", "bad stream"}, "", "-stream, -subject-prefix"},
		{[]string{"-nats-cert", "/no/such/file"}, "", "-nats-cert (OUTBOX_NATS_CERT) \"/no/such/file\": cannot read the file"},
		{[]string{"-nats-user", "relay"}, "", "-nats-user needs a password"},
		{[]string{"-nats-password-file", "/no/such/file"}, "", "-nats-password-file (OUTBOX_NATS_PASSWORD_FILE)"},
		{[]string{"-nats-user", "relay", "-nats-token-file", os.Args[0]}, "OUTBOX_NATS_PASSWORD=pw", "give one of -nats-creds"},
	})
}
