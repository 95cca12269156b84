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
# With --async the standby is asynchronous, and the kill command first cuts its WAL stream: on
# the standby `ALTER SYSTEM SET primary_conninfo = ''` and a reload stop its WAL receiver (the
# standby keeps what it received and waits), the workload goes on against the primary for
# --cut-ms, and only then is the primary killed. The standby is then behind by every commit of
# those --cut-ms, as an asynchronous standby behind a slow or broken link is. The kill command
# records the primary's flushed WAL position just before the SIGKILL and the standby's received
# one after it; the report gives their difference in bytes (`lag_bytes`). The 5xx figures are
# taken from the SIGKILL (the cut is subtracted: nothing fails during it). The chaos checker then
# counts the acknowledged writes the promoted database lacks, the tasks it moved to
# reconcile-first (`store_rewound`), and, from the provider's ledger, effects of lost tasks and
# of lost attempts (docs/chaos.md, "A database failover").
#
#   scripts/failover.sh                 synchronous standby, 1 run (CI)
#   scripts/failover.sh --runs 10       … 10 runs, and the distribution of the 5xx window
#   scripts/failover.sh --async --runs 10
#                                       asynchronous standby cut --cut-ms before the kill:
#                                       acknowledged writes lost are counted
#
# Options: --ops N (chaos operations per run, default 1500), --seed S (first seed, default 1; run i
# uses S+i), --delay-ms N (kill to promote, default 1000), --bound-ms N (default 5000), --cut-ms N
# (with --async: WAL receiver stopped this long before the kill, default 500; 0: no cut), --keep DIR
# (each run's chaos report and log are copied there as run-N.json, run-N.log, and the rows of the
# table as results.jsonl).
# The idem binary: $IDEM_BIN, else $CARGO_TARGET_DIR/debug/idem (or target/debug/idem); idem-lab:
# $IDEM_LAB_BIN, else idem-lab beside that idem; the chaos run is `$chaos` below.
# PostgreSQL's binaries: $PG_BIN, else the newest /usr/lib/postgresql/*/bin; as root they run as
# `postgres` (runuser). Exit status: 1 when a synchronous run has a violation.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=1 ops=1500 seed=1 delay_ms=1000 bound_ms=5000 cut_ms=500 async="" keep=""
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --ops) ops=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --delay-ms) delay_ms=$2; shift 2 ;;
    --bound-ms) bound_ms=$2; shift 2 ;;
    --cut-ms) cut_ms=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    --async) async=1; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

idem=${IDEM_BIN:-${CARGO_TARGET_DIR:-target}/debug/idem}
[ -x "$idem" ] || { echo "no idem binary at $idem (cargo build -p idem, or set IDEM_BIN)" >&2; exit 2; }
lab=${IDEM_LAB_BIN:-$(dirname "$idem")/idem-lab}
[ -x "$lab" ] || { echo "no idem-lab binary at $lab (cargo build -p idem-harness --bin idem-lab, or set IDEM_LAB_BIN)" >&2; exit 2; }
# The chaos run (it starts `idem serve` itself).
chaos=("$lab" chaos --idem-bin "$idem")
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
  "${as_pg[@]}" "$pg_bin/pg_basebackup" -h 127.0.0.1 -p "$p1" -U postgres -D "$run/s" -R -X stream --no-sync --checkpoint=fast
  printf "port = %s\n" "$p2" >> "$run/s/postgresql.conf"
  "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$run/s" -l "$run/s.log" -w start >/dev/null
  want=$([ -z "$async" ] && echo sync || echo async)
  for _ in $(seq 1 100); do
    [ "$("${psql[@]}" -p "$p1" -Atc "SELECT sync_state FROM pg_stat_replication")" = "$want" ] && break
    sleep 0.1
  done
  "${psql[@]}" -p "$p1" -c "CREATE DATABASE idem"

  q="psql -X -q -At -h 127.0.0.1 -U postgres -d postgres -v ON_ERROR_STOP=1"
  if [ -n "$async" ] && [ "$cut_ms" -gt 0 ]; then
    # Cut the standby's WAL stream, let the primary go on alone for cut_ms, then kill it.
    {
      printf '#!/bin/sh\nset -e\nq="%s" p1=%s p2=%s run="%s" cut_s=%s\n' "$q" "$p1" "$p2" "$run" "$(python3 -c "print($cut_ms / 1000)")"
      cat <<'KILL'
t0=$(date +%s%N)
# One session on the primary, opened before the cut: its flushed WAL position is read right
# before the SIGKILL without waiting for a new connection to a busy server.
$q -p "$p1" > "$run/primary-lsn" <<SQL
\! $q -p $p2 -c "ALTER SYSTEM SET primary_conninfo = ''" -c "SELECT pg_reload_conf()" >/dev/null
\! n=0; until [ "\$($q -p $p2 -c 'SELECT count(*) FROM pg_stat_wal_receiver')" = 0 ]; do n=\$((n + 1)); [ \$n -lt 500 ] || exit 1; sleep 0.01; done; date +%s%N > "$run/cut-start"
SELECT pg_sleep($cut_s) \g /dev/null
SELECT pg_current_wal_flush_lsn();
SQL
t2=$(date +%s%N)
pm=$(head -n 1 "$run/p/postmaster.pid")
kill -9 $pm $(ps -o pid= --ppid $pm)
[ -s "$run/cut-start" ] || { echo "the standby's WAL receiver did not stop" >&2; exit 1; }
t1=$(cat "$run/cut-start")
primary=$(cat "$run/primary-lsn")
standby=$($q -p "$p2" -c "SELECT pg_last_wal_receive_lsn()")
lag=$($q -p "$p2" -c "SELECT pg_wal_lsn_diff('$primary', '$standby')::bigint")
echo "$(( (t2 - t0) / 1000000 )) $(( (t2 - t1) / 1000000 )) $lag $primary $standby" > "$run/cut"
KILL
    } > "$run/kill.sh"
  elif [ -n "$async" ]; then
    cat > "$run/kill.sh" <<KILL
