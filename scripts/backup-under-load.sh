#!/usr/bin/env bash
# `idem backup` of an SQLite store under a steady submit load (SPEC §2.11,
# docs/deployment.md "Backups"): one `idem serve` on a new SQLite file, 50
# payments of which 20 are leased (running), then `idem-lab bench --mode new`
# (32 clients) submitting new tasks while `idem backup` copies the store.
# Prints the submit rate while the backup ran, the backup's own line, whether
# the copy holds every task created before the backup began (created_at more
# than 100 ms before it: a task whose answer arrived before the backup began
# was committed before), then starts `idem serve` on the copy and prints how
# long its start (with the rewind) took and the copy's tasks by class and
# state, judged from the store.
#
# usage: scripts/backup-under-load.sh
# env: IDEM_BIN (default: builds `cargo build --release -p idem -p idem-harness
#      --bin idem --bin idem-lab` and uses $CARGO_TARGET_DIR/release/idem, or
#      target/release/idem), IDEM_LAB_BIN (default: idem-lab beside IDEM_BIN),
#      WARMUP_S (default 3: load before the backup), COUNT (default 400000:
#      submits the bench may send; it is stopped after the backup)
set -euo pipefail
cd "$(dirname "$0")/.."
WARMUP_S=${WARMUP_S:-3}
COUNT=${COUNT:-400000}
if [ -z "${IDEM_BIN:-}" ]; then
  cargo build --release -p idem -p idem-harness --bin idem --bin idem-lab --quiet
  IDEM_BIN="${CARGO_TARGET_DIR:-./target}/release/idem"
fi
IDEM_LAB_BIN=${IDEM_LAB_BIN:-$(dirname "$IDEM_BIN")/idem-lab}
D=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$D"
}
trap cleanup EXIT
ms() { date +%s%3N; }
sq() { python3 -c 'import sqlite3,sys; c=sqlite3.connect("file:"+sys.argv[1]+"?mode=ro", uri=True); [print(*r, sep="\t") for r in c.execute(sys.argv[2])]' "$@"; }

export RUST_LOG=warn IDEM_STORE="sqlite://$D/idem.db"
CLIENT=$("$IDEM_BIN" keys create --tenant acme --role client)
EXEC=$("$IDEM_BIN" keys create --tenant acme --role executor)
serve() { # serve STORE LOG: starts idem serve (in this shell, so cleanup stops it); sets URL
  "$IDEM_BIN" serve --store "$1" --listen 127.0.0.1:0 > "$2.out" 2> "$2" &
  PIDS+=($!)
  until grep -q "idem listening on" "$2.out" 2>/dev/null; do sleep 0.05; done
  URL=$(sed -n 's/^idem listening on //p' "$2.out")
}
serve "$IDEM_STORE" "$D/serve.log"
for i in $(seq 1 50); do
  curl -fs -o /dev/null -X POST "$URL/v1/tasks" -H "Authorization: Bearer $CLIENT" \
    -H "Idempotency-Key: \"payout-$i\"" \
    -d "{\"operation\":\"payment.release\",\"params\":{\"payee\":\"acct_$i\",\"amount\":$((1000 + i)),\"currency\":\"EUR\"}}"
done
for i in $(seq 1 20); do
  curl -fs -o /dev/null -X POST "$URL/v1/attempts/claim" -H "Authorization: Bearer $EXEC" \
    -d '{"executor_id":"worker-1","operations":["payment.release"],"lease_ms":300000}'
done
"$IDEM_LAB_BIN" bench --mode new --url "$URL" --api-key "$CLIENT" --count "$COUNT" \
  --concurrency 32 --no-baseline > "$D/bench.out" 2>&1 &
BENCH=$!
PIDS+=($BENCH)
sleep "$WARMUP_S"
T0=$(ms)
"$IDEM_BIN" backup --to "$D/backup.db"
T1=$(ms)
kill "$BENCH" 2>/dev/null || true
wait "$BENCH" 2>/dev/null || true
sleep 0.5
echo "backup ran $((T1 - T0)) ms under load"
sq "$D/idem.db" "SELECT 'submits/s while the backup ran: ' || (count(*) * 1000 / max($T1 - $T0, 1)) FROM tasks WHERE created_at >= $T0 AND created_at <= $T1 AND operation = 'generation.dispatch'"
sq "$D/idem.db" "SELECT 'submits/s in the ${WARMUP_S} s before it: ' || (count(*) * 1000 / ($WARMUP_S * 1000)) FROM tasks WHERE created_at >= $T0 - $WARMUP_S * 1000 AND created_at < $T0 AND operation = 'generation.dispatch'"
sq "$D/idem.db" "SELECT id FROM tasks WHERE created_at < $T0 - 100 ORDER BY id" > "$D/before.txt"
sq "$D/backup.db" "SELECT id FROM tasks ORDER BY id" > "$D/copy.txt"
missing=$(comm -23 "$D/before.txt" "$D/copy.txt" | wc -l)
echo "tasks created before the backup began: $(wc -l < "$D/before.txt"); in the copy: $(wc -l < "$D/copy.txt"); missing from it: $missing"
sq "$D/backup.db" "SELECT 'copy: integrity_check ' || (SELECT integrity_check FROM pragma_integrity_check) || ', restored = ' || restored FROM store_identity"
S0=$(ms)
serve "sqlite://$D/backup.db" "$D/restored.log"
echo "idem serve on the copy listened after $(( $(ms) - S0 )) ms (identity check and rewind included)"
grep -o 'the store went back in time.*' "$D/restored.log" | head -1 || true
grep -o 'tasks=[0-9]*' "$D/restored.log" | head -1 || true
sq "$D/backup.db" "SELECT operation, state, count(*) FROM tasks GROUP BY 1, 2 ORDER BY 1, 2"
sq "$D/backup.db" "SELECT 'attempts expired by the rewind: ' || count(*) FROM attempts WHERE state = 'expired'"
sq "$D/backup.db" "SELECT 'store_rewound events: ' || count(*) FROM events WHERE json_extract(data, '$.reason') = 'store_rewound'"
