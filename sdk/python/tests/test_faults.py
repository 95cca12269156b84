"""The worker's lease, report and shutdown rules under injected faults, on
SQLite and on PostgreSQL, with the worker talking to ``idem serve`` through the
fault-injecting proxy (``FaultProxy``), judged by the attempts the store shows:

- heartbeats failing (503, connection reset, never answered): the handler is
  signalled before the server's lease end, and the next attempt is leased after
  the signal;
- a revoked key (401) or a stale generation (409) on a heartbeat signals at once;
- a 1 MiB exception message is reported trimmed, a result too large to report
  is reported all the same (as ``unknown``), never dropped;
- a worker process stopped by SIGTERM while its long-poll is open releases the
  task that poll still brings: another executor runs it at once;
- claims answered 503 ``OVERLOADED`` with ``Retry-After``: the next claim waits
  at least that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
from conftest import Faulty, Tenant, key, payment, serving

import idem
from idem import Cancelled, Committed, Context, NotCommitted, Worker

#: Rounds of each heartbeat fault per store, run at once (each its own task and attempt).
ROUNDS = 20
LEASE_MS = 2000


def wall(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


async def until(condition: Any, within: float = 20.0) -> None:
    """Polls ``condition()`` every 20 ms, in a thread (the workers under test share
    this event loop), until it holds (fails after ``within`` s)."""
    deadline = time.monotonic() + within
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def forwarded(faulty: Faulty, route: str) -> int:
    return faulty.proxy.counts().get(route, {}).get("forwarded", 0)


class UntilSignalled:
    """A task's first attempt runs until its ``cancelled_event``; notes when it
    fired (``ctx.lease_lost_at``, wall clock) and stops with ``Cancelled()`` (nothing is reported for a
    lost lease). Later attempts (a lease lost before the faults began, on a
    slow store) end at once, as executor B's do."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.contexts: dict[str, Context] = {}
        self.signalled: dict[str, float] = {}
        self.all_started = asyncio.Event()

    async def execute(self, ctx: Context) -> Any:
        if ctx.number > 1:
            return {"by": "a"}
        self.contexts[ctx.task_id] = ctx
        if len(self.contexts) == self.rounds:
            self.all_started.set()
        await asyncio.wait_for(ctx.cancelled_event.wait(), 15)
        assert ctx.lease_lost_at is not None
        self.signalled[ctx.task_id] = ctx.lease_lost_at
        return Cancelled()

    async def reconcile(self, ctx: Context) -> Any:
        return NotCommitted()


class Succeeds:
    """Executor B: finds nothing committed, then executes."""

    async def execute(self, ctx: Context) -> Any:
        return {"by": "b"}

    async def reconcile(self, ctx: Context) -> Any:
        return NotCommitted()


@pytest.mark.parametrize("mode", ["503", "reset", "hang"])
def test_failing_heartbeats_signal_the_handler_before_the_server_lease_ends(faulty: Faulty, mode: str) -> None:
    t = faulty.tenant()
    faulty.proxy.set({})
    a = UntilSignalled(ROUNDS)

    async def scenario() -> list[tuple[str, list[idem.Attempt]]]:
        async with (
            idem.AsyncClient(faulty.proxy.url, t.executor_key) as ex_a,
            t.executor() as ex_b,
            t.async_client() as client,
        ):
            worker_a = Worker(
                ex_a, "executor-a", {"payment.release": a}, concurrency=ROUNDS, lease_ms=LEASE_MS, claim_wait_ms=1000
            )
            async with serving(worker_a):
                ids = [(await client.submit("payment.release", payment(1 + n), key())).task.id for n in range(ROUNDS)]
                await asyncio.wait_for(a.all_started.wait(), 20)
                # Every lease confirmed by a heartbeat in the handler's time, then heartbeats fail
                # (and executor A claims nothing more).
                beats = await asyncio.to_thread(forwarded, faulty, "heartbeat")
                # (A lease lost early, on a busy machine, ends the wait: that round is judged all the same.)
                await until(lambda: forwarded(faulty, "heartbeat") >= beats + ROUNDS or bool(a.signalled))
                await asyncio.to_thread(faulty.proxy.set, {"heartbeat": mode, "claim": "503"})
                worker_b = Worker(ex_b, "executor-b", {"payment.release": Succeeds()}, concurrency=ROUNDS)
                async with serving(worker_b):
                    for task_id in ids:
                        assert (await client.get(task_id, wait=20)).state == "succeeded"
            faulty.proxy.set({})
            return [(task_id, await client.attempts(task_id)) for task_id in ids]

    rounds = asyncio.run(scenario())
    lease_gaps, next_gaps = [], []
    for task_id, attempts in rounds:
        first, following = attempts[0], attempts[1]
        assert first.executor_id == "executor-a" and first.state == "expired"
        assert task_id in a.signalled, "the handler was never signalled"
        signalled = wall(a.signalled[task_id])
        assert signalled < first.lease_expires_at, f"signalled at {signalled}, lease ended {first.lease_expires_at}"
        assert following.leased_at > signalled, f"next attempt leased at {following.leased_at}, signal at {signalled}"
        lease_gaps.append((first.lease_expires_at - signalled).total_seconds())
        next_gaps.append((following.leased_at - signalled).total_seconds())
    print(
        f"\n[python {faulty.kind} heartbeat {mode}] {ROUNDS} rounds: min(lease end - signal) "
        f"{min(lease_gaps) * 1000:.0f} ms, min(next attempt leased - signal) {min(next_gaps) * 1000:.0f} ms"
    )


