// The task page's verdict block on incident fixtures: each states the answer as text before the
// timeline — a cancellation that lost to delivery shows one charge and says its fee is that same
// charge; a reconciling payment shows the executor's message and says to check the provider, then
// resolve; a failed payment says why and that a redrive applies, then shows the redrive; a double
// payout's attempts table shows the stale report's transaction id. Attempt counts agree between the
// task page, the search and the overview; times show the viewer's offset beside UTC; the frozen
// contract is collapsed below the timeline.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, test } from "node:test";

import { act } from "./dom.js";
import { doublePayout, failedPayment, timedOutPayment, tooLateCancel } from "./scenarios.js";
import { Server, launchBrowser, liveDone, moneyText, newPage, signIn } from "./support.js";

let server, browser, t, tf, prefix, late, timedOut, failed, double;

before(async () => {
  [server, browser] = await Promise.all([Server.start(), launchBrowser()]);
  // The redriven payment has a tenant of its own: its claims must not take the reconciling
  // payment's reconcile attempt.
  [t, tf] = await Promise.all([server.tenant("verdict"), server.tenant("redrive")]);
  prefix = `incident-${randomUUID().slice(0, 8)}`;
  // One at a time, the reconciling one last: a claim takes any claimable task of its class in
  // the tenant.
  failed = await failedPayment(tf, `${prefix}-failed`);
  late = await tooLateCancel(t, `${prefix}-late`);
  double = await doublePayout(t, `${prefix}-double`);
  timedOut = await timedOutPayment(t, `${prefix}-timeout`);
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

/** Whitespace-collapsed text of `sel` on `page`. */
async function text(page, sel) {
  return (await page.locator(sel).textContent()).replace(/\s+/g, " ").trim();
}

async function openTask(page, id) {
  const res = await page.goto(`${server.url}/console/tasks/${id}`);
  assert.equal(res.status(), 200);
}

test("a cancellation that lost to delivery: one charge, and the fee is that same charge", async () => {
  const { page, problems } = await newPage(browser);
  await signIn(page, server.url, t.clientKey);
  const api = await t.client.task(late.id);
  assert.equal(api.cancellation.status, "too_late", "setup: the cancellation lost");
  assert.equal(api.cancellation.fee, api.delivery.charge, "setup: its fee is the charge");
  await openTask(page, late.id);
  const charge = moneyText(api.delivery.charge, api.contract);

  assert.match(await text(page, "#verdict-answer"), new RegExp(`^Charged once: ${charge}, po_C, \\d{4}-\\d\\d-\\d\\dT`));
  assert.equal(
    await text(page, "#verdict-effects"),
    "1 execute attempt started: the provider was asked 1 time; 1 delivered",
  );
  assert.match(
    await text(page, "#verdict-next"),
    new RegExp(`came too late, the delivery won\\. Its fee is that same charge \\(${charge}\\), not a second charge\\.$`),
  );
  // The cancellation names no second amount.
  assert.equal(await text(page, "#cancellation .fee"), "the delivery's charge above, not a second charge");
  const delivery = await text(page, "#delivery");
  assert.equal(delivery.split(charge).length - 1, 1, `the charge appears once in Delivery: ${delivery}`);
  assert.deepEqual(problems, { dialogs: [], errors: [], console: [] });
});

test("a reconciling payment: the executor's message, and check the provider, then resolve", async () => {
  const { page, problems } = await newPage(browser);
  await signIn(page, server.url, t.adminKey);
  await openTask(page, timedOut.task.id);
  assert.equal(await page.locator("#verdict").getAttribute("data-state"), "reconciling");
  assert.match(await text(page, "#verdict-answer"), /^Outcome unknown: the provider may or may not have carried out execute attempt 1\.$/);
  assert.match(
    await text(page, "#verdict-message"),
    /^PSP timed out after 30s — attempt 1 \(payout-worker-1\), reported unknown at \d{4}-/,
  );
  const next = await text(page, "#verdict-next");
  assert.match(next, /^Reconciling for less than a minute: check the provider for this payment \(attempt ids sent to it: /);
  assert.ok(next.includes(timedOut.attempt.id), `the attempt id to quote to the provider: ${next}`);
  assert.match(next, /then resolve: committed if it paid \(delivered once, charged .+\), not committed if it did not\.$/);
  // The attempts table shows the message too, not only the raw JSON.
  assert.equal(await text(page, `tr[data-attempt-id="${timedOut.attempt.id}"] td.message`), "PSP timed out after 30s");
  assert.deepEqual(problems, { dialogs: [], errors: [], console: [] });
});

test("a failed payment: why, redrive applies; redriven from the page: queued, then charged once", async () => {
  const { page, problems } = await newPage(browser);
  await signIn(page, server.url, tf.adminKey);
  await openTask(page, failed.task.id);
  assert.equal(await text(page, "#verdict-answer"), "Failed (transient): nothing delivered, nothing charged.");
  assert.match(
    await text(page, "#verdict-next"),
    /^Why: PSP answered 503\. Redrive applies: it sends the task back to the queue with one more execute attempt \(1 of 3 used, the limit becomes 4\); check the provider first that no attempt paid\.$/,
  );
  assert.match(await text(page, "#verdict-message"), /^PSP answered 503 — attempt 1 \(payout-worker-1\), reported failed at /);

  const res = await act(page, "redrive", { reason: "PSP incident over; payout never reached it" });
  assert.equal(res.status(), 200);
  assert.equal(new URL(page.url()).pathname, `/console/tasks/${failed.task.id}`);
  assert.equal(await text(page, "#verdict-answer"), "Queued: waiting for an executor to claim execute attempt 2 of 4.");
  assert.match(
    await text(page, "#verdict-next"),
    new RegExp(`^Redriven at \\S+ \\(.*\\) \\(api key ${tf.adminKeyId}: PSP incident over; payout never reached it\\)\\. Nothing to do: it waits for an executor of class payment\\.release\\.$`),
  );

  const a2 = await tf.executor.claim("payment.release", { executorId: "payout-worker-2" });
  assert.equal(a2.task_id, failed.task.id);
  await tf.executor.report(a2, { outcome: "succeeded", result: { payout_id: "po_D" }, external_txn_id: "po_D" });
  await openTask(page, failed.task.id);
  const api = await tf.client.task(failed.task.id);
  assert.match(await text(page, "#verdict-answer"), new RegExp(`^Charged once: ${moneyText(api.delivery.charge, api.contract)}, po_D, `));
  assert.equal(
    await text(page, "#verdict-effects"),
    "2 execute attempts started: the provider was asked 2 times; 1 delivered",
  );
  assert.equal(await text(page, "#attempt-count"), "2 attempts: 2 of 4 execute");
  assert.deepEqual(problems, { dialogs: [], errors: [], console: [] });
});

test("a double payout: each attempt's reported transaction ids, the stale report's included", async () => {
  const { page, problems } = await newPage(browser);
  await signIn(page, server.url, t.clientKey);
  await openTask(page, double.task.id);
  const ids = (attemptId) =>
    page
      .locator(`tr[data-attempt-id="${attemptId}"] td.txn li.txn-id`)
      .evaluateAll((lis) => lis.map((li) => ({ id: li.dataset.txnId, keptAs: li.dataset.keptAs ?? null, text: li.textContent.replace(/\s+/g, " ").trim() })));
  const first = await ids(double.first.id);
  assert.deepEqual(
    first.map(({ id, keptAs }) => ({ id, keptAs })),
    [{ id: "po_A", keptAs: "stale_generation" }],
    "attempt 1: its late report's po_A, kept as stale evidence",
  );
  assert.match(first[0].text, /^po_A — stale report \(generation 1\)$/);
  assert.deepEqual(await ids(double.second.id), [{ id: "po_B", keptAs: null, text: "po_B" }]);
  const api = await t.client.task(double.task.id);
  assert.match(await text(page, "#verdict-answer"), new RegExp(`^Charged once: ${moneyText(api.delivery.charge, api.contract)}, po_B, `));
  assert.match(await text(page, "#verdict-effects"), /^2 execute attempts started: the provider was asked 2 times; 1 delivered\b/);
  // The newest message is the timeout's: the late success carried none.
  assert.match(await text(page, "#verdict-message"), /^PSP timed out after 30s — attempt 1 \(payout-worker-1\), reported unknown at /);
  assert.deepEqual(problems, { dialogs: [], errors: [], console: [] });
});

test("a double payout: the suspected second effect in red with its evidence; acknowledged from the verdict", async () => {
  const { page, problems } = await newPage(browser);
  await signIn(page, server.url, t.adminKey);
  const api = await t.client.task(double.task.id);
  assert.deepEqual(
    api.second_effects.map((e) => [e.external_txn_id, e.evidence, e.acknowledgment]),
    [["po_A", "stale_report", null]],
    "setup: the API suspects po_A",
  );
  await openTask(page, double.task.id);
  const charge = moneyText(api.delivery.charge, api.contract);
  assert.equal(await page.locator("#verdict").getAttribute("data-suspected"), "1");
  assert.match(
    await text(page, "#verdict-answer"),
    new RegExp(`^Charged once: ${charge}, po_B, \\S+ .*\\. A second effect is suspected: po_A\\.$`),
  );
  assert.equal(
    await text(page, "#verdict-effects"),
    "2 execute attempts started: the provider was asked 2 times; 1 delivered; 1 suspected second effect",
  );
  const effect = page.locator('#verdict-suspected li.second-effect[data-txn-id="po_A"]');
  assert.match(
    (await effect.locator("p.effect").textContent()).replace(/\s+/g, " ").trim(),
    new RegExp(
      `^The provider may have carried out this payment\\.release twice: po_A besides the delivered po_B \\(charged once, ${charge}\\)\\. ` +
        "Evidence: a stale report \\(from a generation that no longer held the lease\\) of attempt 1 \\(generation 1\\), suspected at ",
    ),
  );
  await liveDone(page);
  assert.equal(await effect.getAttribute("class"), "second-effect suspected");
  assert.equal(
    await effect.evaluate((li) => getComputedStyle(li).color),
    "rgb(168, 7, 26)",
    "in red while not acknowledged",
  );
  assert.match(
    await text(page, "#verdict-next"),
    /^Check the provider for po_A: if it paid twice, refund and acknowledge refund issued; otherwise acknowledge provider deduplicated or false alarm\. The task itself: Nothing to do/,
  );

  // The search finds it by the stale report's id and by the filter, with its ids and amount.
  const search = async (query) => {
    await page.goto(`${server.url}/console/tasks?${new URLSearchParams(query)}`);
    return page.locator("table#results tr[data-task-id]").evaluateAll((rows) => rows.map((r) => r.dataset.taskId));
  };
  assert.deepEqual(await search({ external_txn_id: "po_A" }), [double.task.id]);
  assert.deepEqual(await search({ second_effect: "suspected", idempotency_key_prefix: prefix }), [double.task.id]);
  assert.deepEqual(await search({ second_effect: "unacknowledged", idempotency_key_prefix: prefix }), [double.task.id]);
  assert.equal(await page.locator("select#second_effect").inputValue(), "unacknowledged");
  const row = `tr[data-task-id="${double.task.id}"]`;
  assert.equal(await text(page, `${row} td.txns`), "po_B delivered po_A suspected second effect");
  assert.equal(await text(page, `${row} td.display[data-field="payee"]`), "acct-double");
  assert.equal(await text(page, `${row} td.display[data-field="amount"]`), moneyText(100, api.contract));

  // A forged acknowledgment (no CSRF token) changes nothing.
  await openTask(page, double.task.id);
  // (Through the context's request API: the session's cookie, no page behind it.)
  const forged = await page.request.post(`${server.url}/console/tasks/${double.task.id}/actions/acknowledge-effect`, {
    form: { external_txn_id: "po_A", resolution: "false_alarm", reason: "forged", confirm: "yes" },
    headers: { origin: server.url },
    maxRedirects: 0,
  });
  assert.equal(forged.status(), 403);
  assert.equal((await t.client.task(double.task.id)).second_effects[0].acknowledgment, null);

  // The admin acknowledges it from the verdict.
  await liveDone(page);
  const form = effect.locator('form[data-action="acknowledge-effect"]');
  await form.locator('input[name="resolution"][value="refund_issued"]').check();
  await form.locator('textarea[name="reason"]').fill("PSP refunded po_A, ticket R-1042");
  await form.locator('input[name="confirm"]').check();
  const [res] = await Promise.all([page.waitForNavigation({ waitUntil: "load" }), form.locator("button").click()]);
  assert.equal(res.status(), 200);
  const ack = (await t.client.task(double.task.id)).second_effects[0].acknowledgment;
  assert.equal(ack.resolution, "refund_issued");
  assert.equal(ack.reason, "PSP refunded po_A, ticket R-1042");
  assert.equal(await page.locator("#verdict").getAttribute("data-suspected"), "0");
  assert.match(
    await text(page, '#verdict-suspected li[data-txn-id="po_A"] p.acknowledgment'),
    new RegExp(`^Acknowledged refund issued by api key ${t.adminKeyId} at \\S+ .*: PSP refunded po_A, ticket R-1042$`),
  );
  assert.equal(await page.locator('#verdict-suspected form[data-action="acknowledge-effect"]').count(), 0);
  assert.doesNotMatch(await text(page, "#verdict-next"), /Check the provider/);
  assert.deepEqual(await search({ second_effect: "unacknowledged", idempotency_key_prefix: prefix }), []);
  assert.deepEqual(await search({ second_effect: "suspected", idempotency_key_prefix: prefix }), [double.task.id]);
  assert.deepEqual(problems, { dialogs: [], errors: [], console: [] });
});

test("the verdict opens the page; the timeline follows; the frozen contract is collapsed below it", async () => {
  const { page } = await newPage(browser);
  await signIn(page, server.url, t.clientKey);
  await openTask(page, double.task.id);
  const order = await page.evaluate(() => {
    const body = document.getElementById("task-body");
    const ids = ["verdict", "timeline", "contract", "raw-events"];
    return {
      first: body.firstElementChild.id,
      positions: ids.map((id) => [...body.querySelectorAll("[id]")].indexOf(document.getElementById(id))),
      contractOpen: document.getElementById("contract").open,
      contractTag: document.getElementById("contract").tagName.toLowerCase(),
    };
  });
  assert.equal(order.first, "verdict");
  assert.deepEqual([...order.positions].sort((a, b) => a - b), order.positions, "verdict, timeline, contract, raw events in order");
  assert.equal(order.contractTag, "details");
  assert.equal(order.contractOpen, false);
  // The verdict and the top of the timeline fit the first screen (900 px).
  // (Read in one go: the live stream's last refresh may swap the task's body meanwhile.)
  const top = await page.evaluate(() => document.getElementById("timeline").getBoundingClientRect().top);
  assert.ok(top < 900, `the timeline starts at ${top} px`);
});

test("attempt counts agree on the task page, the search and the overview", async () => {
  const { page } = await newPage(browser);
  await signIn(page, server.url, t.clientKey);
  const tasks = [late, timedOut.task, double.task];
  const pageCounts = {};
  for (const task of tasks) {
    await openTask(page, task.id);
    pageCounts[task.id] = await text(page, "#attempt-count");
    const api = await t.client.task(task.id);
    assert.ok(pageCounts[task.id].startsWith(`${api.attempt_count} attempt`), `${pageCounts[task.id]} counts attempt_count ${api.attempt_count}`);
  }
  await page.goto(`${server.url}/console/tasks?${new URLSearchParams({ idempotency_key_prefix: prefix })}`);
  for (const task of tasks) {
    const row = await text(page, `tr[data-task-id="${task.id}"] td.attempts`);
    assert.ok(pageCounts[task.id].startsWith(row), `search "${row}" vs task page "${pageCounts[task.id]}"`);
  }
  await page.goto(`${server.url}/console/overview?reconciling_after=0`);
  const listed = await text(page, `#reconciling-long li:has(a[href="/console/tasks/${timedOut.task.id}"]) .attempts`);
  assert.ok(pageCounts[timedOut.task.id].startsWith(listed), `overview "${listed}" vs task page "${pageCounts[timedOut.task.id]}"`);
});

test("times show the viewer's local time and offset beside UTC", async () => {
  const { page } = await newPage(browser, { timezoneId: "Asia/Kolkata" });
  await signIn(page, server.url, t.clientKey);
  await openTask(page, late.id);
  const shown = await page.locator("#delivery .delivered-at").evaluate((dd) => ({
    utc: dd.querySelector("time").getAttribute("datetime"),
    utcText: dd.querySelector("time").textContent,
    local: dd.querySelector(".local-time")?.textContent,
  }));
  assert.equal(shown.utcText, shown.utc, "UTC, server-rendered");
  const at = new Date(shown.utc).getTime() + 330 * 60_000;
  const d = new Date(at);
  const two = (n) => String(n).padStart(2, "0");
  const clock = `${two(d.getUTCHours())}:${two(d.getUTCMinutes())}:${two(d.getUTCSeconds())}.${String(d.getUTCMilliseconds()).padStart(3, "0")}`;
  const date = `${d.getUTCFullYear()}-${two(d.getUTCMonth() + 1)}-${two(d.getUTCDate())}`;
  const want = `${date === shown.utc.slice(0, 10) ? "" : `${date} `}${clock} UTC+05:30`;
  assert.equal(shown.local, want);
  // Every <time> got its local time.
  const missing = await page.locator("time[datetime]:not([data-local])").count();
  assert.equal(missing, 0);
});
