#!/usr/bin/env bash
# Builds the TypeScript SDK (sdk/typescript → dist/) and runs examples/typescript/payments.mjs.
# The idem binary: $IDEM_BIN, else ${CARGO_TARGET_DIR:-target}/debug/idem (`cargo build -p idem`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
(
  cd "$repo/sdk/typescript"
  [ -d node_modules ] || npm ci --no-audit --no-fund --loglevel=error
  npm run --silent build
)
node "$repo/examples/typescript/payments.mjs"
