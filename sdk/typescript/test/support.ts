/**
 * Test support: a real `idem serve` on a scratch SQLite file or a scratch PostgreSQL database
 * (binary from env `IDEM_BIN`, default `target/debug/idem` under the repository root), tenants
 * with fresh keys, a TCP proxy that can drop or cut answers, and the fault-injecting proxy of
 * idem-harness ({@link FaultProxy}).
 */
import { spawn, execFile, type ChildProcess } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdtemp, rm } from "node:fs/promises";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

import { Client, type ClientOptions, type Logger } from "../src/index.js";

const run = promisify(execFile);

/** The repository root (this file runs as dist-test/test/support.js under sdk/typescript). */
export const repoRoot = fileURLToPath(new URL("../../../../", import.meta.url));
export const idemBin = path.resolve(repoRoot, process.env["IDEM_BIN"] ?? "target/debug/idem");

/**
 * The bundled configuration with short backoffs (as crates/idem/tests/http/support.rs
 * `fast_toml` does, through the documented `IDEM_OPERATIONS__…` overrides): a transient
 * failure of `generation.dispatch` waits 300 ms, long enough to measure.
 */
const FAST_ENV: Record<string, string> = {
  IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS: "50",
  IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS: "200",
  IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__INITIAL_MS: "300",
  IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__MAX_MS: "1000",
};
export const DISPATCH_BACKOFF_MS = 300;

export interface Tenant {
  name: string;
  /** A client key's client. */
  client: Client;
  /** An executor key's client. */
  executor: Client;
  clientKey: string;
  executorKey: string;
}

export class Server {
  private constructor(
    readonly url: string,
    private readonly child: ChildProcess,
    private readonly dir: string,
    private readonly store: string,
    private readonly stderr: () => string,
    private readonly dropStore: () => Promise<void> = async () => {},
  ) {}

  /**
   * `idem serve` on a SQLite file, or (`kind` "postgres") on a scratch database
   * `idem_t_sdk_<pid>_<n>` of `IDEM_TEST_PG_URL`'s server, dropped by `stop()`.
   */
  static async start(kind: "sqlite" | "postgres" = "sqlite"): Promise<Server> {
    const dir = await mkdtemp(path.join(tmpdir(), "idem-ts-"));
    let store = `sqlite://${path.join(dir, "idem.db")}`;
    let dropStore = async () => {};
    if (kind === "postgres") {
      const name = `idem_t_sdk_${process.pid}_${scratch++}`;
      await run("psql", [PG_URL, "-qc", `CREATE DATABASE ${name}`]);
      store = `${PG_URL.slice(0, PG_URL.lastIndexOf("/"))}/${name}`;
      dropStore = async () => {
        await run("psql", [PG_URL, "-qc", `DROP DATABASE IF EXISTS ${name} WITH (FORCE)`]);
      };
    }
    try {
      return await Server.#start(dir, store, dropStore);
    } catch (e) {
      await dropStore();
      throw e;
    }
  }

  static async #start(dir: string, store: string, dropStore: () => Promise<void>): Promise<Server> {
    const child = spawn(
      idemBin,
      [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--store",
        store,
        "--sweep-interval-ms",
        "50",
        "--shutdown-grace-ms",
        "2000",
      ],
      {
        env: { ...process.env, ...FAST_ENV, RUST_LOG: process.env["RUST_LOG"] ?? "warn" },
        stdio: ["ignore", "pipe", "pipe"],
      },
    );
    // The server goes with this process, even when a test run is cut short.
    process.once("exit", () => child.kill("SIGKILL"));
    let err = "";
    child.stderr!.on("data", (d: Buffer) => (err = (err + d.toString()).slice(-20_000)));
    const url = await new Promise<string>((resolve, reject) => {
      let out = "";
      const timer = setTimeout(() => reject(new Error(`idem serve did not start within 20 s: ${err}`)), 20_000);
      child.on("error", (e) => reject(new Error(`cannot start ${idemBin} (set IDEM_BIN): ${e.message}`)));
      child.on("exit", (code) => reject(new Error(`idem serve exited (${code}): ${err}`)));
      child.stdout!.on("data", (d: Buffer) => {
        out += d.toString();
        const m = /idem listening on (http:\/\/\S+)/.exec(out);
        if (m) {
          clearTimeout(timer);
          resolve(m[1]!);
        }
      });
    });
    return new Server(url, child, dir, store, () => err, dropStore);
  }

  /** A fresh tenant with a client key and an executor key. */
  async tenant(options: ClientOptions = {}): Promise<Tenant> {
    const name = `t-${randomUUID()}`;
    const clientKey = (await this.key(name, "client")).key;
    const executorKey = (await this.key(name, "executor")).key;
    return {
      name,
      clientKey,
      executorKey,
      client: new Client(this.url, clientKey, options),
      executor: new Client(this.url, executorKey, options),
    };
  }

  /** A new key of `tenant` with `role`, and its id (for {@link revoke}). */
  async key(tenant: string, role: string): Promise<{ key: string; id: string }> {
    const { stdout, stderr } = await run(
      idemBin,
      ["keys", "create", "--tenant", tenant, "--role", role, "--store", this.store],
      { env: { ...process.env, RUST_LOG: "warn" } },
    );
    return { key: stdout.trim(), id: /created API key (\S+)/.exec(stderr)?.[1] ?? "" };
  }

  /** Revokes a key by id (`idem keys revoke`). */
  async revoke(id: string): Promise<void> {
    await run(idemBin, ["keys", "revoke", id, "--store", this.store], { env: { ...process.env, RUST_LOG: "warn" } });
  }

  /** The server's log so far (for failure messages). */
  log(): string {
    return this.stderr();
  }

  async stop(): Promise<void> {
    if (this.child.exitCode === null) {
      const exited = new Promise((r) => this.child.once("exit", r));
      this.child.kill("SIGTERM");
      await exited;
    }
    await rm(this.dir, { recursive: true, force: true });
    await this.dropStore();
  }
}

