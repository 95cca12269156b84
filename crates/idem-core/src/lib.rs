//! # idem-core
//!
//! The pure heart of idem: no I/O, no clock, no randomness. Time (epoch
//! milliseconds) and identifiers come in as arguments, so every rule here is
//! tested exhaustively and deterministically.
//!
//! - [`json`]: strict reading of request bodies (duplicate keys, unsafe
//!   integers and deep nesting are rejected before anything is fingerprinted).
//! - [`fingerprint`]: RFC 8785 canonical request and its SHA-256 fingerprint.
//! - [`key`]: the `Idempotency-Key` header (RFC 9651 sf-string or bare token).
//! - [`config`]: operation classes, their retry and fee policy, and the
//!   [`config::Contract`] frozen onto each task at acceptance.
//! - [`contract`]: a frozen contract as tasks share and stores keep it (one
//!   JSON text and content id per class and configuration version).
//! - [`money`]: amounts in minor units with their ISO 4217 currency, and
//!   the one way they are written for people (`EUR 1.00`).
//! - [`schema`]: the JSON Schema a class's params must match.
//! - [`submit`]: a submit body from its bytes to params, canonical request
//!   and fingerprint.
//! - [`model`]: tasks, attempts, cancellation, delivery, failure.
//! - [`trace`]: the W3C `traceparent` a submit may carry, kept on its task.
//! - [`machine`]: the task state machine: every transition as one pure
//!   function returning the new records and the events to append.

pub mod config;
pub mod contract;
pub mod fingerprint;
pub mod flow;
pub mod json;
pub mod key;
pub mod machine;
pub mod model;
pub mod money;
pub mod schema;
pub mod submit;
pub mod trace;
