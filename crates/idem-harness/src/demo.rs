//! `idem-lab demo`: the seeds' payment case, end to end over HTTP, as a readable report.
//!
//! An agent releases a payment through idem; executors carry it out at a
//! simulated payout provider. The scenes show what idem promises when things go
//! wrong, and each one checks the promise:
//!
//! - (a) the agent's answer is lost, it retries with the same key: one task, one payout, one charge;
//! - (b) a retry with a changed amount or payee: 422 `IDEMPOTENCY_CONFLICT`, nothing executed;
//! - (c) an executor pays and crashes before reporting: the lease expires, the task is
//!   reconciled against the provider, the recorded payout is delivered, nothing is paid twice;
//! - (d) a stale executor's late report after its lease expired: 409 `STALE_GENERATION`,
//!   kept as evidence, no effect;
//! - (e) a cancellation that loses to delivery (`too_late`, fee = charge) and one that wins
//!   (`confirmed`, generation raised, a later report of the retired attempt refused);
//! - (f) at a provider without idempotency keys, a partition lets a stale executor pay a second
//!   time: idem raises `second_effect_suspected` from its late report and an operator
//!   acknowledges it (refund issued).
//!
//! Finally the records of every task are audited against the provider's ledger.
//!
//! The demo runs against an in-process idem on a temporary SQLite store, or
//! against a running one (`--url` with a client and an executor key of one
//! tenant that has no other pending `payment.release` work).
//!
//! This file holds the options, the checks and the report; the provider, the
//! target with its flaky link, the stage, the scenes and the closing audit
//! each have a submodule.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_client::{
    AttemptKind, AttemptState, CancelStatus, ClaimedAttempt, Client, ClientError, Contract,
    EffectResolution, ReportBody, SecondEffect, SubmitRetry, Task, TaskState,
};
use idem_core::config::{Config, DEFAULT_TOML};
use idem_core::model::Role;
use idem_core::money::{self, Currency, Money};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use uuid::Uuid;

/// The operation class the demo uses.
const OPERATION: &str = "payment.release";

/// Lease of an executor that is about to crash or stall, ms.
const SHORT_LEASE_MS: u64 = 300;

/// Lease of a healthy executor, ms.
const NORMAL_LEASE_MS: u64 = 10_000;

/// The agent's per-request time limit.
const AGENT_TIMEOUT: Duration = Duration::from_millis(500);

/// How long the demo waits for background work (lease expiry, claims).
const PATIENCE: Duration = Duration::from_secs(10);

/// What to run the demo against.
#[derive(Debug, Clone, Default)]
pub struct DemoOptions {
    /// A running idem (`http://host:port`); `None`: an in-process server on a temporary SQLite store.
    pub url: Option<String>,
    /// Client (or admin) API key for `url`.
    pub client_key: Option<String>,
    /// Executor (or admin) API key for `url`, of the same tenant as `client_key`.
    pub executor_key: Option<String>,
    /// Admin API key for `url`, of the same tenant (scene f's acknowledgment);
    /// `None`: the acknowledgment is left out.
    pub admin_key: Option<String>,
    /// Print each line of the report to stdout as soon as it is written.
    pub echo: bool,
}

/// The invariants the demo checks (SPEC §2, seeds IDEM-01, RETRY-01, CANCEL-01).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// One scope (tenant, operation, key) maps to exactly one task.
    OneScopeOneTask,
    /// A retry with a changed request is refused and executes nothing.
    ConflictExecutedNothing,
    /// At most one payout, one delivery and one charge per task.
    OneDeliveryOneCharge,
    /// After an unknown outcome nothing is paid again before reconciliation.
    ReconcileBeforeRepeat,
    /// A report from an old generation is kept as evidence and changes nothing.
    StaleChangesNothing,
    /// Cancellation and delivery never both win.
    CancelOrDeliverNeverBoth,
    /// A second payment an executor reported is raised as suspected, once.
    SecondEffectRaised,
}

