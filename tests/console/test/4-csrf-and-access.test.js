// CSRF and access: a form posted without its CSRF token, with another session's token, or by a
// client key → 403 and nothing changes; another tenant's task id → 404; a signed-out session
// cannot reach any page. The crafted posts go through the browser's own request context
// (page.request: the context's cookies, as a forged form would carry them).
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, test } from "node:test";

import { taskState } from "./dom.js";
import { Server, csrfOf, key, launchBrowser, newPage, payment, reconcilingPayment, signIn } from "./support.js";

let server, browser, t, other;

before(async () => {
  [server, browser] = await Promise.all([Server.start(), launchBrowser()]);
  [t, other] = await Promise.all([server.tenant("csrf"), server.tenant("other")]);
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

/** What the API says of a task: the task and its events (to prove that nothing changed). */
async function snapshot(api, id) {
  return { task: await api.task(id), events: await api.events(id) };
}

/** A POST of form fields through `page`'s request context, redirects not followed. */
function post(page, path, form) {
  return page.request.post(`${server.url}${path}`, { form, maxRedirects: 0, failOnStatusCode: false });
}

const REASON = "support ticket 4711";

test("action posts: without the CSRF token, with another session's token, or by a client key → 403, nothing changes", async (t1) => {
  const admin = await newPage(browser);
  const admin2 = await newPage(browser);
  const client = await newPage(browser);
  await signIn(admin.page, server.url, t.adminKey);
  await signIn(admin2.page, server.url, t.adminKey);
  await signIn(client.page, server.url, t.clientKey);
  const own = await csrfOf(admin.page);
  const foreign = await csrfOf(admin2.page);
  const clientToken = await csrfOf(client.page);
  assert.ok(own && foreign && clientToken, "each session's pages carry a CSRF token");
  assert.notEqual(own, foreign, "two sessions of one key have different tokens");

  // Reconciling first: its claim would take any queued payment of the tenant.
  const { task: reconciling } = await reconcilingPayment(t, key("csrf-r"));
  const queued = await t.client.submit("payment.release", key("csrf-q"), payment(300));

  // The client sees no action at all.
  await client.page.goto(`${server.url}/console/tasks/${reconciling.id}`);
  assert.equal(await client.page.locator("form.action").count(), 0, "a client key sees no action form");
  await admin.page.goto(`${server.url}/console/tasks/${reconciling.id}`);
  assert.ok((await admin.page.locator("form.action").count()) > 0, "an admin sees the action forms");

  const cases = [
    { id: queued.id, action: "cancel", fields: { reason: REASON, confirm: "yes" } },
    {
      id: reconciling.id,
      action: "resolve",
      fields: { reason: REASON, confirm: "yes", outcome: "committed", result: '{"payout_id":"po_1"}', external_txn_id: "tx-1" },
    },
  ];
  for (const c of cases) {
    const path = `/console/tasks/${c.id}/actions/${c.action}`;
    const before = await snapshot(t.client, c.id);
    const attempts = [
      ["without a CSRF token", admin.page, c.fields, 403],
      ["with an empty CSRF token", admin.page, { ...c.fields, csrf: "" }, 403],
      ["with another session's token", admin.page, { ...c.fields, csrf: foreign }, 403],
      ["with the token altered", admin.page, { ...c.fields, csrf: own.slice(0, -2) + (own.endsWith("AA") ? "BB" : "AA") }, 403],
      ["by a client key's session, with its own valid token", client.page, { ...c.fields, csrf: clientToken }, 403],
      ["by a client key's session, with an admin session's token", client.page, { ...c.fields, csrf: own }, 403],
      ["without the confirmation", admin.page, { ...c.fields, confirm: undefined, csrf: own }, 400],
      ["with an empty reason", admin.page, { ...c.fields, reason: "  ", csrf: own }, 400],
    ];
    for (const [what, page, fields, status] of attempts) {
      const form = Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined));
      const res = await post(page, path, form);
      assert.equal(res.status(), status, `${c.action} ${what}: ${status}`);
      assert.deepEqual(await snapshot(t.client, c.id), before, `${c.action} ${what}: nothing changed`);
    }
    t1.diagnostic(`${c.action}: ${attempts.length} refused posts, task and events unchanged`);

    // The same form with the session's own token is accepted: the refusals above were about the token.
    const ok = await post(admin.page, path, { ...c.fields, csrf: own });
    assert.equal(ok.status(), 303, `${c.action} with the right token: 303`);
    assert.equal(new URL(ok.headers().location, server.url).pathname, `/console/tasks/${c.id}`);
    const afterOk = await t.client.task(c.id);
    assert.notEqual(afterOk.state, before.task.state, `${c.action} took effect (${afterOk.state})`);
  }

  // An action that no longer applies: 409, nothing changes.
  const done = await snapshot(t.client, queued.id);
  const res = await post(admin.page, `/console/tasks/${queued.id}/actions/retry-now`, { reason: REASON, confirm: "yes", csrf: own });
  assert.equal(res.status(), 409, "retry-now on a cancelled task: 409");
  assert.deepEqual(await snapshot(t.client, queued.id), done);

  for (const p of [admin, admin2, client]) await p.context.close();
});

