"""The documents of idem's HTTP API (SPEC §4, docs/openapi.json) as dataclasses.

Each is built from the JSON with ``from_json``; members this version does not
know are ignored, and enum-like members (``state``, ``kind``…) stay plain
strings so that a newer server's words do not break an older SDK.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

TaskState = Literal["queued", "running", "retry_wait", "reconciling", "succeeded", "failed", "cancelled"]
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})

_FRACTION = re.compile(r"\.(\d+)")


def parse_time(value: str | None) -> datetime | None:
    """An RFC 3339 timestamp as an aware datetime (Python 3.10's
    ``fromisoformat`` takes neither ``Z`` nor fractions other than 3 or 6 digits)."""
    if value is None:
        return None
    text = value.replace("Z", "+00:00").replace("z", "+00:00")
    text = _FRACTION.sub(lambda m: "." + (m.group(1) + "000000")[:6], text, count=1)
    return datetime.fromisoformat(text)


def _time(value: str) -> datetime:
    parsed = parse_time(value)
    assert parsed is not None
    return parsed


@dataclass(frozen=True)
class Cancellation:
    """A cancellation record: ``status`` is ``requested``, ``confirmed`` or ``too_late``;
    ``fee`` (minor units) is None while pending; ``currency`` is the ISO 4217 code
    of the contract's fees (``"EUR"``), None when the contract names none."""

    status: str
    requested_at: datetime
    confirmed_at: datetime | None = None
    fee: int | None = None
    currency: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Cancellation:
        return cls(
            d["status"],
            _time(d["requested_at"]),
            parse_time(d.get("confirmed_at")),
            d.get("fee"),
            d.get("currency"),
        )


@dataclass(frozen=True)
class Delivery:
    """The recorded final outcome; ``charge`` is the contract price in minor units,
    charged once; ``currency`` is its ISO 4217 code (``"EUR"``), None when the
    contract names none."""

    result: Any
    delivered_at: datetime
    charge: int
    external_txn_id: str | None = None
    acknowledged_at: datetime | None = None
    currency: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Delivery:
        return cls(
            d.get("result"),
            _time(d["delivered_at"]),
            d["charge"],
            d.get("external_txn_id"),
            parse_time(d.get("acknowledged_at")),
            d.get("currency"),
        )


@dataclass(frozen=True)
class Failure:
    """Why a task failed: ``class_`` is the failure class (``transient``,
    ``invalid_input``, ``permission_denied``, ``budget_exhausted``, …)."""

    class_: str
    message: str

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Failure:
        return cls(d["class"], d.get("message", ""))


@dataclass(frozen=True)
class EffectAcknowledgment:
    """An operator's acknowledgment of a suspected second effect: ``resolution``
    is ``refund_issued``, ``provider_deduplicated`` or ``false_alarm``;
    ``actor`` as received (a dict)."""

    resolution: str
    reason: str
    actor: dict[str, Any]
    acknowledged_at: datetime

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EffectAcknowledgment:
        return cls(d["resolution"], d["reason"], d.get("actor") or {}, _time(d["acknowledged_at"]))


@dataclass(frozen=True)
class SecondEffect:
    """A suspected second effect (SPEC §2.12): evidence of an external effect
    besides the delivered one. ``evidence`` is ``stale_report``, ``late_report``,
    ``duplicate_report``, ``applied_report`` or ``operator_resolved``."""

    external_txn_id: str | None
    attempt_id: str | None
    generation: int
    evidence: str
    suspected_at: datetime
    acknowledgment: EffectAcknowledgment | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SecondEffect:
        ack = d.get("acknowledgment")
        return cls(
            external_txn_id=d.get("external_txn_id"),
            attempt_id=d.get("attempt_id"),
            generation=d["generation"],
            evidence=d["evidence"],
            suspected_at=_time(d["suspected_at"]),
            acknowledgment=EffectAcknowledgment.from_json(ack) if ack else None,
        )


@dataclass(frozen=True)
class Task:
    """The one durable logical operation a scope maps to (SPEC §4 TASK).
    ``contract`` is the frozen policy as received (a dict)."""

    id: str
    operation: str
    idempotency_key: str
    fingerprint: str
    params: Any
    state: str
    generation: int
    attempt_count: int
    usage: int
    contract: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    cancellation: Cancellation | None = None
    delivery: Delivery | None = None
    failure: Failure | None = None
    second_effects: tuple[SecondEffect, ...] = ()

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Task:
        return cls(
            id=d["id"],
            operation=d["operation"],
            idempotency_key=d["idempotency_key"],
            fingerprint=d["fingerprint"],
            params=d.get("params"),
            state=d["state"],
            generation=d["generation"],
            attempt_count=d["attempt_count"],
            usage=d["usage"],
            contract=d.get("contract") or {},
            created_at=_time(d["created_at"]),
            updated_at=_time(d["updated_at"]),
            cancellation=Cancellation.from_json(d["cancellation"]) if d.get("cancellation") else None,
            delivery=Delivery.from_json(d["delivery"]) if d.get("delivery") else None,
            failure=Failure.from_json(d["failure"]) if d.get("failure") else None,
            second_effects=tuple(SecondEffect.from_json(e) for e in d.get("second_effects") or ()),
        )


