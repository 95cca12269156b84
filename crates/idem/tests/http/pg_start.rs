//! How `idem` connects to PostgreSQL at start-up: TLS (`sslmode`,
//! `sslrootcert`) against a throwaway TLS-only cluster, the refusals that end
//! start-up at once with their cause, and the log line that says where the
//! data goes.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idem_store_postgres::testing::{TlsCluster, fresh_database};
use tokio_postgres::NoTls;

use crate::support::{BIN, Server, ikey, payment, s};

/// The bound within which a refusal that retrying cannot fix must come.
const AT_ONCE: Duration = Duration::from_secs(2);

/// Runs `idem serve` on `store` with a start-up wait of ten minutes; returns
/// its exit code, stderr and how long it ran. Fails the test when it is still
/// running after 30 s (it was waiting instead of refusing).
fn serve_refused(store: &str) -> (Option<i32>, String, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("stderr");
    let log = std::fs::File::create(&log_path).unwrap();
    let started = Instant::now();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--store", store])
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_CONFIG")
        .env("IDEM_STORE_WAIT_MS", "600000")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "idem serve --store {store} still running after 30 s: {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = started.elapsed();
    let err = std::fs::read_to_string(&log_path).unwrap();
    (status.code(), err, took)
}

/// Runs the CLI with `args` and `RUST_LOG=info`; returns (success, stderr).
fn cli_info(args: &[&str], cwd: &std::path::Path) -> (bool, String) {
    let out = Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_CONFIG")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `idem serve` over `sslmode=verify-full` with the cluster's CA serves a
/// submit, claim and report; a wrong root certificate and a plain connection to
/// a TLS-only server end start-up at once (exit 1) with the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_over_tls_and_tls_refusals_end_start_up_at_once() {
    let cluster = TlsCluster::start().unwrap();
    cluster.create_database("served").await.unwrap();
    let url = cluster.url(
        "localhost",
        "served",
        &format!("sslmode=verify-full&sslrootcert={}", cluster.ca.display()),
    );
    let keys = Server::create_keys(&url);
    let server = Server::start_pg(&url, &keys, &[]).await;
    let task = server
        .new_task(&ikey(), "payment.release", payment(7))
        .await;
    let id = s(&task["id"]);
    let attempt = server.claim_one("payment.release", None).await;
    assert_eq!(attempt["task_id"], serde_json::json!(id), "{attempt}");
    let report = serde_json::json!({"generation": 1, "outcome": "succeeded", "result": {"ok": true}, "usage": 1});
    let done = server.report(&s(&attempt["id"]), report).await;
    assert_eq!(
        done.ok(200)["task"]["state"],
        serde_json::json!("succeeded")
    );
    drop(server);

    let wrong = cluster.url(
        "localhost",
        "served",
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            cluster.wrong_ca.display()
        ),
    );
    let (code, err, took) = serve_refused(&wrong);
    eprintln!("wrong root certificate: exit {code:?} after {took:?}");
    assert_eq!(code, Some(1), "{err}");
    assert!(took < AT_ONCE, "{took:?}: {err}");
    assert!(
        err.contains(&format!(
            "TLS to PostgreSQL at localhost:{} (database served) failed (sslmode=verify-full, root certificates from {})",
            cluster.port,
            cluster.wrong_ca.display()
        )),
        "{err}"
    );
    assert!(
        err.contains("invalid peer certificate: UnknownIssuer"),
        "{err}"
    );
    assert!(!err.contains("retrying"), "{err}");

    let plain = cluster.url("127.0.0.1", "served", "sslmode=disable");
    let (code, err, took) = serve_refused(&plain);
    eprintln!("sslmode=disable: exit {code:?} after {took:?}");
    assert_eq!(code, Some(1), "{err}");
    assert!(took < AT_ONCE, "{took:?}: {err}");
    assert!(err.contains("no pg_hba.conf entry for host"), "{err}");
    assert!(err.contains("no encryption"), "{err}");
}

