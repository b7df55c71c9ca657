package main

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// config is the relay's configuration, as flags and the environment give
// it, every value checked by parse before anything connects.
type config struct {
	database, mode, broker, table, http string
	json                                bool // the operator commands' output, one JSON value a line

	relay postgres.RelayConfig    // polling mode's settings (the loggers and meters are run's)
	log   postgres.LogRelayConfig // log mode's

	brokers     map[string]brokerFlags // every registered broker's flags, by name
	cloudEvents string                 // the CloudEvents source the publisher sets; none if empty

	retention, cleanupEvery time.Duration
	sweepEvery              time.Duration // log mode: how often unsent rows older than it are swept; 0 never
	processedRetention      time.Duration
	checkEvery              time.Duration // how often run checks the database and the broker again, for /readyz
	stallAfter              time.Duration // /healthz fails when rows wait and no pass succeeded for this long
	grace                   time.Duration // after SIGTERM, how long the relay has to finish before it exits at once

	replay postgres.Replay // the replay command's rows

	role            string // grants and check: the part whose privileges; "" for the one -mode runs
	consumer        string // forget-position: the consumer whose position
	grantee, schema string // grants: the role granted to, and the schema of the outbox's tables
}

// commands are the relay's commands and how many arguments each takes.
var commands = map[string]int{"migrate": 0, "migrate-database": 0, "migrate-consumer": 0, "provision": 0, "grants": 0, "forget-position": 0,
	"run": 0, "check": 0, "lag": 0, "parked": 0, "unpark": 1, "drop": 1, "replay": 0}

// settings registers flags whose default is an environment variable's
// value, and converts each once the flags are parsed, so that a bad value
// from either is refused with the flag's name, the variable's, and why.
type settings struct {
	fs       *flag.FlagSet
	converts []func() error
}

func (s *settings) env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}

// add registers -name (or the variable env) as a string, and convert for
// it.
func (s *settings) add(name, env, def, usage string, convert func(string) error) {
	raw := s.fs.String(name, s.env(env, def), usage+" ("+env+")")
	s.converts = append(s.converts, func() error {
		if err := convert(*raw); err != nil {
			return fmt.Errorf("-%s (%s) %q: %w", name, env, *raw, err)
		}
		return nil
	})
}

func (s *settings) str(p *string, name, env, def, usage string) {
	s.add(name, env, def, usage, func(v string) error { *p = v; return nil })
}

func (s *settings) boolean(p *bool, name, env string, def bool, usage string) {
	raw := s.env(env, strconv.FormatBool(def))
	s.fs.Var(boolFlag{&raw}, name, usage+" ("+env+")")
	s.converts = append(s.converts, func() (err error) {
		if *p, err = strconv.ParseBool(raw); err != nil {
			return fmt.Errorf("-%s (%s) %q: want true or false", name, env, raw)
		}
		return nil
	})
}

// boolFlag is a boolean flag, given alone (-poll-only) or with a value
// (-poll-only=false), whose value is checked with the others.
type boolFlag struct{ raw *string }

func (b boolFlag) String() string {
	if b.raw == nil {
		return ""
	}
	return *b.raw
}
func (b boolFlag) Set(v string) error { *b.raw = v; return nil }
func (b boolFlag) IsBoolFlag() bool   { return true }

// integer is a whole number from min to max.
func (s *settings) integer(p *int, name, env string, def, min, max int, usage string) {
	s.add(name, env, strconv.Itoa(def), usage, func(v string) (err error) {
		if *p, err = strconv.Atoi(v); err != nil || *p < min || *p > max {
			return fmt.Errorf("want a whole number from %d to %d", min, max)
		}
		return nil
	})
}

// duration is a duration of at least min.
// instant is a time given as RFC 3339 (2026-12-05T09:00:00Z), or none.
func (s *settings) instant(p *time.Time, name, env, usage string) {
	s.add(name, env, "", usage, func(v string) (err error) {
		if v == "" {
			return nil
		}
		if *p, err = time.Parse(time.RFC3339Nano, v); err != nil {
			return errors.New("want a time as RFC 3339, such as 2026-12-05T09:00:00Z")
		}
		return nil
	})
}

