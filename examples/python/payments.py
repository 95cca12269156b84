#!/usr/bin/env python3
"""The payment story of ``idem-lab demo``, told by an executor written with the
Python SDK against a real ``idem serve`` and the fake provider of
examples/provider.

    examples/python/run.sh          # a virtualenv with ./sdk/python, then this

It starts ``idem serve`` on a temporary SQLite store (binary: ``$IDEM_BIN``,
else ``${CARGO_TARGET_DIR:-target}/debug/idem``), creates a client and an executor key, starts the
provider (with a relay to idem that can lose answers), runs a worker whose
``payment.release`` handler pays through the provider with the task id as the
provider's idempotency key, and plays four scenes, checking each. Exit status
0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import idem

REPO = Path(__file__).resolve().parents[2]
OPERATION = "payment.release"
FAILED: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)


def check(ok: bool, what: str) -> None:
    say(f"    {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        FAILED.append(what)


def eur(cents: int) -> str:
    return f"EUR {cents / 100:.2f}"


def start(
    cmd: list[str], log: Path, pattern: str, env: dict | None = None, count: int = 1
) -> tuple[subprocess.Popen, list[str]]:
    """Starts ``cmd`` with stdout in ``log``; waits for ``count`` matches of ``pattern``."""
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
    raise RuntimeError(f"{cmd[0]} did not start; see {log}:\n{log.read_text()}")


class Payout:
    """The executor's handler: pays through the provider, idempotent by task id."""

    def __init__(self, provider: str) -> None:
        self.http = httpx.AsyncClient(base_url=provider, timeout=10)

    async def execute(self, ctx: idem.Context):
        p = ctx.params
        body = {"payee": p["payee"], "amount": p["amount"], "currency": p["currency"], "reference": ctx.idempotency_key}
        try:
            r = await self.http.post("/payouts", json=body, headers={"Idempotency-Key": ctx.task_id})
        except httpx.TransportError as e:
            # The request may have been committed: only a reconcile can tell.
            raise idem.UnknownOutcomeError(f"the provider's answer was lost: {e!r}") from e
        r.raise_for_status()
        payout = r.json()
        if p.get("hold_until_cancelled"):
            # Scene (d): the money has moved; wait until idem tells us of the
            # cancel request, then finish anyway (it is too late to undo).
            try:
                await asyncio.wait_for(ctx.cancelled_event.wait(), 15)
            except asyncio.TimeoutError:
                pass
            say(f"    executor: cancel requested = {ctx.cancel_requested}, but payout {payout['id']} is already made; reporting it")
        return idem.Succeeded({"payout": payout["id"]}, external_txn_id=payout["id"])

    async def reconcile(self, ctx: idem.Context):
        r = await self.http.get(f"/payouts/{ctx.task_id}")
        if r.status_code == 404:
            say(f"    executor: reconcile attempt {ctx.number}: the provider has no payout for the task")
            return idem.NotCommitted()
        r.raise_for_status()
        payout = r.json()
        say(f"    executor: reconcile attempt {ctx.number}: the provider has payout {payout['id']}")
        return idem.Committed({"payout": payout["id"]}, external_txn_id=payout["id"])


