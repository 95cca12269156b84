//! Waiting for a result instead of polling (SPEC §4, "Waiting"): `Prefer:
//! wait=N` on a submit ([`Client::submit_and_wait`]) and on a task read
//! ([`Client::wait_task`]). The server holds the answer until the task is
//! terminal or N seconds (at most [`MAX_WAIT`]) passed, and then answers as
//! usual: the task as it is, terminal or not.

use std::time::Duration;

use reqwest::{Method, RequestBuilder};
use serde_json::Value;
use uuid::Uuid;

use crate::{Client, Result, Submitted, Task, TaskEnvelope};

/// The longest wait the server grants; a longer one is capped to it.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// `rb` with `Prefer: wait=N` (whole seconds, rounded up, at most
/// [`MAX_WAIT`]) and a request timeout of the wait plus `timeout`, so the
/// client does not give up on an answer the server is holding.
pub(crate) fn prefer(
    rb: RequestBuilder,
    wait: Option<Duration>,
    timeout: Duration,
) -> RequestBuilder {
    let Some(wait) = wait else { return rb };
    let wait = wait.min(MAX_WAIT);
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    rb.header("prefer", format!("wait={seconds}"))
        .timeout(Duration::from_secs(seconds) + timeout)
}

impl Client {
    /// Submits like [`Client::submit`] and waits up to `wait` (at most
    /// [`MAX_WAIT`]) for the task to become terminal; a replay waits the
    /// same way. The answer's task is terminal unless the wait ran out.
    ///
    /// # Errors
    /// As [`Client::submit`].
    pub async fn submit_and_wait(
        &self,
        operation: &str,
        params: &Value,
        idempotency_key: &str,
        wait: Duration,
    ) -> Result<Submitted> {
        self.submit_inner(operation, params, idempotency_key, None, Some(wait))
            .await
    }

    /// `GET /v1/tasks/{id}` with `Prefer: wait`: the task once it is
    /// terminal, or as it is after `wait` (at most [`MAX_WAIT`]).
    ///
    /// # Errors
    /// 404 `NOT_FOUND` for no such task (or one of another tenant).
    pub async fn wait_task(&self, task_id: Uuid, wait: Duration) -> Result<Task> {
        let url = self.url(&format!("v1/tasks/{task_id}"))?;
        let rb = prefer(self.request(Method::GET, url), Some(wait), self.timeout);
        let answer = self.send::<TaskEnvelope>(rb).await?;
        Ok(answer.body.task)
    }
}
