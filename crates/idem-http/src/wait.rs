//! Waiting for a result (SPEC §4, "Waiting"): `Prefer: wait=N` (RFC 7240
//! §4.3) on `POST /v1/tasks` and `GET /v1/tasks/{id}` holds the answer until
//! the task is terminal or N seconds (at most [`MAX_WAIT_SECONDS`]) passed,
//! then answers as usual with `Preference-Applied: wait=N`.
//!
//! A waiting request subscribes to the store's committed changes
//! ([`idem_store::changes`]: PostgreSQL `LISTEN/NOTIFY`, so a report accepted
//! by another instance ends the wait; in process on SQLite) and reads the
//! task again when an event that ends a task is heard for it, when
//! notifications may have been lost ([`idem_store::Notice::Resync`]), every
//! [`TASK_RECHECK`] in any case, and once more when the wait runs out. A
//! graceful shutdown ([`crate::AppState::drain`]) ends every wait at once.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use idem_core::model::Task;
use idem_store::{Notice, Store};
use tokio::time::Instant;
use uuid::Uuid;

use crate::{AppResult, AppState};

/// Longest wait a `Prefer: wait` gets, in seconds; a larger N is capped.
pub const MAX_WAIT_SECONDS: u64 = 60;

/// How long a waiting request goes without reading the task again when it
/// heard nothing: what a lost notification costs at most (a lost listening
/// connection makes every waiter read again once it is back, so this covers
/// only what no connection loss announced). Each task adds up to
/// [`RECHECK_JITTER_MS`], so waits begun together do not read together.
pub const TASK_RECHECK: Duration = Duration::from_secs(10);

/// The most a task's re-check is spread beyond [`TASK_RECHECK`], ms.
pub const RECHECK_JITTER_MS: u64 = 2_000;

/// [`TASK_RECHECK`] for task `id`: 10–12 s, the same for every wait on it.
pub fn task_recheck(id: Uuid) -> Duration {
    let jitter = (id.as_u128() as u64) % RECHECK_JITTER_MS;
    TASK_RECHECK + Duration::from_millis(jitter)
}

/// The `Preference-Applied` header (RFC 7240 §3).
pub const PREFERENCE_APPLIED: &str = "preference-applied";

/// The `wait` preference of `headers`, in seconds, capped at
/// [`MAX_WAIT_SECONDS`]; `None` when there is none.
///
/// `Prefer` is a comma-separated list of `token [= word] *(; parameter)`
/// (RFC 7240 §2); the first `wait` whose value is a decimal number of
/// seconds applies. A `wait` that is not a number is ignored, as RFC 7240
/// §2 asks of a preference a server cannot honour. (The `headers` crate
/// leaves `Prefer` unimplemented and no maintained crate parses it.)
pub fn wait_preference(headers: &HeaderMap) -> Option<u64> {
    headers
        .get_all("prefer")
        .iter()
        // A preference with bytes that are not ASCII is one this server does
        // not know; the others still count.
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect::<Vec<_>>()
        .iter()
        .flat_map(|v| v.split(','))
        .filter_map(|pref| {
            let head = pref.split(';').next()?;
            let (name, value) = head.split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("wait") {
                return None;
            }
            let value = value.trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            // All digits: only an overflow fails, and that is more than the cap.
            Some(
                value
                    .parse::<u64>()
                    .unwrap_or(u64::MAX)
                    .min(MAX_WAIT_SECONDS),
            )
        })
        .next()
}

/// Adds `Preference-Applied: wait=N`.
pub fn applied(headers: &mut HeaderMap, seconds: u64) {
    if let Ok(v) = HeaderValue::from_str(&format!("wait={seconds}")) {
        headers.insert(PREFERENCE_APPLIED, v);
    }
}

/// `task` once it is terminal, or as it is after `seconds` (read again at
/// the end), or at once when the server drains. Reads go through `store`
/// for `tenant`; a task that can no longer be read is answered as last read.
///
/// # Errors
/// 503 when a read fails.
pub async fn until_terminal(
    st: &AppState,
    store: &Store,
    tenant: &str,
    task: Task,
    seconds: u64,
) -> AppResult<Task> {
    if task.state.is_terminal() || seconds == 0 || st.is_draining() {
        return Ok(task);
    }
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let id = task.id;
    let mut watch = store.changes().subscribe();
    // Read once more after subscribing: an event committed between the
    // caller's read and the subscription was not heard.
    let mut task = reread(store, tenant, id, task).await?;
    tracing::debug!(task_id = %id, seconds, "task wait holding");
    let drained = st.drained();
    tokio::pin!(drained);
    loop {
        if task.state.is_terminal() {
            return Ok(task);
        }
        let recheck = deadline.min(Instant::now() + task_recheck(id));
        tokio::select! {
            () = &mut drained => return Ok(task),
            notice = watch.next() => match notice {
                Notice::Change(c) if c.task_id != id || !c.kind.ends_task() => continue,
                _ => {}
            },
            () = tokio::time::sleep_until(recheck) => {}
        }
        task = reread(store, tenant, id, task).await?;
        if Instant::now() >= deadline {
            return Ok(task);
        }
    }
}

async fn reread(store: &Store, tenant: &str, id: Uuid, last: Task) -> AppResult<Task> {
    Ok(store.get_task(Some(tenant), id).await?.unwrap_or(last))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(v: &str) -> Option<u64> {
        let mut h = HeaderMap::new();
        h.insert("prefer", HeaderValue::from_str(v).unwrap());
        wait_preference(&h)
    }

    #[test]
    fn wait_is_read_from_the_preference_list_and_capped() {
        assert_eq!(prefer("wait=10"), Some(10));
        assert_eq!(prefer("respond-async, wait=5"), Some(5));
        assert_eq!(prefer("return=minimal; foo=bar, Wait = 7 ;x"), Some(7));
        assert_eq!(prefer("wait=\"3\""), Some(3));
        assert_eq!(prefer("wait=600"), Some(60));
        assert_eq!(prefer("wait=99999999999999999999999"), Some(60));
        assert_eq!(prefer("wait=0"), Some(0));
        assert_eq!(prefer("wait=-1"), None);
        assert_eq!(prefer("wait=1.5"), None);
        assert_eq!(prefer("wait="), None);
        assert_eq!(prefer("waiting=3"), None);
        assert_eq!(prefer("respond-async"), None);
        let mut h = HeaderMap::new();
        h.insert(
            "prefer",
            HeaderValue::from_bytes("wait=1, \u{e9}=1".as_bytes()).unwrap(),
        );
        assert_eq!(wait_preference(&h), Some(1));
        assert_eq!(wait_preference(&HeaderMap::new()), None);
    }
}