/** PostgreSQL server the fault suites create their scratch databases on. */
const PG_URL = process.env["IDEM_TEST_PG_URL"] ?? "postgres://postgres@127.0.0.1:5432/test";
let scratch = 0;

/**
 * The fault proxy binary: env `FAULT_PROXY_BIN`, else the example of idem-harness under
 * `$CARGO_TARGET_DIR` or the repository's target (`cargo build -p idem-harness --example fault-proxy`).
 */
export const faultProxyBin =
  process.env["FAULT_PROXY_BIN"] ??
  path.resolve(repoRoot, process.env["CARGO_TARGET_DIR"] ?? "target", "debug/examples/fault-proxy");

/** A route class's rule: a mode, or a mode applied after the first `after` requests pass. */
export type FaultRule = string | { mode: string; after: number };

/**
 * The fault-injecting proxy (crates/idem-harness/examples/fault-proxy.rs) in front of a server:
 * `set()` replaces its rules (route class → rule), `counts()` reads its counters.
 */
export class FaultProxy {
  private constructor(
    private readonly child: ChildProcess,
    readonly url: string,
  ) {}

  static async start(upstream: string): Promise<FaultProxy> {
    const child = spawn(faultProxyBin, ["--upstream", new URL(upstream).host, "--listen", "127.0.0.1:0"], {
      stdio: ["ignore", "pipe", "inherit"],
    });
    process.once("exit", () => child.kill("SIGKILL"));
    const url = await new Promise<string>((resolve, reject) => {
      let out = "";
      child.on("error", (e) => reject(new Error(`cannot start ${faultProxyBin} (set FAULT_PROXY_BIN): ${e.message}`)));
      child.on("exit", (code) => reject(new Error(`the fault proxy exited (${code})`)));
      child.stdout!.on("data", (d: Buffer) => {
        out += d.toString();
        const m = /listening on (127\.0\.0\.1:\d+)/.exec(out);
        if (m) resolve(`http://${m[1]}`);
      });
    });
    return new FaultProxy(child, url);
  }

  async set(rules: Record<string, FaultRule>): Promise<void> {
    const r = await fetch(`${this.url}/__faults`, { method: "PUT", body: JSON.stringify(rules) });
    if (r.status !== 204) throw new Error(`PUT /__faults: ${r.status} ${await r.text()}`);
  }

  async counts(): Promise<Record<string, { forwarded: number; faulted: number }>> {
    return (await (await fetch(`${this.url}/__faults/counts`)).json()) as Record<
      string,
      { forwarded: number; faulted: number }
    >;
  }

  /** Requests of `route` forwarded so far. */
  async forwarded(route: string): Promise<number> {
    return (await this.counts())[route]?.forwarded ?? 0;
  }

  async stop(): Promise<void> {
    if (this.child.exitCode === null) {
      const exited = new Promise((r) => this.child.once("exit", r));
      this.child.kill("SIGTERM");
      await exited;
    }
  }
}

/** A unique idempotency key. */
export function key(prefix = "k"): string {
  return `${prefix}-${randomUUID()}`;
}

