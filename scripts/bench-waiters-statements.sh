#!/usr/bin/env bash
# Which statements `idem-lab bench-waiters` makes PostgreSQL run in each of its
# phases: a scratch cluster with pg_stat_statements (initdb in a temp dir, a free
# port, removed on exit), the bench against it, pg_stat_statements read at every
# progress line of the bench; prints each phase's statements by calls.
#
# usage: scripts/bench-waiters-statements.sh [bench-waiters flags, e.g. --instances 2 --submits 1000 --seconds 10]
# env: IDEM_BIN (default target/release/idem), IDEM_LAB_BIN (default: idem-lab beside it),
#      PG_BIN (default: the newest /usr/lib/postgresql/*/bin). Runs initdb as the
#      postgres user when run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
IDEM_BIN=${IDEM_BIN:-target/release/idem}
IDEM_LAB_BIN=${IDEM_LAB_BIN:-$(dirname "$IDEM_BIN")/idem-lab}
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)}
dir=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
cleanup() {
  as_pg "'$PG_BIN/pg_ctl' -D '$dir/data' -m immediate stop" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; fi
as_pg "'$PG_BIN/initdb' -D '$dir/data' -A trust -U postgres" >/dev/null
as_pg "'$PG_BIN/pg_ctl' -D '$dir/data' -l '$dir/log' -w -o \"-p $port -k '$dir' -c listen_addresses=127.0.0.1 -c max_connections=400 -c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all\" start" >/dev/null
pg="postgres://postgres@127.0.0.1:$port"
psql "$pg/postgres" -qXc "CREATE EXTENSION pg_stat_statements" -c "CREATE DATABASE bench" \
  -c "CREATE TABLE snaps (phase int, queryid bigint, query text, calls bigint)" \
  -c "CREATE TABLE phases (phase int, line text)"
snap() {
  psql "$pg/postgres" -qX -v phase="$1" -v line="$2" >/dev/null <<'SQL'
INSERT INTO phases VALUES (:phase, :'line');
INSERT INTO snaps SELECT :phase, queryid, query, calls
  FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = 'bench';
SQL
}
# A connection per waiter in the bench, and as many in the servers.
hard=$(ulimit -Hn)
if [ "$hard" = unlimited ] || [ "$hard" -gt 65536 ]; then hard=65536; fi
ulimit -n "$hard"
n=0
snap 0 start
while IFS= read -r line; do
  echo "$line" >&2
  case "$line" in bench-waiters:*) n=$((n + 1)); snap "$n" "$line" ;; esac
done < <("$IDEM_LAB_BIN" bench-waiters --idem-bin "$IDEM_BIN" --store "$pg/bench" --waiters 1000 "$@" 2>&1 >"$dir/out")
snap $((n + 1)) end
cat "$dir/out"
for p in $(seq 1 $((n + 1))); do
  psql "$pg/postgres" -qXAt -c "SELECT '== ' || line FROM phases WHERE phase = $((p - 1))"
  psql "$pg/postgres" -qXAt -F ' | ' -c "
    SELECT b.calls - coalesce(a.calls, 0), left(regexp_replace(b.query, '\s+', ' ', 'g'), 120)
    FROM snaps b LEFT JOIN snaps a ON a.phase = $((p - 1)) AND a.queryid = b.queryid AND a.query = b.query
    WHERE b.phase = $p AND b.calls - coalesce(a.calls, 0) > 0 ORDER BY 1 DESC"
done
