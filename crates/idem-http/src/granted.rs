//! Leases granted to a claim whose answer never reached its executor are
//! released at once (SPEC §4 "Releasing an attempt"): nobody can have
//! started those attempts, so waiting out their leases (and, on a non-safe
//! class, reconciling them) would only delay the work.
//!
//! A claim's answer can be lost in two places, and both end in a
//! [`Granted`] being dropped while it still holds attempts:
//! - **The request future is dropped while the claim query runs.** hyper
//!   drops a request's future when its client closes the connection (an
//!   end of stream while the request is in flight), but the store runs the
//!   query on its own task and commits it all the same. So [`claim`] runs
//!   the query on a task of its own, which receives the committed answer
//!   and hands it to the request; when the request is gone the hand-over
//!   fails and the answer, with its [`Granted`], is dropped there.
//! - **The answer is not written.** The handler returned, but the
//!   connection ended before hyper took the answer's body. The [`Granted`]
//!   travels in the body ([`GrantedBody`]), which lets it go only when hyper
//!   has taken the last of the body's bytes.
//!
//! A release is the fenced `release` transition: one that races a report of
//! an executor who did get the answer (a body handed to the connection is
//! never released, so only an answer that was lost in the kernel's buffers
//! can) is refused and changes nothing. A release that fails (the store is
//! unavailable) leaves the lease to run out, as before.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use idem_store::ops::{ClaimRequest, Claimed};
use idem_store::{Store, StoreError};
use uuid::Uuid;

/// The attempts one claim leased: released when dropped, unless their answer
/// was handed to the connection ([`Granted::handed_over`]).
#[derive(Debug)]
pub(crate) struct Granted {
    store: Store,
    tenant: String,
    /// `(attempt id, generation)` of each attempt still to release.
    attempts: Vec<(Uuid, i64)>,
}

impl Granted {
    fn new(store: Store, tenant: String, claimed: &[Claimed]) -> Granted {
        let attempts = claimed
            .iter()
            .map(|c| (c.attempt.id, c.attempt.generation))
            .collect();
        Granted {
            store,
            tenant,
            attempts,
        }
    }

    /// The answer reached the connection: nothing is released.
    fn handed_over(&mut self) {
        self.attempts.clear();
    }
}

impl Drop for Granted {
    fn drop(&mut self) {
        if self.attempts.is_empty() {
            return;
        }
        let attempts = std::mem::take(&mut self.attempts);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                attempts = attempts.len(),
                "a claim's answer was lost outside a runtime; its leases run out instead"
            );
            return;
        };
        let store = self.store.clone();
        let tenant = std::mem::take(&mut self.tenant);
        runtime.spawn(async move {
            for (attempt_id, generation) in attempts {
                match store.release(&tenant, attempt_id, generation).await {
                    Ok(Ok(_)) => tracing::info!(
                        %attempt_id,
                        generation,
                        "released an attempt whose claim answer never reached its executor"
                    ),
                    Ok(Err(refusal)) => tracing::debug!(
                        %attempt_id,
                        generation,
                        %refusal,
                        "an attempt whose claim answer was lost was not released"
                    ),
                    Err(e) => tracing::warn!(
                        %attempt_id,
                        generation,
                        error = %e,
                        "could not release an attempt whose claim answer was lost; its lease runs out instead"
                    ),
                }
            }
        });
    }
}

/// Runs the claim query of `req` on `store` on a task of its own, so that
/// the attempts it leases are released when the request that asked is gone
/// before it hears of them (module docs). With `key`, the claim's
/// transaction first checks that this executor key is still live
/// ([`Store::claim_as`]): `None`, nothing leased, when it is not.
///
/// # Errors
/// The store's failure ([`StoreError`]); nothing was leased.
pub(crate) async fn claim(
    store: &Store,
    req: ClaimRequest,
    key: Option<uuid::Uuid>,
) -> Result<Option<(Vec<Claimed>, Granted)>, StoreError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let store = store.clone();
    // In the request's span, so the store's span is its child as for any
    // other store call.
    let span = tracing::Span::current();
    let task = async move {
        let tenant = req.tenant.clone();
        let claimed = match key {
            Some(key) => store.claim_as(key, req).await,
            None => store.claim(req).await.map(Some),
        };
        let answer = claimed.map(|claimed| {
            claimed.map(|claimed| {
                let granted = Granted::new(store.clone(), tenant, &claimed);
                (claimed, granted)
            })
        });
        // A request that is gone drops the answer here: its `Granted`
        // releases the attempts.
        let _ = tx.send(answer);
    };
    tokio::spawn(tracing::Instrument::instrument(task, span));
    rx.await.unwrap_or_else(|_| {
        Err(StoreError::Unavailable(
            "the claim query's task ended without an answer".to_owned(),
        ))
    })
}

