//! `idem-lab chaos --failover-kill CMD --failover-promote CMD`: a database
//! failover in the middle of the run, driven by the operator's own commands
//! (`scripts/failover.sh` kills the primary with SIGKILL and promotes its
//! standby), and what it did to the answers.
//!
//! The run's own server faults (SIGKILL of idem, `pg_terminate_backend`) are
//! left out, so every 5xx answer is the failover's. Half-way through the
//! operations the kill command runs; after `delay` the promote command runs
//! (it returns once the standby accepts writes). Afterwards:
//!
//! - every 5xx answer must fall between the start of the kill command and
//!   the end of the promote command plus `bound` (a 5xx outside is a
//!   violation, and so is a 5xx window longer than that);
//! - every acknowledged write must be in the promoted database: each submit
//!   answered 201/200 names a task the database has, each report answered
//!   200 left its evidence on its attempt. With `expect_no_loss` (a
//!   synchronous standby) a lost one is a violation; without it (an
//!   asynchronous standby) they are counted;
//! - what else the promoted database lacks, the tasks idem moved on because
//!   the store went back in time, and whether an effect performed by a lost
//!   attempt was repeated without a reconciliation ([`LossReport`]: a
//!   repeat is a violation in both modes).

use super::*;

/// The failover of a run.
#[derive(Debug, Clone)]
pub struct Failover {
    /// Shell command that kills the primary (`sh -c`).
    pub kill: String,
    /// Shell command that promotes the standby; returns once it accepts writes.
    pub promote: String,
    /// Pause between the end of the kill command and the promote command.
    pub delay: Duration,
    /// How long after the promotion 5xx answers may still come.
    pub bound: Duration,
    /// Whether an acknowledged write missing afterwards is a violation
    /// (synchronous standby) or only counted (asynchronous).
    pub expect_no_loss: bool,
}

/// When the failover's steps happened.
#[derive(Debug, Clone, Copy)]
pub(super) struct FailoverTimes {
    pub(super) kill_started: Instant,
    pub(super) kill_done: Instant,
    pub(super) promoted: Instant,
}

/// What the failover did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FailoverReport {
    /// From the start of the kill command to the end of the promote command, ms.
    pub kill_to_promoted_ms: u64,
    /// 5xx answers (clients and executors, retries included).
    pub errors_5xx: u64,
    /// From the kill to the last 5xx answer, ms (0 without any).
    pub kill_to_last_5xx_ms: u64,
    /// From the end of the promotion to the last 5xx answer, ms (negative:
    /// the last one came before the promotion ended).
    pub promoted_to_last_5xx_ms: i64,
    /// The bound stated for it, ms.
    pub bound_ms: u64,
    /// 5xx answers before the kill or after promotion + bound.
    pub errors_5xx_outside: u64,
    /// Submits answered with a task (created or replayed).
    pub acknowledged_submits: u64,
    /// … whose task the promoted database does not have.
    pub lost_submits: u64,
    /// Reports answered 200.
    pub acknowledged_reports: u64,
    /// … whose attempt has no evidence afterwards.
    pub lost_reports: u64,
    /// Reports answered 200 while the kill command ran (with
    /// `scripts/failover.sh --async`: while the standby's WAL stream was cut).
    pub reports_acknowledged_during_kill: u64,
    /// Whether a lost write counts as a violation.
    pub expect_no_loss: bool,
    /// The rest of what the promoted database lacks, and what idem did about it.
    pub loss: LossReport,
}

impl FailoverReport {
    /// Violations: 5xx outside the window, effects repeated without a
    /// reconciliation after a lost attempt, and lost writes when none may be lost.
    pub fn violations(&self) -> u64 {
        let lost = if self.expect_no_loss {
            self.lost_submits + self.lost_reports
        } else {
            0
        };
        self.errors_5xx_outside + self.loss.repeated_without_reconcile + lost
    }
}

