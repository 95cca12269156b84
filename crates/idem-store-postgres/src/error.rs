//! Mapping of driver and pool errors to [`StoreError`].

use std::error::Error as _;

use idem_store::StoreError;
use tokio_postgres::error::SqlState;

use crate::target::Target;

/// Maps a tokio-postgres error to a [`StoreError`]:
///
/// - serialization failure (`40001`), deadlock (`40P01`) and unique violation
///   (`23505`, a concurrent writer got there first) → [`StoreError::Contention`]
///   (the whole transaction is run again);
/// - text PostgreSQL cannot hold (`22021` a NUL character, `22P05` a character
///   with no equivalent in the database's encoding) and program limits
///   exceeded (`54…`, e.g. an index row too large) → [`StoreError::Rejected`]
///   (the values can never be stored: 400, not a corrupt store);
/// - other data exceptions (`22…`), other integrity violations (`23…`,
///   including the append-only triggers) and raised exceptions (`P0…`) →
///   [`StoreError::Corrupt`];
/// - everything else (connection lost, timeouts, admin shutdown, resources,
///   no error code at all) → [`StoreError::Unavailable`] (HTTP 503).
pub fn map_pg_error(e: tokio_postgres::Error) -> StoreError {
    let msg = pg_error_text(&e);
    let Some(db) = e.as_db_error() else {
        return StoreError::Unavailable(msg);
    };
    let code = db.code();
    if *code == SqlState::T_R_SERIALIZATION_FAILURE
        || *code == SqlState::T_R_DEADLOCK_DETECTED
        || *code == SqlState::UNIQUE_VIOLATION
    {
        return StoreError::Contention(msg);
    }
    if *code == SqlState::CHARACTER_NOT_IN_REPERTOIRE || *code == SqlState::UNTRANSLATABLE_CHARACTER
    {
        return StoreError::Rejected(msg);
    }
    match code.code().get(..2) {
        Some("22" | "23" | "P0") => StoreError::Corrupt(msg),
        Some("54") => StoreError::Rejected(msg),
        _ => StoreError::Unavailable(msg),
    }
}

/// The error's own words, without a [`StoreError`] kind in front:
/// `SEVERITY SQLSTATE: message` for an error the server sent, else the error
/// and each of its sources.
pub(crate) fn pg_error_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} {}: {}", db.severity(), db.code().code(), db.message());
    }
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// Whether `e` may pass by itself, so that trying again later can succeed: no
/// SQLSTATE at all (I/O error, refused or closed connection) unless it is a
/// TLS failure ([`is_tls_failure`]), or a class that names a passing
/// condition: `08` connection exception, `40` transaction rollback, `53`
/// insufficient resources, `57` operator intervention (admin shutdown, the
/// database starting up), `58` system error (PostgreSQL Appendix A).
/// Everything else (`28` a role, password or `pg_hba.conf` refusal, `3D` no
/// such database, `42` missing privileges, a certificate that does not verify
/// …) stays until an operator acts.
pub(crate) fn is_transient(e: &tokio_postgres::Error) -> bool {
    match e.as_db_error() {
        None => !is_tls_failure(e),
        Some(db) => matches!(
            db.code().code().get(..2),
            Some("08" | "40" | "53" | "57" | "58")
        ),
    }
}

/// Whether `e` is a TLS failure that trying again cannot fix: the handshake
/// failed in rustls (a certificate that does not verify, no common protocol
/// …), or the server does not offer TLS where the `sslmode` requires it. A
/// connection cut during the handshake is an I/O error and passes.
pub(crate) fn is_tls_failure(e: &tokio_postgres::Error) -> bool {
    let mut src = e.source();
    while let Some(s) = src {
        if s.downcast_ref::<rustls::Error>().is_some()
            || s.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
        {
            return true;
        }
        src = s.source();
    }
    // tokio-postgres's own words when the server answers the TLS request with "no".
    e.to_string().contains("server does not support TLS")
}

/// An error while connecting at start-up to `target`, naming it:
/// [`StoreError::Unavailable`] when it may pass ([`is_transient`]), else
/// [`StoreError::Config`] (a wrong role, password or database name in the URL,
/// a `pg_hba.conf` refusal, a TLS failure), so that start-up stops at once.
pub(crate) fn connect_error(e: deadpool_postgres::PoolError, target: &Target) -> StoreError {
    match e {
        deadpool_postgres::PoolError::Backend(e) => connect_pg_error(e, target),
        other => StoreError::Unavailable(format!(
            "PostgreSQL at {} (database {}): connection pool: {other}",
            target.address_list(),
            target.database
        )),
    }
}

/// As [`connect_error`], for a connection made without the pool.
pub(crate) fn connect_pg_error(e: tokio_postgres::Error, target: &Target) -> StoreError {
    let at = format!(
        "PostgreSQL at {} (database {})",
        target.address_list(),
        target.database
    );
    if is_tls_failure(&e) {
        return StoreError::Config(format!(
            "TLS to {at} failed ({}): {}",
            target.tls_description(),
            pg_error_text(&e)
        ));
    }
    if is_transient(&e) {
        return match map_pg_error(e) {
            StoreError::Unavailable(msg) => {
                StoreError::Unavailable(format!("{at} is unavailable: {msg}"))
            }
            other => other,
        };
    }
    StoreError::Config(format!(
        "{at} refused the connection ({}): {}",
        target.tls_description(),
        pg_error_text(&e)
    ))
}

/// A pool failure: every connection stayed busy for the pool's wait
/// timeout → [`StoreError::Overloaded`] (the database answers; this instance
/// has more work than connections); a connection that cannot be opened or
/// checked in time, or any other failure → [`StoreError::Unavailable`].
pub(crate) fn pool_error(e: deadpool_postgres::PoolError) -> StoreError {
    use deadpool_postgres::{PoolError, TimeoutType};
    match e {
        PoolError::Backend(e) => map_pg_error(e),
        PoolError::Timeout(TimeoutType::Wait) => StoreError::Overloaded(
            "every pooled PostgreSQL connection stayed busy for the pool's wait timeout".into(),
        ),
        other => StoreError::Unavailable(format!("connection pool: {other}")),
    }
}

/// A stored value that does not decode.
pub(crate) fn corrupt(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {e}"))
}
