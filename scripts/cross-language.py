#!/usr/bin/env python3
"""Cross-language run (SDKs of three languages against one server); started by scripts/cross-language.sh.

One ``idem serve`` (SQLite), the fake provider of examples/provider with faults
(a share of its answers dropped after the payout was recorded, a 300 ms delay
after recording in which an executor can die with the money moved), a Python client
submitting PAYMENTS payments (some of its own answers lost on the way back),
2 TypeScript worker processes (examples/typescript/payments.mjs worker) and 1
Rust worker process (idem-example-payments worker), of which some are killed
with SIGKILL mid-run and restarted.

Afterwards, read through the API and the provider's ledger:
- every task is terminal;
- the ledger holds at most one payout per task (and per business key), a
  succeeded task exactly one, the one its delivery names; a failed or
  cancelled task none;
- no task was executed twice without a reconcile between: between two
  ``execute`` attempts there is a ``reconcile`` attempt unless the first one
  reported a definite failure (attempt state ``failed``).

Prints a summary; exit status 1 on any violation.

Environment: IDEM_BIN, IDEM_EXAMPLE_BIN (the Rust example binary), PAYMENTS
(default 200), SEED (default 1).
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import idem

REPO = Path(__file__).resolve().parents[1]
OPERATION = "payment.release"
TERMINAL = {"succeeded", "failed", "cancelled"}


def start(cmd: list[str], log: Path, pattern: str, count: int = 1, env: dict | None = None):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.findall(pattern, log.read_text())
        if len(found) >= count:
            return proc, found
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"{cmd} did not start; see {log}:\n{log.read_text()}")


def main() -> int:
    target = os.environ.get("CARGO_TARGET_DIR", str(REPO / "target"))
    idem_bin = os.environ.get("IDEM_BIN", f"{target}/debug/idem")
    example_bin = os.environ.get("IDEM_EXAMPLE_BIN", f"{target}/debug/idem-example-payments")
    payments = int(os.environ.get("PAYMENTS", "200"))
    rng = random.Random(int(os.environ.get("SEED", "1")))
    started = time.monotonic()
    procs: list[subprocess.Popen] = []
    workers: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="idem-cross-") as tmp:
        d = Path(tmp)
        try:
            store = f"sqlite://{d / 'idem.db'}"
            server, urls = start(
                [idem_bin, "serve", "--listen", "127.0.0.1:0", "--store", store, "--sweep-interval-ms", "100"],
                d / "idem.log",
                r"idem listening on (http://\S+)",
                env={
                    **os.environ,
                    "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS": "100",
                    "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS": "500",
                    "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__MAX_ATTEMPTS": "10",
                },
            )
            procs.append(server)
            idem_url = urls[0]

            def key(role: str) -> str:
                return subprocess.run(
                    [idem_bin, "keys", "create", "--tenant", "cross", "--role", role, "--store", store],
                    check=True, capture_output=True, text=True,
                ).stdout.strip()

            client_key, executor_key = key("client"), key("executor")
            provider, urls = start(
                [sys.executable, str(REPO / "examples/provider/provider.py"), "--link-to", idem_url],
                d / "provider.log",
                r"(?:provider|link) listening on (http://\S+)",
                count=2,
            )
            procs.append(provider)
            provider_url, link_url = urls
            prov = httpx.Client(base_url=provider_url, timeout=10)
            prov.post("/faults", json={"drop_ratio": 0.1, "seed": rng.randrange(1 << 30), "delay_ms": 300,
                                       "drop_link_responses": 5}).raise_for_status()

            worker_env = {**os.environ, "IDEM_URL": idem_url, "IDEM_EXECUTOR_KEY": executor_key,
                          "PROVIDER_URL": provider_url, "LEASE_MS": "1500"}
            commands = {
                "ts-1": ["node", str(REPO / "examples/typescript/payments.mjs"), "worker"],
                "ts-2": ["node", str(REPO / "examples/typescript/payments.mjs"), "worker"],
                "rs-1": [example_bin, "worker"],
            }
            restarts = collections.Counter()

            def launch(name: str) -> None:
                log = d / f"worker-{name}-{restarts[name]}.log"
                workers[name], _ = start(commands[name], log, r"worker \S+ (running)",
                                         env={**worker_env, "EXECUTOR_ID": f"{name}.{restarts[name]}"})

            for name in commands:
                launch(name)

            # The Python client: PAYMENTS payments through the lossy link.
            agent = idem.Client(link_url, client_key, retry=idem.RetryPolicy(max_tries=6, initial_backoff=0.05))
            submitted: dict[str, str] = {}
            retried = 0
            kills = 0
            kill_at = sorted(rng.sample(range(10, payments), 4))
            for i in range(payments):
                k = f"payout-{i:04d}"
                s = agent.submit(OPERATION, {"payee": f"acct-{i % 17}", "amount": 100 + i, "currency": "EUR"}, k)
                submitted[s.task.id] = k
                retried += s.tries > 1
                if kill_at and i == kill_at[0]:
                    kill_at.pop(0)
                    victim = ("ts-1", "rs-1", "ts-2", "rs-1")[kills % 4]
                    time.sleep(0.1)  # let it be inside an attempt
                    workers[victim].send_signal(signal.SIGKILL)
                    workers[victim].wait()
                    kills += 1
                    restarts[victim] += 1
                    launch(victim)
            print(f"submitted {len(submitted)} payments ({len(set(submitted.values()))} keys, "
                  f"{retried} retried after a lost answer); "
                  f"killed {kills} worker processes with SIGKILL and restarted them: {dict(restarts)}", flush=True)

            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                open_tasks = [t for t in agent.list(operation=OPERATION) if t.state not in TERMINAL]
                if not open_tasks:
                    break
                time.sleep(0.5)

            tasks = list(agent.list(operation=OPERATION))
            ledger = prov.get("/ledger").json()
            by_key = collections.defaultdict(list)
            by_reference = collections.defaultdict(list)
            for p in ledger["payouts"]:
                by_key[p["key"]].append(p)
                by_reference[p["reference"]].append(p)

            violations: list[str] = []
            states = collections.Counter(t.state for t in tasks)
            kinds = collections.Counter()
            executors = collections.Counter()
            reconciled = 0
            if retried == 0:
                violations.append("no submit answer was lost (no submit retried)")
            if len(tasks) != payments or set(submitted) != {t.id for t in tasks}:
                violations.append(f"{len(tasks)} tasks for {payments} submitted payments")
            for t in tasks:
                if t.state not in TERMINAL:
                    violations.append(f"task {t.id} is {t.state}, not terminal")
                paid = by_key.get(t.id, [])
                for_key = by_reference.get(t.idempotency_key, [])
                if len(paid) > 1 or len(for_key) > 1:
                    violations.append(
                        f"task {t.id}: {len(paid)} payouts under its id, {len(for_key)} for its key {t.idempotency_key}"
                    )
                if t.state == "succeeded" and (len(paid) != 1 or t.delivery is None
                                               or t.delivery.external_txn_id != paid[0]["id"]):
                    violations.append(f"task {t.id} succeeded, but its payouts are {paid}")
                if t.state in ("failed", "cancelled") and paid:
                    violations.append(f"task {t.id} {t.state}, but the provider paid {paid}")
                attempts = sorted(agent.attempts(t.id), key=lambda a: a.number)
                kinds.update(f"{a.kind}:{a.state}" for a in attempts)
                executors.update(a.executor_id for a in attempts)
                reconciled += any(a.kind == "reconcile" for a in attempts)
                last_execute = None
                for a in attempts:
                    if a.kind == "reconcile":
                        last_execute = None
                    elif a.kind == "execute":
                        if last_execute is not None and last_execute.state != "failed":
                            violations.append(
                                f"task {t.id}: execute attempt {a.number} follows execute attempt "
                                f"{last_execute.number} ({last_execute.state}) with no reconcile between"
                            )
                        last_execute = a

            print(f"tasks: {len(tasks)}, states {dict(states)}; {reconciled} reconciled", flush=True)
            print(f"attempts (kind:state): {dict(sorted(kinds.items()))}", flush=True)
            print(f"provider: {len(ledger['payouts'])} payouts, {ledger['pay_requests']} pay requests, "
                  f"{ledger['lookups']} lookups, {ledger['dropped']} answers dropped after commit", flush=True)
            print(f"attempts per executor: {dict(sorted(executors.items()))}; "
                  f"{len(commands)} worker processes (2 TypeScript, 1 Rust), {kills} SIGKILLs; "
                  f"{time.monotonic() - started:.1f} s", flush=True)
            # A run that exercised neither fault proves nothing.
            if not any(k.startswith("execute:expired") for k in kinds):
                violations.append("no attempt was cut by a killed worker (no expired execute attempt)")
            if not kinds.get("execute:unknown"):
                violations.append("no provider answer was lost (no unknown execute attempt)")
            for v in violations[:20]:
                print(f"VIOLATION {v}", flush=True)
            if violations:
                print(f"{len(violations)} violation(s); logs were in {d}", flush=True)
                for log in sorted(d.glob("*.log")):
                    print(f"--- {log.name} (tail)\n" + "\n".join(log.read_text().splitlines()[-15:]), flush=True)
                return 1
            print("every task terminal, at most one payout per task, no execute repeated without a reconcile", flush=True)
            return 0
        finally:
            for p in [*workers.values(), *procs]:
                if p.poll() is None:
                    p.terminate()
            for p in [*workers.values(), *procs]:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


if __name__ == "__main__":
    sys.exit(main())
