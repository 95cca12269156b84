//! Executor operations whose API key is checked inside their own
//! transaction (SPEC §4 Auth): the claim of a waiting claim woken for work,
//! and a report, sent with a key from the process's cache of authenticated
//! keys. A key's tenant, role and grant never change; only `revoked_at`
//! does, and it is read here, where the attempt is leased or the report
//! written, so a key revoked since it was cached leases and writes nothing,
//! without a lookup of its own before the operation.

use idem_core::model::Task;
use uuid::Uuid;

use super::{Claim, ClaimRequest, Claimed, Operation, Report};
use crate::spans::Ending;
use crate::{Refusal, Result, Tx};

/// Whether API key `id` exists and is not revoked, read in `tx`.
async fn live<T: Tx>(tx: &mut T, id: Uuid) -> Result<bool> {
    Ok(tx
        .api_key(id)
        .await?
        .is_some_and(|key| key.revoked_at.is_none()))
}

/// [`Claim`] by the executor key `key`: `None` (nothing leased) when that
/// key is revoked or gone.
#[derive(Debug, Clone)]
pub struct ClaimAs {
    /// The executor's API key.
    pub key: Uuid,
    /// The claim.
    pub req: ClaimRequest,
}

impl Operation for ClaimAs {
    type Reply = Option<Vec<Claimed>>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        if !live(tx, self.key).await? {
            return Ok(None);
        }
        Claim(self.req.clone()).run(tx).await.map(Some)
    }
}

/// [`Report`] by the executor key `key`: `None` (nothing written) when that
/// key is revoked or gone.
#[derive(Debug, Clone)]
pub struct ReportAs {
    /// The executor's API key.
    pub key: Uuid,
    /// The report.
    pub report: Report,
}

impl Operation for ReportAs {
    type Reply = Ending<Option<std::result::Result<Task, Refusal>>>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Self::Reply> {
        if !live(tx, self.key).await? {
            return Ok(Ending {
                reply: None,
                ended: Vec::new(),
            });
        }
        let out = self.report.run(tx).await?;
        Ok(Ending {
            reply: Some(out.reply),
            ended: out.ended,
        })
    }
}
