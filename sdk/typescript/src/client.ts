/**
 * The idem HTTP client (SPEC §4) over the global `fetch`.
 */
import { IdemError, IdemTimeoutError, IdemTransportError, errorFromResponse } from "./errors.js";
import { readSse, SseParser } from "./sse.js";
import type {
  Attempt,
  Cancellation,
  EffectResolution,
  ClaimedAttempt,
  HeartbeatResponse,
  JsonObject,
  Meta,
  ReportBody,
  Task,
  TaskEvent,
  TaskState,
} from "./types.js";

/** How {@link Client.submit} repeats a request whose answer did not come. */
export interface RetryPolicy {
  /** HTTP submissions at most (at least 1). Default 5. */
  maxTries: number;
  /** Pause after the first failed try, ms; doubled after each further one. Default 100. */
  initialBackoffMs: number;
  /** Longest pause, ms. Default 5000. */
  maxBackoffMs: number;
}

export interface ClientOptions {
  /** Time limit of one request, ms. Default 30 000. */
  timeoutMs?: number;
  retry?: Partial<RetryPolicy>;
  /** A `fetch` to use instead of the global one. */
  fetch?: typeof fetch;
}

/** Per-call options. */
export interface CallOptions {
  /** Ends the call with the signal's reason. */
  signal?: AbortSignal;
}

export interface SubmitOptions extends CallOptions {
  /** Seconds (at most 60) the server may hold the answer until the task is terminal (`Prefer: wait=N`); extends the time limit by as much. */
  wait?: number;
  /** W3C trace context to record with the task (`traceparent` header). */
  traceparent?: string;
}

/** The answer to {@link Client.submit}. */
export interface Submitted {
  /** The task (a replay: its current state and, once delivered, its result). */
  task: Task;
  /** Whether the task existed before this call's answer (`Idempotent-Replayed`, or found by scope). */
  replayed: boolean;
  /** Whether the task was found by its scope after the tries were used up. */
  lookedUp: boolean;
  /** HTTP submissions sent. */
  tries: number;
  /** The answer's `meta` (absent when looked up). */
  meta: Meta | undefined;
}

/** Filters of {@link Client.list} (SPEC §4 "Task search"); every filter given must hold. */
export interface ListFilter {
  state?: TaskState | TaskState[];
  operation?: string;
  /** RFC 3339 instant or a Date; exclusive. */
  createdAfter?: string | Date;
  /** RFC 3339 instant or a Date; exclusive. */
  createdBefore?: string | Date;
  idempotencyKeyPrefix?: string;
  externalTxnId?: string;
  /** `suspected`: tasks with a suspected second effect; `unacknowledged`: with one not acknowledged yet. */
  secondEffect?: "suspected" | "unacknowledged";
  /** Page size, 1–200 (server default 50). */
  limit?: number;
}

export interface TaskPage {
  tasks: Task[];
  /** Cursor of the next page; `null` on the last. */
  nextCursor: string | null;
}

export interface CancelResult {
  /** 202 when recorded and pending, 200 when confirmed or `too_late`. */
  status: number;
  task: Task;
  cancellation: Cancellation;
}

export interface EventsOptions extends CallOptions {
  /** Follow the task live (Server-Sent Events) until its terminal event; default: the history as it is. */
  live?: boolean;
  /** Resume after this event `seq`. */
  afterSeq?: number;
}

export interface ClaimOptions extends CallOptions {
  executorId: string;
  /** Operation classes to claim from; default: every class the key is granted. */
  operations?: string[];
  /** Attempts at most (1–100). */
  max?: number;
  /** Lease length, ms (100 to the class maximum); default: the class default. */
  leaseMs?: number;
  /** Long poll: wait up to this many ms for work (0–30 000). Extends the time limit by as much. */
  waitMs?: number;
}

const TERMINAL_EVENTS = new Set(["delivered", "task_failed", "cancel_confirmed"]);
const MAX_KEY_LEN = 255;

/**
 * An idempotency key as an RFC 9651 sf-string (`"key"`, `\` and `"` escaped), after
 * checking idem's rules (1–255 bytes of visible ASCII).
 *
 * @throws TypeError for a key idem would refuse.
 */
