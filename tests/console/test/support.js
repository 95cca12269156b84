/**
 * Test support for the console's browser tests: a real `idem serve` (binary from env
 * `IDEM_BIN`, default `target/debug/idem` under the repository root) on a scratch SQLite
 * file, or on the PostgreSQL database named by env `IDEM_CONSOLE_STORE` (scripts/ci.sh
 * creates and drops it); tenants with fresh keys made by `idem keys create`; a small client
 * of the public HTTP API (SPEC §4) for submitting and executing tasks; and headless Debian
 * Chromium driven by playwright-core (never a downloaded browser).
 *
 * Cleanup: every server and browser this process starts is stopped by `stop()` and, should
 * the process die first, on its `exit`. When env `IDEM_CONSOLE_PIDS` names a directory, each
 * started process's pid is written there as a file, so that scripts/ci.sh can end what a
 * killed test process left behind.
 */
import { execFile, spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdtemp, rm, writeFile, unlink } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

import { chromium } from "playwright-core";

const run = promisify(execFile);

/** The repository root (this file is tests/console/test/support.js). */
export const repoRoot = fileURLToPath(new URL("../../../", import.meta.url));
export const idemBin = path.resolve(repoRoot, process.env.IDEM_BIN ?? "target/debug/idem");
/** Debian's Chromium (env `CHROMIUM`), never one a test tool downloads. */
export const chromiumBin = process.env.CHROMIUM ?? "/usr/bin/chromium";

/**
 * Short backoffs for the bundled classes (the documented `IDEM_OPERATIONS__…` overrides, as
 * the SDK suites use): a retry or a reconciliation is claimable within 50–200 ms.
 */
const FAST_ENV = {
  IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS: "50",
  IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS: "200",
  IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__INITIAL_MS: "50",
  IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__MAX_MS: "200",
};

/** Chromium's flags on this machine (see .library/env/machines/rust-svc.md): no network of its own. */
const CHROMIUM_ARGS = [
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--disable-dev-shm-usage",
];

const cleanups = new Set();
process.once("exit", () => {
  for (const f of cleanups) f();
});

/** Notes a started process as `KIND-PID` in `IDEM_CONSOLE_PIDS` (kind `idem` or `chromium`). */
async function notePid(kind, pid) {
  const dir = process.env.IDEM_CONSOLE_PIDS;
  if (dir && pid) await writeFile(path.join(dir, `${kind}-${pid}`), "");
}
async function forgetPid(kind, pid) {
  const dir = process.env.IDEM_CONSOLE_PIDS;
  if (dir && pid) await unlink(path.join(dir, `${kind}-${pid}`)).catch(() => {});
}

/** Which store the servers of this run use: `sqlite` or `postgres`. */
export const storeKind = process.env.IDEM_CONSOLE_STORE?.startsWith("postgres") ? "postgres" : "sqlite";
const sharedStore = process.env.IDEM_CONSOLE_STORE || undefined;

export class Server {
  constructor(url, child, dir, store, log) {
    this.url = url;
    this.child = child;
    this.dir = dir;
    this.store = store;
    this.log = log;
  }

  /**
   * Starts `idem serve` on a free port. `store`: env `IDEM_CONSOLE_STORE`, else a SQLite file
   * in a fresh temporary directory.
   */
  static async start({ env = {} } = {}) {
    const dir = await mkdtemp(path.join(tmpdir(), "idem-console-"));
    const store = sharedStore ?? `sqlite://${path.join(dir, "idem.db")}`;
    const child = spawn(
      idemBin,
      ["serve", "--listen", "127.0.0.1:0", "--store", store, "--sweep-interval-ms", "50", "--shutdown-grace-ms", "2000"],
      {
        env: { ...process.env, ...FAST_ENV, RUST_LOG: process.env.RUST_LOG ?? "warn", ...env },
        stdio: ["ignore", "pipe", "pipe"],
      },
    );
    const kill = () => child.kill("SIGKILL");
    cleanups.add(kill);
    await notePid("idem", child.pid);
    let err = "";
    child.stderr.on("data", (d) => (err = (err + d.toString()).slice(-20_000)));
    const url = await new Promise((resolve, reject) => {
      let out = "";
      const timer = setTimeout(() => reject(new Error(`idem serve did not start within 30 s: ${err}`)), 30_000);
      child.on("error", (e) => reject(new Error(`cannot start ${idemBin} (set IDEM_BIN): ${e.message}`)));
      child.on("exit", (code) => reject(new Error(`idem serve exited (${code}): ${err}`)));
      child.stdout.on("data", (d) => {
        out += d.toString();
        const m = /idem listening on (http:\/\/\S+)/.exec(out);
        if (m) {
          clearTimeout(timer);
          resolve(m[1]);
        }
      });
    }).catch(async (e) => {
      kill();
      await rm(dir, { recursive: true, force: true });
      throw e;
    });
    const server = new Server(url, child, dir, store, () => err);
    server.kill = kill;
    return server;
  }

