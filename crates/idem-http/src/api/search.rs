//! `GET /v1/tasks`: a tenant's tasks, newest first, filtered and in pages
//! (SPEC §4 "Task search"); with `idempotency_key`, the lookup by scope
//! ([`super::tasks::lookup_task`]) instead.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, RawQuery, State};
use axum::response::{IntoResponse, Response};
use idem_core::model::{Role, TaskState, Timestamp};
#[cfg(test)]
use idem_store::ops::search::TaskCursor;
use idem_store::ops::search::{CursorKey, DEFAULT_LIMIT, MAX_LIMIT, SecondEffectFilter, TaskQuery};
use serde::Serialize;
use utoipa::{IntoParams, ToSchema};

use super::unknown_operation;
use super::wire::{LookupQuery, TaskEnvelope, TasksPage};
use crate::auth::Caller;
use crate::problem::{Problem, shorten};
use crate::{AppResult, St};
use idem_core::machine::operator::ExternalTxnId;

/// The query of `GET /v1/tasks` (for the OpenAPI document; read by
/// [`read_query`]). With `idempotency_key` it is a lookup by scope and
/// `operation` is required; without, a search.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct TasksQuery {
    /// Operation class (required with `idempotency_key`; else a filter).
    operation: Option<String>,
    /// Idempotency key of a lookup by scope (1–255 visible ASCII); absent
    /// for a search.
    #[param(pattern = "^[!-~]{1,255}$")]
    idempotency_key: Option<String>,
    /// Only tasks in one of these states (repeat the parameter for several).
    #[param(value_type = Option<Vec<TaskState>>, explode, style = Form)]
    state: Option<Vec<String>>,
    /// Only tasks accepted strictly after this instant (RFC 3339).
    #[param(value_type = Option<String>, format = DateTime)]
    created_after: Option<String>,
    /// Only tasks accepted strictly before this instant (RFC 3339).
    #[param(value_type = Option<String>, format = DateTime)]
    created_before: Option<String>,
    /// Only idempotency keys starting with this text (1–255 visible ASCII;
    /// no character is a wildcard).
    #[param(pattern = "^[!-~]{1,255}$")]
    idempotency_key_prefix: Option<String>,
    /// Only tasks any of whose attempts reported this provider transaction
    /// id (applied, stale, late or duplicate evidence, or an operator's
    /// resolve; 1–200 characters, none of them a control character: what a
    /// report takes, SPEC §7).
    #[param(min_length = 1, max_length = 200)]
    external_txn_id: Option<String>,
    /// Only tasks with a suspected second effect (`suspected`), or with one
    /// no operator acknowledged yet (`unacknowledged`).
    #[param(pattern = "^(suspected|unacknowledged)$")]
    second_effect: Option<String>,
    /// Page size, 1–200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    limit: Option<u32>,
    /// The previous page's `next_cursor` (opaque).
    cursor: Option<String>,
}

/// The answer of `GET /v1/tasks`: a page (a search) or `{"task"}` (a lookup).
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum TasksAnswer {
    /// A search's page.
    Page(TasksPage),
    /// A lookup's task.
    Task(Box<TaskEnvelope>),
}