export function sfString(key: string): string {
  if (key.length === 0) throw new TypeError("the idempotency key is empty");
  if (key.length > MAX_KEY_LEN)
    throw new TypeError(`the idempotency key has ${key.length} characters; at most ${MAX_KEY_LEN} are allowed`);
  if (!/^[\x21-\x7e]+$/.test(key)) throw new TypeError("the idempotency key may hold only visible ASCII (0x21–0x7E)");
  return `"${key.replace(/[\\"]/g, (c) => `\\${c}`)}"`;
}

/** Whether two JSON values are equal (object members in any order). */
export function jsonEqual(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (typeof a !== "object" || typeof b !== "object" || a === null || b === null) return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  if (Array.isArray(a) && Array.isArray(b)) return a.length === b.length && a.every((v, i) => jsonEqual(v, b[i]));
  const ka = Object.keys(a);
  const kb = Object.keys(b);
  return (
    ka.length === kb.length &&
    ka.every((k) => Object.hasOwn(b, k) && jsonEqual((a as JsonObject)[k], (b as JsonObject)[k]))
  );
}

/** Resolves after `ms`, or rejects with the signal's reason when it aborts first. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** `Retry-After` (delay-seconds or an HTTP date) in ms. */
function retryAfterMs(value: string | null): number | undefined {
  if (value === null) return undefined;
  if (/^\s*\d+\s*$/.test(value)) return Number(value) * 1000;
  const at = Date.parse(value);
  return Number.isNaN(at) ? undefined : Math.max(0, at - Date.now());
}

function isRetryable(e: unknown): boolean {
  return (e instanceof IdemTransportError || e instanceof IdemError) && e.retryable;
}

interface RequestSpec extends CallOptions {
  method: "GET" | "POST";
  path: string;
  query?: [string, string][];
  body?: unknown;
  headers?: Record<string, string>;
  /** Time limit of the whole exchange, body included; default: the client's. */
  timeoutMs?: number;
  /** An event stream: the time limit covers the answer's head, not its body. */
  stream?: boolean;
}

interface Answer<T> {
  status: number;
  headers: Headers;
  body: T;
}

/**
 * A client of one idem service, authenticated by one API key.
 *
 * ```ts
 * const idem = new Client("http://127.0.0.1:8787", process.env.IDEM_API_KEY!);
 * const { task } = await idem.submit("payment.release", { payee: "acct-42", amount: 1250, currency: "EUR" }, "invoice-42");
 * ```
 */
export class Client {
  readonly baseUrl: URL;
  readonly timeoutMs: number;
  readonly retry: RetryPolicy;
  readonly #apiKey: string;
  readonly #fetch: typeof fetch;

  /**
   * @param baseUrl e.g. `http://127.0.0.1:8787` (a path prefix is kept)
   * @param apiKey sent as `Authorization: Bearer <apiKey>`
   */
  constructor(baseUrl: string | URL, apiKey: string, options: ClientOptions = {}) {
    const base = new URL(baseUrl);
    if (base.protocol !== "http:" && base.protocol !== "https:")
      throw new TypeError(`base URL ${base} must be http:// or https://`);
    if (!base.pathname.endsWith("/")) base.pathname += "/";
    base.search = "";
    base.hash = "";
    this.baseUrl = base;
    this.#apiKey = apiKey;
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.retry = { maxTries: 5, initialBackoffMs: 100, maxBackoffMs: 5_000, ...options.retry };
    this.#fetch = options.fetch ?? globalThis.fetch;
  }

