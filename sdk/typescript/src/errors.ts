/**
 * Errors: {@link IdemError} for an answer with an error status (one subclass per problem
 * `code` of SPEC §4), {@link IdemTransportError} when no answer came.
 */
import type { InvalidValue, Problem, ProblemCode } from "./types.js";

/** What an error answer carried besides its status line. */
export interface ErrorInit {
  /** HTTP status (default: the code's usual status). */
  status?: number;
  /** The problem `code` (set by the subclass; the base class takes it from here). */
  code?: string;
  /** The problem document, when the body was one. */
  problem?: Partial<Problem>;
  /** `X-Request-Id` of the answer. */
  requestId?: string;
  /** `Retry-After` of the answer, in ms. */
  retryAfterMs?: number;
  cause?: unknown;
}

/**
 * idem answered with an error status. `code` is the problem's stable code (e.g.
 * `IDEMPOTENCY_CONFLICT`), or `undefined` when the body was not a problem document
 * (e.g. from a proxy). A code this SDK does not know gives this base class.
 */
export class IdemError extends Error {
  /** The code its subclass stands for; `undefined` on the base class. */
  static readonly code: ProblemCode | undefined = undefined;
  static readonly status: number = 500;

  readonly status: number;
  readonly code: string | undefined;
  readonly title: string | undefined;
  readonly detail: string | undefined;
  readonly requestId: string | undefined;
  /** `Retry-After`, in ms (503 `UNAVAILABLE` or `OVERLOADED`, 429 `RATE_LIMITED`). */
  readonly retryAfterMs: number | undefined;
  /** The whole problem document (extension members included). */
  readonly problem: Partial<Problem>;

  constructor(message?: string, init: ErrorInit = {}) {
    const ctor = new.target as typeof IdemError;
    const detail = init.problem?.detail ?? message;
    super(message ?? init.problem?.detail ?? init.problem?.title ?? "idem error", { cause: init.cause });
    this.name = new.target.name;
    this.status = init.status ?? init.problem?.status ?? ctor.status;
    this.code = ctor.code ?? init.code ?? init.problem?.code;
    this.title = init.problem?.title;
    this.detail = detail;
    this.requestId = init.requestId;
    this.retryAfterMs = init.retryAfterMs;
    this.problem = init.problem ?? {};
  }

  /** Whether the same request may succeed when repeated: a 5xx answer. */
  get retryable(): boolean {
    return this.status >= 500;
  }
}

/**
 * No answer: connection refused or dropped, or the answer was cut off. The request may or
 * may not have been applied: repeat it with the same idempotency key, or look the task up.
 */
export class IdemTransportError extends Error {
  constructor(message: string, options: { cause?: unknown } = {}) {
    super(message, { cause: options.cause });
    this.name = new.target.name;
  }

  get retryable(): boolean {
    return true;
  }

  /** Whether it is an {@link IdemTimeoutError}. */
  get timedOut(): boolean {
    return this instanceof IdemTimeoutError;
  }
}

/** No answer within the time limit (the request may have been applied). */
export class IdemTimeoutError extends IdemTransportError {}

/** 400: the request has no `Idempotency-Key`. */
export class IdempotencyKeyMissingError extends IdemError {
  static override readonly code = "IDEMPOTENCY_KEY_MISSING" as const;
  static override readonly status = 400;
}
/** 400: the `Idempotency-Key` is malformed. */
export class IdempotencyKeyInvalidError extends IdemError {
  static override readonly code = "IDEMPOTENCY_KEY_INVALID" as const;
  static override readonly status = 400;
}
/**
 * 422: the scope `(tenant, operation, key)` is bound to a request with other material
 * params. `taskId` names the original task; `differingFields` are the RFC 6901 pointers
 * into `params` whose values differ (e.g. `["/amount"]`).
 */
export class IdempotencyConflictError extends IdemError {
  static override readonly code = "IDEMPOTENCY_CONFLICT" as const;
  static override readonly status = 422;
  readonly taskId: string | undefined = this.problem.task_id ?? undefined;
  readonly differingFields: string[] = this.problem.differing_fields ?? [];
}
/** 400: malformed request or a broken rule; `errors` names failing values by JSON Pointer. */
export class InvalidRequestError extends IdemError {
  static override readonly code = "INVALID_REQUEST" as const;
  static override readonly status = 400;
  readonly errors: InvalidValue[] = this.problem.errors ?? [];
}
/** 401: no or bad credentials. */
export class UnauthenticatedError extends IdemError {
  static override readonly code = "UNAUTHENTICATED" as const;
  static override readonly status = 401;
}
/**
 * 403: the key's role or grant does not allow the request. A worker's handler throws it
 * too, to report the attempt `failed` with class `permission_denied`.
 */
