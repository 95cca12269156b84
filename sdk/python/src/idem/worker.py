"""The executor runtime: ``Worker`` claims attempts, runs a handler for each,
heartbeats its lease, and reports the outcome (docs/SPEC.md §4, "Executors and their leases").

A handler is any object with two coroutine methods::

    class Payout:
        async def execute(self, ctx: Context) -> Any: ...          # a result, Succeeded(...) or Cancelled()
        async def reconcile(self, ctx: Context) -> Committed | NotCommitted: ...

How the handler's return or exception is reported:

========================================  ==========================================
execute returns a value / ``Succeeded``   ``succeeded`` with the result
execute returns ``Cancelled()``           ``cancelled`` (answers a cancel request)
raises ``TransientError``                 ``failed`` / ``transient``
raises ``InvalidInputError``              ``failed`` / ``invalid_input``
raises ``PermissionDeniedError``          ``failed`` / ``permission_denied``
raises ``UnknownOutcomeError``            ``unknown``
execute raises anything else              ``unknown``: the task is reconciled before
                                          anything repeats
reconcile returns ``Committed(...)``      ``committed`` (delivers its result)
reconcile returns ``NotCommitted()``      ``not_committed``
reconcile raises anything else            ``failed`` / ``transient``: another
                                          reconcile attempt follows (SPEC §4)
========================================  ==========================================

Every report carries the attempt's generation and the usage the handler recorded.

The lease, as the executor keeps it (SPEC §4, leases): each attempt has a local
deadline, the lease length the server last confirmed (``lease_ms`` of the claim
or heartbeat answer) counted from when that request was *sent* (monotonic
clock), less a margin of max(500 ms, 10 % of the lease). At that deadline the
lease counts as lost: ``ctx.lease_lost`` is set and ``ctx.cancelled_event``
fires, unless a heartbeat answer moved the deadline first. Heartbeats time out
within min(lease / 3, time left to the deadline); a heartbeat answered 401, 403,
404 or 409 loses the lease at once. The server may hand the task to another
executor only after its own lease end, which is later than the local deadline:
a handler that stops when told never overlaps the next attempt; one that
ignores ``cancelled_event`` is on its own.

Free text (``message``) is cut to ``MESSAGE_LIMIT`` characters; a report
refused for its size (413) is sent again with its text cut further. After
``stop()``, an attempt the open claim still brings is released (``POST
/v1/attempts/{id}/release``), never run; an attempt abandoned at the end of the
grace is never reported (its lease runs out).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from .client import AsyncClient
from .errors import (
    IdemError,
    IdemTransportError,
    InvalidInputError,
    PermissionDeniedError,
    StaleGenerationError,
    TransientError,
    UnknownOutcomeError,
)
from .models import ClaimedAttempt

log = logging.getLogger("idem.worker")

#: Longest ``message`` the worker puts into a report, in characters (SPEC §7).
MESSAGE_LIMIT = 4096

#: Shortest lease a worker asks for, ms: below twice the margin the local
#: deadline leaves no time to run.
MIN_WORKER_LEASE_MS = 1000

#: Heartbeat answers that mean the lease is gone now: key revoked (401),
#: grant withdrawn (403), attempt unknown (404), generation stale (409).
_LEASE_GONE = frozenset({401, 403, 404, 409})


def lease_margin(lease_ms: int) -> float:
    """Seconds the local lease deadline keeps before the confirmed lease end:
    max(500 ms, 10 % of the lease)."""
    return max(0.5, lease_ms / 10_000)


@dataclass(frozen=True)
class Succeeded:
    """``execute``'s success with details; a plain return value means ``Succeeded(value)``.
    ``result`` is a JSON object (or None); ``usage`` sets the recorded total."""

    result: Any = None
    external_txn_id: str | None = None
    usage: int | None = None


@dataclass(frozen=True)
class Cancelled:
    """``execute`` stopped because a cancellation was requested (``ctx.cancel_requested``)."""


@dataclass(frozen=True)
class Committed:
    """``reconcile`` found the effect committed at the provider."""

    result: Any = None
    external_txn_id: str | None = None


@dataclass(frozen=True)
class NotCommitted:
    """``reconcile`` found that the effect did not happen: a new execute attempt may run."""


class Handler(Protocol):
    """The code of one operation class."""

    async def execute(self, ctx: Context) -> Any: ...

    async def reconcile(self, ctx: Context) -> Committed | NotCommitted: ...


class Context:
    """What a handler knows about its attempt, and how it talks back.

    Pass ``task_id`` to the provider as ITS idempotency key: it is the same for
    every attempt and reconciliation of the task. ``cancelled_event`` is set when a
    cancellation is requested (``cancel_requested``), the lease is lost
    (``lease_lost``: the local lease deadline passed, or a heartbeat was answered
    401/403/404/409), or the worker abandons the attempt at the end of its grace
    (``abandoned``): stop, and return ``Cancelled()`` (on a cancel request) or
    anything (on a lost lease: the result is reported once, kept as evidence
    only; when abandoned: nothing is reported).
    """

    def __init__(self, client: AsyncClient, attempt: ClaimedAttempt) -> None:
        self._client = client
        self.task_id: str = attempt.task_id
        self.attempt_id: str = attempt.id
        self.generation: int = attempt.generation
        #: ``execute`` or ``reconcile``.
        self.kind: str = attempt.kind
        self.operation: str = attempt.operation
        self.params: Any = attempt.params
        self.idempotency_key: str = attempt.idempotency_key
        self.traceparent: str | None = attempt.traceparent
        #: 1-based attempt number within the task.
        self.number: int = attempt.number
        #: The lease end, moved by each heartbeat.
        self.lease_expires_at: datetime = attempt.lease_expires_at
        #: The usage total reported with heartbeats and the report.
        self.usage: int = 0
        self.cancel_requested = False
        self.lease_lost = False
        self.abandoned = False
        #: Wall-clock time (``time.time()``) the lease was taken as lost, or None.
        self.lease_lost_at: float | None = None
        self.cancelled_event = asyncio.Event()

    def record_usage(self, total: int) -> None:
        """Sets the attempt's usage total (integer units; idem keeps the highest)."""
        if total < 0:
            raise ValueError("usage must not be negative")
        self.usage = int(total)

    async def ack(self) -> None:
        """Sends "command acknowledged" (a device gateway), apart from the completion."""
        await self._client.ack(self.attempt_id, self.generation)

    def _request_cancel(self) -> None:
        if not self.cancel_requested:
            log.info("attempt %s of task %s: cancellation requested", self.attempt_id, self.task_id)
        self.cancel_requested = True
        self.cancelled_event.set()

    def _lose_lease(self, why: str) -> None:
        if self.lease_lost:
            return
        self.lease_lost_at = time.time()
        log.warning("attempt %s of task %s: lease lost (%s)", self.attempt_id, self.task_id, why)
        self.lease_lost = True
        self.cancelled_event.set()

    def _abandon(self) -> None:
        self.abandoned = True
        self.cancelled_event.set()


