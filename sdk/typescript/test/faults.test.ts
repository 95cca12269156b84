/**
 * The worker's lease, report and shutdown rules under injected faults, on SQLite and on
 * PostgreSQL, with the worker talking to `idem serve` through the fault-injecting proxy
 * ({@link FaultProxy}), judged by the attempts the store shows:
 *
 * - heartbeats failing (503, connection reset, never answered): `ctx.signal` aborts before the
 *   server's lease end, and the next attempt is leased after the signal;
 * - a revoked key (401) or a stale generation (409) on a heartbeat aborts it at once;
 * - a 1 MiB exception message is reported trimmed; a result too large to report is reported all
 *   the same (as `unknown`), never dropped;
 * - a worker process stopped by SIGTERM while its long-poll is open releases the task that poll
 *   still brings: another executor runs it at once;
 * - claims answered 503 `OVERLOADED` with `Retry-After`: the next claim waits at least that long.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { after, before, describe, test } from "node:test";
import { setTimeout as delay } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import {
  Cancelled,
  Client,
  Committed,
  InvalidInputError,
  MESSAGE_LIMIT,
  NotCommitted,
  UnknownOutcomeError,
  Worker,
  type AttemptContext,
  type Handler,
  type Task,
  type WorkerOptions,
} from "../src/index.js";
import { FaultProxy, MemoryLogger, Server, aborted, key, ms, signal, type Tenant } from "./support.js";

/** Rounds of each heartbeat fault per store, run at once (each its own task and attempt). */
const ROUNDS = 20;
const LEASE_MS = 2000;
/** A long lease (heartbeat every 2 s, local deadline 5.4 s after each): only an answer can abort. */
const LONG_LEASE_MS = 6000;
const SHUTDOWN_ROUNDS = 50;
const payment = (n = 0) => ({ payee: "acct-42", amount: 1250 + n, currency: "EUR" });

function worker(client: Client, options: Partial<WorkerOptions> & Pick<WorkerOptions, "handlers">) {
  const logger = new MemoryLogger();
  const w = new Worker(client, { executorId: "ts-faults", logger, handleSignals: false, ...options });
  return { worker: w, logger, run: w.run() };
}

async function terminal(client: Client, id: string): Promise<Task> {
  const deadline = Date.now() + 20_000;
  for (;;) {
    const t = await client.get(id, { wait: 5 });
    if (["succeeded", "failed", "cancelled"].includes(t.state)) return t;
    if (Date.now() > deadline) throw new Error(`task ${id} did not end within 20 s: ${JSON.stringify(t)}`);
  }
}

/** Polls `condition` every 20 ms until it holds (fails after 20 s). */
async function until(condition: () => Promise<boolean> | boolean): Promise<void> {
  const deadline = Date.now() + 20_000;
  while (!(await condition())) {
    if (Date.now() > deadline) throw new Error("condition not reached within 20 s");
    await delay(20);
  }
}

