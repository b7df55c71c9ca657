package postgres

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
)

// A Role is a part a database role plays for an outbox, and so the
// privileges it needs ([Privileges]): give each process a role of
// its own with those and nothing more.
type Role string

const (
	// RoleProducer writes events ([Outbox.Write]) in the service's own
	// transactions, and checks the schema at start-up.
	RoleProducer Role = "producer"
	// RoleRelay runs [OutboxRelay]: it claims, marks, records failures,
	// parks, releases scheduled rows, and deletes the sent rows past
	// their retention ([Outbox.DeleteSent]).
	RoleRelay Role = "relay"
	// RoleLogRelay runs [LogRelay]: what RoleRelay needs, for its marks and
	// its sweep, and the REPLICATION attribute, to read its slot.
	RoleLogRelay Role = "log-relay"
	// RoleConsumer checks the consumer's schema ([Outbox.CheckConsumerSchema]),
	// applies messages ([Outbox.ApplyOnce], [Outbox.ApplyBatch]) and
	// forgets old keys and positions ([Outbox.ForgetProcessed],
	// [Outbox.ForgetPosition]), in the consumer's database.
	RoleConsumer Role = "consumer"
	// RoleConsumerMigrator runs [Outbox.MigrateConsumer] in a consumer's
	// database: it creates the consumer's tables, and so owns them.
	RoleConsumerMigrator Role = "consumer-migrator"
	// RoleOperator reads the lag and the parked rows, unparks, drops,
	// replays and cleans up ([Outbox.ReadLag], [Outbox.Unpark],
	// [Outbox.DropParked], [Outbox.Replay], [Outbox.DeleteSent]).
	RoleOperator Role = "operator"
	// RoleMigrator runs [Outbox.Migrate]: it creates the outbox's tables in
	// the schema, and so owns them. For a log relay it also creates the
	// publication and the slot ([Outbox.CreateLogSlot]), with
	// [PrivilegePublication] and [PrivilegeReplication] beside.
	// Run every migration as the same role: only a table's owner may
	// alter it.
	RoleMigrator Role = "migrator"
)

// Roles are the roles, in the order a deployment sets them up.
var Roles = []Role{RoleMigrator, RoleProducer, RoleRelay, RoleLogRelay, RoleConsumerMigrator, RoleConsumer, RoleOperator}

// ErrPrivilege is wrapped by [Outbox.CheckPrivileges]'s error when the
// session's role lacks a privilege its part needs; the error names each.
var ErrPrivilege = errors.New("postgres: the role lacks a privilege")

// A Privilege is one thing a role needs of the database: a privilege on
// an object (INSERT on a table, USAGE on a schema), a role's attribute
// (REPLICATION), or membership of a predefined role (pg_read_all_stats).
type Privilege struct {
	// Privilege is what is granted: a privilege's keyword ("SELECT"),
	// "REPLICATION", or the predefined role's name.
	Privilege string
	// On is what it is granted on: "TABLE", "SCHEMA", "DATABASE",
	// "ATTRIBUTE" (a role's attribute) or "ROLE" (a membership).
	On string
	// Object is the table's name (unqualified: the schema is the one its
	// tables are in), "" for the schema or the database.
	Object string
	// Columns, if not empty, limits a table's privilege to these columns.
	Columns []string
	// For says what needs it.
	For string
}

// String is the privilege as an operator reads it: "UPDATE on table
// outbox", "SELECT (id) on table outbox", "the REPLICATION attribute".
func (p Privilege) String() string {
	what := p.Privilege
	if len(p.Columns) > 0 {
		what += " (" + strings.Join(p.Columns, ", ") + ")"
	}
	switch p.On {
	case "TABLE":
		return what + " on table " + p.Object
	case "SCHEMA":
		return what + " on the schema"
	case "DATABASE":
		return what + " on the database"
	case "ATTRIBUTE":
		return "the " + what + " attribute"
	default:
		return "membership of " + what
	}
}

