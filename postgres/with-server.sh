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
# Runs COMMAND with OUTBOX_POSTGRES_URL naming
# that server, then stops the server and removes the folder, whether COMMAND
# passed, failed or was interrupted. Exits with COMMAND's status.
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

dir=$(mktemp -d "${TMPDIR:-/tmp}/outbox-postgres.XXXXXX") || exit 1
# server runs one of the server's programs from the server's own folder: the
# postgres user may not be allowed into the folder make runs in, and the
# programs complain when they cannot change back to it.
server() { (cd "$dir" && "${as[@]}" "$@"); }
cleanup() {
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

if ! server "$bindir/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1; then
	cat "$dir/initdb.log" >&2
	exit 1
fi
if ! server "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
	-o "-k $dir -c listen_addresses='' -c fsync=${OUTBOX_POSTGRES_FSYNC:-off} -c full_page_writes=${OUTBOX_POSTGRES_FSYNC:-off} ${OUTBOX_POSTGRES_OPTS:-}" start >/dev/null; then
	cat "$dir/server.log" >&2
	exit 1
fi

export OUTBOX_POSTGRES_URL="host=$dir user=postgres dbname=postgres sslmode=disable"
"$@"
