#!/bin/sh
# Fails when src/generated/openapi.ts is not what `npm run generate` makes from
# docs/openapi.json (the API changed and the types were not regenerated).
set -eu
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp src/generated/openapi.ts "$tmp/committed.ts"
npm run --silent generate >/dev/null 2>&1 || { echo "npm run generate failed" >&2; npm run generate; exit 1; }
if ! diff -u "$tmp/committed.ts" src/generated/openapi.ts; then
  echo "src/generated/openapi.ts is out of date with docs/openapi.json: run \`npm run generate\` and commit it" >&2
  exit 1
fi
echo "generated types match docs/openapi.json"