class SignalledOnce:
    """Starts, then waits for ``cancelled_event``, noting when it fired; a
    second execute succeeds. ``reconcile`` waits the same way."""

    def __init__(self, first: Any = None) -> None:
        self.started = asyncio.Event()
        self.signalled: float | None = None
        self.ctx: Context | None = None
        self.first = first

    async def _wait(self, ctx: Context) -> Any:
        self.ctx = ctx
        self.started.set()
        await asyncio.wait_for(ctx.cancelled_event.wait(), 15)
        self.signalled = time.monotonic()
        return Cancelled()

    async def execute(self, ctx: Context) -> Any:
        if self.first is not None and ctx.number == 1:
            raise self.first
        if ctx.number > 1 and self.first is not None:
            return {"again": ctx.number}
        return await self._wait(ctx)

    async def reconcile(self, ctx: Context) -> Any:
        return await self._wait(ctx)


async def heartbeats_until_signalled(faulty: Faulty, handler: SignalledOnce, lose: Any) -> int:
    """Heartbeats the proxy forwarded from ``lose()`` (the lease taken away)
    until the handler's signal; waits first for one heartbeat in the handler's time."""
    await asyncio.wait_for(handler.started.wait(), 20)
    beats = await asyncio.to_thread(forwarded, faulty, "heartbeat")
    await until(lambda: forwarded(faulty, "heartbeat") > beats)
    before = await asyncio.to_thread(forwarded, faulty, "heartbeat")
    await asyncio.to_thread(lose)
    await until(lambda: handler.signalled is not None)
    return await asyncio.to_thread(forwarded, faulty, "heartbeat") - before


# A long lease (heartbeat every 2 s, local deadline 5.4 s after each): only the answer can signal.
LONG_LEASE_MS = 6000


