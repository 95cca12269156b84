/**
 * Stories told through the public API, for the pages that show them: a reconciled payment
 * whose timeline has every kind of mark, and a tenant with tasks in every state.
 */
import { payment } from "./support.js";

/**
 * A payment reconciled by an operator, with the whole story on its timeline:
 * - attempt 1 (execute, `payout-worker-1`): acknowledged, a heartbeat with usage 3, then
 *   `unknown` ("provider timed out…") → `reconciling`;
 * - the client asks to cancel meanwhile (recorded, pending);
 * - attempt 2 (reconcile, `recon-worker-1`): leased, a heartbeat;
 * - an admin resolves it `committed` with the provider's result and transaction id: the
 *   generation is raised, attempt 2 retired, the payment delivered with its charge, the
 *   pending cancellation `too_late` with its fee;
 * - attempt 2's late report (`committed`) arrives: stale evidence;
 * - the client acknowledges the delivery (the key's expiry is then known).
 * → the task as the API has it at the end.
 */
export async function reconciledPayment(t, idempotencyKey, params = payment(125_000)) {
  const task = await t.client.submit("payment.release", idempotencyKey, params);
  const a1 = await t.executor.claim("payment.release", { executorId: "payout-worker-1" });
  if (a1.task_id !== task.id) throw new Error("claimed another task than the one submitted");
  await t.executor.ack(a1);
  await t.executor.heartbeat(a1, 3);
  await t.executor.report(a1, {
    outcome: "unknown",
    message: "provider timed out after the payout request was sent",
    usage: 3,
  });
  await t.client.cancel(task.id);
  const a2 = await t.executor.claim("payment.release", { executorId: "recon-worker-1" });
  if (a2.kind !== "reconcile") throw new Error(`expected a reconcile attempt, got ${a2.kind}`);
  await t.executor.heartbeat(a2, 0);
  const result = { payout_id: "po_3KX81723", status: "paid" };
  await t.admin.resolve(task.id, {
    outcome: "committed",
    result,
    external_txn_id: "tx-3KX81723",
    reason: "Provider dashboard shows payout po_3KX81723 paid; the reconcile worker is stuck on a timeout",
  });
  try {
    await t.executor.report(a2, { outcome: "committed", result, external_txn_id: "tx-3KX81723" });
    throw new Error("the retired reconcile attempt's report was accepted");
  } catch (e) {
    if (e.status !== 409) throw e;
  }
  await t.client.ackDelivery(task.id);
  return t.client.task(task.id);
}

/**
 * Tasks of both bundled classes in every state, as an overview would show a working day.
 * Each claim is made while only the task it is meant for is queued in its class.
 * → `{ byState: { state: [task…] } }`.
 */
export async function workingDay(t, prefix) {
  const made = [];
  let n = 0;
  const next = (cls) => `${prefix}-${cls === "payment.release" ? "payout" : "render"}-${String(++n).padStart(4, "0")}`;
  const payee = (i) => `acct-${(4200 + i * 37).toString()}`;

  // Payments paid out.
  for (let i = 0; i < 4; i++) {
    const task = await t.client.submit("payment.release", next("payment.release"), payment(1000 + i * 250, { payee: payee(i) }));
    const a = await t.executor.claim("payment.release", { executorId: `payout-worker-${1 + (i % 2)}` });
    await t.executor.report(a, { outcome: "succeeded", result: { payout_id: `po_${i}` }, external_txn_id: `tx-${i}` });
    made.push(task);
  }
  // Renders: two succeeded, one failed for good, one still running.
  for (let i = 0; i < 2; i++) {
    const task = await t.client.submit("generation.dispatch", next("generation.dispatch"), { prompt: `frame ${i}`, steps: 30 });
    const a = await t.executor.claim("generation.dispatch", { executorId: "gpu-worker-1" });
    await t.executor.heartbeat(a, 10 + i);
    await t.executor.report(a, { outcome: "succeeded", result: { image: `img-${i}.png` }, usage: 10 + i });
    made.push(task);
  }
  {
    const task = await t.client.submit("generation.dispatch", next("generation.dispatch"), { prompt: "no such model", steps: 30 });
    const a = await t.executor.claim("generation.dispatch", { executorId: "gpu-worker-2" });
    await t.executor.report(a, { outcome: "failed", failure_class: "invalid_input", message: "model 'sdxl-9' is not deployed" });
    made.push(task);
  }
  {
    const task = await t.client.submit("generation.dispatch", next("generation.dispatch"), { prompt: "a lighthouse at dusk", steps: 50 });
    const a = await t.executor.claim("generation.dispatch", { executorId: "gpu-worker-1", leaseMs: 300_000 });
    await t.executor.heartbeat(a, 40);
    made.push(task);
  }
  // A running payment whose client asked to cancel: requested, not yet confirmed.
  {
    const task = await t.client.submit("payment.release", next("payment.release"), payment(5_000, { payee: payee(20) }));
    await t.executor.claim("payment.release", { executorId: "payout-worker-1", leaseMs: 300_000 });
    await t.client.cancel(task.id);
    made.push(task);
  }
  // Payments whose outcome is unknown: reconciling. Both are leased before either reports, so
  // that neither claim can take the other's reconcile attempt.
  {
    const tasks = [];
    for (let i = 0; i < 2; i++)
      tasks.push(await t.client.submit("payment.release", next("payment.release"), payment(9_900 + i, { payee: payee(10 + i) })));
    const leased = [];
    for (let i = 0; i < 2; i++) leased.push(await t.executor.claim("payment.release", { executorId: "payout-worker-2" }));
    for (const a of leased) await t.executor.report(a, { outcome: "unknown", message: "provider answered 504" });
    made.push(...tasks);
  }
  // Cancelled while queued, and queued.
  {
    const task = await t.client.submit("payment.release", next("payment.release"), payment(750, { payee: payee(30) }));
    await t.client.cancel(task.id);
    made.push(task);
  }
  for (let i = 0; i < 2; i++)
    made.push(await t.client.submit("payment.release", next("payment.release"), payment(2_000 + i, { payee: payee(40 + i) })));
  made.push(await t.client.submit("generation.dispatch", next("generation.dispatch"), { prompt: "storyboard 3", steps: 20 }));

  const byState = {};
  for (const task of made) {
    const now = await t.client.task(task.id);
    (byState[now.state] ??= []).push(now);
  }
  return { byState };
}

