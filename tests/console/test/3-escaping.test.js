// Escaping: a task whose params contain `<script>`, `"><img src=x onerror=…>` and
// `javascript:` values renders them as text; no script runs (checked in the page).
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, test } from "node:test";

import { attemptRows, rawEvents } from "./dom.js";
import { Server, launchBrowser, newPage, signIn } from "./support.js";

// Each payload, if it ever ran, sets window.__pwned and opens a dialog.
const SCRIPT = `<script>window.__pwned=1;alert("script")</script>`;
const IMG = `"><img src=x onerror=window.__pwned=1;alert(1)>`;
const JS_URL = `javascript:window.__pwned=1;alert(1)`;
const SVG = `'><svg/onload=window.__pwned=1>`;
// An idempotency key is visible ASCII without spaces: the same attack without them.
const KEY_PREFIX = `xss"><svg/onload=window.__pwned=1>`;

/** The CSP every /console response carries (brief, DOM contract). */
const CSP =
  "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

let server, browser, t, paid, failed, resolved;
const params = {
  payee: SCRIPT,
  amount: 1250,
  currency: "EUR",
  memo: IMG,
  link: JS_URL,
  note: SVG,
  nested: { href: JS_URL, list: [SCRIPT, IMG] },
};
const executorId = `<img src=x onerror=window.__pwned=1>`;
const result = { html: SCRIPT, href: JS_URL, alt: IMG };