/// A PostgreSQL URL without a database is refused at once with a message; an
/// unreachable server's message names host and port; a store that is neither
/// SQLite nor PostgreSQL names the schemes `postgresql://` among them.
#[test]
fn store_urls_are_refused_with_their_reason() {
    let (code, err, took) = serve_refused("postgres://postgres@127.0.0.1:5432");
    assert_eq!(code, Some(1), "{err}");
    assert!(took < AT_ONCE, "{took:?}");
    assert!(
        err.contains(
            "the PostgreSQL URL names no database: add it after the host (postgres://USER@127.0.0.1:5432/DATABASE)"
        ),
        "{err}"
    );
    let (code, err, _) = serve_refused("mysql://root@127.0.0.1/app");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--store must start with sqlite://, postgres:// or postgresql://, got `mysql://root@127.0.0.1/app`"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = cli_info(
        &[
            "migrate",
            "--store",
            "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable",
        ],
        dir.path(),
    );
    assert!(!ok);
    assert!(
        err.contains("PostgreSQL at 127.0.0.1:1 (database nowhere) is unavailable"),
        "{err}"
    );
}

/// `serve`, `migrate` and `keys` log where the data goes: PostgreSQL's host,
/// port, database and role (never the password), SQLite's absolute path; and
/// `postgresql://` URLs work as `postgres://` ones.
#[tokio::test]
async fn start_up_logs_where_the_data_goes() {
    let db = fresh_database().await;
    let with_password = db.replacen("postgres@", "postgres:s3cret-pw@", 1);
    let dir = tempfile::tempdir().unwrap();
    for args in [
        vec!["migrate", "--store", with_password.as_str()],
        vec!["keys", "list", "--store", with_password.as_str()],
    ] {
        let (ok, err) = cli_info(&args, dir.path());
        assert!(ok, "{args:?}: {err}");
        let at = idem_store_postgres::testing::server_address();
        let (host, port) = at.rsplit_once(':').unwrap();
        assert!(
            err.contains(&format!("store: PostgreSQL database {} at {at}", db.name())),
            "{err}"
        );
        assert!(
            err.contains(&format!(
                "host={host} port={port} database={} user=postgres",
                db.name()
            )),
            "{err}"
        );
        assert!(!err.contains("s3cret"), "{err}");
    }
    let again = db.replacen("postgres://", "postgresql://", 1);
    let (ok, err) = cli_info(&["migrate", "--store", &again], dir.path());
    assert!(ok && err.contains("nothing to apply"), "{err}");

    let (ok, err) = cli_info(&["migrate", "--store", "sqlite://data/idem.db"], dir.path());
    assert!(ok, "{err}");
    let absolute = dir.path().canonicalize().unwrap().join("data/idem.db");
    assert!(
        err.contains(&format!("store: SQLite file {}", absolute.display())),
        "{err}"
    );
}

/// A database whose only other objects belong to an extension (the views of
/// `pg_stat_statements`, as in the database pg_auto_failover makes) is
/// created into by `serve` without `idem migrate`.
#[tokio::test]
async fn an_extensions_views_do_not_make_a_database_an_applications() {
    let db = fresh_database().await;
    let (client, conn) = tokio_postgres::connect(&db, NoTls).await.unwrap();
    tokio::spawn(conn);
    client
        .batch_execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    let keys = Server::create_keys(&db);
    let server = Server::start_pg(&db, &keys, &[]).await;
    server
        .new_task(&ikey(), "payment.release", payment(3))
        .await;
    drop(server);
    client
        .batch_execute("DROP EXTENSION pg_stat_statements")
        .await
        .unwrap();
}

