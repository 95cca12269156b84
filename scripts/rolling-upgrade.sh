#!/usr/bin/env bash
# A rolling upgrade on one PostgreSQL under load (docs/operations.md, "Upgrading").
#
# Builds the previous release (the commit in ci/previous-release) in a git
# worktree with a target dir of its own, and this checkout's idem. On a scratch
# database: two instances of the previous release serve a steady
# submit/claim/report load (scripts/rolling-upgrade-load.py, every instance in
# turn); then two instances of the new binary start on the same database (the
# first applies its expand migration while the old ones serve) and the load
# goes on across all four. Fails unless: no instance answered a 5xx or dropped a
# connection, every acknowledged submit's task is in the database, every
# instance's /readyz said 200 throughout (they all served), the old instances
# served beside the new ones, and the schema reached the new binary's version.
#
# Then, on a second scratch database, the new binary against a future schema
# (a schema_migrations row above its version): declared compatible with it, it
# serves and /readyz says 200; once that row declares it incompatible, /readyz
# turns 503 naming both versions, and a fresh start refuses (exit 1) naming both.
#
# Drops both databases, stops every instance and removes the worktree and its
# build on any exit. Usage: scripts/rolling-upgrade.sh [load seconds, default 40]
# (IDEM_BIN: this checkout's binary, else `cargo build -p idem`; IDEM_PREV_BIN:
# the previous release's binary, built already; else IDEM_PREV_TARGET_DIR:
# build the previous release there and keep it, to run this again without
# rebuilding it).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-40}"
pg="postgres://postgres@127.0.0.1:5432"
prev=$(tr -d '[:space:]' < ci/previous-release)
work=$(mktemp -d)
db="idem_rolling_$$"
db_future="idem_rolling_future_$$"
pids=()

psql_() { psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -qtAX "$@"; }
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  for d in "$db" "$db_future"; do
    psql_ -d postgres -c "DROP DATABASE IF EXISTS $d WITH (FORCE)" >/dev/null 2>&1 || true
  done
  git worktree remove --force "$work/prev" >/dev/null 2>&1 || true
  git worktree prune
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "rolling upgrade: FAILED: $*" >&2; exit 1; }

started=$(date +%s)
if [ -n "${IDEM_BIN:-}" ]; then
  new="$IDEM_BIN"
else
  cargo build -p idem --quiet
  new="$(cd "${CARGO_TARGET_DIR:-target}/debug" && pwd)/idem"
fi
if [ -n "${IDEM_PREV_BIN:-}" ]; then
  old="$IDEM_PREV_BIN"
else
  git worktree add --quiet --detach "$work/prev" "$prev"
  prev_target="${IDEM_PREV_TARGET_DIR:-$work/prev-target}"
  (cd "$work/prev" && CARGO_TARGET_DIR="$prev_target" cargo build -p idem --quiet)
  old="$(cd "$prev_target/debug" && pwd)/idem"
fi
built=$(date +%s)
echo "built: previous release ${prev:0:10} and this checkout ($((built - started)) s)"

# start NAME BINARY DB: serves DB on a free port of 127.0.0.1; sets $url and
# adds the process to $servers.
servers=()
start() {
  "$2" serve --listen 127.0.0.1:0 --store "$pg/$3" >"$work/$1.out" 2>"$work/$1.err" &
  pids+=($!)
  servers+=($!)
  for _ in $(seq 1 600); do
    grep -q 'listening on' "$work/$1.out" 2>/dev/null && break
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$work/$1.err" >&2; fail "$1 exited at start-up"; }
    sleep 0.1
  done
  url=$(sed -n 's/^idem listening on //p' "$work/$1.out")
  [ -n "$url" ] || { cat "$work/$1.err" >&2; fail "$1 did not start"; }
}

# --- The rolling upgrade -----------------------------------------------------
psql_ -d postgres -c "CREATE DATABASE $db"
"$old" migrate --store "$pg/$db" >/dev/null 2>"$work/migrate.err" || { cat "$work/migrate.err" >&2; fail "idem migrate (previous release)"; }
client_key=$("$old" keys create --tenant rolling --role client --store "$pg/$db" 2>/dev/null)
executor_key=$("$old" keys create --tenant rolling --role executor --store "$pg/$db" 2>/dev/null)
from=$(psql_ -d "$db" -c "SELECT max(version) FROM schema_migrations")
instances="$work/instances"
: > "$instances"
for n in old-1 old-2; do start "$n" "$old" "$db"; echo "$n $url" >> "$instances"; done
python3 scripts/rolling-upgrade-load.py --instances "$instances" --seconds "$seconds" --old 2 \
  --client-key "$client_key" --executor-key "$executor_key" \
  --acked "$work/acked" --summary "$work/summary.json" &
