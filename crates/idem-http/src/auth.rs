//! `Authorization: Bearer <api key>` (SPEC §4 Auth).

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use std::collections::HashMap;
use std::sync::RwLock;

use axum::http::request::Parts;
use idem_core::model::{ApiKey, Role};
use idem_store::api_key_digest;

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
        let token = bearer_token(&parts.headers)?;
        authenticate(state, token).await.map(Caller)
    }
}

/// The API key of a submit (`POST /v1/tasks`): taken from the process's
/// [`KeyCache`] when this token was authenticated before, else looked up as for
/// [`Caller`]. The store checks the key again inside the submit transaction
/// (`idem_store::ops`, [`SubmitOutcome::KeyRevoked`]), so a key revoked since it
/// was cached is still refused, by the database, before anything is written.
///
/// [`SubmitOutcome::KeyRevoked`]: idem_store::ops::SubmitOutcome::KeyRevoked
pub struct SubmitCaller {
    /// The key as cached or looked up.
    pub caller: Caller,
    /// SHA-256 of the bearer token (the cache's key).
    pub token_hash: [u8; 32],
    /// The bearer token, when the key came from the cache (to confirm it).
    cached_token: Option<String>,
}

impl SubmitCaller {
    /// Whether the key came from this process's cache (not checked against
    /// the database by this request yet).
    pub fn is_cached(&self) -> bool {
        self.cached_token.is_some()
    }

    /// Asks the database whether the key is still valid; a revoked (or gone)
    /// key leaves the cache and gets 401.
    ///
    /// # Errors
    /// 401 when revoked or unknown, 503 when the store fails.
    pub async fn recheck(
        &self,
        state: &AppState,
        headers: &axum::http::HeaderMap,
    ) -> Result<(), Problem> {
        recheck(state, headers).await.inspect_err(|p| {
            if p.status == 401 {
                state.keys.remove(&self.token_hash);
            }
        })
    }

    /// The answer to a request whose operation found this key revoked (or
    /// gone) in its own transaction ([`idem_store::Store::claim_as`],
    /// [`idem_store::Store::report_as`]): 401, and the key leaves the cache.
    pub fn revoked(&self, state: &AppState) -> Problem {
        state.keys.remove(&self.token_hash);
        Problem::unauthenticated("this API key was revoked")
    }

    /// The answer to send instead of `refusal`, a refusal made before the store
    /// checked the key: for a cached key, the database is asked first, and a
    /// key revoked (or gone) since it was cached gets 401 and leaves the cache,
    /// so a revoked key learns nothing else (SPEC §4 Auth). A failing store
    /// answers 503.
    pub async fn confirm(&self, state: &AppState, refusal: Problem) -> Problem {
        let Some(token) = &self.cached_token else {
            return refusal;
        };
        match authenticate(state, token).await {
            Ok(_) => refusal,
            Err(p) => {
                if p.status == 401 {
                    state.keys.remove(&self.token_hash);
                }
                p
            }
        }
    }
}

impl FromRequestParts<AppState> for SubmitCaller {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        // A submit refused here never reaches the handler that counts
        // submits: count it as the handler would (401 or 5xx), without
        // reading its body.
        submit_caller(parts, state).await.inspect_err(|p| {
            crate::service_metrics::count_submit(Err(p));
        })
    }
}

/// The key of an executor's claim (`POST /v1/attempts/claim`, long-polled
/// or not) or report (`POST /v1/attempts/{id}/report`): from this process's
/// [`KeyCache`] when its token was seen before, else from the database. A
/// claim query run with a cached key (or after the claim waited) and a
/// report with a cached key check the key in their own transaction
/// ([`idem_store::Store::claim_as`], [`idem_store::Store::report_as`]), so a
/// claim that finds its group known to be empty and waits costs the database
/// nothing, a revoked key never leases an attempt nor writes a report, and
/// neither costs a lookup of its own.
pub struct ClaimCaller(pub SubmitCaller);

impl FromRequestParts<AppState> for ClaimCaller {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        cached_caller(parts, state, Role::Executor)
            .await
            .map(ClaimCaller)
    }
}