/// `serve` refuses to create idem's schema in a database that holds other
/// tables (and creates nothing); `idem migrate` accepts it, leaves the other
/// tables alone, and `serve` runs on it afterwards.
#[tokio::test]
async fn serve_refuses_a_database_with_other_tables_until_migrate() {
    let db = fresh_database().await;
    let (client, conn) = tokio_postgres::connect(&db, NoTls).await.unwrap();
    tokio::spawn(conn);
    client
        .batch_execute("CREATE TABLE orders (id int PRIMARY KEY); INSERT INTO orders VALUES (1)")
        .await
        .unwrap();
    let (code, err, took) = serve_refused(&db);
    assert_eq!(code, Some(1), "{err}");
    assert!(took < AT_ONCE, "{took:?}");
    assert!(
        err.contains(&format!(
            "database {} at {} already holds 1 table(s) that are not idem's (orders) and no idem schema",
            db.name(),
            idem_store_postgres::testing::server_address()
        )),
        "{err}"
    );
    assert!(
        err.contains("if this database really is meant for idem, run `idem migrate` with the same --store first"),
        "{err}"
    );
    let count: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(count, 1, "nothing was created");

    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = cli_info(&["migrate", "--store", &db], dir.path());
    assert!(ok, "{err}");
    let orders: i64 = client
        .query_one("SELECT count(*) FROM orders", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(orders, 1);
    let keys = Server::create_keys(&db);
    let server = Server::start_pg(&db, &keys, &[]).await;
    server
        .new_task(&ikey(), "payment.release", payment(1))
        .await;
}

/// Expand/contract on a running `idem serve` (docs/operations.md,
/// "Upgrading"): on a schema one migration newer than its own and declared
/// compatible with it, it serves and `/readyz` says 200; once that migration
/// declares it incompatible (a later release's contract step), `/readyz`
/// answers 503 naming both versions within the schema re-read interval, and
/// a new `idem serve` refuses at once (exit 1) naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_and_start_up_refuse_a_schema_this_binary_cannot_serve() {
    let db = fresh_database().await;
    let keys = Server::create_keys(&db);
    let (client, conn) = tokio_postgres::connect(&db, NoTls).await.unwrap();
    tokio::spawn(conn);
    let known = idem_store_postgres::MIGRATIONS.last().unwrap().version;
    let future = known + 1;
    client
        .execute(
            "INSERT INTO schema_migrations (version, compatible_from) VALUES ($1, $2)",
            &[&future, &known],
        )
        .await
        .unwrap();
    let server = Server::start_pg(&db, &keys, &[]).await;
    let ready = server
        .call(reqwest::Method::GET, "/readyz", None, None)
        .await;
    assert_eq!(ready.status, 200, "{}", ready.text);
    server
        .new_task(&ikey(), "payment.release", payment(1))
        .await;

    client
        .execute(
            "UPDATE schema_migrations SET compatible_from = version WHERE version = $1",
            &[&future],
        )
        .await
        .unwrap();
    let both = |text: &str| {
        text.contains(&format!("version {future}"))
            && text.contains(&format!("this binary's {known}"))
    };
    // The real binary reads the schema again by real time: at most
    // SCHEMA_RECHECK after this change, plus a margin for a loaded machine.
    let bound = idem_store::schema::SCHEMA_RECHECK + Duration::from_secs(10);
    let started = Instant::now();
    let refused = loop {
        let r = server
            .call(reqwest::Method::GET, "/readyz", None, None)
            .await;
        if r.status != 200 {
            break r;
        }
        assert!(
            started.elapsed() < bound,
            "/readyz still 200 after {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused.status, 503, "{}", refused.text);
    assert_eq!(refused.json["code"], "UNAVAILABLE", "{}", refused.text);
    assert!(
        both(refused.json["detail"].as_str().unwrap_or_default()),
        "{}",
        refused.text
    );

    let (code, err, took) = serve_refused(&db);
    assert_eq!(code, Some(1), "{err}");
    assert!(took < AT_ONCE, "{took:?}");
    assert!(both(&err), "{err}");
}