  /** `idem keys create` for `tenant` with `role`: `{ key, id }`. */
  async createKey(tenant, role) {
    const { stdout, stderr } = await run(
      idemBin,
      ["keys", "create", "--tenant", tenant, "--role", role, "--store", this.store],
      { env: { ...process.env, RUST_LOG: "warn" } },
    );
    const id = /created API key (\S+)/.exec(stderr)?.[1];
    return { key: stdout.trim(), id };
  }

  /** `idem keys revoke ID`. */
  async revokeKey(id) {
    await run(idemBin, ["keys", "revoke", id, "--store", this.store], { env: { ...process.env, RUST_LOG: "warn" } });
  }

  /** A fresh tenant (`prefix-` and 8 random hex digits) with an admin, a client and an executor key. */
  async tenant(prefix = "t") {
    return this.tenantNamed(`${prefix}-${randomUUID().slice(0, 8)}`);
  }

  /** Tenant `name` with a new admin, client and executor key, each with its API client. */
  async tenantNamed(name) {
    const [admin, client, executor] = await Promise.all(
      ["admin", "client", "executor"].map((r) => this.createKey(name, r)),
    );
    return {
      name,
      adminKey: admin.key,
      adminKeyId: admin.id,
      clientKey: client.key,
      clientKeyId: client.id,
      executorKey: executor.key,
      admin: new Api(this.url, admin.key),
      client: new Api(this.url, client.key),
      executor: new Api(this.url, executor.key),
    };
  }

  async stop() {
    if (this.child.exitCode === null && this.child.signalCode === null) {
      const exited = new Promise((r) => this.child.once("exit", r));
      this.child.kill("SIGTERM");
      // A graceful stop takes at most the 2 s grace; past 5 s it is killed.
      const timer = setTimeout(() => this.child.kill("SIGKILL"), 5_000);
      await exited;
      clearTimeout(timer);
    }
    cleanups.delete(this.kill);
    await forgetPid("idem", this.child.pid);
    await rm(this.dir, { recursive: true, force: true });
  }
}

export class ApiError extends Error {
  constructor(method, url, status, body) {
    super(`${method} ${url} → ${status}: ${JSON.stringify(body)}`);
    this.status = status;
    this.body = body;
  }
}

/** The public HTTP API (SPEC §4) with one key. */
export class Api {
  constructor(base, key) {
    this.base = base;
    this.key = key;
  }

