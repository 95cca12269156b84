//! # idem-store-postgres
//!
//! The PostgreSQL backend of idem: many stateless idem instances over one
//! database (SPEC §5). It implements [`idem_store::Tx`] with
//! `tokio-postgres` through a `deadpool-postgres` pool, and
//! [`idem_store::Backend`] by running every [`Op`] as one READ COMMITTED
//! transaction.
//!
//! - Entry points: [`connect`] (pool + migrations, returns a [`Store`]) and
//!   [`migrate`] (migrations only, for `idem migrate`).
//! - Layout: this file holds the options, the pool and the connection's set-up;
//!   `run.rs` how operations run (the submit, retry and authentication lanes
//!   on [`idem_store::batch`], one transaction per operation, contention
//!   retries, deadlines); `tx.rs` the [`idem_store::Tx`] implementation
//!   with the pipelined [`idem_store::ops::SubmitPlan`]; `error.rs` the
//!   mapping of PostgreSQL errors.
//! - Correctness lives in the database: the scope is the primary key of
//!   `idempotency_keys` (`INSERT … ON CONFLICT DO NOTHING`, then a separate
//!   `SELECT`: under READ COMMITTED a new statement sees the row that won,
//!   committed); every task write is a compare-and-set on
//!   `(version, generation)`; claims and sweeps lock with `FOR UPDATE SKIP
//!   LOCKED`; leases and backoff are decided by the database clock
//!   (`clock_timestamp()`), one clock for all instances (plus the offset of
//!   [`PgOptions::clock`], added in SQL: 0 in production, moved by tests).
//! - Errors: connection, pool and timeout failures are
//!   [`StoreError::Unavailable`]; serialization failures, deadlocks, unique
//!   violations and lost compare-and-sets are [`StoreError::Contention`] and
//!   are retried (whole transaction, bounded, jittered); undecodable rows and
//!   integrity violations are [`StoreError::Corrupt`].
//! - Each operation runs on its own tokio task, so a caller that drops the
//!   future (client disconnect, HTTP timeout) never interrupts a commit.

use std::sync::Arc;
use std::time::Duration;

use announce::Notifications;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use idem_store::contracts::StoredContracts;
use idem_store::ops::{Authenticate, Call, Submit};
use idem_store::{Clock, Result, SchemaWatch, ScopeHints, Store, StoreError, batch};
use tokio::sync::mpsc;

mod announce;
mod error;
mod feed;
mod migrate;
pub mod notify;
mod rows;
mod run;
pub mod standby;
mod target;
mod tls;
mod tx;

pub mod testing;

pub use error::map_pg_error;
pub use idem_store::Migration;
pub use migrate::{MIGRATION_LOCK_TIMEOUT_MS, MIGRATIONS, migrate};
pub use standby::{SyncStandby, SyncStandbyWatch};
pub use target::{RootCerts, SslMode, Target};
pub use tx::PgTx;

/// Pool and session settings of the PostgreSQL backend.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PgOptions {
    /// Connections at most (default 16).
    pub max_size: usize,
    /// How long to wait for a free connection, to open one, or to check one
    /// before reuse (default 5 s). Past it the operation is `Unavailable`.
    pub pool_timeout: Duration,
    /// `statement_timeout` of every session (default 10 s).
    pub statement_timeout: Duration,
    /// `idle_in_transaction_session_timeout` of every session (default 10 s):
    /// a stalled instance never holds row locks for long.
    pub idle_in_transaction_timeout: Duration,
    /// How many times a transaction that met contention (serialization failure,
    /// deadlock, lost compare-and-set) is run again (default 5).
    pub max_retries: u32,
    /// How long one operation, or one submit or authentication batch, may take
    /// end to end, retries included (default 30 s). Past it the callers get
    /// `Unavailable` and its connection is not used again. `statement_timeout`
    /// is enforced by the server, so it cannot end a wait on a link that went
    /// silent (a frozen proxy, a dropped route): this can.
    pub operation_timeout: Duration,
    /// Whether [`connect`] applies pending migrations (default `true`). With
    /// `false` it changes no schema and refuses a database whose schema is
    /// not this binary's: for tools that only read or administer a store.
    pub migrate: bool,
    /// Whether applying migrations may create idem's schema in a database that
    /// already holds other tables and no idem schema (default `false`: refused
    /// with [`StoreError::Migration`], so a mistyped URL cannot put idem's
    /// tables into an application's database; `idem migrate` sets it).
    pub allow_other_tables: bool,
    /// The offset added to the database clock in SQL (default
    /// [`Clock::real`]: none); tests pass a test clock and move it forward
    /// instead of sleeping. The database clock stays the one clock.
    pub clock: Clock,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            max_size: 16,
            pool_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(10),
            idle_in_transaction_timeout: Duration::from_secs(10),
            max_retries: 5,
            operation_timeout: Duration::from_secs(30),
            migrate: true,
            allow_other_tables: false,
            clock: Clock::real(),
        }
    }
}

