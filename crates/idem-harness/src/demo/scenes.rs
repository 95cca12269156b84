//! The scenes (a)–(e), each acting out one promise of idem and checking it.

use super::*;

impl Demo {
    pub(super) async fn scene_a(&mut self) -> Result<()> {
        let key = self.key("invoice-A");
        let params =
            json!({"payee": "acct-alice", "amount": 1250, "currency": "EUR", "memo": "invoice A"});
        self.say(format!(
            "The agent asks idem to release {} to acct-alice under the idempotency key {key}.",
            money(1250, "EUR")
        ));
        self.link.arm();
        let policy = SubmitRetry {
            max_tries: 4,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        };
        let first = self
            .agent
            .submit_with_retry(OPERATION, &params, &key, &policy)
            .await
            .context("the agent's submission")?;
        let task_id = first.task.id;
        self.tasks.push(task_id);
        let lost = self.link.lost_one();
        self.say(format!(
            "idem accepted it, but the answer was lost on the way back: the agent timed out after {} ms and sent the same request with the same key.",
            AGENT_TIMEOUT.as_millis()
        ));
        self.say(format!(
            "The retry was answered {} with Idempotent-Replayed: {}, naming task {}, the one the first request created ({} HTTP tries in all).",
            first.status,
            first.replayed,
            short(task_id),
            first.tries
        ));
        self.check(
            Invariant::OneScopeOneTask,
            lost && first.tries >= 2,
            "the first answer was lost and the agent retried",
        );
        self.check(
            Invariant::OneScopeOneTask,
            first.status == 201 && first.replayed && !first.looked_up,
            "the retry is answered 201 with Idempotent-Replayed: true",
        );

        let a = self.claim("executor-1", task_id, NORMAL_LEASE_MS).await?;
        let (payout, moved) = self.provider.pay(a.task_id, a.id, &a.params);
        let done = self
            .exec
            .report(
                a.id,
                &ReportBody::succeeded(a.generation, payout.result())
                    .with_external_txn_id(payout.txn.clone()),
            )
            .await
            .context("reporting success")?;
        self.say(format!(
            "executor-1 claimed attempt {} (generation {}), paid {} at the provider (transaction {}) and reported succeeded: 200, task {}.",
            a.number, a.generation, money(payout.amount, &payout.currency), payout.txn, done.state
        ));
        self.check(
            Invariant::OneDeliveryOneCharge,
            moved && done.state == TaskState::Succeeded,
            "the first execution pays and delivers",
        );

        let again = self
            .agent
            .submit_with_retry(OPERATION, &params, &key, &policy)
            .await
            .context("the agent's later retry")?;
        let delivered_charge = again.task.delivery.as_ref().map(|d| d.charge);
        let txn = again
            .task
            .delivery
            .as_ref()
            .and_then(|d| d.external_txn_id.clone());
        self.say(format!(
            "Later the agent sends the same request once more: {} again, replayed, same task {}, now {} with {} for the delivery and the recorded transaction {}.",
            again.status,
            short(again.task.id),
            again.task.state,
            charge(delivered_charge, &again.task.contract),
            txn.clone().unwrap_or_else(|| "none".into())
        ));
        let ack1 = self.agent_patient.ack_delivery(task_id).await;
        let ack2 = self.agent_patient.ack_delivery(task_id).await;
        let same_ack = match (&ack1, &ack2) {
            (Ok(x), Ok(y)) => {
                x.delivery == y.delivery
                    && y.delivery
                        .as_ref()
                        .is_some_and(|d| d.acknowledged_at.is_some())
            }
            _ => false,
        };
        self.say(format!(
            "Its delivery acknowledgment is sent twice, as if the first answer had been lost: {} and {}, one unchanged delivery record.",
            status_of(&ack1),
            status_of(&ack2)
        ));
        let found = self.reader.find_task(OPERATION, &key).await?;
        self.say(format!(
            "Looking the key up (GET /v1/tasks?operation=payment.release&idempotency_key=…) finds task {}.",
            short(found.id)
        ));
        let events = self.reader.events(task_id).await?;
        let delivered = events.iter().filter(|e| e.kind == "delivered").count();
        self.say(format!(
            "The provider moved money {} for this task; idem recorded {} with {}.",
            times(self.provider.money_moved(task_id)),
            count(delivered, "delivery"),
            charge(delivered_charge, &again.task.contract)
        ));
        self.say("Invariant: one key names one business operation, so every retry returns the same task and the payment happens once.");
        self.check(
            Invariant::OneScopeOneTask,
            again.task.id == task_id
                && found.id == task_id
                && again.replayed
                && again.status == 201,
            "every retry and the lookup return the same task",
        );
        self.check(
            Invariant::OneDeliveryOneCharge,
            self.provider.money_moved(task_id) == 1
                && delivered == 1
                && delivered_charge == Some(again.task.contract.price)
                && txn.as_deref() == Some(payout.txn.as_str())
                && again.task.attempt_count == 1,
            "one attempt, one payout, one delivery charged the contract price",
        );
        self.check(
            Invariant::OneDeliveryOneCharge,
            same_ack,
            "a repeated delivery acknowledgment returns the same record",
        );
        Ok(())
    }

