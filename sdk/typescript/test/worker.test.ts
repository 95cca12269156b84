import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { after, afterEach, before, describe, test } from "node:test";
import { setTimeout as delay } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import {
  Cancelled,
  Committed,
  NotCommitted,
  PermissionDeniedError,
  Succeeded,
  TransientError,
  Worker,
  type AttemptContext,
  type Client,
  type Handler,
  type WorkerOptions,
} from "../src/index.js";
import { DISPATCH_BACKOFF_MS, MemoryLogger, Server, aborted, all, key, ms, signal, type Tenant } from "./support.js";

const LEASE_MS = 1000;
const HEARTBEAT_MS = Math.floor(LEASE_MS / 3);
const payment = { payee: "acct-42", amount: 1250, currency: "EUR" };

const never = (): never => {
  throw new Error("not expected");
};

/** Workers of the running test, stopped after it even when it failed. */
const workers: Worker[] = [];

function worker(t: Tenant, handlers: Record<string, Handler>, options: Partial<WorkerOptions> = {}) {
  const logger = new MemoryLogger();
  const w = new Worker(t.executor, {
    executorId: "ts-test",
    handlers,
    leaseMs: LEASE_MS,
    graceMs: 2000,
    logger,
    handleSignals: false,
    ...options,
  });
  workers.push(w);
  return { worker: w, logger, run: w.run() };
}

/** The task once terminal (`Prefer: wait` where the server honours it, else read again). */
async function terminal(client: Client, id: string) {
  const deadline = Date.now() + 15_000;
  for (;;) {
    const t = await client.get(id, { wait: 5 });
    if (["succeeded", "failed", "cancelled"].includes(t.state)) return t;
    if (Date.now() > deadline) throw new Error(`task ${id} did not end within 15 s: ${JSON.stringify(t)}`);
    await delay(50);
  }
}

