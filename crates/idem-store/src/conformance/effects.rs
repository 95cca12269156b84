//! Suspected second effects (SPEC §2 "Second effects"): each evidence
//! pattern raises `second_effect_suspected` once per distinct transaction id
//! and none for a replay or a report of the delivered id; the task answer
//! shows them, search finds the task by every id any attempt reported and by
//! `second_effect`; an acknowledgment is scoped to the tenant, audited with
//! its actor, idempotent, and ordered with a racing report by the database.

use idem_core::machine::operator::{Actor, By, Reason, Refused, Resolution};
use idem_core::model::{EffectEvidence, EffectResolution, SecondEffect};

use super::*;
use crate::ops::search::{SecondEffectFilter, TaskQuery};

/// An admin of `c`'s tenant acting with a reason.
async fn admin(c: &Ctx) -> By {
    let (key, _) = must(
        c.store.create_api_key(&c.tenant, Role::Admin, None).await,
        "create admin key",
    );
    By {
        actor: Actor::ApiKey(key.id),
        reason: must(Reason::parse("refund issued at the provider"), "reason"),
    }
}

/// `succeeded` with transaction id `txn` (`None`: without one) and a body
/// that tells reports apart by `tag`.
fn effect(generation: i64, txn: Option<&str>, tag: u32) -> Report {
    let mut r = rep(generation, Outcome::Succeeded).result(json!({"tag": tag}));
    if let Some(t) = txn {
        r = r.txn(t);
    }
    r.build()
}

/// The ids of the task's suspected second effects, in order.
fn ids(t: &Task) -> Vec<Option<&str>> {
    t.second_effects
        .iter()
        .map(|s| s.external_txn_id.as_deref())
        .collect()
}

/// The tasks of `c`'s tenant a search with `q` finds.
async fn found(c: &Ctx, q: TaskQuery) -> Vec<Uuid> {
    let page = must(c.store.search_tasks(&c.tenant, q).await, "search");
    page.tasks.iter().map(|t| t.id).collect()
}

fn by_txn(txn: &str) -> TaskQuery {
    TaskQuery {
        external_txn_id: Some(txn.to_owned()),
        ..TaskQuery::default()
    }
}

fn by_effect(f: SecondEffectFilter) -> TaskQuery {
    TaskQuery {
        second_effect: Some(f),
        ..TaskQuery::default()
    }
}

/// A safe task whose first attempt's lease ran out and whose second attempt
/// holds the lease: (task, first attempt, second attempt).
async fn second_attempt(c: &Ctx) -> (Task, Attempt, Attempt) {
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a1 = c.claim_one(SAFE, SHORT_LEASE, t.id).await;
    c.run_out_lease(t.id, "retry_wait", |t| t.state == TaskState::RetryWait)
        .await;
    let a2 = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    (t, a1, a2)
}

