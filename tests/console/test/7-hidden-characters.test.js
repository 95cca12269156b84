// What the console shows is what is stored: every control, bidirectional and invisible
// character (C0 U+0000–001F, DEL, C1 U+0080–009F, U+061C, U+200B–200F, U+2028/2029,
// U+202A–202E, U+2066–2069, U+FEFF) put through the API into params, results, failure
// messages, executor ids, external transaction ids and reasons is shown as a visible escape
// `⟨U+XXXX⟩` on the task page (its text, the timeline's SVG labels and tooltips, the raw
// events, a live update), the search and the overview: never as the raw character in any text
// node, attribute value or the document's title. (Idempotency keys and tenants are visible
// ASCII: the API and `idem keys create` refuse these characters there, checked below.)
import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { rawEvents } from "./dom.js";
import { Server, key, launchBrowser, newPage, signIn } from "./support.js";

const range = (a, b) => Array.from({ length: b - a + 1 }, (_, i) => String.fromCodePoint(a + i));
/** Every listed character. */
const LISTED = [
  ...range(0x00, 0x1f),
  "\u007f",
  ...range(0x80, 0x9f),
  "\u061c",
  ...range(0x200b, 0x200f),
  "\u2028",
  "\u2029",
  ...range(0x202a, 0x202e),
  ...range(0x2066, 0x2069),
  "\ufeff",
];
/** The ones the API takes in executor ids, external transaction ids and reasons (no Cc there). */
const NOT_CONTROL = LISTED.filter((c) => !/\p{Cc}/u.test(c));
const escape = (c) => `⟨U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}⟩`;
/** Each character between two letters, as in a payee `x\u202Egnp.exe`. */
const spell = (chars) => chars.map((c, i) => `${String.fromCharCode(97 + (i % 26))}${c}`).join("") + "z";
const ALL = spell(LISTED);
const SOME = spell(NOT_CONTROL);

let server, browser, t, paid, failing, cancelled;