before(async () => {
  [server, browser] = await Promise.all([Server.start(), launchBrowser()]);
  t = await server.tenant("xss");
  const suffix = randomUUID().slice(0, 8);

  // Delivered: hostile params, executor id, result and provider transaction id.
  paid = await t.client.submit("payment.release", `${KEY_PREFIX}-paid-${suffix}`, params);
  const a = await t.executor.claim("payment.release", { executorId });
  assert.equal(a.task_id, paid.id);
  await t.executor.heartbeat(a, 1);
  await t.executor.report(a, { outcome: "succeeded", result, external_txn_id: IMG, usage: 1 });

  // Failed: a hostile failure message.
  failed = await t.client.submit("generation.dispatch", `${KEY_PREFIX}-failed-${suffix}`, { prompt: SCRIPT, url: JS_URL });
  const b = await t.executor.claim("generation.dispatch", { executorId: SVG });
  await t.executor.report(b, { outcome: "failed", failure_class: "invalid_input", message: IMG });

  // Resolved by an operator with a hostile reason, result and transaction id.
  resolved = await t.client.submit("payment.release", `${KEY_PREFIX}-resolved-${suffix}`, { ...params, amount: 99 });
  const c = await t.executor.claim("payment.release", { executorId: JS_URL });
  await t.executor.report(c, { outcome: "unknown", message: SCRIPT });
  await t.admin.resolve(resolved.id, { outcome: "committed", result, external_txn_id: JS_URL, reason: IMG });
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

/**
 * What must hold on every page: no payload became markup (no element carries an event
 * handler attribute, no `img[src=x]`, no script but the console's own, no `javascript:` link),
 * nothing ran (`window.__pwned` unset, no dialog, no error, no CSP violation).
 */
async function assertInert(page, problems, where) {
  // An <img src=x> would fail to load and fire onerror; give it the time to.
  await page.waitForTimeout(150);
  const found = await page.evaluate(() => {
    const handlers = [];
    for (const el of document.querySelectorAll("*"))
      for (const a of el.attributes) if (/^on/i.test(a.name)) handlers.push(`${el.tagName}[${a.name}]`);
    return {
      pwned: window.__pwned,
      handlers,
      imgX: document.querySelectorAll('img[src="x"]').length,
      scripts: [...document.scripts].map((s) => s.getAttribute("src") ?? `inline: ${s.textContent.slice(0, 60)}`),
      jsLinks: [...document.querySelectorAll("[href], [src], [action], [formaction], [xlink\\:href]")]
        .map((e) => e.getAttribute("href") ?? e.getAttribute("src") ?? e.getAttribute("action") ?? "")
        .filter((v) => /^\s*javascript:/i.test(v)),
      csp: window.__cspViolations,
    };
  });
  assert.equal(found.pwned, undefined, `${where}: window.__pwned stayed undefined`);
  assert.deepEqual(found.handlers, [], `${where}: no event-handler attribute in the DOM`);
  assert.equal(found.imgX, 0, `${where}: no <img src=x> element`);
  assert.deepEqual(
    found.scripts.filter((s) => new URL(s, "http://x").pathname !== "/console/static/console.js"),
    [],
    `${where}: no script but /console/static/console.js`,
  );
  assert.deepEqual(found.jsLinks, [], `${where}: no javascript: URL in a link or form`);
  assert.deepEqual(found.csp, [], `${where}: no Content-Security-Policy violation (nothing was even tried)`);
  // A page answered 4xx on purpose is logged by Chromium as a resource that failed to load.
  const here = page.url();
  const console = problems.console.filter((m) => !(/^Failed to load resource: .* 4\d\d /.test(m) && m.endsWith(`(${here})`)));
  assert.deepEqual({ ...problems, console }, { dialogs: [], errors: [], console: [] }, `${where}: no dialog, error or console error`);
}

test("hostile params, key, executor id, result, message and reason render as text; no script runs", async (t1) => {
  const { page, problems } = await newPage(browser);
  await signIn(page, server.url, t.adminKey);

  await t1.test("task page of the delivered payment", async () => {
    const res = await page.goto(`${server.url}/console/tasks/${paid.id}`);
    assert.equal(res.status(), 200);
    await assertInert(page, problems, "delivered task");
    assert.ok((await page.locator("h1").textContent()).includes(paid.idempotency_key), "the key, literally, in <h1>");
    assert.deepEqual(JSON.parse(await page.locator("pre#params").textContent()), params, "params, literally");
    const paramsText = await page.locator("pre#params").textContent();
    for (const s of [SCRIPT, JS_URL, `<img src=x onerror=window.__pwned=1;alert(1)>`, SVG])
      assert.ok(paramsText.includes(s.replace(/"/g, '\\"')), `#params shows ${s} as text`);
    assert.ok((await page.locator("pre#canonical-request").textContent()).includes("<script>"), "canonical request");
    const [row] = await attemptRows(page);
    assert.ok(row.executor.includes(executorId), `executor id as text: ${row.executor}`);
    const delivered = await page.locator("#delivery").textContent();
    assert.ok(delivered.includes("<script>window.__pwned=1"), "the result as text");
    assert.ok(delivered.includes("javascript:window.__pwned=1"), "the result's javascript: value as text");
    const raw = await rawEvents(page);
    assert.ok(raw.length > 0);
    await assertInert(page, problems, "delivered task, raw events open");
  });

  await t1.test("the SVG timeline names the hostile executor id as text", async () => {
    await page.goto(`${server.url}/console/tasks/${paid.id}`);
    await assertInert(page, problems, "delivered task's timeline");
    const svg = page.locator("#timeline svg");
    assert.equal(await svg.count(), 1);
    assert.ok((await svg.textContent()).includes(executorId), "the executor id, literally, in the SVG's text");
    assert.equal(await svg.locator("img, script, foreignObject").count(), 0, "no HTML element inside the SVG");
  });

  await t1.test("task page of the failed task (hostile failure message)", async () => {
    await page.goto(`${server.url}/console/tasks/${failed.id}`);
    await rawEvents(page);
    await assertInert(page, problems, "failed task");
    assert.ok((await page.locator("main").textContent()).includes(`<img src=x onerror=window.__pwned=1;alert(1)>`));
  });

  await t1.test("task page of the operator-resolved task (hostile reason and transaction id)", async () => {
    await page.goto(`${server.url}/console/tasks/${resolved.id}`);
    const raw = await rawEvents(page);
    await assertInert(page, problems, "resolved task");
    const op = raw.find((r) => r.cells.includes("operator_resolved"));
    assert.equal(op?.payload.reason, IMG, "the operator's reason, literally");
  });

  await t1.test("search: the key prefix in the form and the results", async () => {
    const q = new URLSearchParams({ idempotency_key_prefix: KEY_PREFIX, limit: "2" });
    const res = await page.goto(`${server.url}/console/tasks?${q}`);
    assert.equal(res.status(), 200);
    await assertInert(page, problems, "search");
    assert.equal(await page.locator('form#search [name="idempotency_key_prefix"]').inputValue(), KEY_PREFIX);
    assert.equal(await page.locator("table#results tr[data-task-id]").count(), 2);
    const next = await page.locator('a[rel="next"]').getAttribute("href");
    assert.equal(new URL(next, server.url).searchParams.get("idempotency_key_prefix"), KEY_PREFIX, "the next link keeps the prefix, encoded");
    await Promise.all([page.waitForNavigation(), page.locator('a[rel="next"]').click()]);
    await assertInert(page, problems, "search, next page");
    assert.equal(await page.locator("table#results tr[data-task-id]").count(), 1);
  });

  await t1.test("overview (the failed task is listed as needing a person)", async () => {
    await page.goto(`${server.url}/console/overview`);
    await assertInert(page, problems, "overview");
    assert.equal(await page.locator(`#failed-recent a.task-link[href="/console/tasks/${failed.id}"]`).count(), 1);
  });

  await t1.test("a bad filter answers 400 with the value as text", async () => {
    const res = await page.goto(`${server.url}/console/tasks?state=${encodeURIComponent(SCRIPT)}`);
    assert.equal(res.status(), 400);
    await assertInert(page, problems, "400 page");
  });

  await t1.test("headers: Content-Security-Policy without inline script, nosniff, same-origin referrer, no-store", async () => {
    const res = await page.goto(`${server.url}/console/tasks/${paid.id}`);
    const h = res.headers();
    assert.equal(h["content-security-policy"], CSP);
    assert.equal(h["x-content-type-options"], "nosniff");
    assert.equal(h["referrer-policy"], "same-origin");
    assert.match(h["cache-control"] ?? "", /no-store/);
    const inlineStyles = await page.evaluate(() => document.querySelectorAll("[style]").length);
    assert.equal(inlineStyles, 0, "no style= attribute (the CSP would refuse it)");
    for (const [file, type] of [
      ["console.js", /^(text|application)\/javascript/],
      ["console.css", /^text\/css/],
    ]) {
      const r = await page.request.get(`${server.url}/console/static/${file}`);
      assert.equal(r.status(), 200, file);
      assert.match(r.headers()["content-type"] ?? "", type, `${file}: its content type`);
      assert.match(r.headers()["cache-control"] ?? "", /max-age=\d{5,}/, `${file}: a long cache`);
    }
  });
});
