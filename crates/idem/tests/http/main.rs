//! Black-box HTTP tests of `idem serve`: every test starts its own server
//! process over its own SQLite file and talks to it with real HTTP; the
//! `multi_pg` tests run several processes over one fresh PostgreSQL database.

// Helpers outside `#[test]` functions panic on setup failures by design.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod backup;
mod cancel;
mod cli;
mod console;
mod contract;
mod events;
mod executor;
mod failover;
mod grants;
mod messages;
mod multi_pg;
mod operator;
mod overload;
mod pg_start;
mod pools;
mod queues;
mod rates;
mod release;
mod sdk;
mod search;
mod second_effects;
mod secrets;
mod serving;
mod sqlite_files;
mod submit;
mod support;
mod traceparent;
mod wait;
mod worker;
