#!/usr/bin/env bash
# A database failover under the chaos workload (docs/deployment.md, "Failover").
#
# Each run: a primary and a streaming standby made from it with pg_basebackup -R (two throwaway
# clusters on 127.0.0.1, under a temp dir); two `idem serve` instances (started by `idem-lab chaos`)
# on the multi-host URL postgres://…@127.0.0.1:P,127.0.0.1:S/idem?target_session_attrs=read-write;
# half-way through the operations the primary is killed with SIGKILL (postmaster and every
# backend), and after --delay-ms the standby is promoted (pg_ctl promote -w) and its inherited
# synchronous_standby_names cleared, as a failover manager does when no standby is left. Then
# `idem-lab chaos` checks every SPEC §2 invariant, that every acknowledged submit and report is in the
# promoted database, and that 5xx answers came only between the kill and the promotion plus
# --bound-ms.
#
#   scripts/failover.sh                 synchronous standby, 1 run (CI)
#   scripts/failover.sh --runs 10       … 10 runs, and the distribution of the 5xx window
#   scripts/failover.sh --async --runs 10
#                                       asynchronous standby: acknowledged writes lost are counted
#
# Options: --ops N (chaos operations per run, default 1500), --seed S (first seed, default 1; run i
# uses S+i), --delay-ms N (kill to promote, default 1000), --bound-ms N (default 5000).
# The idem binary: $IDEM_BIN, else $CARGO_TARGET_DIR/debug/idem (or target/debug/idem); idem-lab:
# $IDEM_LAB_BIN, else idem-lab beside that idem.
# PostgreSQL's binaries: $PG_BIN, else the newest /usr/lib/postgresql/*/bin; as root they run as
# `postgres` (runuser). Exit status: 1 when a synchronous run has a violation.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=1 ops=1500 seed=1 delay_ms=1000 bound_ms=5000 async=""
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --ops) ops=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --delay-ms) delay_ms=$2; shift 2 ;;
    --bound-ms) bound_ms=$2; shift 2 ;;
    --async) async=1; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

idem=${IDEM_BIN:-${CARGO_TARGET_DIR:-target}/debug/idem}
[ -x "$idem" ] || { echo "no idem binary at $idem (cargo build -p idem, or set IDEM_BIN)" >&2; exit 2; }
lab=${IDEM_LAB_BIN:-$(dirname "$idem")/idem-lab}
[ -x "$lab" ] || { echo "no idem-lab binary at $lab (cargo build -p idem-harness --bin idem-lab, or set IDEM_LAB_BIN)" >&2; exit 2; }
pg_bin=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
[ -x "$pg_bin/initdb" ] || { echo "no PostgreSQL binaries (set PG_BIN)" >&2; exit 2; }
as_pg=()
[ "$(id -u)" = 0 ] && as_pg=(runuser -u postgres --)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

