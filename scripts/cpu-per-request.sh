#!/usr/bin/env bash
# CPU time per request of each process on the machine: the `idem serve`
# process, the load generator (`idem-lab bench --url`) and every PostgreSQL backend.
# Shows where a throughput ceiling comes from when everything shares two cores.
#
# usage: scripts/cpu-per-request.sh STORE MODE COUNT
#   STORE  sqlite:///tmp/x/idem.db or postgres://postgres@127.0.0.1:5432/idem_cpu
#   MODE   new | replay | conflict | storm | mixed
#   COUNT  requests measured (after 2,000 warm-up requests)
# env: IDEM_BIN (default $CARGO_TARGET_DIR or target, then dist/idem: the packaged build, `cargo build --profile dist`), IDEM_LAB_BIN (default: idem-lab beside IDEM_BIN, `cargo build --profile dist -p idem-harness --bin idem-lab`), PORT (default 18787)
set -euo pipefail
STORE=$1; MODE=$2; COUNT=$3
BIN=${IDEM_BIN:-"${CARGO_TARGET_DIR:-$(dirname "$0")/../target}/dist/idem"}
LAB=${IDEM_LAB_BIN:-$(dirname "$BIN")/idem-lab}
PORT=${PORT:-18787}
KEY=$("$BIN" keys create --tenant bench --role client --store "$STORE" 2>/dev/null)
"$BIN" serve --store "$STORE" --listen "127.0.0.1:$PORT" >/dev/null 2>&1 &
SPID=$!
trap 'kill $SPID 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
# PostgreSQL's share: the backends of STORE's database plus the server's own
# background processes (WAL writer, checkpointer …), not other databases' backends.
DB=${STORE##*/}; DB=${DB%%\?*}
pg_ticks() {
  local s=0 t
  for p in $(pgrep -u postgres -f "postgres: (.* $DB |walwriter|checkpointer|background writer|autovacuum|logical replication)" || true); do
    t=$(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0); s=$((s + t))
  done
  echo "$s"
}
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat; }
"$LAB" bench --url "http://127.0.0.1:$PORT" --api-key "$KEY" --mode "$MODE" --count 2000 --no-baseline >/dev/null 2>&1
s0=$(ticks $SPID); p0=$(pg_ticks); read -r b0 i0 < <(busy)
TIMES=$(mktemp)
/usr/bin/time -f "%U %S" -o "$TIMES" "$LAB" bench --url "http://127.0.0.1:$PORT" --api-key "$KEY" \
  --mode "$MODE" --count "$COUNT" --no-baseline | grep -E "^$MODE"
s1=$(ticks $SPID); p1=$(pg_ticks); read -r b1 i1 < <(busy)
read -r bu bs < "$TIMES"; rm -f "$TIMES"
# A SQLite store has no PostgreSQL share (the local cluster's own background
# work is not idem's): -1 prints as "-".
case $STORE in postgres://*|postgresql://*) pg_delta=$((p1 - p0)) ;; *) pg_delta=-1 ;; esac
python3 - "$COUNT" "$(getconf CLK_TCK)" "$((s1 - s0))" "$pg_delta" "$bu" "$bs" "$((b1 - b0))" "$((i1 - i0))" <<'PY'
import sys
n, hz = int(sys.argv[1]), int(sys.argv[2])
srv, pg = int(sys.argv[3]), int(sys.argv[4])
gen = float(sys.argv[5]) + float(sys.argv[6])
busy, idle = int(sys.argv[7]), int(sys.argv[8])
us = lambda ticks: ticks / hz / n * 1e6
print(f"CPU per request: idem serve {us(srv):.0f} us, load generator {gen / n * 1e6:.0f} us, "
      f"postgres {'-' if pg < 0 else f'{us(pg):.0f} us'}; machine busy {100 * busy / (busy + idle):.0f}%")
PY
