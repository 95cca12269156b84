/**
 * The console's screenshots for docs/console.md: a fresh `idem serve` on SQLite, a tenant
 * `acme-payments` with a working day of tasks (scenarios.js) and a payment reconciled by an
 * operator, signed in as its admin; full-page PNGs 1280 px wide of
 * - overview.png: /console/overview (reconciling threshold 1 s, so that the reconciling
 *   payments are listed as needing a person);
 * - search.png: /console/tasks, payments, 10 a page;
 * - task-reconciled.png: the reconciled payment's task page;
 * - task-double-payout.png: a double payout's task page (a stale report's po_A beside the
 *   delivered po_B: the verdict's suspected second effect, with the acknowledge form);
 * - task-too-late.png: a cancellation that lost to delivery (one charge, the fee is that charge);
 * - task-reconciling.png: a working day's payment reconciling after its executor's "provider
 *   answered 504".
 * Written to env IDEM_CONSOLE_SCREENSHOTS_DIR, default docs/console under the repository root.
 * Run through scripts/screenshots.sh (which cleans up whatever happens).
 */
import { mkdir } from "node:fs/promises";
import path from "node:path";

import { doublePayout, reconciledPayment, tooLateCancel, workingDay } from "../test/scenarios.js";
import { Server, launchBrowser, newPage, payment, repoRoot, signIn } from "../test/support.js";

const out = path.resolve(process.env.IDEM_CONSOLE_SCREENSHOTS_DIR ?? path.join(repoRoot, "docs/console"));
const WIDTH = 1280;

const server = await Server.start();
let browser;
try {
  browser = await launchBrowser();
  const t = await server.tenantNamed("acme-payments");
  const reconciled = await reconciledPayment(t, "payout-2026-12-0417", payment(125_000, { payee: "acct-7731" }));
  const double = await doublePayout(t, "payout-2026-12-0502", payment(48_000, { payee: "acct-2209" }));
  const late = await tooLateCancel(t, "payout-2026-12-0503", payment(2_500, { payee: "acct-5120" }));
  const { byState } = await workingDay(t, "acme");
  // Listed under "needs attention" from 1 s on.
  await new Promise((r) => setTimeout(r, 1200));

  const { page } = await newPage(browser, { width: WIDTH, height: 800 });
  await signIn(page, server.url, t.adminKey);
  await mkdir(out, { recursive: true });
  const shots = [
    ["overview.png", "/console/overview?reconciling_after=1"],
    ["search.png", `/console/tasks?${new URLSearchParams({ operation: "payment.release", limit: "10" })}`],
    ["task-reconciled.png", `/console/tasks/${reconciled.id}`],
    ["task-double-payout.png", `/console/tasks/${double.task.id}`],
    ["task-too-late.png", `/console/tasks/${late.id}`],
    ["task-reconciling.png", `/console/tasks/${byState.reconciling[0].id}`],
  ];
  for (const [file, p] of shots) {
    const res = await page.goto(`${server.url}${p}`);
    if (res.status() !== 200) throw new Error(`${p} answered ${res.status()}`);
    await page.evaluate(() => document.fonts.ready);
    await page.screenshot({ path: path.join(out, file), fullPage: true });
    console.log(`${path.relative(process.cwd(), path.join(out, file))}: ${p}`);
  }
} finally {
  await browser?.close();
  await server.stop();
}
