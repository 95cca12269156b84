//! `idem-lab verify`: explores the protocol model of `idem-model` with the
//! stateright model checker (docs/verification.md, "Model checking").

use anyhow::{Result, bail};
use clap::Args;
use idem_model::check::{Options, Report, Strategy, Verdict};
use idem_model::{Bounds, Classes};

use idem_server::output::{say, say_raw};

/// The bounds and how to explore them. Without `--ci` the bounds are those
/// of the acceptance run (at least 10^6 distinct states); each flag replaces
/// one bound of the chosen preset.
#[derive(Args, Debug, Clone)]
pub(crate) struct VerifyArgs {
    /// The small bound CI runs (a debug build finishes in well under 2 minutes).
    #[arg(long)]
    ci: bool,
    /// Idempotency keys (scopes) clients submit under.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=8))]
    keys: Option<u8>,
    /// Tasks the store may accept in all (above --keys once retention
    /// released a key and it is submitted again).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=16))]
    tasks: Option<u8>,
    /// Classes of the keys: unsafe (payment.release), safe
    /// (generation.dispatch) or both (alternating).
    #[arg(long)]
    classes: Option<Classes>,
    /// Executors.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=8))]
    executors: Option<u8>,
    /// Attempts (execute and reconcile) executors may claim per task before
    /// the horizon.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=16))]
    attempts: Option<u8>,
    /// Executor crashes in all.
    #[arg(long)]
    crashes: Option<u8>,
    /// Operator actions (retry-now, cancel, resolve, redrive) in all.
    #[arg(long)]
    operator: Option<u8>,
    /// Tenants (1 or 2): keys and executors alternate between them, and
    /// with two the same idempotency key is used by both.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=2))]
    tenants: Option<u8>,
    /// Report answers lost in all (the executor sends the same report again).
    #[arg(long)]
    lost: Option<u8>,
    /// Concurrency key cap (SPEC §8.2 "Concurrency caps"): every task carries
    /// one concurrency key and claims lease at most this many of its tasks
    /// at once; 0 (the default): no cap.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=8))]
    cap: Option<u8>,
    /// Clock horizon in ticks of 100 ms: faults happen before it, then the
    /// run drains and liveness is checked.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=32))]
    horizon: Option<u8>,
    /// Checker threads (1 to 256); default: the machine's cores.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=MAX_THREADS))]
    threads: Option<u16>,
    /// Walk order: bfs (the shortest counterexample; keeps the frontier in
    /// memory) or dfs (memory for one path). Default: bfs with --ci, else dfs.
    #[arg(long)]
    strategy: Option<Strategy>,
    /// Explore every state even after a counterexample (else stop at the first).
    #[arg(long)]
    all: bool,
    /// One JSON object on stdout (the report, traces included).
    #[arg(long)]
    json: bool,
}

/// Most checker threads `--threads` takes. The checker spawns each one
/// before it starts, and a spawn the system refuses is a panic inside
/// stateright, so a count far beyond any machine's cores is refused here.
const MAX_THREADS: i64 = 256;

/// The bounds of the acceptance run (`idem-lab verify` without `--ci`): one key
/// of the non-safe class, one tenant, three executors, three attempts per
/// task, two crashes, two operator actions (a key revocation among their
/// choices), no lost answers, 3 ticks (about 2.7 × 10^7 distinct states;
/// docs/verification.md, "Bounds and figures").
fn full() -> Bounds {
    Bounds {
        keys: 1,
        tasks: 1,
        classes: Classes::Unsafe,
        executors: 3,
        attempts: 3,
        crashes: 2,
        operator: 2,
        horizon: 3,
        tenants: 1,
        lost: 0,
        cap: 0,
    }
}

impl VerifyArgs {
    fn strategy(&self) -> Strategy {
        self.strategy.unwrap_or(if self.ci {
            Strategy::Bfs
        } else {
            Strategy::Dfs
        })
    }

    fn bounds(&self) -> Bounds {
        let base = if self.ci { Bounds::ci() } else { full() };
        Bounds {
            keys: self.keys.unwrap_or(base.keys),
            // At least one task per key.
            tasks: self
                .tasks
                .unwrap_or(base.tasks)
                .max(self.keys.unwrap_or(base.keys)),
            classes: self.classes.unwrap_or(base.classes),
            executors: self.executors.unwrap_or(base.executors),
            attempts: self.attempts.unwrap_or(base.attempts),
            crashes: self.crashes.unwrap_or(base.crashes),
            operator: self.operator.unwrap_or(base.operator),
            horizon: self.horizon.unwrap_or(base.horizon),
            tenants: self.tenants.unwrap_or(base.tenants),
            lost: self.lost.unwrap_or(base.lost),
            cap: self.cap.unwrap_or(base.cap),
        }
    }
}

