//! `idem task`: a task, its events and attempts (any tenant), and a tenant's
//! tasks in pages (`task list`, the search of `GET /v1/tasks` with the same
//! filters and checks), and the operator actions ([`crate::task_action`]),
//! each through the store.

use anyhow::{Context, Result, anyhow};
use clap::{Args, Subcommand};
use idem_store::Store;
use uuid::Uuid;

use std::path::PathBuf;

use idem_server::output::say;

use crate::config::read_config;
use crate::output::print_json;

/// `idem task …`.
#[derive(Subcommand)]
pub(crate) enum TaskCommand {
    /// The task as JSON, or with `--summary` as lines for people.
    Show {
        /// Task id.
        id: Uuid,
        /// Lines instead of JSON: state, the class's display fields, the
        /// delivery's charge and the cancellation's fee with their currency.
        #[arg(long)]
        summary: bool,
        /// TOML configuration whose `[display]` fields `--summary` shows,
        /// as `serve`'s; default: the bundled one.
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
    },
    /// The event history as JSON.
    Events {
        /// Task id.
        id: Uuid,
    },
    /// Attempts with evidence as JSON.
    Attempts {
        /// Task id.
        id: Uuid,
    },
    /// One page of a tenant's tasks, newest first, as JSON
    /// `{"tasks": [...], "next_cursor": ...}` (SPEC §4 "Task search"), or
    /// with `--table` as columns.
    List(ListArgs),
    #[command(flatten)]
    Action(crate::task_action::TaskAction),
}

/// The filters of `idem task list` (those of `GET /v1/tasks`).
#[derive(Args)]
pub(crate) struct ListArgs {
    /// The tenant whose tasks are listed.
    #[arg(long)]
    tenant: String,
    /// Only tasks in this state (repeat for several).
    #[arg(long)]
    state: Vec<String>,
    /// Only this operation class.
    #[arg(long)]
    operation: Option<String>,
    /// Only tasks accepted strictly after this instant (RFC 3339).
    #[arg(long)]
    created_after: Option<String>,
    /// Only tasks accepted strictly before this instant (RFC 3339).
    #[arg(long)]
    created_before: Option<String>,
    /// Only idempotency keys starting with this text (no wildcards).
    #[arg(long)]
    idempotency_key_prefix: Option<String>,
    /// Only tasks any of whose attempts reported this provider transaction id.
    #[arg(long)]
    external_txn_id: Option<String>,
    /// Only tasks with a suspected second effect: `suspected` (any) or
    /// `unacknowledged`.
    #[arg(long)]
    second_effect: Option<String>,
    /// The tenant's queues instead of its tasks: per class with waiting
    /// tasks, the depth and the longest, median and 99th-percentile waits
    /// (`GET /v1/queues`); the other filters do not apply.
    #[arg(long)]
    queues: bool,
    /// Columns instead of JSON: id, class, state, the classes' display
    /// fields, the charge and the cancellation fee with their currency.
    #[arg(long)]
    table: bool,
    /// TOML configuration whose `[display]` fields `--table` shows, as
    /// `serve`'s; default: the bundled one.
    #[arg(long, env = "IDEM_CONFIG")]
    config: Option<PathBuf>,
    /// Page size, 1–200 (default 50).
    #[arg(long)]
    limit: Option<String>,
    /// The previous page's `next_cursor`.
    #[arg(long)]
    cursor: Option<String>,
}

impl ListArgs {
    /// The arguments as the query pairs of `GET /v1/tasks`.
    fn pairs(self) -> Vec<(String, String)> {
        let mut pairs: Vec<(String, String)> = self
            .state
            .into_iter()
            .map(|s| ("state".into(), s))
            .collect();
        for (name, value) in [
            ("operation", self.operation),
            ("created_after", self.created_after),
            ("created_before", self.created_before),
            ("idempotency_key_prefix", self.idempotency_key_prefix),
            ("external_txn_id", self.external_txn_id),
            ("second_effect", self.second_effect),
            ("limit", self.limit),
            ("cursor", self.cursor),
        ] {
            if let Some(v) = value {
                pairs.push((name.into(), v));
            }
        }
        pairs
    }
}

/// Runs `command` on `store`.
///
/// # Errors
/// No such task; a bad filter (the HTTP API's 400 detail); storage failures.
pub(crate) async fn run(store: &Store, command: TaskCommand) -> Result<()> {
    match command {
        TaskCommand::Show {
            id,
            summary,
            config,
        } => {
            let task = store
                .get_task(None, id)
                .await?
                .map_err(|_| anyhow!("no task {id}"))?;
            if summary {
                let config = read_config(config.as_ref())?;
                Ok(say(crate::task_text::summary(&task, &config))?)
            } else {
                print_json(&task)
            }
        }
        TaskCommand::Events { id } => print_json(
            &store
                .list_events(None, id)
                .await?
                .map_err(|_| anyhow!("no task {id}"))?,
        ),
        TaskCommand::Attempts { id } => print_json(
            &store
                .list_attempts(None, id)
                .await?
                .map_err(|_| anyhow!("no task {id}"))?,
        ),
        TaskCommand::List(args) => {
            let tenant = args.tenant.clone();
            let table = args.table;
            if args.queues {
                let q = store.task_queues(&tenant).await?;
                if table {
                    return Ok(say(crate::task_text::queue_table(&q.queues))?);
                }
                return print_json(&serde_json::json!({"now": q.now, "queues": q.queues}));
            }
            let config = args.config.clone();
            let key = store.cursor_key().await?;
            let query = idem_http::read_task_query(&args.pairs(), &key, &tenant)
                .map_err(|p| anyhow!("{}", p.detail))?;
            let page = store.search_tasks(&tenant, query).await?;
            if table {
                let config = read_config(config.as_ref())?;
                say(crate::task_text::table(&page.tasks, &config))?;
                if let Some(c) = page.next_cursor {
                    say(format!("next cursor: {}", key.seal(&tenant, &c)))?;
                }
                return Ok(());
            }
            print_json(&idem_api::TasksPage {
                tasks: page.tasks,
                next_cursor: page.next_cursor.map(|c| key.seal(&tenant, &c)),
            })
        }
        TaskCommand::Action(action) => {
            // A store that went back in time is rewound before an operator
            // changes a task in it (SPEC §2.11).
            store
                .check_identity()
                .await
                .context("checking the store's identity")?;
            crate::task_action::run(store, action).await
        }
    }
}
