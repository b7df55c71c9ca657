package postgres

import "testing"

// A claim passed over nothing only when it took exactly the unsent rows its
// snapshot began with, up to the batch: as many of them, ending at the same
// id. (The tests with several relays, in hot_test.go and order_test.go,
// show what passing over a row another relay holds does to an aggregate's
// order when the check is skipped.)
func TestClaimPassedOverOnlyWhatItDidNotTake(t *testing.T) {
	rows := func(ids ...int64) []claimed {
		var msgs []claimed
		for _, id := range ids {
			msgs = append(msgs, claimed{Message: Message{ID: id}})
		}
		return msgs
	}
	for _, c := range []struct {
		name string
		head unsentHead
		msgs []claimed
		want bool
	}{
		{"nothing unsent, nothing claimed", unsentHead{0, 0}, nil, false},
		{"all three unsent claimed", unsentHead{3, 7}, rows(5, 6, 7), false},
		{"the first row held by another relay", unsentHead{3, 7}, rows(6, 7), true},
		{"a row in the middle passed over, one more claimed after it", unsentHead{3, 7}, rows(5, 7, 9), true},
		{"the last row passed over", unsentHead{3, 7}, rows(5, 6), true},
		{"every unsent row held elsewhere", unsentHead{2, 4}, nil, true},
	} {
		if got := c.head.passedOver(c.msgs); got != c.want {
			t.Errorf("%s: passedOver = %v, want %v", c.name, got, c.want)
		}
	}
}
