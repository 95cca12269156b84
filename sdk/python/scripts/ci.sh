#!/usr/bin/env bash
# The Python SDK's checks, as CI runs them: a fresh virtualenv with the package
# and its test extra from PyPI, the tests against a real `idem serve` (env
# IDEM_BIN, default target/debug/idem under the repository root; the fault
# suites also use the proxy of env FAULT_PROXY_BIN, default
# debug/examples/fault-proxy under CARGO_TARGET_DIR or target, and PostgreSQL at
# IDEM_TEST_PG_URL: this script builds nothing in cargo, .ci/run builds both
# binaries first), then the
# wheel built and installed into another fresh virtualenv (check-wheel.sh).
set -euo pipefail
sdk=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --upgrade pip
"$work/venv/bin/pip" install --quiet "$sdk[test]" build
cd "$sdk"
# -s: the fault suites print the margins they measured.
"$work/venv/bin/python" -m pytest -q -s -p no:cacheprovider tests
PYTHON="$work/venv/bin/python" "$sdk/scripts/check-wheel.sh"