/// Stale and duplicate reports of other ids after a delivery raise one
/// second effect per distinct id; a replay, a stale report of the delivered
/// id and a report without an id raise nothing. The task answer shows them;
/// search finds the task by each reported id and by `second_effect`.
pub async fn stale_reports_of_other_ids_raise_one_second_effect_per_id(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let (t, a1, a2) = second_attempt(&c).await;
    // A stale report before the delivery: raised when the task delivers.
    assert_stale(
        c.report(&a1, effect(a1.generation, Some("psp-A"), 1)).await,
        "stale A",
    );
    assert!(
        c.task(t.id).await.second_effects.is_empty(),
        "nothing delivered yet"
    );
    let delivered = c
        .report_ok(&a2, effect(a2.generation, Some("psp-B"), 2))
        .await;
    assert_eq!(ids(&delivered), vec![Some("psp-A")]);
    // Replay, the delivered id, no id, and `psp-A` again: nothing more.
    c.report_ok(&a2, effect(a2.generation, Some("psp-B"), 2))
        .await;
    assert_stale(
        c.report(&a1, effect(a1.generation, Some("psp-B"), 3)).await,
        "stale B",
    );
    assert_stale(
        c.report(&a1, effect(a1.generation, None, 4)).await,
        "stale, no id",
    );
    assert_stale(
        c.report(&a1, effect(a1.generation, Some("psp-A"), 5)).await,
        "stale A again",
    );
    // A new distinct id: raised once more.
    assert_stale(
        c.report(&a1, effect(a1.generation, Some("psp-C"), 6)).await,
        "stale C",
    );
    let t = c.task(t.id).await;
    assert_eq!(ids(&t), vec![Some("psp-A"), Some("psp-C")]);
    let s = &t.second_effects[0];
    assert_eq!(
        (s.attempt_id, s.generation, s.evidence, &s.acknowledgment),
        (
            Some(a1.id),
            a1.generation,
            EffectEvidence::StaleReport,
            &None
        )
    );
    let events = c.events(t.id).await;
    assert_eq!(count(&events, "second_effect_suspected"), 2);
    let first = events
        .iter()
        .find(|e| e.kind == EventKind::SecondEffectSuspected)
        .map(|e| json_of(&e.data));
    assert_eq!(
        first,
        Some(json!({
            "attempt_id": a1.id,
            "delivered_txn_id": "psp-B",
            "evidence": "stale_report",
            "external_txn_id": "psp-A",
            "generation": a1.generation,
            "state": "succeeded",
        }))
    );
    for txn in ["psp-A", "psp-B", "psp-C"] {
        assert_eq!(found(&c, by_txn(txn)).await, vec![t.id], "search by {txn}");
    }
    assert!(found(&c, by_txn("psp-Z")).await.is_empty());
    assert_eq!(
        found(&c, by_effect(SecondEffectFilter::Suspected)).await,
        vec![t.id]
    );
    assert_eq!(
        found(&c, by_effect(SecondEffectFilter::Unacknowledged)).await,
        vec![t.id]
    );
    // Another tenant's search finds none of it.
    let other = Ctx::new(&store, "globex").await;
    assert!(found(&other, by_txn("psp-A")).await.is_empty());
    assert!(
        found(&other, by_effect(SecondEffectFilter::Suspected))
            .await
            .is_empty()
    );
    assert_history(&store, t.id).await;
}

/// A late report (its own generation, after its lease) is raised when a
/// reconciliation delivers another id; a duplicate report on a task that
/// ended without delivery is raised with any id, `null` included, once.
pub async fn late_and_duplicate_reports_raise_second_effects(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    c.run_out_lease(t.id, "reconciling", |t| t.state == TaskState::Reconciling)
        .await;
    assert_stale(
        c.report(&a, effect(a.generation, Some("late-1"), 1)).await,
        "late",
    );
    let r = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let t2 = c
        .report_ok(
            &r,
            rep(r.generation, Outcome::Committed)
                .result(json!({}))
                .txn("rec-1")
                .build(),
        )
        .await;
    assert_eq!(ids(&t2), vec![Some("late-1")]);
    assert_eq!(t2.second_effects[0].evidence, EffectEvidence::LateReport);
    assert_eq!(found(&c, by_txn("late-1")).await, vec![t.id]);
    assert_history(&store, t.id).await;

    // Failed without delivery: a duplicate `succeeded` without an id.
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, LONG_LEASE, t.id).await;
    let failed_task = c
        .report_ok(&a, failed(a.generation, FailureClass::Transient))
        .await;
    assert_failed(&failed_task, FailureClass::Transient);
    for tag in [1, 2] {
        let r = must(
            c.report(&a, effect(a.generation, None, tag)).await,
            "duplicate",
        );
        assert!(
            matches!(r, Err(Refusal::Machine(Rejection::AlreadyReported { .. }))),
            "{r:?}"
        );
    }
    let t = c.task(t.id).await;
    assert_eq!(ids(&t), vec![None], "a null id counts as one distinct id");
    assert_eq!(
        t.second_effects[0].evidence,
        EffectEvidence::DuplicateReport
    );
    assert_eq!(count(&c.events(t.id).await, "second_effect_suspected"), 1);
    assert_history(&store, t.id).await;
}

