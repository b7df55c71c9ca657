package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// refusedSetting is a setting parse refuses: its flags, a variable set for it
// (NAME=value), and what the error must say.
type refusedSetting struct {
	args []string
	env  string
	want string
}

// refusesEach checks that parse refuses each setting of run, saying why.
func refusesEach(t *testing.T, cases []refusedSetting) {
	t.Helper()
	const db = "-database=host=127.0.0.1 port=1"
	for _, tc := range cases {
		if tc.env != "" {
			name, value, _ := strings.Cut(tc.env, "=")
			t.Setenv(name, value)
		}
		_, _, err := parse("run", append([]string{db}, tc.args...))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run %v (%s) = %v; want an error with %q", tc.args, tc.env, err, tc.want)
		}
		if tc.env != "" {
			name, _, _ := strings.Cut(tc.env, "=")
			os.Unsetenv(name)
		}
	}
}

// Every setting is checked before anything connects, from its flag or its
// OUTBOX_* variable, and a bad value is refused with the flag's name, the
// variable's and why; the settings that agree reach the relays' configs.
// (Caught: no flag for the batch, the budget, parking, order per
// aggregate, the poll interval or PollOnly, and a bad value found only at
// the first pass.)
func TestEverySettingIsCheckedBeforeAnythingConnects(t *testing.T) {
	refusesEach(t, []refusedSetting{
		{[]string{"-batch-size", "0x10"}, "", "-batch-size (OUTBOX_BATCH_SIZE)"},
		{[]string{"-batch-size", "20000"}, "", "from 0 to 10000"},
		{nil, "OUTBOX_BATCH_SIZE=-1", "-batch-size (OUTBOX_BATCH_SIZE) \"-1\""},
		{[]string{"-pass-timeout", "soon"}, "", "-pass-timeout (OUTBOX_PASS_TIMEOUT)"},
		{[]string{"-park-after", "-3"}, "", "-park-after (OUTBOX_PARK_AFTER)"},
		{[]string{"-never-park", "-park-after", "3"}, "", "-never-park and -park-after"},
		{nil, "OUTBOX_PER_AGGREGATE=maybe", "-per-aggregate (OUTBOX_PER_AGGREGATE) \"maybe\": want true or false"},
		{[]string{"-poll-interval", "-1s"}, "", "-poll-interval (OUTBOX_POLL_INTERVAL)"},
		{[]string{"-max-backoff", "1 minute"}, "", "-max-backoff (OUTBOX_MAX_BACKOFF)"},
		{nil, "OUTBOX_POLL_ONLY=yes please", "-poll-only (OUTBOX_POLL_ONLY)"},
		{[]string{"-retry-delay", "-1s"}, "", "-retry-delay (OUTBOX_RETRY_DELAY)"},
		{[]string{"-cloudevents-source", "/shop two"}, "", `-cloudevents-source (OUTBOX_CLOUDEVENTS_SOURCE) "/shop two": want a URI-reference`},
		{nil, "OUTBOX_CLOUDEVENTS_SOURCE=%zz", `-cloudevents-source (OUTBOX_CLOUDEVENTS_SOURCE) "%zz"`},
		{[]string{"-from", "yesterday"}, "", "-from (OUTBOX_REPLAY_FROM) \"yesterday\": want a time as RFC 3339"},
		{[]string{"-aggregate", "order/1"}, "", "-aggregate, -from, -to, -new-keys and -allow-dropped are for replay (-aggregate for forget-position too), not run"},
		{[]string{"-retry-delay", "10s", "-max-retry-delay", "5s"}, "", "-max-retry-delay 5s is below -retry-delay 10s"},
		{[]string{"-retry-delay", "1h"}, "", "-max-retry-delay 5m0s is below -retry-delay 1h0m0s"},
		{[]string{"-mode", "log", "-standbys", "s1"}, "", "-standbys is for -mode polling"},
		{[]string{"-standby-count", "1", "-standbys", "s1"}, "", "-standbys and -standby-count: wait by name or by number, not both"},
		{[]string{"-publish-without-standbys"}, "", "-publish-without-standbys needs -standby-count"},
		{[]string{"-standby-count", "-1"}, "", "-standby-count (OUTBOX_STANDBY_COUNT)"},
		{[]string{"-mode", "log", "-slot", "Bad-Slot"}, "", "-slot \"Bad-Slot\""},
		{[]string{"-mode", "log", "-publication", "pub lication"}, "", "-publication \"pub lication\""},
		{[]string{"-status-interval", "x"}, "", "-status-interval (OUTBOX_STATUS_INTERVAL)"},
		{[]string{"-mode", "push"}, "", "-mode \"push\""},
		{[]string{"-broker", "sqs"}, "", "-broker \"sqs\""},
		{[]string{"-retention", "-1s"}, "", "-retention (OUTBOX_RETENTION)"},
		{[]string{"-processed-retention", "a week"}, "", "-processed-retention (OUTBOX_PROCESSED_RETENTION)"},
		{[]string{"-check-every", "0s"}, "", "-check-every (OUTBOX_CHECK_EVERY)"},
		{[]string{"-stall-after", "0s"}, "", "-stall-after (OUTBOX_STALL_AFTER)"},
		{[]string{"-json=sometimes"}, "", "-json (OUTBOX_JSON)"},
		{[]string{"extra"}, "", "run takes no argument"},
		{[]string{"-database", "host=db.internal user=relay password=s3cret"}, "", "-database (OUTBOX_DATABASE_URL): the connection string holds a password"},
		{[]string{"-database", "postgres://relay:s3cret@db.internal/shop"}, "", "the connection string holds a password"},
		{[]string{"-database", "postgresql://db.internal/shop?password=s3cret"}, "", "the connection string holds a password"},
	})
	const db = "-database=host=127.0.0.1 port=1"
	for _, tc := range []struct {
		cmd  string
		args []string
		want string
	}{
		{"unpark", nil, "unpark takes the id of one parked row"},
		{"drop", []string{"seven"}, "drop \"seven\": not a row id"},
		{"unpark", []string{"0"}, "unpark \"0\": not a row id"},
		{"resend", nil, "unknown command \"resend\""},
		{"replay", nil, "replay needs -aggregate or -from"},
		{"replay", []string{"-aggregate", "order/1", "-to", "2026-12-05T09:00:00Z"}, "replay: -to needs a -from"},
		{"replay", []string{"-from", "2026-12-05T09:00:00Z", "-to", "2026-12-05T08:00:00Z"}, "replay: -from 2026-12-05T09:00:00Z is not before -to"},
		{"replay", []string{"-from", "2026-12-05"}, "-from (OUTBOX_REPLAY_FROM) \"2026-12-05\": want a time as RFC 3339"},
	} {
		if _, _, err := parse(tc.cmd, append([]string{db}, tc.args...)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %v = %v; want an error with %q", tc.cmd, tc.args, err, tc.want)
		}
	}
	if _, _, err := parse("run", nil); err == nil || !strings.Contains(err.Error(), "-database (OUTBOX_DATABASE_URL) is not set") {
		t.Errorf("run with no database = %v, want it named", err)
	}

	// Settings that agree reach the relays, from flags and the environment.
	t.Setenv("OUTBOX_PARK_AFTER", "7")
	t.Setenv("OUTBOX_POLL_ONLY", "true")
	c, _, err := parse("run", []string{db, "-batch-size", "250", "-pass-timeout", "3s", "-per-aggregate=false",
		"-poll-interval", "250ms", "-max-backoff", "5s", "-retry-delay", "2s", "-max-retry-delay", "1m", "-standbys", "s1, s2", "-slot", "relay_slot", "-status-interval", "2s", "-delete-delivered"})
	if err != nil {
		t.Fatal(err)
	}
	r, l := c.relay, c.log
	if r.BatchSize != 250 || r.PassTimeout != 3*time.Second || r.ParkAfter != 7 || !r.WholeTable || r.PollInterval != 250*time.Millisecond ||
		r.MaxBackoff != 5*time.Second || r.RetryDelay != 2*time.Second || r.MaxRetryDelay != time.Minute || !r.PollOnly || len(r.Standbys) != 2 || r.Standbys[1] != "s2" {
		t.Errorf("the polling relay's settings: %+v", r)
	}
	if l.Slot != "relay_slot" || l.StatusInterval != 2*time.Second || !l.DeleteDelivered || l.ParkAfter != 7 || l.MaxBackoff != 5*time.Second {
		t.Errorf("the log relay's settings: %+v", l)
	}

	// The process refuses a bad setting with exit code 2, before it opens
	// anything: the database's port 1 would answer nothing.
	var out, errOut bytes.Buffer
	if code := cli([]string{"run", db, "-pass-timeout", "1ns"}, &out, &errOut); code != 2 || !strings.Contains(errOut.String(), "-pass-timeout") {
		t.Errorf("run -pass-timeout 1ns exited %d: %s; want 2, the flag named", code, errOut.String())
	}
	t.Logf("run -pass-timeout 1ns: %s", strings.TrimSpace(errOut.String()))
}

