/**
 * The executor runtime: claims attempts for its handlers, heartbeats them,
 * tells handlers about cancellation and lease loss, maps their outcomes to reports, and
 * shuts down gracefully.
 *
 * The lease, as the executor keeps it (SPEC §4, leases): each attempt has a local deadline,
 * the lease length the server last confirmed (`lease_ms` of the claim or heartbeat answer)
 * counted from when that request was sent (monotonic clock), less a margin of
 * max(500 ms, 10 % of the lease). At that deadline `ctx.signal` aborts and `ctx.leaseLost` is
 * set, unless a heartbeat answer moved the deadline first. A heartbeat times out within
 * min(lease / 3, time left to the deadline); one answered 401, 403, 404 or 409 loses the lease
 * at once. The server hands the task to another executor only after its own lease end, later
 * than the local deadline: a handler that stops on `ctx.signal` never overlaps the next
 * attempt; one that ignores it is on its own.
 */
import type { Client } from "./client.js";
import { sleep } from "./client.js";
import { IdemError, IdemTransportError, PermissionDeniedError, StaleGenerationError } from "./errors.js";
import type { AttemptKind, ClaimedAttempt, JsonObject, ReportBody } from "./types.js";

/** `execute` outcome: the effect happened. Returning a plain value is the same as `new Succeeded(value)`. */
export class Succeeded {
  constructor(
    readonly result?: JsonObject,
    readonly options: { externalTxnId?: string; usage?: number } = {},
  ) {}
}
/** `execute` outcome: the handler stopped on a cancel request (`ctx.signal`); usage is kept. */
export class Cancelled {}
/** `reconcile` outcome: the effect happened (the provider has it). */
export class Committed {
  constructor(
    readonly result?: JsonObject,
    readonly options: { externalTxnId?: string } = {},
  ) {}
}
/** `reconcile` outcome: the effect did not happen; the task may be executed again. */
export class NotCommitted {}

/** Thrown by `execute`: a failure worth retrying (retried only for classes declared safe). */
export class TransientError extends Error {
  override name = "TransientError";
}
/** Thrown by `execute`: the params cannot be executed; never retried. */
export class InvalidInputError extends Error {
  override name = "InvalidInputError";
}
/** Thrown by `execute`: whether the effect happened is not known; the task is reconciled. */
export class UnknownOutcomeError extends Error {
  override name = "UnknownOutcomeError";
}
// `PermissionDeniedError` (from ./errors.js) thrown by `execute` reports `permission_denied`.

/** Longest `message` the worker puts into a report, in characters (SPEC §7). */
export const MESSAGE_LIMIT = 4096;

/** Milliseconds the local lease deadline keeps before the confirmed lease end: max(500 ms, 10 % of the lease). */
export function leaseMarginMs(leaseMs: number): number {
  return Math.max(500, leaseMs / 10);
}

/** Shortest lease a worker asks for, ms: below twice the margin the local deadline leaves no time to run. */
export const MIN_WORKER_LEASE_MS = 1000;

/** Heartbeat answers that mean the lease is gone now: key revoked, grant withdrawn, attempt unknown, generation stale. */
const LEASE_GONE = new Set([401, 403, 404, 409]);

/** What `execute` may return. */
export type ExecuteResult = Succeeded | Cancelled | JsonObject | undefined;
/** What `reconcile` must return. */
export type ReconcileResult = Committed | NotCommitted;

