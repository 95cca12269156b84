"""Python SDK of idem: a client (``Client``, ``AsyncClient``) and an executor
runtime (``Worker``) for idem's HTTP API (docs/SPEC.md §4)."""

from ._api import sf_string
from .client import AsyncClient, Client
from .errors import (
    ERRORS_BY_CODE,
    AttemptAlreadyReportedError,
    ConflictError,
    IdempotencyConflictError,
    IdempotencyKeyInvalidError,
    IdempotencyKeyMissingError,
    IdemError,
    IdemTimeoutError,
    IdemTransportError,
    InternalError,
    InvalidInputError,
    InvalidRequestError,
    InvalidStateError,
    MethodNotAllowedError,
    NotDeliveredError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    StaleGenerationError,
    SubmitterRevokedError,
    TransientError,
    UnauthenticatedError,
    UnavailableError,
    UnknownOutcomeError,
)
from .models import (
    Attempt,
    CancelResponse,
    Cancellation,
    ClaimedAttempt,
    Delivery,
    Event,
    Evidence,
    Failure,
    HeartbeatAck,
    RetryPolicy,
    Submitted,
    Task,
)
from .worker import Cancelled, Committed, Context, Handler, NotCommitted, Succeeded, Worker

__all__ = [
    "AsyncClient", "Attempt", "AttemptAlreadyReportedError", "CancelResponse", "Cancellation", "Cancelled",
    "ClaimedAttempt", "Client", "Committed", "ConflictError", "Context", "Delivery", "ERRORS_BY_CODE", "Event",
    "Evidence", "Failure", "Handler", "HeartbeatAck", "IdemError", "IdemTimeoutError", "IdemTransportError",
    "IdempotencyConflictError", "IdempotencyKeyInvalidError", "IdempotencyKeyMissingError", "InternalError",
    "InvalidInputError", "InvalidRequestError", "InvalidStateError", "MethodNotAllowedError", "NotCommitted",
    "NotDeliveredError", "NotFoundError", "PayloadTooLargeError", "PermissionDeniedError", "RetryPolicy",
    "StaleGenerationError", "Submitted", "SubmitterRevokedError", "Succeeded", "Task", "TransientError",
    "UnauthenticatedError", "UnavailableError", "UnknownOutcomeError", "Worker", "sf_string",
]
__version__ = "0.1.0"