/// A task cancelled before its next attempt started ended without delivery:
/// a stale `succeeded` from the attempt whose lease ran out is an effect
/// the provider may have made, raised once per distinct id (a repeat of the
/// same id raises nothing more); search finds the task by each id.
pub async fn stale_success_on_a_task_cancelled_before_start_is_raised(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let t = c.create(SAFE, &contract(SAFE)).await;
    let a = c.claim_one(SAFE, SHORT_LEASE, t.id).await;
    c.run_out_lease(t.id, "retry_wait", |t| t.state == TaskState::RetryWait)
        .await;
    let (cancelled, _) = c.cancel(t.id).await;
    assert_eq!(cancelled.state, TaskState::Cancelled, "{cancelled:?}");
    for (tag, txn) in [(1, "po-cancel-1"), (2, "po-cancel-1"), (3, "po-cancel-2")] {
        assert_stale(
            c.report(&a, effect(a.generation, Some(txn), tag)).await,
            "stale success after the cancellation",
        );
    }
    let t = c.task(t.id).await;
    assert_eq!(t.state, TaskState::Cancelled);
    assert_eq!(ids(&t), vec![Some("po-cancel-1"), Some("po-cancel-2")]);
    assert!(
        t.second_effects
            .iter()
            .all(|s| s.evidence == EffectEvidence::StaleReport && s.attempt_id == Some(a.id)),
        "{:?}",
        t.second_effects
    );
    assert_eq!(count(&c.events(t.id).await, "second_effect_suspected"), 2);
    for txn in ["po-cancel-1", "po-cancel-2"] {
        assert_eq!(found(&c, by_txn(txn)).await, vec![t.id], "{txn}");
    }
    assert!(
        found(&c, by_effect(SecondEffectFilter::Suspected))
            .await
            .contains(&t.id)
    );
    assert_history(&store, t.id).await;
}

/// An operator's committed resolve is an effect report: it delivers its own
/// id (nothing raised for it) and an earlier late report of another id is
/// raised; search finds the task by the resolve's id.
pub async fn operator_resolve_delivers_its_id_and_raises_earlier_reports(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    let t = c.create(NON_SAFE, &contract(NON_SAFE)).await;
    let a = c.claim_one(NON_SAFE, SHORT_LEASE, t.id).await;
    c.run_out_lease(t.id, "reconciling", |t| t.state == TaskState::Reconciling)
        .await;
    assert_stale(
        c.report(&a, effect(a.generation, Some("late-9"), 1)).await,
        "late",
    );
    let resolution = Resolution::Committed {
        result: json!({"found": true}),
        external_txn_id: Some("op-9".into()),
    };
    let t = ok2(
        store.resolve(Some("acme"), t.id, by, resolution).await,
        "resolve",
    );
    assert_eq!(ids(&t), vec![Some("late-9")]);
    assert_eq!(found(&c, by_txn("op-9")).await, vec![t.id]);
    assert_history(&store, t.id).await;
}