test("another tenant's task id → 404 (pages, fragment, live stream and actions), its task unchanged", async () => {
  const { page, context } = await newPage(browser);
  await signIn(page, server.url, t.adminKey);
  const own = await csrfOf(page);
  const theirs = await other.client.submit("payment.release", key("theirs"), payment(900));
  const before = await snapshot(other.client, theirs.id);

  for (const p of [`/console/tasks/${theirs.id}`, `/console/tasks/${randomUUID()}`, "/console/tasks/not-a-task-id"]) {
    const res = await page.goto(`${server.url}${p}`);
    assert.equal(res.status(), 404, `GET ${p}: 404`);
    assert.equal(await page.locator("#task-state").count(), 0);
  }
  for (const p of [`/console/tasks/${theirs.id}/fragment`, `/console/tasks/${theirs.id}/live`]) {
    const res = await page.request.get(`${server.url}${p}`, { maxRedirects: 0, failOnStatusCode: false });
    assert.equal(res.status(), 404, `GET ${p}: 404`);
    await res.dispose();
  }
  for (const action of ["cancel", "retry-now", "redrive", "resolve"]) {
    const res = await post(page, `/console/tasks/${theirs.id}/actions/${action}`, {
      reason: REASON,
      confirm: "yes",
      csrf: own,
      outcome: "not_committed",
    });
    assert.equal(res.status(), 404, `POST ${action} on another tenant's task: 404`);
  }
  assert.deepEqual(await snapshot(other.client, theirs.id), before, "their task is unchanged");
  // A search of this tenant never lists it.
  await page.goto(`${server.url}/console/tasks?idempotency_key_prefix=theirs`);
  assert.equal(await page.locator(`tr[data-task-id="${theirs.id}"]`).count(), 0);
  await context.close();
});

