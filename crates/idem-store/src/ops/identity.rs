//! The store's identity check: record the database's identity, and when it
//! went back in time, move the tasks that may have started to
//! reconcile-first (SPEC §2.11; [`crate::identity`]).

use idem_core::machine::{self, Journal};
use serde_json::json;
use uuid::Uuid;

use super::{Operation, persist};
use crate::identity::{IdentityCheck, StoreIdentity};
use crate::spans::{EndedAttempt, Ending};
use crate::{Result, Tx};

/// Tasks read per page while rewinding (all pages in the one transaction).
const REWIND_PAGE: i64 = 500;

/// Compares the database's identity with the recorded one; records it when
/// none is; on a change records the new one with a compare-and-set on the
/// recorded epoch and, in the same transaction, applies
/// [`machine::store_rewound`] to every non-terminal task.
#[derive(Debug, Clone)]
pub struct CheckIdentity {
    /// The epoch recorded if a new identity is (a UUID v4 the caller made).
    pub fresh_epoch: Uuid,
}

impl Operation for CheckIdentity {
    type Reply = Ending<IdentityCheck>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        let db = tx.database_identity().await?;
        let recorded = tx.recorded_identity().await?;
        let fresh = StoreIdentity {
            epoch: self.fresh_epoch,
            system_identifier: db.as_ref().map(|d| d.system_identifier.clone()),
            timeline: db.as_ref().map(|d| d.timeline),
        };
        let unchanged = |identity| Ending {
            reply: IdentityCheck::Unchanged(identity),
            ended: Vec::new(),
        };
        let Some(rec) = recorded else {
            return Ok(if tx.record_identity(None, &fresh).await? {
                Ending {
                    reply: IdentityCheck::Recorded(fresh),
                    ended: Vec::new(),
                }
            } else {
                // Another instance recorded one first.
                let now = tx.recorded_identity().await?;
                unchanged(now.map_or(fresh, |r| r.identity))
            });
        };
        let moved = rec.restored || db.as_ref().is_some_and(|d| rec.identity.differs_from(d));
        if !moved {
            return Ok(unchanged(rec.identity));
        }
        if !tx.record_identity(Some(&rec.identity), &fresh).await? {
            // Another instance noticed the same change and rewound first.
            let now = tx.recorded_identity().await?;
            return Ok(unchanged(now.map_or(fresh, |r| r.identity)));
        }
        let now = tx.now().await?;
        let store = json!({
            "from": rec.identity,
            "to": fresh,
            "restored_backup": rec.restored,
        });
        let mut tasks = 0;
        let mut ended = Vec::new();
        let mut after = None;
        loop {
            let ids = tx.unfinished_tasks(after, REWIND_PAGE).await?;
            let Some(last) = ids.last().copied() else {
                break;
            };
            after = Some(last);
            for id in ids {
                let Some(mut task) = super::load_task(tx, id, true).await? else {
                    continue;
                };
                let mut attempt = match task.control.active_attempt_id {
                    Some(a) => tx.attempt(a).await?,
                    None => None,
                };
                let was_active = attempt.as_ref().is_some_and(|a| a.state.is_active());
                let loaded = (task.control.version, task.generation);
                let mut j = Journal::default();
                if !machine::store_rewound(&mut task, attempt.as_mut(), &mut j, now, &store) {
                    continue;
                }
                if let Some(a) = &attempt
                    && was_active
                    && !a.state.is_active()
                {
                    tx.update_attempt(a).await?;
                    ended.extend(EndedAttempt::of(&task, a, true, now));
                }
                persist(tx, &task, loaded, &j).await?;
                tasks += 1;
            }
        }
        Ok(Ending {
            reply: IdentityCheck::Rewound {
                from: rec.identity,
                to: fresh,
                restored: rec.restored,
                tasks,
            },
            ended,
        })
    }
}

/// Marks the store as restored from a backup ([`Tx::mark_restored`]): what
/// `idem backup` does to its copy, and what an operator does to a database
/// restored by a means that keeps its identity (a logical dump loaded into
/// the same PostgreSQL cluster). Claims lease nothing until the next
/// identity check has rewound. Answers whether an identity was recorded to
/// mark (a store that never checked its identity has none).
#[derive(Debug, Clone)]
pub struct MarkRestored;

impl Operation for MarkRestored {
    type Reply = bool;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<bool> {
        tx.mark_restored().await
    }
}
