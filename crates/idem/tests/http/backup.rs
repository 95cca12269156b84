//! `idem backup` copies an SQLite store while its server takes a steady
//! submit load: the copy passes `PRAGMA integrity_check`, holds every task
//! acknowledged before the backup began, and is marked as a backup, so a
//! server started on it records a new epoch and moves every task that may
//! have started to reconcile-first before it leases anything (SPEC §2.11).
//! A destination that exists and a PostgreSQL store are refused.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{Options, Server, cli_at, payment};

/// Concurrent submitters of the load.
const SUBMITTERS: usize = 32;
/// Tasks leased (running) before the backup.
const IN_FLIGHT: usize = 20;

/// Acknowledged idempotency keys with the time of their answer.
type Acked = Arc<Mutex<Vec<(String, Instant)>>>;

/// Submits new payments from [`SUBMITTERS`] clients until `stop`; every 201
/// is recorded in `acked`.
fn start_load(
    srv: &Arc<Server>,
    acked: &Acked,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let next = Arc::new(AtomicU64::new(0));
    (0..SUBMITTERS)
        .map(|_| {
            let (srv, acked, stop, next) = (
                Arc::clone(srv),
                Arc::clone(acked),
                Arc::clone(stop),
                Arc::clone(&next),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let key = format!("load-{n}");
                    let amount = i64::try_from(n % 100_000).unwrap_or(0) + 1;
                    let r = srv.submit(&key, "payment.release", payment(amount)).await;
                    if r.status == 201 {
                        acked.lock().unwrap().push((key, Instant::now()));
                    }
                }
            })
        })
        .collect()
}

/// The value of the single-column query `sql` on `conn`.
fn one<T: rusqlite::types::FromSql>(conn: &rusqlite::Connection, sql: &str) -> T {
    conn.query_row(sql, [], |r| r.get(0)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_under_load_holds_every_acknowledged_task_and_its_restore_reconciles_first() {
    let srv = Arc::new(Server::fast().await);
    // Tasks whose attempts run while the backup is taken.
    let mut running = Vec::new();
    for i in 0..IN_FLIGHT {
        let t = srv
            .new_task(&format!("in-flight-{i}"), "payment.release", payment(7))
            .await;
        running.push(t["id"].as_str().unwrap().to_owned());
    }
    for _ in 0..IN_FLIGHT {
        srv.claim_one("payment.release", Some(300_000)).await;
    }
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let load = start_load(&srv, &acked, &stop);
    // The load runs for a while before the backup begins.
    let deadline = Instant::now() + Duration::from_secs(20);
    while acked.lock().unwrap().len() < 2_000 {
        assert!(Instant::now() < deadline, "the load never got going");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let copy_dir = tempfile::tempdir().unwrap();
    let copy = copy_dir.path().join("backup.db");
    let began = Instant::now();
    let before: HashSet<String> = acked
        .lock()
        .unwrap()
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    let (store, to) = (srv.store(), copy.display().to_string());
    let (ok, out, err) =
        tokio::task::spawn_blocking(move || cli_at(&store, &["backup", "--to", &to]))
            .await
            .unwrap();
    let ended = Instant::now();
    // The load goes on a little after the backup, then stops.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for h in load {
        h.await.unwrap();
    }
    assert!(ok, "idem backup failed: {err}");
    assert!(out.contains("integrity_check ok"), "{out}");
    let during = acked
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, at)| *at >= began && *at <= ended)
        .count();
    let secs = (ended - began).as_secs_f64();
    eprintln!(
        "backup took {:.0} ms; {during} submits acknowledged meanwhile ({:.0}/s); {} before it began; {out}",
        secs * 1000.0,
        during as f64 / secs,
        before.len()
    );

    {
        let conn = rusqlite::Connection::open_with_flags(
            &copy,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .unwrap();
        assert_eq!(one::<String>(&conn, "PRAGMA integrity_check"), "ok");
        let mut stmt = conn
            .prepare("SELECT idempotency_key FROM idempotency_keys")
            .unwrap();
        let held: HashSet<String> = stmt
            .query_map([], |r| r.get::<_, String>(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let missing: Vec<&String> = before.iter().filter(|k| !held.contains(*k)).collect();
        assert!(
            missing.is_empty(),
            "{} acknowledged before the backup began are missing from it, e.g. {:?}",
            missing.len(),
            missing.iter().take(5).collect::<Vec<_>>()
        );
        assert_eq!(
            one::<i64>(&conn, "SELECT restored FROM store_identity"),
            1,
            "the copy is marked as a backup"
        );
    }
    let source_epoch: String = {
        let conn = rusqlite::Connection::open_with_flags(
            srv.db_path(),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .unwrap();
        assert_eq!(
            one::<i64>(&conn, "SELECT restored FROM store_identity"),
            0,
            "the source is not marked"
        );
        one(&conn, "SELECT epoch FROM store_identity")
    };

    // A destination that exists is refused and left as it was.
    let (ok, _, err) = cli_at(
        &srv.store(),
        &["backup", "--to", &copy.display().to_string()],
    );
    assert!(!ok, "a second backup to the same file must be refused");
    assert!(err.contains("already exists"), "{err}");

    // A server started on the copy rewinds before it serves.
    let keys = srv.keys.clone();
    let restored = Server::start_on_file(&copy, Options::fast(), keys);
    let conn = rusqlite::Connection::open_with_flags(
        restored.db_path(),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    assert_eq!(one::<i64>(&conn, "SELECT restored FROM store_identity"), 0);
    assert_ne!(
        one::<String>(&conn, "SELECT epoch FROM store_identity"),
        source_epoch,
        "the restored store records a new epoch"
    );
    // Every task of the copy is a payment, none terminal: all may have
    // started after the copy was made, so all reconcile first.
    let not_reconciling: i64 = one(
        &conn,
        "SELECT count(*) FROM tasks WHERE state <> 'reconciling'",
    );
    assert_eq!(
        not_reconciling, 0,
        "every task of the copy reconciles first"
    );
    let rewound: i64 = one(
        &conn,
        "SELECT count(DISTINCT task_id) FROM events \
         WHERE type = 'reconciliation_required' AND json_extract(data, '$.reason') = 'store_rewound'",
    );
    let tasks: i64 = one(&conn, "SELECT count(*) FROM tasks");
    assert_eq!(rewound, tasks, "each task's event says why");
    for id in &running {
        let state: String = conn
            .query_row("SELECT state FROM attempts WHERE task_id = ?1", [id], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(state, "expired", "the attempt running at the backup ended");
    }
    // What it leases first is a reconcile attempt.
    let a = restored.claim_one("payment.release", None).await;
    assert_eq!(a["kind"], json!("reconcile"), "{a}");
}

/// A PostgreSQL store is answered with where its backups are described,
/// and nothing is written.
#[test]
fn a_postgres_store_is_pointed_to_its_own_backups() {
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join("copy.db");
    let (ok, _, err) = cli_at(
        "postgres://postgres@127.0.0.1:1/none",
        &["backup", "--to", &to.display().to_string()],
    );
    assert!(!ok);
    assert!(
        err.contains("pg_basebackup") && err.contains("docs/deployment.md"),
        "{err}"
    );
    assert!(!to.exists());
}
