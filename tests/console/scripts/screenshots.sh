#!/usr/bin/env bash
# Takes the console's screenshots for docs/console.md (overview.png, search.png,
# task-reconciled.png in docs/console, or env IDEM_CONSOLE_SCREENSHOTS_DIR): headless Debian
# Chromium against a fresh `idem serve` on SQLite (env IDEM_BIN, default target/debug/idem
# under the repository root). Every process it started and its temporary files are removed
# on any exit.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
repo="$(cd "$here/../.." && pwd)"
export IDEM_BIN="${IDEM_BIN:-$repo/target/debug/idem}"
work="$(mktemp -d "${TMPDIR:-/tmp}/idem-console-shots.XXXXXX")"
mkdir "$work/pids" "$work/tmp"
node_pid=""
cleanup() {
  local status=$?
  # The test run is a process group of its own (setsid): it goes, with the servers it started.
  [ -z "$node_pid" ] || kill -KILL -- "-$node_pid" 2>/dev/null || true
  for f in "$work"/pids/*; do
    [ -e "$f" ] || continue
    name="$(basename "$f")"
    case "$name" in
      chromium-*) kill -KILL -- "-${name#*-}" 2>/dev/null || true ;;
      *) kill -KILL "${name#*-}" 2>/dev/null || true ;;
    esac
  done
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cd "$here"
[ -d node_modules ] || npm ci --no-audit --no-fund
export IDEM_CONSOLE_PIDS="$work/pids" TMPDIR="$work/tmp" IDEM_CONSOLE_STORE=""
setsid node scripts/screenshots.js &
node_pid=$!
rc=0
wait "$node_pid" || rc=$?
node_pid=""
exit "$rc"
