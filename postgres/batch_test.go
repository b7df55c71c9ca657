package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"example.com/patterns/enterprise/outbox/postgres"
)

// batchBroker is a BatchPublisher whose every PublishBatch call answers
// with the next of its replies: how many it accepts, and the error for the
// next message. It records the ids of every call's batch.
type batchBroker struct {
	replies []batchReply
	calls   [][]int64
}

type batchReply struct {
	accept int
	err    error
}

func (b *batchBroker) Publish(context.Context, postgres.Message) error {
	return errors.New("Publish called: the relay should use PublishBatch")
}

func (b *batchBroker) PublishBatch(_ context.Context, msgs []postgres.Message) (int, error) {
	var ids []int64
	for _, m := range msgs {
		ids = append(ids, m.ID)
	}
	b.calls = append(b.calls, ids)
	if len(b.replies) == 0 {
		return len(msgs), nil
	}
	r := b.replies[0]
	b.replies = b.replies[1:]
	return r.accept, r.err
}

// A relay with PerAggregate whose broker is a BatchPublisher hands it the
// whole claim at once
// and marks exactly the prefix the broker accepted: the first message it
// did not accept and everything after it stay unsent, even if the broker
// stored them, and go again next pass.
func TestBatchPublisherMarksExactlyTheAcceptedPrefix(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200, 300, 400, 500)
	broker := &batchBroker{replies: []batchReply{{2, fmt.Errorf("ack of 3 lost: %w", postgres.ErrBrokerUnavailable)}}}
	relay := newRelay(t, db, broker)
	n, err := relay.PublishPending(ctx)
	if n != 2 || !errors.Is(err, postgres.ErrBrokerUnavailable) {
		t.Fatalf("pass = %d, %v; want 2 and the broker's error", n, err)
	}
	wantSent(t, db, true, true, false, false, false)
	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("next pass = %d, %v; want 3, <nil>", n, err)
	}
	wantSent(t, db, true, true, true, true, true)
	if want := [][]int64{{1, 2, 3, 4, 5}, {3, 4, 5}}; !slices.EqualFunc(broker.calls, want, slices.Equal) {
		t.Errorf("batches = %v, want %v", broker.calls, want)
	}
}

// A rejection in the middle of a batch parks that row (with ParkAfter) and
// the rest of the batch goes in a call of its own, in the same pass.
func TestBatchPublisherRejectionParksAndTheRestGoesOn(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200, 300, 400, 500)
	broker := &batchBroker{replies: []batchReply{{2, fmt.Errorf("too large: %w", postgres.ErrRejected)}}}
	relay := newRelay(t, db, broker, postgres.RelayConfig{ParkAfter: 1})
	if n, err := relay.PublishPending(ctx); n != 4 || err != nil {
		t.Fatalf("pass = %d, %v; want 4, <nil>", n, err)
	}
	wantSent(t, db, true, true, false, true, true)
	if want := [][]int64{{1, 2, 3, 4, 5}, {4, 5}}; !slices.EqualFunc(broker.calls, want, slices.Equal) {
		t.Errorf("batches = %v, want %v", broker.calls, want)
	}
	parked, err := postgres.ListParked(ctx, db, 0)
	if err != nil || len(parked) != 1 || parked[0].ID != 3 {
		t.Errorf("parked = %+v, %v; want row 3", parked, err)
	}
}

// A broker that answers what cannot be (more than it was given, or fewer
// than all with no error) gets nothing marked beyond what it can have
// accepted, and the pass says what the broker answered.
func TestBatchPublisherThatMisreportsMarksNothingItCannotHaveAccepted(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		reply batchReply
		n     int
		sent  []bool
	}{
		{batchReply{4, nil}, 0, []bool{false, false, false}},
		{batchReply{-1, nil}, 0, []bool{false, false, false}},
		{batchReply{1, nil}, 1, []bool{true, false, false}},
	} {
		t.Run(fmt.Sprint(tc.reply.accept), func(t *testing.T) {
			db := newDatabase(t)
			place(t, db, 100, 200, 300)
			relay := newRelay(t, db, &batchBroker{replies: []batchReply{tc.reply}})
			n, err := relay.PublishPending(ctx)
			if n != tc.n || err == nil {
				t.Fatalf("pass = %d, %v; want %d and an error", n, err, tc.n)
			}
			wantSent(t, db, tc.sent...)
		})
	}
}