/// An acknowledgment records resolution, reason and actor in its event and
/// the task answer; a second one answers the first and writes nothing; an
/// unknown id and another tenant's task are refused with nothing written.
pub async fn second_effect_acknowledgment_is_audited_and_idempotent(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    let (t, a1, a2) = second_attempt(&c).await;
    c.report_ok(&a2, effect(a2.generation, Some("psp-B"), 1))
        .await;
    assert_stale(
        c.report(&a1, effect(a1.generation, Some("psp-A"), 2)).await,
        "stale A",
    );
    let before = c.events(t.id).await.len();
    let ack = |txn: Option<&str>, by: By, res| {
        let store = store.clone();
        let txn = txn.map(str::to_owned);
        async move {
            store
                .acknowledge_second_effect(Some("acme"), t.id, by, txn, res)
                .await
        }
    };
    let r = must(
        ack(Some("psp-B"), by.clone(), EffectResolution::FalseAlarm).await,
        "ack B",
    );
    assert!(
        matches!(r, Err(Refusal::Operator(Refused::NoSecondEffect { .. }))),
        "{r:?}"
    );
    let r = must(
        ack(None, by.clone(), EffectResolution::FalseAlarm).await,
        "ack null",
    );
    assert!(matches!(
        r,
        Err(Refusal::Operator(Refused::NoSecondEffect { .. }))
    ));
    assert_not_found(
        store
            .acknowledge_second_effect(
                Some("globex"),
                t.id,
                by.clone(),
                Some("psp-A".into()),
                EffectResolution::FalseAlarm,
            )
            .await,
        "another tenant",
    );
    assert_eq!(c.events(t.id).await.len(), before, "refusals write nothing");
    let (task, acked) = ok2(
        ack(Some("psp-A"), by.clone(), EffectResolution::RefundIssued).await,
        "ack A",
    );
    let Some(got) = acked.acknowledgment.clone() else {
        panic!("not acknowledged: {acked:?}");
    };
    assert_eq!(got.resolution, EffectResolution::RefundIssued);
    assert_eq!(got.actor, by.actor);
    assert_eq!(got.reason, by.reason.as_str());
    assert_eq!(task.second_effects, vec![acked.clone()]);
    assert_eq!(task.state, TaskState::Succeeded);
    let events = c.events(t.id).await;
    assert_eq!(events.len(), before + 1);
    let data = json_of(&events[before].data);
    assert_eq!(
        data,
        json!({
            "actor": json_of(&by.actor),
            "external_txn_id": "psp-A",
            "reason": by.reason.as_str(),
            "resolution": "refund_issued",
            "state": "succeeded",
        })
    );
    // Idempotent: another admin's second acknowledgment answers the first.
    let other = admin(&c).await;
    let (_, again) = ok2(
        ack(Some("psp-A"), other, EffectResolution::FalseAlarm).await,
        "ack A again",
    );
    assert_eq!(again, acked);
    assert_eq!(c.events(t.id).await.len(), before + 1, "nothing written");
    assert!(
        found(&c, by_effect(SecondEffectFilter::Unacknowledged))
            .await
            .is_empty()
    );
    assert_eq!(
        found(&c, by_effect(SecondEffectFilter::Suspected)).await,
        vec![t.id]
    );
    assert_eq!(c.task(t.id).await.second_effects, vec![acked]);
    assert_history(&store, t.id).await;
}

/// An acknowledgment and a stale report that raises another second effect,
/// in both orders and at once: both apply, one after the other (the
/// compare-and-set on the task's version orders them), and the history stays
/// gap-free.
pub async fn second_effect_acknowledgment_races_a_report(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let by = admin(&c).await;
    for order in ["ack first", "report first", "at once"] {
        let (t, a1, a2) = second_attempt(&c).await;
        c.report_ok(&a2, effect(a2.generation, Some("d-B"), 1))
            .await;
        assert_stale(
            c.report(&a1, effect(a1.generation, Some("d-A"), 2)).await,
            "stale A",
        );
        let ack = {
            let store = store.clone();
            let by = by.clone();
            async move {
                store
                    .acknowledge_second_effect(
                        Some("acme"),
                        t.id,
                        by,
                        Some("d-A".into()),
                        EffectResolution::ProviderDeduplicated,
                    )
                    .await
            }
        };
        let report = {
            let c = c.clone();
            let a1 = a1.clone();
            async move { c.report(&a1, effect(a1.generation, Some("d-C"), 3)).await }
        };
        match order {
            "ack first" => {
                ok2(ack.await, order);
                assert_stale(report.await, order);
            }
            "report first" => {
                assert_stale(report.await, order);
                ok2(ack.await, order);
            }
            _ => {
                let (acked, reported) = tokio::join!(tokio::spawn(ack), tokio::spawn(report));
                ok2(joined(acked), order);
                assert_stale(joined(reported), order);
            }
        }
        let t = c.task(t.id).await;
        assert_eq!(ids(&t), vec![Some("d-A"), Some("d-C")], "{order}");
        let acks: Vec<Option<&SecondEffect>> = t
            .second_effects
            .iter()
            .map(|s| s.acknowledgment.as_ref().map(|_| s))
            .collect();
        assert!(acks[0].is_some() && acks[1].is_none(), "{order}: {acks:?}");
        let events = c.events(t.id).await;
        assert_eq!(count(&events, "second_effect_acknowledged"), 1, "{order}");
        assert_eq!(count(&events, "second_effect_suspected"), 2, "{order}");
        assert_history(&store, t.id).await;
    }
}

