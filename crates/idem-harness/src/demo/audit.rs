//! The closing audit of every task against the provider's ledger, the clean-up
//! of tasks a failed scene left unfinished, and the summary line.

use super::*;

impl Demo {
    /// Checks every task of the run against the provider's ledger.
    pub(super) async fn audit(&mut self) -> Result<()> {
        let mut delivered = 0;
        let mut cancelled = 0;
        let mut bad: BTreeMap<Invariant, Vec<String>> = BTreeMap::new();
        for id in self.tasks.clone() {
            let t = self.reader.get_task(id).await?;
            let attempts = self.reader.attempts(id).await?;
            let events = self.reader.events(id).await?;
            let payout = self.provider.payout(id);
            let deliveries = events.iter().filter(|e| e.kind == "delivered").count();
            if t.delivery.is_some() {
                delivered += 1;
            }
            let confirmed = t
                .cancellation
                .as_ref()
                .is_some_and(|c| c.status == CancelStatus::Confirmed);
            if confirmed {
                cancelled += 1;
            }
            let mut fail = |inv: Invariant, why: String| {
                bad.entry(inv)
                    .or_default()
                    .push(format!("{} {why}", short(id)));
            };
            // A payout beyond the first (scene f's provider without
            // idempotency keys) must be raised by idem and, with an admin
            // key, acknowledged after its refund.
            let extra = self.provider.extra_payouts(id);
            for p in &extra {
                let raised = events.iter().any(|e| {
                    e.kind == "second_effect_suspected" && e.data["external_txn_id"] == json!(p.txn)
                });
                let acknowledged = events.iter().any(|e| {
                    e.kind == "second_effect_acknowledged"
                        && e.data["external_txn_id"] == json!(p.txn)
                });
                if !raised {
                    fail(
                        Invariant::SecondEffectRaised,
                        format!("was paid again ({}) and idem raised nothing", p.txn),
                    );
                }
                if self.admin.is_some() && !(acknowledged && self.provider.refunded(&p.txn)) {
                    fail(
                        Invariant::SecondEffectRaised,
                        format!(
                            "was paid again ({}) without refund and acknowledgment",
                            p.txn
                        ),
                    );
                }
            }
            // One payout, one delivery, one charge; the provider and idem agree.
            if self.provider.money_moved(id) > 1 + extra.len() || deliveries > 1 {
                fail(
                    Invariant::OneDeliveryOneCharge,
                    "was paid or delivered twice".into(),
                );
            }
            match (&payout, &t.delivery) {
                (Some(p), Some(d)) if d.external_txn_id.as_deref() != Some(p.txn.as_str()) => {
                    fail(
                        Invariant::OneDeliveryOneCharge,
                        "delivered another transaction than the provider paid".into(),
                    );
                }
                (Some(_), None) if t.state.is_terminal() => {
                    fail(
                        Invariant::OneDeliveryOneCharge,
                        "was paid but never delivered".into(),
                    );
                }
                (None, Some(_)) => {
                    fail(
                        Invariant::OneDeliveryOneCharge,
                        "was delivered without a payout".into(),
                    );
                }
                _ => {}
            }
            if t.delivery
                .as_ref()
                .is_some_and(|d| d.charge != t.contract.price)
            {
                fail(
                    Invariant::OneDeliveryOneCharge,
                    "was charged other than its price".into(),
                );
            }
            // After an expired or unknown execute attempt, only a reconcile attempt
            // may follow, and an execute attempt only after `not_committed`.
            let mut previous: Option<(AttemptKind, AttemptState)> = None;
            for a in &attempts {
                if let Some((kind, state)) = previous {
                    let uncertain = kind == AttemptKind::Execute
                        && matches!(state, AttemptState::Expired | AttemptState::Unknown);
                    if a.kind == AttemptKind::Execute
                        && (uncertain
                            || (kind == AttemptKind::Reconcile
                                && state != AttemptState::NotCommitted))
                    {
                        fail(
                            Invariant::ReconcileBeforeRepeat,
                            format!(
                                "started execute attempt {} without reconciliation",
                                a.number
                            ),
                        );
                    }
                }
                previous = Some((a.kind, a.state));
            }
            if attempts
                .windows(2)
                .any(|w| w[1].generation <= w[0].generation)
            {
                fail(
                    Invariant::StaleChangesNothing,
                    "has attempts whose generations do not increase".into(),
                );
            }
            if confirmed && (t.delivery.is_some() || payout.is_some()) {
                fail(
                    Invariant::CancelOrDeliverNeverBoth,
                    "was both cancelled and delivered or paid".into(),
                );
            }
        }
        let n = self.tasks.len();
        self.say(format!(
            "idem's records of all {n} tasks of this run (task, attempts, events) were compared with the provider's ledger: {}, {}, {}.",
            count(self.provider.total_payouts(), "payout"),
            count(delivered, "delivery"),
            count(cancelled, "confirmed cancellation")
        ));
        for inv in [
            Invariant::OneDeliveryOneCharge,
            Invariant::ReconcileBeforeRepeat,
            Invariant::StaleChangesNothing,
            Invariant::CancelOrDeliverNeverBoth,
            Invariant::SecondEffectRaised,
        ] {
            let problems = bad.remove(&inv).unwrap_or_default();
            if !problems.is_empty() {
                self.say(format!("Problem: {}", problems.join("; ")));
            }
            let expectation = match inv {
                Invariant::OneDeliveryOneCharge => {
                    "every payout is delivered once, with the provider's transaction, at the contract price"
                }
                Invariant::ReconcileBeforeRepeat => {
                    "no task started a new execute attempt after an unknown outcome without `not_committed`"
                }
                Invariant::StaleChangesNothing => {
                    "attempt generations strictly increase within every task"
                }
                Invariant::SecondEffectRaised => {
                    "every payout beyond a task's first is raised by idem (and refunded and acknowledged)"
                }
                _ => "no task is both cancelled and delivered or paid",
            };
            self.check(
                inv,
                problems.is_empty(),
                format!("{expectation} (all {n} tasks)"),
            );
        }
        Ok(())
    }