#!/bin/sh
set -e
primary=\$($q -p $p1 -c "SELECT pg_current_wal_flush_lsn()")
pm=\$(head -n 1 "$run/p/postmaster.pid")
kill -9 \$pm \$(ps -o pid= --ppid \$pm)
standby=\$($q -p $p2 -c "SELECT pg_last_wal_receive_lsn()")
lag=\$($q -p $p2 -c "SELECT pg_wal_lsn_diff('\$primary', '\$standby')::bigint")
echo "0 0 \$lag \$primary \$standby" > "$run/cut"
KILL
  else
    cat > "$run/kill.sh" <<KILL
#!/bin/sh
pm=\$(head -n 1 "$run/p/postmaster.pid")
kill -9 \$pm \$(ps -o pid= --ppid \$pm)
KILL
  fi
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
  "${chaos[@]}" --seed "$s" --ops "$ops" --store "$url" --json \
    --failover-kill "$run/kill.sh" --failover-promote "$run/promote.sh" \
    --failover-delay-ms "$delay_ms" --failover-bound-ms "$bound_ms" ${async:+--failover-async} \
    > "$run/report.json" 2> "$run/chaos.log"
  status=$?
  set -e
  if ! python3 - "$run/report.json" "$i" "$s" "$run/cut" >> "$results" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))
f, l = r["failover"], r["failover"]["loss"]
# kill.sh: ms from its start to the SIGKILL, ms the WAL receiver was down, lag bytes, LSNs.
cut = open(sys.argv[4]).read().split() if os.path.exists(sys.argv[4]) else ["0", "0", "-", "-", "-"]
before = int(cut[0])
print(json.dumps({
    "run": int(sys.argv[2]), "seed": int(sys.argv[3]), "cut_ms": int(cut[1]), "lag_bytes": cut[2],
    "kill_to_promoted_ms": f["kill_to_promoted_ms"] - before,
    "kill_to_last_5xx_ms": max(f["kill_to_last_5xx_ms"] - before, 0) if f["errors_5xx"] else 0,
    "promoted_to_last_5xx_ms": f["promoted_to_last_5xx_ms"],
    "errors_5xx": f["errors_5xx"], "outside": f["errors_5xx_outside"],
    "submits": f["acknowledged_submits"], "lost_submits": f["lost_submits"],
    "reports": f["acknowledged_reports"], "lost_reports": f["lost_reports"],
    "reports_in_cut": f["reports_acknowledged_during_kill"],
    "lost_cancels": l["lost_cancels"], "lost_deliveries": l["lost_deliveries"], "lost_usage": l["lost_usage"],
    "lost_tasks": l["lost_tasks"], "recreated": l["lost_tasks_recreated"],
    "lost_with_effect": l["lost_tasks_with_effect"], "executed_again": l["executed_again_after_loss"],
    "rewound": l["rewound_tasks"], "rewound_reconcile": l["rewound_to_reconcile"],
    "lost_attempt_effects": l["lost_attempts_with_effect"], "repeated": l["repeated_without_reconcile"],
    "violations": r["violations"],
    "invariants": ",".join(i["name"] + "=" + str(i["violations"]) for i in r["invariants"] if i["violations"]) or "-",
    "examples": l["examples"],
}))
PY
  then
    echo "run $i (seed $s): no report (exit $status); chaos log:" >&2
    tail -n 30 "$run/chaos.log" >&2
    failed=1
  elif [ -z "$async" ] && [ "$status" != 0 ]; then
    failed=1
  fi
  if [ -n "$keep" ]; then
    mkdir -p "$keep"
    cp "$run/report.json" "$keep/run-$i.json"
    cp "$run/chaos.log" "$keep/run-$i.log"
  fi
  "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$run/s" -m immediate -w stop >/dev/null 2>&1 || true
  rm -rf "$run"