    pub(super) async fn scene_b(&mut self) -> Result<()> {
        let key = self.key("invoice-A");
        let before = self.reader.find_task(OPERATION, &key).await?;
        let pays_before = self.provider.total_pay_requests();
        let base =
            json!({"payee": "acct-alice", "amount": 1250, "currency": "EUR", "memo": "invoice A"});
        let mut bigger = base.clone();
        bigger["amount"] = json!(125_000);
        let mut other_payee = base.clone();
        other_payee["payee"] = json!("acct-mallory");

        let r1 = self.agent_patient.submit(OPERATION, &bigger, &key).await;
        let r1_again = self.agent_patient.submit(OPERATION, &bigger, &key).await;
        let r2 = self
            .agent_patient
            .submit(OPERATION, &other_payee, &key)
            .await;
        let describe = |r: &Result<idem_client::Submitted, ClientError>| match r {
            Ok(s) => format!("{} (task {})", s.status, short(s.task.id)),
            Err(e) => describe_error(e),
        };
        self.say(format!(
            "The agent reuses key {key} with the amount changed to {}: {}. Sent again: {}.",
            money(125_000, "EUR"),
            describe(&r1),
            describe(&r1_again)
        ));
        self.say(format!(
            "The same key with the payee changed to acct-mallory: {}.",
            describe(&r2)
        ));
        let conflict = |r: &Result<idem_client::Submitted, ClientError>| match r {
            Err(e) => {
                e.status() == Some(422)
                    && e.code() == Some("IDEMPOTENCY_CONFLICT")
                    && e.problem().and_then(|p| p.task_id) == Some(before.id)
                    && e.problem()
                        .is_some_and(|p| !p.detail.contains("acct-alice"))
            }
            Ok(_) => false,
        };
        let names = match &r1 {
            Err(e) => e
                .problem()
                .and_then(|p| p.task_id)
                .map_or("no task".into(), short),
            Ok(_) => "no task".into(),
        };
        self.say(format!(
            "The problem names the original task ({names}) but none of its parameters; the answer is the same each time."
        ));
        let deterministic = match (&r1, &r1_again) {
            (Err(a), Err(b)) => a.problem() == b.problem(),
            _ => false,
        };
        let after = self.reader.get_task(before.id).await?;
        let found = self.reader.find_task(OPERATION, &key).await?;
        let unchanged = after == before;
        self.say(format!(
            "Afterwards task {} is {} with its original amount {} and payee {}; the provider received {}.",
            short(after.id),
            if unchanged { "untouched" } else { "CHANGED" },
            money(after.params["amount"].as_i64().unwrap_or(0), after.params["currency"].as_str().unwrap_or("")),
            after.params["payee"].as_str().unwrap_or("?"),
            match self.provider.total_pay_requests() - pays_before {
                0 => "no new payment request".to_owned(),
                n => count(n, "new payment request"),
            }
        ));
        self.say("Invariant: a key is bound to its request's fingerprint (payee, amount, currency); a changed request is rejected, never executed or treated as the approved one.");
        self.check(
            Invariant::ConflictExecutedNothing,
            conflict(&r1) && conflict(&r1_again),
            "a changed amount is refused with 422 IDEMPOTENCY_CONFLICT naming the original task",
        );
        self.check(
            Invariant::ConflictExecutedNothing,
            conflict(&r2),
            "a changed payee is refused with 422 IDEMPOTENCY_CONFLICT naming the original task",
        );
        self.check(
            Invariant::ConflictExecutedNothing,
            deterministic,
            "the same conflicting request gets the same problem every time",
        );
        self.check(
            Invariant::ConflictExecutedNothing,
            unchanged && self.provider.total_pay_requests() == pays_before,
            "the original task and the provider's ledger are unchanged",
        );
        self.check(
            Invariant::OneScopeOneTask,
            found.id == before.id,
            "the key still maps to the original task",
        );
        Ok(())
    }

