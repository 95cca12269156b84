//! The plan: everything the seed decides (operation classes, keys, client timeouts,
//! changed payloads, replays and cancels; executor faults per attempt ordinal;
//! server kills and connection terminations), drawn from weighted tables.

use super::*;

/// The operation classes a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// `payment.release`: not safe to repeat; unknown outcomes are reconciled.
    Payment,
    /// `generation.dispatch`: safe to repeat.
    Generation,
}

impl Class {
    /// The operation class name.
    pub fn operation(self) -> &'static str {
        match self {
            Class::Payment => "payment.release",
            Class::Generation => "generation.dispatch",
        }
    }

    /// The class of an operation name.
    pub fn from_operation(op: &str) -> Option<Class> {
        match op {
            "payment.release" => Some(Class::Payment),
            "generation.dispatch" => Some(Class::Generation),
            _ => None,
        }
    }

    /// Whether the class is declared safe to repeat.
    pub fn is_safe(self) -> bool {
        self == Class::Generation
    }

    /// The material fields of `params` (what the fingerprint covers).
    pub fn material(self, params: &Value) -> Value {
        match self {
            Class::Payment => json!({
                "payee": params.get("payee"),
                "amount": params.get("amount"),
                "currency": params.get("currency"),
            }),
            Class::Generation => params.clone(),
        }
    }

    /// The request of operation `op` for `key`, with `change` added to a
    /// material field (0: the scope's usual request).
    pub fn params(self, key: u32, change: u32, op: usize) -> Value {
        let k = u64::from(key);
        match self {
            Class::Payment => json!({
                "payee": format!("acct-{}", k % 97),
                "amount": 100 + (k * 37) % 5000 + u64::from(change),
                "currency": "EUR",
                // Not material: differs between operations, replays all the same.
                "memo": format!("op-{op}"),
            }),
            Class::Generation => json!({
                "prompt": format!("frame {k}"),
                "steps": 20 + k % 10 + u64::from(change),
            }),
        }
    }
}

/// One client operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpPlan {
    /// Operation class.
    pub class: Class,
    /// Idempotency key number (the key is `k<n>`).
    pub key: u32,
    /// A changed material field (`Some(delta)`): the request must be refused with 422.
    pub changed: Option<u32>,
    /// The first try uses this tiny client timeout (ms) and is retried with the same key.
    pub first_timeout_ms: Option<u64>,
    /// Replays of the same request after the answer.
    pub replays: u8,
    /// Pause before each replay, ms.
    pub replay_delay_ms: u64,
    /// Cancel this long after the answer, ms.
    pub cancel_after_ms: Option<u64>,
}

impl OpPlan {
    /// The idempotency key.
    pub fn key_string(&self) -> String {
        format!("k{}", self.key)
    }
}

/// What an executor does with one execute attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecFault {
    /// Perform the effect and report `succeeded`.
    Clean,
    /// Crash before the effect (no report).
    CrashBeforeEffect,
    /// Perform the effect, then crash (no report).
    CrashAfterEffect,
    /// Perform the effect, then report `unknown`.
    UnknownAfterEffect,
    /// Report `unknown` without performing the effect.
    UnknownWithoutEffect,
    /// Report `failed` / `transient` without performing the effect.
    Transient,
    /// Report `failed` / `invalid_input` without performing the effect.
    Permanent,
    /// Perform the effect, sleep past the lease, then report `succeeded` (must be refused).
    LateReport,
    /// Report `succeeded`, repeat it exactly, then send a different outcome (must be refused).
    DuplicateReport,
    /// Cut off from idem (no heartbeat gets through) for longer than its
    /// lease, pay anyway `after_ms` after the lease ran out, then report
    /// `succeeded` with the transaction id, retried until answered (must be
    /// refused, and is kept as evidence). Whether this is the task's first
    /// effect or a second one depends on the race with the reconciliation
    /// that follows the expired lease. See [`Plan::with_stale_payers`].
    StalePay {
        /// Pause after the lease ran out, ms.
        after_ms: u64,
    },
    /// Pay within the lease but lose the provider's answer, stay cut off from
    /// idem past the lease, pay again `after_ms` after it ran out (a second
    /// effect, unless the provider deduplicates), then report `succeeded` with
    /// the second transaction id, retried until answered (must be refused).
    StaleRepay {
        /// Pause after the lease ran out, ms.
        after_ms: u64,
    },
}

impl ExecFault {
    /// Name of the fault kind in `faults`.
    pub fn name(self) -> &'static str {
        match self {
            ExecFault::Clean => "clean",
            ExecFault::CrashBeforeEffect => "executor_crash_before_effect",
            ExecFault::CrashAfterEffect => "executor_crash_after_effect",
            ExecFault::UnknownAfterEffect => "outcome_unknown_after_effect",
            ExecFault::UnknownWithoutEffect => "outcome_unknown_without_effect",
            ExecFault::Transient => "transient_failure",
            ExecFault::Permanent => "invalid_input_failure",
            ExecFault::LateReport => "stale_late_report",
            ExecFault::DuplicateReport => "duplicate_report",
            ExecFault::StalePay { .. } => "stale_executor_pays",
            ExecFault::StaleRepay { .. } => "stale_executor_pays_again",
        }
    }
}

