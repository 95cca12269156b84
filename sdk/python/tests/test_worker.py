"""The worker against a real idem: leases kept by
heartbeats, cancellation and lease loss told to the handler, exceptions mapped
so that a non-safe class is reconciled before anything repeats, transient
failures retried after backoff, and a shutdown that claims nothing more."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

from conftest import DISPATCH_BACKOFF_MS, Tenant, key, payment, serving

import idem
from idem import Cancelled, Committed, Context, NotCommitted, Worker


class Recorder:
    """A handler that records its calls (kind, attempt number, and what it saw)
    and runs ``on_execute`` / ``on_reconcile``."""

    def __init__(self, on_execute: Any = None, on_reconcile: Any = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.contexts: list[Context] = []
        self.started = asyncio.Event()
        self._execute = on_execute
        self._reconcile = on_reconcile

    async def execute(self, ctx: Context) -> Any:
        self.calls.append(("execute", ctx.number))
        self.contexts.append(ctx)
        self.started.set()
        return await self._execute(ctx, len([c for c in self.calls if c[0] == "execute"]))

    async def reconcile(self, ctx: Context) -> Any:
        self.calls.append(("reconcile", ctx.number))
        self.contexts.append(ctx)
        return await self._reconcile(ctx)


def event_types(client: idem.Client, task_id: str) -> list[str]:
    return [e.type for e in client.events(task_id)]


def run_one(tenant: Tenant, operation: str, params: dict, handler: Recorder) -> idem.Task:
    """Submits one task, runs a worker with ``handler`` until the task is terminal."""

    async def scenario() -> idem.Task:
        async with (
            tenant.executor() as ex,
            tenant.async_client() as client,
            serving(Worker(ex, "w", {operation: handler}, lease_ms=5000)),
        ):
            task = (await client.submit(operation, params, key())).task
            return await client.get(task.id, wait=15)

    return asyncio.run(scenario())


def test_a_heartbeating_handler_keeps_its_lease_past_three_leases(tenant: Tenant) -> None:
    # 1.5 s: each heartbeat may take up to 500 ms before the local deadline (lease less 500 ms) passes.
    lease_ms = 1500

    async def slow(ctx: Context, n: int) -> Any:
        ctx.record_usage(5)
        await asyncio.sleep(3.2 * lease_ms / 1000)
        return {"ok": True, "lease_lost": ctx.lease_lost}

    handler = Recorder(slow)

    async def scenario() -> tuple[idem.Task, float]:
        async with (
            tenant.executor() as ex,
            tenant.async_client() as client,
            serving(Worker(ex, "w-lease", {"generation.dispatch": handler}, lease_ms=lease_ms)),
        ):
            task = (await client.submit("generation.dispatch", {"n": 1}, key())).task
            started = time.monotonic()
            task = await client.get(task.id, wait=15)
            return task, time.monotonic() - started

    task, took = asyncio.run(scenario())
    assert took > 3 * lease_ms / 1000
    assert task.state == "succeeded" and task.delivery.result == {"ok": True, "lease_lost": False}
    assert task.attempt_count == 1 and task.usage == 5
    with tenant.client() as client:
        (attempt,) = client.attempts(task.id)
        assert attempt.state == "succeeded"
        assert "lease_expired" not in event_types(client, task.id)


def test_a_cancel_reaches_the_running_handler_within_one_heartbeat_interval(tenant: Tenant) -> None:
    lease_ms = 1000
    interval = lease_ms / 3000
    seen_at: list[float] = []

    async def until_cancelled(ctx: Context, n: int) -> Any:
        ctx.record_usage(7)
        await asyncio.wait_for(ctx.cancelled_event.wait(), 10)
        seen_at.append(time.monotonic())
        return Cancelled()

    handler = Recorder(until_cancelled)

    async def scenario() -> tuple[idem.Task, float, int]:
        async with (
            tenant.executor() as ex,
            tenant.async_client() as client,
            serving(Worker(ex, "w-cancel", {"generation.dispatch": handler}, lease_ms=lease_ms)),
        ):
            task = (await client.submit("generation.dispatch", {"n": 1}, key())).task
            await asyncio.wait_for(handler.started.wait(), 10)
            asked = time.monotonic()
            answer = await client.cancel(task.id)
            task = await client.get(task.id, wait=10)
            return task, seen_at[0] - asked, answer.status

    task, delay, status = asyncio.run(scenario())
    assert status == 202, "recorded, pending while the handler runs"
    assert delay <= interval + 0.25, f"seen {delay:.3f} s after the request; a heartbeat interval is {interval:.3f} s"
    ctx = handler.contexts[0]
    assert ctx.cancel_requested and not ctx.lease_lost
    assert task.state == "cancelled" and task.cancellation.status == "confirmed"
    assert task.usage == 7, "usage kept"
    assert task.cancellation.fee == 5 + 7, "generation.dispatch: 5 after start + usage x 1"


def test_an_exception_on_payment_release_is_reconciled_before_any_second_execute(tenant: Tenant) -> None:
    async def crash_once(ctx: Context, n: int) -> Any:
        if n == 1:
            raise ConnectionResetError("the provider hung up mid-payout")
        return {"payout": ctx.task_id}

    async def not_committed(ctx: Context) -> Any:
        return NotCommitted()

    handler = Recorder(crash_once, not_committed)
    task = run_one(tenant, "payment.release", payment(), handler)
    assert handler.calls == [("execute", 1), ("reconcile", 2), ("execute", 3)]
    assert task.state == "succeeded" and task.delivery.result == {"payout": task.id}
    with tenant.client() as client:
        attempts = client.attempts(task.id)
        assert [(a.kind, a.state) for a in attempts] == [
            ("execute", "unknown"),
            ("reconcile", "not_committed"),
            ("execute", "succeeded"),
        ]
        assert attempts[0].evidence[0].body["outcome"] == "unknown"
        assert "provider hung up" in attempts[0].evidence[0].body["message"]


def test_an_exception_in_reconcile_leads_to_another_reconcile(tenant: Tenant) -> None:
    async def unknown(ctx: Context, n: int) -> Any:
        raise idem.UnknownOutcomeError("no answer from the provider")

    tries: list[int] = []

    async def flaky_lookup(ctx: Context) -> Any:
        tries.append(ctx.number)
        if len(tries) == 1:
            raise TimeoutError("the provider's lookup timed out")
        return Committed({"found": True}, external_txn_id="prov-7")

    handler = Recorder(unknown, flaky_lookup)
    task = run_one(tenant, "payment.release", payment(), handler)
    assert handler.calls == [("execute", 1), ("reconcile", 2), ("reconcile", 3)]
    assert task.state == "succeeded" and task.delivery.result == {"found": True}
    assert task.delivery.external_txn_id == "prov-7"


def test_typed_failures_are_final_and_a_result_that_is_not_json_is_reconciled(tenant: Tenant) -> None:
    async def invalid(ctx: Context, n: int) -> Any:
        raise idem.InvalidInputError("unknown model")

    task = run_one(tenant, "generation.dispatch", {"n": 1}, Recorder(invalid))
    assert (task.state, task.failure.class_, task.attempt_count) == ("failed", "invalid_input", 1)

    async def denied(ctx: Context, n: int) -> Any:
        raise idem.PermissionDeniedError("the provider refused our credentials")

    task = run_one(tenant, "generation.dispatch", {"n": 2}, Recorder(denied))
    assert (task.state, task.failure.class_, task.attempt_count) == ("failed", "permission_denied", 1)

    async def not_json(ctx: Context, n: int) -> Any:
        return {"at": time} if n == 1 else {"ok": True}

    async def not_committed(ctx: Context) -> Any:
        return NotCommitted()

    handler = Recorder(not_json, not_committed)
    task = run_one(tenant, "payment.release", payment(), handler)
    assert handler.calls == [("execute", 1), ("reconcile", 2), ("execute", 3)]
    assert task.state == "succeeded"


def test_a_device_gateway_acknowledges_the_command_apart_from_its_completion(tenant: Tenant) -> None:
    seen: list[str] = []

    async def command(ctx: Context, n: int) -> Any:
        await ctx.ack()
        async with tenant.async_client() as client:
            seen.append((await client.get(ctx.task_id)).state)
        return {"observed": "door closed"}

    task = run_one(tenant, "generation.dispatch", {"device": "door-7", "command": "close"}, Recorder(command))
    assert seen == ["running"], "acknowledged, not completed"
    assert task.state == "succeeded" and task.delivery.result == {"observed": "door closed"}
    with tenant.client() as client:
        (attempt,) = client.attempts(task.id)
        assert [(e.outcome, e.disposition) for e in attempt.evidence] == [("ack", "applied"), ("succeeded", "applied")]
        assert "command_acknowledged" in event_types(client, task.id)


class StallingClient(idem.AsyncClient):
    """An executor client whose heartbeats after the first leave ``stall``
    seconds late, as from a worker paused (GC, a suspended VM) or cut off by the
    network: the lease runs out on the server meanwhile. The worker itself is
    unchanged."""

    def __init__(self, *args: Any, stall: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.stall = stall
        self.heartbeats = 0

    async def heartbeat(self, *args: Any, **kw: Any) -> idem.HeartbeatAck:
        self.heartbeats += 1
        if self.heartbeats > 1:
            await asyncio.sleep(self.stall)
        return await super().heartbeat(*args, **kw)


def test_a_lost_lease_is_told_to_the_handler_and_its_late_result_is_evidence_only(tenant: Tenant) -> None:
    lease_ms = 1000

    async def until_stopped(ctx: Context, n: int) -> Any:
        await asyncio.wait_for(ctx.cancelled_event.wait(), 10)
        # Returns only after the server's lease end: the report is stale evidence.
        await asyncio.sleep(ctx.lease_expires_at.timestamp() - time.time() + 0.3)
        return {"late": True}

    async def committed(ctx: Context) -> Any:
        return Committed({"reconciled": True}, external_txn_id="prov-1")

    handler = Recorder(until_stopped, committed)

    async def scenario() -> idem.Task:
        async with (
            StallingClient(tenant.url, tenant.executor_key, stall=3 * lease_ms / 1000) as ex,
            tenant.async_client() as client,
            serving(Worker(ex, "w-lost", {"payment.release": handler}, lease_ms=lease_ms)),
        ):
            task = (await client.submit("payment.release", payment(), key())).task
            return await client.get(task.id, wait=15)

    task = asyncio.run(scenario())
    ctx = handler.contexts[0]
    assert ctx.lease_lost and not ctx.cancel_requested
    assert handler.calls == [("execute", 1), ("reconcile", 2)], "the lapsed non-safe attempt was reconciled"
    assert task.state == "succeeded" and task.delivery.result == {"reconciled": True}
    with tenant.client() as client:
        first = client.attempts(task.id)[0]
        assert first.state == "expired"
        (late,) = first.evidence
        assert (late.outcome, late.disposition) == ("succeeded", "stale_generation")
        assert late.body["result"] == {"late": True}, "reported once, kept as evidence only"
        assert "stale_report" in event_types(client, task.id)


def test_transient_on_generation_dispatch_is_retried_after_backoff(tenant: Tenant) -> None:
    async def fail_once(ctx: Context, n: int) -> Any:
        if n == 1:
            raise idem.TransientError("GPU pool busy")
        return {"frames": 24}

    handler = Recorder(fail_once)
    task = run_one(tenant, "generation.dispatch", {"n": 1}, handler)
    assert handler.calls == [("execute", 1), ("execute", 2)]
    assert task.state == "succeeded" and task.delivery.result == {"frames": 24}
    with tenant.client() as client:
        first, second = client.attempts(task.id)
        assert first.state == "failed" and first.evidence[0].body["failure_class"] == "transient"
        gap = (second.leased_at - first.evidence[0].received_at).total_seconds()
        assert gap >= DISPATCH_BACKOFF_MS / 1000, f"the retry came {gap:.3f} s after the failure"
        assert "retry_scheduled" in event_types(client, task.id)


class CountingClient(idem.AsyncClient):
    """An executor client that notes when each claim starts, and when none is in flight."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.claims_started: list[float] = []
        self.no_claim = asyncio.Event()

    async def claim(self, *args: Any, **kw: Any) -> list[idem.ClaimedAttempt]:
        self.claims_started.append(time.monotonic())
        self.no_claim.clear()
        try:
            return await super().claim(*args, **kw)
        finally:
            self.no_claim.set()