/// The submitting caller: the key from this process's cache when its token
/// was seen before (a key's tenant, role and grant never change; the submit's
/// own transaction checks that it is still live), else from the database.
async fn submit_caller(parts: &Parts, state: &AppState) -> Result<SubmitCaller, Problem> {
    cached_caller(parts, state, Role::Client).await
}

/// The caller from the cache, or from the database (then cached when it has
/// `role`, the role of the requests that read the cache).
async fn cached_caller(
    parts: &Parts,
    state: &AppState,
    role: Role,
) -> Result<SubmitCaller, Problem> {
    let token = bearer_token(&parts.headers)?;
    let token_hash = api_key_digest(token);
    if let Some(key) = state.keys.get(&token_hash) {
        return Ok(SubmitCaller {
            caller: Caller(key),
            token_hash,
            cached_token: Some(token.to_owned()),
        });
    }
    let key = authenticate(state, token).await?;
    // Only keys that may make these requests at all are worth keeping.
    if key.has_role(role) {
        state.keys.insert(token_hash, key.clone());
    }
    Ok(SubmitCaller {
        caller: Caller(key),
        token_hash,
        cached_token: None,
    })
}

/// The token of the one `Authorization: Bearer <token>` header.
fn bearer_token(headers: &axum::http::HeaderMap) -> Result<&str, Problem> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(Problem::unauthenticated(
            "send exactly one `Authorization: Bearer <api key>` header",
        ));
    };
    // The scheme is case-insensitive (RFC 9110 §11.1).
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().split_once([' ', '\t']))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Problem::unauthenticated("expected `Authorization: Bearer <api key>`"))
}

/// Whether the request's key is still known and unrevoked, asked of the
/// database again: a request that waits (a long-poll claim woken for work,
/// an event stream) checks it before it hands out more, so a key revoked
/// while it waited gets no more data (SPEC §4, "Waiting").
///
/// # Errors
/// 401 when the key was revoked (or is gone); 503 when the store fails.
pub(crate) async fn recheck(
    state: &AppState,
    headers: &axum::http::HeaderMap,
) -> Result<(), Problem> {
    authenticate(state, bearer_token(headers)?)
        .await
        .map(|_| ())
}

/// Looks `token` up in the database; only a known, unrevoked key passes.
async fn authenticate(state: &AppState, token: &str) -> Result<ApiKey, Problem> {
    match state.store.authenticate(token).await? {
        Some(key) if key.revoked_at.is_none() => Ok(key),
        Some(_) => Err(Problem::unauthenticated("this API key was revoked")),
        None => Err(Problem::unauthenticated("unknown API key")),
    }
}

/// Most keys a [`KeyCache`] holds; when full it starts again empty.
pub const KEY_CACHE_MAX: usize = 10_000;

/// Unrevoked API keys this process has authenticated, by the SHA-256 of their
/// token (the plain token is never kept). A key's tenant, role and
/// operation grant never change after creation; only `revoked_at` does, and the
/// one path that reads this cache (submit) has the store check revocation in
/// its own transaction. A refused key is removed ([`KeyCache::remove`]).
#[derive(Debug, Default)]
pub struct KeyCache {
    keys: RwLock<HashMap<[u8; 32], ApiKey>>,
}

impl KeyCache {
    /// The cached key of `token_hash`.
    pub fn get(&self, token_hash: &[u8; 32]) -> Option<ApiKey> {
        self.keys.read().ok()?.get(token_hash).cloned()
    }

    /// Caches `key` (an unrevoked key just read from the database).
    pub fn insert(&self, token_hash: [u8; 32], key: ApiKey) {
        if let Ok(mut keys) = self.keys.write() {
            if keys.len() >= KEY_CACHE_MAX {
                keys.clear();
            }
            keys.insert(token_hash, key);
        }
    }

    /// Forgets `token_hash` (its key was refused by the store).
    pub fn remove(&self, token_hash: &[u8; 32]) {
        if let Ok(mut keys) = self.keys.write() {
            keys.remove(token_hash);
        }
    }
}