impl Invariant {
    /// Every invariant, in report order.
    pub const ALL: [Invariant; 7] = [
        Invariant::OneScopeOneTask,
        Invariant::ConflictExecutedNothing,
        Invariant::OneDeliveryOneCharge,
        Invariant::ReconcileBeforeRepeat,
        Invariant::StaleChangesNothing,
        Invariant::CancelOrDeliverNeverBoth,
        Invariant::SecondEffectRaised,
    ];

    /// A short plain-language statement.
    pub fn title(self) -> &'static str {
        match self {
            Invariant::OneScopeOneTask => "one idempotency key, one task",
            Invariant::ConflictExecutedNothing => {
                "a changed request under the same key executes nothing"
            }
            Invariant::OneDeliveryOneCharge => "at most one payout, delivery and charge per task",
            Invariant::ReconcileBeforeRepeat => {
                "no repeat payment without reconciliation after an unknown outcome"
            }
            Invariant::StaleChangesNothing => {
                "a stale executor's report is kept but changes nothing"
            }
            Invariant::CancelOrDeliverNeverBoth => "cancellation and delivery never both win",
            Invariant::SecondEffectRaised => {
                "a second payment an executor reported is raised as suspected"
            }
        }
    }
}

/// One checked expectation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The invariant it supports.
    pub invariant: Invariant,
    /// The scene that checked it (`a` … `f`, or `audit`).
    pub scene: String,
    /// Whether it held.
    pub passed: bool,
    /// What was expected, in plain words.
    pub expectation: String,
}

/// The outcome of a demo run.
#[derive(Debug, Clone, Default)]
pub struct DemoReport {
    /// Whether every check held and every scene finished.
    pub passed: bool,
    /// The report, line by line, as printed.
    pub lines: Vec<String>,
    /// Every check made.
    pub checks: Vec<Check>,
    /// Scenes that could not finish, with the reason.
    pub errors: Vec<String>,
}

/// Runs the demo and returns its report (also printed when `opts.echo`).
///
/// # Errors
/// Only when the demo cannot start (no server, missing keys). Failed checks and
/// scenes that break off are reported in [`DemoReport`] instead.
pub async fn run(opts: DemoOptions) -> Result<DemoReport> {
    let target = Target::open(&opts).await?;
    let mut demo = Demo::new(&opts, &target).await?;
    demo.header(&target);

    let scenes: [(&str, &str); 6] = [
        (
            "a",
            "Lost answer: the agent times out and retries with the same key",
        ),
        ("b", "A retry with a changed amount or payee"),
        ("c", "The executor pays, then crashes before reporting"),
        ("d", "A stale executor reports after its lease ran out"),
        ("e", "Cancellation racing delivery"),
        (
            "f",
            "A provider without idempotency keys: a stale executor pays a second time",
        ),
    ];
    for (id, title) in scenes {
        demo.begin(id, title);
        let res = match id {
            "a" => demo.scene_a().await,
            "b" => demo.scene_b().await,
            "c" => demo.scene_c().await,
            "d" => demo.scene_d().await,
            "e" => demo.scene_e().await,
            _ => demo.scene_f().await,
        };
        demo.end(res);
    }
    demo.begin("audit", "Audit of every task against the provider's ledger");
    let res = demo.audit().await;
    demo.end(res);
    demo.cleanup().await;
    demo.summary();
    drop(target);
    Ok(demo.report)
}

mod audit;
mod provider;
mod scenes;
mod second;
mod stage;
mod target;

use provider::*;
use stage::*;
use target::*;

impl std::fmt::Display for DemoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}

