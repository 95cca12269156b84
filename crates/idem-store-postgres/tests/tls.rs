//! TLS to PostgreSQL as libpq documents `sslmode` and `sslrootcert`, against a
//! throwaway cluster with TLS on ([`TlsCluster`]: one for the whole test, a
//! few seconds to start), and the refusals that must end start-up at once.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use idem_store::StoreError;
use idem_store::conformance as cases;
use idem_store_postgres::testing::TlsCluster;
use idem_store_postgres::{PgOptions, connect};

/// The bound within which a refusal that retrying cannot fix must come.
const AT_ONCE: Duration = Duration::from_secs(2);

/// `connect(url)`'s error and how long it took to come.
async fn refused(url: &str) -> (StoreError, Duration) {
    let started = Instant::now();
    let err = connect(url, PgOptions::default())
        .await
        .map(|_| ())
        .expect_err(url);
    (err, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_modes_work_as_libpq_documents_them() {
    let cluster = TlsCluster::start().unwrap();
    let ca = cluster.ca.display().to_string();
    let full = format!("sslmode=verify-full&sslrootcert={ca}");
    let mut n = 0;
    let mut fresh = async |host: &str, query: &str| {
        n += 1;
        let db = format!("tls_{n}");
        cluster.create_database(&db).await.unwrap();
        cluster.url(host, &db, query)
    };

    // The conformance cases move the store's clock.
    let test_clock = || {
        let mut options = PgOptions::default();
        options.clock = idem_store::Clock::test();
        options
    };
    // verify-full with the right root certificate: the conformance smoke,
    // by host name and by IP address (both in the certificate).
    for host in ["localhost", "127.0.0.1"] {
        let store = connect(&fresh(host, &full).await, test_clock())
            .await
            .unwrap();
        cases::submit_creates_then_exact_repeat_replays(store).await;
    }
    let smoke = async |url: String, case: u8| {
        let store = connect(&url, test_clock()).await.unwrap();
        match case {
            0 => cases::claim_leases_first_attempt_with_params(store).await,
            1 => cases::succeeded_report_delivers_once_with_charge(store).await,
            _ => cases::cancel_queued_confirms_at_once(store).await,
        }
    };
    for case in 0..3 {
        smoke(fresh("localhost", &full).await, case).await;
    }
    // `idem migrate`'s path connects the same way.
    let url = fresh("localhost", &full).await;
    assert_eq!(
        idem_store_postgres::migrate(&url).await.unwrap().len(),
        idem_store_postgres::MIGRATIONS.len()
    );

    // A root certificate that did not sign the server's: refused at once,
    // naming the certificate error, the mode and the server.
    let wrong = format!(
        "sslmode=verify-full&sslrootcert={}",
        cluster.wrong_ca.display()
    );
    let (err, took) = refused(&fresh("localhost", &wrong).await).await;
    let text = err.to_string();
    eprintln!("wrong root certificate refused in {took:?}: {text}");
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    assert!(took < AT_ONCE, "{took:?}");
    assert!(
        text.contains(&format!(
            "TLS to PostgreSQL at localhost:{} (database tls_",
            cluster.port
        )),
        "{text}"
    );
    assert!(
        text.contains("invalid peer certificate: UnknownIssuer"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "sslmode=verify-full, root certificates from {}",
            cluster.wrong_ca.display()
        )),
        "{text}"
    );
    // The same through `idem migrate`'s connection.
    let err = idem_store_postgres::migrate(&fresh("localhost", &wrong).await)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");
    // `require` with a root certificate checks the chain (libpq).
    let (err, _) = refused(
        &fresh(
            "localhost",
            &format!("sslmode=require&sslrootcert={}", cluster.wrong_ca.display()),
        )
        .await,
    )
    .await;
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");

    // A plain connection to a server that accepts TLS only: PostgreSQL's own
    // refusal, at once.
    let (err, took) = refused(&fresh("127.0.0.1", "sslmode=disable").await).await;
    let text = err.to_string();
    eprintln!("sslmode=disable refused in {took:?}: {text}");
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    assert!(took < AT_ONCE, "{took:?}");
    assert!(text.contains("no pg_hba.conf entry for host"), "{text}");
    assert!(text.contains("no encryption"), "{text}");
    assert!(text.contains("(sslmode=disable)"), "{text}");
    assert!(
        text.contains(&format!("PostgreSQL at 127.0.0.1:{}", cluster.port)),
        "{text}"
    );

    // 127.0.0.2 is not in the certificate: verify-full refuses the name,
    // verify-ca checks only the chain, require and prefer check nothing.
    let (err, took) = refused(&fresh("127.0.0.2", &full).await).await;
    assert!(took < AT_ONCE, "{took:?}");
    assert!(
        err.to_string().contains("certificate not valid for name"),
        "{err}"
    );
    for query in [
        format!("sslmode=verify-ca&sslrootcert={ca}"),
        "sslmode=require".to_owned(),
        "sslmode=prefer".to_owned(),
        String::new(),
    ] {
        let store = connect(&fresh("127.0.0.2", &query).await, PgOptions::default())
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"));
        store.ping().await.unwrap();
    }
    // verify-ca still checks the chain.
    let (err, _) = refused(
        &fresh(
            "127.0.0.2",
            &format!(
                "sslmode=verify-ca&sslrootcert={}",
                cluster.wrong_ca.display()
            ),
        )
        .await,
    )
    .await;
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");

    // A root certificate file that is not there: refused before connecting.
    let (err, _) = refused(&cluster.url(
        "localhost",
        "postgres",
        "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
    ))
    .await;
    assert!(
        err.to_string()
            .contains("sslrootcert=/nonexistent/ca.pem: cannot read the root certificates"),
        "{err}"
    );
}