@dataclass(frozen=True)
class Submitted:
    """The answer to ``submit``.

    ``replayed``: idem answered with an earlier acceptance (also true when the
    task was found by ``looked_up``). ``tries``: HTTP submissions sent.
    ``looked_up``: every try failed retryably and the task was then found by
    its scope with the same params.
    """

    task: Task
    replayed: bool
    looked_up: bool = False
    tries: int = 1


@dataclass(frozen=True)
class CancelResponse:
    """The answer to ``cancel``: ``status`` 202 when recorded and pending, 200
    when confirmed or ``too_late``."""

    task: Task
    cancellation: Cancellation
    status: int


@dataclass(frozen=True)
class Evidence:
    """A report, heartbeat or acknowledgment received for an attempt.
    ``disposition``: ``applied``, ``repeat``, ``stale_generation``, ``already_reported``."""

    received_at: datetime
    generation: int
    outcome: str
    body: Any
    disposition: str

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Evidence:
        return cls(_time(d["received_at"]), d["generation"], d["outcome"], d.get("body"), d["disposition"])


@dataclass(frozen=True)
class Attempt:
    """One try at executing (``kind`` ``execute``) or reconciling a task."""

    id: str
    task_id: str
    number: int
    generation: int
    kind: str
    state: str
    executor_id: str
    leased_at: datetime
    lease_expires_at: datetime
    usage: int
    external_txn_id: str | None = None
    evidence: list[Evidence] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Attempt:
        return cls(
            id=d["id"],
            task_id=d["task_id"],
            number=d["number"],
            generation=d["generation"],
            kind=d["kind"],
            state=d["state"],
            executor_id=d["executor_id"],
            leased_at=_time(d["leased_at"]),
            lease_expires_at=_time(d["lease_expires_at"]),
            usage=d["usage"],
            external_txn_id=d.get("external_txn_id"),
            evidence=[Evidence.from_json(e) for e in d.get("evidence") or []],
        )


@dataclass(frozen=True)
class Event:
    """An append-only audit event of a task: ``seq`` is 1-based and gap-free."""

    seq: int
    type: str
    at: datetime
    data: Any

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Event:
        return cls(d["seq"], d["type"], _time(d["at"]), d.get("data"))


#: The events that make a task terminal; a task's live stream ends after one.
TERMINAL_EVENTS = frozenset({"delivered", "task_failed", "cancel_confirmed"})


@dataclass(frozen=True)
class ClaimedAttempt:
    """A leased attempt handed to an executor. ``traceparent`` is None when the
    server sends none; ``lease_ms`` (the lease length granted, ms) is None from a
    server that does not send it."""

    id: str
    task_id: str
    number: int
    generation: int
    kind: str
    lease_expires_at: datetime
    operation: str
    params: Any
    idempotency_key: str
    traceparent: str | None = None
    lease_ms: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ClaimedAttempt:
        return cls(
            id=d["id"],
            task_id=d["task_id"],
            number=d["number"],
            generation=d["generation"],
            kind=d["kind"],
            lease_expires_at=_time(d["lease_expires_at"]),
            operation=d["operation"],
            params=d.get("params"),
            idempotency_key=d["idempotency_key"],
            traceparent=d.get("traceparent"),
            lease_ms=d.get("lease_ms"),
        )


@dataclass(frozen=True)
class HeartbeatAck:
    """The answer to a heartbeat: the extended lease end, whether a
    cancellation is pending (stop and report ``cancelled`` with usage), and
    ``lease_ms``, the length the lease was extended by (None from a server that
    does not send it)."""

    lease_expires_at: datetime
    cancel_requested: bool
    lease_ms: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HeartbeatAck:
        return cls(_time(d["lease_expires_at"]), bool(d["cancel_requested"]), d.get("lease_ms"))


@dataclass(frozen=True)
class RetryPolicy:
    """How ``submit`` repeats a request: at most ``max_tries`` submissions, pausing
    ``initial_backoff`` seconds after the first failure, doubled after each
    further one, at most ``max_backoff`` (which also caps ``Retry-After``)."""

    max_tries: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0

    def pauses(self) -> list[float]:
        """The pause after each failed try but the last."""
        out, pause = [], self.initial_backoff
        for _ in range(max(self.max_tries, 1) - 1):
            out.append(min(pause, self.max_backoff))
            pause *= 2
        return out


#: 5 tries, 0.1 s doubling to at most 5 s.
DEFAULT_RETRY = RetryPolicy()
