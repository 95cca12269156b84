#!/usr/bin/env bash
# Claim+report throughput against PostgreSQL (docs/benchmarks.md, "Change
# notifications: announced after commit"): on a scratch database, `idem
# serve` on the store URL, TASKS tasks queued with `idem-lab bench --url …
# --mode new`, then EXECUTORS executor loops for SECONDS s, each with one keep-alive
# connection: claim one attempt (no wait), report it succeeded. Prints the
# pairs per second. OPTIONS is added to the URL's `options` (e.g.
# `-c idem.notify=on` for the trigger path).
#
# usage: scripts/claim-report-load.sh
# env: PG (default postgres://postgres@127.0.0.1:5432), IDEM_BIN (default
#      $CARGO_TARGET_DIR/release/idem), IDEM_LAB_BIN (default: idem-lab beside it), TASKS (25000), EXECUTORS (32),
#      SECONDS_ (15), OPTIONS (empty)
set -euo pipefail
cd "$(dirname "$0")/.."
PG=${PG:-postgres://postgres@127.0.0.1:5432}
IDEM_BIN=${IDEM_BIN:-${CARGO_TARGET_DIR:-./target}/release/idem}
LAB=${IDEM_LAB_BIN:-$(dirname "$IDEM_BIN")/idem-lab}
TASKS=${TASKS:-25000}; EXECUTORS=${EXECUTORS:-32}; SECS=${SECONDS_:-15}
DB="idem_claim_report_$$"
URL="$PG/$DB"
if [ -n "${OPTIONS:-}" ]; then
  URL="$URL?options=$(python3 -c 'import sys,urllib.parse;print(urllib.parse.quote(sys.argv[1]))' "$OPTIONS")"
fi
DIR=$(mktemp -d)
SERVER=
cleanup() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  psql "$PG/postgres" -qXc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$DIR"
}
trap cleanup EXIT
psql "$PG/postgres" -qXc "CREATE DATABASE $DB" >/dev/null
CLIENT=$("$IDEM_BIN" keys --store "$URL" create --tenant bench --role client)
EXECUTOR=$("$IDEM_BIN" keys --store "$URL" create --tenant bench --role executor)
PORT=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
RUST_LOG=warn "$IDEM_BIN" serve --store "$URL" --listen "127.0.0.1:$PORT" >"$DIR/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do
  curl -fs "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
  sleep 0.1
done
"$LAB" bench --url "http://127.0.0.1:$PORT" --api-key "$CLIENT" --mode new \
  --concurrency 32 --count "$TASKS" >"$DIR/seed.log" 2>&1
python3 - "$PORT" "$EXECUTOR" "$EXECUTORS" "$SECS" <<'PY'
import http.client, json, sys, threading, time
port, key, n, secs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
done = [0] * n
stop = time.monotonic() + secs
def loop(i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    claim = json.dumps({"executor_id": f"load-{i}", "max": 1})
    while time.monotonic() < stop:
        c.request("POST", "/v1/attempts/claim", claim, headers)
        r = c.getresponse(); body = json.loads(r.read())
        if r.status != 200 or not body["attempts"]:
            continue
        a = body["attempts"][0]
        c.request("POST", f"/v1/attempts/{a['id']}/report",
                  json.dumps({"generation": a["generation"], "outcome": "succeeded"}), headers)
        r = c.getresponse(); r.read()
        if r.status == 200:
            done[i] += 1
start = time.monotonic()
ts = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
for t in ts: t.start()
for t in ts: t.join()
print(f"claim+report pairs/s: {sum(done) / (time.monotonic() - start):.0f} ({sum(done)} in {secs:.0f} s, {n} executors)")
PY