done

[ -n "$keep" ] && cp "$results" "$keep/results.jsonl"
echo "mode: $([ -z "$async" ] && echo synchronous || echo "asynchronous (WAL receiver cut $cut_ms ms before the kill)") standby; $runs run(s) of $ops operations; kill→promote pause $delay_ms ms; bound $bound_ms ms after the promotion"
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cols = [("run", "run"), ("seed", "seed"), ("cut_ms", "cut"), ("lag_bytes", "lag_B"),
        ("kill_to_promoted_ms", "kill→prom"), ("kill_to_last_5xx_ms", "kill→5xx"),
        ("promoted_to_last_5xx_ms", "prom→5xx"), ("errors_5xx", "5xx"), ("outside", "out"),
        ("submits", "sub_ack"), ("lost_submits", "lost"), ("reports", "rep_ack"), ("lost_reports", "lost"), ("reports_in_cut", "rep_in_kill"),
        ("lost_cancels", "canc_lost"), ("lost_deliveries", "deliv_lost"), ("lost_tasks", "tasks_lost"),
        ("recreated", "recreated"), ("lost_with_effect", "w/effect"), ("executed_again", "again"),
        ("rewound", "rewound"), ("rewound_reconcile", "→reconcile"), ("lost_attempt_effects", "lostatt_eff"),
        ("repeated", "repeated"), ("violations", "viol"), ("invariants", "invariants")]
print(" ".join(f"{h:>{max(len(h), 4)}}" for _, h in cols))
for r in rows:
    print(" ".join(f"{str(r[k]):>{max(len(h), 4)}}" for k, h in cols))
for r in rows:
    for e in r["examples"]:
        print(f"run {r['run']}: {e}")
if not rows:
    sys.exit(0)
def dist(key):
    v = sorted(int(r[key]) for r in rows)
    return f"min {v[0]}, median {v[len(v)//2]}, max {v[-1]}"
def total(key):
    return sum(int(r[key]) for r in rows)
print("kill → last 5xx, ms:      ", dist("kill_to_last_5xx_ms"))
print("promotion → last 5xx, ms: ", dist("promoted_to_last_5xx_ms"))
lags = [int(r["lag_bytes"]) for r in rows if r["lag_bytes"] not in ("-", "")]
if lags:
    lags.sort()
    print("standby behind at the kill, bytes: min", lags[0], "median", lags[len(lags)//2], "max", lags[-1])
print("acknowledged writes lost:  submits", total("lost_submits"), "of", total("submits"),
      "; reports", total("lost_reports"), "of", total("reports"),
      "; cancels", total("lost_cancels"), "; deliveries shown", total("lost_deliveries"))
print("tasks lost with the store:", total("lost_tasks"), "(re-created by a later submit", total("recreated"),
      "; with an effect", total("lost_with_effect"), "; executed again under the same key", total("executed_again"), ")")
print("tasks moved on by store_rewound:", total("rewound"), "(reconcile-first", total("rewound_reconcile"),
      "); surviving tasks with an effect by a lost attempt:", total("lost_attempt_effects"),
      "; repeated without a reconciliation:", total("repeated"))
print("violations:", total("violations"))
PY
exit "$failed"