/// Runs the exploration and prints the report; a counterexample is an error
/// (exit status 1) after its trace was printed, and so is a `sometimes`
/// witness not reached in a complete exploration: bounds that never reach a
/// delivery, a reconcile or a stale report prove the invariants vacuously.
pub(crate) async fn verify(args: VerifyArgs) -> Result<()> {
    let bounds = args.bounds();
    let threads = args
        .threads
        .map(usize::from)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let options = Options {
        bounds: bounds.clone(),
        threads,
        strategy: args.strategy(),
        stop_at_first: !args.all,
    };
    if !args.json {
        say(format_args!("{}", render_bounds(&bounds, threads, &args)))?;
    }
    let report = tokio::task::spawn_blocking(move || idem_model::run(&options)).await??;
    if args.json {
        let json = serde_json::json!({
            "bounds": {
                "keys": bounds.keys,
                "tasks": bounds.tasks,
                "classes": bounds.classes.to_string(),
                "executors": bounds.executors,
                "attempts": bounds.attempts,
                "crashes": bounds.crashes,
                "operator": bounds.operator,
                "horizon": bounds.horizon,
                "tenants": bounds.tenants,
                "lost": bounds.lost,
                "threads": threads,
                "strategy": args.strategy(),
            },
            "report": report,
        });
        say(serde_json::to_string(&json)?)?;
    } else {
        say_raw(render(&report))?;
    }
    let failed: Vec<&str> = report.counterexamples().map(|p| p.name).collect();
    if !failed.is_empty() {
        bail!("counterexample found: {}", failed.join("; "));
    }
    let unreached: Vec<&str> = report
        .properties
        .iter()
        .filter(|p| matches!(p.verdict, Verdict::NotReached))
        .map(|p| p.name.trim_start_matches("reached: "))
        .collect();
    if !report.stopped_early && !unreached.is_empty() {
        bail!(
            "these bounds never reach: {} (the invariants would hold vacuously; widen the bounds)",
            unreached.join("; ")
        );
    }
    Ok(())
}

fn render_bounds(b: &Bounds, threads: usize, args: &VerifyArgs) -> String {
    format!(
        "idem-lab verify: model checking idem_store::ops over an in-memory store (stateright, {strategy})\n\
         bounds: keys {}, tasks {}, classes {}, tenants {}, executors {}, attempts per task {}, crashes {}, operator actions {}, lost answers {}, horizon {} ticks of 100 ms; threads {threads}",
        b.keys,
        b.tasks,
        b.classes,
        b.tenants,
        b.executors,
        b.attempts,
        b.crashes,
        b.operator,
        b.lost,
        b.horizon,
        strategy = match args.strategy() {
            Strategy::Bfs => "breadth first",
            Strategy::Dfs => "depth first",
        },
    )
}

fn render(r: &Report) -> String {
    let mut out = format!(
        "distinct states: {}\nstates generated: {}\nmax depth: {}\ntime: {:.1} s{}\n\nproperties:\n",
        r.distinct_states,
        r.generated_states,
        r.max_depth,
        r.elapsed.as_secs_f64(),
        if r.stopped_early {
            " (stopped at the first counterexample)"
        } else {
            ""
        }
    );
    for p in &r.properties {
        let verdict = match &p.verdict {
            Verdict::Held => "holds",
            Verdict::Counterexample { .. } => "COUNTEREXAMPLE",
            Verdict::Reached => "reached",
            Verdict::NotReached if r.stopped_early => "not reached before the stop",
            Verdict::NotReached => "NOT REACHED",
        };
        out.push_str(&format!("  {:<10} {:<28} {}\n", p.kind, verdict, p.name));
    }
    for p in r.counterexamples() {
        if let Verdict::Counterexample { trace } = &p.verdict {
            out.push('\n');
            out.push_str(trace);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        verify: VerifyArgs,
    }

    fn parse(args: &[&str]) -> Result<VerifyArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("verify").chain(args.iter().copied())).map(|c| c.verify)
    }

    /// `--threads` takes 1..=256 only: 0 threads explore nothing, and a
    /// count no machine has fails at the checker's thread spawns.
    #[test]
    fn threads_are_bounded() {
        for bad in ["0", "257", "100000", "-1"] {
            let err = parse(&["--threads", bad]).err();
            assert!(
                err.is_some_and(|e| e.kind() != clap::error::ErrorKind::DisplayHelp),
                "--threads {bad} was taken"
            );
        }
        for good in ["1", "2", "256"] {
            let args = parse(&["--threads", good]).unwrap();
            assert_eq!(args.threads.map(u64::from), good.parse().ok());
        }
        assert!(parse(&[]).unwrap().threads.is_none());
    }
}
