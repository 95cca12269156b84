//! The actions of the model's actors (clients, executors, the operator,
//! time) and how a trace names them.

use crate::setup::{OperatorAction, Sent, Setup};
use crate::state::Reported;

/// An action of one actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A client submits under key `key`.
    Submit {
        /// Key index.
        key: u8,
        /// Which request.
        sent: Sent,
    },
    /// The client cancels task `task`.
    Cancel {
        /// Task index.
        task: u8,
    },
    /// The client acknowledges the delivery of task `task`.
    AcknowledgeDelivery {
        /// Task index.
        task: u8,
    },
    /// Executor `executor` claims one attempt.
    Claim {
        /// Executor index.
        executor: u8,
    },
    /// The executor heartbeats its attempt.
    Heartbeat {
        /// Executor index.
        executor: u8,
    },
    /// The executor sends the device acknowledgment of its execute attempt.
    Acknowledge {
        /// Executor index.
        executor: u8,
    },
    /// The executor performs the effect at the provider (within its lease).
    PerformEffect {
        /// Executor index.
        executor: u8,
    },
    /// The executor of a reconcile attempt asks the provider's ledger.
    QueryProvider {
        /// Executor index.
        executor: u8,
    },
    /// The executor reports an outcome (late when its lease ran out).
    Report {
        /// Executor index.
        executor: u8,
        /// What it reports.
        what: Reported,
        /// The answer is lost on the way back: the executor sends the
        /// same report again.
        lost: bool,
    },
    /// The executor whose report's answer was lost sends it again, exactly.
    RepeatReport {
        /// Executor index.
        executor: u8,
    },
    /// The executor gives back an attempt it has not started (a worker
    /// shutting down): an execute attempt before the effect and the device
    /// acknowledgment, a reconcile attempt before it asked the ledger.
    Release {
        /// Executor index.
        executor: u8,
    },
    /// The executor stops working on an attempt whose lease it saw end.
    Abandon {
        /// Executor index.
        executor: u8,
    },
    /// The executor crashes and restarts with nothing (before or after the effect).
    Crash {
        /// Executor index.
        executor: u8,
    },
    /// The clock advances.
    Tick,
    /// The sweeper runs.
    Sweep,
    /// An admin revokes tenant `tenant`'s API key (`idem keys revoke`).
    RevokeKey {
        /// Tenant index.
        tenant: u8,
    },
    /// An operator acts on a task.
    Operator {
        /// Task index.
        task: u8,
        /// The action.
        action: OperatorAction,
    },
}

impl Action {
    /// The actor and the action, e.g. `executor-1: report \`unknown\``.
    pub fn describe(&self, setup: &Setup, tenants: u8) -> String {
        match self {
            Action::Submit { key, sent } => {
                let who = setup.keys.get(usize::from(*key)).map_or_else(
                    || format!("key {key}"),
                    |k| {
                        if tenants > 1 {
                            format!(
                                "{} of {}",
                                k.idempotency_key,
                                crate::setup::TENANTS[usize::from(k.tenant)]
                            )
                        } else {
                            k.idempotency_key.clone()
                        }
                    },
                );
                format!(
                    "client: submit under {who} ({})",
                    match sent {
                        Sent::Original => "the original request",
                        Sent::Changed => "a changed request: same key, other amount",
                        Sent::Reconfigured =>
                            "the original request, fingerprinted after the configuration made the payee material",
                    }
                )
            }
            Action::Cancel { task } => format!("client: cancel task {}", task + 1),
            Action::AcknowledgeDelivery { task } => {
                format!("client: acknowledge the delivery of task {}", task + 1)
            }
            Action::Claim { executor } => format!("executor-{executor}: claim an attempt"),
            Action::Heartbeat { executor } => format!("executor-{executor}: heartbeat"),
            Action::Acknowledge { executor } => {
                format!("executor-{executor}: device acknowledgment (/ack)")
            }
            Action::PerformEffect { executor } => {
                format!("executor-{executor}: perform the effect at the provider")
            }
            Action::QueryProvider { executor } => {
                format!("executor-{executor}: reconcile: ask the provider's ledger")
            }
            Action::Report {
                executor,
                what,
                lost,
            } => format!(
                "executor-{executor}: report `{what}`{}",
                if *lost {
                    " (the answer is lost on the way back)"
                } else {
                    ""
                }
            ),
            Action::RepeatReport { executor } => {
                format!("executor-{executor}: send the same report again")
            }
            Action::RevokeKey { tenant } => format!(
                "admin: revoke the API key of tenant {}",
                crate::setup::TENANTS[usize::from(*tenant) % crate::setup::TENANTS.len()]
            ),
            Action::Release { executor } => {
                format!("executor-{executor}: release the attempt it has not started")
            }
            Action::Abandon { executor } => {
                format!("executor-{executor}: its lease ended; stop working on the attempt")
            }
            Action::Crash { executor } => format!("executor-{executor}: crash"),
            Action::Tick => "clock: advance".to_owned(),
            Action::Sweep => "sweeper: expire leases, wake backoffs, release keys".to_owned(),
            Action::Operator { task, action } => {
                let what = match action {
                    OperatorAction::Resolve => "resolve (as the provider's ledger says)".to_owned(),
                    other => other.to_string(),
                };
                format!("operator: {what} task {}", task + 1)
            }
        }
    }
}