/// What an executor does with one reconcile attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconFault {
    /// Look the effect up and report `committed` / `not_committed`.
    Clean,
    /// Crash (no report).
    Crash,
    /// Report `failed` / `transient`.
    Transient,
    /// Report `unknown`.
    Unknown,
    /// Look up, sleep past the lease, then report (must be refused).
    LateReport,
}

impl ReconFault {
    /// Name of the fault kind in `faults`.
    pub fn name(self) -> &'static str {
        match self {
            ReconFault::Clean => "clean",
            ReconFault::Crash => "reconcile_crash",
            ReconFault::Transient => "reconcile_transient_failure",
            ReconFault::Unknown => "reconcile_unknown",
            ReconFault::LateReport => "reconcile_stale_late_report",
        }
    }
}

/// One execute attempt's behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecStep {
    /// The fault.
    pub fault: ExecFault,
    /// Heartbeat (with half the usage) before the effect; a pending cancel is obeyed.
    pub heartbeat: bool,
    /// Usage units the attempt reports.
    pub usage: i64,
}

impl ExecStep {
    pub(super) const CLEAN: ExecStep = ExecStep {
        fault: ExecFault::Clean,
        heartbeat: false,
        usage: 1,
    };
}

/// The executor behaviour for one scope: by ordinal of execute and of
/// reconcile attempts; attempts beyond the script behave cleanly.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Script {
    /// Execute attempts 1, 2, 3 …
    pub exec: Vec<ExecStep>,
    /// Reconcile attempts 1, 2 …
    pub recon: Vec<ReconFault>,
}

/// A fault injected into the infrastructure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerFault {
    /// SIGKILL server process `server`, then restart it on the same store.
    Kill {
        /// Index of the server process.
        server: usize,
    },
    /// Terminate every PostgreSQL connection of the idem processes.
    PgTerminate,
}

/// Everything a seed decides. Equal seeds (with equal `ops` and store kind) give equal plans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The seed.
    pub seed: u64,
    /// Server processes (1 on SQLite, 2 on PostgreSQL).
    pub servers: usize,
    /// Client operations, in dispatch order.
    pub ops: Vec<OpPlan>,
    /// Executor behaviour per scope used by `ops`.
    pub scripts: BTreeMap<(Class, u32), Script>,
    /// `(operation index, fault)`: the fault is injected when that operation is dispatched.
    pub server_faults: Vec<(usize, ServerFault)>,
    /// Network episodes against one instance's database link at a time, by
    /// operation index (`--netns`; empty otherwise). See [`Plan::with_network`].
    pub network: Vec<NetEpisode>,
    /// Shift of the second instance's clock, ms (`--clock-skew-ms`; 0: none).
    /// See [`Plan::with_clock_skew`].
    pub clock_skew_ms: i64,
}

fn weighted<T: Copy>(rng: &mut StdRng, table: &[(T, u32)]) -> T {
    let total: u32 = table.iter().map(|(_, w)| *w).sum();
    let mut x = rng.random_range(0..total.max(1));
    for (v, w) in table {
        if x < *w {
            return *v;
        }
        x -= *w;
    }
    table[0].0
}

const FIRST_EXEC: &[(ExecFault, u32)] = &[
    (ExecFault::Clean, 46),
    (ExecFault::CrashBeforeEffect, 6),
    (ExecFault::CrashAfterEffect, 8),
    (ExecFault::UnknownAfterEffect, 7),
    (ExecFault::UnknownWithoutEffect, 4),
    (ExecFault::Transient, 8),
    (ExecFault::Permanent, 2),
    (ExecFault::LateReport, 11),
    (ExecFault::DuplicateReport, 8),
];

const LATER_EXEC: &[(ExecFault, u32)] = &[
    (ExecFault::Clean, 70),
    (ExecFault::CrashBeforeEffect, 4),
    (ExecFault::CrashAfterEffect, 5),
    (ExecFault::UnknownAfterEffect, 5),
    (ExecFault::UnknownWithoutEffect, 2),
    (ExecFault::Transient, 5),
    (ExecFault::Permanent, 1),
    (ExecFault::LateReport, 5),
    (ExecFault::DuplicateReport, 3),
];

const RECON: &[(ReconFault, u32)] = &[
    (ReconFault::Clean, 60),
    (ReconFault::Crash, 12),
    (ReconFault::Transient, 10),
    (ReconFault::Unknown, 8),
    (ReconFault::LateReport, 10),
];