def test_a_revoked_key_signals_the_handler_at_the_next_heartbeat(
    faulty: Faulty, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"t-revoke-{os.getpid()}-{time.monotonic_ns()}"
    executor_key, key_id = faulty.server.create_key_with_id(name, "executor")
    t = Tenant(name, faulty.server.url, faulty.server.create_key(name, "client"), executor_key)
    faulty.proxy.set({})
    handler = SignalledOnce()

    counted: list[int] = []

    async def scenario() -> None:
        async with idem.AsyncClient(faulty.proxy.url, t.executor_key) as ex, t.async_client() as client:
            # Its next claim is refused (401) too: the worker then stops with that error.
            with contextlib.suppress(idem.UnauthenticatedError):
                async with serving(Worker(ex, "w-revoked", {"generation.dispatch": handler}, lease_ms=LONG_LEASE_MS)):
                    await client.submit("generation.dispatch", {"n": 1}, key())
                    counted.append(
                        await heartbeats_until_signalled(faulty, handler, lambda: faulty.server.revoke(key_id))
                    )

    with caplog.at_level(logging.WARNING, logger="idem.worker"):
        asyncio.run(scenario())
    (beats,) = counted
    assert handler.ctx is not None and handler.ctx.lease_lost
    assert beats <= 2, f"{beats} heartbeats after the revocation before the signal (one in flight, one answered 401)"
    assert any("401" in r.getMessage() and "lease lost" in r.getMessage() for r in caplog.records), caplog.text


def test_a_stale_generation_signals_the_handler_at_the_next_heartbeat(
    faulty: Faulty, caplog: pytest.LogCaptureFixture
) -> None:
    t = faulty.tenant()
    admin = faulty.server.create_key(t.name, "admin")
    faulty.proxy.set({})
    handler = SignalledOnce(first=idem.UnknownOutcomeError("no answer from the provider"))

    async def scenario() -> tuple[int, idem.Task]:
        async with (
            idem.AsyncClient(faulty.proxy.url, t.executor_key) as ex,
            t.async_client() as client,
            serving(Worker(ex, "w-stale", {"payment.release": handler}, lease_ms=LONG_LEASE_MS)),
        ):
            task = (await client.submit("payment.release", payment(), key())).task

            def resolve() -> None:
                # An operator's manual reconciliation raises the generation under the live reconcile attempt.
                r = httpx.post(
                    f"{faulty.server.url}/v1/tasks/{task.id}/resolve",
                    json={"outcome": "not_committed", "reason": "checked at the provider"},
                    headers={"Authorization": f"Bearer {admin}"},
                    timeout=10,
                )
                assert r.status_code == 200, r.text

            beats = await heartbeats_until_signalled(faulty, handler, resolve)
            return beats, await client.get(task.id, wait=15)

    with caplog.at_level(logging.WARNING, logger="idem.worker"):
        beats, task = asyncio.run(scenario())
    assert handler.ctx is not None and handler.ctx.kind == "reconcile" and handler.ctx.lease_lost
    assert beats <= 2, f"{beats} heartbeats after the resolve before the signal (one in flight, one answered 409)"
    assert any("409" in r.getMessage() and "lease lost" in r.getMessage() for r in caplog.records), caplog.text
    assert task.state == "succeeded" and task.delivery.result == {"again": 3}


def test_a_one_mib_exception_message_is_reported_trimmed(faulty: Faulty) -> None:
    t = faulty.tenant()
    faulty.proxy.set({})

    class Huge:
        async def execute(self, ctx: Context) -> Any:
            raise idem.InvalidInputError("é" * (1 << 20))

        async def reconcile(self, ctx: Context) -> Any:
            raise AssertionError("not expected")

    async def scenario() -> tuple[idem.Task, list[idem.Attempt]]:
        async with (
            idem.AsyncClient(faulty.proxy.url, t.executor_key) as ex,
            t.async_client() as client,
            serving(Worker(ex, "w-huge", {"generation.dispatch": Huge()}, lease_ms=LONG_LEASE_MS)),
        ):
            task = (await client.submit("generation.dispatch", {"n": 1}, key())).task
            task = await client.get(task.id, wait=15)
            return task, await client.attempts(task.id)

    task, (attempt,) = asyncio.run(scenario())
    assert (task.state, task.failure.class_) == ("failed", "invalid_input")
    assert attempt.state == "failed"
    message = attempt.evidence[0].body["message"]
    assert message == "é" * idem.worker.MESSAGE_LIMIT


def test_a_result_too_large_to_report_is_reported_unknown_and_reconciled(faulty: Faulty) -> None:
    t = faulty.tenant()
    faulty.proxy.set({})

    class HugeResult:
        async def execute(self, ctx: Context) -> Any:
            return {"blob": "x" * (1 << 20)}

        async def reconcile(self, ctx: Context) -> Any:
            return Committed({"found": True})

    async def scenario() -> tuple[idem.Task, list[idem.Attempt]]:
        async with (
            idem.AsyncClient(faulty.proxy.url, t.executor_key) as ex,
            t.async_client() as client,
            serving(Worker(ex, "w-big", {"payment.release": HugeResult()}, lease_ms=LONG_LEASE_MS)),
        ):
            task = (await client.submit("payment.release", payment(), key())).task
            task = await client.get(task.id, wait=15)
            return task, await client.attempts(task.id)

    task, attempts = asyncio.run(scenario())
    assert [(a.kind, a.state) for a in attempts] == [("execute", "unknown"), ("reconcile", "committed")]
    assert attempts[0].evidence[0].body["message"] == "the result is too large to report"
    assert task.state == "succeeded" and task.delivery.result == {"found": True}


STOPPING_WORKER = textwrap.dedent("""
    import asyncio, logging, sys
    import idem

    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("idem.worker").setLevel(logging.INFO)

    class Held:
        async def execute(self, ctx):
            if ctx.params.get("hold"):
                print("started", flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            return {"by": "stopping"}

        async def reconcile(self, ctx):
            return idem.NotCommitted()

    url, key = sys.argv[1:]
    worker = idem.Worker(
        idem.AsyncClient(url, key), "w-stopping", {"generation.dispatch": Held()},
        concurrency=2, lease_ms=5000, grace=20, claim_wait_ms=20000,
    )
    worker.run()
    print("exited", flush=True)
""")

SHUTDOWN_ROUNDS = 50


def shutdown_round(faulty: Faulty) -> float:
    """One round; returns the time from the released task's arrival to another executor's lease, s."""
    t = faulty.tenant()
    with t.client() as client, idem.Client(t.url, t.executor_key) as other:
        client.submit("generation.dispatch", {"hold": True}, key())
        proc = subprocess.Popen(
            [sys.executable, "-c", STOPPING_WORKER, faulty.proxy.url, t.executor_key],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            while (line := proc.stdout.readline().strip()) != "started":
                assert line, "the worker ended before its handler started"
            # The handler runs; the worker's second slot waits in a long-poll.
            proc.send_signal(signal.SIGTERM)
            # The task arrives once the worker's shutdown began (before, it would be run).
            while not (line := proc.stdout.readline()).startswith("stopping:"):
                assert line, "the worker ended before its shutdown began"
            arrived = client.submit("generation.dispatch", {"n": 2}, key()).task
            # Once the stopping worker holds it, another executor waits for it (a long-poll).
            deadline = time.monotonic() + 10
            while not client.attempts(arrived.id):
                assert time.monotonic() < deadline, "the open claim did not lease the task"
                time.sleep(0.01)
            (attempt,) = other.claim("w-other", ["generation.dispatch"], lease_ms=5000, wait_ms=5000)
            assert attempt.task_id == arrived.id
            other.report(attempt.id, {"generation": attempt.generation, "outcome": "succeeded", "result": {}})
            proc.stdin.write("\n")
            proc.stdin.flush()
            out, _ = proc.communicate(timeout=20)
        finally:
            proc.kill()
        assert proc.returncode == 0 and out.strip().endswith("exited"), out
        released, ran = client.attempts(arrived.id)
        assert (released.executor_id, released.state, released.evidence) == ("w-stopping", "released", [])
        assert (ran.kind, ran.executor_id, ran.state) == ("execute", "w-other", "succeeded")
        return (ran.leased_at - client.get(arrived.id).created_at).total_seconds()


def test_a_worker_stopped_by_sigterm_releases_the_task_its_open_claim_brings(faulty: Faulty) -> None:
    faulty.proxy.set({})
    with ThreadPoolExecutor(max_workers=5) as pool:
        waits = list(pool.map(lambda _: shutdown_round(faulty), range(SHUTDOWN_ROUNDS)))
    # Released, not expired: another executor had it before the stopping worker's 5 s lease could
    # have run out (the time itself is printed, not judged: speed is never asserted).
    assert max(waits) < 5.0, f"claimed by another executor {max(waits):.3f} s after its arrival"
    print(f"\n[python {faulty.kind} SIGTERM] {SHUTDOWN_ROUNDS} rounds: max(arrival to next lease) {max(waits):.3f} s")


def test_an_overloaded_claim_is_retried_after_its_retry_after(faulty: Faulty, caplog: pytest.LogCaptureFixture) -> None:
    """Claims answered 503 ``OVERLOADED`` with ``Retry-After: 2``: the worker
    sends its next claim no sooner than that, rather than after its own shorter
    pause (judged by when the worker logged each failed claim: the answer of the
    next one comes after the pause and a round trip)."""
    t = faulty.tenant()
    faulty.proxy.set({"claim": "503-overloaded"})
    caplog.set_level(logging.WARNING, logger="idem.worker")

    def failed() -> list[float]:
        return [
            r.created for r in caplog.records if "claim failed" in r.getMessage() and "OVERLOADED" in r.getMessage()
        ]

    async def scenario() -> None:
        async with (
            idem.AsyncClient(faulty.proxy.url, t.executor_key) as ex,
            serving(Worker(ex, "w-overloaded", {"generation.dispatch": Succeeds()}, claim_wait_ms=1000)),
        ):
            await until(lambda: len(failed()) >= 3)

    try:
        asyncio.run(scenario())
    finally:
        faulty.proxy.set({})
    first, second, third = failed()[:3]
    for gap in (second - first, third - second):
        assert gap >= 2.0, f"the next claim failed {gap:.3f} s after an OVERLOADED"
