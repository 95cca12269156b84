"""``Client`` (blocking) and ``AsyncClient`` (asyncio): the same methods over
httpx, performing the flows of ``_api``."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from datetime import datetime
from typing import Any

import httpx

from . import _api
from ._api import Answer, Call, Close, Flow, Item, Open, Read, Sleep, error_from
from .errors import IdemError, IdemTimeoutError, IdemTransportError
from .models import (
    DEFAULT_RETRY,
    Attempt,
    CancelResponse,
    ClaimedAttempt,
    Event,
    HeartbeatAck,
    RetryPolicy,
    Submitted,
    Task,
)

#: A stream's read time limit, at least: idem sends a comment every 15 s.
_STREAM_READ_TIMEOUT = 45.0


class _Base:
    def __init__(self, base_url: str, api_key: str, timeout: float, retry: RetryPolicy) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL {base_url!r} must be http:// or https://")
        self.base_url = base_url.rstrip("/") + "/"
        self.timeout = timeout
        self.retry = retry
        self._auth = {"Authorization": f"Bearer {api_key}"}

    def _request_args(self, call: Call, stream: bool = False) -> dict[str, Any]:
        limit = call.timeout if call.timeout is not None else self.timeout + call.extra_timeout
        timeout = httpx.Timeout(limit, read=max(limit, _STREAM_READ_TIMEOUT)) if stream else httpx.Timeout(limit)
        headers = dict(self._auth)
        content = None
        if call.json is not None:
            # Compact, as httpx would send it; the same bytes on every retry.
            content = json.dumps(call.json, separators=(",", ":"), allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        return {
            "params": call.query,
            "content": content,
            "headers": {**headers, **call.headers},
            "timeout": timeout,
        }

    @staticmethod
    def _transport_error(call: Call, e: httpx.TransportError) -> IdemTransportError:
        cls = IdemTimeoutError if isinstance(e, httpx.TimeoutException) else IdemTransportError
        return cls(f"{call.method} /{call.path}: {type(e).__name__}: {e}")

    @staticmethod
    def _answer(r: httpx.Response) -> Answer:
        headers = {k.lower(): v for k, v in r.headers.items()}
        if not r.is_success:
            raise error_from(r.status_code, headers, r.content)
        if r.status_code == 204 or not r.content:
            return Answer(r.status_code, headers, None)
        try:
            return Answer(r.status_code, headers, r.json())
        except ValueError:
            raise IdemError(f"the answer is not JSON: {r.text[:200]!r}", status=r.status_code) from None


class Client(_Base):
    """A blocking client of one idem service, authenticated by one API key.

    ``timeout``: seconds per request (extended by a ``wait``). ``retry``: how
    ``submit`` repeats. Use as a context manager, or call ``close()``.
    """

    def __init__(self, base_url: str, api_key: str, timeout: float = 30.0, retry: RetryPolicy = DEFAULT_RETRY) -> None:
        super().__init__(base_url, api_key, timeout, retry)
        self._http = httpx.Client(base_url=self.base_url)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- performing flows --

    def _send(self, call: Call) -> Answer:
        try:
            r = self._http.request(call.method, call.path, **self._request_args(call))
        except httpx.TransportError as e:
            raise self._transport_error(call, e) from e
        return self._answer(r)

    def _open(self, call: Call, stack: contextlib.ExitStack) -> httpx.Response:
        try:
            r = self._http.send(
                self._http.build_request(call.method, call.path, **self._request_args(call, True)), stream=True
            )
        except httpx.TransportError as e:
            raise self._transport_error(call, e) from e
        stack.callback(r.close)
        if not r.is_success:
            r.read()
            self._answer(r)
        r.chunks = r.iter_bytes()  # type: ignore[attr-defined]
        r.call = call  # type: ignore[attr-defined]
        return r

    @staticmethod
    def _read(r: httpx.Response) -> bytes:
        try:
            return next(r.chunks, b"")  # type: ignore[attr-defined]
        except httpx.TransportError as e:
            raise Client._transport_error(r.call, e) from e  # type: ignore[attr-defined]

    def _iterate(self, flow: Flow) -> Iterator[Any]:
        """Performs ``flow``'s steps, yielding its ``Item``s; returns its result."""
        with contextlib.ExitStack() as stack:
            stack.callback(flow.close)
            value: Any = None
            error: BaseException | None = None
            while True:
                try:
                    step = flow.throw(error) if error is not None else flow.send(value)
                except StopIteration as stop:
                    return stop.value
                value, error = None, None
                try:
                    if isinstance(step, Call):
                        value = self._send(step)
                    elif isinstance(step, Sleep):
                        time.sleep(step.seconds)
                    elif isinstance(step, Item):
                        yield step.value
                    elif isinstance(step, Open):
                        value = self._open(step.call, stack)
                    elif isinstance(step, Read):
                        value = self._read(step.handle)
                    elif isinstance(step, Close):
                        step.handle.close()
                except (IdemError, IdemTransportError) as e:
                    error = e

    def _run(self, flow: Flow) -> Any:
        it = self._iterate(flow)
        while True:
            try:
                next(it)
            except StopIteration as stop:
                return stop.value

    # -- client API --

    def submit(
        self,
        operation: str,
        params: Any,
        idempotency_key: str,
        wait: float | None = None,
        traceparent: str | None = None,
    ) -> Submitted:
        """POST /v1/tasks under ``idempotency_key`` (it names the business
        operation). Repeats the SAME request on timeouts, connection errors and
        5xx, honouring ``Retry-After``; when the tries are used up, returns the
        scope's task if its params equal ``params`` (``looked_up``), else raises
        the last error. ``wait`` (s): hold the answer until the task is terminal
        (``Prefer: wait``). Raises ``IdempotencyConflictError`` at once when the
        key is bound to other params, ``ValueError`` for a key idem refuses."""
        return self._run(_api.submit(operation, params, idempotency_key, wait, traceparent, self.retry))

    def get(self, task_id: str, wait: float | None = None) -> Task:
        """GET /v1/tasks/{id}; ``wait`` (s): until the task is terminal or it passed."""
        return self._run(_api.get(task_id, wait))

    def find(self, operation: str, idempotency_key: str) -> Task:
        """The task of a scope (``NotFoundError`` when there is none)."""
        return self._run(_api.find(operation, idempotency_key))

    def list(
        self,
        state: str | Iterable[str] | None = None,
        operation: str | None = None,
        created_after: datetime | str | None = None,
        created_before: datetime | str | None = None,
        idempotency_key_prefix: str | None = None,
        external_txn_id: str | None = None,
        limit: int | None = None,
        second_effect: str | None = None,
    ) -> Iterator[Task]:
        """The tenant's tasks matching every filter given, newest first, across
        all pages (``limit`` is the page size)."""
        return self._iterate(
            _api.list_tasks(
                state,
                operation,
                created_after,
                created_before,
                idempotency_key_prefix,
                external_txn_id,
                limit,
                second_effect,
            )
        )

    def attempts(self, task_id: str) -> builtins.list[Attempt]:
        """GET /v1/tasks/{id}/attempts: every attempt with its evidence."""
        return self._run(_api.attempts(task_id))

    def events(self, task_id: str, live: bool = False) -> Iterator[Event]:
        """The task's events; ``live``: then each new one as it commits (SSE,
        resumed with ``Last-Event-ID`` after a dropped connection), ending after
        the event that made the task terminal."""
        flow = _api.live_events(task_id, self.retry) if live else _api.events(task_id)
        return self._iterate(flow)

    def cancel(self, task_id: str) -> CancelResponse:
        """POST /v1/tasks/{id}/cancel: recorded (202) is not stopped; 200 is confirmed or too late."""
        return self._run(_api.cancel(task_id))

    def acknowledge_second_effect(
        self, task_id: str, external_txn_id: str | None, resolution: str, reason: str
    ) -> Task:
        """POST /v1/tasks/{id}/second-effects/acknowledge (admin key): records how
        the suspected second effect with ``external_txn_id`` (``None``: the one
        reported without an id) was settled (``refund_issued``,
        ``provider_deduplicated``, ``false_alarm``) and why. The task does not
        change otherwise; ``NotFoundError`` when it has no such second effect."""
        return self._run(_api.acknowledge_second_effect(task_id, external_txn_id, resolution, reason))

    def ack_delivery(self, task_id: str) -> Task:
        """POST /v1/tasks/{id}/delivery/ack (idempotent)."""
        return self._run(_api.ack_delivery(task_id))

    # -- executor API --

    def claim(
        self,
        executor_id: str,
        operations: Iterable[str] | None = None,
        max: int = 1,
        lease_ms: int | None = None,
        wait_ms: int = 0,
    ) -> builtins.list[ClaimedAttempt]:
        """POST /v1/attempts/claim: up to ``max`` attempts, waiting up to ``wait_ms``."""
        return self._run(_api.claim(executor_id, operations, max, lease_ms, wait_ms))

    def heartbeat(
        self, attempt_id: str, generation: int, usage: int | None = None, timeout: float | None = None
    ) -> HeartbeatAck:
        """Extends the lease (``StaleGenerationError`` when it is lost)."""
        return self._run(_api.heartbeat(attempt_id, generation, usage, timeout))

    def ack(self, attempt_id: str, generation: int) -> Task:
        """A device gateway's "command acknowledged" (not completed)."""
        return self._run(_api.ack(attempt_id, generation))

    def release(self, attempt_id: str, generation: int) -> Task:
        """POST /v1/attempts/{id}/release: gives back an attempt this executor never
        started; the task is due again at once and the attempt ends ``released``.
        ``StaleGenerationError`` (lease gone), ``AttemptAlreadyReportedError`` and
        ``NotFoundError`` mean there is nothing to give back."""
        return self._run(_api.release(attempt_id, generation))

    def report(self, attempt_id: str, body: dict[str, Any]) -> Task:
        """POST /v1/attempts/{id}/report with ``body`` (``generation``, ``outcome``, …)."""
        return self._run(_api.report(attempt_id, body))