impl Plan {
    /// The plan of `seed` for `ops` operations on SQLite (`postgres: false`) or PostgreSQL.
    pub fn new(seed: u64, ops: usize, postgres: bool) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        let keyspace = u32::try_from((ops / 4).max(8)).unwrap_or(u32::MAX);
        let mut plan_ops = Vec::with_capacity(ops);
        for _ in 0..ops {
            let class = if rng.random_bool(0.8) {
                Class::Payment
            } else {
                Class::Generation
            };
            let key = rng.random_range(0..keyspace);
            let changed = rng.random_bool(0.07).then(|| rng.random_range(1..=9));
            let first_timeout_ms = rng.random_bool(0.08).then(|| rng.random_range(1..=15));
            let replays = weighted(&mut rng, &[(0u8, 55), (1, 30), (2, 15)]);
            let replay_delay_ms = rng.random_range(0..200);
            // Half of the cancels race the first attempt, half come later.
            let cancel_after_ms = rng.random_bool(0.12).then(|| {
                if rng.random_bool(0.5) {
                    rng.random_range(0..15)
                } else {
                    rng.random_range(15..400)
                }
            });
            plan_ops.push(OpPlan {
                class,
                key,
                changed,
                first_timeout_ms,
                replays,
                replay_delay_ms,
                cancel_after_ms,
            });
        }
        let scopes: BTreeSet<(Class, u32)> = plan_ops.iter().map(|o| (o.class, o.key)).collect();
        let mut scripts = BTreeMap::new();
        for scope in scopes {
            let exec = (0..3)
                .map(|i| ExecStep {
                    fault: weighted(&mut rng, if i == 0 { FIRST_EXEC } else { LATER_EXEC }),
                    heartbeat: rng.random_bool(0.5),
                    usage: rng.random_range(1..=20),
                })
                .collect();
            let recon = (0..2).map(|_| weighted(&mut rng, RECON)).collect();
            scripts.insert(scope, Script { exec, recon });
        }
        let servers = if postgres { 2 } else { 1 };
        let lo = ops / 20;
        let hi = (ops * 9 / 10).max(lo + 1);
        let mut server_faults = Vec::new();
        for _ in 0..(ops / 400).max(3) {
            let at = rng.random_range(lo..hi);
            let server = rng.random_range(0..servers);
            server_faults.push((at, ServerFault::Kill { server }));
        }
        if postgres {
            for _ in 0..(ops / 300).max(3) {
                server_faults.push((rng.random_range(lo..hi), ServerFault::PgTerminate));
            }
        }
        server_faults.sort_by_key(|(at, _)| *at);
        Plan {
            seed,
            servers,
            ops: plan_ops,
            scripts,
            server_faults,
            network: Vec::new(),
            clock_skew_ms: 0,
        }
    }

    /// The plan with stale payers: for about one scope in seven, the first
    /// execute attempt's executor is cut off from idem past its lease and pays
    /// at the provider anyway ([`ExecFault::StalePay`], or
    /// [`ExecFault::StaleRepay`] after a first payment within the lease), at
    /// most 2.5 s after the lease ran out, then reports. Drawn from a
    /// generator of its own, so the rest of the plan is the seed's as
    /// without them.
    pub fn with_stale_payers(mut self) -> Plan {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x5741_1e9a_7e25_0001);
        for script in self.scripts.values_mut() {
            if !rng.random_bool(0.15) {
                continue;
            }
            let after_ms = rng.random_range(0..2500);
            let fault = if rng.random_bool(0.5) {
                ExecFault::StalePay { after_ms }
            } else {
                ExecFault::StaleRepay { after_ms }
            };
            if let Some(first) = script.exec.first_mut() {
                first.fault = fault;
                first.heartbeat = false;
            }
        }
        self
    }

    /// Injected faults by kind, as planned (identical for identical plans).
    pub fn fault_counts(&self) -> BTreeMap<String, u64> {
        let mut m: BTreeMap<String, u64> = BTreeMap::new();
        let mut add = |k: &str, n: u64| {
            if n > 0 {
                *m.entry(k.to_owned()).or_default() += n;
            }
        };
        for op in &self.ops {
            add("client_timeout", u64::from(op.first_timeout_ms.is_some()));
            add("changed_payload", u64::from(op.changed.is_some()));
            add("retry_same_key", u64::from(op.replays));
            add("cancel", u64::from(op.cancel_after_ms.is_some()));
        }
        for s in self.scripts.values() {
            for step in &s.exec {
                if step.fault != ExecFault::Clean {
                    add(step.fault.name(), 1);
                }
            }
            for r in &s.recon {
                if *r != ReconFault::Clean {
                    add(r.name(), 1);
                }
            }
        }
        for (_, f) in &self.server_faults {
            match f {
                ServerFault::Kill { server } => {
                    add("server_sigkill", 1);
                    if self.clock_skew_ms != 0 && *server == SKEWED_SERVER {
                        add("clock_skew_flip", 1);
                    }
                }
                ServerFault::PgTerminate => add("pg_terminate_backend", 1),
            }
        }
        for e in &self.network {
            add(e.fault.name(), 1);
            add(&format!("{}_ms", e.fault.name()), e.duration_ms);
        }
        m
    }
}
