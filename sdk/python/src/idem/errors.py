"""Errors: one class per problem ``code`` of idem (SPEC §4, RFC 9457), transport
failures, and the exceptions a worker handler raises to choose a failure class.
"""

from __future__ import annotations

from typing import Any


class IdemError(Exception):
    """idem answered with an error status.

    For idem's own errors ``code`` is the problem's stable code (e.g.
    ``"IDEMPOTENCY_CONFLICT"``) and the instance is of the subclass for that
    code; a code this SDK does not know gives this base class. An answer that
    is not a problem document (e.g. a proxy's 502) has ``code`` None and the
    start of the body in ``detail``.
    """

    def __init__(
        self,
        detail: str = "",
        *,
        status: int | None = None,
        code: str | None = None,
        title: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
        problem: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        #: HTTP status, when idem answered.
        self.status = status
        #: Problem ``code``.
        self.code = code
        self.title = title
        #: The answer's ``X-Request-Id``.
        self.request_id = request_id
        #: ``Retry-After`` in seconds (503 ``UNAVAILABLE`` or ``OVERLOADED``,
        #: 429 ``RATE_LIMITED``).
        self.retry_after = retry_after
        #: The whole problem document as received.
        self.problem: dict[str, Any] = problem or {}

    def __str__(self) -> str:
        if self.status is None:
            return self.detail
        return f"HTTP {self.status} {self.code or self.title or ''}: {self.detail}"

    @property
    def retryable(self) -> bool:
        """Whether the SAME request may succeed when repeated (5xx)."""
        return self.status is not None and self.status >= 500


class IdempotencyKeyMissingError(IdemError):
    """400 ``IDEMPOTENCY_KEY_MISSING``."""


class IdempotencyKeyInvalidError(IdemError):
    """400 ``IDEMPOTENCY_KEY_INVALID``: empty, over 255 bytes, not visible ASCII."""


class IdempotencyConflictError(IdemError):
    """422 ``IDEMPOTENCY_CONFLICT``: the scope's task was submitted with other
    material params. ``task_id`` names that task; ``differing_fields`` lists the
    RFC 6901 pointers into ``params`` whose values differ (never the values)."""

    @property
    def task_id(self) -> str | None:
        return self.problem.get("task_id")

    @property
    def differing_fields(self) -> list[str]:
        return list(self.problem.get("differing_fields") or [])


class InvalidRequestError(IdemError):
    """400 ``INVALID_REQUEST``; ``errors`` lists failing values of a params schema."""

    @property
    def errors(self) -> list[dict[str, str]]:
        return list(self.problem.get("errors") or [])


class UnauthenticatedError(IdemError):
    """401 ``UNAUTHENTICATED``."""


class PermissionDeniedError(IdemError):
    """403 ``PERMISSION_DENIED`` from idem.

    A worker handler may raise it too (``raise PermissionDeniedError("…")``):
    the attempt is reported ``failed`` with failure class ``permission_denied``,
    which is never retried.
    """


class NotFoundError(IdemError):
    """404 ``NOT_FOUND``: no such path or record for this tenant."""


class MethodNotAllowedError(IdemError):
    """405 ``METHOD_NOT_ALLOWED``."""


class StaleGenerationError(IdemError):
    """409 ``STALE_GENERATION``: this generation no longer holds the lease (a
    report is still kept as evidence)."""

    @property
    def current_generation(self) -> int | None:
        return self.problem.get("current_generation")


class AttemptAlreadyReportedError(IdemError):
    """409 ``ATTEMPT_ALREADY_REPORTED``: the attempt has another outcome."""


class NotDeliveredError(IdemError):
    """409 ``NOT_DELIVERED``: nothing to acknowledge yet."""


class InvalidStateError(IdemError):
    """409 ``INVALID_STATE``: an operator action does not apply to the task's state."""


class SubmitterRevokedError(IdemError):
    """409 ``SUBMITTER_REVOKED``."""


class ConflictError(IdemError):
    """409 ``CONFLICT``: another refusal of the state machine."""


class RequestTimeoutError(IdemError):
    """408 ``REQUEST_TIMEOUT``: the request body was not complete within the
    server's body bound; the connection was closed."""


class PayloadTooLargeError(IdemError):
    """413 ``PAYLOAD_TOO_LARGE``."""


class RateLimitedError(IdemError):
    """429 ``RATE_LIMITED``: a new task over a rate limit of its tenant or
    class; nothing was created and the idempotency key is still free. Submit
    again with the same key no sooner than ``retry_after`` seconds."""


class UnavailableError(IdemError):
    """503 ``UNAVAILABLE``: the store is unavailable, nothing was half-written."""


class OverloadedError(IdemError):
    """503 ``OVERLOADED``: the store is healthy but had no connection free in
    time; nothing was written. Retry no sooner than ``retry_after`` seconds."""


class NoSyncStandbyError(IdemError):
    """503 ``NO_SYNC_STANDBY``: the server requires a synchronous standby
    (``IDEM_REQUIRE_SYNC_STANDBY``) and none is attached; nothing was written.
    Retry no sooner than ``retry_after`` seconds."""


class InternalError(IdemError):
    """500 ``INTERNAL``."""


#: Problem ``code`` → class (crates/idem-api/src/problem.rs ``ProblemCode``).
ERRORS_BY_CODE: dict[str, type[IdemError]] = {
    "IDEMPOTENCY_KEY_MISSING": IdempotencyKeyMissingError,
    "IDEMPOTENCY_KEY_INVALID": IdempotencyKeyInvalidError,
    "IDEMPOTENCY_CONFLICT": IdempotencyConflictError,
    "INVALID_REQUEST": InvalidRequestError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "NOT_FOUND": NotFoundError,
    "METHOD_NOT_ALLOWED": MethodNotAllowedError,
    "STALE_GENERATION": StaleGenerationError,
    "ATTEMPT_ALREADY_REPORTED": AttemptAlreadyReportedError,
    "NOT_DELIVERED": NotDeliveredError,
    "INVALID_STATE": InvalidStateError,
    "SUBMITTER_REVOKED": SubmitterRevokedError,
    "CONFLICT": ConflictError,
    "REQUEST_TIMEOUT": RequestTimeoutError,
    "PAYLOAD_TOO_LARGE": PayloadTooLargeError,
    "RATE_LIMITED": RateLimitedError,
    "UNAVAILABLE": UnavailableError,
    "OVERLOADED": OverloadedError,
    "NO_SYNC_STANDBY": NoSyncStandbyError,
    "INTERNAL": InternalError,
}


class IdemTransportError(Exception):
    """No answer: connection refused or reset, or the answer was cut off. The
    request may or may not have been applied: repeat it with the same
    idempotency key, or look the task up."""

    retryable = True


class IdemTimeoutError(IdemTransportError):
    """No answer within the time limit (the request may have been applied)."""


# Outcomes a worker handler chooses by raising (the SDK model of docs/SPEC.md §4, "Executors and their leases").


class TransientError(Exception):
    """Raised by a handler: the attempt failed in a way worth retrying
    (failure class ``transient``; retried only for classes declared safe)."""


class InvalidInputError(Exception):
    """Raised by a handler: the params cannot succeed (``invalid_input``, never retried)."""


class UnknownOutcomeError(Exception):
    """Raised by a handler: the external effect may or may not have happened
    (outcome ``unknown``: the task is reconciled before anything repeats)."""