impl PgOptions {
    /// Sets [`PgOptions::max_size`].
    pub fn with_max_size(mut self, max_size: usize) -> Self {
        self.max_size = max_size.max(1);
        self
    }
}

/// The PostgreSQL [`Backend`]: a connection pool.
#[derive(Debug, Clone)]
pub struct PgBackend {
    pool: Pool,
    max_retries: u32,
    /// [`PgOptions::operation_timeout`].
    operation_timeout: Duration,
    /// Submits wait here for the next batch (group commit, see [`SUBMIT_BATCH`]).
    submits: mpsc::UnboundedSender<Call<Submit>>,
    /// Authentications wait here for the next lookup (see [`AUTH_BATCH`]).
    auths: mpsc::UnboundedSender<Call<Authenticate>>,
    /// Submits of scopes seen bound wait here for a read ([`RETRY_LANES`]).
    retries: mpsc::UnboundedSender<Call<Submit>>,
    /// Which scopes were seen bound; `None` without a retry lane.
    hints: Option<ScopeHints>,
    /// [`PgOptions::clock`].
    clock: Clock,
    /// The contracts this database is known to hold (shared with the submit lanes).
    stored: Arc<StoredContracts>,
    /// Committed changes, heard on a listening connection of their own
    /// (`notify.rs`).
    listening: Arc<notify::Listening>,
    /// Publishes what this store committed and announces it to the other
    /// instances (`announce.rs`).
    announcer: announce::Announcer,
    /// The last reading of the database's schema: another instance may
    /// migrate it to one this binary cannot serve ([`Backend::ping`] reads it
    /// again at most every [`idem_store::schema::SCHEMA_RECHECK`]).
    ///
    /// [`Backend::ping`]: idem_store::Backend::ping
    schema: Arc<SchemaWatch>,
}

/// How long [`connect`] waits for another instance that is applying
/// migrations before it answers [`StoreError::Unavailable`] (start-up retries,
/// for up to `IDEM_STORE_WAIT_MS`, so the error it ends with names the cause).
pub const MIGRATION_WAIT: Duration = Duration::from_secs(2);

/// Most submissions one transaction accepts together. Concurrent submits are
/// queued and written by [`SUBMIT_LANES`] batchers: each takes what is queued
/// (up to this many), writes all scope rows, tasks and events with one
/// multi-row statement each, commits once (`synchronous_commit=on`) and only
/// then answers every caller. A lone submit is a batch of one.
pub const SUBMIT_BATCH: usize = 64;

/// Batches in flight at once: fewer lanes make larger batches, and a larger
/// batch costs PostgreSQL less per key (the figures are in
/// `docs/benchmarks.md`).
pub const SUBMIT_LANES: usize = 2;

/// Readers of retries in flight at once: submits whose scope this process has
/// seen bound ([`ScopeHints`]) are answered by one read each batch, on a lane
/// of its own, so they neither wait behind writes nor make batches of new keys
/// smaller; one lane gathers larger batches than two sharing the work
/// (`docs/benchmarks.md`). None in a pool of fewer than 8 connections, where
/// every submit is written.
pub const RETRY_LANES: usize = 1;

/// How many times a batcher yields to the runtime to let more work join a batch.
const LINGER_YIELDS: usize = 4;

/// Most authentications one lookup answers together.
pub const AUTH_BATCH: usize = 128;

/// The least time a connection attempt to one host of the URL is given.
pub const MIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long data sent on a pooled connection may stay unacknowledged by the
/// server's host before the kernel gives up on the connection (Linux
/// `TCP_USER_TIMEOUT`; a live server's kernel acknowledges at once, however
/// busy the server is).
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP keepalive of pooled connections: probes start after this much idle
/// time …
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// … one every this long …
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// … and the kernel drops the connection after this many unanswered ones
/// (an idle connection to a vanished host is dropped within 10 + 3 × 2 =
/// 16 s, before the pool could hand it out).
pub const KEEPALIVE_RETRIES: u32 = 3;

/// Connects to `url` (`postgres://user@host:port/db`), applies pending
/// migrations and returns the store.
///
/// # Errors
/// [`StoreError::Config`] when `url` does not parse or the server refuses the
/// connection for good (unknown role or database, wrong password),
/// [`StoreError::Unavailable`] when the database cannot be reached (yet),
/// [`StoreError::Migration`] when the schema cannot be brought up to date.
pub async fn connect(url: &str, options: PgOptions) -> Result<Store> {
    Ok(Store::new(PgBackend::connect(url, options).await?))
}

