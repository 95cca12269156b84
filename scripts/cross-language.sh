#!/usr/bin/env bash
# Cross-language run: a Python client submits 200 payments,
# 2 TypeScript workers and 1 Rust worker execute them against one idem serve and the
# fake provider, with answers dropped after commit and workers killed with SIGKILL;
# then every task must be terminal, hold at most one payout, and never have been
# executed twice without a reconcile between (scripts/cross-language.py checks).
#
# Builds what it needs: idem and idem-example-payments (cargo, unless IDEM_BIN and
# IDEM_EXAMPLE_BIN are given), the TypeScript SDK (npm), and a throwaway virtualenv
# holding ./sdk/python. Exit status: that of the check.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$repo/target}"
if [ -z "${IDEM_BIN:-}" ] || [ -z "${IDEM_EXAMPLE_BIN:-}" ]; then
  (cd "$repo" && cargo build --quiet -p idem -p idem-example-payments)
fi
export IDEM_BIN="${IDEM_BIN:-$target/debug/idem}"
export IDEM_EXAMPLE_BIN="${IDEM_EXAMPLE_BIN:-$target/debug/idem-example-payments}"
(
  cd "$repo/sdk/typescript"
  [ -d node_modules ] || npm ci --no-audit --no-fund --loglevel=error
  npm run --silent build
)
venv="$(mktemp -d "${TMPDIR:-/tmp}/idem-cross-venv.XXXXXX")"
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "$repo/sdk/python"
"$venv/bin/python" "$repo/scripts/cross-language.py"