describe("Worker against idem serve", () => {
  let server: Server;
  before(async () => {
    server = await Server.start();
  });
  afterEach(async () => {
    await Promise.all(workers.splice(0).map((w) => w.stop()));
  });
  after(async () => {
    await server?.stop();
  });

  test("a heartbeating handler keeps its lease past 3x leaseMs", async () => {
    const t = await server.tenant();
    let seen: AttemptContext | undefined;
    const w = worker(t, {
      "generation.dispatch": {
        async execute(ctx) {
          seen = ctx;
          await ctx.ack(); // a device gateway's "command acknowledged", before completion
          ctx.recordUsage(11);
          await delay(3.5 * LEASE_MS);
          return { frames: 24 };
        },
        reconcile: never,
      },
    });
    const { task } = await t.client.submit("generation.dispatch", { prompt: "long" }, key());
    const done = await terminal(t.client, task.id);
    await w.worker.stop();
    assert.equal(done.state, "succeeded", JSON.stringify(done));
    assert.deepEqual(done.delivery?.result, { frames: 24 });
    assert.equal(done.attempt_count, 1);
    assert.equal(done.usage, 11);
    const [attempt, ...more] = await t.client.attempts(task.id);
    assert.equal(more.length, 0);
    assert.equal(attempt!.state, "succeeded");
    assert.deepEqual(
      attempt!.evidence!.map((e) => e.outcome),
      ["ack", "succeeded"],
    );
    const held = ms(attempt!.evidence![1]!.received_at) - ms(attempt!.leased_at);
    assert.ok(held > 3 * LEASE_MS, `held the lease ${held} ms`);
    assert.equal(seen?.signal.aborted, false);
    assert.equal(seen?.leaseLost, false);
    const events = await all(t.client.events(task.id));
    assert.ok(!events.some((e) => e.type === "lease_expired"));
    assert.ok(
      events.some((e) => e.type === "usage_recorded"),
      "the heartbeat carried the usage",
    );
  });

  test("a cancel request reaches the running handler within one heartbeat interval; the task ends cancelled with its usage", async () => {
    const t = await server.tenant();
    const started = signal<AttemptContext>();
    let noticedAt = 0;
    const w = worker(t, {
      "payment.release": {
        async execute(ctx) {
          ctx.recordUsage(7);
          started.resolve(ctx);
          await aborted(ctx.signal);
          noticedAt = Date.now();
          assert.equal(ctx.cancelRequested, true);
          assert.equal(ctx.leaseLost, false);
          return new Cancelled();
        },
        reconcile: never,
      },
    });
    const { task } = await t.client.submit("payment.release", payment, key());
    await started.promise;
    const requestedAt = Date.now();
    const c = await t.client.cancel(task.id);
    assert.equal(c.status, 202, "pending: the handler is running");
    const done = await terminal(t.client, task.id);
    await w.worker.stop();
    const delay = noticedAt - requestedAt;
    assert.ok(
      delay > 0 && delay <= HEARTBEAT_MS + 250,
      `the handler heard of it after ${delay} ms (interval ${HEARTBEAT_MS} ms)`,
    );
    assert.equal(done.state, "cancelled");
    assert.equal(done.cancellation?.status, "confirmed");
    assert.equal(done.usage, 7);
    assert.equal(done.cancellation?.fee, 10 + 7, "fee: fixed 10 + usage x 1 (frozen contract)");
    const [attempt] = await t.client.attempts(task.id);
    assert.equal(attempt!.state, "cancelled");
    assert.equal(attempt!.usage, 7);
  });

  test("an exception in execute on payment.release leads to reconcile, never to a second execute before it", async () => {
    const t = await server.tenant();
    const calls: string[] = [];
    const w = worker(t, {
      "payment.release": {
        async execute(ctx) {
          calls.push(`${ctx.kind}#${ctx.number}`);
          if (ctx.number === 1) throw new Error("connection reset while the provider was paying out");
          return new Succeeded({ payout: "po-2" }, { externalTxnId: "tx-2" });
        },
        async reconcile(ctx) {
          calls.push(`${ctx.kind}#${ctx.number}`);
          // The provider has no payout under ctx.taskId: safe to execute again.
          return new NotCommitted();
        },
      },
    });
    const { task } = await t.client.submit("payment.release", payment, key());
    const done = await terminal(t.client, task.id);
    await w.worker.stop();
    assert.deepEqual(calls, ["execute#1", "reconcile#2", "execute#3"]);
    assert.equal(done.state, "succeeded");
    assert.deepEqual(done.delivery?.result, { payout: "po-2" });
    assert.equal(done.delivery?.external_txn_id, "tx-2");
    const attempts = await t.client.attempts(task.id);
    assert.deepEqual(
      attempts.map((a) => `${a.kind}:${a.state}`),
      ["execute:unknown", "reconcile:not_committed", "execute:succeeded"],
    );
    assert.match(String((attempts[0]!.evidence![0]!.body as { message?: string }).message), /connection reset/);
  });

  test("reconcile that finds the payout delivers it; an exception in reconcile leads to another reconcile", async () => {
    const t = await server.tenant();
    const calls: string[] = [];
    const w = worker(t, {
      "payment.release": {
        async execute(ctx) {
          calls.push(ctx.kind);
          throw new Error("crashed after the provider committed");
        },
        async reconcile(ctx) {
          calls.push(ctx.kind);
          if (calls.length === 2) throw new Error("provider lookup timed out");
          return new Committed({ payout: "po-1" }, { externalTxnId: "tx-1" });
        },
      },
    });
    const { task } = await t.client.submit("payment.release", payment, key());
    const done = await terminal(t.client, task.id);
    await w.worker.stop();
    assert.deepEqual(calls, ["execute", "reconcile", "reconcile"]);
    assert.equal(done.state, "succeeded");
    assert.deepEqual(done.delivery?.result, { payout: "po-1" });
    const attempts = await t.client.attempts(task.id);
    assert.deepEqual(
      attempts.map((a) => `${a.kind}:${a.state}`),
      ["execute:unknown", "reconcile:failed", "reconcile:committed"],
    );
  });

  test("a lost lease tells the handler, and its late result lands as evidence only", async () => {
    const t = await server.tenant();
    const told: { leaseLost: boolean; cancelRequested: boolean; reason: string }[] = [];
    // Heartbeats every 2.5 s on a 1 s lease: the local lease deadline passes first and aborts
    // the signal; the handler returns only after the server's lease end, when the server has
    // expired the lease (its sweeper, every 50 ms) and given the task a new generation, so the
    // report answers 409 STALE_GENERATION. The lease runs out for real; only the heartbeat
    // timing is chosen.
    const w = worker(
      t,
      {
        "generation.dispatch": {
          async execute(ctx) {
            if (ctx.number > 1) return { fresh: ctx.number };
            await aborted(ctx.signal);
            told.push({
              leaseLost: ctx.leaseLost,
              cancelRequested: ctx.cancelRequested,
              reason: String(ctx.signal.reason),
            });
            await delay(ms(ctx.leaseExpiresAt) - Date.now() + 300);
            return { late: true };
          },
          reconcile: never,
        },
      },
      { heartbeatIntervalMs: 2.5 * LEASE_MS },
    );
    const { task } = await t.client.submit("generation.dispatch", { prompt: "slow" }, key());
    const done = await terminal(t.client, task.id);
    await w.worker.stop();
    assert.deepEqual(told, [{ leaseLost: true, cancelRequested: false, reason: "Error: lease lost" }]);
    assert.equal(done.state, "succeeded");
    assert.deepEqual(done.delivery?.result, { fresh: 2 }, "the late result changed nothing");
    const [first, second, ...more] = await t.client.attempts(task.id);
    assert.equal(more.length, 0);
    assert.equal(first!.state, "expired");
    assert.equal(second!.state, "succeeded");
    assert.equal(first!.evidence!.length, 1, "reported once, not retried");
    const late = first!.evidence![0]!;
    assert.equal(late.outcome, "succeeded");
    assert.equal(late.disposition, "stale_generation");
    assert.deepEqual((late.body as { result?: unknown }).result, { late: true });
    assert.ok(
      w.logger.lines.some((l) => /late result kept as evidence only/.test(l)),
      w.logger.lines.join("\n"),
    );
  });

  test("transient on generation.dispatch is retried after backoff", async () => {
    const t = await server.tenant();
    const w = worker(t, {
      "generation.dispatch": {
        async execute(ctx) {
          if (ctx.number === 1) throw new TransientError("GPU pool busy");
          return { image: "done" };
        },
        reconcile: never,
      },
    });
    const { task } = await t.client.submit("generation.dispatch", { prompt: "retry me" }, key());
    const done = await terminal(t.client, task.id);
    await w.worker.stop();
    assert.equal(done.state, "succeeded");
    assert.equal(done.attempt_count, 2);
    const [first, second] = await t.client.attempts(task.id);
    assert.equal(first!.state, "failed");
    assert.equal((first!.evidence![0]!.body as { failure_class?: string }).failure_class, "transient");
    const gap = ms(second!.leased_at) - ms(first!.evidence![0]!.received_at);
    assert.ok(
      gap >= DISPATCH_BACKOFF_MS,
      `the retry came ${gap} ms after the failure (backoff ${DISPATCH_BACKOFF_MS} ms)`,
    );
    const events = await all(t.client.events(task.id));
    assert.ok(events.some((e) => e.type === "retry_scheduled"));
  });

  test("shutdown claims nothing more, releases what its open claim still brings, lets the running attempt finish", async () => {
    const t = await server.tenant();
    const started = signal();
    const w = worker(
      t,
      {
        "generation.dispatch": {
          async execute() {
            started.resolve();
            await delay(1000);
            return { ok: true };
          },
          reconcile: never,
        },
      },
      { concurrency: 2, graceMs: 3000 },
    );
    const a = await t.client.submit("generation.dispatch", { n: "a" }, key());
    await started.promise;
    const stopAt = Date.now();
    const stopped = w.worker.stop();
    // A free slot and a due task while the worker drains: the claim open since before the stop
    // leases it; the worker gives it back unstarted.
    const b = await t.client.submit("generation.dispatch", { n: "b" }, key());
    const summary = await stopped;
    const took = Date.now() - stopAt;
    assert.deepEqual(summary, { abandoned: 0, released: 1 });
    assert.ok(took < 3000, `stopped after ${took} ms`);
    assert.equal((await t.client.get(a.task.id)).state, "succeeded", "the running attempt finished and reported");
    const tb = await t.client.get(b.task.id);
    assert.equal(tb.state, "queued", "released: due again at once");
    assert.deepEqual(
      (await t.client.attempts(b.task.id)).map((x) => [x.state, x.evidence]),
      [["released", []]],
      "never run, never reported",
    );
    await w.run;
  });

  test("an attempt still running after the grace is abandoned: not reported, its signal aborted", async () => {
    const t = await server.tenant();
    const started = signal<AttemptContext>();
    const w = worker(
      t,
      {
        "payment.release": {
          async execute(ctx) {
            started.resolve(ctx);
            await aborted(ctx.signal);
            return { too: "late" };
          },
          reconcile: never,
        },
      },
      { graceMs: 500 },
    );
    const { task } = await t.client.submit("payment.release", payment, key());
    const ctx = await started.promise;
    const stopAt = Date.now();
    const summary = await w.worker.stop();
    const took = Date.now() - stopAt;
    assert.deepEqual(summary, { abandoned: 1, released: 0 });
    assert.ok(took >= 500 && took < 500 + 400, `stopped after ${took} ms`);
    assert.equal(String(ctx.signal.reason), "Error: the worker shut down: attempt abandoned");
    const [attempt] = await t.client.attempts(task.id);
    assert.equal(attempt!.state, "leased");
    assert.deepEqual(attempt!.evidence, []);
  });

  test("a claim refused with a 4xx stops the worker: run() rejects with the typed error", async () => {
    const t = await server.tenant();
    // A client key may not claim.
    const w = new Worker(t.client, {
      executorId: "wrong-key",
      handlers: { "generation.dispatch": { execute: () => undefined, reconcile: never } },
      logger: new MemoryLogger(),
      handleSignals: false,
    });
    await assert.rejects(w.run(), PermissionDeniedError);
  });

  test("SIGTERM stops a worker process: the running attempt finishes, the process exits within its grace", async () => {
    const t = await server.tenant();
    const child = spawn(process.execPath, [fileURLToPath(new URL("./fixtures/sigterm-worker.js", import.meta.url))], {
      env: { ...process.env, IDEM_URL: server.url, IDEM_KEY: t.executorKey, GRACE_MS: "3000", WORK_MS: "800" },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    const lines = signal();
    child.stdout.on("data", (d: Buffer) => {
      out += d.toString();
      if (out.includes("started ")) lines.resolve();
    });
    let err = "";
    child.stderr.on("data", (d: Buffer) => (err += d.toString()));
    const exited = new Promise<number | null>((r) => child.on("exit", (code) => r(code)));
    const { task } = await t.client.submit("generation.dispatch", { n: "sigterm" }, key());
    await lines.promise;
    const termAt = Date.now();
    child.kill("SIGTERM");
    const code = await exited;
    const took = Date.now() - termAt;
    assert.equal(code, 0, `stdout: ${out}\nstderr: ${err}`);
    assert.ok(took < 3000, `exited ${took} ms after SIGTERM`);
    assert.match(out, /started .*\nran: \{"abandoned":0,"released":0\}/);
    assert.equal((await t.client.get(task.id)).state, "succeeded");
  });
});
