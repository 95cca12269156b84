//! Test support: a fresh, uniquely named database per test.
//!
//! The server is taken from `IDEM_TEST_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); the role needs `CREATEDB`.
//! Databases are named `idem_t_<unix seconds>_<random>`. Ones created more
//! than ten minutes ago that nobody is connected to are dropped on the way
//! (best effort), so test runs do not pile up databases.

use std::time::{SystemTime, UNIX_EPOCH};

use tokio_postgres::NoTls;

/// The SQL of a claim's scan (`Tx::claimable`), to check its plan.
pub const CLAIMABLE_SQL: &str = crate::tx::CLAIMABLE;

/// The default test server URL.
pub const DEFAULT_TEST_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The test server URL: `IDEM_TEST_PG_URL` or [`DEFAULT_TEST_URL`].
pub fn server_url() -> String {
    std::env::var("IDEM_TEST_PG_URL").unwrap_or_else(|_| DEFAULT_TEST_URL.to_owned())
}

/// `url` with its database name replaced by `db` (URL form only).
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let rest = &base[scheme_end..];
    let authority = rest.split_once('/').map_or(rest, |(a, _)| a);
    let mut out = format!("{}{authority}/{db}", &base[..scheme_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Creates an empty database on the test server and returns its URL.
/// Safe to call from tests running in parallel.
///
/// # Panics
/// When the test server cannot be reached or refuses `CREATE DATABASE`: this
/// is a test helper, and a test without its database cannot run.
pub async fn fresh_database() -> String {
    let server = server_url();
    let (client, connection) = match tokio_postgres::connect(&server, NoTls).await {
        Ok(c) => c,
        Err(e) => {
            panic!("cannot connect to the test PostgreSQL at {server} (set IDEM_TEST_PG_URL): {e}")
        }
    };
    let conn = tokio::spawn(connection);
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = format!(
        "idem_t_{secs}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    if let Err(e) = client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
    {
        panic!("CREATE DATABASE {name} failed on {server}: {e:?}");
    }
    drop_stale(&client, secs).await;
    drop(client);
    let _ = conn.await;
    with_database(&server, &name)
}

/// Drops test databases created more than ten minutes ago (best effort: a database
/// still in use, or being dropped by another test, is left alone).
async fn drop_stale(client: &tokio_postgres::Client, now_secs: u64) {
    let Ok(rows) = client
        .query(
            "SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_t\\_%'",
            &[],
        )
        .await
    else {
        return;
    };
    for row in rows {
        let Ok(name) = row.try_get::<_, String>(0) else {
            continue;
        };
        let created = name
            .strip_prefix("idem_t_")
            .and_then(|rest| rest.split('_').next())
            .and_then(|s| s.parse::<u64>().ok());
        if created.is_some_and(|c| c + 600 < now_secs) {
            let _ = client
                .batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_name_is_replaced() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/test", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
        assert_eq!(
            with_database("postgresql://u:p@h/db?sslmode=disable", "x"),
            "postgresql://u:p@h/x?sslmode=disable"
        );
    }
}