/**
 * Incident: a double payout. Attempt 1 (execute, `payout-worker-1`) times out at the provider
 * and reports `unknown`; an admin checks, finds nothing and resolves `not_committed`; attempt
 * 2 (execute, `payout-worker-2`) pays out and delivers `po_B`; then attempt 1's late report
 * arrives: `succeeded` with `po_A`, kept as stale evidence (409). The provider paid twice.
 * → `{ task, first, second }` (the task as the API has it at the end, the two attempts).
 */
export async function doublePayout(t, idempotencyKey, params = payment(100, { payee: "acct-double" })) {
  const task = await t.client.submit("payment.release", idempotencyKey, params);
  const first = await t.executor.claim("payment.release", { executorId: "payout-worker-1" });
  if (first.task_id !== task.id) throw new Error("claimed another task than the one submitted");
  await t.executor.report(first, { outcome: "unknown", message: "PSP timed out after 30s" });
  await t.admin.call("POST", `/v1/tasks/${task.id}/resolve`, {
    outcome: "not_committed",
    reason: "Provider dashboard shows no payout for this attempt",
  });
  const second = await t.executor.claim("payment.release", { executorId: "payout-worker-2" });
  if (second.task_id !== task.id || second.kind !== "execute") throw new Error("expected the second execute attempt");
  await t.executor.report(second, { outcome: "succeeded", result: { payout_id: "po_B" }, external_txn_id: "po_B" });
  try {
    await t.executor.report(first, { outcome: "succeeded", result: { payout_id: "po_A" }, external_txn_id: "po_A" });
    throw new Error("the retired attempt's late report was accepted");
  } catch (e) {
    if (e.status !== 409) throw e;
  }
  return { task: await t.client.task(task.id), first, second };
}

/**
 * Incident: a cancellation that lost to delivery. The client cancels while attempt 1 runs;
 * the attempt then delivers `po_C`: the cancellation is `too_late`, its fee the delivery's
 * charge. → the task.
 */
export async function tooLateCancel(t, idempotencyKey, params = payment(100, { payee: "acct-late" })) {
  const task = await t.client.submit("payment.release", idempotencyKey, params);
  const a = await t.executor.claim("payment.release", { executorId: "payout-worker-1" });
  if (a.task_id !== task.id) throw new Error("claimed another task than the one submitted");
  await t.client.cancel(task.id);
  await t.executor.report(a, { outcome: "succeeded", result: { payout_id: "po_C" }, external_txn_id: "po_C" });
  return t.client.task(task.id);
}

/**
 * Incident: a payment whose executor said "PSP timed out after 30s" (`unknown`): reconciling,
 * no reconcile attempt leased. → `{ task, attempt }`.
 */
export async function timedOutPayment(t, idempotencyKey, params = payment(100, { payee: "acct-timeout" })) {
  const task = await t.client.submit("payment.release", idempotencyKey, params);
  const attempt = await t.executor.claim("payment.release", { executorId: "payout-worker-1" });
  if (attempt.task_id !== task.id) throw new Error("claimed another task than the one submitted");
  await t.executor.report(attempt, { outcome: "unknown", message: "PSP timed out after 30s" });
  return { task: await t.client.task(task.id), attempt };
}

/**
 * Incident: a payment that failed `transient` ("PSP answered 503"; a payout is not retried
 * automatically) → `{ task, attempt }`, state `failed`. Its redrive is the test's to do.
 */
export async function failedPayment(t, idempotencyKey, params = payment(100, { payee: "acct-503" })) {
  const task = await t.client.submit("payment.release", idempotencyKey, params);
  const attempt = await t.executor.claim("payment.release", { executorId: "payout-worker-1" });
  if (attempt.task_id !== task.id) throw new Error("claimed another task than the one submitted");
  await t.executor.report(attempt, { outcome: "failed", failure_class: "transient", message: "PSP answered 503" });
  return { task: await t.client.task(task.id), attempt };
}
