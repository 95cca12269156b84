//! Running the checker and reading its result.

use std::time::{Duration, Instant};

use serde::Serialize;
use stateright::{Checker, Expectation, HasDiscoveries, Model};

use crate::bounds::Bounds;
use crate::model::IdemModel;
use crate::setup::SetupError;

/// How the state space is walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Breadth first: the shortest counterexample; the frontier is kept in memory.
    Bfs,
    /// Depth first: less memory for large bounds.
    Dfs,
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Strategy, String> {
        match s {
            "bfs" => Ok(Strategy::Bfs),
            "dfs" => Ok(Strategy::Dfs),
            _ => Err(format!("`{s}`: expected bfs or dfs")),
        }
    }
}

/// Options of one run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The bounds.
    pub bounds: Bounds,
    /// Checker threads.
    pub threads: usize,
    /// Walk order.
    pub strategy: Strategy,
    /// Stop at the first counterexample (else explore everything).
    pub stop_at_first: bool,
}

/// What one property came to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum Verdict {
    /// `always` / `eventually`: no counterexample in the states explored.
    Held,
    /// `always` / `eventually`: a counterexample, with its trace.
    Counterexample {
        /// The numbered steps.
        trace: String,
    },
    /// `sometimes`: a state satisfying it was reached.
    Reached,
    /// `sometimes`: not reached in the states explored.
    NotReached,
}

/// One property's result.
#[derive(Debug, Clone, Serialize)]
pub struct PropertyResult {
    /// Its name (with its SPEC reference).
    pub name: &'static str,
    /// `always`, `eventually` or `sometimes`.
    pub kind: &'static str,
    /// What it came to.
    pub verdict: Verdict,
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Distinct states explored.
    pub distinct_states: usize,
    /// States generated (repeats included).
    pub generated_states: usize,
    /// Longest path explored, in steps.
    pub max_depth: usize,
    /// Wall-clock time of the exploration.
    #[serde(serialize_with = "secs")]
    pub elapsed: Duration,
    /// Whether the run stopped at a counterexample before exploring everything.
    pub stopped_early: bool,
    /// Every property, in the model's order.
    pub properties: Vec<PropertyResult>,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Report {
    /// The properties with a counterexample.
    pub fn counterexamples(&self) -> impl Iterator<Item = &PropertyResult> {
        self.properties
            .iter()
            .filter(|p| matches!(p.verdict, Verdict::Counterexample { .. }))
    }
}

/// Explores the model of `options.bounds`.
///
/// # Errors
/// [`SetupError`] when the model's own configuration is wrong.
pub fn run(options: &Options) -> Result<Report, SetupError> {
    let model = IdemModel::new(options.bounds.clone())?;
    let started = Instant::now();
    let mut builder = model.checker().threads(options.threads.max(1));
    if options.stop_at_first {
        builder = builder.finish_when(HasDiscoveries::AnyFailures);
    }
    let report = match options.strategy {
        Strategy::Bfs => collect(builder.spawn_bfs().join(), started, options.stop_at_first),
        Strategy::Dfs => collect(builder.spawn_dfs().join(), started, options.stop_at_first),
    };
    Ok(report)
}

fn collect(c: impl Checker<IdemModel>, started: Instant, stop_at_first: bool) -> Report {
    let elapsed = started.elapsed();
    let model = c.model();
    let discoveries = c.discoveries();
    let mut properties = Vec::new();
    let mut failed = false;
    for p in model.properties() {
        let found = discoveries.get(p.name);
        let (kind, verdict) = match p.expectation {
            Expectation::Always | Expectation::Eventually => {
                let kind = if p.expectation == Expectation::Always {
                    "always"
                } else {
                    "eventually"
                };
                match found {
                    Some(path) => {
                        failed = true;
                        let steps = path.clone().into_vec();
                        // The checker keeps the last violating state it met;
                        // an `always` property's trace ends at the first one.
                        let end = match p.expectation {
                            Expectation::Always => steps
                                .iter()
                                .position(|(s, _)| !(p.condition)(model, s))
                                .unwrap_or(steps.len()),
                            _ => steps.len(),
                        };
                        let actions: Vec<_> =
                            steps.into_iter().take(end).filter_map(|(_, a)| a).collect();
                        let trace = crate::trace::render(model, &actions, p.name);
                        (kind, Verdict::Counterexample { trace })
                    }
                    None => (kind, Verdict::Held),
                }
            }
            Expectation::Sometimes => (
                "sometimes",
                if found.is_some() {
                    Verdict::Reached
                } else {
                    Verdict::NotReached
                },
            ),
        };
        properties.push(PropertyResult {
            name: p.name,
            kind,
            verdict,
        });
    }
    Report {
        distinct_states: c.unique_state_count(),
        generated_states: c.state_count(),
        max_depth: c.max_depth(),
        elapsed,
        stopped_early: failed && stop_at_first,
        properties,
    }
}