/// Search the caller's tenant's tasks, newest first, or look one up by scope.
#[utoipa::path(get, path = "/v1/tasks", tag = "tasks", params(TasksQuery),
    responses((status = 200, description = "a search's page `{tasks, next_cursor}`, or with `idempotency_key` the task `{task}`", body = TasksAnswer), (status = 400, description = "INVALID_REQUEST: an unknown state or parameter, a bad timestamp, cursor or limit", body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 404, description = "a lookup whose scope has no task", body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn list_tasks(
    State(st): St,
    caller: Caller,
    RawQuery(raw): RawQuery,
    lookup: Result<Query<LookupQuery>, QueryRejection>,
) -> AppResult<Response> {
    let raw = raw.unwrap_or_default();
    let pairs: Vec<(String, String)> = form_urlencoded::parse(raw.as_bytes())
        .into_owned()
        .collect();
    if pairs.iter().any(|(k, _)| k == "idempotency_key") {
        let Json(found) = super::tasks::lookup_task(State(st), caller, lookup).await?;
        return Ok(Json(TasksAnswer::Task(Box::new(found))).into_response());
    }
    caller.require(Role::Client)?;
    let store = caller.store(&st);
    let key = store.cursor_key().await?;
    let query = read_query(&pairs, &key, &caller.0.tenant)?;
    if let Some(op) = &query.operation {
        if !st.config.operations.contains_key(op) {
            return Err(unknown_operation(&st, op));
        }
        caller.require_grant(op)?;
    }
    let page = store.search_tasks(&caller.0.tenant, query).await?;
    Ok(Json(TasksAnswer::Page(TasksPage {
        tasks: page.tasks,
        next_cursor: page.next_cursor.map(|c| key.seal(&caller.0.tenant, &c)),
    }))
    .into_response())
}

/// The search of `pairs` (a query string's decoded pairs) for `tenant`; a
/// `cursor` is opened with the store's cursor key `key`
/// ([`idem_store::Store::cursor_key`]).
///
/// # Errors
/// 400 `INVALID_REQUEST` for an unknown parameter, a repeated one other than
/// `state`, an unknown state, a timestamp that is not RFC 3339, a limit
/// outside 1–200, a cursor not given out by an instance of this store to this
/// tenant, an empty or malformed prefix, or a transaction id a report would
/// not take (1–200 characters, no control character).
pub fn read_query(
    pairs: &[(String, String)],
    key: &CursorKey,
    tenant: &str,
) -> Result<TaskQuery, Problem> {
    let mut q = TaskQuery::default();
    let mut seen: Vec<&str> = Vec::new();
    for (k, v) in pairs {
        if k != "state" {
            if seen.contains(&k.as_str()) {
                return Err(Problem::invalid(format!(
                    "`{}` is given more than once (only `state` repeats)",
                    shorten(k)
                )));
            }
            seen.push(k);
        }
        match k.as_str() {
            "state" => q.states.push(v.parse().map_err(|_| {
                let all: Vec<&str> = TaskState::ALL.iter().map(|s| s.as_str()).collect();
                Problem::invalid(format!(
                    "unknown state `{}`; states: {}",
                    shorten(v),
                    all.join(", ")
                ))
            })?),
            "operation" => q.operation = Some(v.clone()),
            "created_after" => q.created_after = Some(instant(k, v, Rounding::Down)?),
            "created_before" => q.created_before = Some(instant(k, v, Rounding::Up)?),
            "idempotency_key_prefix" => {
                if v.is_empty() || v.len() > 255 || !v.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(Problem::invalid(
                        "`idempotency_key_prefix` must be 1–255 visible ASCII characters",
                    ));
                }
                q.idempotency_key_prefix = Some(v.clone());
            }
            "external_txn_id" => {
                // The rule of the reports that store these ids: one the
                // report would refuse can match no task.
                ExternalTxnId::parse(v).map_err(|e| Problem::invalid(e.to_string()))?;
                q.external_txn_id = Some(v.clone());
            }
            "second_effect" => {
                q.second_effect = Some(SecondEffectFilter::parse(v).ok_or_else(|| {
                    Problem::invalid(format!(
                        "`second_effect` must be `suspected` or `unacknowledged`, not `{}`",
                        shorten(v)
                    ))
                })?);
            }
            "limit" => {
                q.limit = v
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| {
                        Problem::invalid(format!(
                            "`limit` must be an integer from 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT}), not `{}`",
                            shorten(v)
                        ))
                    })?;
            }
            "cursor" => {
                q.cursor = Some(key.open(tenant, v).map_err(|e| {
                    Problem::invalid(format!("{e} (pass a page's `next_cursor` as it is)"))
                })?);
            }
            other => {
                return Err(Problem::invalid(format!(
                    "unknown parameter `{}`; a search takes state, operation, created_after, created_before, idempotency_key_prefix, external_txn_id, second_effect, limit and cursor",
                    shorten(other)
                )));
            }
        }
    }
    Ok(q)
}