async def story(idem_url: str, link_url: str, provider_url: str, client_key: str, executor_key: str) -> None:
    prov = httpx.AsyncClient(base_url=provider_url, timeout=10)
    # The agent talks to idem through the relay that can lose answers.
    agent = idem.AsyncClient(link_url, client_key, retry=idem.RetryPolicy(max_tries=4, initial_backoff=0.1, max_backoff=1.0))
    worker = idem.Worker(
        idem.AsyncClient(idem_url, executor_key),
        "payouts-py",
        {OPERATION: Payout(provider_url)},
        concurrency=4,
        lease_ms=3000,
        claim_wait_ms=1000,
    )
    running = asyncio.create_task(worker.serve())

    async def payouts_for(task_id: str) -> list[dict]:
        ledger = (await prov.get("/ledger")).json()
        return [p for p in ledger["payouts"] if p["key"] == task_id]

    try:
        # (a) The answer is lost; the same request with the same key names the same task.
        say("(a) A payout submitted, its answer lost, retried with the same key")
        params = {"payee": "acct-alice", "amount": 1250, "currency": "EUR"}
        await prov.post("/faults", json={"drop_link_responses": 1})
        a = await agent.submit(OPERATION, params, "invoice-A", wait=10)
        say(
            f"    agent: released {eur(1250)} to acct-alice under key invoice-A; the first answer was lost, "
            f"{a.tries} tries in all: task {a.task.id[-8:]}, replayed = {a.replayed}, {a.task.state}"
        )
        found = await agent.find(OPERATION, "invoice-A")
        paid = await payouts_for(a.task.id)
        check(a.tries >= 2 and a.replayed and not a.looked_up, "the retry was answered with the same task, replayed")
        check(found.id == a.task.id and a.task.state == "succeeded", "the key names that one task, succeeded")
        check(len(paid) == 1, f"the provider paid once ({len(paid)} payout)")

        # (b) The same key with a changed payee is refused.
        say("(b) The same key with the payee changed")
        try:
            await agent.submit(OPERATION, {**params, "payee": "acct-mallory"}, "invoice-A")
            say("    agent: accepted?!")
            check(False, "a changed payee is refused")
        except idem.IdempotencyConflictError as e:
            say(f"    agent: refused {e.status} {e.code}, task {str(e.task_id)[-8:]}, differing in {e.differing_fields}")
            check(
                e.code == "IDEMPOTENCY_CONFLICT" and e.differing_fields == ["/payee"] and e.task_id == a.task.id,
                "refused with IDEMPOTENCY_CONFLICT naming the task, differing in /payee",
            )
        check(len(await payouts_for(a.task.id)) == 1, "the provider's ledger is unchanged")

        # (c) The provider commits, its answer is lost: unknown outcome, reconcile, delivered once.
        say("(c) The provider commits but its answer is lost")
        await prov.post("/faults", json={"drop_response_after_commit": ["invoice-C"]})
        c = await agent.submit(OPERATION, {"payee": "acct-bob", "amount": 4200, "currency": "EUR"}, "invoice-C")
        task = await agent.get(c.task.id, wait=20)
        attempts = await agent.attempts(task.id)
        kinds = [(x.kind, x.state) for x in attempts]
        paid = await payouts_for(task.id)
        say(
            f"    agent: task {task.id[-8:]} is {task.state}, attempts {kinds}, "
            f"delivered transaction {task.delivery.external_txn_id if task.delivery else None}"
        )
        check(
            [k for k, _ in kinds] == ["execute", "reconcile"],
            "the lost answer led to a reconcile, not to a second execute",
        )
        check(
            task.state == "succeeded" and len(paid) == 1 and task.delivery is not None
            and task.delivery.external_txn_id == paid[0]["id"],
            "the reconcile found the payout: delivered once, one payout in the ledger",
        )

        # (d) A cancel that loses to delivery.
        say("(d) A cancel that arrives while the payout is being made")
        d = await agent.submit(
            OPERATION, {"payee": "acct-carol", "amount": 990, "currency": "EUR", "hold_until_cancelled": True}, "invoice-D"
        )
        deadline = time.monotonic() + 15
        while not await payouts_for(d.task.id) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cancel = await agent.cancel(d.task.id)
        say(f"    agent: the provider has paid; cancel → {cancel.status} {cancel.cancellation.status}")
        task = await agent.get(d.task.id, wait=20)
        events = [e.type async for e in agent.events(task.id)]
        charge = task.delivery.charge if task.delivery else None
        say(
            f"    agent: task {task.id[-8:]} is {task.state}, cancellation {task.cancellation.status if task.cancellation else None}, "
            f"delivery charge {charge}, events {events}"
        )
        check(cancel.status == 202 and cancel.cancellation.status == "requested", "the cancel was recorded while the attempt ran")
        check(
            task.state == "succeeded" and task.cancellation is not None and task.cancellation.status == "too_late"
            and "cancel_too_late" in events,
            "delivery won: the cancellation is too_late (cancel_too_late)",
        )
        check(
            task.delivery is not None and charge == task.contract.get("price") and events.count("delivered") == 1
            and len(await payouts_for(task.id)) == 1,
            "delivered once, charged the contract price, one payout",
        )

        # The ledger: one payout per task, none for a refused request.
        ledger = (await prov.get("/ledger")).json()
        tasks = [t async for t in agent.list(operation=OPERATION)]
        per_task = {t.id: sum(p["key"] == t.id for p in ledger["payouts"]) for t in tasks}
        say(
            f"Ledger: {len(ledger['payouts'])} payouts for {len(tasks)} tasks, "
            f"{ledger['pay_requests']} pay requests, {ledger['lookups']} lookups, {ledger['dropped']} answers dropped"
        )
        check(
            all(n == 1 for n in per_task.values()) and len(ledger["payouts"]) == len(tasks),
            "exactly one payout per task",
        )
    finally:
        worker.stop()
        await asyncio.wait_for(running, 10)


def main() -> int:
    target = os.environ.get("CARGO_TARGET_DIR", str(REPO / "target"))
    idem_bin = os.environ.get("IDEM_BIN", str(Path(target) / "debug" / "idem"))
    with tempfile.TemporaryDirectory(prefix="idem-example-py-") as tmp:
        d = Path(tmp)
        store = f"sqlite://{d / 'idem.db'}"
        env = {
            **os.environ,
            "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS": "50",
            "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS": "200",
        }
        procs: list[subprocess.Popen] = []
        try:
            server, urls = start(
                [idem_bin, "serve", "--listen", "127.0.0.1:0", "--store", store, "--sweep-interval-ms", "50"],
                d / "idem.log",
                r"idem listening on (http://\S+)",
                env,
            )
            procs.append(server)
            idem_url = urls[0]
            keys = {
                role: subprocess.run(
                    [idem_bin, "keys", "create", "--tenant", "acme", "--role", role, "--store", store],
                    check=True, capture_output=True, text=True,
                ).stdout.strip()
                for role in ("client", "executor")
            }
            provider, urls = start(
                [sys.executable, str(REPO / "examples" / "provider" / "provider.py"), "--link-to", idem_url],
                d / "provider.log",
                r"(?:provider|link) listening on (http://\S+)",
                count=2,
            )
            procs.append(provider)
            provider_url, link_url = urls[0], urls[1]
            say(f"idem at {idem_url}, provider at {provider_url}, the agent's lossy link at {link_url}")
            asyncio.run(story(idem_url, link_url, provider_url, keys["client"], keys["executor"]))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    if FAILED:
        say(f"{len(FAILED)} check(s) failed: {FAILED}")
        return 1
    say("Every check held.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