/// Runs the kill command, waits, runs the promote command; records when.
pub(super) async fn run_failover(ctx: Arc<Ctx>, f: Failover) -> Result<()> {
    let kill_started = Instant::now();
    shell(&f.kill)
        .await
        .context("the failover's kill command")?;
    let kill_done = Instant::now();
    tokio::time::sleep(f.delay).await;
    shell(&f.promote)
        .await
        .context("the failover's promote command")?;
    let promoted = Instant::now();
    ctx.log().failover = Some(FailoverTimes {
        kill_started,
        kill_done,
        promoted,
    });
    Ok(())
}

async fn shell(cmd: &str) -> Result<()> {
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("running `{cmd}`"))?;
    if !out.status.success() {
        bail!(
            "`{cmd}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The report of the failover: the 5xx answers against its times, the
/// acknowledged writes against the database and the read-back records.
pub(super) fn failover_report(
    f: &Failover,
    times: Option<FailoverTimes>,
    errors_5xx: &[Instant],
    input: &CheckInput,
    accepted_reports: &[(Uuid, Instant)],
    loss: LossReport,
) -> Result<FailoverReport> {
    let times = times.context("the failover did not run (fewer operations than its start?)")?;
    let end = times.promoted + f.bound;
    let outside = errors_5xx
        .iter()
        .filter(|t| **t < times.kill_started || **t > end)
        .count();
    let last = errors_5xx.iter().max().copied();
    let in_db: BTreeSet<Uuid> = input.db_tasks.iter().map(|t| t.id).collect();
    let mut acknowledged_submits = 0u64;
    let mut lost_submits = 0u64;
    for s in &input.submits {
        if let SubmitAnswer::Accepted { task_id, .. } = &s.answer {
            acknowledged_submits += 1;
            if !in_db.contains(task_id) {
                lost_submits += 1;
            }
        }
    }
    let reported: BTreeSet<Uuid> = input
        .tasks
        .iter()
        .flat_map(|t| t.attempts.iter())
        .filter(|a| !a.evidence.is_empty())
        .map(|a| a.id)
        .collect();
    let acknowledged: BTreeSet<Uuid> = accepted_reports.iter().map(|(id, _)| *id).collect();
    let during_kill = accepted_reports
        .iter()
        .filter(|(_, t)| *t >= times.kill_started && *t <= times.kill_done)
        .count();
    let lost_reports = acknowledged.difference(&reported).count();
    Ok(FailoverReport {
        kill_to_promoted_ms: ms(times.promoted.duration_since(times.kill_started)),
        errors_5xx: errors_5xx.len() as u64,
        kill_to_last_5xx_ms: last
            .map_or(0, |l| ms(l.saturating_duration_since(times.kill_started))),
        promoted_to_last_5xx_ms: last.map_or(0, |l| {
            if l >= times.promoted {
                i64::try_from(ms(l - times.promoted)).unwrap_or(i64::MAX)
            } else {
                -i64::try_from(ms(times.promoted - l)).unwrap_or(i64::MAX)
            }
        }),
        bound_ms: ms(f.bound),
        errors_5xx_outside: outside as u64,
        acknowledged_submits,
        lost_submits,
        acknowledged_reports: acknowledged.len() as u64,
        lost_reports: lost_reports as u64,
        reports_acknowledged_during_kill: during_kill as u64,
        expect_no_loss: f.expect_no_loss,
        loss,
    })
}

/// The report's lines.
pub(super) fn render_failover(out: &mut String, f: &FailoverReport) {
    use std::fmt::Write as _;
    let _ = writeln!(
        out,
        "failover: kill to promoted {} ms; {} 5xx answers, the last {} ms after the kill ({:+} ms from the promotion; bound +{} ms), {} outside",
        f.kill_to_promoted_ms,
        f.errors_5xx,
        f.kill_to_last_5xx_ms,
        f.promoted_to_last_5xx_ms,
        f.bound_ms,
        f.errors_5xx_outside
    );
    let _ = writeln!(
        out,
        "failover: acknowledged submits {} ({} lost), acknowledged reports {} ({} lost; {} while the kill command ran){}",
        f.acknowledged_submits,
        f.lost_submits,
        f.acknowledged_reports,
        f.lost_reports,
        f.reports_acknowledged_during_kill,
        if f.expect_no_loss {
            ""
        } else {
            " (asynchronous standby: counted, not violations)"
        }
    );
    render_loss(out, &f.loss);
}
