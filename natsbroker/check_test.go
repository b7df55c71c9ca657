package natsbroker_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
)

// CheckPublish stores nothing and says whether a publish to the subject
// reaches the stream: yes for a user that may publish there; no, naming
// the permission the server refused, for one that may use JetStream's API
// and nothing under the stream's subjects; no for a subject no stream
// takes.
func TestCheckPublishSaysWhetherAPublishReachesTheStream(t *testing.T) {
	ctx := context.Background()
	b := startBroker(t, func(o *server.Options) {
		o.Users = []*server.User{
			{Username: "relay", Password: "relay-pw"},
			{Username: "reader", Password: "reader-pw", Permissions: &server.Permissions{
				Publish: &server.SubjectPermission{Allow: []string{"$JS.API.>", "_INBOX.>"}},
			}},
		}
	})
	as := func(user, password string) jetstream.JetStream {
		nc, err := nats.Connect(b.url(), nats.UserInfo(user, password))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	relay := as("relay", "relay-pw")
	_, stream := setUp(t, relay.Conn(), 0, 0)
	short := func() context.Context {
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		t.Cleanup(cancel)
		return c
	}
	subject := natsbroker.SubjectPrefix + "OutboxRelayCheck"
	if err := natsbroker.CheckPublish(short(), relay, subject); err != nil {
		t.Errorf("CheckPublish as a user that may publish = %v; want nil", err)
	}
	err := natsbroker.CheckPublish(short(), as("reader", "reader-pw"), subject)
	if !errors.Is(err, natsbroker.ErrPublishRefused) || !strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
		t.Errorf("CheckPublish as a user that may not publish there = %v; want ErrPublishRefused naming the permission", err)
	}
	if err := natsbroker.CheckPublish(short(), relay, "elsewhere.check"); !errors.Is(err, natsbroker.ErrPublishRefused) {
		t.Errorf("CheckPublish to a subject no stream takes = %v; want ErrPublishRefused", err)
	}
	info, err := stream.Info(ctx)
	if err != nil || info.State.Msgs != 0 {
		t.Errorf("the stream holds %d messages after the checks (%v); want none", info.State.Msgs, err)
	}
}