class AsyncClient(_Base):
    """The asyncio twin of ``Client``: the same methods, as coroutines (``list``
    and ``events`` return async iterators). Use ``async with`` or ``aclose()``."""

    def __init__(self, base_url: str, api_key: str, timeout: float = 30.0, retry: RetryPolicy = DEFAULT_RETRY) -> None:
        super().__init__(base_url, api_key, timeout, retry)
        self._http = httpx.AsyncClient(base_url=self.base_url)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, call: Call) -> Answer:
        try:
            r = await self._http.request(call.method, call.path, **self._request_args(call))
        except httpx.TransportError as e:
            raise self._transport_error(call, e) from e
        return self._answer(r)

    async def _open(self, call: Call, stack: contextlib.AsyncExitStack) -> httpx.Response:
        try:
            r = await self._http.send(
                self._http.build_request(call.method, call.path, **self._request_args(call, True)), stream=True
            )
        except httpx.TransportError as e:
            raise self._transport_error(call, e) from e
        stack.push_async_callback(r.aclose)
        if not r.is_success:
            await r.aread()
            self._answer(r)
        r.chunks = r.aiter_bytes()  # type: ignore[attr-defined]
        r.call = call  # type: ignore[attr-defined]
        return r

    @staticmethod
    async def _read(r: httpx.Response) -> bytes:
        try:
            return await anext(r.chunks, b"")  # type: ignore[attr-defined]
        except httpx.TransportError as e:
            raise AsyncClient._transport_error(r.call, e) from e  # type: ignore[attr-defined]

    async def _iterate(self, flow: Flow, result: builtins.list[Any] | None = None) -> AsyncIterator[Any]:
        """Performs ``flow``'s steps, yielding its ``Item``s; its result is
        appended to ``result`` (an async generator cannot return one)."""
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(flow.close)
            value: Any = None
            error: BaseException | None = None
            while True:
                try:
                    step = flow.throw(error) if error is not None else flow.send(value)
                except StopIteration as stop:
                    if result is not None:
                        result.append(stop.value)
                    return
                value, error = None, None
                try:
                    if isinstance(step, Call):
                        value = await self._send(step)
                    elif isinstance(step, Sleep):
                        await asyncio.sleep(step.seconds)
                    elif isinstance(step, Item):
                        yield step.value
                    elif isinstance(step, Open):
                        value = await self._open(step.call, stack)
                    elif isinstance(step, Read):
                        value = await self._read(step.handle)
                    elif isinstance(step, Close):
                        await step.handle.aclose()
                except (IdemError, IdemTransportError) as e:
                    error = e

    async def _run(self, flow: Flow) -> Any:
        result: builtins.list[Any] = []
        async for _ in self._iterate(flow, result):
            pass
        return result[0]

    async def submit(
        self,
        operation: str,
        params: Any,
        idempotency_key: str,
        wait: float | None = None,
        traceparent: str | None = None,
    ) -> Submitted:
        """As ``Client.submit``."""
        return await self._run(_api.submit(operation, params, idempotency_key, wait, traceparent, self.retry))

    async def get(self, task_id: str, wait: float | None = None) -> Task:
        return await self._run(_api.get(task_id, wait))

    async def find(self, operation: str, idempotency_key: str) -> Task:
        return await self._run(_api.find(operation, idempotency_key))

    def list(
        self,
        state: str | Iterable[str] | None = None,
        operation: str | None = None,
        created_after: datetime | str | None = None,
        created_before: datetime | str | None = None,
        idempotency_key_prefix: str | None = None,
        external_txn_id: str | None = None,
        limit: int | None = None,
        second_effect: str | None = None,
    ) -> AsyncIterator[Task]:
        """As ``Client.list``, an async iterator."""
        return self._iterate(
            _api.list_tasks(
                state,
                operation,
                created_after,
                created_before,
                idempotency_key_prefix,
                external_txn_id,
                limit,
                second_effect,
            )
        )

    async def attempts(self, task_id: str) -> builtins.list[Attempt]:
        return await self._run(_api.attempts(task_id))

    def events(self, task_id: str, live: bool = False) -> AsyncIterator[Event]:
        """As ``Client.events``, an async iterator."""
        flow = _api.live_events(task_id, self.retry) if live else _api.events(task_id)
        return self._iterate(flow)

    async def cancel(self, task_id: str) -> CancelResponse:
        return await self._run(_api.cancel(task_id))

    async def acknowledge_second_effect(
        self, task_id: str, external_txn_id: str | None, resolution: str, reason: str
    ) -> Task:
        """As ``Client.acknowledge_second_effect``."""
        return await self._run(_api.acknowledge_second_effect(task_id, external_txn_id, resolution, reason))

    async def ack_delivery(self, task_id: str) -> Task:
        return await self._run(_api.ack_delivery(task_id))

    async def claim(
        self,
        executor_id: str,
        operations: Iterable[str] | None = None,
        max: int = 1,
        lease_ms: int | None = None,
        wait_ms: int = 0,
    ) -> builtins.list[ClaimedAttempt]:
        return await self._run(_api.claim(executor_id, operations, max, lease_ms, wait_ms))

    async def heartbeat(
        self, attempt_id: str, generation: int, usage: int | None = None, timeout: float | None = None
    ) -> HeartbeatAck:
        return await self._run(_api.heartbeat(attempt_id, generation, usage, timeout))

    async def ack(self, attempt_id: str, generation: int) -> Task:
        return await self._run(_api.ack(attempt_id, generation))

    async def release(self, attempt_id: str, generation: int) -> Task:
        return await self._run(_api.release(attempt_id, generation))

    async def report(self, attempt_id: str, body: dict[str, Any]) -> Task:
        return await self._run(_api.report(attempt_id, body))
