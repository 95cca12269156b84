import assert from "node:assert/strict";
import net from "node:net";
import { after, before, describe, test } from "node:test";

import {
  AttemptAlreadyReportedError,
  Client,
  IdemError,
  IdemTimeoutError,
  IdemTransportError,
  IdempotencyConflictError,
  InvalidRequestError,
  NotDeliveredError,
  NotFoundError,
  PermissionDeniedError,
  StaleGenerationError,
  UnauthenticatedError,
  sfString,
  type Task,
  type TaskEvent,
} from "../src/index.js";
import { Proxy, Server, all, key } from "./support.js";

const payment = (amount = 1250) => ({ payee: "acct-42", amount, currency: "EUR" });

/** Every task of the tenant under exactly this key, counted with `list`. */
async function tasksWithKey(client: Client, operation: string, k: string): Promise<Task[]> {
  const out: Task[] = [];
  for await (const t of client.list({ operation, idempotencyKeyPrefix: k })) if (t.idempotency_key === k) out.push(t);
  return out;
}

/** Claims the task's attempt with the executor client and reports it succeeded. */
async function complete(executor: Client, taskId: string, result: Record<string, unknown>): Promise<Task> {
  for (let i = 0; i < 50; i++) {
    const [a] = await executor.claim({
      executorId: "test",
      operations: ["payment.release", "generation.dispatch"],
      waitMs: 2000,
    });
    if (a === undefined) continue;
    assert.equal(a.task_id, taskId);
    return executor.report(a.id, { generation: a.generation, outcome: "succeeded", result, usage: 3 });
  }
  throw new Error("nothing to claim");
}

