//! Concurrency caps (SPEC §8.2 "Concurrency caps"): how many attempts may
//! hold a lease at once per class, per tenant, per (tenant, class) and per
//! concurrency key.
//!
//! A cap is enforced by a unique constraint, not by counting: each cap
//! scope has the slots `0..cap` (`lease_slots`, primary key `(scope,
//! slot)`), and a claim leases an attempt only if it takes one free slot of
//! every cap that applies ([`crate::Tx::take_slots`], `INSERT … ON CONFLICT
//! DO NOTHING` of the first free slot). The slots are freed in the
//! transaction in which the attempt stops holding the lease (every task
//! write goes through one place, `ops::persist`, which calls
//! [`crate::Tx::free_slots`]). Two claims racing for one slot on PostgreSQL:
//! the unique index makes the second wait for the first and then insert
//! nothing, so that candidate counts as capped (a race may admit fewer than
//! the cap, never more).
//!
//! The store holds no configuration: the caps travel in the claim
//! ([`ClaimFlow`], built by the HTTP layer from the configuration).

use idem_core::model::Task;

/// Counter of claim candidates left waiting because a cap was full, by
/// `operation` and `cap` ([`CapKind::as_str`]); counted per claim
/// transaction run (a retried transaction counts again).
pub const CLAIMS_CAPPED: &str = "idem_claims_capped_total";

/// Which cap a slot belongs to (the metric's `cap` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CapKind {
    /// `[tenants."T"] cap`: leased attempts of a tenant, all classes.
    Tenant,
    /// `[operations.X.flow] cap`: leased attempts of a class, all tenants.
    Class,
    /// `[operations.X.flow] tenant_cap`: per (tenant, class).
    TenantClass,
    /// `[operations.X.flow] concurrency_key_cap`: per concurrency key value
    /// of a (tenant, class).
    ConcurrencyKey,
}

impl CapKind {
    /// The metric label: `tenant`, `class`, `tenant_class`, `concurrency_key`.
    pub fn as_str(self) -> &'static str {
        match self {
            CapKind::Tenant => "tenant",
            CapKind::Class => "class",
            CapKind::TenantClass => "tenant_class",
            CapKind::ConcurrencyKey => "concurrency_key",
        }
    }
}

pub use crate::flow::{ClaimFlow, ClassCaps};

/// One slot to take: the cap scope, its cap and which cap it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapSlot {
    /// Which cap.
    pub kind: CapKind,
    /// The scope's name in `lease_slots.scope`: a JSON array naming the cap
    /// and what it counts, e.g. `["concurrency_key","acme","payment.release","p-1"]`.
    pub scope: String,
    /// Slots `0..cap` may be taken (at least 1).
    pub cap: i64,
}

impl ClaimFlow {
    /// The slots a lease of `task` must take, in a fixed order (tenant,
    /// class, tenant and class, concurrency key); empty when no cap applies.
    pub fn slots(&self, task: &Task) -> Vec<CapSlot> {
        let tenant = task.control.tenant.as_str();
        let class = task.operation.as_str();
        let caps = self.classes.get(class).copied().unwrap_or_default();
        let scope = |parts: &[&str]| serde_json::Value::from(parts.to_vec()).to_string();
        let mut out = Vec::new();
        let mut add = |kind: CapKind, cap: Option<i64>, parts: &[&str]| {
            if let Some(cap) = cap {
                out.push(CapSlot {
                    kind,
                    scope: scope(parts),
                    cap: cap.max(1),
                });
            }
        };
        add(
            CapKind::Tenant,
            self.tenant_caps.get(tenant).copied(),
            &["tenant", tenant],
        );
        add(CapKind::Class, caps.cap, &["class", class]);
        add(
            CapKind::TenantClass,
            caps.tenant_cap,
            &["tenant_class", tenant, class],
        );
        if let Some(key) = task.control.concurrency_key.as_deref() {
            add(
                CapKind::ConcurrencyKey,
                caps.concurrency_key_cap,
                &["concurrency_key", tenant, class, key],
            );
        }
        out
    }
}
