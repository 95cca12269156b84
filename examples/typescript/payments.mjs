#!/usr/bin/env node
// The payment story of `idem-lab demo`, told by an executor written with the
// TypeScript SDK (sdk/typescript, built into its dist/) against a real
// `idem serve` and the fake provider of examples/provider.
//
//     examples/typescript/run.sh      # builds the SDK, then runs this
//
// It starts `idem serve` on a temporary SQLite store (binary: $IDEM_BIN, else
// ${CARGO_TARGET_DIR:-target}/debug/idem), creates a client and an executor key, starts the provider
// (with a relay to idem that can lose answers), runs a worker whose
// `payment.release` handler pays through the provider with the task id as the
// provider's idempotency key, and plays four scenes, checking each. Exit
// status 0 when every check held, 1 otherwise.

import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, readFileSync, openSync, closeSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import {
  Client,
  Worker,
  Succeeded,
  Committed,
  NotCommitted,
  UnknownOutcomeError,
  IdempotencyConflictError,
} from "../../sdk/typescript/dist/index.js";

const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const OPERATION = "payment.release";
const failed = [];

const say = (line) => console.log(line);
const check = (ok, what) => {
  say(`    ${ok ? "ok  " : "FAIL"} ${what}`);
  if (!ok) failed.push(what);
};
const eur = (cents) => `EUR ${(cents / 100).toFixed(2)}`;
const short = (id) => String(id).slice(-8);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Starts `cmd` with its output in `log`; resolves with the matches of `pattern` once `count` appeared. */
async function start(cmd, args, log, pattern, count = 1, env = process.env) {
  const fd = openSync(log, "w");
  const child = spawn(cmd, args, { stdio: ["ignore", fd, fd], env });
  closeSync(fd);
  const deadline = Date.now() + 30_000;
  while (Date.now() < deadline) {
    const found = [...readFileSync(log, "utf8").matchAll(pattern)].map((m) => m[1]);
    if (found.length >= count) return { child, found };
    if (child.exitCode !== null) break;
    await sleep(20);
  }
  child.kill("SIGKILL");
  throw new Error(`${cmd} did not start; see ${log}:\n${readFileSync(log, "utf8")}`);
}

/** The executor's handler: pays through the provider, idempotent by task id. */
function payouts(provider) {
  return {
    async execute(ctx) {
      const p = ctx.params;
      let r;
      try {
        r = await fetch(`${provider}/payouts`, {
          method: "POST",
          headers: { "content-type": "application/json", "idempotency-key": ctx.taskId },
          body: JSON.stringify({ payee: p.payee, amount: p.amount, currency: p.currency, reference: ctx.idempotencyKey }),
        });
      } catch (e) {
        // The request may have been committed: only a reconcile can tell.
        throw new UnknownOutcomeError(`the provider's answer was lost: ${e.cause?.code ?? e.message}`);
      }
      if (!r.ok) throw new Error(`provider answered ${r.status}`);
      const payout = await r.json();
      if (p.hold_until_cancelled) {
        // Scene (d): the money has moved; wait until idem tells us of the cancel
        // request, then finish anyway (it is too late to undo).
        const deadline = Date.now() + 15_000;
        while (!ctx.cancelRequested && Date.now() < deadline) await sleep(20);
        say(`    executor: cancel requested = ${ctx.cancelRequested}, but payout ${payout.id} is already made; reporting it`);
      }
      return new Succeeded({ payout: payout.id }, { externalTxnId: payout.id });
    },
    async reconcile(ctx) {
      const r = await fetch(`${provider}/payouts/${ctx.taskId}`);
      if (r.status === 404) {
        say(`    executor: reconcile attempt ${ctx.number}: the provider has no payout for the task`);
        return new NotCommitted();
      }
      if (!r.ok) throw new Error(`provider answered ${r.status}`);
      const payout = await r.json();
      say(`    executor: reconcile attempt ${ctx.number}: the provider has payout ${payout.id}`);
      return new Committed({ payout: payout.id }, { externalTxnId: payout.id });
    },
  };
}

