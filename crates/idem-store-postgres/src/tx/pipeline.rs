//! The pipelined run of the [`SubmitPlan`] on an autocommit [`PgTx`]: two
//! round trips instead of five.

use idem_core::contract::FrozenContract;
use idem_store::contracts::StoredContracts;
use idem_store::ops::{Submission, SubmitOutcome, SubmitPlan, scopes_with_second_effects};
use idem_store::{Clock, Result, StoreError};

use super::{Conn, PgTx, changes_of};
use crate::error::map_pg_error;
use crate::rows::*;

/// A submit batch to run as one pipelined transaction
/// ([`PgTx::submit_pipelined`]), on the backend's clock, and what its
/// database is known to hold.
pub(crate) struct Pipelined<'s>(
    pub(crate) &'s [Submission],
    pub(crate) &'s Clock,
    pub(crate) &'s StoredContracts,
    pub(crate) &'s crate::announce::Announcer,
);

impl PgTx<'_> {
    /// Runs the [`SubmitPlan`] of `subs` in two round trips instead of five,
    /// using the protocol's pipelining. Round trip 1: `BEGIN`, the clock and key
    /// check, the scope rows. Round trip 2: the new tasks with their events and
    /// `COMMIT` (a batch that won every scope), or the read-back of the taken
    /// scopes and `COMMIT` (a batch that won none, so wrote nothing). A batch
    /// with both sends the tasks and the read-back, and commits in a third round
    /// trip once every answer is decoded. Each statement still runs in order in
    /// one READ COMMITTED transaction, with its own snapshot, and the plan
    /// decides every answer, so the answers are those of [`SubmitPlan::run`],
    /// and nothing can fail after a `COMMIT` that wrote something. Only on an
    /// autocommit [`PgTx`] (the connection itself).
    ///
    /// Answers `None`, with nothing written, when a submitting key is revoked:
    /// run the batch as an ordinary transaction, which refuses that key's
    /// submissions only.
    ///
    /// A failed statement aborts the transaction, and PostgreSQL then ends a
    /// pipelined `COMMIT` as a rollback: errors are read in statement order and
    /// the first one is returned, with nothing written. On any error a
    /// `ROLLBACK` is sent, so the connection goes back to the pool idle.
    ///
    /// # Errors
    /// As [`SubmitPlan::run`]: [`StoreError::Contention`] (run it again; also
    /// when a taken scope's row vanished before the read-back),
    /// [`StoreError::Unavailable`] (connection lost; if during `COMMIT`, the
    /// outcome is unknown), [`StoreError::Corrupt`].
    ///
    /// Once committed, the new tasks' events are in [`PgTx::take_changes`].
    ///
    /// The new tasks' contracts not in `stored` are written with the tasks,
    /// in the same statement, and remembered once committed; after an error
    /// `stored` is forgotten (a contract row may be missing: a restored
    /// database), so the batch run again writes them.
    pub(crate) async fn submit_pipelined(
        &mut self,
        subs: &[Submission],
        stored: &StoredContracts,
    ) -> Result<Option<Vec<SubmitOutcome>>> {
        let Conn::Auto(client) = self.conn else {
            return Err(StoreError::Corrupt(
                "a pipelined submit opens its own transaction".into(),
            ));
        };
        let res = self.submit_pipelined_on(client, subs, stored).await;
        if res.is_err() {
            stored.forget();
            // After a COMMIT this only draws a warning ("no transaction").
            let _ = client.batch_execute("ROLLBACK").await;
        }
        res
    }

    async fn submit_pipelined_on(
        &mut self,
        client: &deadpool_postgres::Client,
        subs: &[Submission],
        stored: &StoredContracts,
    ) -> Result<Option<Vec<SubmitOutcome>>> {
        let keys_stmt = self.statement(NOW_AND_LIVE_KEYS).await?;
        let scopes_stmt = self.statement(SCOPES_INSERT).await?;
        let tasks_stmt = self.statement(&TASKS_WITH_EVENTS_INSERT).await?;
        let lookup_stmt = self.statement(&SCOPES_WITH_TASKS).await?;
        let mut plan = SubmitPlan::new(subs);
        let (now, live, won) = {
            let scope_arrays = ScopeArrays::new(plan.scope_rows());
            let keys = plan.keys();
            let offset = self.clock.offset_ms();
            let keys_params: [Param<'_>; 2] = [&keys, &offset];
            let scope_params = scope_arrays.params();
            // Round trip 1. `biased` polls in order, so the requests go out in
            // order. Should BEGIN fail, the scope insert would fail too: its
            // foreign key to `tasks` is checked at commit, and there is no task yet.
            let (begun, keys, inserted) = tokio::join!(
                biased;
                client.batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED"),
                client.query(&keys_stmt, &keys_params),
                client.query(&scopes_stmt, &scope_params),
            );
            begun.map_err(map_pg_error)?;
            let (now, live) = now_and_live(&keys.map_err(map_pg_error)?)?;
            let won = scopes_won(plan.scope_rows(), &inserted.map_err(map_pg_error)?)?;
            (now, live, won)
        };
        if !plan.check_keys(&live) {
            client
                .batch_execute("ROLLBACK")
                .await
                .map_err(map_pg_error)?;
            return Ok(None);
        }
        let accepted = plan.accept(&won, now)?;
        let (created, journals) = accepted.new_tasks();
        let contracts: Vec<FrozenContract> = stored
            .unknown(created.iter().map(|t| &t.contract))
            .into_iter()
            .cloned()
            .collect();
        let lookup = ScopeLookup::new(accepted.taken());
        let lookup_params = lookup.params();
        if accepted.taken().is_empty() {
            // Round trip 2 of a batch of new scopes only: tasks and events, COMMIT.
            // Nothing is left to decode after COMMIT, so no error can follow it.
            let (tasks_written, committed) = tokio::join!(
                biased;
                self.insert_new_tasks(&tasks_stmt, created, journals, &contracts),
                client.batch_execute("COMMIT"),
            );
            // In statement order: a failed insert turned COMMIT into a rollback.
            tasks_written?;
            committed.map_err(map_pg_error)?;
            stored.remember(&contracts);
            let changes = changes_of(created, journals);
            drop(lookup);
            self.changes = changes;
            return accepted.answer_all(Vec::new()).map(Some);
        }
        if created.is_empty() {
            // Round trip 2 of a batch that won no scope (replays and conflicts
            // only): the read-back and COMMIT. The batch wrote nothing, so an
            // error found after COMMIT (a row that does not decode, a vanished
            // scope) leaves nothing behind either, and the batch may run again.
            let (existing, committed) = tokio::join!(
                biased;
                client.query(&lookup_stmt, &lookup_params),
                client.batch_execute("COMMIT"),
            );
            let existing = existing.map_err(map_pg_error)?;
            committed.map_err(map_pg_error)?;
            let mut existing = existing_scopes(accepted.taken(), &existing)?;
            drop(lookup);
            // A replayed task with effect reports (rare) reads its second
            // effects in one more statement, after COMMIT (autocommit): they
            // are only ever added and acknowledged, so it shows at least
            // those the lookup's snapshot held.
            scopes_with_second_effects(self, &mut existing).await?;
            return accepted.answer_all(existing).map(Some);
        }
        // Round trip 2 of a batch with both: tasks and events, then the read-back,
        // a later statement, so it sees the scope rows that beat this batch
        // (committed) and the tasks this batch just wrote (two submissions of
        // one scope in a batch). COMMIT waits for round trip 3, once every
        // answer is decoded: any failure until then writes nothing.
        let (tasks_written, existing) = tokio::join!(
            biased;
            self.insert_new_tasks(&tasks_stmt, created, journals, &contracts),
            client.query(&lookup_stmt, &lookup_params),
        );
        tasks_written?;
        let mut existing = existing_scopes(accepted.taken(), &existing.map_err(map_pg_error)?)?;
        drop(lookup);
        // A replayed task with effect reports (rare): its second effects,
        // one more statement before COMMIT.
        scopes_with_second_effects(self, &mut existing).await?;
        let changes = changes_of(created, journals);
        let outcomes = accepted.answer_all(existing)?;
        client.batch_execute("COMMIT").await.map_err(map_pg_error)?;
        stored.remember(&contracts);
        self.changes = changes;
        Ok(Some(outcomes))
    }
}