/** A logger that keeps lines for assertions (and prints nothing). */
export class MemoryLogger implements Logger {
  readonly lines: string[] = [];
  info(m: string) {
    this.lines.push(`INFO ${m}`);
  }
  warn(m: string) {
    this.lines.push(`WARN ${m}`);
  }
  error(m: string) {
    this.lines.push(`ERROR ${m}`);
  }
}

/** A promise with its resolve function, e.g. to learn that a handler started. */
export function signal<T = void>(): { promise: Promise<T>; resolve: (v: T) => void } {
  let resolve!: (v: T) => void;
  const promise = new Promise<T>((r) => (resolve = r));
  return { promise, resolve };
}

/** Resolves when `s` aborts. */
export function aborted(s: AbortSignal): Promise<void> {
  return new Promise((resolve) =>
    s.aborted ? resolve() : s.addEventListener("abort", () => resolve(), { once: true }),
  );
}

export function ms(rfc3339: string): number {
  return Date.parse(rfc3339);
}

export interface ProxyRule {
  /** Which connections it applies to, by the request's first bytes (e.g. `/^POST \/v1\/tasks /`). */
  match: RegExp;
  /** How many matching connections it applies to. */
  times: number;
  /**
   * `drop`: the request is forwarded, and the connection is closed as soon as the answer
   * starts, without relaying it. `cut`: the answer is relayed until `cutWhen` holds for what
   * was relayed, then the connection is closed. `unavailable`: answered 503 `UNAVAILABLE` with
   * `Retry-After: 1` by the proxy itself.
   */
  action: "drop" | "cut" | "unavailable";
  cutWhen?: (relayed: string) => boolean;
}

/** A TCP proxy in front of `target` that applies `rules` to matching connections. */
export class Proxy {
  readonly applied: string[] = [];
  private readonly sockets = new Set<net.Socket>();
  private constructor(
    private readonly server: net.Server,
    readonly url: string,
  ) {}

  static async start(target: string, rules: ProxyRule[]): Promise<Proxy> {
    const upstream = new URL(target);
    const left = rules.map((r) => r.times);
    let proxy!: Proxy;
    const server = net.createServer((client) => {
      proxy.sockets.add(client);
      client.on("close", () => proxy.sockets.delete(client));
      client.on("error", () => {});
      let head = "";
      let rule: ProxyRule | undefined;
      const onFirst = (chunk: Buffer) => {
        head += chunk.toString("latin1");
        if (!head.includes("\r\n")) return;
        client.off("data", onFirst);
        client.pause();
        const i = rules.findIndex((r, n) => left[n]! > 0 && r.match.test(head));
        if (i >= 0) {
          left[i]!--;
          rule = rules[i];
          proxy.applied.push(`${rule!.action} ${head.split("\r\n")[0]}`);
        }
        if (rule?.action === "unavailable") {
          const body = JSON.stringify({
            type: "https://idem.dev/problems/unavailable",
            title: "Unavailable",
            status: 503,
            detail: "proxy says so",
            code: "UNAVAILABLE",
          });
          client.end(
            `HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nretry-after: 1\r\ncontent-length: ${body.length}\r\nconnection: close\r\n\r\n${body}`,
          );
          return;
        }
        const up = net.connect(Number(upstream.port), upstream.hostname);
        proxy.sockets.add(up);
        up.on("close", () => {
          proxy.sockets.delete(up);
          client.destroy();
        });
        up.on("error", () => client.destroy());
        client.on("close", () => up.destroy());
        up.write(Buffer.from(head, "latin1"));
        client.pipe(up);
        client.resume();
        let relayed = "";
        up.on("data", (d: Buffer) => {
          if (rule?.action === "drop") {
            client.destroy();
            up.destroy();
            return;
          }
          if (rule?.action === "cut") {
            relayed += d.toString("latin1");
            if (rule.cutWhen?.(relayed)) {
              // What was relayed reaches the client; then the connection closes mid-answer.
              up.destroy();
              client.write(d, () => client.destroy());
              return;
            }
          }
          client.write(d);
        });
      };
      client.on("data", onFirst);
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    const { port } = server.address() as net.AddressInfo;
    proxy = new Proxy(server, `http://127.0.0.1:${port}`);
    return proxy;
  }

  async close(): Promise<void> {
    for (const s of this.sockets) s.destroy();
    await new Promise((r) => this.server.close(r));
  }
}

/** Every item of an async iterable. */
export async function all<T>(it: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const x of it) out.push(x);
  return out;
}
