//! Scene (f): a provider without idempotency keys. A partition lets a stale
//! executor pay a second time; idem cannot prevent it, but its late report is
//! evidence of a second transaction beside the delivered one: idem raises
//! `second_effect_suspected`, shows it on the task, and an operator
//! acknowledges it once the refund is issued.

use super::*;

/// The task's `second_effects` entry for `txn`.
fn entry<'a>(task: &'a Task, txn: &str) -> Option<&'a SecondEffect> {
    task.second_effects
        .iter()
        .find(|e| e.external_txn_id.as_deref() == Some(txn))
}

/// The task's verdict in a line: its state, its delivery and its suspected
/// second effects with their acknowledgments.
fn verdict(t: &Task) -> String {
    let delivered = t
        .delivery
        .as_ref()
        .and_then(|d| d.external_txn_id.as_deref())
        .unwrap_or("none");
    let suspected = t
        .second_effects
        .iter()
        .map(|e| {
            format!(
                "{} ({} of attempt {}, {})",
                e.external_txn_id.as_deref().unwrap_or("no id"),
                e.evidence,
                e.attempt_id.map_or("?".into(), short),
                e.acknowledgment.as_ref().map_or_else(
                    || "unacknowledged".to_owned(),
                    |a| format!("acknowledged `{}`", a.resolution)
                )
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    format!(
        "{}, delivered once with transaction {delivered}; suspected second effects: {}",
        t.state,
        if suspected.is_empty() {
            "none"
        } else {
            &suspected
        }
    )
}

impl Demo {
    #[allow(clippy::too_many_lines)]
    pub(super) async fn scene_f(&mut self) -> Result<()> {
        let key = self.key("invoice-F");
        let params = json!({"payee": "acct-frank", "amount": 3000, "currency": "EUR"});
        let task = self.submit_new(&key, &params).await?;
        self.say(format!(
            "This time the payout provider takes no idempotency key: every pay request moves money. The agent releases {} to acct-frank (key {key}): 201, task {}.",
            money(3000, "EUR"),
            short(task.id)
        ));
        let cut = self
            .claim("executor-partitioned", task.id, SHORT_LEASE_MS)
            .await?;
        self.say(format!(
            "executor-partitioned claims attempt {} (generation {}, lease {SHORT_LEASE_MS} ms); a network partition cuts it off from idem, not from the provider, before it pays.",
            cut.number, cut.generation
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
        self.exec.report(r.id, &report).await?;
        let b = self.claim("executor-2", task.id, NORMAL_LEASE_MS).await?;
        let first = self.provider.pay_without_key(b.task_id, b.id, &b.params);
        let done = self
            .exec
            .report(
                b.id,
                &ReportBody::succeeded(b.generation, first.result())
                    .with_external_txn_id(first.txn.clone()),
            )
            .await?;
        self.say(format!(
            "The lease ran out (seen after {} ms); reconcile attempt {} found no payout and reported {}; executor-2 claims attempt {} (generation {}), pays (transaction {}) and reports succeeded: task {}.",
            waited.as_millis(),
            r.number,
            report.outcome,
            b.number,
            b.generation,
            first.txn,
            done.state
        ));

        // The partition heals: the stale executor, which never learnt that its
        // lease ran out, pays and reports.
        let second = self
            .provider
            .pay_without_key(cut.task_id, cut.id, &cut.params);
        let stale = self
            .exec
            .report(
                cut.id,
                &ReportBody::succeeded(cut.generation, second.result())
                    .with_external_txn_id(second.txn.clone()),
            )
            .await;
        self.say(format!(
            "Then the partition heals. executor-partitioned, unaware that its lease is gone, pays: the provider moves money again (transaction {}, {} for this task in all). Its `succeeded` report with generation {} gets {}.",
            second.txn,
            times(self.provider.money_moved(task.id)),
            cut.generation,
            status_of(&stale)
        ));
        let events = self.reader.events(task.id).await?;
        let raised: Vec<&idem_client::Event> = events
            .iter()
            .filter(|e| e.kind == "second_effect_suspected")
            .collect();
        for e in &raised {
            self.say(format!("idem's event {} `{}`: {}", e.seq, e.kind, e.data));
        }
        if raised.is_empty() {
            self.say("idem stored no second_effect_suspected event.");
        }
        let seen = self.reader.get_task(task.id).await?;
        self.say(format!(
            "The task's verdict (GET /v1/tasks/{}): {}.",
            short(task.id),
            verdict(&seen)
        ));
        let event_ok = raised.len() == 1
            && raised.first().is_some_and(|e| {
                e.data["external_txn_id"] == json!(second.txn)
                    && e.data["delivered_txn_id"] == json!(first.txn)
                    && e.data["attempt_id"] == json!(cut.id)
                    && e.data["generation"] == json!(cut.generation)
            });
        self.check(
            Invariant::StaleChangesNothing,
            matches!(&stale, Err(e) if e.status() == Some(409) && e.code() == Some("STALE_GENERATION"))
                && seen.state == TaskState::Succeeded
                && seen.delivery.as_ref().and_then(|d| d.external_txn_id.as_deref())
                    == Some(first.txn.as_str()),
            "the stale report is refused with 409 STALE_GENERATION; the delivery stays the first payout",
        );
        self.check(
            Invariant::SecondEffectRaised,
            event_ok,
            "idem raises one second_effect_suspected naming the stale executor's transaction beside the delivered one",
        );
        self.check(
            Invariant::SecondEffectRaised,
            entry(&seen, &second.txn).is_some_and(|e| e.acknowledgment.is_none()),
            "the task shows the suspected second effect, unacknowledged",
        );

        // The operator refunds the second payout and acknowledges it.
        let Some(admin) = self.admin.clone() else {
            self.say(
                "No admin key was given (--admin-key): the acknowledgment is left to an operator.",
            );
            return Ok(());
        };
        self.provider.refund(&second.txn);
        let reason = format!("{} refunded to the payer at the provider", second.txn);
        let acked = admin
            .acknowledge_second_effect(
                task.id,
                Some(&second.txn),
                EffectResolution::RefundIssued,
                &reason,
            )
            .await;
        let ack = acked
            .as_ref()
            .ok()
            .and_then(|t| entry(t, &second.txn))
            .and_then(|e| e.acknowledgment.clone());
        self.say(format!(
            "An operator refunds {} at the provider and acknowledges it (POST /v1/tasks/{}/second-effects/acknowledge, resolution refund_issued): {}, acknowledged by {} with the reason \"{}\".",
            second.txn,
            short(task.id),
            status_of(&acked),
            ack.as_ref().map_or("nobody".into(), |a| a.actor.to_string()),
            ack.as_ref().map_or("", |a| a.reason.as_str())
        ));
        let before = self.reader.events(task.id).await?.len();
        let again = admin
            .acknowledge_second_effect(
                task.id,
                Some(&second.txn),
                EffectResolution::RefundIssued,
                &reason,
            )
            .await;
        let after = self.reader.events(task.id).await?;
        let client_try = self
            .reader
            .acknowledge_second_effect(
                task.id,
                Some(&second.txn),
                EffectResolution::FalseAlarm,
                "the agent tries",
            )
            .await;
        let now = self.reader.get_task(task.id).await?;
        let acknowledged_events = after
            .iter()
            .filter(|e| e.kind == "second_effect_acknowledged")
            .count();
        self.say(format!(
            "Sent again: {}, nothing written ({before} events before, {} after). With the agent's client key: {}. The verdict now: {}.",
            status_of(&again),
            after.len(),
            status_of(&client_try),
            verdict(&now)
        ));
        self.say("idem cannot stop an executor that pays after its lease ran out at a provider without idempotency keys; it raises what the evidence shows, once per transaction, and keeps who acknowledged it and why.");
        self.check(
            Invariant::SecondEffectRaised,
            ack.as_ref()
                .is_some_and(|a| a.resolution == "refund_issued" && a.reason == reason),
            "an admin acknowledges it with resolution refund_issued and a reason",
        );
        self.check(
            Invariant::SecondEffectRaised,
            again.is_ok_and(|t| {
                entry(&t, &second.txn).and_then(|e| e.acknowledgment.clone()) == ack
            }) && after.len() == before
                && acknowledged_events == 1,
            "a repeated acknowledgment answers the existing one and writes nothing",
        );
        self.check(
            Invariant::SecondEffectRaised,
            matches!(&client_try, Err(e) if e.status() == Some(403)),
            "a client key may not acknowledge (403)",
        );
        Ok(())
    }
}