    /// Cancels any task this run left unfinished (after a failed scene), so that
    /// a shared tenant is not left with pending work.
    pub(super) async fn cleanup(&mut self) {
        for id in self.tasks.clone() {
            if let Ok(t) = self.reader.get_task(id).await
                && !t.state.is_terminal()
            {
                let _ = self.reader.cancel(id).await;
            }
        }
    }

    pub(super) fn summary(&mut self) {
        self.line(String::new());
        self.line("Invariants checked");
        let width = Invariant::ALL
            .iter()
            .map(|i| i.title().len())
            .max()
            .unwrap_or(0);
        let scenes_width = 14;
        self.line(format!(
            "  {:<width$}  {:>6}  {:<scenes_width$}  result",
            "invariant", "checks", "checked in"
        ));
        let mut all_ok = self.report.errors.is_empty();
        for inv in Invariant::ALL {
            let checks: Vec<&Check> = self
                .report
                .checks
                .iter()
                .filter(|c| c.invariant == inv)
                .collect();
            let failed = checks.iter().filter(|c| !c.passed).count();
            let mut scenes: Vec<&str> = checks.iter().map(|c| c.scene.as_str()).collect();
            scenes.dedup();
            let ok = failed == 0 && !checks.is_empty();
            all_ok &= ok;
            let result = if checks.is_empty() {
                "FAIL (not checked)".to_owned()
            } else if ok {
                "PASS".to_owned()
            } else {
                format!("FAIL ({failed} failed)")
            };
            let line = format!(
                "  {:<width$}  {:>6}  {:<scenes_width$}  {result}",
                inv.title(),
                checks.len(),
                scenes.join(",")
            );
            self.line(line);
        }
        let total = self.report.checks.len();
        let failed = self.report.checks.iter().filter(|c| !c.passed).count();
        let mut last = String::new();
        if all_ok {
            let _ = write!(last, "Result: PASS, all {total} checks held.");
        } else {
            let _ = write!(
                last,
                "Result: FAIL, {failed} of {total} checks did not hold"
            );
            if !self.report.errors.is_empty() {
                let _ = write!(last, " and {} scene(s) broke off", self.report.errors.len());
            }
            last.push('.');
        }
        self.line(last);
        self.report.passed = all_ok;
    }
}