class _Lease:
    """The local lease deadline of one attempt (``loop.time()`` seconds): the
    confirmed lease length counted from the confirming request's send time, less
    ``lease_margin``. Once armed, the deadline's passing loses ``ctx``'s lease."""

    def __init__(self, ctx: Context, lease_ms: int, sent: float) -> None:
        self.ctx = ctx
        self.lease_ms = lease_ms
        self.deadline = sent + lease_ms / 1000 - lease_margin(lease_ms)
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    def left(self) -> float:
        """Seconds to the deadline (negative once passed)."""
        return self.deadline - self._loop.time()

    def confirm(self, sent: float, lease_ms: int | None) -> None:
        """A heartbeat sent at ``sent`` was answered: the deadline moves on."""
        if self.ctx.lease_lost:
            return
        self.lease_ms = lease_ms or self.lease_ms
        self.deadline = sent + self.lease_ms / 1000 - lease_margin(self.lease_ms)
        if self._timer is not None:
            self.arm()

    def arm(self) -> None:
        self.close()
        self._timer = self._loop.call_at(self.deadline, self._expire)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self.ctx._lose_lease(
            f"no heartbeat confirmed it before the local deadline "
            f"(lease {self.lease_ms} ms less {lease_margin(self.lease_ms):.3f} s)"
        )