before(async () => {
  [server, browser] = await Promise.all([Server.start(), launchBrowser()]);
  t = await server.tenant("hidden");
  // Delivered after reconciliation: params, a message, executor ids, the operator's result,
  // external transaction id and reason.
  paid = await t.client.submit("payment.release", key("hidden-paid"), {
    payee: `x\u202egnp.exe ${ALL}`,
    amount: 1250,
    currency: "EUR",
    [ALL]: ALL,
  });
  const a = await t.executor.claim("payment.release", { executorId: `worker ${SOME}` });
  await t.executor.ack(a);
  await t.executor.report(a, { outcome: "unknown", message: ALL });
  await t.admin.resolve(paid.id, {
    outcome: "committed",
    result: { receipt: ALL, [ALL]: 1 },
    external_txn_id: `tx ${SOME}`,
    reason: `checked ${SOME}`,
  });
  // Cancelled by a client with a reason.
  cancelled = await t.client.submit("payment.release", key("hidden-cancel"), { payee: ALL, amount: 1, currency: "EUR" });
  await t.client.cancel(cancelled.id, `no longer wanted ${SOME}`);
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

/**
 * Every string the page holds: each text node (SVG `<text>`, `<title>`, `<desc>` included),
 * each attribute value, each form field's value, the document's title; `pre` and `title`
 * marks the text nodes inside a `<pre>` or an SVG `<title>`, whose line breaks are the
 * layout's (pretty-printed JSON, a tooltip's lines).
 */
async function strings(page) {
  return page.evaluate(() => {
    const out = [{ where: "document.title", text: document.title }];
    const walker = document.createTreeWalker(document.documentElement, NodeFilter.SHOW_ELEMENT | NodeFilter.SHOW_TEXT);
    for (let n = walker.currentNode; n; n = walker.nextNode()) {
      if (n.nodeType === Node.TEXT_NODE) {
        const p = n.parentElement;
        const multiline = !!p.closest("pre") || (p.namespaceURI === "http://www.w3.org/2000/svg" && p.localName === "title");
        out.push({ where: `text in <${p.localName}>`, text: n.data, multiline });
      } else {
        for (const a of n.attributes) out.push({ where: `${n.localName}[${a.name}]`, text: a.value });
        if ("value" in n && typeof n.value === "string") out.push({ where: `${n.localName}.value`, text: n.value });
      }
    }
    return out;
  });
}

/** Asserts that no listed character is on `page` raw, and that each of `expected` shows as its escape. */
async function assertShown(page, what, expected, t1) {
  const all = await strings(page);
  const raw = new Map();
  for (const s of all) {
    for (const c of s.text) {
      if (!LISTED.includes(c)) continue;
      if (c === "\n" && s.multiline) continue;
      raw.set(escape(c), s.where);
    }
  }
  assert.deepEqual([...raw.entries()], [], `${what}: raw characters (escape → where)`);
  const text = all.map((s) => s.text).join(" ");
  const missing = expected.filter((c) => !text.includes(escape(c))).map(escape);
  assert.deepEqual(missing, [], `${what}: escapes shown`);
  t1.diagnostic(`${what}: ${all.length} strings, none raw; ${expected.length} escapes shown`);
}

test("the task page shows every character as its escape: text, timeline SVG, tooltips, raw events", async (t1) => {
  const { context, page } = await newPage(browser);
  await signIn(page, server.url, t.adminKey);
  await page.goto(`${server.url}/console/tasks/${paid.id}`);
  const events = await rawEvents(page);
  assert.ok(events.length > 0 && events.every((e) => !e.payload?.unparsable), "raw events still read as JSON");
  await assertShown(page, "paid task page", LISTED, t1);
  // In the timeline alone: the executor id in its lane, the message and result in tooltips.
  const svg = await page.locator("#timeline svg").evaluate((s) => s.textContent);
  for (const c of LISTED) assert.ok(svg.includes(escape(c)), `the timeline shows ${escape(c)}`);
  assert.ok(svg.includes("x⟨U+202E⟩gnp.exe") || (await page.locator("#params").textContent()).includes("x⟨U+202E⟩gnp.exe"));
  assert.ok((await page.locator("td.executor").first().textContent()).includes("⟨U+202E⟩"));
  assert.ok((await page.locator("dd.external-txn-id").textContent()).includes("⟨U+2066⟩"));

  await page.goto(`${server.url}/console/tasks/${cancelled.id}`);
  await rawEvents(page);
  await assertShown(page, "cancelled task page", NOT_CONTROL, t1);
  await context.close();
});

test("a live update shows the new facts as escapes too", async (t1) => {
  const { context, page } = await newPage(browser);
  await signIn(page, server.url, t.adminKey);
  failing = await t.client.submit("generation.dispatch", key("hidden-live"), { prompt: ALL });
  const a = await t.executor.claim("generation.dispatch", { executorId: `gpu ${SOME}` });
  await page.goto(`${server.url}/console/tasks/${failing.id}`);
  await page.locator('#task-state[data-state="running"]').waitFor();
  await t.executor.report(a, { outcome: "failed", failure_class: "invalid_input", message: ALL });
  // Swapped in by the page's script from the fragment, without a reload.
  await page.locator('#task-state[data-state="failed"]').waitFor({ timeout: 10_000 });
  assert.ok((await page.locator("#failure").textContent()).includes("⟨U+202E⟩"));
  await rawEvents(page);
  await assertShown(page, "task page after a live update", LISTED, t1);
  await context.close();
});

test("the search and the overview show no raw character; search fields and errors show escapes; keys and tenants refuse them", async (t1) => {
  const { context, page } = await newPage(browser);
  await signIn(page, server.url, t.adminKey);
  await page.goto(`${server.url}/console/tasks?${new URLSearchParams({ external_txn_id: `tx ${SOME}` })}`);
  await assertShown(page, "search by external transaction id", NOT_CONTROL, t1);
  await page.goto(`${server.url}/console/tasks?${new URLSearchParams({ idempotency_key_prefix: "hidden-" })}`);
  assert.ok((await page.locator("tr[data-task-id]").count()) >= 2);
  await assertShown(page, "search by key prefix", [], t1);
  const res = await page.goto(`${server.url}/console/tasks?${new URLSearchParams({ operation: `pay${SOME}` })}`);
  assert.equal(res.status(), 400);
  await assertShown(page, "search error naming the operation", NOT_CONTROL, t1);
  await page.goto(`${server.url}/console/overview`);
  await assertShown(page, "overview", [], t1);
  await context.close();

  // What the search results and the overview show of a task is its idempotency key (and the
  // tenant): visible ASCII, which holds none of these characters.
  // A header value is Latin-1 at most (fetch refuses the others before sending); the server
  // refuses the controls among them.
  for (const c of ["\u0001", "\u007f", "\u0085", "\u00ad"]) {
    const sent = await fetch(`${server.url}/v1/tasks`, {
      method: "POST",
      headers: { authorization: `Bearer ${t.clientKey}`, "content-type": "application/json", "idempotency-key": `k${c}x` },
      body: JSON.stringify({ operation: "payment.release", params: { payee: "p", amount: 1, currency: "EUR" } }),
    }).catch((e) => e);
    assert.ok(sent instanceof Error || sent.status === 400, `a key with ${escape(c)} is refused`);
  }
  await assert.rejects(server.createKey("acme\u202eX", "client"));
});