// A relay that keeps the whole table's order never batches, even through a
// BatchPublisher: it publishes one message at a time, so that the broker
// never stores a message after one it refused. (Caught: a batch over the
// whole table, which a broker may store past a refusal.)
func TestWholeTableRelayPublishesOneAtATime(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200, 300)
	broker := &eitherBroker{}
	relay := newRelay(t, db, broker, postgres.RelayConfig{WholeTable: true}) // the whole table's order, the article's
	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("pass = %d, %v; want 3", n, err)
	}
	if broker.singles != 3 || broker.batches != 0 {
		t.Errorf("the relay made %d single publishes and %d batches, want 3 and 0", broker.singles, broker.batches)
	}
}

// A relay that keeps the whole table's order hands a SequencePublisher,
// which stores nothing after a message it refused, its whole batch: ten
// rows in one call; the broker refuses the sixth, the pass marks five and
// stops, and the next pass hands it the other five in one call. (Caught: a
// whole-table relay that publishes one at a time whatever the broker, ten
// calls and more.)
func TestWholeTableRelayHandsASequencePublisherItsBatch(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000)
	broker := &sequenceBroker{refuse: 6}
	relay := newRelay(t, db, broker, postgres.RelayConfig{WholeTable: true, NeverPark: true}) // the article's relay
	if n, err := relay.PublishPending(ctx); n != 5 || err == nil {
		t.Fatalf("first pass = %d, %v; want 5 and the refusal of message 6", n, err)
	}
	if n, err := relay.PublishPending(ctx); n != 5 || err != nil {
		t.Fatalf("second pass = %d, %v; want 5, <nil>", n, err)
	}
	if want := [][]int64{{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {6, 7, 8, 9, 10}}; !slices.EqualFunc(broker.calls, want, slices.Equal) {
		t.Errorf("the relay handed the broker %v, want %v", broker.calls, want)
	}
	if want := []int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}; !slices.Equal(broker.stored, want) {
		t.Errorf("the broker stored %v, want %v", broker.stored, want)
	}
}

// sequenceBroker is a SequencePublisher that refuses message refuse the first
// time it is given it, and keeps the ids of each call and of what it stored.
type sequenceBroker struct {
	refuse int64
	calls  [][]int64
	stored []int64
}

func (b *sequenceBroker) Publish(ctx context.Context, m postgres.Message) error {
	_, err := b.PublishSequence(ctx, []postgres.Message{m})
	return err
}

func (b *sequenceBroker) PublishSequence(_ context.Context, msgs []postgres.Message) (int, error) {
	var ids []int64
	for _, m := range msgs {
		ids = append(ids, m.ID)
	}
	b.calls = append(b.calls, ids)
	for i, m := range msgs {
		if m.ID == b.refuse {
			b.refuse = 0
			return i, fmt.Errorf("message %d: not now", m.ID)
		}
		b.stored = append(b.stored, m.ID)
	}
	return len(msgs), nil
}

// eitherBroker accepts everything, one message or a batch, and counts which.
type eitherBroker struct{ singles, batches int }

func (b *eitherBroker) Publish(context.Context, postgres.Message) error { b.singles++; return nil }

func (b *eitherBroker) PublishBatch(_ context.Context, msgs []postgres.Message) (int, error) {
	b.batches++
	return len(msgs), nil
}