// PrivilegeReadAllStats is what a relay with standbys to wait for
// ([RelayConfig.Standbys]) needs beside its role's privileges: to read the
// standbys' positions in pg_stat_replication.
var PrivilegeReadAllStats = Privilege{Privilege: "pg_read_all_stats", On: "ROLE",
	For: "to read the standbys' positions in pg_stat_replication (RelayConfig.Standbys)"}

// PrivilegePublication is what the migrator of a log relay's database
// needs beside its role's privileges: to create the publication the log
// relay reads ([Outbox.CreateLogSlot] makes it, and migration 4 where the
// migrator may). A polling deployment's migrator needs none.
var PrivilegePublication = Privilege{Privilege: "CREATE", On: "DATABASE",
	For: "to create the log relay's publication (CreateLogSlot)"}

// PrivilegeReplication is what a role that creates or drops the log
// relay's slot ([Outbox.CreateLogSlot]) or reads it needs.
var PrivilegeReplication = Privilege{Privilege: "REPLICATION", On: "ATTRIBUTE",
	For: "to create, read and drop a replication slot"}

// Privileges returns what role needs of the database for the outbox table
// named table ("" for [DefaultTable], as [Config.Table]) and nothing more,
// each privilege with what needs it: the grants [GrantStatements] writes
// out and [Outbox.CheckPrivileges] checks. A bad table name or an unknown
// role is refused with an error wrapping [ErrInvalidConfig].
func Privileges(tableName string, role Role) ([]Privilege, error) {
	t := cmp.Or(tableName, DefaultTable)
	if !tableNames.MatchString(t) {
		return nil, fmt.Errorf("%w: table %q: want lowercase letters, digits and '_', starting with a letter, at most 40 bytes", ErrInvalidConfig, t)
	}
	usage := Privilege{Privilege: "USAGE", On: "SCHEMA", For: "to reach the outbox's tables"}
	schema := Privilege{Privilege: "SELECT", On: "TABLE", Object: t + "_migrations", For: "to check the schema's version (CheckSchema)"}
	table := func(priv, object, why string, columns ...string) Privilege {
		return Privilege{Privilege: priv, On: "TABLE", Object: object, Columns: columns, For: why}
	}
	switch role {
	case RoleProducer:
		return []Privilege{usage, schema,
			table("INSERT", t, "to write an event"),
			table("SELECT", t, "to return the id of the row written", "id"),
			table("SELECT", t+"_awake", "to notify only while no relay is awake (its trigger)"),
		}, nil
	case RoleRelay, RoleLogRelay:
		p := []Privilege{usage, schema,
			table("SELECT", t, "to claim the rows to publish"),
			table("UPDATE", t, "to lock what it claims, mark it sent, record a failure, park, and release what was scheduled"),
			table("DELETE", t, "to delete the sent rows past their retention"),
			table("SELECT", t+"_cleanup", "to read what cleanup cut"),
			table("UPDATE", t+"_cleanup", "to record what cleanup cut"),
			table("SELECT", t+"_awake", "to release scheduled rows (its trigger reads whether a relay is awake)"),
		}
		if role == RoleRelay {
			p = append(p, table("UPDATE", t+"_awake", "to say whether it is awake, so that producers notify only while none is"))
		}
		if role == RoleLogRelay {
			p = append(p, PrivilegeReplication)
		}
		return p, nil
	case RoleConsumer:
		return []Privilege{usage,
			table("SELECT", "outbox_consumer_migrations", "to check the consumer's schema (CheckConsumerSchema)"),
			table("SELECT", "processed_messages", "to return the keys it records anew"),
			table("INSERT", "processed_messages", "to record the key of what it applies"),
			table("DELETE", "processed_messages", "to forget old keys (ForgetProcessed)"),
			table("SELECT", "aggregate_positions", "to read an aggregate's position"),
			table("INSERT", "aggregate_positions", "to record an aggregate's first position"),
			table("UPDATE", "aggregate_positions", "to move and lock an aggregate's position"),
			table("DELETE", "aggregate_positions", "to forget closed positions (ForgetProcessed, ForgetPosition)"),
		}, nil
	case RoleOperator:
		return []Privilege{usage, schema,
			table("SELECT", t, "to read the lag and the parked rows"),
			table("UPDATE", t, "to unpark and replay"),
			table("DELETE", t, "to drop a parked row and clean up"),
			table("SELECT", t+"_cleanup", "to know what cleanup cut before a replay"),
			table("UPDATE", t+"_cleanup", "to record what cleanup cut"),
		}, nil
	case RoleConsumerMigrator:
		return []Privilege{
			{Privilege: "USAGE", On: "SCHEMA", For: "to reach the schema"},
			{Privilege: "CREATE", On: "SCHEMA", For: "to create the consumer's tables and indexes"},
		}, nil
	case RoleMigrator:
		return []Privilege{
			{Privilege: "USAGE", On: "SCHEMA", For: "to reach the schema"},
			{Privilege: "CREATE", On: "SCHEMA", For: "to create the outbox's tables, indexes and functions"},
		}, nil
	}
	return nil, fmt.Errorf("%w: role %q: want one of %v", ErrInvalidConfig, role, Roles)
}