func (s *settings) duration(p *time.Duration, name, env, def string, min time.Duration, usage string) {
	s.add(name, env, def, usage, func(v string) (err error) {
		if *p, err = time.ParseDuration(v); err != nil || *p < min {
			return fmt.Errorf("want a duration (such as 5s or 1m) of at least %v", min)
		}
		return nil
	})
}

// secret reads a secret from the file named by -name (or the variable
// fileEnv), or else from the variable env: never from a flag's value,
// which every user of the machine sees in the process list. Neither it
// nor the file's name is ever printed.
func (s *settings) secret(p *string, name, fileEnv, env, usage string) {
	s.add(name, fileEnv, "", usage+"; or set "+env, func(file string) error {
		if file == "" {
			*p = os.Getenv(env)
			return nil
		}
		b, err := os.ReadFile(file)
		if err != nil {
			return errors.New("cannot read the file")
		}
		*p = strings.TrimRight(string(b), "\r\n")
		if *p == "" {
			return errors.New("the file is empty")
		}
		return nil
	})
}

// readable is a file that exists and can be read, or "".
func readable(p *string) func(string) error {
	return func(v string) error {
		*p = v
		if v == "" {
			return nil
		}
		f, err := os.Open(v)
		if err != nil {
			return errors.New("cannot read the file")
		}
		return f.Close()
	}
}