// The relay of the zero RelayConfig is the one a team should run: a
// BatchPublisher gets each pass's rows in one batch, and a message the
// broker can never take is set aside after DefaultParkAfter rejections,
// the rows after it delivered, instead of blocking the table for ever.
// (Caught: the article's relay as the default, one message at a time and
// every later row blocked behind the refused one, ParkAfter 0.)
func TestRelayAsItComesBatchesAndParksWhatCanNeverGo(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	place(t, db, 100, 200, 300)
	batching := &eitherBroker{}
	if n, err := newRelay(t, db, batching).PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("pass = %d, %v; want 3", n, err)
	}
	if batching.batches != 1 || batching.singles != 0 {
		t.Errorf("the relay as it comes made %d batches and %d single publishes, want 1 and 0", batching.batches, batching.singles)
	}

	place(t, db, 400, 500, 600) // rows 4, 5 and 6; the broker can never take 5
	broker := &recorder{}
	refuse5 := brokerFunc(func(ctx context.Context, m postgres.Message) error {
		if m.ID == 5 {
			return fmt.Errorf("payload over the broker's limit: %w", postgres.ErrRejected)
		}
		return broker.Publish(ctx, m)
	})
	relay := newRelay(t, db, refuse5)
	for pass := 1; pass <= postgres.DefaultParkAfter+1; pass++ {
		retryNow(t, db) // each refusal's backoff passed
		relay.PublishPending(ctx)
	}
	if ids := broker.IDs(); !slices.Equal(ids, []int64{4, 6}) {
		t.Errorf("the broker got %v, want [4 6]: the rows after the refused one go on", ids)
	}
	parked, err := postgres.ListParked(ctx, db, 0)
	if err != nil || len(parked) != 1 || parked[0].ID != 5 || parked[0].Rejections != postgres.DefaultParkAfter {
		t.Errorf("ListParked = %+v, %v; want row 5 after %d rejections", parked, err, postgres.DefaultParkAfter)
	}
}

// A relay with PerAggregate, through a broker that has both PublishBatch and
// PublishSequence, sends a batch that holds no aggregate twice
// asynchronously (PublishBatch, which costs JetStream less) and one that
// holds a run of an aggregate as a sequence, which keeps the run's order.
// (Caught: a relay that sends every batch as a sequence; one that sends a
// run through PublishBatch, which may store A3 after a refused A2.)
func TestPerAggregateRelayBatchesWhereItCanAndSequencesRuns(t *testing.T) {
	ctx := context.Background()
	db := newDatabase(t)
	insertRun(t, db, "A", 1, 1)
	insertRun(t, db, "B", 1, 1)
	insertRun(t, db, "C", 1, 1) // ids 1 to 3: no aggregate twice
	broker := &bothBroker{}
	relay := newRelay(t, db, broker)
	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("first pass = %d, %v; want 3", n, err)
	}
	insertRun(t, db, "A", 2, 2)
	insertRun(t, db, "B", 2, 1) // ids 4 to 6: A2, A3, B2
	if n, err := relay.PublishPending(ctx); n != 3 || err != nil {
		t.Fatalf("second pass = %d, %v; want 3", n, err)
	}
	if want := []string{"batch [1 2 3]", "sequence [4 5 6]"}; !slices.Equal(broker.calls, want) {
		t.Errorf("the relay called %q, want %q", broker.calls, want)
	}
}

// bothBroker accepts everything, as a batch or a sequence, and notes each
// call.
type bothBroker struct{ calls []string }

func (b *bothBroker) Publish(_ context.Context, m postgres.Message) error {
	b.calls = append(b.calls, fmt.Sprintf("publish %d", m.ID))
	return nil
}

func (b *bothBroker) PublishBatch(_ context.Context, msgs []postgres.Message) (int, error) {
	b.calls = append(b.calls, fmt.Sprintf("batch %v", idsOf(msgs)))
	return len(msgs), nil
}

func (b *bothBroker) PublishSequence(_ context.Context, msgs []postgres.Message) (int, error) {
	b.calls = append(b.calls, fmt.Sprintf("sequence %v", idsOf(msgs)))
	return len(msgs), nil
}

func idsOf(msgs []postgres.Message) []int64 {
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	return ids
}