/// Turns the report's verdict into a process result: `Err` when a check failed.
///
/// # Errors
/// When the demo did not pass.
pub fn verdict(report: &DemoReport) -> Result<()> {
    if report.passed {
        Ok(())
    } else {
        Err(anyhow!(
            "the demo found {} failed check(s) and {} broken scene(s)",
            report.checks.iter().filter(|c| !c.passed).count(),
            report.errors.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn provider_pays_once_per_task() {
        let p = Provider::default();
        let task = Uuid::now_v7();
        let params = json!({"payee": "x", "amount": 5, "currency": "EUR"});
        let (first, moved) = p.pay(task, Uuid::now_v7(), &params);
        let (second, moved_again) = p.pay(task, Uuid::now_v7(), &params);
        assert!(moved && !moved_again);
        assert_eq!(first, second);
        assert_eq!(p.money_moved(task), 1);
        assert_eq!(p.pay_requests(task), 2);
        assert_eq!(p.lookup(task), Some(first));
        assert_eq!(p.lookup(Uuid::now_v7()), None);
    }

    #[test]
    fn ids_and_money_read_well() {
        let id = Uuid::parse_str("0192f0c4-0000-7000-8000-00000000abcd").unwrap();
        assert_eq!(short(id), "…0000abcd");
        assert_eq!(money(1250, "EUR"), "EUR 12.50");
        assert_eq!(money(5, "EUR"), "EUR 0.05");
        let eur: Contract = serde_json::from_value(json!({
            "price": 100, "fees": {"currency": "EUR", "exponent": 2}
        }))
        .unwrap();
        let none: Contract = serde_json::from_value(json!({"price": 100, "fees": {}})).unwrap();
        assert_eq!(charge(Some(100), &eur), "a charge of EUR 1.00");
        assert_eq!(charge(Some(100), &none), "a charge of 100 minor units");
        assert_eq!(charge(None, &eur), "no charge");
        assert_eq!(cancel_fee(Some(14), &eur), "a cancellation fee of EUR 0.14");
        assert_eq!(cancel_fee(None, &eur), "no cancellation fee");
        assert_eq!(
            too_late(100, &eur),
            "the cancellation fee is the delivery's charge, EUR 1.00, charged once (no second charge)"
        );
        assert_eq!(count(2, "delivery"), "2 deliveries");
        assert_eq!(count(1, "payout"), "1 payout");
        let lines = wrap("one two three four", 12, "  ", "    ");
        assert_eq!(lines, ["  one two", "    three", "    four"]);
    }

    proptest::proptest! {
        /// The demo's words for a charge, a fee and a cancellation that lost
        /// to delivery carry the contract's currency code and exactly its
        /// decimals (or `minor units`), and read back to the amount.
        #[test]
        fn the_demo_s_amounts_carry_their_currency(amount in 0i64..=i64::MAX, which in 0usize..4) {
            let currency = money::testing::currencies().swap_remove(which);
            let fees = currency.as_ref().map_or(json!({}), |c| {
                json!({"currency": c.code, "exponent": c.exponent})
            });
            let contract: Contract =
                serde_json::from_value(json!({"price": amount, "fees": fees})).unwrap();
            let expected = Money::new(amount, currency);
            for words in [
                charge(Some(amount), &contract),
                cancel_fee(Some(amount), &contract),
                too_late(amount, &contract),
            ] {
                proptest::prop_assert_eq!(money::testing::check_rendering(&words, &expected), Ok(()));
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_demo_passes_in_process() {
        let report = run(DemoOptions::default()).await.unwrap();
        println!("{report}");
        assert!(report.passed, "{report}");
        // Amounts, charges and fees carry their units and say which is which.
        let text = report
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for said in [
            "release EUR 12.50 to acct-alice",
            "1 delivery with a charge of EUR 1.00",
            "`too_late`: the cancellation fee is the delivery's charge, EUR 1.00, charged once (no second charge)",
            "`confirmed` with a cancellation fee of EUR 0.14: the fixed fee plus 4 units",
        ] {
            assert!(text.contains(said), "{said:?} in {text}");
        }
    }
}