/// The tokio-postgres configuration of `url` with idem's session settings
/// added, where it points, and who notifies (read from the URL's own
/// options, before idem's are added).
fn session_config(
    url: &str,
    options: &PgOptions,
) -> Result<(tokio_postgres::Config, Target, Notifications)> {
    let (mut cfg, target) = target::parse(url)?;
    let notify = notifications(&cfg);
    // Generic plans: idem's statements are point and range lookups on indexed
    // columns whose best plan does not depend on the values, and with array
    // parameters (`unnest`, `= ANY`) PostgreSQL otherwise re-plans the submit
    // key check and the replay read-back on every execution (custom plans look
    // cheaper because they know the array length). `idem.notify=off`: the
    // `events` trigger sends nothing from these sessions (migration 14); the
    // store announces what it committed itself, after the commit
    // (`announce.rs`), unless the URL's options turn the trigger on or
    // notifications off ([`notifications`]).
    let mut ours = format!(
        "-c synchronous_commit=on -c plan_cache_mode=force_generic_plan \
         -c statement_timeout={} -c idle_in_transaction_session_timeout={}",
        options.statement_timeout.as_millis(),
        options.idle_in_transaction_timeout.as_millis(),
    );
    if notify == Notifications::Announced {
        ours.push_str(" -c idem.notify=off");
    }
    let all = match cfg.get_options() {
        Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {ours}"),
        _ => ours,
    };
    cfg.options(all);
    if cfg.get_application_name().is_none() {
        cfg.application_name("idem");
    }
    if cfg.get_connect_timeout().is_none() {
        // The driver tries the hosts one after the other, each within this:
        // all of them within the pool's timeout, so that a first host that
        // no longer answers (a failed primary) leaves time for the next.
        let hosts = u32::try_from(target.addresses.len().max(1)).unwrap_or(u32::MAX);
        cfg.connect_timeout((options.pool_timeout / hosts).max(MIN_CONNECT_TIMEOUT));
    }
    // A server that vanished without closing its connections (a host gone,
    // a dropped route: no FIN, no RST) is noticed by the kernel: a request
    // left unacknowledged for `TCP_USER_TIMEOUT`, or an idle pooled
    // connection whose keepalive probes go unanswered, fails its socket, so
    // the pool opens a new connection (to the new primary) instead of
    // waiting out the operation's deadline on the old one.
    if cfg.get_tcp_user_timeout().is_none() {
        cfg.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    cfg.keepalives(true)
        .keepalives_idle(KEEPALIVE_IDLE)
        .keepalives_interval(KEEPALIVE_INTERVAL)
        .keepalives_retries(KEEPALIVE_RETRIES);
    Ok((cfg, target, notify))
}

/// Who notifies the other instances, from the URL's `options`
/// (`-c idem.notify=on|off`, see [`Notifications`]): the last setting of
/// `idem.notify` counts, as in PostgreSQL; without one, the announcer.
fn notifications(cfg: &tokio_postgres::Config) -> Notifications {
    let mut chosen = Notifications::Announced;
    let Some(options) = cfg.get_options() else {
        return chosen;
    };
    // `-c idem.notify=on`, `-cidem.notify=on` or `--idem.notify=on`.
    for w in options.split_whitespace() {
        let w = w.trim_start_matches('-');
        let w = w.strip_prefix('c').unwrap_or(w);
        match w {
            "idem.notify=on" => chosen = Notifications::Trigger,
            "idem.notify=off" => chosen = Notifications::Off,
            _ => {}
        }
    }
    chosen
}

impl PgBackend {
    /// Builds the pool, checks that the database answers and applies pending
    /// migrations.
    ///
    /// # Errors
    /// As [`connect`].
    pub async fn connect(url: &str, options: PgOptions) -> Result<PgBackend> {
        let (cfg, target, notifications) = session_config(url, &options)?;
        let own = if notifications == Notifications::Trigger {
            announce::OwnSession::trigger()
        } else {
            announce::OwnSession::default()
        };
        let listening = Arc::new(notify::Listening::new(
            cfg.clone(),
            tls::connector(&target)?,
            own.clone(),
        ));
        let cfg_announce = cfg.clone();
        let manager = Manager::from_config(
            cfg,
            tls::connector(&target)?,
            ManagerConfig {
                // `Fast`: a pooled connection is reused without a round trip
                // (an empty query per checkout is a transaction of its own,
                // one more per operation); one whose session the server ended
                // unseen is replaced where the failure wrote nothing, or
                // checked before work that cannot run again (`run.rs`,
                // `checked_client` and `Generic`).
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .runtime(Runtime::Tokio1)
            .max_size(options.max_size.max(1))
            .wait_timeout(Some(options.pool_timeout))
            .create_timeout(Some(options.pool_timeout))
            .recycle_timeout(Some(options.pool_timeout))
            .build()
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot build the connection pool: {e}"))
            })?;
        {
            let mut client = pool
                .get()
                .await
                .map_err(|e| error::connect_error(e, &target))?;
            if options.migrate {
                migrate::apply(
                    &mut client,
                    Some(MIGRATION_WAIT),
                    options.allow_other_tables,
                    &target,
                )
                .await?;
            } else {
                migrate::check(&**client).await?;
            }
        }
        let schema = Arc::new(SchemaWatch::new());
        let _ = schema.record(&options.clock, Ok(()));
        let announcer = match notifications {
            Notifications::Trigger => announce::Announcer::trigger(),
            Notifications::Off => announce::Announcer::silent(listening.changes.publisher()),
            Notifications::Announced => announce::Announcer::start(
                cfg_announce,
                tls::connector(&target)?,
                listening.changes.publisher(),
                own,
            ),
        };
        let (submits, queue) = batch::queue();
        let stored = Arc::new(StoredContracts::new());
        // Lanes hold a connection while work is queued: at most half the pool.
        for _ in 0..SUBMIT_LANES.min((options.max_size / 2).max(1)) {
            tokio::spawn(run::submit_lane(
                pool.clone(),
                options.clock.clone(),
                options.max_retries,
                options.operation_timeout,
                Arc::clone(&queue),
                Arc::clone(&stored),
                announcer.clone(),
            ));
        }
        let (retries, queue) = batch::queue();
        // … the retry lane from a pool of 8 up, none under 8 (retries
        // are then written by the submit lanes, as any submit) …
        let retry_lanes = RETRY_LANES.min(options.max_size / 8);
        for _ in 0..retry_lanes {
            tokio::spawn(run::retry_lane(
                pool.clone(),
                options.clock.clone(),
                options.operation_timeout,
                Arc::clone(&queue),
                submits.clone(),
            ));
        }
        let (auths, queue) = batch::queue();
        // … and the authentication lanes at most a quarter: from a pool of 8 up,
        // at least three connections (eleven of the default 16) stay free for
        // claims, reports and reads.
        for _ in 0..2.min((options.max_size / 4).max(1)) {
            tokio::spawn(run::auth_lane(
                pool.clone(),
                options.clock.clone(),
                options.operation_timeout,
                Arc::clone(&queue),
            ));
        }
        Ok(PgBackend {
            pool,
            max_retries: options.max_retries,
            operation_timeout: options.operation_timeout,
            submits,
            auths,
            retries,
            hints: (retry_lanes > 0).then(ScopeHints::new),
            clock: options.clock,
            stored,
            listening,
            announcer,
            schema,
        })
    }

    /// The connection pool (for metrics and operator tooling).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_options_are_appended() {
        let (cfg, _, notify) = session_config(
            "postgres://u@localhost:5432/db?options=-c%20search_path%3Dx",
            &PgOptions::default(),
        )
        .unwrap();
        let o = cfg.get_options().unwrap();
        assert!(o.starts_with("-c search_path=x "), "{o}");
        assert!(o.contains("synchronous_commit=on"), "{o}");
        assert!(o.contains("statement_timeout=10000"), "{o}");
        assert!(o.contains("plan_cache_mode=force_generic_plan"), "{o}");
        assert!(o.contains("idem.notify=off"), "{o}");
        assert_eq!(notify, Notifications::Announced);
        let (cfg, _, notify) = session_config(
            "postgres://u@localhost:5432/db?options=-c%20idem.notify%3Don",
            &PgOptions::default(),
        )
        .unwrap();
        assert_eq!(notify, Notifications::Trigger);
        assert!(!cfg.get_options().unwrap().contains("idem.notify=off"));
        let (cfg, _, notify) = session_config(
            "postgres://u@localhost:5432/db?options=-c%20idem.notify%3Doff",
            &PgOptions::default(),
        )
        .unwrap();
        assert_eq!(notify, Notifications::Off);
        assert_eq!(
            cfg.get_options()
                .unwrap()
                .matches("idem.notify=off")
                .count(),
            1
        );
        // The last setting counts, as in PostgreSQL.
        let (_, _, notify) = session_config(
            "postgres://u@localhost:5432/db?options=-c%20idem.notify%3Doff%20-cidem.notify%3Don",
            &PgOptions::default(),
        )
        .unwrap();
        assert_eq!(notify, Notifications::Trigger);
    }
}
