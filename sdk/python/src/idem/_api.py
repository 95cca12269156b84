"""What the clients do, written once for both the sync and the asyncio client.

Each API method is a generator (a "flow") that yields steps — ``Call`` (one
HTTP request; the answer is sent back in, an error thrown in), ``Sleep``,
``Item`` (a value handed to the caller of an iterator), and ``Open``/``Read``/
``Close`` for a streamed answer — and returns its result. ``Client`` and
``AsyncClient`` only perform the steps (``client.py``), so the retry, paging
and resume rules exist in one place.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

from .errors import ERRORS_BY_CODE, IdemError, IdemTransportError
from .models import (
    TERMINAL_EVENTS,
    Attempt,
    Cancellation,
    CancelResponse,
    ClaimedAttempt,
    Event,
    HeartbeatAck,
    RetryPolicy,
    Submitted,
    Task,
)

MAX_KEY_LEN = 255


@dataclass
class Call:
    """One HTTP request. ``extra_timeout`` (s) is added to the client's time limit
    (a ``Prefer: wait`` or a long-poll claim); ``timeout`` replaces it."""

    method: str
    path: str
    query: list[tuple[str, str]] | None = None
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    extra_timeout: float = 0.0
    timeout: float | None = None


@dataclass
class Answer:
    """A successful answer: status, headers (lower-case names), JSON body (None for 204)."""

    status: int
    headers: dict[str, str]
    body: Any


@dataclass
class Sleep:
    seconds: float


@dataclass
class Item:
    value: Any


@dataclass
class Open:
    """Open a streamed answer; the flow gets back a handle with ``.status_code``."""

    call: Call


@dataclass
class Read:
    """The handle's next chunk of bytes; b"" at the end of the body."""

    handle: Any


@dataclass
class Close:
    handle: Any


Flow = Generator[Any, Any, Any]


def sf_string(key: str) -> str:
    """An idempotency key as an RFC 9651 sf-string (``"key"``, with ``\\`` and ``"``
    escaped). Raises ValueError for a key idem refuses (1–255 visible ASCII)."""
    if not key:
        raise ValueError("the idempotency key is empty")
    if len(key.encode()) > MAX_KEY_LEN:
        raise ValueError(f"the idempotency key has {len(key.encode())} bytes; at most {MAX_KEY_LEN} are allowed")
    bad = next((c for c in key if not "\x21" <= c <= "\x7e"), None)
    if bad is not None:
        raise ValueError(f"the idempotency key contains {bad!r}; only visible ASCII (0x21-0x7E) is allowed")
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def error_from(status: int, headers: dict[str, str], body: bytes) -> IdemError:
    """The error for a non-2xx answer: the class of its problem ``code``."""
    try:
        problem = json.loads(body)
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        return IdemError(
            body[:200].decode("utf-8", "replace"),
            status=status,
            request_id=headers.get("x-request-id"),
            retry_after=retry_after(headers.get("retry-after")),
        )
    code = problem.get("code")
    cls = ERRORS_BY_CODE.get(code, IdemError) if isinstance(code, str) else IdemError
    return cls(
        str(problem.get("detail", "")),
        status=status,
        code=code,
        title=problem.get("title"),
        request_id=headers.get("x-request-id"),
        retry_after=retry_after(headers.get("retry-after")),
        problem=problem,
    )