async function story(idemUrl, linkUrl, provider, clientKey, executorKey) {
  const post = (path, doc) =>
    fetch(`${provider}${path}`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(doc) });
  const ledger = async () => (await fetch(`${provider}/ledger`)).json();
  const payoutsFor = async (taskId) => (await ledger()).payouts.filter((p) => p.key === taskId);
  // The agent talks to idem through the relay that can lose answers.
  const agent = new Client(linkUrl, clientKey, { retry: { maxTries: 4, initialBackoffMs: 100, maxBackoffMs: 1000 } });
  const quiet = { info() {}, warn() {}, error: (m) => console.error(m) };
  const worker = new Worker(new Client(idemUrl, executorKey), {
    executorId: "payouts-ts",
    handlers: { [OPERATION]: payouts(provider) },
    concurrency: 4,
    leaseMs: 3000,
    claimWaitMs: 1000,
    handleSignals: false,
    logger: quiet,
  });
  const running = worker.run();
  try {
    // (a) The answer is lost; the same request with the same key names the same task.
    say("(a) A payout submitted, its answer lost, retried with the same key");
    const params = { payee: "acct-alice", amount: 1250, currency: "EUR" };
    await post("/faults", { drop_link_responses: 1 });
    const a = await agent.submit(OPERATION, params, "invoice-A", { wait: 10 });
    say(
      `    agent: released ${eur(1250)} to acct-alice under key invoice-A; the first answer was lost, ` +
        `${a.tries} tries in all: task ${short(a.task.id)}, replayed = ${a.replayed}, ${a.task.state}`,
    );
    const found = await agent.find(OPERATION, "invoice-A");
    check(a.tries >= 2 && a.replayed && !a.lookedUp, "the retry was answered with the same task, replayed");
    check(found.id === a.task.id && a.task.state === "succeeded", "the key names that one task, succeeded");
    check((await payoutsFor(a.task.id)).length === 1, "the provider paid once");

    // (b) The same key with a changed payee is refused.
    say("(b) The same key with the payee changed");
    try {
      await agent.submit(OPERATION, { ...params, payee: "acct-mallory" }, "invoice-A");
      check(false, "a changed payee is refused");
    } catch (e) {
      if (!(e instanceof IdempotencyConflictError)) throw e;
      say(`    agent: refused ${e.status} ${e.code}, task ${short(e.taskId)}, differing in ${JSON.stringify(e.differingFields)}`);
      check(
        e.code === "IDEMPOTENCY_CONFLICT" && JSON.stringify(e.differingFields) === '["/payee"]' && e.taskId === a.task.id,
        "refused with IDEMPOTENCY_CONFLICT naming the task, differing in /payee",
      );
    }
    check((await payoutsFor(a.task.id)).length === 1, "the provider's ledger is unchanged");

    // (c) The provider commits, its answer is lost: unknown outcome, reconcile, delivered once.
    say("(c) The provider commits but its answer is lost");
    await post("/faults", { drop_response_after_commit: ["invoice-C"] });
    const c = await agent.submit(OPERATION, { payee: "acct-bob", amount: 4200, currency: "EUR" }, "invoice-C");
    let task = await agent.get(c.task.id, { wait: 20 });
    const attempts = await agent.attempts(task.id);
    const paidC = await payoutsFor(task.id);
    say(
      `    agent: task ${short(task.id)} is ${task.state}, attempts ${attempts.map((x) => `${x.kind}:${x.state}`).join(", ")}, ` +
        `delivered transaction ${task.delivery?.external_txn_id}`,
    );
    check(
      attempts.map((x) => x.kind).join(",") === "execute,reconcile",
      "the lost answer led to a reconcile, not to a second execute",
    );
    check(
      task.state === "succeeded" && paidC.length === 1 && task.delivery?.external_txn_id === paidC[0].id,
      "the reconcile found the payout: delivered once, one payout in the ledger",
    );

    // (d) A cancel that loses to delivery.
    say("(d) A cancel that arrives while the payout is being made");
    const d = await agent.submit(
      OPERATION,
      { payee: "acct-carol", amount: 990, currency: "EUR", hold_until_cancelled: true },
      "invoice-D",
    );
    const deadline = Date.now() + 15_000;
    while ((await payoutsFor(d.task.id)).length === 0 && Date.now() < deadline) await sleep(50);
    const cancel = await agent.cancel(d.task.id);
    say(`    agent: the provider has paid; cancel → ${cancel.status} ${cancel.cancellation.status}`);
    task = await agent.get(d.task.id, { wait: 20 });
    const events = [];
    for await (const e of agent.events(task.id)) events.push(e.type);
    say(
      `    agent: task ${short(task.id)} is ${task.state}, cancellation ${task.cancellation?.status}, ` +
        `delivery charge ${task.delivery?.charge}, events ${events.join(", ")}`,
    );
    check(cancel.status === 202 && cancel.cancellation.status === "requested", "the cancel was recorded while the attempt ran");
    check(
      task.state === "succeeded" && task.cancellation?.status === "too_late" && events.includes("cancel_too_late"),
      "delivery won: the cancellation is too_late (cancel_too_late)",
    );
    check(
      task.delivery?.charge === task.contract.price &&
        events.filter((t) => t === "delivered").length === 1 &&
        (await payoutsFor(task.id)).length === 1,
      "delivered once, charged the contract price, one payout",
    );

    // The ledger: one payout per task, none for a refused request.
    const l = await ledger();
    const tasks = [];
    for await (const t of agent.list({ operation: OPERATION })) tasks.push(t);
    say(
      `Ledger: ${l.payouts.length} payouts for ${tasks.length} tasks, ${l.pay_requests} pay requests, ` +
        `${l.lookups} lookups, ${l.dropped} answers dropped`,
    );
    check(
      tasks.every((t) => l.payouts.filter((p) => p.key === t.id).length === 1) && l.payouts.length === tasks.length,
      "exactly one payout per task",
    );
  } finally {
    await worker.stop();
    await running.catch(() => {});
  }
}

