package postgres_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// EnvSoak is how long TestLogRelaySoak runs its producers (a Go duration);
// unset, 15 s, the short version every make postgres (and so CI) runs.
// make soak-log-relay runs it for 10 minutes. EnvSoakOut, if set, names
// the file its counts are written to, with the machine's cpu.
const (
	EnvSoak    = "OUTBOX_SOAK"
	EnvSoakOut = "OUTBOX_SOAK_OUT"
)

// soakSeed fixes the soak's choices (which rows cannot be read, which
// publishes fail), so that a run can be told again.
const soakSeed = 78

// soakLog is the order of what the soak's log relay did: each publish, and
// each session that failed, in Run's goroutine, where both happen.
type soakLog struct {
	mu     sync.Mutex
	events []soakEvent
}

type soakEvent struct {
	failed bool             // a session failed here
	msg    postgres.Message // else: published
}

func (l *soakLog) add(e soakEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, e)
}

func (l *soakLog) snapshot() []soakEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]soakEvent(nil), l.events...)
}

// The log relay under what wedged it, for a while: producers commit
// transactions of one to four rows, each row of an aggregate of its
// producer's with its Seq; about one transaction in thirty also holds a row
// the relay cannot read (headers that are not strings, written past
// migration 8's check, an event of no aggregate). The broker fails about
// one publish in 150 (ErrBrokerUnavailable), often on a later row of a
// transaction whose earlier rows it took, and the relay's walsender is
// terminated every 3 s: sessions cut mid-transaction. Then, once the
// producers stop: every readable row reached the broker, in order per
// aggregate as a consumer dropping copies by key sees them; every copy
// came after a failed session (a copy with none between is a resend
// without a cause); every unreadable row is parked; the slot confirmed
// past the last commit. The counts are logged (and written to EnvSoakOut).
func TestLogRelaySoak(t *testing.T) {
	length := 15 * time.Second
	if v := os.Getenv(EnvSoak); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("%s=%q: %v", EnvSoak, v, err)
		}
		length = d
	}
	ctx := context.Background()
	name := newDatabaseName(t)
	db := open(t, name, "")
	if _, err := db.Exec(`ALTER TABLE outbox DROP CONSTRAINT outbox_headers_strings`); err != nil {
		t.Fatal(err)
	}
	var events soakLog
	rng := rand.New(rand.NewPCG(soakSeed, 1))
	var rngMu sync.Mutex
	var brokerFailures atomic.Int64
	broker := brokerFunc(func(_ context.Context, m postgres.Message) error {
		rngMu.Lock()
		fail := rng.IntN(150) == 0
		rngMu.Unlock()
		if fail {
			brokerFailures.Add(1)
			return fmt.Errorf("the broker is down for a moment: %w", postgres.ErrBrokerUnavailable)
		}
		events.add(soakEvent{msg: m})
		return nil
	})
	var sessionsFailed atomic.Int64
	relay := logRelayOn(t, db, logConnString(name), name, broker, postgres.LogRelayConfig{
		MaxBackoff: 50 * time.Millisecond,
		OnPass: func(r postgres.PassReport) {
			if r.Err != nil && r.Claimed == 0 && r.Published == 0 && r.Marked == 0 {
				sessionsFailed.Add(1)
				events.add(soakEvent{failed: true})
			}
		},
	})
	runLog(t, relay)

	// The producers.
	type written struct {
		key, aggregate string
		seq            int64
		unreadable     bool
	}
	var mu sync.Mutex
	var rows []written
	transactions := 0
	stop := make(chan struct{})
	var producers sync.WaitGroup
	for p := range 2 {
		producers.Add(1)
		go func() {
			defer producers.Done()
			prng := rand.New(rand.NewPCG(soakSeed, uint64(10+p)))
			seqs := map[string]int64{}
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				var mine []written
				err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
					mine = mine[:0]
					next := map[string]int64{} // within the transaction
					for range 1 + prng.IntN(4) {
						aggregate := fmt.Sprintf("p%d/%d", p, prng.IntN(20))
						seq := max(seqs[aggregate], next[aggregate]) + 1
						next[aggregate] = seq
						var key string
						if err := tx.QueryRowContext(ctx, `INSERT INTO outbox (type, payload, aggregate, seq) VALUES ('Noted', '{}', $1, $2) RETURNING message_key::text`,
							aggregate, seq).Scan(&key); err != nil {
							return err
						}
						mine = append(mine, written{key: key, aggregate: aggregate, seq: seq})
					}
					if prng.IntN(30) == 0 {
						var key string
						if err := tx.QueryRowContext(ctx, `INSERT INTO outbox (type, payload, headers) VALUES ('Noted', '{}', '{"n": 1}') RETURNING message_key::text`).Scan(&key); err != nil {
							return err
						}
						mine = append(mine, written{key: key, unreadable: true})
					}
					return nil
				})
				if err != nil {
					t.Errorf("producer %d: %v", p, err)
					return
				}
				for _, w := range mine {
					if !w.unreadable {
						seqs[w.aggregate] = w.seq
					}
				}
				mu.Lock()
				rows = append(rows, mine...)
				transactions++
				mu.Unlock()
				time.Sleep(5 * time.Millisecond) // a pace, not a wait: at most 200 transactions a second each
			}
		}()
	}
	// The cutter: the relay's walsender terminated every 3 s.
	cuts := 0
	began := time.Now()
	for time.Since(began) < length {
		time.Sleep(min(3*time.Second, length-time.Since(began)))
		var n int
		if err := db.QueryRow(`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_replication WHERE application_name = 'outbox-log-relay'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		cuts += n
	}
	close(stop)
	producers.Wait()
	var end string
	if err := db.QueryRow(`SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
		t.Fatal(err)
	}

	mu.Lock()
	defer mu.Unlock()
	readable := map[string]written{}
	unreadable := 0
	for _, w := range rows {
		if w.unreadable {
			unreadable++
		} else {
			readable[w.key] = w
		}
	}
	waitUntil(t, "every readable row published, and the slot past the last commit", func() bool {
		seen := map[string]bool{}
		for _, e := range events.snapshot() {
			if !e.failed {
				seen[e.msg.Key] = true
			}
		}
		for k := range readable {
			if !seen[k] {
				return false
			}
		}
		var past bool
		return db.QueryRow(`SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = $2`, end, name).Scan(&past) == nil && past
	})

	// As a consumer that drops copies by key sees the stream.
	last := map[string]int64{}
	published := map[string]int{}
	failedBefore := map[string]int{} // by key: the sessions failed when it was last published
	failures, copies, causeless, outOfOrder := 0, 0, 0, 0
	for _, e := range events.snapshot() {
		if e.failed {
			failures++
			continue
		}
		m := e.msg
		published[m.Key]++
		before, again := failedBefore[m.Key], published[m.Key] > 1
		failedBefore[m.Key] = failures
		if again {
			copies++
			if before == failures {
				causeless++
			}
			continue
		}
		if m.Aggregate != "" {
			if m.Seq != last[m.Aggregate]+1 {
				outOfOrder++
			}
			last[m.Aggregate] = m.Seq
		}
	}
	var parked, unparkedBad int
	if err := db.QueryRow(`SELECT count(*) FILTER (WHERE parked_at IS NOT NULL), count(*) FILTER (WHERE headers IS NOT NULL AND parked_at IS NULL)
		FROM outbox`).Scan(&parked, &unparkedBad); err != nil {
		t.Fatal(err)
	}
	for k := range published {
		if _, ok := readable[k]; !ok {
			t.Errorf("published %s, which no producer wrote as a readable row", k)
			break
		}
	}
	summary := fmt.Sprintf("log relay soak, %v, seed %d: %d transactions, %d readable rows, %d unreadable; "+
		"%d broker failures, %d walsender cuts, %d failed sessions; %d rows published, %d copies (%d with no failed session before them), "+
		"%d out of order per aggregate; %d parked, %d unreadable not parked; the slot confirmed past %s",
		length, soakSeed, transactions, len(readable), unreadable, brokerFailures.Load(), cuts, sessionsFailed.Load(),
		len(published), copies, causeless, outOfOrder, parked, unparkedBad, end)
	t.Log(summary)
	if out := os.Getenv(EnvSoakOut); out != "" {
		if err := os.WriteFile(out, []byte(fmt.Sprintf("cpu: %s\ngoos: %s, goarch: %s, cores: %d\n%s\n", cpuName(), runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), summary)), 0o644); err != nil {
			t.Error(err)
		}
	}
	if len(published) != len(readable) || outOfOrder != 0 || causeless != 0 || parked != unreadable || unparkedBad != 0 {
		t.Errorf("want every readable row published (%d of %d), none out of order (%d), no copy without a failed session before it (%d), every unreadable row parked (%d of %d, %d not)",
			len(published), len(readable), outOfOrder, causeless, parked, unreadable, unparkedBad)
	}
	if transactions == 0 || unreadable == 0 || sessionsFailed.Load() == 0 {
		t.Errorf("the soak made %d transactions, %d unreadable rows, %d failed sessions: too short to mean anything", transactions, unreadable, sessionsFailed.Load())
	}
}

// cpuName is the machine's processor, as /proc/cpuinfo names it, or "".
func cpuName() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}
