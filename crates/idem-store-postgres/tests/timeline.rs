//! A failover to a promoted standby is noticed while serving (SPEC §2.11):
//! a primary and a streaming standby made from its base backup, on this
//! machine (throwaway clusters); the primary is stopped (`-m immediate`)
//! and the standby promoted onto timeline 2. A store on the promoted
//! standby leases nothing while its recorded identity (timeline 1) is not
//! the database's; its sweeper, not a restart, records timeline 2 and moves
//! the tasks that may have started to reconcile-first, and a report from
//! before the failover is stale evidence.
//!
//! Needs PostgreSQL's server binaries (`idem_store_postgres::testing::pg_bin`);
//! as root they run as `postgres` (`runuser`).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use idem_core::model::{AttemptKind, Role, TaskState};
use idem_store::Store;
use idem_store::conformance::{NON_SAFE, contract, params, submission};
use idem_store::identity::IdentityCheck;
use idem_store::ops::{ClaimRequest, SubmitOutcome};
use idem_store_postgres::{PgOptions, connect};

/// The two clusters' directory, removed (after an immediate stop of both) on drop.
struct Pair {
    dir: PathBuf,
    bin: PathBuf,
    as_postgres: bool,
    primary: u16,
    standby: u16,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
}

impl Pair {
    fn tool(&self, name: &str) -> Command {
        let path = self.bin.join(name);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    fn run(&self, mut c: Command) {
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{c:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn data(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn pg_ctl(&self, data: &Path, args: &[&str]) {
        let mut c = self.tool("pg_ctl");
        c.arg("-D").arg(data).args(["-w", "-t", "60"]).args(args);
        self.run(c);
    }

    fn url(port: u16, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/{db}")
    }

    /// The primary, initialised and started, with database `idem`.
    fn start() -> Pair {
        let dir =
            std::env::temp_dir().join(format!("idem-timeline-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        if as_postgres {
            let ok = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&dir)
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let pair = Pair {
            bin: idem_store_postgres::testing::pg_bin().unwrap(),
            dir,
            as_postgres,
            primary: free_port(),
            standby: free_port(),
        };
        let data = pair.data("primary");
        let mut init = pair.tool("initdb");
        init.arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "--no-instructions",
        ]);
        pair.run(init);
        let conf = format!(
            "\nport = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             wal_level = replica\nmax_wal_senders = 4\nfsync = off\nshared_buffers = 16MB\n",
            pair.primary,
            pair.dir.display()
        );
        append(&data.join("postgresql.conf"), &conf);
        append(
            &data.join("pg_hba.conf"),
            "\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n",
        );
        pair.pg_ctl(
            &data,
            &[
                "-l",
                &pair.dir.join("primary.log").display().to_string(),
                "start",
            ],
        );
        let mut psql = pair.tool("psql");
        psql.args([
            "-h",
            "127.0.0.1",
            "-p",
            &pair.primary.to_string(),
            "-U",
            "postgres",
            "-qXc",
            "CREATE DATABASE idem",
            "postgres",
        ]);
        pair.run(psql);
        pair
    }

    /// A standby from a base backup of the primary (`-R`: it streams from it), started.
    fn start_standby(&self) {
        let data = self.data("standby");
        let mut b = self.tool("pg_basebackup");
        b.args([
            "-h",
            "127.0.0.1",
            "-p",
            &self.primary.to_string(),
            "-U",
            "postgres",
            "-R",
            "-X",
            "stream",
            // At once: a spread checkpoint on the primary takes most of a minute.
            "--checkpoint=fast",
            "-D",
        ])
        .arg(&data);
        self.run(b);
        append(
            &data.join("postgresql.conf"),
            &format!("\nport = {}\n", self.standby),
        );
        self.pg_ctl(
            &data,
            &[
                "-l",
                &self.dir.join("standby.log").display().to_string(),
                "start",
            ],
        );
    }

    /// One value `sql` answers on the cluster at `port`, database `idem`.
    fn sql(&self, port: u16, sql: &str) -> String {
        let mut psql = self.tool("psql");
        psql.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
            .args(["-qtAXc", sql, "idem"]);
        let out = psql.output().unwrap();
        assert!(
            out.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Waits until the standby replayed everything the primary wrote so far.
    fn standby_caught_up(&self) {
        let lsn = self.sql(self.primary, "SELECT pg_current_wal_lsn()");
        let deadline = Instant::now() + Duration::from_secs(30);
        let check = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
        while self.sql(self.standby, &check) != "t" {
            assert!(
                Instant::now() < deadline,
                "the standby never replayed {lsn}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Cuts the standby off: it stops receiving WAL (an asynchronous standby
    /// that fell behind), so what the primary commits from now on is lost at
    /// a failover.
    fn stop_streaming(&self) {
        let data = self.data("standby");
        append(
            &data.join("postgresql.auto.conf"),
            "\nprimary_conninfo = ''\n",
        );
        self.pg_ctl(&data, &["reload"]);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.sql(self.standby, "SELECT count(*) FROM pg_stat_wal_receiver") != "0" {
            assert!(Instant::now() < deadline, "the standby kept streaming");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the primary at once and promotes the standby.
    fn fail_over(&self) {
        self.pg_ctl(&self.data("primary"), &["-m", "immediate", "stop"]);
        self.pg_ctl(&self.data("standby"), &["promote"]);
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for d in ["primary", "standby"] {
            let data = self.data(d);
            if data.join("postmaster.pid").exists() {
                let _ = self
                    .tool("pg_ctl")
                    .arg("-D")
                    .arg(&data)
                    .args(["-m", "immediate", "-w", "stop"])
                    .output();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

fn claim(tenant: &str) -> ClaimRequest {
    ClaimRequest {
        tenant: tenant.into(),
        operations: vec![NON_SAFE.into()],
        executor_id: "executor-1".into(),
        max: 10,
        lease_ms: Some(120_000),
        flow: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_is_noticed_while_serving_and_rewinds() {
    let pair = Pair::start();
    let primary = connect(&Pair::url(pair.primary, "idem"), PgOptions::default())
        .await
        .unwrap();
    let IdentityCheck::Recorded(first) = primary.check_identity().await.unwrap() else {
        panic!("a new store records its identity");
    };
    assert_eq!(first.timeline, Some(1));
    let (key, _) = primary
        .create_api_key("acme", Role::Client, None)
        .await
        .unwrap();
    let mut ids = Vec::new();
    for k in ["running", "queued"] {
        let s = submission(
            "acme",
            NON_SAFE,
            k,
            params(NON_SAFE, 1),
            contract(NON_SAFE),
            &key,
        );
        let SubmitOutcome::Created(t) = primary.submit(s).await.unwrap() else {
            panic!("created");
        };
        ids.push(t.id);
    }
    let mut req = claim("acme");
    req.max = 1;
    let leased = primary.claim(req).await.unwrap();
    assert_eq!(leased.len(), 1);
    let attempt = leased[0].attempt.clone();
    let running = attempt.task_id;
    let queued = *ids.iter().find(|id| **id != running).unwrap();
    pair.start_standby();
    drop(primary);
    pair.fail_over();

    // An instance on the promoted standby, serving: no restart, no check at start.
    let store: Store = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match connect(&Pair::url(pair.standby, "idem"), PgOptions::default()).await {
                Ok(s) if s.ping().await.is_ok() => break s,
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                other => panic!("the promoted standby answers: {other:?}"),
            }
        }
    };
    // Writes on the promoted standby start once recovery has ended.
    let deadline = Instant::now() + Duration::from_secs(30);
    let blocked = loop {
        match store.claim(claim("acme")).await {
            Ok(got) => break got,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("claims on the promoted standby: {e}"),
        }
    };
    assert!(
        blocked.is_empty(),
        "nothing is leased before the store noticed the new timeline: {blocked:?}"
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sweeper = tokio::spawn(idem_store::sweeper::run_sweeper(
        store.clone(),
        Duration::from_millis(100),
        async {
            let _ = stopped.await;
        },
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    let task = loop {
        let t = store.get_task(None, running).await.unwrap().unwrap();
        if t.generation > attempt.generation {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "the sweeper never rewound: {t:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = stop.send(());
    sweeper.await.unwrap();
    assert_eq!(task.state, TaskState::Reconciling);
    let events = store.list_events(None, running).await.unwrap().unwrap();
    let rewind = serde_json::to_value(&events.last().unwrap().data).unwrap();
    assert_eq!(rewind["reason"], "store_rewound");
    assert_eq!(rewind["store"]["from"]["timeline"], 1);
    assert_eq!(rewind["store"]["to"]["timeline"], 2);
    assert_eq!(
        rewind["store"]["from"]["system_identifier"], rewind["store"]["to"]["system_identifier"],
        "a promoted standby is the same system"
    );
    assert_eq!(rewind["ended_attempt_id"], serde_json::json!(attempt.id));
    let late = store
        .report(
            "acme",
            attempt.id,
            idem_core::machine::Report {
                generation: attempt.generation,
                outcome: idem_core::model::Outcome::Succeeded,
                result: Some(serde_json::json!({})),
                failure_class: None,
                message: None,
                usage: None,
                external_txn_id: None,
                body: serde_json::json!({"generation": attempt.generation, "outcome": "succeeded", "result": {}}),
            },
        )
        .await
        .unwrap();
    assert!(
        late.is_err(),
        "a report from before the failover is stale: {late:?}"
    );
    let q = store.get_task(None, queued).await.unwrap().unwrap();
    assert_eq!(
        q.state,
        TaskState::Reconciling,
        "a queued non-safe task reconciles first"
    );
    let now = store.claim(claim("acme")).await.unwrap();
    assert_eq!(now.len(), 2);
    assert!(now.iter().all(|c| c.attempt.kind == AttemptKind::Reconcile));
    assert!(matches!(
        store.check_identity().await.unwrap(),
        IdentityCheck::Unchanged(id) if id.timeline == Some(2)
    ));
}

/// An asynchronous standby that fell behind loses what the primary
/// acknowledged last: here a lease (the executor started the payment) and a
/// whole submit. After the failover the store shows the task `queued`, as if
/// nothing had started; the identity check moves it to reconcile-first, so
/// the next attempt asks the provider instead of paying again, and the lost
/// attempt's report finds nothing to change. The lost submit is gone (SPEC
/// §2.11: keys acknowledged after the restore point are lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_with_an_asynchronous_standby_reconciles_before_anything_runs_again() {
    let pair = Pair::start();
    let primary = connect(&Pair::url(pair.primary, "idem"), PgOptions::default())
        .await
        .unwrap();
    assert!(matches!(
        primary.check_identity().await.unwrap(),
        IdentityCheck::Recorded(_)
    ));
    let (key, _) = primary
        .create_api_key("acme", Role::Client, None)
        .await
        .unwrap();
    let submit = |k: &str| {
        submission(
            "acme",
            NON_SAFE,
            k,
            params(NON_SAFE, 1),
            contract(NON_SAFE),
            &key,
        )
    };
    let SubmitOutcome::Created(paid) = primary.submit(submit("paid")).await.unwrap() else {
        panic!("created");
    };
    pair.start_standby();
    pair.standby_caught_up();
    pair.stop_streaming();
    // Acknowledged by the primary alone: the lease (the executor pays) and a submit.
    let leased = primary.claim(claim("acme")).await.unwrap();
    assert_eq!(leased.len(), 1);
    let lost_attempt = leased[0].attempt.clone();
    assert_eq!(lost_attempt.task_id, paid.id);
    assert_eq!(lost_attempt.kind, AttemptKind::Execute);
    let SubmitOutcome::Created(lost) = primary.submit(submit("lost")).await.unwrap() else {
        panic!("created");
    };
    drop(primary);
    pair.fail_over();

    let store = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match connect(&Pair::url(pair.standby, "idem"), PgOptions::default()).await {
                Ok(s) if s.ping().await.is_ok() => break s,
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                other => panic!("the promoted standby answers: {other:?}"),
            }
        }
    };
    let before = store.get_task(None, paid.id).await.unwrap().unwrap();
    assert_eq!(
        (before.state, before.generation),
        (TaskState::Queued, paid.generation),
        "the lease was lost with the primary"
    );
    assert!(
        store.get_task(None, lost.id).await.unwrap().is_err(),
        "the submit acknowledged after the standby fell behind is gone"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let check = loop {
        match store.check_identity().await {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("identity check on the promoted standby: {e}"),
        }
    };
    assert!(
        matches!(check, IdentityCheck::Rewound { tasks: 1, .. }),
        "{check:?}"
    );
    let after = store.get_task(None, paid.id).await.unwrap().unwrap();
    assert_eq!(after.state, TaskState::Reconciling);
    let next = store.claim(claim("acme")).await.unwrap();
    assert_eq!(next.len(), 1);
    assert_eq!(
        next[0].attempt.kind,
        AttemptKind::Reconcile,
        "the provider is asked before anything runs again"
    );
    assert!(
        next[0].attempt.generation > lost_attempt.generation,
        "the reconcile attempt's generation is above the lost attempt's"
    );
    let late = store
        .report(
            "acme",
            lost_attempt.id,
            idem_core::machine::Report {
                generation: lost_attempt.generation,
                outcome: idem_core::model::Outcome::Succeeded,
                result: Some(serde_json::json!({})),
                failure_class: None,
                message: None,
                usage: None,
                external_txn_id: None,
                body: serde_json::json!({"generation": lost_attempt.generation, "outcome": "succeeded", "result": {}}),
            },
        )
        .await
        .unwrap();
    assert!(
        late.is_err(),
        "the lost attempt's report changes nothing: {late:?}"
    );
    let task = store.get_task(None, paid.id).await.unwrap().unwrap();
    assert_eq!(task.state, TaskState::Reconciling);
}