  async call(method, p, body, headers = {}) {
    const res = await fetch(this.base + p, {
      method,
      headers: {
        authorization: `Bearer ${this.key}`,
        ...(body === undefined ? {} : { "content-type": "application/json" }),
        ...headers,
      },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await res.text();
    const json = text ? JSON.parse(text) : null;
    if (!res.ok) throw new ApiError(method, p, res.status, json);
    return json;
  }

  /** `POST /v1/tasks` → the task. */
  async submit(operation, idempotencyKey, params) {
    const key = `"${idempotencyKey.replace(/\\/g, "\\\\").replace(/"/g, '\\"')}"`;
    return (await this.call("POST", "/v1/tasks", { operation, params }, { "idempotency-key": key })).task;
  }
  async task(id) {
    return (await this.call("GET", `/v1/tasks/${id}`)).task;
  }
  async attempts(id) {
    return (await this.call("GET", `/v1/tasks/${id}/attempts`)).attempts;
  }
  async events(id) {
    return (await this.call("GET", `/v1/tasks/${id}/events`)).events;
  }
  /** `GET /v1/tasks?…` (search): `{ tasks, next_cursor }`. */
  async search(query) {
    return this.call("GET", `/v1/tasks?${new URLSearchParams(query)}`);
  }
  async cancel(id, reason) {
    return this.call("POST", `/v1/tasks/${id}/cancel`, reason === undefined ? undefined : { reason });
  }
  async ackDelivery(id) {
    return this.call("POST", `/v1/tasks/${id}/delivery/ack`);
  }
  async resolve(id, body) {
    return (await this.call("POST", `/v1/tasks/${id}/resolve`, body)).task;
  }

  /** `POST /v1/attempts/claim` for `operation` → the first attempt (throws when none within `waitMs`). */
  async claim(operation, { executorId = "worker-1", leaseMs, waitMs = 3000 } = {}) {
    const body = { executor_id: executorId, operations: [operation], max: 1, wait_ms: waitMs };
    if (leaseMs !== undefined) body.lease_ms = leaseMs;
    const { attempts } = await this.call("POST", "/v1/attempts/claim", body);
    if (attempts.length === 0) throw new Error(`nothing to claim for ${operation} within ${waitMs} ms`);
    return attempts[0];
  }
  async ack(attempt) {
    return this.call("POST", `/v1/attempts/${attempt.id}/ack`, { generation: attempt.generation });
  }
  async heartbeat(attempt, usage) {
    return this.call("POST", `/v1/attempts/${attempt.id}/heartbeat`, { generation: attempt.generation, usage });
  }
  /** `POST /v1/attempts/{id}/report` with `{generation, ...report}` → the task. */
  async report(attempt, report) {
    return (await this.call("POST", `/v1/attempts/${attempt.id}/report`, { generation: attempt.generation, ...report }))
      .task;
  }
}

/**
 * An amount as the console writes it, from a task's frozen contract (the tests' oracle for
 * idem_core::money): `EUR 1.00`, `JPY 100`, `KWD 1.000`; `100 minor units` without a currency.
 */
export function moneyText(amount, contract) {
  const fees = contract.fees ?? {};
  if (!fees.currency) return `${amount} minor ${amount === 1 ? "unit" : "units"}`;
  const exp = fees.exponent ?? 0;
  const abs = Math.abs(amount);
  const whole = Math.floor(abs / 10 ** exp);
  const frac = exp > 0 ? `.${String(abs % 10 ** exp).padStart(exp, "0")}` : "";
  return `${fees.currency} ${amount < 0 ? "-" : ""}${whole}${frac}`;
}

/**
 * Waits until a terminal task's page has its last live refresh behind it (the stream's `end`
 * and the fragment it fetched), so that nothing swaps the task's body under a test's hands.
 */
export async function liveDone(page) {
  await page.waitForFunction(() => document.getElementById("task")?.dataset.liveDone === "true");
}

/** A unique idempotency key. */
export function key(prefix = "k") {
  return `${prefix}-${randomUUID()}`;
}

export function payment(amount = 1250, extra = {}) {
  return { payee: "acct-42", amount, currency: "EUR", ...extra };
}

/**
 * A payment whose executor reported `unknown`: state `reconciling`, its first (execute)
 * attempt acknowledged, with usage 3. With `reconcileClaimed`, a reconcile attempt is leased
 * too (by executor `recon-1`), so that a later resolution makes its report stale.
 * → `{ task, attempt, reconcile? }`.
 */
export async function reconcilingPayment(t, idempotencyKey, { params = payment(), reconcileClaimed = false } = {}) {
  const task = await t.client.submit("payment.release", idempotencyKey, params);
  const attempt = await t.executor.claim("payment.release", { executorId: "payout-worker-1" });
  if (attempt.task_id !== task.id) throw new Error("claimed another task than the one submitted");
  await t.executor.ack(attempt);
  await t.executor.heartbeat(attempt, 3);
  const after = await t.executor.report(attempt, {
    outcome: "unknown",
    message: "provider timed out after the payout request was sent",
  });
  if (after.state !== "reconciling") throw new Error(`expected reconciling, got ${after.state}`);
  let reconcile;
  if (reconcileClaimed) {
    reconcile = await t.executor.claim("payment.release", { executorId: "recon-1" });
    if (reconcile.kind !== "reconcile") throw new Error(`expected a reconcile attempt, got ${reconcile.kind}`);
  }
  return { task: await t.client.task(task.id), attempt, reconcile };
}

/**
 * A `generation.dispatch` task with two execute attempts: the first fails `transient` after a
 * heartbeat with usage, the second succeeds. → the task.
 */
export async function retriedDispatch(t, idempotencyKey, params = { prompt: "a lighthouse at dusk", steps: 30 }) {
  const task = await t.client.submit("generation.dispatch", idempotencyKey, params);
  const a1 = await t.executor.claim("generation.dispatch", { executorId: "gpu-worker-1" });
  await t.executor.heartbeat(a1, 7);
  await t.executor.report(a1, { outcome: "failed", failure_class: "transient", message: "GPU out of memory", usage: 7 });
  const a2 = await t.executor.claim("generation.dispatch", { executorId: "gpu-worker-2" });
  await t.executor.heartbeat(a2, 12);
  await t.executor.report(a2, { outcome: "succeeded", result: { image: "img-7f3a.png" }, usage: 12 });
  return t.client.task(task.id);
}

/** Headless Debian Chromium (a server process of its own, so that its pid is known for cleanup). */
export async function launchBrowser() {
  const server = await chromium.launchServer({ executablePath: chromiumBin, headless: true, args: CHROMIUM_ARGS });
  const pid = server.process().pid;
  const kill = () => {
    try {
      process.kill(-pid, "SIGKILL");
    } catch {
      /* gone already */
    }
  };
  cleanups.add(kill);
  await notePid("chromium", pid);
  const browser = await chromium.connect(server.wsEndpoint());
  const close = browser.close.bind(browser);
  browser.close = async () => {
    const timeout = (ms) => new Promise((r) => setTimeout(r, ms).unref());
    await Promise.race([close().catch(() => {}), timeout(5_000)]);
    await Promise.race([server.close().catch(() => {}), timeout(5_000)]);
    kill();
    cleanups.delete(kill);
    await forgetPid("chromium", pid);
  };
  return browser;
}

/**
 * A page in a fresh browser context (its own cookies), 1280 px wide, that records what must
 * never happen on a console page: dialogs, uncaught errors, console errors, CSP violations.
 * `timezoneId` (IANA, e.g. `Asia/Kolkata`): the browser's time zone, else the machine's.
 */
export async function newPage(browser, { width = 1280, height = 900, timezoneId } = {}) {
  const context = await browser.newContext({ viewport: { width, height }, deviceScaleFactor: 1, timezoneId });
  // A missing element fails in seconds, not after Playwright's default 30 s.
  context.setDefaultTimeout(5_000);
  context.setDefaultNavigationTimeout(10_000);
  const page = await context.newPage();
  const problems = { dialogs: [], errors: [], console: [] };
  page.on("dialog", (d) => {
    problems.dialogs.push(`${d.type()}: ${d.message()}`);
    d.dismiss().catch(() => {});
  });
  page.on("pageerror", (e) => problems.errors.push(String(e)));
  page.on("console", (m) => {
    if (m.type() !== "error") return;
    const at = m.location()?.url ?? "";
    // Chromium asks every origin for /favicon.ico on its own; its 404 is no fault of a page.
    if (new URL(at, "http://x").pathname === "/favicon.ico") return;
    problems.console.push(`${m.text()} (${at})`);
  });
  await page.addInitScript(() => {
    window.__cspViolations = [];
    document.addEventListener("securitypolicyviolation", (e) =>
      window.__cspViolations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sample}`),
    );
  });
  return { context, page, problems };
}

/** Signs in on `/console/sign-in` with `apiKey`; waits for the overview (or `expectPath`). */
export async function signIn(page, base, apiKey, expectPath = "/console/overview") {
  await page.goto(`${base}/console/sign-in`);
  await page.fill("#api_key", apiKey);
  await Promise.all([
    page.waitForURL((u) => u.pathname === expectPath, { timeout: 10_000 }),
    page.locator("#sign-in").locator('button[type="submit"], input[type="submit"], button:not([type])').first().click(),
  ]);
}

/** The CSRF token of the page's sign-out form (every signed-in page has one). */
export async function csrfOf(page) {
  return page.locator('#sign-out input[name="csrf"]').inputValue();
}

/** Milliseconds since `t0` as a readable figure. */
export function since(t0) {
  return Math.round(performance.now() - t0);
}