/** What a handler is given for one attempt. */
export interface AttemptContext {
  /** The task id: pass it to the provider as ITS idempotency key. */
  readonly taskId: string;
  readonly attemptId: string;
  /** Fencing generation of this attempt. */
  readonly generation: number;
  readonly kind: AttemptKind;
  readonly operation: string;
  readonly params: JsonObject;
  /** The client's idempotency key. */
  readonly idempotencyKey: string;
  /** W3C trace context recorded with the submit, when there is one. */
  readonly traceparent: string | null;
  /** Attempt number. */
  readonly number: number;
  /** Lease end (RFC 3339), moved on by every heartbeat. */
  readonly leaseExpiresAt: string;
  /**
   * Aborted when a cancellation is requested, the lease is lost (the local lease deadline
   * passed, or a heartbeat was answered 401/403/404/409), or the worker abandons the attempt at
   * shutdown (then nothing is reported).
   */
  readonly signal: AbortSignal;
  /** A cancellation was requested: stop and return `new Cancelled()`. */
  readonly cancelRequested: boolean;
  /** The lease is gone: stop; a result still returned is reported once (evidence only once the server's lease ended). */
  readonly leaseLost: boolean;
  /** The usage total recorded so far. */
  readonly usage: number;
  /** Sets the attempt's usage total (integer units), sent with the next heartbeat and the report. */
  recordUsage(total: number): void;
  /** Device gateway: the command was acknowledged (`POST /v1/attempts/{id}/ack`), separately from completion. */
  ack(): Promise<void>;
}

/** The code that executes (and reconciles) one operation class. */
export interface Handler {
  execute(ctx: AttemptContext): Promise<ExecuteResult> | ExecuteResult;
  /** Asks the provider whether the effect of an earlier attempt happened (look it up by `ctx.taskId`). */
  reconcile(ctx: AttemptContext): Promise<ReconcileResult> | ReconcileResult;
}

export interface Logger {
  info(message: string): void;
  warn(message: string): void;
  error(message: string): void;
}

export interface WorkerOptions {
  /** Recorded on every attempt this worker claims (1–200 characters). */
  executorId: string;
  /** Operation class → handler; the worker claims only these classes. */
  handlers: Record<string, Handler>;
  /** Attempts run at once. Default 1. */
  concurrency?: number;
  /** Lease asked for on claim, ms (at least {@link MIN_WORKER_LEASE_MS}). Default 30 000. */
  leaseMs?: number;
  /** After `stop()` (or SIGTERM/SIGINT), how long running attempts may take, ms. Default 30 000. */
  graceMs?: number;
  /** Long-poll wait of a claim, ms (≤ 30 000). Default 20 000. */
  claimWaitMs?: number;
  /**
   * Pause between heartbeats, ms. Default a third of the granted lease. One of the lease or more
   * lets the local lease deadline pass between heartbeats (the SDK's tests lose a lease on
   * purpose that way).
   */
  heartbeatIntervalMs?: number;
  /** Default `console`. */
  logger?: Logger;
  /** Whether `run()` stops on SIGTERM and SIGINT (a second signal skips the grace). Default true. */
  handleSignals?: boolean;
}

/** What `run()` resolves with. */
export interface RunSummary {
  /** Attempts still running when the grace ran out: not reported, their leases run out. */
  abandoned: number;
  /** Attempts received after the stop began, released unstarted. */
  released: number;
}

class Ctx implements AttemptContext {
  readonly taskId: string;
  readonly attemptId: string;
  readonly generation: number;
  readonly kind: AttemptKind;
  readonly operation: string;
  readonly params: JsonObject;
  readonly idempotencyKey: string;
  readonly traceparent: string | null;
  readonly number: number;
  leaseExpiresAt: string;
  cancelRequested = false;
  leaseLost = false;
  abandoned = false;
  usage = 0;
  readonly controller = new AbortController();

  constructor(
    a: ClaimedAttempt,
    private readonly client: Client,
  ) {
    this.taskId = a.task_id;
    this.attemptId = a.id;
    this.generation = a.generation;
    this.kind = a.kind;
    this.operation = a.operation;
    this.params = a.params;
    this.idempotencyKey = a.idempotency_key;
    this.traceparent = a.traceparent ?? null;
    this.number = a.number;
    this.leaseExpiresAt = a.lease_expires_at;
  }

  get signal(): AbortSignal {
    return this.controller.signal;
  }

  recordUsage(total: number): void {
    if (!Number.isSafeInteger(total) || total < 0)
      throw new RangeError(`usage must be a non-negative integer, not ${total}`);
    this.usage = total;
  }

  async ack(): Promise<void> {
    await this.client.ack(this.attemptId, this.generation);
  }
}