work=$(mktemp -d "${TMPDIR:-/tmp}/idem-failover-XXXXXX")
chmod 755 "$work"
cleanup() {
  for d in "$work"/run-*/p "$work"/run-*/s; do
    [ -f "$d/postmaster.pid" ] && "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$d" -m immediate -w stop >/dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

results="$work/results"
: > "$results"
failed=0
for i in $(seq 1 "$runs"); do
  run="$work/run-$i"
  mkdir -p "$run"
  [ ${#as_pg[@]} -gt 0 ] && chown postgres:postgres "$run"
  p1=$(free_port) p2=$(free_port)
  while [ "$p2" = "$p1" ]; do p2=$(free_port); done
  "${as_pg[@]}" "$pg_bin/initdb" -D "$run/p" -U postgres --auth=trust -E UTF8 --no-sync --no-instructions >/dev/null
  cat >> "$run/p/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $p1
unix_socket_directories = '$run'
max_connections = 200
shared_buffers = 64MB
CONF
  printf 'local all all trust\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n' > "$run/p/pg_hba.conf"
  "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$run/p" -l "$run/p.log" -w start >/dev/null
  psql=(psql -X -q -h 127.0.0.1 -U postgres -d postgres -v ON_ERROR_STOP=1)
  if [ -z "$async" ]; then
    # In postgresql.auto.conf, which the base backup copies: the standby inherits it.
    "${psql[@]}" -p "$p1" -c "ALTER SYSTEM SET synchronous_standby_names = '*'" -c "SELECT pg_reload_conf()" >/dev/null
  fi
  "${as_pg[@]}" "$pg_bin/pg_basebackup" -h 127.0.0.1 -p "$p1" -U postgres -D "$run/s" -R -X stream --no-sync
  printf "port = %s\n" "$p2" >> "$run/s/postgresql.conf"
  "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$run/s" -l "$run/s.log" -w start >/dev/null
  want=$([ -z "$async" ] && echo sync || echo async)
  for _ in $(seq 1 100); do
    [ "$("${psql[@]}" -p "$p1" -Atc "SELECT sync_state FROM pg_stat_replication")" = "$want" ] && break
    sleep 0.1
  done
  "${psql[@]}" -p "$p1" -c "CREATE DATABASE idem"

  cat > "$run/kill.sh" <<KILL
#!/bin/sh
pm=\$(head -n 1 "$run/p/postmaster.pid")
kill -9 \$pm \$(ps -o pid= --ppid \$pm)
KILL
  cat > "$run/promote.sh" <<PROMOTE
#!/bin/sh
set -e
${as_pg[*]} "$pg_bin/pg_ctl" -D "$run/s" -w promote >/dev/null
psql -X -q -h 127.0.0.1 -p $p2 -U postgres -d postgres -c "ALTER SYSTEM SET synchronous_standby_names = ''" -c "SELECT pg_reload_conf()" >/dev/null
PROMOTE
  chmod +x "$run/kill.sh" "$run/promote.sh"

  url="postgres://postgres@127.0.0.1:$p1,127.0.0.1:$p2/idem?target_session_attrs=read-write"
  s=$((seed + i - 1))
  set +e
  "$lab" chaos --idem-bin "$idem" --seed "$s" --ops "$ops" --store "$url" --json \
    --failover-kill "$run/kill.sh" --failover-promote "$run/promote.sh" \
    --failover-delay-ms "$delay_ms" --failover-bound-ms "$bound_ms" ${async:+--failover-async} \
    > "$run/report.json" 2> "$run/chaos.log"
  status=$?
  set -e
  if ! python3 - "$run/report.json" "$i" "$s" >> "$results" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
f = r["failover"]
bad = [i["name"] + "=" + str(i["violations"]) for i in r["invariants"] if i["violations"]]
print(sys.argv[2], sys.argv[3], f["kill_to_promoted_ms"], f["kill_to_last_5xx_ms"], f["promoted_to_last_5xx_ms"],
      f["errors_5xx"], f["errors_5xx_outside"], f["acknowledged_submits"], f["lost_submits"],
      f["acknowledged_reports"], f["lost_reports"], r["violations"], ",".join(bad) or "-")
PY
  then
    echo "run $i (seed $s): no report (exit $status); chaos log:" >&2
    tail -n 30 "$run/chaos.log" >&2
    failed=1
  elif [ -z "$async" ] && [ "$status" != 0 ]; then
    failed=1
  fi
  "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$run/s" -m immediate -w stop >/dev/null 2>&1 || true
  rm -rf "$run"
done

echo "mode: $([ -z "$async" ] && echo synchronous || echo asynchronous) standby; $runs run(s) of $ops operations; kill→promote pause $delay_ms ms; bound $bound_ms ms after the promotion"
printf '%-4s %-5s %10s %12s %14s %6s %8s %11s %6s %11s %6s %5s %s\n' run seed kill→prom kill→last5xx prom→last5xx 5xx outside submits_ack lost reports_ack lost viol invariants
while read -r line; do
  # shellcheck disable=SC2086
  printf '%-4s %-5s %10s %12s %14s %6s %8s %11s %6s %11s %6s %5s %s\n' $line
done < "$results"
python3 - "$results" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
if not rows:
    sys.exit(0)
def dist(col):
    v = sorted(int(r[col]) for r in rows)
    return f"min {v[0]}, median {v[len(v)//2]}, max {v[-1]}"
print("kill → last 5xx, ms:      ", dist(3))
print("promotion → last 5xx, ms: ", dist(4))
print("acknowledged writes lost:  submits", sum(int(r[8]) for r in rows), "of", sum(int(r[7]) for r in rows),
      "; reports", sum(int(r[10]) for r in rows), "of", sum(int(r[9]) for r in rows))
PY
exit "$failed"
