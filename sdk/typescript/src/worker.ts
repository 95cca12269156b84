/**
 * The executor runtime (issue 24): claims attempts for its handlers, heartbeats them,
 * tells handlers about cancellation and lease loss, maps their outcomes to reports, and
 * shuts down gracefully.
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
  /** Aborted when a cancellation is requested, the lease is lost, or the worker abandons the attempt at shutdown. */
  readonly signal: AbortSignal;
  /** A cancellation was requested: stop and return `new Cancelled()`. */
  readonly cancelRequested: boolean;
  /** The lease is gone (409 `STALE_GENERATION`): stop; a result still returned is kept as evidence only. */
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
  /** Lease asked for on claim, ms. Default 30 000. */
  leaseMs?: number;
  /** After `stop()` (or SIGTERM/SIGINT), how long running attempts may take, ms. Default 30 000. */
  graceMs?: number;
  /** Long-poll wait of a claim, ms (≤ 30 000). Default 20 000. */
  claimWaitMs?: number;
  /**
   * Pause between heartbeats, ms. Default `leaseMs / 3`. One of `leaseMs` or more lets the
   * lease run out between heartbeats (the SDK's tests lose a lease on purpose that way).
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
  readonly #heartbeatMs: number;
  readonly #log: Logger;
  readonly #handleSignals: boolean;
  readonly #running = new Map<string, { ctx: Ctx; done: Promise<void>; abandoned: boolean }>();
  #stopping: AbortController | undefined;
  #skipGrace: AbortController | undefined;
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
    this.#heartbeatMs = options.heartbeatIntervalMs ?? Math.floor(this.#leaseMs / 3);
    this.#log = options.logger ?? console;
    this.#handleSignals = options.handleSignals ?? true;
    if (Object.keys(this.#handlers).length === 0) throw new TypeError("a worker needs at least one handler");
  }

  /** Attempts running now. */
  get running(): number {
    return this.#running.size;
  }

  /**
   * Claims and runs attempts until `stop()` (or SIGTERM/SIGINT); then claims nothing more,
   * lets running attempts finish within the grace, and resolves. A claim refused with a 4xx
   * (bad key, grant, lease) stops the worker the same way and rejects with that error.
   */
  run(): Promise<RunSummary> {
    if (this.#run) throw new Error("the worker is already running");
    this.#stopping = new AbortController();
    this.#skipGrace = new AbortController();
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

  /** Claims until stopped; returns the error that stopped it, if any. */
  async #claimLoop(stopping: AbortSignal): Promise<unknown> {
    const operations = Object.keys(this.#handlers);
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
      let attempts: ClaimedAttempt[];
      try {
        attempts = await this.#client.claim({
          executorId: this.#executorId,
          operations,
          max: free,
          leaseMs: this.#leaseMs,
          waitMs: this.#claimWaitMs,
          signal: stopping,
        });
        pause = 250;
      } catch (e) {
        if (stopping.aborted) break;
        if (!(e instanceof IdemTransportError || (e instanceof IdemError && e.retryable))) {
          this.#log.error(`claim refused, stopping: ${describe(e)}`);
          this.#stopping?.abort(e);
          return e;
        }
        this.#log.warn(`claim failed, retrying in ${pause} ms: ${describe(e)}`);
        await sleep(pause, stopping).catch(() => {});
        pause = Math.min(pause * 2, 5_000);
        continue;
      }
      // Attempts that arrived are ours (leased): run them even when stopping began meanwhile.
      for (const a of attempts) this.#start(a);
    }
    return undefined;
  }

  async #drain(): Promise<RunSummary> {
    const finished = new AbortController();
    const graceOver = sleep(this.#graceMs, AbortSignal.any([this.#skipGrace!.signal, finished.signal])).catch(() => {});
    await Promise.race([Promise.all([...this.#running.values()].map((r) => r.done)), graceOver]);
    finished.abort();
    let abandoned = 0;
    for (const r of this.#running.values()) {
      r.abandoned = true;
      abandoned++;
      r.ctx.controller.abort(new Error("the worker shut down: attempt abandoned"));
      this.#log.warn(
        `attempt ${r.ctx.attemptId} (task ${r.ctx.taskId}) still running after the grace: abandoned, its lease runs out`,
      );
    }
    this.#running.clear();
    return { abandoned };
  }

  #start(a: ClaimedAttempt): void {
    const ctx = new Ctx(a, this.#client);
    const entry = { ctx, done: Promise.resolve(), abandoned: false };
    entry.done = this.#attempt(ctx, () => entry.abandoned)
      .catch((e: unknown) => this.#log.error(`attempt ${ctx.attemptId} (task ${ctx.taskId}): ${describe(e)}`))
      .finally(() => {
        if (this.#running.get(ctx.attemptId) === entry) this.#running.delete(ctx.attemptId);
        this.#slotFreed?.();
        this.#slotFreed = undefined;
      });
    this.#running.set(ctx.attemptId, entry);
  }

  async #attempt(ctx: Ctx, abandoned: () => boolean): Promise<void> {
    const handler = this.#handlers[ctx.operation];
    const stopHeartbeats = this.#heartbeats(ctx, abandoned);
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
    }
    if (abandoned()) return;
    const report: ReportBody = { generation: ctx.generation, usage: ctx.usage, ...body };
    await this.#report(ctx, report);
  }

  /** Heartbeats every interval until the returned function is called; sets ctx's flags. */
  #heartbeats(ctx: Ctx, abandoned: () => boolean): () => void {
    let stopped = false;
    let timer: NodeJS.Timeout | undefined;
    // Lease end by this process's clock: a heartbeat that does not get through for a whole
    // lease means the lease is gone even if no 409 says so.
    let leaseEnd = Date.now() + this.#leaseMs;
    const tick = async () => {
      if (stopped || abandoned()) return;
      const sent = Date.now();
      try {
        const hb = await this.#client.heartbeat(ctx.attemptId, ctx.generation, ctx.usage, { timeoutMs: this.#leaseMs });
        leaseEnd = sent + this.#leaseMs;
        ctx.leaseExpiresAt = hb.lease_expires_at;
        if (hb.cancel_requested && !ctx.cancelRequested) {
          ctx.cancelRequested = true;
          ctx.controller.abort(new Error("cancellation requested"));
        }
      } catch (e) {
        if (stopped) return;
        if (e instanceof StaleGenerationError) return this.#leaseLost(ctx, describe(e));
        if (Date.now() >= leaseEnd)
          return this.#leaseLost(ctx, `no heartbeat got through within the lease: ${describe(e)}`);
        this.#log.warn(`heartbeat of attempt ${ctx.attemptId} failed: ${describe(e)}`);
      }
      if (!stopped) timer = setTimeout(tick, this.#heartbeatMs);
    };
    timer = setTimeout(tick, this.#heartbeatMs);
    return () => {
      stopped = true;
      clearTimeout(timer);
    };
  }

  #leaseLost(ctx: Ctx, why: string): void {
    ctx.leaseLost = true;
    this.#log.warn(`attempt ${ctx.attemptId} (task ${ctx.taskId}) lost its lease: ${why}`);
    ctx.controller.abort(new Error("lease lost"));
  }

  async #report(ctx: Ctx, report: ReportBody): Promise<void> {
    const what = `attempt ${ctx.attemptId} (task ${ctx.taskId}) ${report.outcome}`;
    if (ctx.leaseLost) {
      // Once, never retried: the server keeps it as evidence and changes nothing.
      try {
        await this.#client.report(ctx.attemptId, report);
        this.#log.warn(`${what}: reported after the lease was lost, yet accepted`);
      } catch (e) {
        if (e instanceof StaleGenerationError)
          this.#log.info(`${what}: late result kept as evidence only (${describe(e)})`);
        else this.#log.warn(`${what}: late report failed, not retried: ${describe(e)}`);
      }
      return;
    }
    let pause = this.#client.retry.initialBackoffMs;
    for (let tries = 1; ; tries++) {
      try {
        await this.#client.report(ctx.attemptId, report);
        return;
      } catch (e) {
        if (e instanceof StaleGenerationError) {
          ctx.leaseLost = true;
          this.#log.warn(`${what}: the lease was lost before the report; kept as evidence only (${describe(e)})`);
          return;
        }
        // An exact repeat of a report is answered like the first: retrying is safe.
        const retryable = e instanceof IdemTransportError || (e instanceof IdemError && e.retryable);
        if (!retryable || tries >= this.#client.retry.maxTries) {
          this.#log.error(`${what}: report failed, the lease will run out: ${describe(e)}`);
          return;
        }
        await sleep((e instanceof IdemError ? e.retryAfterMs : undefined) ?? pause);
        pause = Math.min(pause * 2, this.#client.retry.maxBackoffMs);
      }
    }
  }
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
