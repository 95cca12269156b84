//! How much of the protocol the model explores: keys, tasks, executors,
//! tenants, ticks and faults, and which operation classes the keys use.

use std::fmt;

use crate::setup::{SAFE_CLASS, UNSAFE_CLASS};

/// Which operation classes the keys use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classes {
    /// Every key is `payment.release` (not safe to repeat).
    Unsafe,
    /// Every key is `generation.dispatch` (safe to repeat).
    Safe,
    /// Keys alternate: key 0 `payment.release`, key 1 `generation.dispatch`, …
    Both,
}

impl std::str::FromStr for Classes {
    type Err = String;
    fn from_str(s: &str) -> Result<Classes, String> {
        match s {
            "unsafe" => Ok(Classes::Unsafe),
            "safe" => Ok(Classes::Safe),
            "both" => Ok(Classes::Both),
            _ => Err(format!("`{s}`: expected unsafe, safe or both")),
        }
    }
}

impl fmt::Display for Classes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Classes::Unsafe => "unsafe",
            Classes::Safe => "safe",
            Classes::Both => "both",
        })
    }
}

/// The bounds of one exploration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounds {
    /// Idempotency keys (scopes) clients submit under.
    pub keys: u8,
    /// Tasks the store may accept in all (more than `keys` once retention
    /// released a key and the key is submitted again).
    pub tasks: u8,
    /// Classes of the keys.
    pub classes: Classes,
    /// Executors.
    pub executors: u8,
    /// Attempts (execute and reconcile) executors may claim per task before
    /// the horizon.
    pub attempts: u8,
    /// Executor crashes in all.
    pub crashes: u8,
    /// Operator actions in all.
    pub operator: u8,
    /// Ticks of the clock (100 ms each) during which faults happen; then
    /// the run drains (see [`IdemModel`]).
    pub horizon: u8,
    /// Tenants (1 or 2): key `k` and executor `e` belong to tenant
    /// `k % tenants` and `e % tenants`.
    pub tenants: u8,
    /// Report answers lost in all (the executor sends the same report again).
    pub lost: u8,
    /// Concurrency key cap (SPEC §8.2 "Concurrency caps"): every task carries
    /// the same concurrency key and claims enforce at most this many leased
    /// at once; 0 = no cap (tasks carry no key).
    pub cap: u8,
}

impl Bounds {
    /// The bound `idem-lab verify --ci` explores: one key of the non-safe class,
    /// one tenant, two executors, three attempts, one crash, one operator
    /// action, no lost report answer, 2 ticks (`--classes safe` for the safe
    /// class).
    pub fn ci() -> Bounds {
        Bounds {
            keys: 1,
            tasks: 1,
            classes: Classes::Unsafe,
            executors: 2,
            attempts: 3,
            crashes: 1,
            operator: 1,
            horizon: 2,
            tenants: 1,
            lost: 0,
            cap: 0,
        }
    }

    /// The bound of the test suite: one key of the non-safe class, two
    /// executors, two attempts, one crash, one operator action, one lost
    /// report answer, 2 ticks (about 240,000 distinct states; under a
    /// minute of CPU in a debug build).
    pub fn small() -> Bounds {
        Bounds {
            keys: 1,
            tasks: 1,
            classes: Classes::Unsafe,
            executors: 2,
            attempts: 2,
            crashes: 1,
            operator: 1,
            horizon: 2,
            tenants: 1,
            lost: 1,
            cap: 0,
        }
    }

    /// The class of key `k`.
    pub fn class_of(&self, k: u8) -> &'static str {
        match self.classes {
            Classes::Unsafe => UNSAFE_CLASS,
            Classes::Safe => SAFE_CLASS,
            Classes::Both if k.is_multiple_of(2) => UNSAFE_CLASS,
            Classes::Both => SAFE_CLASS,
        }
    }
}