/// `answer` with `granted` carried in its body until hyper has taken the
/// whole body: a response dropped before that releases the attempts.
pub(crate) fn answer_with(answer: impl IntoResponse, granted: Granted) -> Response {
    answer.into_response().map(|inner| {
        Body::new(GrantedBody {
            inner,
            granted: Some(granted),
        })
    })
}

/// A response body holding the [`Granted`] attempts it answers with, handed
/// over once its last frame was taken.
struct GrantedBody {
    inner: Body,
    granted: Option<Granted>,
}

impl http_body::Body for GrantedBody {
    type Data = <Body as http_body::Body>::Data;
    type Error = <Body as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        let whole = match &frame {
            None => true,
            Some(Ok(_)) => http_body::Body::is_end_stream(&self.inner),
            Some(Err(_)) => false,
        };
        if whole && let Some(mut granted) = self.granted.take() {
            granted.handed_over();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use idem_core::model::{AttemptState, Role};
    use idem_store::conformance::{NON_SAFE, contract, params, submission};
    use idem_store::ops::SubmitOutcome;

    use super::*;

    /// A store with one task of the non-safe class, in a temporary directory.
    async fn store_with_a_task(dir: &tempfile::TempDir) -> (Store, Uuid) {
        let store =
            idem_store_sqlite::open(dir.path().join("idem.db"), Default::default()).unwrap();
        let (key, _) = store
            .create_api_key("acme", Role::Client, None)
            .await
            .unwrap();
        let s = submission(
            "acme",
            NON_SAFE,
            "k1",
            params(NON_SAFE, 1),
            contract(NON_SAFE),
            &key,
        );
        let SubmitOutcome::Created(task) = store.submit(s).await.unwrap() else {
            panic!("a new key creates a task");
        };
        (store, task.id)
    }

    fn request() -> ClaimRequest {
        ClaimRequest {
            tenant: "acme".to_owned(),
            operations: vec![NON_SAFE.to_owned()],
            executor_id: "ex".to_owned(),
            max: 1,
            lease_ms: None,
            flow: Default::default(),
        }
    }

    async fn state(store: &Store, task: Uuid) -> AttemptState {
        let attempts = store.list_attempts(None, task).await.unwrap().unwrap();
        attempts[0].state
    }

    /// An answer dropped before hyper took its body (the connection ended
    /// first) releases its attempt; one whose body was taken does not.
    #[tokio::test]
    async fn an_answer_never_taken_releases_its_attempts() {
        let dir = tempfile::tempdir().unwrap();
        let (store, task) = store_with_a_task(&dir).await;
        let (claimed, granted) = claim(&store, request(), None).await.unwrap().unwrap();
        assert_eq!(claimed.len(), 1);
        drop(answer_with("the answer", granted));
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while state(&store, task).await != AttemptState::Released {
            assert!(tokio::time::Instant::now() < deadline, "never released");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }

        let (claimed, granted) = claim(&store, request(), None).await.unwrap().unwrap();
        assert_eq!(claimed[0].attempt.generation, 2);
        let body = answer_with("the answer", granted).into_body();
        let bytes = http_body_util::BodyExt::collect(body).await.unwrap();
        assert_eq!(bytes.to_bytes(), "the answer");
        // A release would have been spawned when the body was dropped and
        // would reach the store's writer first: the heartbeat finds the
        // lease held.
        tokio::task::yield_now().await;
        let a = &claimed[0].attempt;
        let ack = store.heartbeat("acme", a.id, a.generation, None).await;
        assert!(matches!(ack, Ok(Ok(_))), "{ack:?}");
        let read = store.list_attempts(None, task).await.unwrap().unwrap();
        assert_eq!(read[1].state, AttemptState::Leased);
    }
}