/// Which way an instant finer than a millisecond is rounded to one.
#[derive(Clone, Copy)]
enum Rounding {
    /// `created_after`: `created_at > floor(t)` keeps exactly the tasks after `t`.
    Down,
    /// `created_before`: `created_at < ceil(t)` keeps exactly the tasks before `t`.
    Up,
}

/// Parameter `name`'s RFC 3339 instant `v`, as epoch ms.
fn instant(name: &str, v: &str, rounding: Rounding) -> Result<Timestamp, Problem> {
    let bad = || {
        Problem::invalid(format!(
            "`{name}` must be an RFC 3339 date-time such as 2026-12-01T09:30:00Z, not `{}`",
            shorten(v)
        ))
    };
    let t = time::OffsetDateTime::parse(v, &time::format_description::well_known::Rfc3339)
        .map_err(|_| bad())?;
    let nanos = t.unix_timestamp_nanos();
    let ms = match rounding {
        Rounding::Down => nanos.div_euclid(1_000_000),
        Rounding::Up => -(-nanos).div_euclid(1_000_000),
    };
    i64::try_from(ms).map(Timestamp).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Result<TaskQuery, Problem> {
        let pairs: Vec<(String, String)> =
            form_urlencoded::parse(s.as_bytes()).into_owned().collect();
        read_query(&pairs, &key(), "acme")
    }

    fn key() -> CursorKey {
        CursorKey::new(&[3; 32]).unwrap()
    }

    #[test]
    fn reads_every_filter() {
        let c = TaskCursor {
            created_at: Timestamp(5),
            id: uuid::Uuid::nil(),
        };
        let got = q(&format!(
            "state=queued&state=failed&operation=payment.release&created_after=2026-12-01T00:00:00.0015Z\
             &created_before=2026-12-01T00:00:00.0015Z&idempotency_key_prefix=pay%25_&external_txn_id=tx-1\
             &second_effect=unacknowledged&limit=200&cursor={}",
            key().seal("acme", &c)
        ))
        .unwrap();
        assert_eq!(got.states, [TaskState::Queued, TaskState::Failed]);
        assert_eq!(got.operation.as_deref(), Some("payment.release"));
        let base = 1_796_083_200_000;
        assert_eq!(got.created_after, Some(Timestamp(base + 1)));
        assert_eq!(got.created_before, Some(Timestamp(base + 2)));
        assert_eq!(got.idempotency_key_prefix.as_deref(), Some("pay%_"));
        assert_eq!(got.external_txn_id.as_deref(), Some("tx-1"));
        assert_eq!(got.second_effect, Some(SecondEffectFilter::Unacknowledged));
        assert_eq!(
            q("second_effect=suspected").unwrap().second_effect,
            Some(SecondEffectFilter::Suspected)
        );
        assert_eq!(got.limit, 200);
        assert_eq!(got.cursor, Some(c));
        assert_eq!(q("").unwrap(), TaskQuery::default());
    }

    #[test]
    fn refuses_bad_values() {
        for bad in [
            "state=done",
            "created_after=yesterday",
            "created_before=2026-12-01",
            "limit=0",
            "limit=201",
            "limit=ten",
            "cursor=abc",
            "idempotency_key_prefix=",
            "idempotency_key_prefix=caf%C3%A9",
            "external_txn_id=",
            "external_txn_id=%00",
            "external_txn_id=tx%0A",
            "external_txn_id=tx%C2%85",
            "second_effect=",
            "second_effect=yes",
            "second_effect=Suspected",
            "limit=5&limit=6",
            "states=queued",
        ] {
            let p = q(bad).unwrap_err();
            assert_eq!(p.status, 400, "{bad}");
        }
        let longest = "é".repeat(200);
        assert_eq!(
            q(&format!("external_txn_id={longest}"))
                .unwrap()
                .external_txn_id,
            Some(longest.clone())
        );
        assert_eq!(
            q(&format!("external_txn_id={longest}x"))
                .unwrap_err()
                .status,
            400
        );
    }
}
