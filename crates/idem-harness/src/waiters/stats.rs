//! The store's transaction counts (`pg_stat_database`), read on a
//! connection of the bench's own.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::Listeners;

/// A connection of the bench's own to the store's PostgreSQL database, for
/// its transaction counts.
pub(super) struct PgStats {
    client: tokio_postgres::Client,
}

impl PgStats {
    pub(super) async fn connect(url: &str) -> Result<PgStats> {
        let mut cfg: tokio_postgres::Config = url.parse().context("parsing the PostgreSQL URL")?;
        cfg.application_name("idem-bench-waiters");
        let (client, conn) = cfg
            .connect(tokio_postgres::NoTls)
            .await
            .context("connecting to PostgreSQL for pg_stat_database")?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(PgStats { client })
    }

    /// `xact_commit + xact_rollback` of the current database.
    pub(super) async fn transactions(&self) -> Result<i64> {
        self.number(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database \
             WHERE datname = current_database()",
        )
        .await
        .context("reading pg_stat_database")
    }

    /// The integer `sql` answers. One simple query: one transaction of its
    /// own (an extended-protocol query costs two, its prepare and its
    /// execution).
    pub(super) async fn number(&self, sql: &str) -> Result<i64> {
        let messages = self.client.simple_query(sql).await?;
        messages
            .iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0),
                _ => None,
            })
            .and_then(|v| v.parse::<i64>().ok())
            .with_context(|| format!("no integer from `{sql}`"))
    }

    /// Ends the servers' listening sessions, which publishes their
    /// transaction counts (each server reconnects and re-checks its waiting
    /// claims); then what they cost over the run ([`Listeners`]).
    /// `rest_tx_per_s` is the rate everything else runs at meanwhile.
    pub(super) async fn listeners(
        &self,
        instances: usize,
        rest_tx_per_s: f64,
    ) -> Result<Listeners> {
        let events = self.number("SELECT count(*) FROM events").await?;
        let opened = self.transactions().await?;
        let started = Instant::now();
        self.number(&format!(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND query IN ('LISTEN {}', '{}')",
            idem_store::changes::CHANNEL,
            idem_store_postgres::notify::PING_SQL,
        ))
        .await
        .context("ending the listening sessions")?;
        tokio::time::sleep(LISTENER_SETTLE).await;
        // Less the ending query's own transaction.
        let counted = transactions_since(self, opened).await? - 1.0;
        let tx = (counted - rest_tx_per_s * started.elapsed().as_secs_f64()).max(0.0);
        Ok(Listeners {
            events,
            tx,
            tx_per_event_per_instance: tx / (events.max(1) as f64 * instances as f64),
        })
    }
}

/// How long after ending the listening sessions their counts are read: a
/// session publishes them as it exits.
pub(super) const LISTENER_SETTLE: Duration = Duration::from_secs(2);

/// Transactions counted since `opened` (a [`PgStats::transactions`] read),
/// less that read's own.
pub(super) async fn transactions_since(stats: &PgStats, opened: i64) -> Result<f64> {
    Ok((stats.transactions().await? - opened - 1).max(0) as f64)
}
