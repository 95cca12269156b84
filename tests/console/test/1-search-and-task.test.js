// Search and the task page: sign in, search by state and by idempotency key prefix, open a task, and see
// the same attempts, generations and events the API returns.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, test } from "node:test";

import { attemptRows, lanes, rawEvents, resultIds, results, setField, submitForm, taskState } from "./dom.js";
import { Server, launchBrowser, newPage, payment, reconcilingPayment, retriedDispatch, signIn } from "./support.js";

let server, browser, t, prefix, dispatch, reconciling, queued1, queued2;

before(async () => {
  [server, browser] = await Promise.all([Server.start(), launchBrowser()]);
  t = await server.tenant("search");
  prefix = `inv-${randomUUID().slice(0, 8)}`;
  // Executed ones first: a claim takes any queued task of its class in the tenant.
  dispatch = await retriedDispatch(t, `${prefix}-dispatch-1`);
  reconciling = (await reconcilingPayment(t, `${prefix}-pay-r`)).task;
  queued1 = await t.client.submit("payment.release", `${prefix}-pay-1`, payment(500));
  queued2 = await t.client.submit("payment.release", `other-${randomUUID().slice(0, 8)}-pay-2`, payment(700));
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

test("sign in, search by state and by key prefix, open a task: attempts, generations and events as the API has them", async (t1) => {
  const { page, problems } = await newPage(browser);
  await signIn(page, server.url, t.clientKey);
  assert.equal((await page.locator("#tenant").textContent()).trim(), t.name);
  assert.equal((await page.locator("#role").textContent()).trim(), "client");

  // Search by state, through the form.
  await page.locator("nav").getByRole("link", { name: /tasks/i }).first().click();
  await page.waitForURL((u) => u.pathname === "/console/tasks");
  let form = page.locator("form#search");
  await setField(form, "state", "queued");
  await submitForm(page, form);
  assert.deepEqual(new URL(page.url()).searchParams.getAll("state").join(","), "queued");
  const byState = (await t.client.search({ state: "queued" })).tasks.map((x) => x.id);
  assert.deepEqual(byState, [queued2.id, queued1.id], "the API's own answer (setup check)");
  assert.deepEqual(await resultIds(page), byState, "search by state: the same tasks, in the same order, as GET /v1/tasks");
  for (const r of await results(page)) assert.equal(r.state, "queued");

  // Search by idempotency key prefix, from a clean form.
  await page.goto(`${server.url}/console/tasks`);
  form = page.locator("form#search");
  await setField(form, "idempotency_key_prefix", prefix);
  await submitForm(page, form);
  assert.equal(new URL(page.url()).searchParams.get("idempotency_key_prefix"), prefix);
  const byPrefix = (await t.client.search({ idempotency_key_prefix: prefix })).tasks;
  assert.deepEqual(
    byPrefix.map((x) => x.id),
    [queued1.id, reconciling.id, dispatch.id],
  );
  const rows = await results(page);
  assert.deepEqual(
    rows.map((r) => r.id),
    byPrefix.map((x) => x.id),
    "search by key prefix: as GET /v1/tasks",
  );
  for (const [i, r] of rows.entries()) {
    assert.equal(r.state, byPrefix[i].state, `state of ${r.id}`);
    assert.ok(r.text.includes(byPrefix[i].idempotency_key), `row ${r.id} shows its idempotency key`);
    assert.equal(r.link, `/console/tasks/${r.id}`);
  }

  // Pages: the shareable URL with limit=2, then rel=next.
  await page.goto(`${server.url}/console/tasks?${new URLSearchParams({ idempotency_key_prefix: prefix, limit: "2" })}`);
  const first = await resultIds(page);
  await Promise.all([page.waitForNavigation(), page.locator('a[rel="next"]').click()]);
  const second = await resultIds(page);
  assert.deepEqual([...first, ...second], byPrefix.map((x) => x.id), "two pages hold the listing once");
  assert.equal(await page.locator('a[rel="next"]').count(), 0, "no next link on the last page");

  // Open each task from the search and compare with the API.
  for (const task of [dispatch, reconciling]) {
    await page.goto(`${server.url}/console/tasks?${new URLSearchParams({ idempotency_key_prefix: prefix })}`);
    await Promise.all([
      page.waitForURL((u) => u.pathname === `/console/tasks/${task.id}`),
      page.locator(`tr[data-task-id="${task.id}"] a.task-link`).click(),
    ]);
    const api = await t.client.task(task.id);
    assert.ok((await page.locator("h1").textContent()).includes(api.idempotency_key));
    assert.equal(await taskState(page), api.state);
    assert.equal((await page.locator("#fingerprint").textContent()).trim(), api.fingerprint);
    assert.deepEqual(JSON.parse(await page.locator("pre#params").textContent()), api.params);

    const attempts = await t.client.attempts(task.id);
    const shown = await attemptRows(page);
    assert.equal(shown.length, attempts.length, "one row per attempt");
    for (const [i, a] of attempts.entries()) {
      const row = shown[i];
      assert.equal(row.id, a.id, `attempt ${a.number}: id`);
      assert.equal(row.number, String(a.number), `attempt ${a.number}: number`);
      assert.equal(row.generation, String(a.generation), `attempt ${a.number}: generation`);
      assert.match(row.kind, new RegExp(`\\b${a.kind}\\b`), `attempt ${a.number}: kind`);
      assert.ok(row.executor.includes(a.executor_id), `attempt ${a.number}: executor ${a.executor_id} in ${row.executor}`);
      assert.match(row.outcome, new RegExp(`\\b${a.state}\\b`), `attempt ${a.number}: outcome`);
    }

    const events = await t.client.events(task.id);
    const raw = await rawEvents(page);
    assert.deepEqual(
      raw.map((r) => r.id),
      events.map((e) => String(e.seq)),
      "raw events: one row per event, data-event-id = seq, in order",
    );
    for (const [i, e] of events.entries()) {
      assert.ok(raw[i].cells.some((c) => c.includes(e.type)), `event ${e.seq} shows its type ${e.type}`);
      assert.deepEqual(raw[i].payload, e.data, `event ${e.seq} (${e.type}): its JSON payload`);
    }

    await t1.test(`timeline of ${api.operation}: one lane per attempt with its generation and kind`, async () => {
      assert.equal(await page.locator('#timeline svg[role="img"]').count(), 1);
      assert.deepEqual(
        await lanes(page),
        attempts.map((a) => ({ id: a.id, generation: String(a.generation), kind: a.kind })),
      );
    });
  }
  assert.deepEqual(problems, { dialogs: [], errors: [], console: [] });
});