// The first SIGTERM stops the command, which gets its time to finish; a
// second ends the process at once, exit code 1, saying what it leaves; and
// so does the end of -grace. (Caught: a second SIGTERM swallowed, the
// process waiting on a relay that did not stop.)
func TestASecondSignalOrTheGraceEndsTheProcessAtOnce(t *testing.T) {
	blocked := make(chan struct{})
	defer close(blocked)
	started := make(chan struct{}, 1)
	runCommand = func(ctx context.Context, _ string, _ config, _ []string, _ io.Writer, _ *slog.Logger) error {
		started <- struct{}{} // cli listens for the signals before it runs the command
		<-ctx.Done()
		<-blocked // a relay that does not finish
		return nil
	}
	defer func() { runCommand = run }()
	for _, tc := range []struct {
		name    string
		grace   string
		signals int
		want    string
	}{
		{"a second signal", "1h", 2, "second signal: exiting at once"},
		{"the grace", "1ms", 1, "grace period over: exiting at once"},
	} {
		errOut := &syncBuffer{}
		code := make(chan int, 1)
		go func() {
			code <- cli([]string{"run", "-database=host=127.0.0.1", "-grace", tc.grace}, io.Discard, errOut)
		}()
		<-started
		for i := range tc.signals {
			if i > 0 {
				waitFor(t, "the first signal heard", func() bool { return strings.Contains(errOut.String(), "outbox-relay: stopping") })
			}
			if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case c := <-code:
			if c != 1 || !strings.Contains(errOut.String(), tc.want) || !strings.Contains(errOut.String(), "consumers drop the copies by key") {
				t.Errorf("%s: exit %d, said:\n%s\nwant 1 and %q", tc.name, c, errOut, tc.want)
			}
		case <-time.After(generous):
			t.Fatalf("%s: cli did not return", tc.name)
		}
	}
}

