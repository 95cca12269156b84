#!/bin/sh
# The TypeScript SDK's checks, as CI runs them: install from the lockfile, fail on types that
# drifted from docs/openapi.json, test against a real `idem serve` (env IDEM_BIN, default
# target/debug/idem under the repository root; the fault suite also uses the proxy of env
# FAULT_PROXY_BIN, default debug/examples/fault-proxy under CARGO_TARGET_DIR or target, and
# PostgreSQL at IDEM_TEST_PG_URL: this script builds nothing in cargo, .ci/run builds both
# binaries first), and install the packed tarball elsewhere.
set -eu
cd "$(dirname "$0")/.."
npm ci --no-audit --no-fund
npm run check:generated
npm run check:format
npm test
npm run check:pack