describe("Client against idem serve", () => {
  let server: Server;
  before(async () => {
    server = await Server.start();
  });
  after(async () => {
    await server?.stop();
  });

  test("submit creates a task once; the same request again is a replay", async () => {
    const { client } = await server.tenant();
    const k = key();
    const first = await client.submit("payment.release", payment(), k);
    assert.equal(first.replayed, false);
    assert.equal(first.tries, 1);
    assert.equal(first.task.state, "queued");
    assert.equal(first.meta?.idempotency_key, k);
    const again = await client.submit("payment.release", { ...payment(), note: "not material" }, k);
    assert.equal(again.replayed, true);
    assert.equal(again.task.id, first.task.id);
    assert.deepEqual(await client.get(first.task.id), first.task);
    assert.equal((await client.find("payment.release", k)).id, first.task.id);
  });

  test("a dropped first answer: the retry gets the same task, and the scope holds exactly one", async () => {
    const { client: direct, clientKey } = await server.tenant();
    const proxy = await Proxy.start(server.url, [{ match: /^POST \/v1\/tasks /, times: 1, action: "drop" }]);
    try {
      const client = new Client(proxy.url, clientKey);
      const k = key("drop");
      const s = await client.submit("payment.release", payment(), k);
      assert.deepEqual(proxy.applied, ["drop POST /v1/tasks HTTP/1.1"], "the proxy dropped the first answer");
      assert.equal(s.tries, 2);
      assert.equal(s.replayed, true, "the first request was committed: the retry is a replay");
      assert.equal(s.lookedUp, false);
      const tasks = await tasksWithKey(direct, "payment.release", k);
      assert.deepEqual(
        tasks.map((t) => t.id),
        [s.task.id],
      );
      assert.equal((await all(direct.list())).length, 1, "the tenant holds one task");
    } finally {
      await proxy.close();
    }
  });

  test("every answer dropped: after the tries the task is found by scope, never submitted under a new key", async () => {
    const { client: direct, clientKey } = await server.tenant();
    const proxy = await Proxy.start(server.url, [{ match: /^POST \/v1\/tasks /, times: 3, action: "drop" }]);
    try {
      const client = new Client(proxy.url, clientKey, { retry: { maxTries: 3, initialBackoffMs: 10 } });
      const k = key("lost");
      const s = await client.submit("payment.release", payment(), k);
      assert.equal(proxy.applied.length, 3);
      assert.equal(s.lookedUp, true);
      assert.equal(s.tries, 3);
      const tasks = await all(direct.list());
      assert.deepEqual(
        tasks.map((t) => t.id),
        [s.task.id],
      );
      assert.equal(tasks[0]!.idempotency_key, k);
    } finally {
      await proxy.close();
    }
  });

  test("503 on every try and no task in the scope: the last error, nothing invented", async () => {
    const { client: direct, clientKey } = await server.tenant();
    // The proxy answers the request itself (503) so that nothing reaches idem.
    const proxy = await Proxy.start(server.url, [{ match: /^POST \/v1\/tasks /, times: 2, action: "unavailable" }]);
    try {
      const client = new Client(proxy.url, clientKey, { retry: { maxTries: 2 } });
      const started = Date.now();
      await assert.rejects(
        client.submit("payment.release", payment(), key()),
        (e: unknown) => e instanceof IdemError && e.code === "UNAVAILABLE" && e.retryAfterMs === 1000,
      );
      assert.ok(Date.now() - started >= 1000, "Retry-After: 1 was honoured");
      assert.equal((await all(direct.list())).length, 0);
    } finally {
      await proxy.close();
    }
  });

  test("503 with Retry-After: the same request is sent again after it", async () => {
    const { clientKey } = await server.tenant();
    const proxy = await Proxy.start(server.url, [{ match: /^POST \/v1\/tasks /, times: 1, action: "unavailable" }]);
    try {
      const client = new Client(proxy.url, clientKey);
      const started = Date.now();
      const s = await client.submit("payment.release", payment(), key());
      assert.ok(Date.now() - started >= 1000, "waited Retry-After");
      assert.equal(s.tries, 2);
      assert.equal(s.replayed, false);
    } finally {
      await proxy.close();
    }
  });

  test("a conflict throws IdempotencyConflictError with the task id and differing fields", async () => {
    const { client } = await server.tenant();
    const k = key();
    const first = await client.submit("payment.release", payment(1250), k);
    const err = await client.submit("payment.release", { ...payment(9999), currency: "USD" }, k).then(
      () => assert.fail("expected a conflict"),
      (e: unknown) => e,
    );
    assert.ok(err instanceof IdempotencyConflictError, String(err));
    assert.ok(err instanceof IdemError);
    assert.equal(err.status, 422);
    assert.equal(err.code, "IDEMPOTENCY_CONFLICT");
    assert.equal(err.taskId, first.task.id);
    assert.deepEqual([...err.differingFields].sort(), ["/amount", "/currency"]);
    assert.ok(err.requestId, "X-Request-Id is kept");
    assert.equal((await tasksWithKey(client, "payment.release", k)).length, 1);
  });

  test("4xx errors are typed and thrown at once", async () => {
    const { client, executor } = await server.tenant();
    const bad = await client.submit("payment.release", { payee: "acct-42", amount: 5 }, key()).catch((e: unknown) => e);
    assert.ok(bad instanceof InvalidRequestError, String(bad));
    assert.deepEqual(
      bad.errors.map((e) => e.pointer),
      ["/params/currency"],
    );
    await assert.rejects(client.get("0190b8d6-0000-7000-8000-000000000000"), NotFoundError);
    await assert.rejects(client.find("payment.release", key()), NotFoundError);
    await assert.rejects(
      new Client(server.url, "idem_wrong").get("0190b8d6-0000-7000-8000-000000000000"),
      UnauthenticatedError,
    );
    await assert.rejects(executor.heartbeat("0190b8d6-0000-7000-8000-000000000000", 1), NotFoundError);
    assert.throws(() => sfString(""), TypeError);
    assert.throws(() => sfString("with space"), TypeError);
    assert.equal(sfString('a"b\\c'), '"a\\"b\\\\c"');
    await assert.rejects(
      new Client("http://127.0.0.1:9", "k", { retry: { maxTries: 1 } }).get("x"),
      (e: unknown) => e instanceof IdemTransportError && !e.timedOut,
    );
  });

  test("no answer in time: IdemTimeoutError; submit repeats it and then looks the scope up", async () => {
    const { client: direct } = await server.tenant();
    // Reads requests, never answers.
    const sockets: net.Socket[] = [];
    const requests: string[] = [];
    const silent = net.createServer((s) => {
      sockets.push(s);
      s.once("data", (d: Buffer) => {
        const text = d.toString("latin1");
        const idemKey = /\r\nidempotency-key: ([^\r]*)/i.exec(text)?.[1];
        requests.push(text.split(" HTTP/1.1")[0]! + (idemKey ? ` ${idemKey}` : ""));
      });
    });
    await new Promise<void>((r) => silent.listen(0, "127.0.0.1", r));
    try {
      const url = `http://127.0.0.1:${(silent.address() as net.AddressInfo).port}`;
      const client = new Client(url, "k", { timeoutMs: 200, retry: { maxTries: 2, initialBackoffMs: 10 } });
      await assert.rejects(client.get("x"), IdemTimeoutError);
      const k = key();
      const started = Date.now();
      await assert.rejects(client.submit("payment.release", payment(), k), IdemTimeoutError);
      assert.ok(Date.now() - started < 2000);
      assert.deepEqual(requests, [
        "GET /v1/tasks/x",
        `POST /v1/tasks "${k}"`,
        `POST /v1/tasks "${k}"`,
        `GET /v1/tasks?operation=payment.release&idempotency_key=${k}`,
      ]);
      assert.equal((await all(direct.list())).length, 0);
    } finally {
      sockets.forEach((s) => s.destroy());
      await new Promise((r) => silent.close(r));
    }
  });

  test("a key with quotes and backslashes round-trips through the sf-string header", async () => {
    const { client } = await server.tenant();
    const k = `q"uo\\te-${key()}`;
    const s = await client.submit("generation.dispatch", { prompt: "p" }, k);
    assert.equal(s.task.idempotency_key, k);
    assert.equal((await client.find("generation.dispatch", k)).id, s.task.id);
  });

  test("list follows next_cursor pages, newest first, with filters", async () => {
    const { client } = await server.tenant();
    const ids: string[] = [];
    for (let i = 0; i < 5; i++) ids.push((await client.submit("generation.dispatch", { n: i }, `page-${i}`)).task.id);
    await client.submit("payment.release", payment(), "other-class");
    const page = await client.listPage({ operation: "generation.dispatch", limit: 2 });
    assert.equal(page.tasks.length, 2);
    assert.ok(page.nextCursor);
    const listed = await all(client.list({ operation: "generation.dispatch", limit: 2 }));
    assert.deepEqual(
      listed.map((t) => t.id),
      [...ids].reverse(),
    );
    assert.equal((await all(client.list({ state: ["queued"], idempotencyKeyPrefix: "page-" }))).length, 5);
    assert.equal((await all(client.list({ state: "succeeded" }))).length, 0);
    assert.equal((await all(client.list({ createdAfter: new Date(Date.now() + 60_000) }))).length, 0);
  });

  test("events: the history, and live until the terminal event", async () => {
    const { client, executor } = await server.tenant();
    const { task } = await client.submit("payment.release", payment(), key());
    const live = all(client.events(task.id, { live: true }));
    await complete(executor, task.id, { payout: "p-1" });
    const events = await live;
    assert.equal(events.at(-1)?.type, "delivered");
    assert.deepEqual(
      events.map((e) => e.seq),
      events.map((_, i) => i + 1),
    );
    const history = await all(client.events(task.id));
    assert.deepEqual(history.slice(0, events.length), events);
    assert.deepEqual(await all(client.events(task.id, { afterSeq: 1 })), history.slice(1));
    // Past the terminal event with nothing after it: 204, an empty stream.
    assert.deepEqual(await all(client.events(task.id, { live: true, afterSeq: history.at(-1)!.seq })), []);
  });

  test("live events resume after a dropped stream with Last-Event-ID: no gap, no repeat", async () => {
    const { client, executor, clientKey } = await server.tenant();
    const { task } = await client.submit("payment.release", payment(), key());
    // The first stream is cut right after its first event.
    const proxy = await Proxy.start(server.url, [
      {
        match: /^GET \/v1\/tasks\/[^ ]+\/events /,
        times: 1,
        action: "cut",
        cutWhen: (t) => /\ndata:[^\n]*\n\n/.test(t),
      },
    ]);
    try {
      const seen: TaskEvent[] = [];
      const iterator = new Client(proxy.url, clientKey).events(task.id, { live: true });
      const first = await iterator.next();
      assert.equal(first.done, false);
      seen.push(first.value as TaskEvent);
      const rest = (async () => {
        for await (const e of iterator) seen.push(e);
      })();
      await complete(executor, task.id, { payout: "p-2" });
      await rest;
      assert.equal(proxy.applied.length, 1, "the stream was cut once");
      assert.deepEqual(
        seen.map((e) => e.seq),
        seen.map((_, i) => i + 1),
      );
      assert.equal(seen.at(-1)?.type, "delivered");
    } finally {
      await proxy.close();
    }
  });

  test("cancel and delivery acknowledgment", async () => {
    const { client, executor } = await server.tenant();
    const queued = await client.submit("generation.dispatch", { prompt: "x" }, key());
    const c = await client.cancel(queued.task.id);
    assert.equal(c.status, 200);
    assert.equal(c.cancellation.status, "confirmed");
    assert.equal(c.task.state, "cancelled");
    // generation.dispatch names no fee currency: minor units of none.
    assert.equal(c.cancellation.currency, null);

    const { task } = await client.submit("payment.release", payment(), key());
    assert.equal(task.contract.fees.currency, "EUR");
    assert.equal(task.contract.fees.exponent, 2);
    await assert.rejects(client.ackDelivery(task.id), NotDeliveredError);
    await complete(executor, task.id, { payout: "p-3" });
    const acked = await client.ackDelivery(task.id);
    assert.ok(acked.delivery?.acknowledged_at);
    assert.deepEqual(acked.delivery?.result, { payout: "p-3" });
    // The charge stays an integer of minor units; its currency is beside it.
    assert.equal(acked.delivery?.charge, 100);
    assert.equal(acked.delivery?.currency, "EUR");
    assert.equal((await client.ackDelivery(task.id)).delivery?.acknowledged_at, acked.delivery?.acknowledged_at);
  });

  test("a suspected second effect is shown, searched and acknowledged by an admin", async () => {
    const { name, client, executor } = await server.tenant();
    const { task } = await client.submit("payment.release", payment(), key());
    const [a] = await executor.claim({ executorId: "se-1", operations: ["payment.release"], waitMs: 2000 });
    assert.ok(a);
    await executor.report(a.id, { generation: a.generation, outcome: "failed", failure_class: "transient" });
    await assert.rejects(
      executor.report(a.id, { generation: a.generation, outcome: "succeeded", result: {}, external_txn_id: "psp-ts" }),
      AttemptAlreadyReportedError,
    );
    const failed = await client.get(task.id);
    assert.equal(failed.second_effects?.length, 1);
    assert.equal(failed.second_effects?.[0]?.external_txn_id, "psp-ts");
    assert.equal(failed.second_effects?.[0]?.evidence, "duplicate_report");
    assert.deepEqual(
      (await client.listPage({ secondEffect: "unacknowledged" })).tasks.map((t) => t.id),
      [task.id],
    );
    assert.deepEqual(
      (await client.listPage({ externalTxnId: "psp-ts" })).tasks.map((t) => t.id),
      [task.id],
    );
    await assert.rejects(
      client.acknowledgeSecondEffect(task.id, "psp-ts", "refund_issued", "refunded"),
      PermissionDeniedError,
    );
    const admin = new Client(server.url, (await server.key(name, "admin")).key);
    await assert.rejects(admin.acknowledgeSecondEffect(task.id, null, "false_alarm", "none"), NotFoundError);
    const acked = await admin.acknowledgeSecondEffect(task.id, "psp-ts", "refund_issued", "refunded, ticket 9");
    assert.equal(acked.second_effects?.[0]?.acknowledgment?.resolution, "refund_issued");
    assert.equal(acked.second_effects?.[0]?.acknowledgment?.reason, "refunded, ticket 9");
    assert.equal(acked.state, "failed");
    assert.deepEqual((await client.listPage({ secondEffect: "unacknowledged" })).tasks, []);
  });

  test("executor calls: claim, heartbeat, ack, report; a stale generation is typed", async () => {
    const { client, executor } = await server.tenant();
    const { task } = await client.submit("payment.release", payment(), key());
    const [a] = await executor.claim({
      executorId: "exec-1",
      operations: ["payment.release"],
      max: 1,
      leaseMs: 5000,
      waitMs: 1000,
    });
    assert.ok(a);
    assert.equal(a.task_id, task.id);
    assert.equal(a.kind, "execute");
    const hb = await executor.heartbeat(a.id, a.generation, 4);
    assert.equal(hb.cancel_requested, false);
    await executor.ack(a.id, a.generation);
    const stale = await executor
      .report(a.id, { generation: a.generation + 1, outcome: "succeeded" })
      .catch((e: unknown) => e);
    assert.ok(stale instanceof StaleGenerationError, String(stale));
    const done = await executor.report(a.id, {
      generation: a.generation,
      outcome: "succeeded",
      result: { ok: true },
      usage: 4,
    });
    assert.equal(done.state, "succeeded");
    assert.equal(done.usage, 4);
    const waited = await client.get(task.id, { wait: 5 });
    assert.equal(waited.state, "succeeded");
  });
});
