//! Liveness and readiness.

use axum::Json;
use axum::extract::State;

use super::wire::Health;
use crate::problem::Problem;
use crate::{AppResult, St};

/// Liveness.
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()), responses((status = 200, body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        store: None,
    })
}

/// Readiness: the store answers.
#[utoipa::path(get, path = "/readyz", tag = "operations", security(()), responses((status = 200, body = Health), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn readyz(State(st): St) -> AppResult<Json<Health>> {
    st.store.ping().await?;
    Ok(Json(Health {
        status: "ok".into(),
        store: Some(st.store.kind().into()),
    }))
}
