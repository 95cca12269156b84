//! The mapping of API key and attempt rows to records, and of a task to the
//! values of its columns (the task row's reading is next to its column list
//! in the parent).

use super::*;

pub(super) const API_KEY_COLUMNS: &str =
    "id, tenant, role, operations, created_at, revoked_at, serves";

pub(super) fn api_key_row(r: &Row<'_>) -> rusqlite::Result<ApiKey> {
    Ok(ApiKey {
        id: uuid(&r.get::<_, String>(0)?)?,
        tenant: r.get(1)?,
        role: word::<Role>(&r.get::<_, String>(2)?)?,
        operations: opt_json(r.get(3)?)?,
        created_at: Timestamp(r.get(4)?),
        revoked_at: r.get::<_, Option<i64>>(5)?.map(Timestamp),
        serves: opt_json(r.get(6)?)?,
    })
}

pub(super) const ATTEMPT_COLUMNS: &str = "id, task_id, number, generation, kind, state, executor_id, leased_at, lease_expires_at, \
     lease_ms, usage, external_txn_id, report";

pub(super) fn attempt_row(r: &Row<'_>) -> rusqlite::Result<Attempt> {
    Ok(Attempt {
        id: uuid(&r.get::<_, String>(0)?)?,
        task_id: uuid(&r.get::<_, String>(1)?)?,
        number: r.get(2)?,
        generation: r.get(3)?,
        kind: word::<AttemptKind>(&r.get::<_, String>(4)?)?,
        state: word::<AttemptState>(&r.get::<_, String>(5)?)?,
        executor_id: r.get(6)?,
        leased_at: Timestamp(r.get(7)?),
        lease_expires_at: Timestamp(r.get(8)?),
        lease_ms: r.get(9)?,
        usage: r.get(10)?,
        external_txn_id: r.get(11)?,
        report: applied_report(r.get(12)?)?,
        evidence: Vec::new(),
    })
}

/// Every task column as an SQL value, at its [`Col`] position.
pub(super) fn task_values(t: &Task) -> Result<Vec<rusqlite::types::Value>, StoreError> {
    use rusqlite::types::Value as V;
    let text = |s: &str| V::Text(s.to_owned());
    let opt_text = |s: Option<String>| s.map_or(V::Null, V::Text);
    let opt_int = |i: Option<i64>| i.map_or(V::Null, V::Integer);
    let c = &t.control;
    let columns = [
        (Col::id, V::Text(t.id.to_string())),
        (Col::tenant, text(&c.tenant)),
        (Col::operation, text(&t.operation)),
        (Col::idempotency_key, text(&t.idempotency_key)),
        (Col::fingerprint, text(&t.fingerprint)),
        (Col::canonical_request, text(&c.canonical_request)),
        (Col::params, V::Text(to_json(&t.params)?)),
        (Col::state, text(t.state.as_str())),
        (Col::generation, V::Integer(t.generation)),
        (Col::version, V::Integer(c.version)),
        (Col::event_seq, V::Integer(c.event_seq)),
        (Col::attempt_count, V::Integer(t.attempt_count)),
        (Col::execute_count, V::Integer(c.execute_count)),
        (Col::attempts_granted, V::Integer(c.attempts_granted)),
        (Col::effect_report_count, V::Integer(c.effect_report_count)),
        (Col::usage, V::Integer(t.usage)),
        (
            Col::contract_id,
            V::Blob(t.contract.id().as_bytes().to_vec()),
        ),
        (
            Col::cancellation,
            opt_text(t.cancellation.as_ref().map(to_json).transpose()?),
        ),
        (
            Col::delivery,
            opt_text(t.delivery.as_ref().map(to_json).transpose()?),
        ),
        (
            Col::failure,
            opt_text(t.failure.as_ref().map(to_json).transpose()?),
        ),
        (Col::api_key_id, V::Text(c.api_key_id.to_string())),
        (
            Col::next_kind,
            opt_text(c.next_kind.map(|k| k.as_str().to_owned())),
        ),
        (
            Col::active_attempt_id,
            opt_text(c.active_attempt_id.map(|id| id.to_string())),
        ),
        (Col::ready_at, V::Integer(c.ready_at.0)),
        (Col::deadline_at, V::Integer(c.deadline_at.0)),
        (Col::terminal_at, opt_int(c.terminal_at.map(|t| t.0))),
        (Col::key_expires_at, opt_int(c.key_expires_at.map(|t| t.0))),
        (Col::created_at, V::Integer(t.created_at.0)),
        (Col::updated_at, V::Integer(t.updated_at.0)),
        (
            Col::traceparent,
            opt_text(t.traceparent.as_ref().map(|tp| tp.as_str().to_owned())),
        ),
        (Col::concurrency_key, opt_text(c.concurrency_key.clone())),
        (Col::priority, V::Integer(t.priority)),
        (Col::fairness_key, opt_text(c.fairness_key.clone())),
    ];
    let mut values = vec![V::Null; TASK_COLUMN_COUNT];
    for (col, value) in columns {
        if let Some(slot) = values.get_mut(col.at()) {
            *slot = value;
        }
    }
    Ok(values)
}
