// Accessibility: axe-core finds no serious or critical accessibility violations on the four
// pages: sign-in, overview, search, and the task page (of a reconciled payment, so that the
// timeline has every kind of mark); also on a task page showing the admin's action forms, and on
// a double payout's, whose verdict shows a suspected second effect with its acknowledge form.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import AxeBuilder from "@axe-core/playwright";

import { doublePayout, reconciledPayment, workingDay } from "./scenarios.js";
import { Server, key, launchBrowser, newPage, reconcilingPayment, signIn } from "./support.js";

let server, browser, t, reconciled, reconciling, double;

before(async () => {
  [server, browser] = await Promise.all([Server.start(), launchBrowser()]);
  t = await server.tenant("a11y");
  reconciled = await reconciledPayment(t, key("payout"));
  double = (await doublePayout(t, key("double"))).task;
  // Its reconcile attempt leased, so that the working day's claims cannot take it.
  reconciling = (await reconcilingPayment(t, key("open"), { reconcileClaimed: true })).task;
  await workingDay(t, "day");
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

/** axe-core's violations of impact serious or critical, each with where it was found. */
async function seriousViolations(page, t1, name) {
  const { violations } = await new AxeBuilder({ page }).analyze();
  const lines = violations.map(
    (v) => `${v.impact} ${v.id}: ${v.help} (${v.nodes.length}×, e.g. ${v.nodes[0]?.target.join(" ")})`,
  );
  t1.diagnostic(`${name}: ${violations.length} violation(s) of any impact${lines.length ? "; " + lines.join("; ") : ""}`);
  const found = violations
    .filter((v) => v.impact === "serious" || v.impact === "critical")
    .map((v) => ({
      id: v.id,
      impact: v.impact,
      help: v.help,
      nodes: v.nodes.slice(0, 5).map((n) => `${n.target.join(" ")}: ${n.failureSummary}`),
    }));
  // axe 4.13 no longer reports duplicate ids; an aria-labelledby that names one is ambiguous.
  const dupes = await page.evaluate(() => {
    const ids = [...document.querySelectorAll("[id]")].map((e) => e.id);
    return [...new Set(ids.filter((x, i) => ids.indexOf(x) !== i))];
  });
  if (dupes.length > 0)
    found.push({ id: "duplicate-id", impact: "serious", help: "ids must be unique", nodes: dupes.map((d) => `#${d}`) });
  return found;
}

test("sign-in page", async (t1) => {
  const { page, context } = await newPage(browser);
  await page.goto(`${server.url}/console/sign-in`);
  assert.deepEqual(await seriousViolations(page, t1, "sign-in"), []);
  // With its error message shown, too.
  await page.fill("#api_key", "idem_wrong");
  await Promise.all([page.waitForNavigation(), page.locator('#sign-in button[type="submit"], #sign-in input[type="submit"], #sign-in button:not([type])').first().click()]);
  assert.deepEqual(await seriousViolations(page, t1, "sign-in with an error"), []);
  await context.close();
});

describe("signed in as an admin", () => {
  let page, context;
  before(async () => {
    ({ page, context } = await newPage(browser));
    await signIn(page, server.url, t.adminKey);
  });
  after(() => context?.close());

  test("overview", async (t1) => {
    await page.goto(`${server.url}/console/overview`);
    assert.ok((await page.locator("table#by-state tr[data-operation]").count()) >= 2, "both classes are on the overview");
    assert.equal(await page.locator("table#queues caption").count(), 1, "the queues table is on the overview");
    assert.deepEqual(await seriousViolations(page, t1, "overview"), []);
  });

  test("search", async (t1) => {
    await page.goto(`${server.url}/console/tasks?${new URLSearchParams({ operation: "payment.release", limit: "10" })}`);
    assert.ok((await page.locator("table#results tr[data-task-id]").count()) > 0);
    assert.deepEqual(await seriousViolations(page, t1, "search"), []);
  });

  test("task page of a reconciled payment (full timeline), then with its raw events open", async (t1) => {
    await page.goto(`${server.url}/console/tasks/${reconciled.id}`);
    assert.equal(await page.locator("#task-state").getAttribute("data-state"), "succeeded");
    const closed = await seriousViolations(page, t1, "task page, reconciled payment");
    await page.locator("details#raw-events summary").click();
    const open = await seriousViolations(page, t1, "task page, raw events open");
    assert.deepEqual({ closed, open }, { closed: [], open: [] });
    assert.ok((await page.locator("#timeline svg g.lane").count()) >= 2, "the timeline was full (a lane per attempt)");
  });

  test("task page of a double payout: the verdict's suspected second effect and its form, the contract open", async (t1) => {
    await page.goto(`${server.url}/console/tasks/${double.id}`);
    assert.equal(await page.locator('#verdict-suspected form[data-action="acknowledge-effect"]').count(), 1);
    const closed = await seriousViolations(page, t1, "task page, double payout");
    await page.locator("details#contract summary").click();
    const open = await seriousViolations(page, t1, "task page, contract open");
    assert.deepEqual({ closed, open }, { closed: [], open: [] });
  });

  test("task page with the admin's action forms", async (t1) => {
    await page.goto(`${server.url}/console/tasks/${reconciling.id}`);
    assert.ok((await page.locator("form.action").count()) > 0, "the admin's action forms are shown");
    assert.deepEqual(await seriousViolations(page, t1, "task page with action forms"), []);
  });
});