    pub(super) async fn scene_c(&mut self) -> Result<()> {
        let key = self.key("invoice-C");
        let params = json!({"payee": "acct-bob", "amount": 4200, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        self.say(format!(
            "The agent releases {} to acct-bob (key {key}): 201, task {}.",
            money(4200, "EUR"),
            short(task.id)
        ));
        let a = self
            .claim("executor-crashy", task.id, SHORT_LEASE_MS)
            .await?;
        let (payout, moved) = self.provider.pay(a.task_id, a.id, &a.params);
        self.say(format!(
            "executor-crashy claims attempt {} (generation {}, lease {SHORT_LEASE_MS} ms), pays at the provider (transaction {}) and crashes before it can report.",
            a.number, a.generation, payout.txn
        ));
        self.unknown_outcome.push(task.id);
        let (t, waited) = self.wait_for(task.id, TaskState::Reconciling).await?;
        let attempts = self.reader.attempts(task.id).await?;
        let executes = attempts
            .iter()
            .filter(|x| x.kind == AttemptKind::Execute)
            .count();
        self.say(format!(
            "idem cannot know whether the money moved. When the lease ran out (seen after {} ms) it marked attempt {} `{}` and moved the task to `{}`, starting no new payment attempt.",
            waited.as_millis(),
            a.number,
            attempts.first().map_or("?".into(), |x| x.state.to_string()),
            t.state
        ));
        let r = self
            .claim("executor-reconciler", task.id, NORMAL_LEASE_MS)
            .await?;
        let found = self.provider.lookup(r.task_id);
        let report = match &found {
            Some(p) => {
                ReportBody::committed(r.generation, p.result()).with_external_txn_id(p.txn.clone())
            }
            None => ReportBody::not_committed(r.generation),
        };
        let done = self.exec.report(r.id, &report).await?;
        self.say(format!(
            "executor-reconciler claims attempt {} of kind `{}` (generation {}), looks the task id up at the provider, finds transaction {} and reports {}: 200, task {}.",
            r.number,
            r.kind,
            r.generation,
            found.as_ref().map_or("none".into(), |p| p.txn.clone()),
            report.outcome,
            done.state
        ));
        let delivery_txn = done
            .delivery
            .as_ref()
            .and_then(|d| d.external_txn_id.clone());
        self.say(format!(
            "The agent now reads task {}: {} with {} for the delivery, transaction {}. The provider received {} and {} for it, and paid {}.",
            short(done.id),
            done.state,
            charge(done.delivery.as_ref().map(|d| d.charge), &done.contract),
            delivery_txn.clone().unwrap_or_else(|| "none".into()),
            count(self.provider.pay_requests(task.id), "payment request"),
            count(self.provider.lookups(task.id), "lookup"),
            times(self.provider.money_moved(task.id))
        ));
        self.say("Invariant: after an unknown outcome idem reconciles with the provider before anything is repeated; a committed effect is delivered, not paid again.");
        self.check(
            Invariant::ReconcileBeforeRepeat,
            moved && t.state == TaskState::Reconciling && executes == 1,
            "an expired lease of a payment leads to `reconciling`, not to a new execute attempt",
        );
        self.check(
            Invariant::ReconcileBeforeRepeat,
            r.kind == AttemptKind::Reconcile && r.generation > a.generation,
            "the next attempt is a reconcile attempt with a higher generation",
        );
        self.check(
            Invariant::ReconcileBeforeRepeat,
            self.provider.pay_requests(task.id) == 1 && self.provider.lookups(task.id) == 1,
            "the provider is asked once to pay and once to look up, never to pay again",
        );
        self.check(
            Invariant::OneDeliveryOneCharge,
            done.state == TaskState::Succeeded
                && delivery_txn.as_deref() == Some(payout.txn.as_str())
                && done.delivery.as_ref().map(|d| d.charge) == Some(done.contract.price)
                && self.provider.money_moved(task.id) == 1,
            "the reconciled payout is delivered once, charged the contract price",
        );
        Ok(())
    }

    pub(super) async fn scene_d(&mut self) -> Result<()> {
        let key = self.key("invoice-D");
        let params = json!({"payee": "acct-carol", "amount": 990, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        self.say(format!(
            "The agent releases {} to acct-carol (key {key}): 201, task {}.",
            money(990, "EUR"),
            short(task.id)
        ));
        let slow = self.claim("executor-slow", task.id, SHORT_LEASE_MS).await?;
        self.say(format!(
            "executor-slow claims attempt {} (generation {}, lease {SHORT_LEASE_MS} ms), then loses its network before calling the provider.",
            slow.number, slow.generation
        ));
        self.unknown_outcome.push(task.id);
        let (_, waited) = self.wait_for(task.id, TaskState::Reconciling).await?;
        let r = self
            .claim("executor-reconciler", task.id, NORMAL_LEASE_MS)
            .await?;
        let found = self.provider.lookup(r.task_id);
        let report = match &found {
            Some(p) => {
                ReportBody::committed(r.generation, p.result()).with_external_txn_id(p.txn.clone())
            }
            None => ReportBody::not_committed(r.generation),
        };
        let after_reconcile = self.exec.report(r.id, &report).await?;
        self.say(format!(
            "The lease ran out (seen after {} ms); reconcile attempt {} (generation {}) found no payout at the provider and reported {}: 200, task {}.",
            waited.as_millis(),
            r.number,
            r.generation,
            report.outcome,
            after_reconcile.state
        ));
        let b = self.claim("executor-2", task.id, NORMAL_LEASE_MS).await?;
        let (payout, _) = self.provider.pay(b.task_id, b.id, &b.params);
        let done = self
            .exec
            .report(
                b.id,
                &ReportBody::succeeded(b.generation, payout.result())
                    .with_external_txn_id(payout.txn.clone()),
            )
            .await?;
        self.say(format!(
            "Only now may the payment be tried again: executor-2 claims attempt {} (generation {}), pays (transaction {}) and reports succeeded: 200, task {}.",
            b.number, b.generation, payout.txn, done.state
        ));
        // The stale executor comes back: it pays (the provider answers with the
        // recorded payout) and reports success with its old generation.
        let (late, moved) = self.provider.pay(slow.task_id, slow.id, &slow.params);
        let stale = self
            .exec
            .report(
                slow.id,
                &ReportBody::succeeded(slow.generation, late.result())
                    .with_external_txn_id(late.txn.clone()),
            )
            .await;
        let current = stale
            .as_ref()
            .err()
            .and_then(|e| e.problem())
            .and_then(|p| p.current_generation);
        self.say(format!(
            "Then executor-slow comes back. Its payment request returns the provider's recorded transaction {} ({}), and its late `succeeded` report with generation {} gets {}{}.",
            late.txn,
            if moved { "money moved AGAIN" } else { "no money moved" },
            slow.generation,
            status_of(&stale),
            current.map_or(String::new(), |g| format!(" (current generation {g})"))
        ));
        let after = self.reader.get_task(task.id).await?;
        let attempts = self.reader.attempts(task.id).await?;
        let kept = attempts.iter().find(|x| x.id == slow.id).is_some_and(|x| {
            x.evidence.iter().any(|e| {
                e.generation == slow.generation
                    && e.outcome == "succeeded"
                    && e.disposition
                        .as_deref()
                        .is_none_or(|d| d == "stale_generation")
            })
        });
        let listing = attempts
            .iter()
            .map(|x| format!("{} {} gen {} {}", x.number, x.kind, x.generation, x.state))
            .collect::<Vec<_>>()
            .join("; ");
        self.say(format!(
            "GET /v1/tasks/{}/attempts still lists every attempt ({listing}); the late report {} attempt {}. The task is {}: {}, transaction {}.",
            short(task.id),
            if kept { "is kept as evidence (stale_generation) on" } else { "is MISSING from the evidence of" },
            slow.number,
            if material(&after) == material(&done) { "unchanged" } else { "CHANGED" },
            after.state,
            after
                .delivery
                .as_ref()
                .and_then(|d| d.external_txn_id.clone())
                .unwrap_or_else(|| "none".into())
        ));
        self.say("Invariant: every attempt has a new id and a higher generation; a superseded executor's output is kept as evidence but cannot replace the authorised result.");
        self.check(
            Invariant::StaleChangesNothing,
            matches!(&stale, Err(e) if e.status() == Some(409) && e.code() == Some("STALE_GENERATION")),
            "a report with an old generation is refused with 409 STALE_GENERATION",
        );
        self.check(
            Invariant::StaleChangesNothing,
            kept,
            "the late report is visible as evidence in /attempts",
        );
        self.check(
            Invariant::StaleChangesNothing,
            material(&after) == material(&done),
            "the late report changes nothing in the task",
        );
        self.check(
            Invariant::ReconcileBeforeRepeat,
            r.kind == AttemptKind::Reconcile
                && report.outcome == idem_client::Outcome::NotCommitted
                && b.kind == AttemptKind::Execute
                && b.generation > r.generation
                && r.generation > slow.generation,
            "a new execute attempt starts only after reconciliation found nothing committed",
        );
        self.check(
            Invariant::OneDeliveryOneCharge,
            !moved && self.provider.money_moved(task.id) == 1,
            "the provider paid this task once although asked twice",
        );
        Ok(())
    }

    pub(super) async fn scene_e(&mut self) -> Result<()> {
        // Delivery wins.
        let key = self.key("invoice-E1");
        let params = json!({"payee": "acct-dave", "amount": 5000, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        let a = self.claim("executor-1", task.id, NORMAL_LEASE_MS).await?;
        let (payout, _) = self.provider.pay(a.task_id, a.id, &a.params);
        let cancel = self.agent_patient.cancel(task.id).await?;
        self.say(format!(
            "Task {}, {} to acct-dave: executor-1 has just paid (transaction {}) when the agent asks to cancel: {} with status `{}` (recorded, not yet decided).",
            short(task.id),
            money(5000, "EUR"),
            payout.txn,
            cancel.status,
            cancel.cancellation.status
        ));
        let done = self
            .exec
            .report(
                a.id,
                &ReportBody::succeeded(a.generation, payout.result())
                    .with_external_txn_id(payout.txn.clone()),
            )
            .await?;
        let again = self.agent_patient.cancel(task.id).await?;
        let c = done.cancellation.clone();
        let delivered_charge = done.delivery.as_ref().map(|d| d.charge);
        self.say(format!(
            "The executor's success report arrives first: task {} with {} for the delivery. After delivery a cancellation costs the full price, so the cancellation became `{}`: {}. Asking again answers {} `{}`.",
            done.state,
            charge(delivered_charge, &done.contract),
            c.as_ref().map_or("none".into(), |c| c.status.to_string()),
            match (c.as_ref().and_then(|c| c.fee), delivered_charge) {
                (Some(fee), Some(paid)) if fee == paid => too_late(paid, &done.contract),
                (fee, _) => cancel_fee(fee, &done.contract),
            },
            again.status,
            again.cancellation.status
        ));
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            cancel.status == 202 && cancel.cancellation.status == CancelStatus::Requested,
            "a cancel request while running is recorded (202 `requested`)",
        );
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            done.state == TaskState::Succeeded
                && c.as_ref().is_some_and(|c| c.status == CancelStatus::TooLate && c.fee == delivered_charge)
                && delivered_charge == Some(done.contract.price)
                && again.status == 200
                && again.cancellation.status == CancelStatus::TooLate,
            "when delivery wins, the cancellation is `too_late` and its fee is the delivery's charge",
        );

        // Cancellation wins.
        let key = self.key("invoice-E2");
        let params = json!({"payee": "acct-erin", "amount": 7500, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        let a = self.claim("executor-1", task.id, NORMAL_LEASE_MS).await?;
        let hb1 = self.exec.heartbeat(a.id, a.generation, Some(3)).await?;
        let cancel = self.agent_patient.cancel(task.id).await?;
        let hb2 = self.exec.heartbeat(a.id, a.generation, Some(4)).await?;
        self.say(format!(
            "Task {}, {} to acct-erin: executor-1 is still preparing (heartbeat: cancel requested = {}) when the agent cancels: {} `{}`. The next heartbeat says cancel requested = {}.",
            short(task.id),
            money(7500, "EUR"),
            hb1.cancel_requested,
            cancel.status,
            cancel.cancellation.status,
            hb2.cancel_requested
        ));
        let stopped = self
            .exec
            .report(a.id, &ReportBody::cancelled(a.generation).with_usage(4))
            .await?;
        let c = stopped.cancellation.clone();
        let fees = &stopped.contract.fees;
        let expected_fee = fees["cancel_after_start_fixed"].as_i64().unwrap_or(0)
            + 4 * fees["usage_unit_price"].as_i64().unwrap_or(0);
        self.say(format!(
            "The executor stops without paying and reports cancelled with 4 usage units: task {}, cancellation `{}` with {}: the fixed fee plus 4 units × the unit price, and no delivery charge; generation raised from {} to {}.",
            stopped.state,
            c.as_ref().map_or("none".into(), |c| c.status.to_string()),
            cancel_fee(c.as_ref().and_then(|c| c.fee), &stopped.contract),
            a.generation,
            stopped.generation
        ));
        let late = self
            .exec
            .report(
                a.id,
                &ReportBody::succeeded(a.generation, json!({"status": "paid"})),
            )
            .await;
        let after = self.reader.get_task(task.id).await?;
        self.say(format!(
            "A delayed `succeeded` message from the retired attempt gets {}; the task stays {}, with no payout at the provider.",
            status_of(&late),
            after.state
        ));
        self.say("Invariant: cancellation and delivery are ordered by one atomic transition, exactly one wins; a confirmed cancellation retires the executor's authority and keeps its usage.");
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            !hb1.cancel_requested && hb2.cancel_requested && cancel.status == 202,
            "the running executor learns of the pending cancellation from its heartbeat",
        );
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            stopped.state == TaskState::Cancelled
                && c.as_ref().is_some_and(|c| {
                    c.status == CancelStatus::Confirmed && c.fee == Some(expected_fee)
                })
                && stopped.delivery.is_none()
                && stopped.usage == 4
                && stopped.generation > a.generation,
            "a confirmed cancellation raises the generation, keeps usage and charges the frozen fee",
        );
        self.check(
            Invariant::StaleChangesNothing,
            matches!(&late, Err(e) if e.status() == Some(409) && e.code() == Some("STALE_GENERATION"))
                && material(&after) == material(&stopped),
            "a report from the retired attempt is refused with 409 STALE_GENERATION and changes nothing",
        );
        self.check(
            Invariant::CancelOrDeliverNeverBoth,
            self.provider.payout(task.id).is_none(),
            "nothing was paid for the cancelled task",
        );
        Ok(())
    }
}
