/**
 * Readers of the console's pages, by the console's DOM contract (ids, classes and data
 * attributes the server promises), so that each test states what it expects and not how to
 * find it.
 */

/** Sets a search-form field whatever control renders it (text input, select, checkboxes, radios). */
export async function setField(form, name, value) {
  const all = form.locator(`[name="${name}"]`);
  if ((await all.count()) === 0) throw new Error(`the form has no field named ${name}`);
  const first = all.first();
  const tag = await first.evaluate((e) => e.tagName.toLowerCase());
  const type = (await first.getAttribute("type")) ?? "";
  if (tag === "select") await first.selectOption(value);
  else if (type === "checkbox" || type === "radio") await form.locator(`[name="${name}"][value="${value}"]`).check();
  else await first.fill(value);
}

/** Clicks the form's submit button and waits for the navigation it causes. */
export async function submitForm(page, form) {
  const button = form.locator('button[type="submit"], input[type="submit"], button:not([type])').first();
  await Promise.all([page.waitForNavigation({ waitUntil: "load" }), button.click()]);
}

/** The ids of the search results, in page order (`table#results tr[data-task-id]`). */
export async function resultIds(page) {
  return page.locator("table#results tr[data-task-id]").evaluateAll((rows) => rows.map((r) => r.dataset.taskId));
}

/** The search results as `{ id, state, text }`. */
export async function results(page) {
  return page.locator("table#results tr[data-task-id]").evaluateAll((rows) =>
    rows.map((r) => ({
      id: r.dataset.taskId,
      state: r.querySelector("td.state")?.textContent.trim(),
      text: r.textContent,
      link: r.querySelector("a.task-link")?.getAttribute("href"),
    })),
  );
}

/** `table#attempts` rows as `{ id, number, generation, kind, executor, outcome }` (cell texts, trimmed). */
export async function attemptRows(page) {
  return page.locator("table#attempts tr[data-attempt-id]").evaluateAll((rows) =>
    rows.map((r) => {
      const cell = (c) => r.querySelector(`td.${c}`)?.textContent.trim() ?? null;
      return {
        id: r.dataset.attemptId,
        number: cell("number"),
        generation: cell("generation"),
        kind: cell("kind"),
        executor: cell("executor"),
        outcome: cell("outcome"),
      };
    }),
  );
}

/** The timeline's lanes `g.lane` as `{ id, generation, kind }`. */
export async function lanes(page) {
  return page.locator("#timeline svg g.lane").evaluateAll((gs) =>
    gs.map((g) => ({ id: g.dataset.attemptId, generation: g.dataset.generation, kind: g.dataset.kind })),
  );
}

/**
 * Opens `details#raw-events` (one click, as a person would) and reads its rows
 * `tr[data-event-id]` as `{ id, cells, payload }` (`payload`: the row's `<pre>` parsed as JSON).
 */
export async function rawEvents(page) {
  const details = page.locator("details#raw-events");
  if (!(await details.evaluate((d) => d.open))) await details.locator("summary").click();
  return details.locator("tr[data-event-id]").evaluateAll((rows) =>
    rows.map((r) => {
      const pre = r.querySelector("pre");
      let payload;
      try {
        payload = pre ? JSON.parse(pre.textContent) : undefined;
      } catch {
        payload = { unparsable: pre.textContent };
      }
      return { id: r.dataset.eventId, cells: [...r.querySelectorAll("td")].map((c) => c.textContent.trim()), payload };
    }),
  );
}

/** `#task-state`'s `data-state`. */
export async function taskState(page) {
  return page.locator("#task-state").getAttribute("data-state");
}

/**
 * Fills and submits an action form (`form.action[data-action=…]`): the reason, the
 * confirmation, and for `resolve` the outcome, result and external transaction id.
 */
export async function act(page, action, { reason, outcome, result, externalTxnId, confirm = true }) {
  const form = page.locator(`form.action[data-action="${action}"]`);
  await form.locator('textarea[name="reason"]').fill(reason);
  if (outcome) await form.locator(`input[name="outcome"][value="${outcome}"]`).check();
  if (result !== undefined) await form.locator('textarea[name="result"]').fill(result);
  if (externalTxnId !== undefined) await form.locator('input[name="external_txn_id"]').fill(externalTxnId);
  if (confirm) await form.locator('input[name="confirm"]').check();
  const button = form.locator('button[type="submit"], input[type="submit"], button:not([type])').first();
  const [response] = await Promise.all([page.waitForNavigation({ waitUntil: "load" }), button.click()]);
  return response;
}