// GrantStatements writes out the statements that give grantee the
// privileges privs, on the tables of schema in database (the database
// only for a privilege on it): one GRANT for each object, its
// privileges in one list. The names must be ones PostgreSQL takes unquoted
// (letters, digits and '_'); any other is refused with an error wrapping
// [ErrInvalidConfig], as is a privilege on the database with no database
// named.
func GrantStatements(privs []Privilege, schema, database, grantee string) ([]string, error) {
	for _, n := range []struct{ what, name string }{{"schema", schema}, {"grantee", grantee}} {
		if !identifier(n.name) {
			return nil, fmt.Errorf("%w: %s %q is not a name of letters, digits and '_'", ErrInvalidConfig, n.what, n.name)
		}
	}
	var out []string
	var order []string
	onTable := map[string][]string{}
	for _, p := range privs {
		switch p.On {
		case "TABLE":
			what := p.Privilege
			if len(p.Columns) > 0 {
				what += " (" + strings.Join(p.Columns, ", ") + ")"
			}
			if _, ok := onTable[p.Object]; !ok {
				order = append(order, p.Object)
			}
			onTable[p.Object] = append(onTable[p.Object], what)
		case "SCHEMA":
			out = append(out, "GRANT "+p.Privilege+" ON SCHEMA "+schema+" TO "+grantee)
		case "DATABASE":
			if !identifier(database) {
				return nil, fmt.Errorf("%w: database %q is not a name of letters, digits and '_'", ErrInvalidConfig, database)
			}
			out = append(out, "GRANT "+p.Privilege+" ON DATABASE "+database+" TO "+grantee)
		case "ATTRIBUTE":
			out = append(out, "ALTER ROLE "+grantee+" "+p.Privilege)
		case "ROLE":
			out = append(out, "GRANT "+p.Privilege+" TO "+grantee)
		default:
			return nil, fmt.Errorf("%w: privilege on %q", ErrInvalidConfig, p.On)
		}
	}
	for _, t := range order {
		out = append(out, "GRANT "+strings.Join(onTable[t], ", ")+" ON TABLE "+schema+"."+t+" TO "+grantee)
	}
	return out, nil
}