// parse reads cmd's flags from args, each defaulting to its environment
// variable, and checks every one; the error joins every fault found.
func parse(cmd string, args []string) (config, []string, error) {
	var c config
	s := &settings{fs: flag.NewFlagSet(cmd, flag.ContinueOnError)}
	s.str(&c.database, "database", "OUTBOX_DATABASE_URL", "", "PostgreSQL connection string, pgx's (TLS, several hosts), with no password in it: PGPASSWORD or a .pgpass file holds it")
	s.str(&c.broker, "broker", "OUTBOX_BROKER", brokerKinds[0].name, "the broker: "+brokerNames())
	s.str(&c.mode, "mode", "OUTBOX_MODE", "polling", "polling (OutboxRelay) or log (LogRelay: logical decoding)")
	s.str(&c.table, "table", "OUTBOX_TABLE", postgres.DefaultTable, "the outbox table")
	s.str(&c.http, "http", "OUTBOX_HTTP_ADDR", "", "address of /healthz, /readyz and /metrics; none if empty")
	s.boolean(&c.json, "json", "OUTBOX_JSON", false, "the commands' output as JSON, one value a line")
	s.str(&c.cloudEvents, "cloudevents-source", "OUTBOX_CLOUDEVENTS_SOURCE", "", "publish each message as a CloudEvent too (binary mode), with this source, a URI-reference such as /shop; none if empty")

	// The polling relay's settings; 0 means the package's default.
	r := &c.relay
	s.integer(&r.BatchSize, "batch-size", "OUTBOX_BATCH_SIZE", 0, 0, postgres.MaxBatchSize, "rows a pass claims at most; 0 for 100")
	s.duration(&r.PassTimeout, "pass-timeout", "OUTBOX_PASS_TIMEOUT", "0s", 0, "how long a pass may hold its claim; 0 for 5s")
	s.integer(&r.ParkAfter, "park-after", "OUTBOX_PARK_AFTER", 0, 0, 1_000_000, "rejections after which a row is parked; 0 for 5 (both modes)")
	s.boolean(&r.NeverPark, "never-park", "OUTBOX_NEVER_PARK", false, "park nothing: a row the broker refuses holds up the rows behind it (both modes)")
	perAggregate := true
	s.boolean(&perAggregate, "per-aggregate", "OUTBOX_PER_AGGREGATE", true, "keep order per aggregate, so that one aggregate's failure holds up only its own rows; false: the whole table in id order, stopping at the first failure")
	s.duration(&r.PollInterval, "poll-interval", "OUTBOX_POLL_INTERVAL", "0s", 0, "how often a pass runs with no NOTIFY; 0 for 1s")
	s.duration(&r.MaxBackoff, "max-backoff", "OUTBOX_MAX_BACKOFF", "0s", 0, "the longest wait after failed passes; 0 for 30s (both modes)")
	s.duration(&r.RetryDelay, "retry-delay", "OUTBOX_RETRY_DELAY", "0s", 0, "polling mode, order per aggregate: a refused row's wait before its second attempt, doubling after; 0 for 1s")
	s.duration(&r.MaxRetryDelay, "max-retry-delay", "OUTBOX_MAX_RETRY_DELAY", "0s", 0, "polling mode: the longest wait of a refused row; 0 for 5m")
	s.boolean(&r.PollOnly, "poll-only", "OUTBOX_POLL_ONLY", false, "no LISTEN: poll only (behind PgBouncer in transaction mode)")
	var standbys string
	s.str(&standbys, "standbys", "OUTBOX_STANDBYS", "", "polling mode: the standbys' application_names, comma-separated, that a pass waits for before it publishes")
	s.integer(&r.StandbyCount, "standby-count", "OUTBOX_STANDBY_COUNT", 0, 0, 64, "how many of the primary's standbys, whichever stream from it, have the rows' commits before the relay publishes them (both modes; instead of -standbys: it follows a promotion)")
	s.boolean(&r.PublishWithoutStandbys, "publish-without-standbys", "OUTBOX_PUBLISH_WITHOUT_STANDBYS", false, "with -standby-count: publish, logged, while the primary has no standby at all (just promoted); false holds the events until one streams")

	// The log relay's.
	l := &c.log
	s.str(&l.Slot, "slot", "OUTBOX_SLOT", "", "log mode: the replication slot, unique on the server; empty for the table's name")
	s.str(&l.Publication, "publication", "OUTBOX_PUBLICATION", "", "log mode: the publication; empty for the table's name")
	s.duration(&l.StatusInterval, "status-interval", "OUTBOX_STATUS_INTERVAL", "0s", 0, "log mode: how often the relay confirms its position to the server; 0 for the default")
	s.boolean(&l.DeleteDelivered, "delete-delivered", "OUTBOX_DELETE_DELIVERED", false, "log mode: delete each row the broker accepted instead of marking it sent: the cheapest mark, and nothing left to replay")

	// Each broker's, registered by its own file.
	c.brokers = map[string]brokerFlags{}
	for _, k := range brokerKinds {
		c.brokers[k.name] = k.flags(s)
	}

	// Cleanup, sweeping and health.
	s.duration(&c.retention, "retention", "OUTBOX_RETENTION", "168h", 0, "how long a sent row is kept; 0 keeps them")
	s.duration(&c.cleanupEvery, "cleanup-every", "OUTBOX_CLEANUP_EVERY", "1m", time.Millisecond, "how often cleanup runs")
	s.duration(&c.processedRetention, "processed-retention", "OUTBOX_PROCESSED_RETENTION", "0s", 0, "how long consumers' keys in this database are kept; 0 leaves them (on nats: at least the stream's max age)")
	s.duration(&c.sweepEvery, "sweep-every", "OUTBOX_SWEEP_EVERY", "1m", 0, "log mode: how often a polling pass publishes the unsent rows the log cannot carry (put back with unpark, or older than the slot), once the oldest waited that long; 0 never")
	s.duration(&c.checkEvery, "check-every", "OUTBOX_CHECK_EVERY", "5s", 10*time.Millisecond, "how often run checks the database, the schema and the broker again, for /readyz")
	s.duration(&c.stallAfter, "stall-after", "OUTBOX_STALL_AFTER", "5m", time.Second, "/healthz fails when rows wait and no pass succeeded for this long")
	s.duration(&c.grace, "grace", "OUTBOX_GRACE", "30s", 0, "after SIGTERM, how long the relay has to mark what the broker accepted before it exits at once")

	// The replay command's.
	s.str(&c.replay.Aggregate, "aggregate", "OUTBOX_REPLAY_AGGREGATE", "", "replay: the aggregate whose sent events go again, such as order/17")
	s.instant(&c.replay.From, "from", "OUTBOX_REPLAY_FROM", "replay: the sent rows written at or after this time (RFC 3339) go again")
	s.instant(&c.replay.To, "to", "OUTBOX_REPLAY_TO", "replay: and before this time (RFC 3339); none: up to now")
	s.boolean(&c.replay.NewKeys, "new-keys", "OUTBOX_REPLAY_NEW_KEYS", false, "replay: with new keys, so that consumers that remember the old ones apply them again")
	s.boolean(&c.replay.AllowDropped, "allow-dropped", "OUTBOX_REPLAY_ALLOW_DROPPED", false, "replay: put back, with their old keys, rows the broker took within its duplicate window, which it then drops as copies")

	s.str(&c.consumer, "consumer", "OUTBOX_CONSUMER", "", "forget-position: the consumer (postgres.Config.Consumer; empty for the default one) whose position of -aggregate is forgotten")

	// Roles.
	s.str(&c.role, "role", "OUTBOX_ROLE", "", "grants, check: whose privileges: migrator, producer, relay, log-relay, consumer-migrator, consumer or operator; empty for the relay -mode runs")
	s.str(&c.grantee, "grantee", "OUTBOX_GRANTEE", "", "grants: the database role to grant them to")
	s.str(&c.schema, "schema", "OUTBOX_SCHEMA", "public", "grants: the schema of the outbox's tables")

	if err := s.fs.Parse(args); err != nil {
		return c, nil, err
	}
	var errs []error
	for _, convert := range s.converts {
		errs = append(errs, convert())
	}
	c.relay.WholeTable = !perAggregate
	c.log.ParkAfter, c.log.NeverPark, c.log.MaxBackoff = c.relay.ParkAfter, c.relay.NeverPark, c.relay.MaxBackoff
	c.log.StandbyCount, c.log.PublishWithoutStandbys = c.relay.StandbyCount, c.relay.PublishWithoutStandbys
	for name := range strings.SplitSeq(standbys, ",") {
		if name = strings.TrimSpace(name); name != "" {
			c.relay.Standbys = append(c.relay.Standbys, name)
		}
	}
	errs = append(errs, c.check(cmd, s.fs)...)
	return c, s.fs.Args(), errors.Join(errs...)
}

