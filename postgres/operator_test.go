package postgres_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres"
)

// A relay that publishes with no standby (PublishWithoutStandbys) says so
// once, not once a pass: twenty passes on a primary with no standby, twenty
// rows published, one line at Warn. (Caught: 1,454 lines in 23 s after a
// promotion.)
func TestPublishingWithoutStandbysIsSaidOnceNotEveryPass(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	var logs logBuffer
	relay := newRelay(t, db, &recorder{}, postgres.RelayConfig{StandbyCount: 1, PublishWithoutStandbys: true,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	published := 0
	for range 20 {
		place(t, db, 100)
		n, err := relay.PublishPending(ctx)
		if err != nil {
			t.Fatal(err)
		}
		published += n
	}
	if published != 20 {
		t.Errorf("published %d rows in 20 passes; want 20", published)
	}
	if n := strings.Count(logs.String(), "PublishWithoutStandbys"); n != 1 {
		t.Errorf("%d lines say the relay publishes with no standby; want 1:\n%s", n, logs.String())
	}
}
