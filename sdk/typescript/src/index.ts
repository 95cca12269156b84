export { Client, sfString } from "./client.js";
export type {
  CallOptions,
  CancelResult,
  ClaimOptions,
  ClientOptions,
  EventsOptions,
  ListFilter,
  RetryPolicy,
  SubmitOptions,
  Submitted,
  TaskPage,
} from "./client.js";
export * from "./errors.js";
export { SseParser, readSse } from "./sse.js";
export type { SseEvent } from "./sse.js";
export type * from "./types.js";
export {
  Cancelled,
  Committed,
  InvalidInputError,
  MESSAGE_LIMIT,
  MIN_WORKER_LEASE_MS,
  NotCommitted,
  Succeeded,
  TransientError,
  UnknownOutcomeError,
  Worker,
  leaseMarginMs,
} from "./worker.js";
export type {
  AttemptContext,
  ExecuteResult,
  Handler,
  Logger,
  ReconcileResult,
  RunSummary,
  WorkerOptions,
} from "./worker.js";