// holdsPassword reports whether conn, a PostgreSQL connection string as a
// URL (postgres://user:password@host/db) or as keywords (password=…),
// holds a password.
func holdsPassword(conn string) bool {
	if strings.HasPrefix(conn, "postgres://") || strings.HasPrefix(conn, "postgresql://") {
		u, err := url.Parse(conn)
		if err != nil {
			return false // pgx refuses it, and says why
		}
		_, has := u.User.Password()
		return has || u.Query().Has("password")
	}
	return passwordKeyword.MatchString(conn)
}

// passwordKeyword finds the keyword password in a connection string of
// keywords and values.
var passwordKeyword = regexp.MustCompile(`(^|\s)password\s*=`)

// check is what no single flag can say alone.
func (c *config) check(cmd string, fs *flag.FlagSet) []error {
	var errs []error
	if c.database == "" && cmd != "provision" && cmd != "grants" {
		errs = append(errs, errors.New("-database (OUTBOX_DATABASE_URL) is not set"))
	} else if holdsPassword(c.database) {
		errs = append(errs, errors.New("-database (OUTBOX_DATABASE_URL): the connection string holds a password; give it in PGPASSWORD or a .pgpass file (PGPASSFILE), which are never printed"))
	}
	if c.mode != "polling" && c.mode != "log" {
		errs = append(errs, fmt.Errorf("-mode %q: want polling or log", c.mode))
	}
	if _, ok := c.brokers[c.broker]; !ok {
		errs = append(errs, fmt.Errorf("-broker %q: want %s", c.broker, brokerNames()))
	}
	if len(c.relay.Standbys) > 0 && c.mode == "log" {
		errs = append(errs, errors.New("-standbys is for -mode polling: the log relay waits for standbys by number (-standby-count)"))
	}
	if len(c.relay.Standbys) > 0 && c.relay.StandbyCount > 0 {
		errs = append(errs, errors.New("-standbys and -standby-count: wait by name or by number, not both"))
	}
	if c.relay.PublishWithoutStandbys && c.relay.StandbyCount == 0 {
		errs = append(errs, errors.New("-publish-without-standbys needs -standby-count"))
	}
	if t := c.relay.PassTimeout; t > 0 && t < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("-pass-timeout %v: at least 10ms, or 0 for %v", t, postgres.DefaultPassTimeout))
	}
	if r, m := cmp.Or(c.relay.RetryDelay, postgres.DefaultRetryDelay), cmp.Or(c.relay.MaxRetryDelay, postgres.DefaultMaxRetryDelay); m < r {
		errs = append(errs, fmt.Errorf("-max-retry-delay %v is below -retry-delay %v (0 stands for %v and %v)", m, r,
			postgres.DefaultMaxRetryDelay, postgres.DefaultRetryDelay))
	}
	if c.relay.NeverPark && c.relay.ParkAfter > 0 {
		errs = append(errs, errors.New("-never-park and -park-after: give one"))
	}
	for _, n := range []struct{ flag, v string }{{"-slot", c.log.Slot}, {"-publication", c.log.Publication}} {
		if n.v != "" && !slotName.MatchString(n.v) {
			errs = append(errs, fmt.Errorf("%s %q: want lowercase letters, digits and '_', at most 63 bytes", n.flag, n.v))
		}
	}
	if b, ok := c.brokers[c.broker]; ok {
		errs = append(errs, b.check()...)
	}
	if _, err := url.Parse(c.cloudEvents); err != nil || strings.ContainsFunc(c.cloudEvents, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
		errs = append(errs, fmt.Errorf("-cloudevents-source (OUTBOX_CLOUDEVENTS_SOURCE) %q: want a URI-reference, such as /shop", c.cloudEvents))
	}
	r := c.replay
	if given := r.Aggregate != "" || !r.From.IsZero() || !r.To.IsZero() || r.NewKeys || r.AllowDropped; given && cmd != "replay" && cmd != "forget-position" {
		errs = append(errs, fmt.Errorf("-aggregate, -from, -to, -new-keys and -allow-dropped are for replay (-aggregate for forget-position too), not %s", cmd))
	}
	if c.consumer != "" && cmd != "forget-position" {
		errs = append(errs, fmt.Errorf("-consumer is for forget-position, not %s", cmd))
	}
	if cmd == "forget-position" && (r.Aggregate == "" || !r.From.IsZero() || !r.To.IsZero() || r.NewKeys || r.AllowDropped) {
		errs = append(errs, errors.New("forget-position takes -aggregate (and -consumer), and no other of replay's flags"))
	}
	if r.NewKeys && r.AllowDropped {
		errs = append(errs, errors.New("replay: -new-keys and -allow-dropped: give one (with new keys the broker drops nothing)"))
	}
	if cmd == "replay" {
		switch {
		case r.Aggregate == "" && r.From.IsZero():
			errs = append(errs, errors.New("replay needs -aggregate or -from: the whole outbox is not replayed"))
		case r.From.IsZero() && !r.To.IsZero():
			errs = append(errs, errors.New("replay: -to needs a -from"))
		case !r.To.IsZero() && !r.From.Before(r.To):
			errs = append(errs, fmt.Errorf("replay: -from %s is not before -to %s", r.From.Format(time.RFC3339Nano), r.To.Format(time.RFC3339Nano)))
		}
	}
	if c.role != "" && !slices.Contains(postgres.Roles, postgres.Role(c.role)) {
		errs = append(errs, fmt.Errorf("-role %q: want one of %v", c.role, postgres.Roles))
	}
	if c.role != "" && cmd != "grants" && cmd != "check" {
		errs = append(errs, fmt.Errorf("-role is for grants and check, not %s", cmd))
	}
	if cmd == "grants" {
		if !roleName.MatchString(c.grantee) {
			errs = append(errs, fmt.Errorf("grants: -grantee %q: want the role's name, lowercase letters, digits and '_'", c.grantee))
		}
		if !roleName.MatchString(c.schema) {
			errs = append(errs, fmt.Errorf("grants: -schema %q: want lowercase letters, digits and '_'", c.schema))
		}
	}
	want, known := commands[cmd]
	switch {
	case !known:
		errs = append(errs, fmt.Errorf("unknown command %q: want migrate, migrate-database, migrate-consumer, provision, grants, run, check, lag, parked, unpark ID, drop ID, replay or forget-position", cmd))
	case fs.NArg() != want && want == 0:
		errs = append(errs, fmt.Errorf("%s takes no argument, got %q", cmd, fs.Args()))
	case fs.NArg() != want:
		errs = append(errs, fmt.Errorf("%s takes the id of one parked row", cmd))
	case want == 1:
		if id, err := strconv.ParseInt(fs.Arg(0), 10, 64); err != nil || id < 1 {
			errs = append(errs, fmt.Errorf("%s %q: not a row id", cmd, fs.Arg(0)))
		}
	}
	return errs
}

// slotName is what PostgreSQL allows in a replication slot's or a
// publication's name, as this module makes them.
var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// roleName is a role's or a schema's name as grants writes it, unquoted.
var roleName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)
