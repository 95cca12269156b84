"""The executor runtime: ``Worker`` claims attempts, runs a handler for each,
heartbeats its lease, and reports the outcome (SDK model, issue 24).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import signal
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

#: Longest ``message`` the worker puts into a report.
_MESSAGE_LIMIT = 2000


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
    cancellation is requested (``cancel_requested``) or the lease is lost
    (``lease_lost``): stop, and return ``Cancelled()`` (on a cancel request) or
    anything (on a lost lease: the result is reported once, kept as evidence only).
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

    def _lose_lease(self) -> None:
        log.warning("attempt %s of task %s: lease lost (STALE_GENERATION)", self.attempt_id, self.task_id)
        self.lease_lost = True
        self.cancelled_event.set()


class Worker:
    """Runs ``handlers`` (operation class → handler) for the attempts idem hands
    to ``executor_id``: up to ``concurrency`` at once, each leased for
    ``lease_ms`` and heartbeated every ``lease_ms / 3``. ``grace`` (s): how long
    running attempts may take to finish after a stop; those still running then
    are abandoned (their lease runs out and idem handles it).

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
        self._claiming: asyncio.Task[list[ClaimedAttempt]] | None = None

    def stop(self) -> None:
        """Stops claiming at once (the waiting claim is abandoned) and lets running
        attempts finish within ``grace``; called again, abandons them at once.
        Call it from the worker's event loop (a signal handler, a task)."""
        if self._stopping:
            self._abandon = True
        self._stopping = True
        if self._claiming is not None:
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
        running: set[asyncio.Task[None]] = set()
        pause = 0.1
        try:
            while not self._stopping:
                free = self.concurrency - len(running)
                if free <= 0:
                    await self._until_woken(running)
                    continue
                try:
                    attempts = await self._claim(free)
                except (IdemTransportError, IdemError) as e:
                    if isinstance(e, IdemError) and not e.retryable:
                        raise
                    log.warning("claim failed (%s); again in %.1f s", e, pause)
                    await self._until_woken(set(), timeout=pause)
                    pause = min(pause * 2, 5.0)
                    continue
                pause = 0.1
                for attempt in attempts:
                    task = asyncio.create_task(self._run_attempt(attempt))
                    running.add(task)
                    task.add_done_callback(running.discard)
        finally:
            await self._drain(running)

    async def _claim(self, free: int) -> list[ClaimedAttempt]:
        """One long-poll claim; ``stop()`` cancels it, which closes its connection
        (what it leased is run all the same if its answer was already in).

        A task that arrives while the closing connection is still on its way
        may be leased to the abandoned claim: idem cannot tell until it sees the
        connection close. Its lease then runs out and idem retries it (safe
        class) or reconciles it (non-safe) as for any lost executor."""
        claim = self._claiming = asyncio.create_task(
            self.client.claim(
                self.executor_id, list(self.handlers), max=free, lease_ms=self.lease_ms, wait_ms=self.claim_wait_ms
            )
        )
        try:
            await asyncio.wait({claim})
        finally:
            self._claiming = None
            claim.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            return await claim
        return []

    async def _until_woken(self, running: set[asyncio.Task[None]], timeout: float | None = None) -> None:
        """Until an attempt of ``running`` ends, ``stop()`` is called, or ``timeout`` passed."""
        assert self._wake is not None
        woken = asyncio.create_task(self._wake.wait())
        try:
            await asyncio.wait({woken, *running}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()

    async def _drain(self, running: set[asyncio.Task[None]]) -> None:
        if not running:
            return
        log.info("stopping: %d attempt(s) running, waiting up to %.1f s", len(running), self.grace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        while running and not self._abandon and loop.time() < deadline:
            assert self._wake is not None
            self._wake.clear()
            await self._until_woken(set(running), timeout=deadline - loop.time())
        pending = set(running)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            log.warning("abandoned %d attempt(s) still running after the grace period", len(pending))

    async def _run_attempt(self, attempt: ClaimedAttempt) -> None:
        ctx = Context(self.client, attempt)
        handler = self.handlers[attempt.operation]
        heartbeat = asyncio.create_task(self._heartbeat(ctx))
        try:
            body = await self._outcome(handler, ctx)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        try:
            json.dumps(body, allow_nan=False)
        except (TypeError, ValueError) as e:
            # The effect may have happened, its result cannot be sent: as an exception would.
            log.error(
                "attempt %s of task %s: the %s cannot be sent as JSON: %s", ctx.attempt_id, ctx.task_id, ctx.kind, e
            )
            body = (
                {"outcome": "unknown"} if ctx.kind == "execute" else {"outcome": "failed", "failure_class": "transient"}
            ) | {"message": f"result is not JSON: {e}"}
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

    async def _heartbeat(self, ctx: Context) -> None:
        """Every ``lease_ms / 3``: extends the lease with the usage so far; tells
        ``ctx`` of a cancel request, and of a lost lease (then stops)."""
        interval = self.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                ack = await self.client.heartbeat(
                    ctx.attempt_id, ctx.generation, ctx.usage, timeout=self.lease_ms / 1000
                )
            except StaleGenerationError:
                ctx._lose_lease()
                return
            except (IdemError, IdemTransportError) as e:
                # The lease may still hold; if it runs out, the next answer is 409.
                log.warning("attempt %s: heartbeat failed: %s", ctx.attempt_id, e)
                continue
            ctx.lease_expires_at = ack.lease_expires_at
            if ack.cancel_requested:
                ctx._request_cancel()

    async def _report(self, ctx: Context, body: dict[str, Any]) -> None:
        """Reports once, repeating only when no answer came (timeouts, connection
        errors, 5xx: idem answers an exact repeat as before). A refusal is final:
        after a lost lease the 409 means the report was kept as evidence only."""
        pauses = self.client.retry.pauses()
        for n in range(len(pauses) + 1):
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
                if isinstance(e, IdemError) and not e.retryable or n == len(pauses):
                    log.error(
                        "attempt %s of task %s: report %s refused: %s", ctx.attempt_id, ctx.task_id, body["outcome"], e
                    )
                    return
                await asyncio.sleep(pauses[n])


def _message(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text[:_MESSAGE_LIMIT]