test("signed out (no cookie, signed out, revoked key): every page redirects to sign-in, the stream is 401, a POST 403", async (t1) => {
  const task = await t.client.submit("payment.release", key("signed-out"), payment(100));
  const pages = [
    "/console/overview",
    "/console/tasks",
    "/console/tasks?state=queued",
    `/console/tasks/${task.id}`,
  ];

  /** Asserts that the context behind `page` is signed out everywhere. */
  async function assertSignedOut(page, csrf, where) {
    const get = (p) => page.request.get(`${server.url}${p}`, { maxRedirects: 0, failOnStatusCode: false });
    // All at once: each answer is checked on its own.
    const [root, gets, scripted, posts] = await Promise.all([
      get("/console"),
      Promise.all(pages.map(get)),
      // What the page's script fetches (the stream, the fragment) answers 401: a redirect
      // would swap the sign-in form into the task page.
      Promise.all([`/console/tasks/${task.id}/live`, `/console/tasks/${task.id}/fragment`].map(get)),
      Promise.all(
        [`/console/tasks/${task.id}/actions/cancel`, "/console/sign-out"].map((p) =>
          post(page, p, { reason: REASON, confirm: "yes", csrf: csrf ?? "" }),
        ),
      ),
    ]);
    assert.equal(root.status(), 303, `${where}: GET /console 303`);
    assert.equal(new URL(root.headers().location, server.url).pathname, "/console/sign-in");
    for (const [i, p] of pages.entries()) {
      const res = gets[i];
      assert.equal(res.status(), 303, `${where}: GET ${p} → 303`);
      const to = new URL(res.headers().location, server.url);
      assert.equal(to.pathname, "/console/sign-in", `${where}: GET ${p} → sign-in`);
      assert.equal(new URL(to.searchParams.get("next") ?? "", server.url).pathname, new URL(p, server.url).pathname, `${where}: next names ${p}`);
    }
    for (const res of scripted) {
      assert.equal(res.status(), 401, `${where}: GET ${new URL(res.url()).pathname} → 401`);
      await res.dispose();
    }
    for (const res of posts) assert.equal(res.status(), 403, `${where}: POST ${new URL(res.url()).pathname} → 403`);
    // And in the browser itself: the page shown is the sign-in form, which says where it returns to.
    await page.goto(`${server.url}/console/tasks/${task.id}`);
    const at = new URL(page.url());
    assert.equal(at.pathname, "/console/sign-in", `${where}: the browser lands on sign-in`);
    assert.equal(at.searchParams.get("next"), `/console/tasks/${task.id}`);
    assert.equal(await page.locator("form#sign-in #api_key").count(), 1);
    assert.equal(await page.locator("#task-state").count(), 0);
  }

  // No cookie at all.
  const fresh = await newPage(browser);
  await assertSignedOut(fresh.page, undefined, "no session");
  // Signing in from there returns to the page asked for.
  await fresh.page.fill("#api_key", t.clientKey);
  await Promise.all([
    fresh.page.waitForURL((u) => u.pathname === `/console/tasks/${task.id}`),
    fresh.page.locator('#sign-in button[type="submit"], #sign-in input[type="submit"], #sign-in button:not([type])').first().click(),
  ]);

  // A wrong key: 401 with the form and an alert, no cookie.
  const wrong = await newPage(browser);
  await wrong.page.goto(`${server.url}/console/sign-in`);
  await wrong.page.fill("#api_key", "idem_not-a-key");
  const [bad] = await Promise.all([
    wrong.page.waitForNavigation(),
    wrong.page.locator('#sign-in button[type="submit"], #sign-in input[type="submit"], #sign-in button:not([type])').first().click(),
  ]);
  assert.equal(bad.status(), 401, "a wrong key: 401");
  assert.equal(await wrong.page.locator('p.error[role="alert"]').count(), 1);
  assert.deepEqual((await wrong.context.cookies()).filter((c) => c.name === "idem_session"), [], "no session cookie");

  // The session cookie: HttpOnly, SameSite=Strict, Path=/console, not readable by script.
  const a = await newPage(browser);
  await signIn(a.page, server.url, t.adminKey);
  const cookies = await a.context.cookies();
  const session = cookies.find((c) => c.name === "idem_session");
  assert.ok(session, `an idem_session cookie (${cookies.map((c) => c.name)})`);
  assert.equal(session.httpOnly, true);
  assert.equal(session.sameSite, "Strict");
  assert.equal(session.path, "/console");
  assert.match(session.value, /^[A-Za-z0-9_-]{43}$/, "32 random bytes, base64url");
  assert.ok(session.expires > Date.now() / 1000, "with an expiry");
  assert.equal(await a.page.evaluate(() => document.cookie.includes("idem_session")), false);
  const csrf = await csrfOf(a.page);

  // Sign out with the form: the cookie goes, and the old cookie no longer opens anything.
  await Promise.all([
    a.page.waitForURL((u) => u.pathname === "/console/sign-in"),
    a.page.locator('#sign-out button[type="submit"], #sign-out input[type="submit"], #sign-out button:not([type])').first().click(),
  ]);
  await assertSignedOut(a.page, csrf, "after sign-out");
  const replay = await newPage(browser);
  await replay.context.addCookies([{ ...session }]);
  await assertSignedOut(replay.page, csrf, "the signed-out session's cookie, replayed");

  // A revoked key's session stops at once.
  const second = await server.createKey(t.name, "admin");
  const r = await newPage(browser);
  await signIn(r.page, server.url, second.key);
  const rCsrf = await csrfOf(r.page);
  await server.revokeKey(second.id);
  await assertSignedOut(r.page, rCsrf, "after the key was revoked");
  t1.diagnostic("no cookie, sign-out, replayed cookie and revoked key: all signed out");

  for (const p of [fresh, wrong, a, replay, r]) await p.context.close();
  assert.equal((await t.client.task(task.id)).state, "queued", "the task was never touched");
});
