//! `GET /console/tasks/{id}/live`: the task page's update stream, Server-Sent
//! Events authenticated by the session cookie (401 without one) and scoped to
//! the signed-in key's tenant and grant (404 for another tenant's task).
//!
//! The stream sends `event: change` with the task's newest event `seq` as
//! its data: once at the start, then whenever that changes; the page then
//! fetches its fragment. It wakes on a committed change of its task heard on
//! the store's change notifications (from any instance), on a resync, or
//! every [`LIVE_RECHECK`] at most (a lost notification costs at most that),
//! reading the task and the session again each time: it ends with
//! `event: end` once the task is terminal, and without a word when the
//! session ends or its key is revoked, the task vanishes from the tenant's
//! view, the store fails, or the server drains.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use idem_store::{Notice, Store, Watch};
use uuid::Uuid;

use super::{Params, no_task, params, task_id};
use crate::session::{SignedIn, Watcher};
use crate::{ConsoleError, ConsoleState};

/// The longest a live stream waits before it reads the task again.
pub const LIVE_RECHECK: Duration = Duration::from_secs(5);

/// A live stream between two reads.
struct Live {
    st: ConsoleState,
    who: SignedIn,
    store: Store,
    watch: Watch,
    id: Uuid,
    /// The newest event `seq` sent; `None` before the first.
    sent: Option<i64>,
    /// Whether the task was terminal at the last read.
    done: bool,
    /// Whether the `end` event was sent.
    finished: bool,
}

/// `GET /console/tasks/{id}/live`.
///
/// # Errors
/// 401 without a session; 404; 503.
pub async fn live(
    State(st): State<ConsoleState>,
    Watcher(who): Watcher,
    raw: Params<String>,
) -> Result<Response, ConsoleError> {
    let id = task_id(&params(raw))?;
    let store = who.store(&st);
    // Before the first read: a change committed after it is heard.
    let watch = st.app.store.changes().subscribe();
    let task = store
        .get_task(Some(who.tenant()), id)
        .await?
        .map_err(|_| no_task())?;
    let first = Live {
        st,
        who,
        store,
        watch,
        id,
        sent: None,
        done: task.state.is_terminal(),
        finished: false,
    };
    let seq = task.control.event_seq;
    let stream = futures::stream::unfold((first, Some(seq)), |(mut live, ready)| async move {
        if live.finished {
            return None;
        }
        let seq = match ready {
            Some(seq) => seq,
            None => live.next_change().await?,
        };
        live.sent = Some(seq);
        let kind = if live.done {
            live.finished = true;
            "end"
        } else {
            "change"
        };
        let event = SseEvent::default().event(kind).data(seq.to_string());
        Some((Ok::<_, Infallible>(event), (live, None)))
    });
    // `no-store` as every console answer (the SSE default is `no-cache`).
    let mut res = Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response();
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(res)
}

impl Live {
    /// Waits for the task's next change and answers its newest event `seq`;
    /// `None` ends the stream.
    async fn next_change(&mut self) -> Option<i64> {
        loop {
            if self.st.app.is_draining() {
                return None;
            }
            self.wait().await;
            if self.st.app.is_draining() {
                return None;
            }
            // The session may have ended, or its key been revoked.
            match self.st.app.store.console_session(&self.who.token).await {
                Ok(Some(_)) => {}
                _ => return None,
            }
            let task = match self.store.get_task(Some(self.who.tenant()), self.id).await {
                Ok(Ok(t)) => t,
                Ok(Err(_)) => return None,
                Err(e) => {
                    tracing::warn!(task_id = %self.id, error = %e, "console live stream ended: store failure");
                    return None;
                }
            };
            self.done = task.state.is_terminal();
            if self.sent != Some(task.control.event_seq) || self.done {
                return Some(task.control.event_seq);
            }
        }
    }

    /// Until a committed change of this task is heard (or a resync), the
    /// server drains, or [`LIVE_RECHECK`] passes.
    async fn wait(&mut self) {
        let deadline = tokio::time::Instant::now() + LIVE_RECHECK;
        let drained = self.st.app.drained();
        tokio::pin!(drained);
        loop {
            tokio::select! {
                () = &mut drained => return,
                () = tokio::time::sleep_until(deadline) => return,
                notice = self.watch.next() => match notice {
                    Notice::Resync => return,
                    Notice::Change(c) => {
                        if c.task_id == self.id && c.tenant == self.who.tenant() {
                            return;
                        }
                    }
                },
            }
        }
    }
}
