//! Liveness and readiness.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use idem_store::StoreError;

use super::wire::Health;
use crate::problem::{Problem, ProblemCode};
use crate::{AppResult, St};

/// Liveness.
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()), responses((status = 200, body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        store: None,
    })
}

/// Readiness: the store answers (and, with `IDEM_REQUIRE_SYNC_STANDBY`, a
/// synchronous standby is attached: else 503 `NO_SYNC_STANDBY`).
#[utoipa::path(get, path = "/readyz", tag = "operations", security(()), responses((status = 200, body = Health), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn readyz(State(st): St) -> AppResult<Json<Health>> {
    // The store answers and its schema is one this binary serves (its own, or
    // a newer one declared compatible with it; SPEC §5); otherwise 503
    // `UNAVAILABLE`, whose `detail` names the database's schema version and
    // this binary's when the schema is the cause.
    if let Some(why) = st.sync_standby_refusal() {
        tracing::warn!(%why, "not ready: no synchronous standby");
        return Err(Problem::no_sync_standby(&why));
    }
    match st.store.ping().await {
        Ok(()) => {}
        Err(StoreError::Migration(detail)) => {
            tracing::warn!(%detail, "not ready: this binary cannot serve the store's schema");
            return Err(Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ProblemCode::Unavailable,
                detail,
            ));
        }
        Err(e) => return Err(e.into()),
    }
    Ok(Json(Health {
        status: "ok".into(),
        store: Some(st.store.kind().into()),
    }))
}