def retry_after(value: str | None) -> float | None:
    """``Retry-After`` (RFC 9110 §10.2.3) in seconds: delay-seconds or an HTTP-date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def retryable(e: Exception) -> bool:
    return isinstance(e, IdemTransportError) or (isinstance(e, IdemError) and e.retryable)


def _json_copy(value: Any) -> Any:
    """``value`` as it comes back from JSON (tuples become lists…), for comparing params."""
    return json.loads(json.dumps(value))


def _id(value: Any) -> str:
    return quote(str(value), safe="")


def _prefer(wait: float | None) -> dict[str, str]:
    return {"Prefer": f"wait={int(wait)}"} if wait is not None else {}


# -- client flows ---------------------------------------------------------------------------


def submit(
    operation: str,
    params: Any,
    idempotency_key: str,
    wait: float | None,
    traceparent: str | None,
    retry: RetryPolicy,
) -> Flow:
    """POST /v1/tasks, repeated with the SAME key on timeouts, connection errors and
    5xx (pausing as ``Retry-After`` says, else by ``retry``); when the tries are used
    up, the task of the scope if its params equal these. Never a new key."""
    headers = {"Idempotency-Key": sf_string(idempotency_key), **_prefer(wait)}
    if traceparent:
        headers["traceparent"] = traceparent
    call = Call(
        "POST",
        "v1/tasks",
        json={"operation": operation, "params": params},
        headers=headers,
        extra_timeout=float(wait or 0),
    )
    pauses = retry.pauses()
    last: Exception | None = None
    tries = max(retry.max_tries, 1)
    for n in range(1, tries + 1):
        try:
            answer = yield call
        except Exception as e:
            if not retryable(e):
                raise
            last = e
            if n < tries:
                after = e.retry_after if isinstance(e, IdemError) else None
                yield Sleep(min(after, retry.max_backoff) if after is not None else pauses[n - 1])
            continue
        replayed = answer.headers.get("idempotent-replayed", "").lower() == "true" or bool(
            answer.body.get("meta", {}).get("replayed")
        )
        return Submitted(Task.from_json(answer.body["task"]), replayed=replayed, looked_up=False, tries=n)
    assert last is not None
    try:
        task = yield from find(operation, idempotency_key)
    except (IdemError, IdemTransportError):
        raise last from None
    # Only this request's own task: another request's under this key would have
    # been a 422 conflict, and is never returned as this one's.
    if task.operation == operation and task.params == _json_copy(params):
        return Submitted(task, replayed=True, looked_up=True, tries=tries)
    raise last


def get(task_id: str, wait: float | None) -> Flow:
    answer = yield Call("GET", f"v1/tasks/{_id(task_id)}", headers=_prefer(wait), extra_timeout=float(wait or 0))
    return Task.from_json(answer.body["task"])


def find(operation: str, idempotency_key: str) -> Flow:
    # The query carries the key as stored, not its header encoding.
    q = [("operation", operation), ("idempotency_key", idempotency_key)]
    answer = yield Call("GET", "v1/tasks", query=q)
    return Task.from_json(answer.body["task"])


def _stamp(value: datetime | str) -> str:
    return value.isoformat() if isinstance(value, datetime) else value


def list_tasks(
    state: str | Iterable[str] | None,
    operation: str | None,
    created_after: datetime | str | None,
    created_before: datetime | str | None,
    idempotency_key_prefix: str | None,
    external_txn_id: str | None,
    limit: int | None,
    second_effect: str | None = None,
) -> Flow:
    """Every task of the search, following ``next_cursor`` page by page."""
    q: list[tuple[str, str]] = []
    states = [state] if isinstance(state, str) else list(state or [])
    q += [("state", s) for s in states]
    for name, value in (
        ("operation", operation),
        ("created_after", _stamp(created_after) if created_after is not None else None),
        ("created_before", _stamp(created_before) if created_before is not None else None),
        ("idempotency_key_prefix", idempotency_key_prefix),
        ("external_txn_id", external_txn_id),
        ("second_effect", second_effect),
        ("limit", str(limit) if limit is not None else None),
    ):
        if value is not None:
            q.append((name, value))
    cursor = None
    while True:
        answer = yield Call("GET", "v1/tasks", query=q + ([("cursor", cursor)] if cursor else []))
        for t in answer.body["tasks"]:
            yield Item(Task.from_json(t))
        cursor = answer.body.get("next_cursor")
        if not cursor:
            return


def attempts(task_id: str) -> Flow:
    answer = yield Call("GET", f"v1/tasks/{_id(task_id)}/attempts")
    return [Attempt.from_json(a) for a in answer.body["attempts"]]


def events(task_id: str) -> Flow:
    answer = yield Call("GET", f"v1/tasks/{_id(task_id)}/events")
    for e in answer.body["events"]:
        yield Item(Event.from_json(e))


def live_events(task_id: str, retry: RetryPolicy) -> Flow:
    """The task's events as Server-Sent Events, until the event that made it
    terminal (or a 204: nothing after the last id on a terminal task). A dropped
    connection, or one the server ended early (shutdown), is opened again with
    ``Last-Event-ID``; ``retry.max_tries`` failed openings in a row raise."""
    last_id: str | None = None
    pauses = retry.pauses()
    failures = 0
    while True:
        headers = {"Accept": "text/event-stream"}
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
        received = False
        handle = None
        error: Exception | None = None
        try:
            handle = yield Open(Call("GET", f"v1/tasks/{_id(task_id)}/events", headers=headers))
            if handle.status_code == 204:
                return
            parser = SSEParser()
            while chunk := (yield Read(handle)):
                for message in parser.feed(chunk):
                    event = Event.from_json(json.loads(message.data))
                    last_id = message.id if message.id is not None else str(event.seq)
                    received = True
                    yield Item(event)
                    if event.type in TERMINAL_EVENTS:
                        return
        except Exception as e:
            if not retryable(e):
                raise
            error = e
        if handle is not None:
            yield Close(handle)
        failures = 0 if received else failures + 1
        if failures >= max(retry.max_tries, 1):
            raise error or IdemTransportError(f"the event stream of task {task_id} ended {failures} times, empty")
        yield Sleep(pauses[failures - 1] if failures else retry.initial_backoff)


def cancel(task_id: str) -> Flow:
    answer = yield Call("POST", f"v1/tasks/{_id(task_id)}/cancel", json={})
    return CancelResponse(
        Task.from_json(answer.body["task"]), Cancellation.from_json(answer.body["cancellation"]), answer.status
    )


def acknowledge_second_effect(task_id: str, external_txn_id: str | None, resolution: str, reason: str) -> Flow:
    body = {"external_txn_id": external_txn_id, "resolution": resolution, "reason": reason}
    answer = yield Call("POST", f"v1/tasks/{_id(task_id)}/second-effects/acknowledge", json=body)
    return Task.from_json(answer.body["task"])


def ack_delivery(task_id: str) -> Flow:
    answer = yield Call("POST", f"v1/tasks/{_id(task_id)}/delivery/ack", json={})
    return Task.from_json(answer.body["task"])


# -- executor flows -------------------------------------------------------------------------


def claim(executor_id: str, operations: Iterable[str] | None, max: int, lease_ms: int | None, wait_ms: int) -> Flow:
    body: dict[str, Any] = {"executor_id": executor_id, "max": max, "wait_ms": wait_ms}
    if operations is not None:
        body["operations"] = list(operations)
    if lease_ms is not None:
        body["lease_ms"] = lease_ms
    answer = yield Call("POST", "v1/attempts/claim", json=body, extra_timeout=wait_ms / 1000)
    return [ClaimedAttempt.from_json(a) for a in answer.body["attempts"]]


def heartbeat(attempt_id: str, generation: int, usage: int | None, timeout: float | None) -> Flow:
    body: dict[str, Any] = {"generation": generation}
    if usage is not None:
        body["usage"] = usage
    answer = yield Call("POST", f"v1/attempts/{_id(attempt_id)}/heartbeat", json=body, timeout=timeout)
    return HeartbeatAck.from_json(answer.body)


def ack(attempt_id: str, generation: int) -> Flow:
    answer = yield Call("POST", f"v1/attempts/{_id(attempt_id)}/ack", json={"generation": generation})
    return Task.from_json(answer.body["task"])


def release(attempt_id: str, generation: int) -> Flow:
    answer = yield Call("POST", f"v1/attempts/{_id(attempt_id)}/release", json={"generation": generation})
    return Task.from_json(answer.body["task"])


def report(attempt_id: str, body: dict[str, Any]) -> Flow:
    answer = yield Call("POST", f"v1/attempts/{_id(attempt_id)}/report", json=body)
    return Task.from_json(answer.body["task"])


# -- Server-Sent Events ---------------------------------------------------------------------


@dataclass(frozen=True)
class SSEMessage:
    id: str | None
    data: str


_EOL = re.compile(rb"\r\n|\r|\n")


class SSEParser:
    """An incremental parser of the ``text/event-stream`` format (WHATWG HTML
    §9.2.6). Written here because the SDK's one runtime dependency is httpx (issue
    24); httpx's ``iter_lines`` would not do: it also splits at U+2028, U+0085 and
    other line breaks a JSON string may hold, where SSE ends lines only at CR, LF
    and CRLF. ``id`` is the last event id seen so far (it persists across events,
    as the format says); ``event:`` and ``retry:`` are not used by idem."""

    def __init__(self) -> None:
        self._rest = b""
        self._skip_lf = False
        self._first = True
        self._data: list[str] = []
        self.last_event_id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEMessage]:
        """The messages completed by ``chunk``."""
        if not chunk:
            return []
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        buf = self._rest + chunk
        parts = _EOL.split(buf)
        self._rest = parts.pop()
        # A CR that ends the buffer may be the first half of a CRLF.
        self._skip_lf = buf.endswith(b"\r")
        out = []
        for raw in parts:
            line = raw.decode("utf-8", "replace")
            if self._first:
                line = line.removeprefix("\ufeff")
                self._first = False
            message = self._line(line)
            if message is not None:
                out.append(message)
        return out

    def _line(self, line: str) -> SSEMessage | None:
        if not line:
            if not self._data:
                return None
            message = SSEMessage(self.last_event_id, "\n".join(self._data))
            self._data = []
            return message
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self.last_event_id = value
        return None
