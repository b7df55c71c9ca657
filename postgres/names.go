package postgres

import (
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"
)

// tables is one outbox table of a database and everything named after
// it: the table, its indexes (<table>_unsent, <table>_parked,
// <table>_unsent_by_aggregate, <table>_held, <table>_scheduled), its checks
// <table>_payload_or_body and <table>_headers_strings, its NOTIFY triggers and function
// (<table>_notify, <table>_released), the channel they notify and Run listens on
// (<table>), the publication of its inserts for the log relay
// (<table>_inserts), the log relay's default slot (<table>), the record of
// its migrations (<table>_migrations), and of what cleanup cut
// (<table>_cleanup). The consumer's tables,
// processed_messages and aggregate_positions, are not the outbox's: every
// outbox of the database shares them, each consumer's records under its
// name (Config.Consumer). A tables is immutable.
type tables struct {
	table      string
	sql        statements
	migrations *MigrationSet
}

// statements are the package's statements with an outbox's names written
// in.
type statements struct {
	insertRow, insertTracedRow, insertFullRow      string
	claimRows, claimRuns, checkRuns, markSent      string
	recordFailure, readLag, deleteSent, listParked string
	unpark, dropParked                             string
	replayCheck, replayRows, replayNotify          string
}

// defaultTables is the outbox table named outbox: the one the package's
// functions use.
var defaultTables = func() *tables {
	o, err := newTables(DefaultTable)
	if err != nil {
		panic(err) // a bug of this package
	}
	return o
}()

// newTables returns the tables of the outbox table named table: a name
// of lowercase letters, digits and '_' that starts with a letter, at most
// 40 bytes so that the names made from it fit PostgreSQL's 63. Any other
// name is refused with an error wrapping ErrInvalidConfig.
func newTables(table string) (*tables, error) {
	if !tableNames.MatchString(table) {
		return nil, fmt.Errorf("%w: Config.Table %q: want lowercase letters, digits and '_', starting with a letter, at most 40 bytes", ErrInvalidConfig, table)
	}
	o := &tables{table: table}
	o.sql = statements{
		insertRow: o.named(insertRow), insertTracedRow: o.named(insertTracedRow), insertFullRow: o.named(insertFullRow),
		claimRows: o.named(claimRows), claimRuns: o.named(claimRuns), checkRuns: o.named(checkRuns),
		markSent: o.named(markSent), recordFailure: o.named(recordFailure),
		readLag: o.named(readLag), deleteSent: o.named(deleteSent), listParked: o.named(listParked),
		unpark: o.named(unpark), dropParked: o.named(dropParked),
		replayCheck: o.named(replayCheck), replayRows: o.named(replayRows), replayNotify: o.named(replayNotify),
	}
	lock := int64(7_468_327_001) // the default outbox's, as before names were chosen
	if table != "outbox" {
		h := fnv.New64a()
		h.Write([]byte(table))
		lock = int64(h.Sum64() >> 1)
	}
	migs, err := loadMigrations(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	for i := range migs {
		migs[i].sql = o.named(migs[i].sql)
	}
	o.migrations = &MigrationSet{table: o.named("outbox_migrations"), lock: lock, migrations: migs}
	return o, nil
}

var tableNames = regexp.MustCompile(`^[a-z][a-z0-9_]{0,39}$`)

// outboxName matches the names the package's SQL gives the default
// outbox's objects, each a whole word.
var outboxName = regexp.MustCompile(`\boutbox(_unsent_by_aggregate|_unsent|_parked|_held|_scheduled|_released|_payload_or_body|_headers_strings|_notify|_awake|_inserts|_migrations|_cleanup)?\b`)

// named is query with the default outbox's names replaced by o's: the
// table, its indexes, trigger, function, channel, publication and record
// of migrations. A name followed by a dot (the custom settings
// outbox.wal_flushed, the message prefix outbox.flush) is not one of them.
func (o *tables) named(query string) string {
	if o.table == "outbox" {
		return query
	}
	var b strings.Builder
	last := 0
	for _, m := range outboxName.FindAllStringIndex(query, -1) {
		if m[1] < len(query) && query[m[1]] == '.' {
			continue
		}
		b.WriteString(query[last:m[0]])
		b.WriteString(o.table + strings.TrimPrefix(query[m[0]:m[1]], "outbox"))
		last = m[1]
	}
	b.WriteString(query[last:])
	return b.String()
}