for (const kind of ["sqlite", "postgres"] as const) {
  describe(`the worker under injected faults (${kind})`, () => {
    let server: Server;
    let proxy: FaultProxy;
    before(async () => {
      server = await Server.start(kind);
      proxy = await FaultProxy.start(server.url);
    });
    after(async () => {
      await proxy?.stop();
      await server?.stop();
    });

    for (const mode of ["503", "reset", "hang"]) {
      test(`heartbeats failing by ${mode}: the signal aborts before the server's lease end, the next attempt starts after it`, async () => {
        const t = await server.tenant();
        await proxy.set({});
        const signalled = new Map<string, number>();
        const started = new Set<string>();
        const allStarted = signal();
        const a = worker(new Client(proxy.url, t.executorKey), {
          executorId: "executor-a",
          concurrency: ROUNDS,
          leaseMs: LEASE_MS,
          claimWaitMs: 1000,
          handlers: {
            // A task's first attempt runs until its signal; later ones (a lease lost before the
            // faults began, on a slow store) end at once, as executor B's do.
            "payment.release": {
              async execute(ctx) {
                if (ctx.number > 1) return { by: "a" };
                started.add(ctx.taskId);
                if (started.size === ROUNDS) allStarted.resolve();
                await aborted(ctx.signal);
                signalled.set(ctx.taskId, Date.now());
                return new Cancelled();
              },
              reconcile: () => new NotCommitted(),
            },
          },
        });
        const ids: string[] = [];
        for (let n = 0; n < ROUNDS; n++)
          ids.push((await t.client.submit("payment.release", payment(n), key())).task.id);
        await allStarted.promise;
        // Every lease confirmed by a heartbeat in the handler's time, then heartbeats fail (and
        // executor A claims nothing more).
        const beats = await proxy.forwarded("heartbeat");
        // (A lease lost early, on a busy machine, ends the wait: that round is judged all the same.)
        await until(async () => (await proxy.forwarded("heartbeat")) >= beats + ROUNDS || signalled.size > 0);
        await proxy.set({ heartbeat: mode, claim: "503" });
        const b = worker(t.executor, {
          executorId: "executor-b",
          concurrency: ROUNDS,
          handlers: {
            "payment.release": { execute: () => ({ by: "b" }), reconcile: () => new NotCommitted() },
          },
        });
        for (const id of ids) assert.equal((await terminal(t.client, id)).state, "succeeded");
        await b.worker.stop();
        await a.worker.stop();
        await proxy.set({});
        const leaseGaps: number[] = [];
        const nextGaps: number[] = [];
        for (const id of ids) {
          const [first, following] = await t.client.attempts(id);
          assert.equal(first!.executor_id, "executor-a");
          assert.equal(first!.state, "expired");
          const at = signalled.get(id);
          assert.ok(at !== undefined, "the handler was never signalled");
          assert.ok(at < ms(first!.lease_expires_at), `signalled at ${at}, lease ended ${first!.lease_expires_at}`);
          assert.ok(ms(following!.leased_at) > at, `next attempt leased at ${following!.leased_at}, signal at ${at}`);
          leaseGaps.push(ms(first!.lease_expires_at) - at);
          nextGaps.push(ms(following!.leased_at) - at);
        }
        console.log(
          `[typescript ${kind} heartbeat ${mode}] ${ROUNDS} rounds: min(lease end - signal) ` +
            `${Math.min(...leaseGaps)} ms, min(next attempt leased - signal) ${Math.min(...nextGaps)} ms`,
        );
      });
    }

    /** Until the handler's signal after `lose()`: the heartbeats the proxy forwarded meanwhile. */
    async function heartbeatsUntilSignalled(started: Promise<AttemptContext>, lose: () => Promise<void>) {
      const ctx = await started;
      const beats = await proxy.forwarded("heartbeat");
      await until(async () => (await proxy.forwarded("heartbeat")) > beats);
      const before = await proxy.forwarded("heartbeat");
      await lose();
      await aborted(ctx.signal);
      return { ctx, beats: (await proxy.forwarded("heartbeat")) - before };
    }

    const untilSignalled = (started: { resolve: (c: AttemptContext) => void }) => async (ctx: AttemptContext) => {
      started.resolve(ctx);
      await aborted(ctx.signal);
      return new Cancelled();
    };

    test("a revoked key aborts the signal at the next heartbeat", async () => {
      const name = `t-revoke-${Date.now()}`;
      const executor = await server.key(name, "executor");
      const client = new Client(server.url, (await server.key(name, "client")).key);
      await proxy.set({});
      const started = signal<AttemptContext>();
      const w = worker(new Client(proxy.url, executor.key), {
        leaseMs: LONG_LEASE_MS,
        handlers: { "generation.dispatch": { execute: untilSignalled(started), reconcile: () => new NotCommitted() } },
      });
      w.run.catch(() => {}); // its next claim is refused (401) too
      await client.submit("generation.dispatch", { n: 1 }, key());
      const { ctx, beats } = await heartbeatsUntilSignalled(started.promise, () => server.revoke(executor.id));
      await w.worker.stop();
      assert.ok(ctx.leaseLost);
      assert.ok(beats <= 2, `${beats} heartbeats after the revocation before the signal (one in flight, one 401)`);
      assert.ok(
        w.logger.lines.some((l) => /lost its lease: .*401/i.test(l) || /lost its lease: Unauthenticated/.test(l)),
        w.logger.lines.join("\n"),
      );
    });

    test("claims answered 503 OVERLOADED wait at least its Retry-After before the next", async () => {
      const t = await server.tenant();
      await proxy.set({ claim: "503-overloaded" });
      // When the worker logged each failed claim: the next one's answer comes after the pause
      // and a round trip.
      const failed: number[] = [];
      class Timed extends MemoryLogger {
        override warn(m: string) {
          super.warn(m);
          if (m.includes("claim failed") && m.includes("OVERLOADED")) failed.push(performance.now());
        }
      }
      const w = worker(new Client(proxy.url, t.executorKey), {
        logger: new Timed(),
        handlers: {
          "payment.release": {
            execute: () => ({}),
            reconcile: () => new NotCommitted(),
          },
        },
      });
      try {
        await until(() => failed.length >= 3);
      } finally {
        await w.worker.stop();
        await proxy.set({});
      }
      for (const gap of [failed[1]! - failed[0]!, failed[2]! - failed[1]!]) {
        assert.ok(gap >= 2000, `the next claim failed ${gap.toFixed(0)} ms after an OVERLOADED`);
      }
    });

    test("a stale generation (409) aborts the signal at the next heartbeat", async () => {
      const t = await server.tenant();
      const admin = (await server.key(t.name, "admin")).key;
      await proxy.set({});
      const started = signal<AttemptContext>();
      const w = worker(new Client(proxy.url, t.executorKey), {
        leaseMs: LONG_LEASE_MS,
        handlers: {
          "payment.release": {
            execute(ctx) {
              if (ctx.number === 1) throw new UnknownOutcomeError("no answer from the provider");
              return { again: ctx.number };
            },
            reconcile: untilSignalled(started) as Handler["reconcile"],
          },
        },
      });
      const { task } = await t.client.submit("payment.release", payment(), key());
      const { ctx, beats } = await heartbeatsUntilSignalled(started.promise, async () => {
        // An operator's manual reconciliation raises the generation under the live reconcile attempt.
        const r = await fetch(`${server.url}/v1/tasks/${task.id}/resolve`, {
          method: "POST",
          headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
          body: JSON.stringify({ outcome: "not_committed", reason: "checked at the provider" }),
        });
        assert.equal(r.status, 200, await r.text());
      });
      const done = await terminal(t.client, task.id);
      await w.worker.stop();
      assert.equal(ctx.kind, "reconcile");
      assert.ok(ctx.leaseLost);
      assert.ok(beats <= 2, `${beats} heartbeats after the resolve before the signal (one in flight, one 409)`);
      assert.ok(
        w.logger.lines.some((l) => /lost its lease: .*(409|StaleGeneration)/i.test(l)),
        w.logger.lines.join("\n"),
      );
      assert.equal(done.state, "succeeded");
      assert.deepEqual(done.delivery?.result, { again: 3 });
    });

    test("a handler throwing a 1 MiB message ends with its outcome recorded and the message trimmed", async () => {
      const t = await server.tenant();
      await proxy.set({});
      const w = worker(new Client(proxy.url, t.executorKey), {
        leaseMs: LONG_LEASE_MS,
        handlers: {
          "generation.dispatch": {
            execute() {
              throw new InvalidInputError("é".repeat(1 << 20));
            },
            reconcile: () => new NotCommitted(),
          },
        },
      });
      const { task } = await t.client.submit("generation.dispatch", { n: 1 }, key());
      const done = await terminal(t.client, task.id);
      await w.worker.stop();
      assert.equal(done.state, "failed");
      assert.equal(done.failure?.class, "invalid_input");
      const [attempt] = await t.client.attempts(task.id);
      assert.equal(attempt!.state, "failed");
      const message = (attempt!.evidence![0]!.body as { message: string }).message;
      const prefix = "InvalidInputError: ";
      assert.equal(message, (prefix + "é".repeat(MESSAGE_LIMIT)).slice(0, MESSAGE_LIMIT));
    });

    test("a result too large to report is reported unknown (then reconciled), never dropped", async () => {
      const t = await server.tenant();
      await proxy.set({});
      const w = worker(new Client(proxy.url, t.executorKey), {
        leaseMs: LONG_LEASE_MS,
        handlers: {
          "payment.release": {
            execute: () => ({ blob: "x".repeat(1 << 20) }),
            reconcile: () => new Committed({ found: true }),
          },
        },
      });
      const { task } = await t.client.submit("payment.release", payment(), key());
      const done = await terminal(t.client, task.id);
      await w.worker.stop();
      const attempts = await t.client.attempts(task.id);
      assert.deepEqual(
        attempts.map((a) => [a.kind, a.state]),
        [
          ["execute", "unknown"],
          ["reconcile", "committed"],
        ],
      );
      assert.equal(
        (attempts[0]!.evidence![0]!.body as { message: string }).message,
        "the result is too large to report",
      );
      assert.equal(done.state, "succeeded");
      assert.deepEqual(done.delivery?.result, { found: true });
    });

    /** One shutdown round of tenant `t`; resolves with the time from the released task's arrival to another executor's lease, ms. */
    async function shutdownRound(t: Tenant): Promise<number> {
      await t.client.submit("generation.dispatch", { hold: true }, key());
      const child = spawn(
        process.execPath,
        [fileURLToPath(new URL("./fixtures/stopping-worker.js", import.meta.url))],
        {
          env: { ...process.env, IDEM_URL: proxy.url, IDEM_KEY: t.executorKey },
          stdio: ["pipe", "pipe", "pipe"],
        },
      );
      try {
        let out = "";
        let err = "";
        const startedLine = signal();
        const stoppingLine = signal();
        child.stdout.on("data", (d: Buffer) => {
          out += d.toString();
          if (out.includes("started")) startedLine.resolve();
          if (out.includes("SIGTERM: stopping")) stoppingLine.resolve();
        });
        child.stderr.on("data", (d: Buffer) => (err += d.toString()));
        const exited = new Promise<number | null>((r) => child.on("exit", (code) => r(code)));
        await startedLine.promise;
        // The handler runs; the worker's second slot waits in a long-poll.
        child.kill("SIGTERM");
        // The task arrives once the worker's shutdown began (before, it would be run).
        await stoppingLine.promise;
        const arrived = (await t.client.submit("generation.dispatch", { n: 2 }, key())).task;
        // Once the stopping worker holds it, another executor waits for it (a long-poll).
        await until(async () => (await t.client.attempts(arrived.id)).length > 0);
        const [attempt] = await t.executor.claim({
          executorId: "w-other",
          operations: ["generation.dispatch"],
          leaseMs: 5000,
          waitMs: 5000,
        });
        assert.equal(attempt?.task_id, arrived.id);
        await t.executor.report(attempt!.id, { generation: attempt!.generation, outcome: "succeeded", result: {} });
        child.stdin.write("done\n");
        assert.equal(await exited, 0, `stdout: ${out}\nstderr: ${err}`);
        assert.match(out, /ran: \{"abandoned":0,"released":1\}/);
        const [released, ran, ...more] = await t.client.attempts(arrived.id);
        assert.equal(more.length, 0);
        assert.deepEqual([released!.executor_id, released!.state, released!.evidence], ["w-stopping", "released", []]);
        assert.deepEqual([ran!.kind, ran!.executor_id, ran!.state], ["execute", "w-other", "succeeded"]);
        return ms(ran!.leased_at) - ms(arrived.created_at);
      } finally {
        child.kill("SIGKILL");
      }
    }

    test(`${SHUTDOWN_ROUNDS} rounds: a worker stopped by SIGTERM releases the task its open claim brings`, async () => {
      await proxy.set({});
      // A tenant per round, made before the rounds (their key processes load the machine too).
      const tenants: Tenant[] = [];
      for (let n = 0; n < SHUTDOWN_ROUNDS; n += 10)
        tenants.push(...(await Promise.all(Array.from({ length: 10 }, () => server.tenant()))));
      const waits: number[] = [];
      for (let n = 0; n < SHUTDOWN_ROUNDS; n += 5)
        waits.push(...(await Promise.all(tenants.slice(n, n + 5).map((t) => shutdownRound(t)))));
      // Released, not expired: another executor had it before the stopping worker's 5 s lease could
      // have run out (the time itself is printed, not judged: speed is never asserted).
      const worst = Math.max(...waits);
      assert.ok(worst < 5000, `claimed by another executor ${worst} ms after its arrival`);
      console.log(`[typescript ${kind} SIGTERM] ${SHUTDOWN_ROUNDS} rounds: max(arrival to next lease) ${worst} ms`);
    });
  });
}
