//! `idem task retry-now|cancel|resolve|redrive|acknowledge-effect ID --reason …`: the operator
//! actions of SPEC §4, run on the store directly (any tenant, like the other
//! `idem task` and `idem keys` commands), each one transaction with its
//! event. The actor recorded is the command line and who ran it:
//! `{"type": "cli", "user": U}`, where U is `--actor` when given, else the
//! account name of the process's effective uid (the password database, so
//! it holds under `docker exec` or `kubectl exec`, where `$USER` and
//! `$LOGNAME` are often unset), else `uid:N`. Environment variables are not
//! read: anyone can set them. Prints the task (a cancel: the task and its
//! cancellation; an acknowledgment: the task and the second effect) as
//! JSON; a refused action prints why and exits 1, having
//! changed nothing.

use anyhow::{Result, anyhow, bail};
use clap::{Subcommand, ValueEnum};
use idem_core::machine::operator::{
    Actor, By, ExternalTxnId, MAX_SHORT_TEXT_CHARS, Reason, Resolution, ResolveOutcome,
    is_short_text,
};
use idem_core::model::EffectResolution;
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
        #[command(flatten)]
        by: ByArgs,
    },
    /// Cancel a task as an operator (the client's cancellation, with the reason recorded).
    Cancel {
        /// Task id.
        id: Uuid,
        #[command(flatten)]
        by: ByArgs,
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
        #[command(flatten)]
        by: ByArgs,
    },
    /// Send a `failed` task (transient, attempts_exhausted, deadline_exceeded,
    /// budget_exhausted) back to `queued` with one more execute attempt.
    Redrive {
        /// Task id.
        id: Uuid,
        #[command(flatten)]
        by: ByArgs,
    },
    /// Acknowledge a suspected second effect of a task: record how it was
    /// settled (the task itself does not change). Name it by
    /// `--external-txn-id`, or `--without-id` for the one reported without an id.
    AcknowledgeEffect {
        /// Task id.
        id: Uuid,
        /// The second effect's transaction id, as the task's `second_effects` shows it.
        #[arg(
            long,
            required_unless_present = "without_id",
            conflicts_with = "without_id"
        )]
        external_txn_id: Option<String>,
        /// The second effect reported without a transaction id.
        #[arg(long)]
        without_id: bool,
        /// How it was settled.
        #[arg(long, value_enum)]
        resolution: ResolutionArg,
        #[command(flatten)]
        by: ByArgs,
    },
}

/// `--resolution` of `idem task acknowledge-effect`.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ResolutionArg {
    /// The second effect happened and was refunded.
    #[value(name = "refund_issued")]
    RefundIssued,
    /// The provider deduplicated it: one effect only.
    #[value(name = "provider_deduplicated")]
    ProviderDeduplicated,
    /// No second effect happened.
    #[value(name = "false_alarm")]
    FalseAlarm,
}

/// Who acts and why, on every action.
#[derive(clap::Args)]
pub(crate) struct ByArgs {
    /// Why (1–500 characters, no control characters), recorded in the event.
    #[arg(long)]
    reason: String,
    /// Who acts, recorded in the event (1–200 characters, no control
    /// characters); default: the account name of the process's uid.
    #[arg(long)]
    actor: Option<String>,
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

/// Who runs this command: `--actor`, else the account name of the process's
/// effective uid, else `uid:N`.
fn cli_actor(actor: Option<&str>) -> Result<Actor> {
    let user = match actor {
        Some(a) => {
            if !is_short_text(a) {
                bail!(
                    "--actor must be 1–{MAX_SHORT_TEXT_CHARS} characters, none of them a control character"
                );
            }
            a.to_owned()
        }
        None => whoami::username()
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| format!("uid:{}", rustix::process::geteuid().as_raw())),
    };
    Ok(Actor::Cli { user })
}

fn by(args: &ByArgs) -> Result<By> {
    Ok(By {
        actor: cli_actor(args.actor.as_deref())?,
        reason: Reason::parse(&args.reason).map_err(|e| anyhow!("{e}"))?,
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
        TaskAction::RetryNow { id, by: b } => {
            let task = store.retry_now(None, id, by(&b)?).await?;
            print_json(&task.map_err(|r| refused(id, r))?)
        }
        TaskAction::Cancel { id, by: b } => {
            let (task, cancellation) = store
                .operator_cancel(None, id, by(&b)?)
                .await?
                .map_err(|r| refused(id, r))?;
            print_json(&serde_json::json!({"task": task, "cancellation": cancellation}))
        }
        TaskAction::Resolve {
            id,
            outcome,
            result,
            external_txn_id,
            by: b,
        } => {
            let resolution = resolution(outcome, result, external_txn_id)?;
            let task = store.resolve(None, id, by(&b)?, resolution).await?;
            print_json(&task.map_err(|r| refused(id, r))?)
        }
        TaskAction::Redrive { id, by: b } => {
            let task = store.redrive(None, id, by(&b)?).await?;
            print_json(&task.map_err(|r| refused(id, r))?)
        }
        TaskAction::AcknowledgeEffect {
            id,
            external_txn_id,
            without_id: _,
            resolution,
            by: b,
        } => {
            let txn = external_txn_id
                .as_deref()
                .map(ExternalTxnId::parse)
                .transpose()
                .map_err(|e| anyhow!("--external-txn-id: {e}"))?
                .map(ExternalTxnId::into_string);
            let resolution = match resolution {
                ResolutionArg::RefundIssued => EffectResolution::RefundIssued,
                ResolutionArg::ProviderDeduplicated => EffectResolution::ProviderDeduplicated,
                ResolutionArg::FalseAlarm => EffectResolution::FalseAlarm,
            };
            let (task, effect) = store
                .acknowledge_second_effect(None, id, by(&b)?, txn, resolution)
                .await?
                .map_err(|r| refused(id, r))?;
            print_json(&serde_json::json!({"task": task, "second_effect": effect}))
        }
    }
}

/// The resolution the arguments ask for, under the rules of the HTTP body
/// ([`Resolution::parse`]); `--result` is a JSON document under the API's
/// strict rules.
fn resolution(
    outcome: OutcomeArg,
    result: Option<String>,
    external_txn_id: Option<String>,
) -> Result<Resolution> {
    let result = result
        .map(|text| idem_core::json::parse_strict(text.as_bytes()))
        .transpose()
        .map_err(|e| anyhow!("--result: {e}"))?;
    let outcome = match outcome {
        OutcomeArg::Committed => ResolveOutcome::Committed,
        OutcomeArg::NotCommitted => ResolveOutcome::NotCommitted,
    };
    Resolution::parse(outcome, result, external_txn_id.as_deref()).map_err(|e| anyhow!("{e}"))
}
