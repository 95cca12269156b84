#!/usr/bin/env bash
# The console's browser tests, as CI runs them: the suite in headless Debian Chromium
# (/usr/bin/chromium, env CHROMIUM) against real `idem serve` processes (env IDEM_BIN, default
# target/debug/idem under the repository root): the whole suite on SQLite (a temporary file
# per test file), then its store-dependent files (1, 2, 4, 6, 8) on PostgreSQL: a scratch database
# created on the server of IDEM_TEST_PG_URL (default postgres://postgres@127.0.0.1:5432/test)
# and dropped at the end.
#
# Expects `npm ci` to have run in tests/console (.ci/run does it; this script does it when
# node_modules is missing). Whatever the outcome, it stops every process the tests started
# (their pids are noted in a temporary directory), drops the scratch database and removes its
# temporary files.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
repo="$(cd "$here/../.." && pwd)"
export IDEM_BIN="${IDEM_BIN:-$repo/target/debug/idem}"
pg_url="${IDEM_TEST_PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
[ -x "$IDEM_BIN" ] || { echo "no idem binary at $IDEM_BIN (set IDEM_BIN, or cargo build -p idem)" >&2; exit 1; }
[ -x "${CHROMIUM:-/usr/bin/chromium}" ] || { echo "no Chromium at ${CHROMIUM:-/usr/bin/chromium} (apt-get install chromium)" >&2; exit 1; }

work="$(mktemp -d "${TMPDIR:-/tmp}/idem-console-ci.XXXXXX")"
mkdir "$work/pids" "$work/tmp"
pg_db="idem_console_ci_$$"
pg_created=""

node_pid=""
cleanup() {
  local status=$?
  # The test run is a process group of its own (setsid): it goes, with the servers it started.
  [ -z "$node_pid" ] || kill -KILL -- "-$node_pid" 2>/dev/null || true
  # Each file is named KIND-PID: a Chromium is the leader of its own process group
  # (Playwright starts it detached), an idem server is one process.
  for f in "$work"/pids/*; do
    [ -e "$f" ] || continue
    name="$(basename "$f")"
    pid="${name#*-}"
    case "$name" in
      chromium-*) kill -KILL -- "-$pid" 2>/dev/null || true ;;
      *) kill -KILL "$pid" 2>/dev/null || true ;;
    esac
  done
  if [ -n "$pg_created" ]; then
    psql "$pg_url" -qtAc "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" >/dev/null || status=1
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cd "$here"
[ -d node_modules ] || npm ci --no-audit --no-fund
export IDEM_CONSOLE_PIDS="$work/pids"
# Playwright's Chromium profiles and the servers' SQLite files go here, removed at the end.
export TMPDIR="$work/tmp"

# One `node --test` run over the given files (spec reporter: each test with its time).
# In the background and waited for, so that a signal to this script runs its cleanup at once.
suite() {
  setsid node --test --test-reporter=spec --test-timeout=60000 "$@" &
  node_pid=$!
  local rc=0
  wait "$node_pid" || rc=$?
  node_pid=""
  return "$rc"
}
failed=""

start=$SECONDS
echo "== console browser tests on SQLite ($IDEM_BIN)"
IDEM_CONSOLE_STORE="" suite test/*.test.js || failed="$failed SQLite"
sqlite_s=$((SECONDS - start))

# PostgreSQL: the URL's server, a database of this run's own.
pg_store="${pg_url%%\?*}"
pg_query=""
[ "$pg_store" = "$pg_url" ] || pg_query="?${pg_url#*\?}"
pg_store="${pg_store%/*}/$pg_db$pg_query"
psql "$pg_url" -qtAc "CREATE DATABASE $pg_db" >/dev/null
pg_created=1
start=$SECONDS
echo "== console browser tests on PostgreSQL (database $pg_db)"
# What the store decides: search, sessions and their revocation, CSRF and tenant scoping, the
# live page woken by PostgreSQL's notifications, sign-in and the sessions it keeps or replaces,
# the verdict read from the attempts' evidence and the counts the search reads.
# (Escaping, hidden characters and accessibility are about the HTML, which is the same on both
# stores: SQLite's run covers them.)
IDEM_CONSOLE_STORE="$pg_store" suite test/1-*.test.js test/2-*.test.js test/4-*.test.js test/6-*.test.js test/8-*.test.js || failed="$failed PostgreSQL"
pg_s=$((SECONDS - start))
echo "console browser tests: SQLite ${sqlite_s} s, PostgreSQL ${pg_s} s"
if [ -n "$failed" ]; then
  echo "console browser tests failed on:$failed" >&2
  exit 1
fi
