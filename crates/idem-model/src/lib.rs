//! # idem-model
//!
//! A model of idem's protocol for the `stateright` model checker, whose
//! actions call the real transitions of [`idem_core::machine`] (and
//! [`idem_core::machine::operator`]) on an in-memory store, so the checker
//! explores every interleaving the bounds allow of the code that runs in
//! production, not of a re-implementation (`idem verify`; docs/verification.md,
//! "Model checking").
//!
//! - [`state`]: the state: the store's task and attempt records, the
//!   executors' local knowledge, the provider's ledger, the model clock and
//!   ghost fields for properties about history.
//! - [`store`]: one function per store transaction, in the order of checks of
//!   `crates/idem-store/src/ops`.
//! - [`model`]: actors and actions (clients, executors, provider, sweeper,
//!   clock, operator), bounds, and the properties of SPEC §2.
//! - [`check`]: running the checker; [`trace`]: a counterexample as
//!   numbered steps.
//!
//! Each action is one store transaction (or one step of an executor or the
//! provider that does not touch the store): load the records, call the
//! machine function, write them back. Time is a discrete clock of 100 ms ticks
//! with a horizon; ids are deterministic (`Uuid::from_u128`).

pub mod check;
pub mod model;
pub mod state;
pub mod store;
pub mod trace;

pub use check::{Options, Report, Strategy, Verdict, run};
pub use model::{Action, Bounds, Classes, IdemModel};
