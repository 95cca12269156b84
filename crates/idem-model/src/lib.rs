//! # idem-model
//!
//! A model of idem's protocol for the `stateright` model checker whose
//! actions run the real operations of [`idem_store::ops`] (submit, claim,
//! heartbeat, report, release, cancel, sweep, the operator actions, key
//! revocation) on an in-memory store, so the checker explores every
//! interleaving the bounds allow of the code that runs in production, not of
//! a re-implementation (`idem-lab verify`; docs/verification.md, "Model
//! checking").
//!
//! - [`memory`]: [`idem_store::Tx`] over the model's state; operations run
//!   on it as the SQLite writer runs them.
//! - [`state`]: the state: the store's rows (tasks, attempts, scope rows,
//!   which API keys are revoked), the executors' local knowledge, the
//!   provider's ledger, the model clock and ghost fields for properties
//!   about history.
//! - [`setup`]: what a run holds fixed: classes, tenants and their keys,
//!   the requests clients send.
//! - [`model`]: actors and actions (clients, executors, provider, sweeper,
//!   clock, operator), bounds, and the properties of SPEC §2.
//! - [`check`]: running the checker; [`trace`]: a counterexample as
//!   numbered steps.
//!
//! Each store action is one operation, one transaction: the step runs it on
//! a copy of the state and keeps none of it if it fails. Time is a discrete
//! clock of 100 ms ticks with a horizon; ids are deterministic
//! ([`idem_store::Tx::new_id`] counts up).

pub mod action;
pub mod bounds;
pub mod check;
pub mod memory;
pub mod model;
pub mod properties;
pub mod setup;
pub mod state;
pub mod trace;
mod transition;

pub use action::Action;
pub use bounds::{Bounds, Classes};
pub use check::{Options, Report, Strategy, Verdict, run};
pub use model::IdemModel;