def test_shutdown_claims_nothing_more_and_releases_what_its_open_claim_still_brings(tenant: Tenant) -> None:
    async def one_second(ctx: Context, n: int) -> Any:
        await asyncio.sleep(1.0)
        return {"done": True}

    handler = Recorder(one_second)

    async def scenario() -> tuple[float, list[float], idem.Task, idem.Task, list[idem.Attempt]]:
        async with CountingClient(tenant.url, tenant.executor_key) as ex, tenant.async_client() as client:
            worker = Worker(ex, "w-stop", {"generation.dispatch": handler}, concurrency=2, grace=5)
            serving_task = asyncio.create_task(worker.serve())
            first = (await client.submit("generation.dispatch", {"n": 1}, key())).task
            await asyncio.wait_for(handler.started.wait(), 10)
            worker.stop()
            stopped = time.monotonic()
            # The claim open since before the stop leases this task; the worker gives it back unstarted.
            second = (await client.submit("generation.dispatch", {"n": 2}, key())).task
            await asyncio.wait_for(serving_task, 10)
            took = time.monotonic() - stopped
            late_claims = [t for t in ex.claims_started if t >= stopped]
            return (
                took,
                late_claims,
                await client.get(first.id),
                await client.get(second.id),
                await client.attempts(second.id),
            )

    took, late_claims, first, second, attempts = asyncio.run(scenario())
    assert took < 5, f"exited {took:.2f} s after stop, within its grace"
    assert late_claims == [], "no claim after stop"
    assert first.state == "succeeded", "the running attempt finished and was reported"
    assert second.state == "queued", "released: due again at once"
    assert [(a.state, a.evidence) for a in attempts] == [("released", [])], "never run, never reported"
    assert handler.calls == [("execute", 1)]


