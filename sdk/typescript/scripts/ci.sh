#!/bin/sh
# The TypeScript SDK's checks, as CI runs them: install from the lockfile, fail on types that
# drifted from docs/openapi.json, test against a real `idem serve` (env IDEM_BIN, default
# target/debug/idem under the repository root), and install the packed tarball elsewhere.
set -eu
cd "$(dirname "$0")/.."
npm ci --no-audit --no-fund
npm run check:generated
npm run check:format
npm test
npm run check:pack
