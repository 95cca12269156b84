// Console sign-in cannot be forged: a page served from another port of 127.0.0.1 (same site,
// another origin) that auto-posts the sign-in form with a key of another tenant, with or
// without a sign-in token it planted in a cookie of its own, neither signs the browser in nor
// ends its session; a same-origin post without the form's token cannot either; the normal
// sign-in works; a sign-in with another tenant's key over a live session asks first and
// replaces it only when confirmed. "Still signed in" is judged by the store: the session's
// cookie still opens the overview of the victim's tenant.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { after, before, test } from "node:test";

import { Server, launchBrowser, newPage, signIn } from "./support.js";

let server, browser, victim, attacker, evil;

/** Pages served by `evil` (another port of 127.0.0.1), by path. */
const evilPages = new Map();

before(async () => {
  [server, browser] = await Promise.all([Server.start(), launchBrowser()]);
  [victim, attacker] = await Promise.all([server.tenant("victim"), server.tenant("attacker")]);
  evil = createServer((req, res) => {
    const page = evilPages.get(new URL(req.url, "http://x").pathname);
    res.writeHead(page ? 200 : 404, { "content-type": "text/html; charset=utf-8" });
    res.end(page ?? "not found");
  });
  await new Promise((r) => evil.listen(0, "127.0.0.1", r));
});

after(async () => {
  await browser?.close();
  await server?.stop();
  await new Promise((r) => (evil ? evil.close(r) : r()));
});

const evilUrl = (p) => `http://127.0.0.1:${evil.address().port}${p}`;

/** An auto-submitting form posting `fields` to the console's sign-in, run first by `script`. */
function autoPost(fields, script = "") {
  const inputs = Object.entries(fields)
    .map(([k, v]) => `<input type="hidden" name="${k}" value="${v}">`)
    .join("");
  return `<!doctype html><title>win a prize</title>
<form id="f" method="post" action="${server.url}/console/sign-in">${inputs}</form>
<script>${script};document.getElementById("f").submit();</script>`;
}

/** Who the browser behind `page` is signed in as, by the overview (`null`: signed out). */
async function signedInAs(page) {
  const res = await page.request.get(`${server.url}/console/overview`, { maxRedirects: 0, failOnStatusCode: false });
  if (res.status() !== 200) return null;
  const html = await res.text();
  return /<span id="tenant">([^<]*)<\/span>/.exec(html)?.[1] ?? "?";
}

async function sessionCookie(context) {
  return (await context.cookies()).find((c) => c.name === "idem_session")?.value;
}

test("a page of another port of 127.0.0.1 auto-posting the sign-in form neither signs in nor ends the session", async (t1) => {
  const { context, page } = await newPage(browser);
  await signIn(page, server.url, victim.adminKey);
  const before = await sessionCookie(context);
  assert.equal(await signedInAs(page), victim.name);

  // A plain forged form, and one with a sign-in token the attacker planted: cookies ignore
  // ports, so a page of 127.0.0.1:other can set a cookie the console on 127.0.0.1 receives.
  const planted = "A".repeat(43);
  evilPages.set("/plain", autoPost({ api_key: attacker.clientKey }));
  evilPages.set(
    "/planted",
    autoPost(
      { api_key: attacker.clientKey, sign_in_token: planted },
      `document.cookie = "idem_sign_in=${planted}; path=/console"`,
    ),
  );
  for (const p of ["/plain", "/planted"]) {
    const answered = page.waitForResponse((r) => r.url() === `${server.url}/console/sign-in` && r.request().method() === "POST");
    await page.goto(evilUrl(p));
    const res = await answered;
    assert.equal(res.status(), 403, `${p}: the forged sign-in is refused`);
    await page.locator('p.error[role="alert"]').waitFor();
    assert.equal(await signedInAs(page), victim.name, `${p}: still signed in as the victim`);
    assert.equal(await sessionCookie(context), before, `${p}: the same session cookie`);
    t1.diagnostic(`${p}: 403, still signed in as ${victim.name}`);
  }
  await context.close();
});