/// Search by `external_txn_id` finds a task by every id any report of its
/// attempts carried, a stale `unknown` or `failed` one included (the
/// evidence holds them); a replayed submission answers the task with its
/// second effects, as a read and a search page do; the task counts its
/// effect reports (none until one arrives).
pub async fn every_reported_id_finds_the_task_and_a_replay_shows_its_second_effects(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let key = format!("key-{}", Uuid::new_v4());
    let sub = || c.submission(SAFE, &key, params(SAFE, 7), &contract(SAFE));
    let t = match c.submit(sub()).await {
        SubmitOutcome::Created(t) => t,
        other => panic!("a fresh key must create a task, got {other:?}"),
    };
    let a1 = c.claim_one(SAFE, SHORT_LEASE, t.id).await;
    c.run_out_lease(t.id, "retry_wait", |t| t.state == TaskState::RetryWait)
        .await;
    let a2 = c.claim_due(SAFE, LONG_LEASE, t.id).await;
    let unknown = rep(a1.generation, Outcome::Unknown).txn("psp-U").build();
    assert_stale(c.report(&a1, unknown).await, "stale unknown");
    let failed = rep(a1.generation, Outcome::Failed)
        .class(FailureClass::Transient)
        .txn("psp-F")
        .build();
    assert_stale(c.report(&a1, failed).await, "stale failed");
    let read = c.task(t.id).await;
    assert_eq!(
        (read.control.effect_report_count, read.second_effects.len()),
        (0, 0),
        "neither report is evidence of an effect"
    );
    for txn in ["psp-U", "psp-F"] {
        assert_eq!(found(&c, by_txn(txn)).await, vec![t.id], "search by {txn}");
    }
    c.report_ok(&a2, effect(a2.generation, Some("psp-B"), 1))
        .await;
    assert_stale(
        c.report(&a1, effect(a1.generation, Some("psp-A"), 2)).await,
        "stale A",
    );
    let read = c.task(t.id).await;
    assert_eq!(ids(&read), vec![Some("psp-A")]);
    assert_eq!(
        (
            read.control.effect_report_count,
            read.control.effect_reports.len()
        ),
        (2, 2)
    );
    match c.submit(sub()).await {
        SubmitOutcome::Replayed(r) => {
            assert_eq!(r.id, t.id);
            assert_eq!(r.second_effects, read.second_effects, "replay");
        }
        other => panic!("the same request must replay, got {other:?}"),
    }
    let replays = must(c.store.submit_batch(vec![sub(), sub()]).await, "batch");
    for r in replays {
        match r {
            SubmitOutcome::Replayed(r) => {
                assert_eq!(r.second_effects, read.second_effects, "batch replay");
            }
            other => panic!("the same request must replay, got {other:?}"),
        }
    }
    // A search page: the task with its second effects beside one without.
    let plain = c.create(SAFE, &contract(SAFE)).await;
    let page = must(
        c.store.search_tasks(&c.tenant, TaskQuery::default()).await,
        "search",
    );
    let shown = |id: Uuid| {
        page.tasks
            .iter()
            .find(|p| p.id == id)
            .map(|p| p.second_effects.clone())
    };
    assert_eq!(shown(t.id), Some(read.second_effects.clone()));
    assert_eq!(shown(plain.id), Some(Vec::new()));
    for txn in ["psp-U", "psp-F", "psp-A", "psp-B"] {
        assert_eq!(found(&c, by_txn(txn)).await, vec![t.id], "search by {txn}");
    }
    let other = Ctx::new(&store, "globex").await;
    assert!(found(&other, by_txn("psp-U")).await.is_empty());
    assert_history(&store, t.id).await;
}
