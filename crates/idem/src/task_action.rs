//! `idem task retry-now|cancel|resolve|redrive ID --reason …`: the operator
//! actions of SPEC §4, run on the store directly (any tenant, like the other
//! `idem task` and `idem keys` commands), each one transaction with its
//! event. The actor recorded is the command line as the operating-system
//! user running it: `{"type": "cli", "user": $USER}` (else `$LOGNAME`, else
//! `unknown`). Prints the task (a cancel: the task and its cancellation) as
//! JSON; a refused action prints why and exits 1, having changed nothing.

use anyhow::{Result, anyhow, bail};
use clap::{Subcommand, ValueEnum};
use idem_core::machine::operator::{Actor, By, Reason, Resolution};
use idem_store::{Refusal, Store};
use uuid::Uuid;

use crate::output::print_json;

/// The operator actions of `idem task`.
#[derive(Subcommand)]
pub(crate) enum TaskAction {
    /// Make a `retry_wait` task claimable at once.
    RetryNow {
        /// Task id.
        id: Uuid,
        /// Why (1–500 characters, no control characters), recorded in the event.
        #[arg(long)]
        reason: String,
    },
    /// Cancel a task as an operator (the client's cancellation, with the reason recorded).
    Cancel {
        /// Task id.
        id: Uuid,
        /// Why (1–500 characters, no control characters), recorded in the event.
        #[arg(long)]
        reason: String,
    },
    /// Settle a `reconciling` task's unknown outcome: `committed` delivers
    /// `--result` once with its charge; `not_committed` lets the next execute
    /// attempt start.
    Resolve {
        /// Task id.
        id: Uuid,
        /// What the external system shows.
        #[arg(long, value_enum)]
        outcome: OutcomeArg,
        /// With `committed`: the result document to deliver (JSON).
        #[arg(long)]
        result: Option<String>,
        /// With `committed`: the external system's transaction id.
        #[arg(long)]
        external_txn_id: Option<String>,
        /// Why (1–500 characters, no control characters), recorded in the event.
        #[arg(long)]
        reason: String,
    },
    /// Send a `failed` task (transient, attempts_exhausted, deadline_exceeded,
    /// budget_exhausted) back to `queued` with one more execute attempt.
    Redrive {
        /// Task id.
        id: Uuid,
        /// Why (1–500 characters, no control characters), recorded in the event.
        #[arg(long)]
        reason: String,
    },
}

/// `--outcome` of `idem task resolve`.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum OutcomeArg {
    /// The effect happened.
    Committed,
    /// The effect did not happen.
    #[value(name = "not_committed")]
    NotCommitted,
}

/// The operating-system user running this command.
fn cli_actor() -> Actor {
    let user = ["USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| "unknown".to_owned());
    Actor::Cli { user }
}

fn by(reason: &str) -> Result<By> {
    Ok(By {
        actor: cli_actor(),
        reason: Reason::parse(reason).map_err(|e| anyhow!("{e}"))?,
    })
}

/// `r`'s refusal as the command's error.
fn refused(id: Uuid, r: Refusal) -> anyhow::Error {
    match r {
        Refusal::NotFound => anyhow!("no task {id}"),
        other => anyhow!("{other}; nothing changed"),
    }
}

/// Runs `action` on `store`.
///
/// # Errors
/// A reason or result that is not valid, a refused action, a failing store.
pub(crate) async fn run(store: &Store, action: TaskAction) -> Result<()> {
    match action {
        TaskAction::RetryNow { id, reason } => {
            let task = store.retry_now(None, id, by(&reason)?).await?;
            print_json(&task.map_err(|r| refused(id, r))?)
        }
        TaskAction::Cancel { id, reason } => {
            let (task, cancellation) = store
                .operator_cancel(None, id, by(&reason)?)
                .await?
                .map_err(|r| refused(id, r))?;
            print_json(&serde_json::json!({"task": task, "cancellation": cancellation}))
        }
        TaskAction::Resolve {
            id,
            outcome,
            result,
            external_txn_id,
            reason,
        } => {
            let resolution = resolution(outcome, result, external_txn_id)?;
            let task = store.resolve(None, id, by(&reason)?, resolution).await?;
            print_json(&task.map_err(|r| refused(id, r))?)
        }
        TaskAction::Redrive { id, reason } => {
            let task = store.redrive(None, id, by(&reason)?).await?;
            print_json(&task.map_err(|r| refused(id, r))?)
        }
    }
}

/// The resolution the arguments ask for, under the rules of the HTTP body.
fn resolution(
    outcome: OutcomeArg,
    result: Option<String>,
    external_txn_id: Option<String>,
) -> Result<Resolution> {
    match outcome {
        OutcomeArg::Committed => {
            let Some(text) = result else {
                bail!("`--outcome committed` needs `--result` (the JSON document to deliver)");
            };
            let result = idem_core::json::parse_strict(text.as_bytes())
                .map_err(|e| anyhow!("--result: {e}"))?;
            if let Some(t) = &external_txn_id
                && (t.is_empty() || t.chars().count() > 200 || t.chars().any(char::is_control))
            {
                bail!(
                    "--external-txn-id must be 1–200 characters, none of them a control character"
                );
            }
            Ok(Resolution::Committed {
                result,
                external_txn_id,
            })
        }
        OutcomeArg::NotCommitted => {
            if result.is_some() || external_txn_id.is_some() {
                bail!(
                    "`--outcome not_committed` delivers nothing: give neither --result nor --external-txn-id"
                );
            }
            Ok(Resolution::NotCommitted)
        }
    }
}
