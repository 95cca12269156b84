#!/usr/bin/env bash
# Runs examples/python/payments.py in a throwaway virtualenv holding ./sdk/python.
# The idem binary: $IDEM_BIN, else ${CARGO_TARGET_DIR:-target}/debug/idem (`cargo build -p idem`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$(mktemp -d "${TMPDIR:-/tmp}/idem-example-venv.XXXXXX")"
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "$repo/sdk/python"
"$venv/bin/python" "$repo/examples/python/payments.py"
