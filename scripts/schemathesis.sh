#!/usr/bin/env bash
# Checks the served /openapi.json with openapi-spec-validator, then runs
# schemathesis (an outside client generating requests from idem's own
# /openapi.json) against a live, authenticated idem on a temporary SQLite store.
# Fails on any 5xx, any response that breaks the document, or a crash.
# Usage: scripts/schemathesis.sh [max-examples per operation, default 40]
set -euo pipefail
cd "$(dirname "$0")/.."
examples="${1:-40}"

if ! command -v schemathesis >/dev/null 2>&1; then
  python3 -m pip install --quiet 'schemathesis>=4.3,<5'
fi
if ! python3 -c 'import openapi_spec_validator' >/dev/null 2>&1; then
  python3 -m pip install --quiet 'openapi-spec-validator>=0.7,<1'
fi

# IDEM_BIN: that binary (CI: the test build's); IDEM_PROFILE=debug: a debug
# build; default: a release build.
if [ -n "${IDEM_BIN:-}" ]; then
  bin="$IDEM_BIN"
elif [ "${IDEM_PROFILE:-release}" = debug ]; then
  cargo build -p idem --quiet
  bin="${CARGO_TARGET_DIR:-./target}/debug/idem"
else
  cargo build --release -p idem --quiet
  bin="${CARGO_TARGET_DIR:-./target}/release/idem"
fi
dir=$(mktemp -d)
store="sqlite://$dir/idem.db"
key=$("$bin" keys create --tenant acme --role admin --store "$store" 2>/dev/null)
"$bin" serve --listen 127.0.0.1:0 --store "$store" >"$dir/out" 2>"$dir/err" &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 1 100); do
  grep -q 'listening on' "$dir/out" 2>/dev/null && break
  sleep 0.1
done
url=$(sed -n 's/^idem listening on //p' "$dir/out")
[ -n "$url" ] || { cat "$dir/err"; echo "idem did not start" >&2; exit 1; }

# The served document (with this server's operation classes) is valid OpenAPI 3.1.
curl -fsS "$url/openapi.json" -o "$dir/openapi.json"
python3 -c 'import json, sys; from openapi_spec_validator import validate; validate(json.load(open(sys.argv[1]))); print("openapi.json: valid OpenAPI 3.1")' "$dir/openapi.json"

# A claim may long-poll for up to 30 s (`wait_ms` ≤ 30000) when no work is
# queued, and a read or submit with `Prefer: wait=N` may be held for up to
# 60 s, so requests may take that long: the default 10 s timeout would report
# such a request as a network error.
schemathesis run "$url/openapi.json" \
  -H "Authorization: Bearer $key" \
  --request-timeout 65 \
  --max-examples "$examples" \
  --seed 20261129 \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance

kill -0 "$pid" || { echo "idem crashed during the run" >&2; cat "$dir/err"; exit 1; }
if grep -q 'panicked' "$dir/err"; then
  echo "idem logged a panic" >&2
  grep -n 'panicked' "$dir/err" >&2
  exit 1
fi
echo "schemathesis: no failures"
