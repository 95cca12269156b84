#!/usr/bin/env bash
# The console's browser tests, as CI runs them: the suite in headless Debian Chromium
# (/usr/bin/chromium, env CHROMIUM) against real `idem serve` processes (env IDEM_BIN, default
# target/debug/idem under the repository root): the whole suite on SQLite (a temporary file
# per test file) and, side by side with it, its store-dependent files (1, 2, 4) on PostgreSQL:
# a scratch database created on the server of IDEM_TEST_PG_URL (default
# postgres://postgres@127.0.0.1:5432/test) and dropped at the end.
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

node_pids=()
cleanup() {
  local status=$?
  # Each test run is a process group of its own (setsid): it goes, with the servers it started.
  for pid in "${node_pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
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

# PostgreSQL: the URL's server, a database of this run's own.
pg_store="${pg_url%%\?*}"
pg_query=""
[ "$pg_store" = "$pg_url" ] || pg_query="?${pg_url#*\?}"
pg_store="${pg_store%/*}/$pg_db$pg_query"
psql "$pg_url" -qtAc "CREATE DATABASE $pg_db" >/dev/null
pg_created=1

# The two runs go side by side (each test file waits mostly on its browser and server: one run
# leaves most of two cores idle), each a `node --test` of its own in a process group of its own,
# its report (spec reporter: each test with its time) kept apart and printed when both ended.
# In the background and waited for, so that a signal to this script runs its cleanup at once.
start=$SECONDS
run() { # NAME STORE FILE...
  local name=$1 store=$2
  shift 2
  (
    begin=$SECONDS
    IDEM_CONSOLE_STORE="$store" node --test --test-reporter=spec --test-timeout=60000 "$@" && rc=0 || rc=$?
    echo "== $name: $((SECONDS - begin)) s, exit $rc"
    exit "$rc"
  ) >"$work/$name.log" 2>&1
}
echo "== console browser tests on SQLite and on PostgreSQL (database $pg_db), side by side ($IDEM_BIN)"
setsid bash -c "$(declare -f run); work='$work'; run SQLite '' test/*.test.js" &
node_pids+=("$!")
# What the store decides: search, sessions and their revocation, CSRF and tenant scoping, the
# live page woken by PostgreSQL's notifications. (Escaping and accessibility are about the
# HTML, which is the same on both stores: SQLite's run covers them.)
setsid bash -c "$(declare -f run); work='$work'; run PostgreSQL '$pg_store' test/1-*.test.js test/2-*.test.js test/4-*.test.js" &
node_pids+=("$!")
failed=""
wait "${node_pids[0]}" || failed="$failed SQLite"
wait "${node_pids[1]}" || failed="$failed PostgreSQL"
node_pids=()
for name in SQLite PostgreSQL; do
  echo "== console browser tests on $name"
  cat "$work/$name.log"
done
echo "console browser tests: $((SECONDS - start)) s in all"
if [ -n "$failed" ]; then
  echo "console browser tests failed on:$failed" >&2
  exit 1
fi