test("a same-origin post without the form's token neither signs in nor ends the session", async () => {
  const { context, page } = await newPage(browser);
  await signIn(page, server.url, victim.adminKey);
  const before = await sessionCookie(context);
  // A script of the console's own origin (as an injected one would be) posts a form it built.
  const answered = page.waitForResponse((r) => r.url() === `${server.url}/console/sign-in` && r.request().method() === "POST");
  await page.evaluate((key) => {
    const f = document.createElement("form");
    f.method = "post";
    f.action = "/console/sign-in";
    const i = document.createElement("input");
    i.name = "api_key";
    i.value = key;
    f.append(i);
    document.body.append(f);
    f.submit();
  }, attacker.clientKey);
  const res = await answered;
  assert.equal(res.status(), 403);
  // The answer's page replaces the one that posted: the form again, with why.
  await page.locator('p.error[role="alert"]').waitFor();
  assert.equal(await page.locator("form#sign-in").count(), 1);
  assert.equal(await signedInAs(page), victim.name);
  assert.equal(await sessionCookie(context), before);
  await context.close();
});

test("the sign-in form signs in; its token lives in an HttpOnly, SameSite=Strict cookie under /console", async () => {
  const { context, page } = await newPage(browser);
  await page.goto(`${server.url}/console/sign-in`);
  const pre = (await context.cookies()).find((c) => c.name === "idem_sign_in");
  assert.ok(pre, "a pre-session cookie");
  assert.equal(pre.httpOnly, true);
  assert.equal(pre.sameSite, "Strict");
  assert.equal(pre.path, "/console");
  assert.equal(await page.locator('#sign-in input[name="sign_in_token"]').inputValue(), pre.value);
  await signIn(page, server.url, victim.clientKey);
  assert.equal(await page.locator("#tenant").textContent(), victim.name);
  assert.equal(await signedInAs(page), victim.name);
  await context.close();
});

test("a sign-in with another tenant's key over a live session asks first, and replaces it only when confirmed", async () => {
  const { context, page } = await newPage(browser);
  await signIn(page, server.url, victim.adminKey);
  const before = await sessionCookie(context);

  const ask = async () => {
    await page.goto(`${server.url}/console/sign-in`);
    await page.fill("#api_key", attacker.clientKey);
    await Promise.all([page.waitForNavigation(), page.locator('#sign-in button[type="submit"]').click()]);
    assert.equal(await page.locator("main#replace-session").count(), 1, "the confirmation page");
    assert.equal(await page.locator("#current-tenant").textContent(), victim.name);
    assert.equal(await page.locator("#current-key").textContent(), victim.adminKeyId);
    assert.equal(await page.locator("#new-tenant").textContent(), attacker.name);
    assert.equal(await page.locator("#new-key").textContent(), attacker.clientKeyId);
    assert.equal(await signedInAs(page), victim.name, "asking changed nothing");
    assert.equal(await sessionCookie(context), before);
  };

  await ask();
  await Promise.all([page.waitForURL((u) => u.pathname === "/console/overview"), page.locator("#keep").click()]);
  assert.equal(await page.locator("#tenant").textContent(), victim.name, "kept");

  await ask();
  await Promise.all([
    page.waitForURL((u) => u.pathname === "/console/overview"),
    page.locator('#replace button[type="submit"]').click(),
  ]);
  assert.equal(await page.locator("#tenant").textContent(), attacker.name, "replaced once confirmed");
  assert.notEqual(await sessionCookie(context), before);
  // The replaced session ended: its cookie opens nothing.
  const old = await newPage(browser);
  await old.context.addCookies([{ name: "idem_session", value: before, url: server.url }]);
  assert.equal(await signedInAs(old.page), null);
  await old.context.close();
  await context.close();
});