export class PermissionDeniedError extends IdemError {
  static override readonly code = "PERMISSION_DENIED" as const;
  static override readonly status = 403;
}
/** 404: no such path or record for this tenant. */
export class NotFoundError extends IdemError {
  static override readonly code = "NOT_FOUND" as const;
  static override readonly status = 404;
}
/** 405: the path exists, not with this method. */
export class MethodNotAllowedError extends IdemError {
  static override readonly code = "METHOD_NOT_ALLOWED" as const;
  static override readonly status = 405;
}
/** 409: the generation no longer holds the lease (the report was kept as evidence). */
export class StaleGenerationError extends IdemError {
  static override readonly code = "STALE_GENERATION" as const;
  static override readonly status = 409;
  readonly currentGeneration: number | undefined = this.problem.current_generation ?? undefined;
}
/** 409: the attempt already has a different outcome. */
export class AttemptAlreadyReportedError extends IdemError {
  static override readonly code = "ATTEMPT_ALREADY_REPORTED" as const;
  static override readonly status = 409;
}
/** 409: the task has no delivery to acknowledge. */
export class NotDeliveredError extends IdemError {
  static override readonly code = "NOT_DELIVERED" as const;
  static override readonly status = 409;
}
/** 409: an operator action does not apply to the task's state. */
export class InvalidStateError extends IdemError {
  static override readonly code = "INVALID_STATE" as const;
  static override readonly status = 409;
}
/** 409: a redrive of a task whose submitting key was revoked or lost the grant. */
export class SubmitterRevokedError extends IdemError {
  static override readonly code = "SUBMITTER_REVOKED" as const;
  static override readonly status = 409;
}
/** 409: another refusal of the state machine. */
export class ConflictError extends IdemError {
  static override readonly code = "CONFLICT" as const;
  static override readonly status = 409;
}
/** 408: the request body was not complete within the server's body bound; the connection was closed. */
export class RequestTimeoutError extends IdemError {
  static override readonly code = "REQUEST_TIMEOUT" as const;
  static override readonly status = 408;
}
/** 413: the body is over the limit. */
export class PayloadTooLargeError extends IdemError {
  static override readonly code = "PAYLOAD_TOO_LARGE" as const;
  static override readonly status = 413;
}
/** 429: a new task over a rate limit of its tenant or class; nothing was created and the idempotency key is still free. Submit again with the same key no sooner than `retryAfterMs`. */
export class RateLimitedError extends IdemError {
  static override readonly code = "RATE_LIMITED" as const;
  static override readonly status = 429;
}
/** 503: the store is unavailable; nothing was half-written. `retryAfterMs` says when to retry. */
export class UnavailableError extends IdemError {
  static override readonly code = "UNAVAILABLE" as const;
  static override readonly status = 503;
}
/** 503: the store is healthy but had no connection free in time; nothing was written. Retry no sooner than `retryAfterMs`. */
export class OverloadedError extends IdemError {
  static override readonly code = "OVERLOADED" as const;
  static override readonly status = 503;
}
/** 503: the server requires a synchronous standby (`IDEM_REQUIRE_SYNC_STANDBY`) and none is attached; nothing was written. Retry no sooner than `retryAfterMs`. */
export class NoSyncStandbyError extends IdemError {
  static override readonly code = "NO_SYNC_STANDBY" as const;
  static override readonly status = 503;
}
/** 500: an internal error. */
export class InternalError extends IdemError {
  static override readonly code = "INTERNAL" as const;
  static override readonly status = 500;
}

/** The class of each code; typed by the generated `ProblemCode`, so a code added to the API fails the build until it has one. */
const ERRORS: { [C in ProblemCode]: typeof IdemError } = {
  IDEMPOTENCY_KEY_MISSING: IdempotencyKeyMissingError,
  IDEMPOTENCY_KEY_INVALID: IdempotencyKeyInvalidError,
  IDEMPOTENCY_CONFLICT: IdempotencyConflictError,
  INVALID_REQUEST: InvalidRequestError,
  UNAUTHENTICATED: UnauthenticatedError,
  PERMISSION_DENIED: PermissionDeniedError,
  NOT_FOUND: NotFoundError,
  METHOD_NOT_ALLOWED: MethodNotAllowedError,
  STALE_GENERATION: StaleGenerationError,
  ATTEMPT_ALREADY_REPORTED: AttemptAlreadyReportedError,
  NOT_DELIVERED: NotDeliveredError,
  INVALID_STATE: InvalidStateError,
  SUBMITTER_REVOKED: SubmitterRevokedError,
  CONFLICT: ConflictError,
  REQUEST_TIMEOUT: RequestTimeoutError,
  PAYLOAD_TOO_LARGE: PayloadTooLargeError,
  RATE_LIMITED: RateLimitedError,
  UNAVAILABLE: UnavailableError,
  OVERLOADED: OverloadedError,
  NO_SYNC_STANDBY: NoSyncStandbyError,
  INTERNAL: InternalError,
};

/**
 * The error for an answer with status `status` and body `text`: the subclass of the
 * problem's `code`, or {@link IdemError} for an unknown code or a body that is not a problem.
 */
export function errorFromResponse(
  status: number,
  text: string,
  init: Omit<ErrorInit, "status" | "problem"> = {},
): IdemError {
  let problem: Partial<Problem> | undefined;
  try {
    const parsed: unknown = JSON.parse(text);
    if (parsed !== null && typeof parsed === "object" && !Array.isArray(parsed)) {
      problem = parsed as Partial<Problem>;
    }
  } catch {
    // Not JSON: a proxy's page, say. The start of the body becomes the message.
  }
  const code = typeof problem?.code === "string" ? problem.code : undefined;
  const ctor = code !== undefined && Object.hasOwn(ERRORS, code) ? ERRORS[code as ProblemCode] : IdemError;
  const message = problem
    ? `HTTP ${status} ${code ?? ""}: ${problem.detail ?? problem.title ?? ""}`.replace("  ", " ")
    : `HTTP ${status}: ${text.slice(0, 200)}`;
  return new ctor(message, { ...init, status, code, problem: problem ?? {} });
}
