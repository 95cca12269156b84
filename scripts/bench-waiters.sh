#!/usr/bin/env bash
# What executors long-polling for work cost (`idem-lab bench-waiters`, SPEC §4
# "Waiting executors at fleet scale"): 1,000 waiters on one `idem serve` and
# spread over two, against the local PostgreSQL, each run on a scratch
# database of its own (created here, dropped on exit). Prints each run's table.
#
# usage: scripts/bench-waiters.sh [extra bench-waiters flags, e.g. --seconds 60 --submits 1000]
# env: PG (default postgres://postgres@127.0.0.1:5432, the server to use),
#      IDEM_BIN (default: builds `cargo build --release -p idem -p idem-harness
#      --bin idem --bin idem-lab` and uses $CARGO_TARGET_DIR/release/idem, or
#      target/release/idem), IDEM_LAB_BIN (default: idem-lab beside IDEM_BIN),
#      WAITERS (default 1000), INSTANCES (default "1 2": the runs, in order)
set -euo pipefail
cd "$(dirname "$0")/.."
PG=${PG:-postgres://postgres@127.0.0.1:5432}
WAITERS=${WAITERS:-1000}
INSTANCES=${INSTANCES:-"1 2"}
if [ -z "${IDEM_BIN:-}" ]; then
  cargo build --release -p idem -p idem-harness --bin idem --bin idem-lab --quiet
  IDEM_BIN="${CARGO_TARGET_DIR:-./target}/release/idem"
fi
IDEM_LAB_BIN=${IDEM_LAB_BIN:-$(dirname "$IDEM_BIN")/idem-lab}
# A connection per waiter in the bench, and as many in the servers.
hard=$(ulimit -Hn)
if [ "$hard" = unlimited ] || [ "$hard" -gt 65536 ]; then hard=65536; fi
ulimit -n "$hard"
DB="idem_bench_waiters_$$"
cleanup() { psql "$PG/postgres" -qXc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true; }
trap cleanup EXIT
for n in $INSTANCES; do
  cleanup
  psql "$PG/postgres" -qXc "CREATE DATABASE $DB" >/dev/null
  echo "== $WAITERS waiters, $n instance(s), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  "$IDEM_LAB_BIN" bench-waiters --idem-bin "$IDEM_BIN" --store "$PG/$DB" --waiters "$WAITERS" --instances "$n" "$@"
  echo
done