// outbox-relay -h, -help, --help and help print the usage, and nothing
// else, on the standard output and exit 0. (Caught: they said
// "-database (OUTBOX_DATABASE_URL) is not set" first, and "unknown command".)
func TestHelpPrintsTheUsageAlone(t *testing.T) {
	for _, arg := range []string{"-h", "-help", "--help", "help"} {
		var out, errOut bytes.Buffer
		if code := cli([]string{arg}, &out, &errOut); code != 0 || !strings.Contains(out.String(), "usage: outbox-relay") || errOut.Len() != 0 {
			t.Errorf("outbox-relay %s: exit %d, out %q, errors %q; want 0, the usage, no error", arg, code, out.String(), errOut.String())
		}
	}
}

// Each part asks only what the options it runs with need, and grants and
// check both ask it (part): a relay waits for no standby, so it needs no
// pg_read_all_stats, and a polling deployment's migrator makes no
// publication, so it needs no CREATE on the database nor REPLICATION;
// each is asked only with the option that needs it. (Caught: a migrator
// asked CREATE on the database for a publication a polling relay never
// reads.)
func TestEachPartAsksOnlyWhatItsOptionsNeed(t *testing.T) {
	const db = "-database=host=127.0.0.1 port=1"
	for _, c := range []struct {
		cmd  string
		args []string
		want []string // the privileges beside the role's, as String says them
	}{
		{"check", nil, nil},
		{"check", []string{"-standby-count", "1"}, []string{"membership of pg_read_all_stats"}},
		{"check", []string{"-standbys", "s1"}, []string{"membership of pg_read_all_stats"}},
		{"check", []string{"-mode", "log"}, nil},
		{"check", []string{"-mode", "log", "-standby-count", "1"}, []string{"membership of pg_read_all_stats"}},
		{"check", []string{"-role", "migrator"}, nil},
		{"check", []string{"-role", "migrator", "-mode", "log"}, []string{"CREATE on the database", "the REPLICATION attribute"}},
		{"check", []string{"-processed-retention", "169h"}, []string{"SELECT on table processed_messages", "DELETE on table processed_messages",
			"SELECT on table aggregate_positions", "DELETE on table aggregate_positions"}},
	} {
		cfg, _, err := parse(c.cmd, append([]string{db}, c.args...))
		if err != nil {
			t.Fatalf("%s %v: %v", c.cmd, c.args, err)
		}
		_, extra := part(cfg)
		var got []string
		for _, p := range extra {
			got = append(got, p.String())
		}
		if strings.Join(got, "; ") != strings.Join(c.want, "; ") {
			t.Errorf("%s %v asks beside its role's: %q; want %q", c.cmd, c.args, got, c.want)
		}
	}
}