load=$!
pids+=("$load")
sleep "$(( seconds / 4 ))"
for n in new-1 new-2; do start "$n" "$new" "$db"; echo "$n $url" >> "$instances"; done
wait "$load" || fail "the load driver failed"
to=$(psql_ -d "$db" -c "SELECT max(version) FROM schema_migrations")
for p in "${servers[@]}"; do kill -0 "$p" 2>/dev/null || fail "an instance exited during the load"; done
found=$(psql_ -d "$db" <<SQL
CREATE TEMP TABLE acked (id uuid PRIMARY KEY);
\copy acked FROM '$work/acked'
SELECT count(*) FROM acked JOIN tasks USING (id);
SQL
)

python3 - "$work/summary.json" "$found" "$from" "$to" <<'PY' || fail "see above"
import json, sys
s = json.load(open(sys.argv[1]))
found, frm, to = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
bad = []
total = fivexx = 0
print(f"{'instance':9} {'requests':>9} {'beside new':>11} {'5xx':>5} {'errors':>7}  readyz")
for name in sorted(s["instances"]):
    i = s["instances"][name]
    f = sum(n for code, n in i["status"].items() if code.startswith("5"))
    total += i["requests"]; fivexx += f
    print(f"{name:9} {i['requests']:>9} {i['requests_beside_new']:>11} {f:>5} {i['errors']:>7}  {i['readyz']}")
    if f: bad.append(f"{name} answered {f} 5xx ({i['status']})")
    if i["errors"]: bad.append(f"{name}: {i['errors']} failed requests or readiness answers, e.g. {i['error_samples']}")
    if set(i["readyz"]) != {"200"}: bad.append(f"{name}: /readyz answered {i['readyz']}")
    if i["requests"] == 0: bad.append(f"{name} answered nothing")
    if name.startswith("old") and i["requests_beside_new"] == 0:
        bad.append(f"{name} served nothing once the new binary was up")
print(f"requests: {total}, 5xx: {fivexx}, acknowledged submits: {s['acked']}, "
      f"their tasks found in the database: {found}, schema: v{frm} -> v{to}, load: {s['seconds']} s")
if found != s["acked"]: bad.append(f"{s['acked'] - found} acknowledged task(s) missing from the database")
if s["acked"] == 0: bad.append("no submit was acknowledged")
if to <= frm: bad.append(f"the new binary did not migrate (schema v{frm} -> v{to})")
for b in bad: print("  " + b, file=sys.stderr)
sys.exit(1 if bad else 0)
PY

# --- A schema the new binary cannot serve ------------------------------------
psql_ -d postgres -c "CREATE DATABASE $db_future"
"$new" migrate --store "$pg/$db_future" >/dev/null 2>"$work/migrate.err" || { cat "$work/migrate.err" >&2; fail "idem migrate"; }
known=$(psql_ -d "$db_future" -c "SELECT max(version) FROM schema_migrations")
future=$((known + 1))
# A later release's expand step: declared compatible with this binary.
psql_ -d "$db_future" -c "INSERT INTO schema_migrations (version, compatible_from) VALUES ($future, $known)"
start future "$new" "$db_future"
curl -fsS "$url/readyz" >/dev/null || fail "the new binary does not serve v$future declared compatible with v$known"
# Its contract step, applied under the running instance: /readyz turns 503.
psql_ -d "$db_future" -c "UPDATE schema_migrations SET compatible_from = $future WHERE version = $future"
ready=""
for _ in $(seq 1 100); do
  ready=$(curl -sS "$url/readyz")
  grep -q "version $future" <<<"$ready" && break
  sleep 0.1
done
grep -q "version $future" <<<"$ready" && grep -q "$known" <<<"$ready" \
  || fail "/readyz did not name v$future and v$known once the schema became incompatible: $ready"
echo "a running new instance on v$future (compatible from v$future): /readyz 503: $(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["detail"])' "$ready")"
set +e
timeout 60 "$new" serve --listen 127.0.0.1:0 --store "$pg/$db_future" >"$work/refused.out" 2>"$work/refused.err"
rc=$?
set -e
[ "$rc" = 1 ] || fail "a new binary on v$future (compatible from v$future) exited $rc, not 1"
grep -q "version $future" "$work/refused.err" && grep -q "this binary's $known" "$work/refused.err" \
  || { cat "$work/refused.err" >&2; fail "the refusal does not name v$future and v$known"; }
echo "a new binary started on v$future (compatible from v$future): exit 1: $(grep -o "the database's schema is at version[^:]*" "$work/refused.err" | head -n 1)"
echo "rolling upgrade: passed in $(( $(date +%s) - built )) s after the builds"
