//! `Authorization: Bearer <api key>` (SPEC §4 Auth).

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use idem_core::model::{ApiKey, Role};

use crate::AppState;
use crate::problem::Problem;

/// The authenticated, unrevoked API key of the request.
pub struct Caller(pub ApiKey);

impl Caller {
    /// Requires `role` (admin passes every role check).
    pub fn require(&self, role: Role) -> Result<(), Problem> {
        if self.0.has_role(role) {
            Ok(())
        } else {
            Err(Problem::forbidden(format!(
                "this API key has role `{}`; `{role}` is required",
                self.0.role
            )))
        }
    }

    /// The store acting for this key: tasks of classes the key is not granted
    /// are `NOT_FOUND` (existence is not leaked).
    pub fn store(&self, st: &AppState) -> idem_store::Store {
        st.store.granted(self.0.operations.clone())
    }

    /// Requires a grant for `operation`.
    pub fn require_grant(&self, operation: &str) -> Result<(), Problem> {
        if self.0.grants(operation) {
            Ok(())
        } else {
            Err(Problem::forbidden(format!(
                "this API key is not granted operation class `{operation}`"
            )))
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let mut values = parts.headers.get_all(AUTHORIZATION).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return Err(Problem::unauthenticated(
                "send exactly one `Authorization: Bearer <api key>` header",
            ));
        };
        // The scheme is case-insensitive (RFC 9110 §11.1).
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().split_once([' ', '\t']))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                Problem::unauthenticated("expected `Authorization: Bearer <api key>`")
            })?;
        match state.store.authenticate(token).await? {
            Some(key) if key.revoked_at.is_none() => Ok(Caller(key)),
            Some(_) => Err(Problem::unauthenticated("this API key was revoked")),
            None => Err(Problem::unauthenticated("unknown API key")),
        }
    }
}
