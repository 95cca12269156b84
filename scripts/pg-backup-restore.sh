#!/usr/bin/env bash
# docs/deployment.md "Backups", PostgreSQL, run as written on throwaway
# clusters of this machine: a primary with WAL archiving serving `idem
# serve`; a base backup taken while it serves; more work; a named restore
# point; more work (lost by the restore); the primary stopped; the base
# backup restored to the restore point (a new timeline); `idem serve` started
# on it. Prints what each phase acknowledged, what the restored database
# holds, and how idem moved the tasks that may have started to
# reconcile-first, judged from the store.
#
# usage: scripts/pg-backup-restore.sh
# env: IDEM_BIN (default: builds `cargo build --release -p idem` and uses
#      $CARGO_TARGET_DIR/release/idem, or target/release/idem),
#      PGBIN (default: pg_config --bindir, else the newest
#      /usr/lib/postgresql/*/bin). As root the PostgreSQL tools run as
#      `postgres` (runuser).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${IDEM_BIN:-}" ]; then
  cargo build --release -p idem --quiet
  IDEM_BIN="${CARGO_TARGET_DIR:-./target}/release/idem"
fi
IDEM_BIN=$(realpath "$IDEM_BIN")
PGBIN=${PGBIN:-$(pg_config --bindir 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
D=$(mktemp -d)
[ "$(id -u)" = 0 ] && chown postgres "$D"
P1=$(free_port); P2=$(free_port)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  for c in primary restored; do
    [ -f "$D/$c/postmaster.pid" ] && as_pg "$PGBIN/pg_ctl" -D "$D/$c" -m immediate -w stop >/dev/null 2>&1 || true
  done
  rm -rf "$D"
}
trap cleanup EXIT
q() { psql -h 127.0.0.1 -p "$1" -U postgres -AtqX -d "$2" -c "$3"; }
export RUST_LOG=warn

echo "== 1. a primary with WAL archiving (port $P1)"
as_pg mkdir "$D/wal"
as_pg "$PGBIN/initdb" -D "$D/primary" -U postgres --auth=trust --no-instructions >/dev/null
cat >> "$D/primary/postgresql.conf" <<CONF
port = $P1
listen_addresses = '127.0.0.1'
unix_socket_directories = '$D'
wal_level = replica
archive_mode = on
archive_command = 'test ! -f $D/wal/%f && cp %p $D/wal/%f'
CONF
as_pg "$PGBIN/pg_ctl" -D "$D/primary" -l "$D/primary.log" -w start >/dev/null
q "$P1" postgres "CREATE DATABASE idem"

STORE="postgres://postgres@127.0.0.1:$P1/idem"
CLIENT=$("$IDEM_BIN" keys create --store "$STORE" --tenant acme --role client)
EXEC=$("$IDEM_BIN" keys create --store "$STORE" --tenant acme --role executor)
serve() { # serve STORE LOG: starts idem serve (in this shell, so cleanup stops it); sets URL
  "$IDEM_BIN" serve --store "$1" --listen 127.0.0.1:0 > "$2.out" 2> "$2" &
  PIDS+=($!)
  until grep -q "idem listening on" "$2.out" 2>/dev/null; do sleep 0.05; done
  URL=$(sed -n 's/^idem listening on //p' "$2.out")
}
serve "$STORE" "$D/serve.log"
submit() { # submit PREFIX N
  for i in $(seq 1 "$2"); do
    curl -fs -o /dev/null -X POST "$URL/v1/tasks" -H "Authorization: Bearer $CLIENT" \
      -H "Idempotency-Key: \"$1-$i\"" \
      -d "{\"operation\":\"payment.release\",\"params\":{\"payee\":\"acct_$i\",\"amount\":$((1000 + i)),\"currency\":\"EUR\"}}"
  done
}
claim() { # claim N: leases N attempts, prints their ids
  for _ in $(seq 1 "$1"); do
    curl -fs -X POST "$URL/v1/attempts/claim" -H "Authorization: Bearer $EXEC" \
      -d '{"executor_id":"worker-1","operations":["payment.release"],"lease_ms":300000}' |
      python3 -c 'import json,sys; [print(a["id"], a["generation"]) for a in json.load(sys.stdin)["attempts"]]'
  done
}
echo "== 2. idem serves it: 50 payments submitted, 20 of them leased"
submit before-base 50
claim 20 > /dev/null

echo "== 3. base backup while idem serves"
as_pg "$PGBIN/pg_basebackup" -h 127.0.0.1 -p "$P1" -U postgres -D "$D/base" -X stream --checkpoint=fast

echo "== 4. after the base backup: 50 payments, 20 leased, 10 of those reported succeeded"
submit after-base 50
claim 20 > "$D/leased-after-base.txt"
head -10 "$D/leased-after-base.txt" | while read -r id gen; do
  curl -fs -o /dev/null -X POST "$URL/v1/attempts/$id/report" -H "Authorization: Bearer $EXEC" \
    -d "{\"generation\":$gen,\"outcome\":\"succeeded\",\"result\":{\"payout\":\"p-$id\"}}"
done
q "$P1" idem "SELECT pg_create_restore_point('before-lost-work')" > /dev/null

echo "== 5. after the restore point (lost by the restore): 50 payments, 10 leased"
submit after-point 50
claim 10 > /dev/null
# The WAL segment holding the restore point is archived once it is switched.
SEG=$(q "$P1" idem "SELECT pg_walfile_name(pg_switch_wal())")
until [ -f "$D/wal/$SEG" ]; do sleep 0.1; done
echo "primary before the disaster: $(q "$P1" idem "SELECT count(*) || ' tasks, ' || count(*) FILTER (WHERE state = 'succeeded') || ' succeeded, timeline ' || ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint FROM tasks")"

echo "== 6. the primary is lost"
kill "${PIDS[0]}"; wait "${PIDS[0]}" 2>/dev/null || true; PIDS=()
as_pg "$PGBIN/pg_ctl" -D "$D/primary" -m immediate -w stop >/dev/null

echo "== 7. the base backup restored to the restore point (port $P2)"
as_pg cp -a "$D/base" "$D/restored"
cat >> "$D/restored/postgresql.conf" <<CONF
port = $P2
archive_mode = off
restore_command = 'cp $D/wal/%f %p'
recovery_target_name = 'before-lost-work'
recovery_target_action = 'promote'
CONF
as_pg touch "$D/restored/recovery.signal"
as_pg "$PGBIN/pg_ctl" -D "$D/restored" -l "$D/restored.log" -w start >/dev/null
until [ "$(q "$P2" postgres "SELECT pg_is_in_recovery()")" = f ]; do sleep 0.1; done

echo "== 8. idem serve on the restored database"
STORE="postgres://postgres@127.0.0.1:$P2/idem"
S0=$(date +%s%3N)
serve "$STORE" "$D/restored-serve.log"
echo "listening after $(( $(date +%s%3N) - S0 )) ms; its log:"
sed -n 's/.*WARN.*\(the store went back in time.*\)/  \1/p' "$D/restored-serve.log" | head -1
grep -o 'from_timeline=[^ ]* to_timeline=[^ ]*\|tasks=[0-9]*' "$D/restored-serve.log" | sed 's/^/  /' | head -2
echo "restored database: tasks by idempotency-key prefix and state"
q "$P2" idem "SELECT split_part(idempotency_key, '-', 1) || '-' || split_part(idempotency_key, '-', 2) AS phase, state, count(*) FROM tasks GROUP BY 1, 2 ORDER BY 1, 2" | sed 's/^/  /'
echo "  payments acknowledged after the restore point still there: $(q "$P2" idem "SELECT count(*) FROM tasks WHERE idempotency_key LIKE 'after-point-%'") of 50"
echo "  store_rewound events: $(q "$P2" idem "SELECT count(*) FROM events WHERE data::jsonb->>'reason' = 'store_rewound'")"
echo "  attempts ended by the rewind: $(q "$P2" idem "SELECT count(*) FROM events WHERE data::jsonb->>'reason' = 'store_rewound' AND data::jsonb->>'ended_attempt_id' IS NOT NULL")"
echo "  recorded identity: $(q "$P2" idem "SELECT 'system ' || system_identifier || ', timeline ' || timeline FROM store_identity")"
echo "first claim on the restored database:"
curl -fs -X POST "$URL/v1/attempts/claim" -H "Authorization: Bearer $EXEC" \
  -d '{"executor_id":"worker-2","operations":["payment.release"],"max":1}' |
  python3 -c 'import json,sys; a=json.load(sys.stdin)["attempts"][0]; print("  kind", a["kind"], "generation", a["generation"])'