// CheckPrivileges reports, with an error wrapping [ErrPrivilege] that names
// each, the privileges of role ([Privileges]) and of extra that
// the session's role lacks: those the catalog says it lacks, directly or
// through a role it belongs to (a superuser lacks none). A table is looked
// for in the session's search_path, as the outbox's statements look for
// it; one found in none of its schemas is named, with an error wrapping
// [ErrSchemaVersion], to be made by [Outbox.Migrate]. It reads the catalog
// only, and takes no lock.
func (o *Outbox[T]) CheckPrivileges(ctx context.Context, role Role, extra ...Privilege) error {
	if err := o.usable(); err != nil {
		return err
	}
	privs, err := Privileges(o.t.table, role)
	if err != nil {
		return err
	}
	privs = append(privs, extra...)
	var user, path string
	if err := o.db.queryRow(ctx, `SELECT current_user, current_setting('search_path')`).Scan(&user, &path); err != nil {
		return fmt.Errorf("postgres: check privileges: %w", err)
	}
	schemas := searchPath(path, user)
	var missing, absent []string
	for _, p := range privs {
		ok, found, err := o.holds(ctx, p, schemas)
		switch {
		case err != nil:
			return fmt.Errorf("postgres: check %s: %w", p, err)
		case !found:
			if !slices.Contains(absent, p.Object) {
				absent = append(absent, p.Object)
			}
		case !ok:
			missing = append(missing, p.String()+", "+p.For)
		}
	}
	var errs []error
	if len(absent) > 0 {
		errs = append(errs, fmt.Errorf("%w: no table %s in the search path (%s): run migrate first",
			ErrSchemaVersion, strings.Join(absent, ", "), strings.Join(schemas, ", ")))
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		errs = append(errs, fmt.Errorf("%w: %s, as the outbox's %s, lacks %s", ErrPrivilege, user, role, strings.Join(missing, "; ")))
	}
	return errors.Join(errs...)
}

// searchPath is the schemas a search_path setting names, in order, with
// "$user" as user.
func searchPath(setting, user string) []string {
	var out []string
	for _, s := range strings.Split(setting, ",") {
		s = strings.TrimSpace(s)
		if strings.HasPrefix(s, `"`) && strings.HasSuffix(s, `"`) && len(s) >= 2 {
			s = strings.ReplaceAll(s[1:len(s)-1], `""`, `"`)
		}
		if s == "$user" {
			s = user
		}
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

// holds reports whether the session's role holds p, and for a table
// whether it exists. The schema is the one of the outbox's table if it
// exists, else the first of the search path that exists: where Migrate
// creates it.
func (o *Outbox[T]) holds(ctx context.Context, p Privilege, schemas []string) (ok, found bool, err error) {
	found = true
	switch p.On {
	case "TABLE":
		var col any
		if len(p.Columns) > 0 {
			col = p.Columns[0] // one column is all the package asks for
		}
		// The catalog is read by every role, so a table is found whether or
		// not the role may use its schema; the schema is checked apart.
		err = o.db.queryRow(ctx, `
WITH t AS (
    SELECT c.oid FROM unnest($4::text[]) WITH ORDINALITY AS s(name, n)
    JOIN pg_namespace ns ON ns.nspname = s.name
    JOIN pg_class c ON c.relnamespace = ns.oid AND c.relname = $1
    ORDER BY s.n LIMIT 1)
SELECT EXISTS (SELECT 1 FROM t),
       COALESCE((SELECT CASE WHEN $3::text IS NULL THEN has_table_privilege(oid, $2)
                             ELSE has_column_privilege(oid, $3::text, $2) END FROM t), false)`,
			p.Object, p.Privilege, col, schemas).Scan(&found, &ok)
	case "SCHEMA":
		err = o.db.queryRow(ctx, `
SELECT COALESCE((
    SELECT has_schema_privilege(ns.oid, $2)
    FROM unnest($3::text[]) WITH ORDINALITY AS s(name, n)
    JOIN pg_namespace ns ON ns.nspname = s.name
    ORDER BY EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = ns.oid AND c.relname = $1) DESC, s.n
    LIMIT 1), false)`, o.t.table, p.Privilege, schemas).Scan(&ok)
	case "DATABASE":
		err = o.db.queryRow(ctx, `SELECT has_database_privilege(current_database(), $1)`, p.Privilege).Scan(&ok)
	case "ATTRIBUTE":
		if p.Privilege != "REPLICATION" {
			return false, true, fmt.Errorf("%w: attribute %q", ErrInvalidConfig, p.Privilege)
		}
		err = o.db.queryRow(ctx, `SELECT rolsuper OR rolreplication FROM pg_roles WHERE rolname = current_user`).Scan(&ok)
	case "ROLE":
		err = o.db.queryRow(ctx, `SELECT pg_has_role(current_user, $1, 'USAGE')`, p.Privilege).Scan(&ok)
	default:
		return false, true, fmt.Errorf("%w: privilege on %q", ErrInvalidConfig, p.On)
	}
	return ok, found, err
}