async function main() {
  const idemBin = process.env.IDEM_BIN ?? join(resolve(REPO, process.env.CARGO_TARGET_DIR ?? "target"), "debug", "idem");
  const dir = mkdtempSync(join(tmpdir(), "idem-example-ts-"));
  const store = `sqlite://${join(dir, "idem.db")}`;
  const children = [];
  try {
    const env = {
      ...process.env,
      IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS: "50",
      IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS: "200",
    };
    const server = await start(
      idemBin,
      ["serve", "--listen", "127.0.0.1:0", "--store", store, "--sweep-interval-ms", "50"],
      join(dir, "idem.log"),
      /idem listening on (http:\/\/\S+)/g,
      1,
      env,
    );
    children.push(server.child);
    const idemUrl = server.found[0];
    const key = (role) =>
      execFileSync(idemBin, ["keys", "create", "--tenant", "acme", "--role", role, "--store", store], {
        encoding: "utf8",
        stdio: ["ignore", "pipe", "pipe"],
      }).trim();
    const [clientKey, executorKey] = [key("client"), key("executor")];
    const provider = await start(
      "python3",
      [join(REPO, "examples", "provider", "provider.py"), "--link-to", idemUrl],
      join(dir, "provider.log"),
      /(?:provider|link) listening on (http:\/\/\S+)/g,
      2,
    );
    children.push(provider.child);
    const [providerUrl, linkUrl] = provider.found;
    say(`idem at ${idemUrl}, provider at ${providerUrl}, the agent's lossy link at ${linkUrl}`);
    await story(idemUrl, linkUrl, providerUrl, clientKey, executorKey);
  } finally {
    for (const c of children) {
      const exited = new Promise((r) => (c.exitCode !== null ? r() : c.once("exit", r)));
      c.kill("SIGTERM");
      await Promise.race([exited, sleep(10_000).then(() => c.kill("SIGKILL"))]);
    }
    rmSync(dir, { recursive: true, force: true });
  }
  if (failed.length) {
    say(`${failed.length} check(s) failed: ${JSON.stringify(failed)}`);
    return 1;
  }
  say("Every check held.");
  return 0;
}

/**
 * `payments.mjs worker`: only the executor, for scripts/cross-language.sh. Reads
 * IDEM_URL, IDEM_EXECUTOR_KEY, PROVIDER_URL, EXECUTOR_ID (and LEASE_MS); runs until SIGTERM.
 */
async function workerOnly() {
  const env = process.env;
  const worker = new Worker(new Client(env.IDEM_URL, env.IDEM_EXECUTOR_KEY), {
    executorId: env.EXECUTOR_ID ?? "payouts-ts",
    handlers: { [OPERATION]: payouts(env.PROVIDER_URL) },
    concurrency: 8,
    leaseMs: Number(env.LEASE_MS ?? 2000),
    claimWaitMs: 1000,
    graceMs: 5000,
  });
  say(`worker ${env.EXECUTOR_ID} running`);
  const summary = await worker.run();
  say(`worker ${env.EXECUTOR_ID} stopped: ${JSON.stringify(summary)}`);
  return 0;
}

process.exitCode = process.argv[2] === "worker" ? await workerOnly() : await main();