class Worker:
    """Runs ``handlers`` (operation class → handler) for the attempts idem hands
    to ``executor_id``: up to ``concurrency`` at once, each leased for
    ``lease_ms`` (at least ``MIN_WORKER_LEASE_MS``) and heartbeated every third of its lease. ``grace`` (s): how
    long running attempts may take to finish after a stop; those still running
    then are abandoned (never reported: their lease runs out and idem handles it).

    ``await worker.serve()`` in a running loop, or ``worker.run()`` from sync
    code (with SIGTERM/SIGINT handling); ``worker.stop()`` to shut down.
    """

    def __init__(
        self,
        client: AsyncClient,
        executor_id: str,
        handlers: Mapping[str, Handler],
        concurrency: int = 1,
        lease_ms: int = 30_000,
        grace: float = 30.0,
        claim_wait_ms: int = 20_000,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if lease_ms < MIN_WORKER_LEASE_MS:
            raise ValueError(
                f"lease_ms must be at least {MIN_WORKER_LEASE_MS}: the lease margin leaves no time below it"
            )
        if not handlers:
            raise ValueError("a worker needs at least one handler")
        for operation, handler in handlers.items():
            for method in ("execute", "reconcile"):
                if not inspect.iscoroutinefunction(getattr(handler, method, None)):
                    raise TypeError(f"the handler of {operation!r} needs an `async def {method}(self, ctx)`")
        self.client = client
        self.executor_id = executor_id
        self.handlers = dict(handlers)
        self.concurrency = concurrency
        self.lease_ms = lease_ms
        self.grace = grace
        self.claim_wait_ms = claim_wait_ms
        self._stopping = False
        self._abandon = False
        self._wake: asyncio.Event | None = None
        self._claiming: asyncio.Task[tuple[float, list[ClaimedAttempt]]] | None = None
        self._contexts: dict[asyncio.Task[Any], Context] = {}
        self._running: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        """Stops claiming and lets running attempts finish within ``grace``;
        called again, abandons them at once. The claim open at the stop is
        closed at once when nothing runs, else when the running attempts are
        done; an attempt it still brings is released, never run. Call it from
        the worker's event loop (a signal handler, a task)."""
        if self._stopping:
            log.warning("stopping again: abandoning running attempts now")
            self._abandon = True
        else:
            log.info("stopping: claiming nothing more, %d attempt(s) running", len(self._running))
        self._stopping = True
        if self._claiming is not None and not self._running:
            self._claiming.cancel()
        if self._wake is not None:
            self._wake.set()

    def run(self) -> None:
        """Runs ``serve()`` in a new event loop until SIGTERM or SIGINT (``stop()``;
        a second signal abandons running attempts at once)."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            signals = (signal.SIGTERM, signal.SIGINT)
            for sig in signals:
                with contextlib.suppress(NotImplementedError):  # not on Windows
                    loop.add_signal_handler(sig, self.stop)
            try:
                await self.serve()
            finally:
                for sig in signals:
                    with contextlib.suppress(NotImplementedError):
                        loop.remove_signal_handler(sig)

        asyncio.run(main())

    async def serve(self) -> None:
        """Claims and runs attempts until ``stop()``; then waits up to ``grace``
        for the running ones. Raises a non-retryable error of a claim (e.g.
        ``UnauthenticatedError``, ``PermissionDeniedError``); retryable ones are
        logged and the claim is repeated after a pause."""
        self._wake = asyncio.Event()
        if self._stopping:
            self._wake.set()
        running = self._running
        claim: asyncio.Task[tuple[float, list[ClaimedAttempt]]] | None = None
        pause = 0.1
        try:
            while not self._stopping:
                free = self.concurrency - len(running)
                if free <= 0:
                    await self._until_woken(running)
                    continue
                claim = self._claiming = asyncio.create_task(self._claim(free))
                await self._until_woken({claim})
                if not claim.done() or claim.cancelled():
                    break  # stopping: the drain decides when the claim closes
                self._claiming = None
                try:
                    sent, attempts = claim.result()
                except (IdemTransportError, IdemError) as e:
                    if isinstance(e, IdemError) and not e.retryable:
                        raise
                    # At least as long as idem asked (``Retry-After`` of a 503
                    # ``OVERLOADED`` or ``UNAVAILABLE``).
                    asked = e.retry_after if isinstance(e, IdemError) else None
                    wait = max(pause, asked or 0.0)
                    log.warning("claim failed (%s); again in %.1f s", e, wait)
                    await self._until_woken(set(), timeout=wait)
                    pause = min(pause * 2, 5.0)
                    continue
                finally:
                    claim = None
                pause = 0.1
                for attempt in attempts:
                    if self._stopping:
                        self._spawn(self._release(attempt), running)
                    else:
                        self._spawn(self._run_attempt(attempt, sent), running)
        finally:
            await self._drain(running, claim)

    @staticmethod
    def _spawn(coro: Any, running: set[asyncio.Task[None]]) -> None:
        task = asyncio.create_task(coro)
        running.add(task)
        task.add_done_callback(running.discard)

    async def _claim(self, free: int) -> tuple[float, list[ClaimedAttempt]]:
        """One long-poll claim: its send time (``loop.time()``) and what it leased."""
        sent = asyncio.get_running_loop().time()
        attempts = await self.client.claim(
            self.executor_id, list(self.handlers), max=free, lease_ms=self.lease_ms, wait_ms=self.claim_wait_ms
        )
        return sent, attempts

    async def _until_woken(self, running: set[asyncio.Task[Any]], timeout: float | None = None) -> None:
        """Until an attempt of ``running`` ends, ``stop()`` is called, or ``timeout`` passed."""
        assert self._wake is not None
        woken = asyncio.create_task(self._wake.wait())
        try:
            await asyncio.wait({woken, *running}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()

    async def _drain(
        self, running: set[asyncio.Task[None]], claim: asyncio.Task[tuple[float, list[ClaimedAttempt]]] | None
    ) -> None:
        """Waits up to ``grace`` for ``running``; meanwhile what the open
        ``claim`` brings is released. Then closes the claim and abandons what
        still runs (cancelled, never reported)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        if running:
            log.info("stopping: %d attempt(s) running, waiting up to %.1f s", len(running), self.grace)
        while (running or (claim is not None and not self._abandon)) and loop.time() < deadline:
            if claim is not None and not running:
                claim.cancel()
            if claim is not None and claim.done():
                self._release_claimed(claim, running)
                claim = None
                continue
            if self._abandon:
                break
            assert self._wake is not None
            self._wake.clear()
            await self._until_woken({*running, *([claim] if claim is not None else [])}, timeout=deadline - loop.time())
        self._claiming = None
        if claim is not None:
            claim.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({claim})
            self._release_claimed(claim, running)
        pending = {t for t in running if t in self._contexts}
        for task in running:
            if task in self._contexts:
                self._contexts[task]._abandon()
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if pending:
            log.warning("abandoned %d attempt(s) still running after the grace period", len(pending))

    def _release_claimed(
        self, claim: asyncio.Task[tuple[float, list[ClaimedAttempt]]], running: set[asyncio.Task[None]]
    ) -> None:
        """Releases what a claim answered after the stop (a cancelled or failed claim brought nothing)."""
        if claim.cancelled() or claim.exception() is not None:
            return
        for attempt in claim.result()[1]:
            self._spawn(self._release(attempt), running)

    async def _release(self, attempt: ClaimedAttempt) -> None:
        """Gives ``attempt`` back unstarted (``POST …/release``), repeating only
        when no answer came; 404/409 mean there is nothing to give back."""
        pauses = self.client.retry.pauses()
        for n in range(len(pauses) + 1):
            try:
                await self.client.release(attempt.id, attempt.generation)
                log.info("attempt %s of task %s: released unstarted", attempt.id, attempt.task_id)
                return
            except (IdemError, IdemTransportError) as e:
                if isinstance(e, IdemError) and e.status in (404, 409):
                    log.info("attempt %s of task %s: nothing to release (%s)", attempt.id, attempt.task_id, e)
                    return
                if isinstance(e, IdemError) and not e.retryable or n == len(pauses):
                    log.error(
                        "attempt %s of task %s: release failed, its lease runs out: %s", attempt.id, attempt.task_id, e
                    )
                    return
                await asyncio.sleep(pauses[n])

    async def _run_attempt(self, attempt: ClaimedAttempt, sent: float) -> None:
        ctx = Context(self.client, attempt)
        lease = _Lease(ctx, attempt.lease_ms or self.lease_ms, sent)
        if self.claim_wait_ms > 0 and lease.left() < lease.lease_ms / 2000:
            # A long poll's send time may be long before the grant: count from a heartbeat's.
            await self._heartbeat_once(ctx, lease, timeout=lease.lease_ms / 3000)
            if ctx.lease_lost:
                return
        if self._stopping or lease.left() <= 0:
            await self._release(attempt)
            return
        handler = self.handlers[attempt.operation]
        me = asyncio.current_task()
        assert me is not None
        self._contexts[me] = ctx
        lease.arm()
        heartbeat = asyncio.create_task(self._heartbeat(ctx, lease))
        try:
            body = await self._outcome(handler, ctx)
        finally:
            del self._contexts[me]
            lease.close()
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        if ctx.abandoned:
            log.warning(
                "attempt %s of task %s: abandoned at shutdown, not reported; its lease runs out",
                ctx.attempt_id,
                ctx.task_id,
            )
            return
        try:
            json.dumps(body, allow_nan=False)
        except (TypeError, ValueError) as e:
            # The effect may have happened, its result cannot be sent: as an exception would.
            log.error(
                "attempt %s of task %s: the %s cannot be sent as JSON: %s", ctx.attempt_id, ctx.task_id, ctx.kind, e
            )
            body = _unsendable(ctx.kind, f"result is not JSON: {e}")
        if ctx.lease_lost and body["outcome"] == "cancelled" and not ctx.cancel_requested:
            # Stopped on the lost lease, with no outcome of its own: nothing to report.
            log.info("attempt %s of task %s: stopped after its lease was lost", ctx.attempt_id, ctx.task_id)
            return
        body["generation"] = ctx.generation
        body["usage"] = ctx.usage
        try:
            await self._report(ctx, body)
        except Exception:
            log.exception("attempt %s of task %s: the report failed", ctx.attempt_id, ctx.task_id)

    async def _outcome(self, handler: Handler, ctx: Context) -> dict[str, Any]:
        """Runs the handler; its return or exception as a report body (see the module doc)."""
        execute = ctx.kind == "execute"
        try:
            if execute:
                value = await handler.execute(ctx)
            else:
                value = await handler.reconcile(ctx)
        except TransientError as e:
            return {"outcome": "failed", "failure_class": "transient", "message": _message(e)}
        except InvalidInputError as e:
            return {"outcome": "failed", "failure_class": "invalid_input", "message": _message(e)}
        except PermissionDeniedError as e:
            return {"outcome": "failed", "failure_class": "permission_denied", "message": _message(e)}
        except UnknownOutcomeError as e:
            return {"outcome": "unknown", "message": _message(e)}
        except Exception as e:
            log.exception("attempt %s of task %s: %s raised", ctx.attempt_id, ctx.task_id, ctx.kind)
            if execute:
                return {"outcome": "unknown", "message": _message(e)}
            return {"outcome": "failed", "failure_class": "transient", "message": _message(e)}
        if execute:
            if isinstance(value, Cancelled):
                return {"outcome": "cancelled"}
            if not isinstance(value, Succeeded):
                value = Succeeded(value)
            if value.usage is not None:
                ctx.record_usage(value.usage)
            body = {"outcome": "succeeded", "result": value.result}
        elif isinstance(value, Committed):
            body = {"outcome": "committed", "result": value.result}
        elif isinstance(value, NotCommitted):
            return {"outcome": "not_committed"}
        else:
            log.error(
                "attempt %s of task %s: reconcile returned %r, not Committed or NotCommitted",
                ctx.attempt_id,
                ctx.task_id,
                value,
            )
            return {
                "outcome": "failed",
                "failure_class": "transient",
                "message": f"reconcile returned {type(value).__name__}, not Committed or NotCommitted",
            }
        if value.external_txn_id is not None:
            body["external_txn_id"] = value.external_txn_id
        return body

    async def _heartbeat(self, ctx: Context, lease: _Lease) -> None:
        """Every third of the lease: extends it with the usage so far; tells
        ``ctx`` of a cancel request, and of a lost lease (then stops)."""
        while not ctx.lease_lost:
            await asyncio.sleep(lease.lease_ms / 3000)
            if ctx.lease_lost:
                return
            await self._heartbeat_once(ctx, lease, timeout=min(lease.lease_ms / 3000, lease.left()))

    async def _heartbeat_once(self, ctx: Context, lease: _Lease, timeout: float) -> None:
        """One heartbeat, given up after ``timeout`` s; an answer moves ``lease``
        on, a 401/403/404/409 loses it, any other failure leaves it as it was."""
        timeout = max(timeout, 0.01)
        sent = asyncio.get_running_loop().time()
        try:
            ack = await asyncio.wait_for(
                self.client.heartbeat(ctx.attempt_id, ctx.generation, ctx.usage, timeout=timeout), timeout
            )
        except asyncio.TimeoutError:
            log.warning("attempt %s: heartbeat unanswered within %.3f s", ctx.attempt_id, timeout)
            return
        except (IdemError, IdemTransportError) as e:
            if isinstance(e, IdemError) and e.status in _LEASE_GONE:
                ctx._lose_lease(f"heartbeat answered {e}")
                return
            log.warning("attempt %s: heartbeat failed: %s", ctx.attempt_id, e)
            return
        lease.confirm(sent, ack.lease_ms)
        ctx.lease_expires_at = ack.lease_expires_at
        if ack.cancel_requested:
            ctx._request_cancel()

    async def _report(self, ctx: Context, body: dict[str, Any]) -> None:
        """Reports once, repeating only when no answer came (timeouts, connection
        errors, 5xx: idem answers an exact repeat as before), or with its text
        cut further when refused for its size (413). Any other refusal is final:
        after a lost lease the 409 means the report was kept as evidence only."""
        body = _trimmed(body)
        pauses = self.client.retry.pauses()
        n = 0
        while True:
            try:
                await self.client.report(ctx.attempt_id, body)
                log.info("attempt %s of task %s: reported %s", ctx.attempt_id, ctx.task_id, body["outcome"])
                return
            except StaleGenerationError:
                log.warning(
                    "attempt %s of task %s: the %s report came after the lease was lost; idem kept it as evidence only",
                    ctx.attempt_id,
                    ctx.task_id,
                    body["outcome"],
                )
                return
            except (IdemError, IdemTransportError) as e:
                smaller = _smaller(body, ctx.kind) if isinstance(e, IdemError) and e.status == 413 else None
                if smaller is not None:
                    log.warning(
                        "attempt %s of task %s: report refused for its size; cutting it", ctx.attempt_id, ctx.task_id
                    )
                    body = smaller
                    continue
                if isinstance(e, IdemError) and not e.retryable or n == len(pauses):
                    log.error(
                        "attempt %s of task %s: report %s refused: %s", ctx.attempt_id, ctx.task_id, body["outcome"], e
                    )
                    return
                await asyncio.sleep(pauses[n])
                n += 1


def _message(e: BaseException) -> str:
    return _cut(str(e) or type(e).__name__, MESSAGE_LIMIT)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit]


def _trimmed(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its ``message`` cut to ``MESSAGE_LIMIT`` characters."""
    if isinstance(body.get("message"), str):
        return body | {"message": _cut(body["message"], MESSAGE_LIMIT)}
    return body


def _unsendable(kind: str, message: str) -> dict[str, Any]:
    """The report of a result that cannot be sent: the effect may have happened."""
    outcome = {"outcome": "unknown"} if kind == "execute" else {"outcome": "failed", "failure_class": "transient"}
    return outcome | {"message": message}


def _smaller(body: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """``body`` made smaller after a 413: its message halved, then dropped; then
    a result too large to send reported as ``_unsendable``; None when nothing is
    left to cut."""
    message = body.get("message")
    if isinstance(message, str) and message:
        return body | {"message": message[: len(message) // 2]}
    if "message" in body:
        return {k: v for k, v in body.items() if k != "message"}
    if "result" in body or "external_txn_id" in body:
        kept = {k: body[k] for k in ("generation", "usage") if k in body}
        return _unsendable(kind, "the result is too large to report") | kept
    return None
