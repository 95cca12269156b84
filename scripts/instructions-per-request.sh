#!/usr/bin/env bash
# Instructions per request that `idem serve` executes in user space, counted by
# valgrind's callgrind: unlike req/s or CPU time, the count does not move with
# the machine's load, so two builds can be compared in one try. Every thread
# of the server is counted; the kernel's share (sockets, fsync) is not. Under
# valgrind the CPU has no SHA extensions, so SHA-256 counts in software: fine
# for comparing builds, not for absolute costs.
#
# usage: scripts/instructions-per-request.sh STORE MODE COUNT
#   STORE  sqlite:///tmp/x/idem.db (a fresh file) or postgres://…/db (a fresh database)
#   MODE   new | replay | conflict | storm | mixed
#   COUNT  requests measured (after 500 warm-up requests), 8 clients
# env: IDEM_BIN (default $CARGO_TARGET_DIR or target, then dist/idem: the packaged build, `cargo build --profile dist`), IDEM_LAB_BIN (default: idem-lab beside IDEM_BIN, `cargo build --profile dist -p idem-harness --bin idem-lab`), PORT (default 18789)
set -euo pipefail
STORE=$1; MODE=$2; COUNT=$3
BIN=${IDEM_BIN:-"${CARGO_TARGET_DIR:-$(dirname "$0")/../target}/dist/idem"}
LAB=${IDEM_LAB_BIN:-$(dirname "$BIN")/idem-lab}
PORT=${PORT:-18789}
OUT=$(mktemp -d)
trap 'kill "$SPID" 2>/dev/null || true; rm -rf "$OUT"' EXIT
KEY=$("$BIN" keys create --tenant bench --role client --store "$STORE" 2>/dev/null)
valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.%p" \
  "$BIN" serve --store "$STORE" --listen "127.0.0.1:$PORT" >/dev/null 2>"$OUT/valgrind.log" &
SPID=$!
for _ in $(seq 1 300); do curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break; sleep 0.2; done
load() {
  "$LAB" bench --url "http://127.0.0.1:$PORT" --api-key "$KEY" --mode "$MODE" --count "$1" \
    --concurrency 8 --no-baseline >/dev/null 2>&1
}
load 500
callgrind_control -z "$SPID" >/dev/null 2>&1   # counts start here …
load "$COUNT"
callgrind_control -d "$SPID" >/dev/null 2>&1   # … and are written here (the file ending .1)
total=$(awk '/^summary:/ {print $2}' "$OUT"/cg.*.1)
echo "$MODE: $((total / COUNT)) instructions per request (idem serve, user space, $COUNT requests)"