/** What a claim ended with: its send time (`performance.now()`) and attempts, or its error. */
type Claimed = { sent: number; attempts: ClaimedAttempt[] } | { error: unknown };

/**
 * The local lease deadline of one attempt (`performance.now()` ms): the confirmed lease length
 * counted from the confirming request's send time, less {@link leaseMarginMs}. Once armed, the
 * deadline's passing calls `expire`.
 */
class Lease {
  deadline: number;
  #timer: NodeJS.Timeout | undefined;

  constructor(
    public leaseMs: number,
    sent: number,
    private readonly expire: () => void,
  ) {
    this.deadline = sent + leaseMs - leaseMarginMs(leaseMs);
  }

  /** Ms to the deadline (negative once passed). */
  left(): number {
    return this.deadline - performance.now();
  }

  /** A heartbeat sent at `sent` was answered with `leaseMs`: the deadline moves on. */
  confirm(sent: number, leaseMs: number | undefined): void {
    this.leaseMs = leaseMs ?? this.leaseMs;
    this.deadline = sent + this.leaseMs - leaseMarginMs(this.leaseMs);
    if (this.#timer !== undefined) this.arm();
  }

  arm(): void {
    this.close();
    this.#timer = setTimeout(this.expire, Math.max(0, this.left()));
  }

  close(): void {
    clearTimeout(this.#timer);
    this.#timer = undefined;
  }
}

/**
 * Runs handlers for attempts claimed from idem.
 *
 * ```ts
 * const worker = new Worker(client, { executorId: "payments-1", handlers: { "payment.release": payouts } });
 * await worker.run(); // until SIGTERM / SIGINT / worker.stop()
 * ```
 */
export class Worker {
  readonly #client: Client;
  readonly #executorId: string;
  readonly #handlers: Record<string, Handler>;
  readonly #concurrency: number;
  readonly #leaseMs: number;
  readonly #graceMs: number;
  readonly #claimWaitMs: number;
  readonly #heartbeatMs: number | undefined;
  readonly #log: Logger;
  readonly #handleSignals: boolean;
  readonly #running = new Map<string, { ctx: Ctx; done: Promise<void>; abandoned: boolean }>();
  readonly #releases = new Set<Promise<void>>();
  #released = 0;
  #stopping: AbortController | undefined;
  #skipGrace: AbortController | undefined;
  #closeClaim: AbortController | undefined;
  #openClaim: Promise<Claimed> | undefined;
  #run: Promise<RunSummary> | undefined;
  #slotFreed: (() => void) | undefined;

  constructor(client: Client, options: WorkerOptions) {
    this.#client = client;
    this.#executorId = options.executorId;
    this.#handlers = options.handlers;
    this.#concurrency = Math.max(1, options.concurrency ?? 1);
    this.#leaseMs = options.leaseMs ?? 30_000;
    this.#graceMs = options.graceMs ?? 30_000;
    this.#claimWaitMs = options.claimWaitMs ?? 20_000;
    this.#heartbeatMs = options.heartbeatIntervalMs;
    this.#log = options.logger ?? console;
    this.#handleSignals = options.handleSignals ?? true;
    if (Object.keys(this.#handlers).length === 0) throw new TypeError("a worker needs at least one handler");
    if (!(this.#leaseMs >= MIN_WORKER_LEASE_MS))
      throw new RangeError(`leaseMs must be at least ${MIN_WORKER_LEASE_MS}, not ${this.#leaseMs}`);
  }

  /** Attempts running now. */
  get running(): number {
    return this.#running.size;
  }

  /**
   * Claims and runs attempts until `stop()` (or SIGTERM/SIGINT); then claims nothing more,
   * lets running attempts finish within the grace, and resolves. The claim open at the stop
   * is closed at once when nothing runs, else when the running attempts are done; an attempt
   * it still brings is released (`POST /v1/attempts/{id}/release`), never run. A claim refused
   * with a 4xx (bad key, grant, lease) stops the worker the same way and rejects with that error.
   */
  run(): Promise<RunSummary> {
    if (this.#run) throw new Error("the worker is already running");
    this.#stopping = new AbortController();
    this.#skipGrace = new AbortController();
    this.#closeClaim = new AbortController();
    this.#released = 0;
    this.#run = this.#loop();
    return this.#run;
  }

  /** Stops claiming at once and resolves when `run()` has ended (after at most the grace). */
  async stop(): Promise<RunSummary | undefined> {
    if (!this.#run) return undefined;
    this.#stopping?.abort(new Error("worker stopping"));
    return this.#run.catch(() => undefined);
  }

  async #loop(): Promise<RunSummary> {
    const stopping = this.#stopping!.signal;
    const onSignal = (name: string) => {
      if (stopping.aborted) {
        this.#log.warn(`${name} again: abandoning running attempts now`);
        this.#skipGrace?.abort();
      } else {
        this.#log.info(
          `${name}: stopping (claiming nothing more, ${this.#running.size} attempt(s) running, grace ${this.#graceMs} ms)`,
        );
        this.#stopping?.abort(new Error(name));
      }
    };
    const onTerm = () => onSignal("SIGTERM");
    const onInt = () => onSignal("SIGINT");
    if (this.#handleSignals) {
      process.on("SIGTERM", onTerm);
      process.on("SIGINT", onInt);
    }
    let failure: unknown;
    let summary: RunSummary;
    try {
      failure = await this.#claimLoop(stopping);
      summary = await this.#drain();
    } finally {
      if (this.#handleSignals) {
        process.off("SIGTERM", onTerm);
        process.off("SIGINT", onInt);
      }
      this.#run = undefined;
    }
    if (failure !== undefined) throw failure;
    return summary;
  }

  /** Claims until stopped; returns the error that stopped it, if any. A claim open at the stop is left in `#openClaim`. */
  async #claimLoop(stopping: AbortSignal): Promise<unknown> {
    const operations = Object.keys(this.#handlers);
    const stopped = new Promise<"stopped">((resolve) =>
      stopping.aborted ? resolve("stopped") : stopping.addEventListener("abort", () => resolve("stopped")),
    );
    let pause = 250;
    while (!stopping.aborted) {
      const free = this.#concurrency - this.#running.size;
      if (free <= 0) {
        await new Promise<void>((resolve) => {
          const done = () => {
            stopping.removeEventListener("abort", done);
            resolve();
          };
          this.#slotFreed = done;
          stopping.addEventListener("abort", done, { once: true });
        });
        continue;
      }
      const sent = performance.now();
      const claim: Promise<Claimed> = this.#client
        .claim({
          executorId: this.#executorId,
          operations,
          max: free,
          leaseMs: this.#leaseMs,
          waitMs: this.#claimWaitMs,
          signal: this.#closeClaim!.signal,
        })
        .then(
          (attempts) => ({ sent, attempts }),
          (error: unknown) => ({ error }),
        );
      const claimed = await Promise.race([claim, stopped]);
      if (claimed === "stopped") {
        this.#openClaim = claim;
        break;
      }
      if ("error" in claimed) {
        const e = claimed.error;
        if (stopping.aborted) break;
        if (!(e instanceof IdemTransportError || (e instanceof IdemError && e.retryable))) {
          this.#log.error(`claim refused, stopping: ${describe(e)}`);
          this.#stopping?.abort(e);
          return e;
        }
        // At least as long as idem asked (`Retry-After` of a 503 `OVERLOADED` or `UNAVAILABLE`).
        const wait = Math.max(pause, (e instanceof IdemError ? e.retryAfterMs : undefined) ?? 0);
        this.#log.warn(`claim failed, retrying in ${wait} ms: ${describe(e)}`);
        await sleep(wait, stopping).catch(() => {});
        pause = Math.min(pause * 2, 5_000);
        continue;
      }
      pause = 250;
      for (const a of claimed.attempts) {
        if (stopping.aborted) this.#release(a);
        else this.#start(a, claimed.sent);
      }
    }
    return undefined;
  }

  async #drain(): Promise<RunSummary> {
    const open = this.#openClaim;
    this.#openClaim = undefined;
    // What the open claim brings from now on is released, never run.
    const releasing = open?.then((c) => {
      if ("attempts" in c) for (const a of c.attempts) this.#release(a);
    });
    if (this.#running.size === 0) this.#closeClaim!.abort(new Error("worker stopping"));
    const finished = new AbortController();
    const graceOver = sleep(this.#graceMs, AbortSignal.any([this.#skipGrace!.signal, finished.signal])).catch(() => {});
    await Promise.race([Promise.all([...this.#running.values()].map((r) => r.done)), graceOver]);
    finished.abort();
    this.#closeClaim!.abort(new Error("worker stopping"));
    await releasing;
    let abandoned = 0;
    for (const r of this.#running.values()) {
      r.abandoned = true;
      r.ctx.abandoned = true;
      abandoned++;
      r.ctx.controller.abort(new Error("the worker shut down: attempt abandoned"));
      this.#log.warn(
        `attempt ${r.ctx.attemptId} (task ${r.ctx.taskId}) still running after the grace: abandoned, its lease runs out`,
      );
    }
    this.#running.clear();
    await Promise.all([...this.#releases]);
    return { abandoned, released: this.#released };
  }

  /** Gives `a` back unstarted, repeating only when no answer came; 404/409 mean nothing to give back. */
  #release(a: ClaimedAttempt): void {
    const what = `attempt ${a.id} (task ${a.task_id})`;
    const done = (async () => {
      let pause = this.#client.retry.initialBackoffMs;
      for (let tries = 1; ; tries++) {
        try {
          await this.#client.release(a.id, a.generation);
          this.#released++;
          this.#log.info(`${what}: released unstarted`);
          return;
        } catch (e) {
          if (e instanceof IdemError && (e.status === 404 || e.status === 409)) {
            this.#log.info(`${what}: nothing to release (${describe(e)})`);
            return;
          }
          const retryable = e instanceof IdemTransportError || (e instanceof IdemError && e.retryable);
          if (!retryable || tries >= this.#client.retry.maxTries) {
            this.#log.error(`${what}: release failed, its lease runs out: ${describe(e)}`);
            return;
          }
          await sleep(pause);
          pause = Math.min(pause * 2, this.#client.retry.maxBackoffMs);
        }
      }
    })();
    this.#releases.add(done);
    void done.finally(() => this.#releases.delete(done));
  }

  #start(a: ClaimedAttempt, sent: number): void {
    const ctx = new Ctx(a, this.#client);
    const entry = { ctx, done: Promise.resolve(), abandoned: false };
    entry.done = this.#attempt(ctx, a, sent, () => entry.abandoned)
      .catch((e: unknown) => this.#log.error(`attempt ${ctx.attemptId} (task ${ctx.taskId}): ${describe(e)}`))
      .finally(() => {
        if (this.#running.get(ctx.attemptId) === entry) this.#running.delete(ctx.attemptId);
        this.#slotFreed?.();
        this.#slotFreed = undefined;
      });
    this.#running.set(ctx.attemptId, entry);
  }

  async #attempt(ctx: Ctx, a: ClaimedAttempt, sent: number, abandoned: () => boolean): Promise<void> {
    const handler = this.#handlers[ctx.operation];
    const lease = new Lease(a.lease_ms ?? this.#leaseMs, sent, () =>
      this.#leaseLost(ctx, `no heartbeat confirmed it before the local lease deadline (lease ${lease.leaseMs} ms)`),
    );
    if (this.#claimWaitMs > 0 && lease.left() < lease.leaseMs / 2) {
      // A long poll's send time may be long before the grant: count from a heartbeat's.
      await this.#heartbeat(ctx, lease, lease.leaseMs / 3);
      if (ctx.leaseLost) return;
    }
    if (this.#stopping!.signal.aborted || lease.left() <= 0) {
      this.#release(a);
      return;
    }
    lease.arm();
    const stopHeartbeats = this.#heartbeats(ctx, lease, abandoned);
    let body: Omit<ReportBody, "generation">;
    try {
      if (!handler) throw new Error(`no handler for ${ctx.operation}`);
      body =
        ctx.kind === "reconcile"
          ? reconcileReport(await handler.reconcile(ctx))
          : executeReport(await handler.execute(ctx));
    } catch (e) {
      body =
        ctx.kind === "reconcile"
          ? { outcome: "failed", failure_class: "transient", message: `reconcile threw: ${describe(e)}` }
          : failureReport(e);
    } finally {
      stopHeartbeats();
      lease.close();
    }
    if (abandoned()) return;
    if (ctx.leaseLost && body.outcome === "cancelled" && !ctx.cancelRequested) {
      // Stopped on the lost lease, with no outcome of its own: nothing to report.
      this.#log.info(`attempt ${ctx.attemptId} (task ${ctx.taskId}) stopped after its lease was lost`);
      return;
    }
    const report: ReportBody = { generation: ctx.generation, usage: ctx.usage, ...trimmed(body) };
    await this.#report(ctx, report);
  }

  /** Heartbeats every interval until the returned function is called. */
  #heartbeats(ctx: Ctx, lease: Lease, abandoned: () => boolean): () => void {
    let stopped = false;
    let timer: NodeJS.Timeout | undefined;
    const interval = () => this.#heartbeatMs ?? Math.floor(lease.leaseMs / 3);
    const tick = async () => {
      if (stopped || abandoned() || ctx.leaseLost) return;
      await this.#heartbeat(ctx, lease, Math.min(lease.leaseMs / 3, lease.left()));
      if (!stopped && !ctx.leaseLost) timer = setTimeout(tick, interval());
    };
    timer = setTimeout(tick, interval());
    return () => {
      stopped = true;
      clearTimeout(timer);
    };
  }

  /**
   * One heartbeat, given up after `timeoutMs`: an answer moves `lease` on and passes on a
   * cancel request; a 401/403/404/409 loses the lease; any other failure leaves it as it was.
   */
  async #heartbeat(ctx: Ctx, lease: Lease, timeoutMs: number): Promise<void> {
    const sent = performance.now();
    try {
      const hb = await this.#client.heartbeat(ctx.attemptId, ctx.generation, ctx.usage, {
        timeoutMs: Math.max(10, Math.floor(timeoutMs)),
      });
      if (ctx.leaseLost) return;
      lease.confirm(sent, hb.lease_ms);
      ctx.leaseExpiresAt = hb.lease_expires_at;
      if (hb.cancel_requested && !ctx.cancelRequested) {
        ctx.cancelRequested = true;
        ctx.controller.abort(new Error("cancellation requested"));
      }
    } catch (e) {
      if (e instanceof IdemError && LEASE_GONE.has(e.status)) return this.#leaseLost(ctx, describe(e));
      this.#log.warn(`heartbeat of attempt ${ctx.attemptId} failed: ${describe(e)}`);
    }
  }

  #leaseLost(ctx: Ctx, why: string): void {
    if (ctx.leaseLost) return;
    ctx.leaseLost = true;
    this.#log.warn(`attempt ${ctx.attemptId} (task ${ctx.taskId}) lost its lease: ${why}`);
    ctx.controller.abort(new Error("lease lost"));
  }

  async #report(ctx: Ctx, report: ReportBody): Promise<void> {
    const what = `attempt ${ctx.attemptId} (task ${ctx.taskId}) ${report.outcome}`;
    let pause = this.#client.retry.initialBackoffMs;
    for (let tries = 1; ;) {
      try {
        await this.#client.report(ctx.attemptId, report);
        if (ctx.leaseLost) this.#log.warn(`${what}: reported after the lease was lost, yet accepted`);
        return;
      } catch (e) {
        if (e instanceof StaleGenerationError) {
          ctx.leaseLost = true;
          this.#log.info(`${what}: late result kept as evidence only (${describe(e)})`);
          return;
        }
        const smaller = e instanceof IdemError && e.status === 413 ? smallerReport(report, ctx.kind) : undefined;
        if (smaller) {
          this.#log.warn(`${what}: report refused for its size; sending it again with its text cut`);
          report = smaller;
          continue;
        }
        // An exact repeat of a report is answered like the first: retrying is safe. After a lost
        // lease the report is sent once, never repeated.
        const retryable = e instanceof IdemTransportError || (e instanceof IdemError && e.retryable);
        if (!retryable || ctx.leaseLost || tries >= this.#client.retry.maxTries) {
          this.#log.error(`${what}: report failed, the lease will run out: ${describe(e)}`);
          return;
        }
        tries++;
        await sleep((e instanceof IdemError ? e.retryAfterMs : undefined) ?? pause);
        pause = Math.min(pause * 2, this.#client.retry.maxBackoffMs);
      }
    }
  }
}

/** `text` cut to at most `limit` UTF-16 units, never inside a surrogate pair. */
function cut(text: string, limit: number): string {
  if (text.length <= limit) return text;
  const end = /[\uD800-\uDBFF]/.test(text.charAt(limit - 1)) ? limit - 1 : limit;
  return text.slice(0, end);
}

/** `body` with its message cut to {@link MESSAGE_LIMIT}. */
function trimmed<T extends { message?: string | null }>(body: T): T {
  return typeof body.message === "string" ? { ...body, message: cut(body.message, MESSAGE_LIMIT) } : body;
}

/**
 * `report` made smaller after a 413: its message halved, then dropped; then a result too large
 * to send reported as an exception would be (the effect may have happened); undefined when
 * nothing is left to cut.
 */
function smallerReport(report: ReportBody, kind: AttemptKind): ReportBody | undefined {
  if (typeof report.message === "string" && report.message.length > 0)
    return { ...report, message: cut(report.message, Math.floor(report.message.length / 2)) };
  if ("message" in report) {
    const { message: _, ...rest } = report;
    return rest;
  }
  if (report.result !== undefined || report.external_txn_id !== undefined) {
    const message = "the result is too large to report";
    const base = { generation: report.generation, usage: report.usage };
    return kind === "reconcile"
      ? { ...base, outcome: "failed", failure_class: "transient", message }
      : { ...base, outcome: "unknown", message };
  }
  return undefined;
}

function executeReport(r: ExecuteResult): Omit<ReportBody, "generation"> {
  if (r instanceof Cancelled) return { outcome: "cancelled" };
  if (r instanceof Committed || r instanceof NotCommitted) throw new TypeError("execute returned a reconcile outcome");
  if (r instanceof Succeeded) {
    const body: Omit<ReportBody, "generation"> = { outcome: "succeeded" };
    if (r.result !== undefined) body.result = r.result;
    if (r.options.externalTxnId !== undefined) body.external_txn_id = r.options.externalTxnId;
    if (r.options.usage !== undefined) body.usage = r.options.usage;
    return body;
  }
  return r === undefined ? { outcome: "succeeded" } : { outcome: "succeeded", result: r };
}

function reconcileReport(r: ReconcileResult): Omit<ReportBody, "generation"> {
  if (r instanceof Committed) {
    const body: Omit<ReportBody, "generation"> = { outcome: "committed" };
    if (r.result !== undefined) body.result = r.result;
    if (r.options.externalTxnId !== undefined) body.external_txn_id = r.options.externalTxnId;
    return body;
  }
  if (r instanceof NotCommitted) return { outcome: "not_committed" };
  throw new TypeError("reconcile must return a Committed or a NotCommitted");
}

/** An exception of `execute` as a report: typed ones by class, any other `unknown` (reconciled before anything repeats). */
function failureReport(e: unknown): Omit<ReportBody, "generation"> {
  const message = describe(e);
  if (e instanceof TransientError) return { outcome: "failed", failure_class: "transient", message };
  if (e instanceof InvalidInputError) return { outcome: "failed", failure_class: "invalid_input", message };
  if (e instanceof PermissionDeniedError) return { outcome: "failed", failure_class: "permission_denied", message };
  return { outcome: "unknown", message };
}

function describe(e: unknown): string {
  return e instanceof Error ? `${e.name}: ${e.message}` : String(e);
}
