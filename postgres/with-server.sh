#!/usr/bin/env bash
# Usage: with-server.sh COMMAND [ARG...]
#
# Starts a throwaway PostgreSQL from the installed server programs: initdb into
# a fresh temporary folder, the server listening only on a Unix socket in that
# folder (no TCP port), fsync and full_page_writes off (OUTBOX_POSTGRES_FSYNC=on
# turns both on, to measure what a durable commit costs). With fsync off an
# operating-system crash can corrupt the whole cluster, not only lose recent
# commits: for a throwaway server only. OUTBOX_POSTGRES_OPTS adds options of
# the postgres command (make measure-postgres: -c autovacuum_naptime=1s).
# wal_level is logical, for the log relay's replication slots (LogRelay); the
# default, replica, refuses to create one.
# Runs COMMAND with OUTBOX_POSTGRES_URL naming
# that server, then stops the server and removes the folder, whether COMMAND
# passed, failed or was interrupted. Exits with COMMAND's status.
#
# OUTBOX_POSTGRES_DATA=FOLDER keeps the server's files instead (make shop
# SHOP_DATA=...): the cluster is made there the first time, started from
# there after, with fsync on, and at the end stopped cleanly and left in
# place.
#
# PostgreSQL refuses to run as root; run as root, the server runs as the
# postgres user. It never touches a server it did not start.
set -u

bindir=$(pg_config --bindir 2>/dev/null || true)
for prog in initdb pg_ctl postgres; do
	if [ -z "$bindir" ] || [ ! -x "$bindir/$prog" ]; then
		if [ -z "$bindir" ]; then
			echo "make postgres: pg_config was not found, so neither were PostgreSQL's server programs (initdb, pg_ctl, postgres)." >&2
		else
			echo "make postgres: PostgreSQL's server program $prog is not in $bindir (what pg_config --bindir names)." >&2
		fi
		echo "Install PostgreSQL 15 or later; on Debian or Ubuntu: apt-get install postgresql" >&2
		exit 2
	fi
done

as=()
if [ "$(id -u)" = 0 ]; then
	if ! id postgres >/dev/null 2>&1; then
		echo "make postgres: running as root, but there is no postgres user to run the server as" >&2
		exit 2
	fi
	as=(runuser -u postgres --)
fi

keep=${OUTBOX_POSTGRES_DATA:-}
if [ -n "$keep" ]; then
	mkdir -p "$keep" && dir=$(cd "$keep" && pwd) || exit 1
else
	dir=$(mktemp -d "${TMPDIR:-/tmp}/outbox-postgres.XXXXXX") || exit 1
fi
# server runs one of the server's programs from the server's own folder: the
# postgres user may not be allowed into the folder make runs in, and the
# programs complain when they cannot change back to it.
server() { (cd "$dir" && "${as[@]}" "$@"); }
# started is set once this script's pg_ctl start succeeded: in a kept
# folder the exit trap stops only a server this script started, never one
# it found running (a second make shop on the same SHOP_DATA folder, whose
# start would fail on the first one's lock file). A temporary folder is
# this script's own, and so is any server in it.
started=
cleanup() {
	if [ -n "$keep" ]; then
		[ -n "$started" ] && server "$bindir/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1
		return
	fi
	if [ -f "$dir/data/postmaster.pid" ]; then
		server "$bindir/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1
	fi
	rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
chmod 755 "$dir"
[ ${#as[@]} -gt 0 ] && chown postgres "$dir"

# A throwaway server runs without fsync; a kept one with it, since its files
# must survive what happens to the machine.
fsync=${OUTBOX_POSTGRES_FSYNC:-off}
[ -n "$keep" ] && fsync=${OUTBOX_POSTGRES_FSYNC:-on}

if [ -n "$keep" ] && server "$bindir/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
	echo "with-server.sh: a server already runs on $dir/data (another make shop?); it is left as it is" >&2
	exit 1
fi
if [ -f "$dir/data/PG_VERSION" ]; then
	: # a kept cluster, made by an earlier run
elif ! server "$bindir/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1; then
	cat "$dir/initdb.log" >&2
	exit 1
fi
if ! server "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
	-o "-k $dir -c listen_addresses='' -c fsync=$fsync -c full_page_writes=$fsync -c wal_level=logical ${OUTBOX_POSTGRES_OPTS:-}" start >/dev/null; then
	cat "$dir/server.log" >&2
	exit 1
fi
started=1

export OUTBOX_POSTGRES_URL="host=$dir user=postgres dbname=postgres sslmode=disable"
"$@"