  /**
   * `POST /v1/tasks`: submits `params` for `operation` under `idempotencyKey`. On a timeout,
   * a connection error or a 5xx answer it sends the SAME request with the SAME key again
   * (after `Retry-After`, else exponential backoff), up to `retry.maxTries`; then it looks the
   * task up by scope and returns it (`lookedUp`) only when its params equal `params`. It never
   * invents a new key.
   *
   * @throws {IdempotencyConflictError} the key is bound to other material params (`differingFields`)
   * @throws {IdemError} any other 4xx at once; the last retryable error when the tries and the lookup found nothing
   * @throws {IdemTransportError} no answer after the last try (an {@link IdemTimeoutError} when none came in time) and no task found by scope
   */
  async submit(
    operation: string,
    params: JsonObject,
    idempotencyKey: string,
    options: SubmitOptions = {},
  ): Promise<Submitted> {
    const headers: Record<string, string> = { "idempotency-key": sfString(idempotencyKey) };
    let timeoutMs = this.timeoutMs;
    if (options.wait !== undefined) {
      headers["prefer"] = `wait=${Math.floor(options.wait)}`;
      timeoutMs += options.wait * 1000;
    }
    if (options.traceparent !== undefined) headers["traceparent"] = options.traceparent;
    const maxTries = Math.max(1, this.retry.maxTries);
    let pause = this.retry.initialBackoffMs;
    let last: unknown;
    for (let tries = 1; tries <= maxTries; tries++) {
      try {
        const answer = await this.#request<{ task: Task; meta: Meta }>({
          method: "POST",
          path: "v1/tasks",
          body: { operation, params },
          headers,
          timeoutMs,
          signal: options.signal,
        });
        const replayed =
          answer.headers.get("idempotent-replayed")?.toLowerCase() === "true" || answer.body.meta.replayed;
        return { task: answer.body.task, replayed, lookedUp: false, tries, meta: answer.body.meta };
      } catch (e) {
        if (!isRetryable(e)) throw e;
        last = e;
        if (tries < maxTries) {
          const asked = e instanceof IdemError ? e.retryAfterMs : undefined;
          await sleep(asked ?? pause, options.signal);
          pause = Math.min(pause * 2, this.retry.maxBackoffMs);
        }
      }
    }
    // Only this request's own task: the scope may hold another request's (a conflict the
    // lost answers would have reported). Equal params give an equal fingerprint.
    try {
      const task = await this.find(operation, idempotencyKey, options);
      if (task.operation === operation && jsonEqual(task.params, JSON.parse(JSON.stringify(params)))) {
        return { task, replayed: true, lookedUp: true, tries: maxTries, meta: undefined };
      }
    } catch (e) {
      if (options.signal?.aborted) throw e;
    }
    throw last;
  }

  /** `GET /v1/tasks/{id}`; with `wait` (seconds, ≤ 60) the answer waits until the task is terminal or the time passed. */
  async get(taskId: string, options: CallOptions & { wait?: number } = {}): Promise<Task> {
    const headers: Record<string, string> = {};
    let timeoutMs = this.timeoutMs;
    if (options.wait !== undefined) {
      headers["prefer"] = `wait=${Math.floor(options.wait)}`;
      timeoutMs += options.wait * 1000;
    }
    const answer = await this.#request<{ task: Task }>({
      method: "GET",
      path: `v1/tasks/${enc(taskId)}`,
      headers,
      timeoutMs,
      signal: options.signal,
    });
    return answer.body.task;
  }

  /**
   * `GET /v1/tasks?operation=&idempotency_key=`: the task of a scope.
   *
   * @throws {NotFoundError} the scope has no task
   */
  async find(operation: string, idempotencyKey: string, options: CallOptions = {}): Promise<Task> {
    const query: [string, string][] = [
      ["operation", operation],
      ["idempotency_key", idempotencyKey],
    ];
    const answer = await this.#request<{ task: Task }>({
      method: "GET",
      path: "v1/tasks",
      query,
      signal: options.signal,
    });
    return answer.body.task;
  }

  /** One page of the tenant's tasks, newest first, after `cursor`. */
  async listPage(filter: ListFilter = {}, cursor?: string, options: CallOptions = {}): Promise<TaskPage> {
    const query: [string, string][] = [];
    const states = filter.state === undefined ? [] : Array.isArray(filter.state) ? filter.state : [filter.state];
    for (const s of states) query.push(["state", s]);
    if (filter.operation !== undefined) query.push(["operation", filter.operation]);
    if (filter.createdAfter !== undefined) query.push(["created_after", instant(filter.createdAfter)]);
    if (filter.createdBefore !== undefined) query.push(["created_before", instant(filter.createdBefore)]);
    if (filter.idempotencyKeyPrefix !== undefined) query.push(["idempotency_key_prefix", filter.idempotencyKeyPrefix]);
    if (filter.externalTxnId !== undefined) query.push(["external_txn_id", filter.externalTxnId]);
    if (filter.secondEffect !== undefined) query.push(["second_effect", filter.secondEffect]);
    if (filter.limit !== undefined) query.push(["limit", String(filter.limit)]);
    if (cursor !== undefined) query.push(["cursor", cursor]);
    const answer = await this.#request<{ tasks: Task[]; next_cursor?: string | null }>({
      method: "GET",
      path: "v1/tasks",
      query,
      signal: options.signal,
    });
    return { tasks: answer.body.tasks, nextCursor: answer.body.next_cursor ?? null };
  }

  /** The tenant's tasks matching `filter`, newest first, page after page (`for await (const task of client.list(...))`). */
  async *list(filter: ListFilter = {}, options: CallOptions = {}): AsyncGenerator<Task> {
    let cursor: string | undefined;
    do {
      const page = await this.listPage(filter, cursor, options);
      yield* page.tasks;
      cursor = page.nextCursor ?? undefined;
    } while (cursor !== undefined);
  }

  /** `GET /v1/tasks/{id}/attempts`: every attempt, old ones included, with its evidence. */
  async attempts(taskId: string, options: CallOptions = {}): Promise<Attempt[]> {
    const answer = await this.#request<{ attempts: Attempt[] }>({
      method: "GET",
      path: `v1/tasks/${enc(taskId)}/attempts`,
      signal: options.signal,
    });
    return answer.body.attempts;
  }

  /**
   * The task's events in `seq` order. With `live`, a Server-Sent Events stream that goes on
   * as events commit and ends after the event that made the task terminal; a dropped
   * connection is resumed with `Last-Event-ID` (neither gap nor repeat).
   */
  async *events(taskId: string, options: EventsOptions = {}): AsyncGenerator<TaskEvent> {
    const path = `v1/tasks/${enc(taskId)}/events`;
    if (!options.live) {
      const answer = await this.#request<{ events: TaskEvent[] }>({ method: "GET", path, signal: options.signal });
      yield* answer.body.events.filter((e) => options.afterSeq === undefined || e.seq > options.afterSeq);
      return;
    }
    let lastSeq = options.afterSeq;
    let failures = 0;
    let pause = this.retry.initialBackoffMs;
    for (;;) {
      const headers: Record<string, string> = { accept: "text/event-stream" };
      if (lastSeq !== undefined) headers["last-event-id"] = String(lastSeq);
      let response: Response;
      try {
        response = (await this.#open({ method: "GET", path, headers, stream: true, signal: options.signal })).response;
      } catch (e) {
        if (!isRetryable(e) || ++failures >= this.retry.maxTries) throw e;
        await sleep((e instanceof IdemError ? e.retryAfterMs : undefined) ?? pause, options.signal);
        pause = Math.min(pause * 2, this.retry.maxBackoffMs);
        continue;
      }
      if (response.status === 204 || response.body === null) return;
      const parser = new SseParser();
      let received = false;
      try {
        for await (const sse of readSse(response.body, parser)) {
          const event = JSON.parse(sse.data) as TaskEvent;
          lastSeq = event.seq;
          received = true;
          failures = 0;
          pause = this.retry.initialBackoffMs;
          yield event;
          if (TERMINAL_EVENTS.has(event.type)) return;
        }
        if (received) continue;
        // Ended with nothing: count it as a failure, so a server that keeps doing so is not hammered.
        if (++failures >= this.retry.maxTries)
          throw new IdemTransportError(`event stream of task ${taskId} keeps ending without an event`);
      } catch (e) {
        if (options.signal?.aborted) throw options.signal.reason;
        if (e instanceof SyntaxError)
          throw new IdemError(`event stream of task ${taskId}: ${e.message}`, { status: response.status, cause: e });
        if (e instanceof IdemTransportError || ++failures >= this.retry.maxTries)
          throw e instanceof IdemTransportError
            ? e
            : new IdemTransportError(`event stream of task ${taskId} broke`, { cause: e });
      }
      await sleep(parser.retryMs ?? pause, options.signal);
      pause = Math.min(pause * 2, this.retry.maxBackoffMs);
      // The server ended the stream without a terminal event (it is shutting down): resume.
    }
  }

  /** `POST /v1/tasks/{id}/cancel`: records a cancel request (confirmed at once for a queued task). */
  async cancel(taskId: string, options: CallOptions = {}): Promise<CancelResult> {
    const answer = await this.#request<{ task: Task; cancellation: Cancellation }>({
      method: "POST",
      path: `v1/tasks/${enc(taskId)}/cancel`,
      signal: options.signal,
    });
    return { status: answer.status, task: answer.body.task, cancellation: answer.body.cancellation };
  }

  /** `POST /v1/tasks/{id}/delivery/ack`: acknowledges the delivered result (idempotent). */
  async ackDelivery(taskId: string, options: CallOptions = {}): Promise<Task> {
    const answer = await this.#request<{ task: Task }>({
      method: "POST",
      path: `v1/tasks/${enc(taskId)}/delivery/ack`,
      signal: options.signal,
    });
    return answer.body.task;
  }

  /**
   * `POST /v1/tasks/{id}/second-effects/acknowledge` (admin key): records how the suspected
   * second effect with `externalTxnId` (`null`: the one reported without an id) was settled,
   * and why. The task does not change otherwise; an acknowledged effect answers its
   * acknowledgment. A task without that second effect is `NotFoundError` (404).
   */
  async acknowledgeSecondEffect(
    taskId: string,
    externalTxnId: string | null,
    resolution: EffectResolution,
    reason: string,
    options: CallOptions = {},
  ): Promise<Task> {
    const answer = await this.#request<{ task: Task }>({
      method: "POST",
      path: `v1/tasks/${enc(taskId)}/second-effects/acknowledge`,
      body: { external_txn_id: externalTxnId, resolution, reason },
      signal: options.signal,
    });
    return answer.body.task;
  }

  /** `POST /v1/attempts/claim` (executor key): leases due attempts; an empty list when none came within `waitMs`. */
  async claim(options: ClaimOptions): Promise<ClaimedAttempt[]> {
    const body: Record<string, unknown> = { executor_id: options.executorId };
    if (options.operations !== undefined) body["operations"] = options.operations;
    if (options.max !== undefined) body["max"] = options.max;
    if (options.leaseMs !== undefined) body["lease_ms"] = options.leaseMs;
    if (options.waitMs !== undefined) body["wait_ms"] = options.waitMs;
    const answer = await this.#request<{ attempts: ClaimedAttempt[] }>({
      method: "POST",
      path: "v1/attempts/claim",
      body,
      timeoutMs: this.timeoutMs + (options.waitMs ?? 0),
      signal: options.signal,
    });
    return answer.body.attempts;
  }

  /**
   * `POST /v1/attempts/{id}/heartbeat`: extends the lease and records the attempt's usage total.
   *
   * @throws {StaleGenerationError} the lease is lost
   */
  async heartbeat(
    attemptId: string,
    generation: number,
    usage?: number,
    options: CallOptions & { timeoutMs?: number } = {},
  ): Promise<HeartbeatResponse> {
    const body: Record<string, unknown> = { generation };
    if (usage !== undefined) body["usage"] = usage;
    const answer = await this.#request<HeartbeatResponse>({
      method: "POST",
      path: `v1/attempts/${enc(attemptId)}/heartbeat`,
      body,
      ...options,
    });
    return answer.body;
  }

  /** `POST /v1/attempts/{id}/ack`: the command was acknowledged (not completed). */
  async ack(attemptId: string, generation: number, options: CallOptions = {}): Promise<void> {
    await this.#request<unknown>({
      method: "POST",
      path: `v1/attempts/${enc(attemptId)}/ack`,
      body: { generation },
      signal: options.signal,
    });
  }

  /**
   * `POST /v1/attempts/{id}/release`: gives back an attempt this executor never started; the
   * task is due again at once and the attempt ends `released`.
   *
   * @throws {StaleGenerationError} the lease is gone; {@link AttemptAlreadyReportedError} it has
   *   an outcome; {@link NotFoundError} no such attempt: in each case nothing to give back
   */
  async release(attemptId: string, generation: number, options: CallOptions = {}): Promise<Task> {
    const answer = await this.#request<{ task: Task }>({
      method: "POST",
      path: `v1/attempts/${enc(attemptId)}/release`,
      body: { generation },
      signal: options.signal,
    });
    return answer.body.task;
  }

  /**
   * `POST /v1/attempts/{id}/report`: the attempt's outcome.
   *
   * @throws {StaleGenerationError} the generation no longer holds the lease (the report is kept as evidence)
   */
  async report(attemptId: string, body: ReportBody, options: CallOptions = {}): Promise<Task> {
    const answer = await this.#request<{ task: Task }>({
      method: "POST",
      path: `v1/attempts/${enc(attemptId)}/report`,
      body,
      signal: options.signal,
    });
    return answer.body.task;
  }

  /** Sends a request; returns the response when its status is a success, else throws its error. */
  async #open(spec: RequestSpec): Promise<{ response: Response; timeout: AbortSignal | undefined }> {
    const url = new URL(spec.path, this.baseUrl);
    for (const [k, v] of spec.query ?? []) url.searchParams.append(k, v);
    const headers: Record<string, string> = { authorization: `Bearer ${this.#apiKey}`, ...spec.headers };
    if (spec.body !== undefined) headers["content-type"] = "application/json";
    // A stream's time limit covers its head only: the body lasts as long as the server keeps it open.
    const headLimit = spec.stream ? new AbortController() : undefined;
    const headTimer =
      headLimit &&
      setTimeout(
        () => headLimit.abort(new DOMException("no answer in time", "TimeoutError")),
        spec.timeoutMs ?? this.timeoutMs,
      );
    const timeout = headLimit?.signal ?? AbortSignal.timeout(spec.timeoutMs ?? this.timeoutMs);
    const signals = [spec.signal, timeout].filter((s): s is AbortSignal => s !== undefined);
    let response: Response;
    try {
      response = await this.#fetch(url, {
        method: spec.method,
        headers,
        body: spec.body === undefined ? undefined : JSON.stringify(spec.body),
        signal: AbortSignal.any(signals),
      });
    } catch (e) {
      throw this.#transport(e, spec, timeout);
    } finally {
      clearTimeout(headTimer);
    }
    if (response.ok) return { response, timeout };
    let text: string;
    try {
      text = await response.text();
    } catch (e) {
      throw this.#transport(e, spec, timeout);
    }
    throw errorFromResponse(response.status, text, {
      requestId: response.headers.get("x-request-id") ?? undefined,
      retryAfterMs: retryAfterMs(response.headers.get("retry-after")),
    });
  }

  async #request<T>(spec: RequestSpec): Promise<Answer<T>> {
    const { response, timeout } = await this.#open(spec);
    let text: string;
    try {
      text = await response.text();
    } catch (e) {
      throw this.#transport(e, spec, timeout);
    }
    let body: T;
    try {
      body = (text === "" ? undefined : JSON.parse(text)) as T;
    } catch (e) {
      throw new IdemError(`HTTP ${response.status}: the answer is not JSON: ${text.slice(0, 200)}`, {
        status: response.status,
        cause: e,
      });
    }
    return { status: response.status, headers: response.headers, body };
  }

  #transport(e: unknown, spec: RequestSpec, timeout: AbortSignal | undefined): unknown {
    if (spec.signal?.aborted) return spec.signal.reason;
    const what = `${spec.method} /${spec.path}`;
    if (timeout?.aborted)
      return new IdemTimeoutError(`${what}: no answer within ${spec.timeoutMs ?? this.timeoutMs} ms`, { cause: e });
    const cause = e instanceof Error && e.cause instanceof Error ? e.cause.message : String(e);
    return new IdemTransportError(`${what}: ${cause}`, { cause: e });
  }
}

function enc(id: string): string {
  return encodeURIComponent(id);
}

function instant(t: string | Date): string {
  return t instanceof Date ? t.toISOString() : t;
}
