#!/usr/bin/env bash
# Instructions per claim+report pair that `idem serve` executes in user space
# (valgrind's callgrind), for an executor pool serving TENANTS tenants that all
# have work (docs/benchmarks.md, "Fair claims: starvation and cost"). With a
# SQLite store the count includes the database's own work (it runs in the
# server's process), so it shows how a claim's cost grows with the number of
# tenants with work, whatever else the machine is doing.
#
# The store is filled by a plain `idem serve` first (TASKS tasks of the class
# generation.dispatch, spread evenly over the tenants); then `idem serve`
# runs under callgrind, 8 executor loops of the pool key claim one attempt
# each (no wait) and report it succeeded, 200 pairs warm up, and the counts
# cover the next COUNT pairs.
#
# usage: scripts/instructions-per-claim.sh TENANTS [TASKS [COUNT]]
#   TENANTS  tenants with work (1 or more); TASKS default 20000; COUNT default 2000
# env: IDEM_BIN (default ${CARGO_TARGET_DIR:-target}/release/idem), PORT (default 18790)
set -euo pipefail
cd "$(dirname "$0")/.."
TENANTS=$1; TASKS=${2:-20000}; COUNT=${3:-2000}
BIN=${IDEM_BIN:-${CARGO_TARGET_DIR:-./target}/release/idem}
PORT=${PORT:-18790}
DIR=$(mktemp -d)
SPID=
stop() {
  if [ -n "$SPID" ]; then kill "$SPID" 2>/dev/null || true; wait "$SPID" 2>/dev/null || true; fi
  SPID=
}
trap 'stop; rm -rf "$DIR"' EXIT
STORE="sqlite://$DIR/idem.db"
ready() {
  for _ in $(seq 1 600); do
    curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "idem serve did not become ready" >&2; return 1
}
"$BIN" migrate --store "$STORE" >/dev/null 2>&1 || true
POOL=$("$BIN" keys --store "$STORE" create --tenant pool --role executor --serves all 2>/dev/null)
: >"$DIR/clients"
for t in $(seq 1 "$TENANTS"); do
  "$BIN" keys --store "$STORE" create --tenant "t$t" --role client 2>/dev/null >>"$DIR/clients"
done
RUST_LOG=warn "$BIN" serve --store "$STORE" --listen "127.0.0.1:$PORT" >"$DIR/fill.log" 2>&1 &
SPID=$!
ready
python3 - "$PORT" "$DIR/clients" "$TASKS" <<'PY'
import http.client, json, sys, threading, uuid
port, path, tasks = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
keys = [l.strip() for l in open(path) if l.strip()]
per = max(tasks // len(keys), 1)
jobs = [(k, i) for k in keys for i in range(per)]
def fill(part):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for key, i in part:
        body = json.dumps({"operation": "generation.dispatch", "params": {"prompt": f"p{i}", "steps": 1}})
        c.request("POST", "/v1/tasks", body, {"Authorization": f"Bearer {key}",
                  "Content-Type": "application/json", "Idempotency-Key": f'"{uuid.uuid4()}"'})
        r = c.getresponse(); r.read()
        if r.status != 201:
            sys.exit(f"submit answered {r.status}")
ts = [threading.Thread(target=fill, args=(jobs[i::8],)) for i in range(8)]
for t in ts: t.start()
for t in ts: t.join()
PY
stop
valgrind --tool=callgrind --callgrind-out-file="$DIR/cg.%p" \
  "$BIN" serve --store "$STORE" --listen "127.0.0.1:$PORT" >/dev/null 2>"$DIR/valgrind.log" &
SPID=$!
ready
pairs() {
  python3 - "$PORT" "$POOL" "$1" <<'PY'
import http.client, json, sys, threading
port, key, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
left = [count]; lock = threading.Lock(); empty = [0]
def take():
    with lock:
        if left[0] == 0:
            return False
        left[0] -= 1
        return True
def loop(i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    claim = json.dumps({"executor_id": f"cost-{i}", "max": 1})
    while take():
        while True:
            c.request("POST", "/v1/attempts/claim", claim, headers)
            r = c.getresponse(); body = json.loads(r.read())
            if r.status == 200 and body["attempts"]:
                break
            empty[0] += 1
            if empty[0] > 1000:
                sys.exit("the pool found no work")
        a = body["attempts"][0]
        c.request("POST", f"/v1/attempts/{a['id']}/report",
                  json.dumps({"generation": a["generation"], "outcome": "succeeded"}), headers)
        r = c.getresponse(); r.read()
        if r.status != 200:
            sys.exit(f"report answered {r.status}")
ts = [threading.Thread(target=loop, args=(i,)) for i in range(8)]
for t in ts: t.start()
for t in ts: t.join()
PY
}
pairs 200
callgrind_control -z "$SPID" >/dev/null 2>&1   # counts start here …
pairs "$COUNT"
callgrind_control -d "$SPID" >/dev/null 2>&1   # … and are written here (the file ending .1)
total=$(awk '/^summary:/ {print $2}' "$DIR"/cg.*.1)
echo "tenants $TENANTS: $((total / COUNT)) instructions per claim+report pair (idem serve, SQLite, user space, $COUNT pairs, $TASKS tasks)"