def test_shutdown_abandons_attempts_still_running_after_the_grace(tenant: Tenant) -> None:
    grace = 0.5
    outcome: list[str] = []

    async def forever(ctx: Context, n: int) -> Any:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    handler = Recorder(forever)

    async def scenario() -> tuple[float, idem.Task]:
        async with tenant.executor() as ex, tenant.async_client() as client:
            worker = Worker(ex, "w-grace", {"generation.dispatch": handler}, grace=grace)
            serving_task = asyncio.create_task(worker.serve())
            task = (await client.submit("generation.dispatch", {"n": 1}, key())).task
            await asyncio.wait_for(handler.started.wait(), 10)
            worker.stop()
            stopped = time.monotonic()
            await asyncio.wait_for(serving_task, 10)
            return time.monotonic() - stopped, await client.get(task.id)

    took, task = asyncio.run(scenario())
    assert grace <= took < grace + 0.5, f"exited {took:.2f} s after stop; grace {grace} s"
    assert outcome == ["cancelled"]
    assert task.state == "running", "not reported: the lease runs out and idem handles it"
    with tenant.client() as client:
        assert client.attempts(task.id)[0].evidence == []


def test_an_attempt_abandoned_at_shutdown_is_never_reported_whatever_the_handler_returns(tenant: Tenant) -> None:
    async def swallows_the_cancellation(ctx: Context, n: int) -> Any:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return Cancelled()  # an outcome the handler never reached: it was cut off

    handler = Recorder(swallows_the_cancellation)

    async def scenario() -> idem.Task:
        async with tenant.executor() as ex, tenant.async_client() as client:
            worker = Worker(ex, "w-abandon", {"payment.release": handler}, grace=0.3)
            serving_task = asyncio.create_task(worker.serve())
            task = (await client.submit("payment.release", payment(), key())).task
            await asyncio.wait_for(handler.started.wait(), 10)
            # A pending cancellation: a `cancelled` report would be accepted, were one sent.
            assert (await client.cancel(task.id)).status == 202
            worker.stop()
            await asyncio.wait_for(serving_task, 10)
            return await client.get(task.id)

    task = asyncio.run(scenario())
    with tenant.client() as client:
        assert client.attempts(task.id)[0].evidence == [], "nothing reported"
    assert task.state == "running", "left to its lease"
    ctx = handler.contexts[0]
    assert ctx.abandoned


WORKER_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import idem

    class Slow:
        async def execute(self, ctx):
            print("started", flush=True)
            await asyncio.sleep(1.0)
            return {"done": True}

        async def reconcile(self, ctx):
            return idem.NotCommitted()

    url, key = sys.argv[1:]
    idem.Worker(idem.AsyncClient(url, key), "w-sigterm", {"generation.dispatch": Slow()}, grace=5).run()
    print("exited", flush=True)
""")


def test_run_stops_on_sigterm_within_its_grace(tenant: Tenant) -> None:
    with tenant.client() as client:
        task = client.submit("generation.dispatch", {"n": 1}, key()).task
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_SCRIPT, tenant.url, tenant.executor_key],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout.readline().strip() == "started"
            proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            out, _ = proc.communicate(timeout=10)
        finally:
            proc.kill()
        took = time.monotonic() - stopped
        assert proc.returncode == 0 and out.strip() == "exited"
        assert took < 5, f"exited {took:.2f} s after SIGTERM, within its grace"
        assert client.get(task.id).state == "succeeded", "the running attempt finished first"
