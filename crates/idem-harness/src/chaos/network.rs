//! Network faults of `idem-lab chaos --netns`: the seeded episodes against one
//! instance's database link at a time, and the runner that applies, holds
//! and heals each one and measures what it did.
//!
//! Which mechanism makes which fault (the kernel has no `sch_netem`, so
//! `tc … netem` is not available):
//!
//! - **partition**: nftables rules in the instance's namespace drop every
//!   packet to and from its forwarder (only the database traffic: the
//!   instance's clients still reach it, and get answers that wait or 503s);
//! - **loss**: the same rules with `numgen random mod 100 < P`, dropping P %
//!   of those packets; TCP retransmits;
//! - **delay**: the forwarder holds every chunk `delay ± delay/2` ms in each
//!   direction (see [`super::forward`]), so a transaction of several round
//!   trips outlives a lease (800 ms) and requests on different connections
//!   reorder.

use super::netns::Link;
use super::*;

/// Stream of the seed the network plan draws from (the client, executor and
/// server plan of a seed is the same with and without `--netns`).
const NETWORK_STREAM: u64 = 0x6e65_746e_735f_7631;

/// Stream of the seed the clock-skew restarts are drawn from.
const SKEW_STREAM: u64 = 0x736b_6577_5f76_3100;

/// The instance that runs under a shifted clock with `--clock-skew-ms`.
pub const SKEWED_SERVER: usize = 1;

/// A fault on one instance's database link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NetFault {
    /// Every packet to and from the database dropped (nftables).
    Partition,
    /// Each chunk held `delay_ms ± jitter_ms` in each direction (forwarder).
    Delay {
        /// Mean hold, ms.
        delay_ms: u64,
        /// Uniform jitter around it, ms.
        jitter_ms: u64,
    },
    /// `percent` % of the packets to and from the database dropped (nftables).
    Loss {
        /// Share dropped, %.
        percent: u8,
    },
}

impl NetFault {
    /// Name of the fault kind in `faults`.
    pub fn name(self) -> &'static str {
        match self {
            NetFault::Partition => "net_partition",
            NetFault::Delay { .. } => "net_delay",
            NetFault::Loss { .. } => "net_loss",
        }
    }
}

/// One planned network episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct NetEpisode {
    /// Starts when this operation is dispatched (or, if the previous episode
    /// still runs then, when it has healed).
    pub at: usize,
    /// The instance whose database link it hits.
    pub instance: usize,
    /// What it does.
    pub fault: NetFault,
    /// How long it lasts before it is healed, ms.
    pub duration_ms: u64,
}

impl Plan {
    /// This plan with network episodes (`--netns`), drawn from their own
    /// stream of the seed: max(2, N/1500) partitions of 2–7 s, as many delay
    /// episodes of 3–7 s holding chunks 200–900 ms (± half), and
    /// max(1, N/3000) loss episodes of 3–6 s dropping 10–30 % of the packets,
    /// in shuffled order, one per equal slot of operations 5–85 %, each
    /// against one instance.
    pub fn with_network(mut self) -> Plan {
        let ops = self.ops.len();
        let mut rng = StdRng::seed_from_u64(self.seed ^ NETWORK_STREAM);
        let partitions = (ops / 1500).max(2);
        let losses = (ops / 3000).max(1);
        let mut kinds: Vec<u8> = std::iter::repeat_n(0u8, partitions)
            .chain(std::iter::repeat_n(1, partitions))
            .chain(std::iter::repeat_n(2, losses))
            .collect();
        rand::seq::SliceRandom::shuffle(kinds.as_mut_slice(), &mut rng);
        let lo = ops / 20;
        let hi = (ops * 17 / 20).max(lo + kinds.len());
        let slot = ((hi - lo) / kinds.len()).max(1);
        self.network = kinds
            .iter()
            .enumerate()
            .map(|(j, kind)| {
                let at = lo + j * slot + rng.random_range(0..slot);
                let instance = rng.random_range(0..self.servers);
                let (fault, duration_ms) = match kind {
                    0 => (NetFault::Partition, rng.random_range(2_000..=7_000)),
                    1 => {
                        let delay_ms = rng.random_range(200..=900);
                        let fault = NetFault::Delay {
                            delay_ms,
                            jitter_ms: delay_ms / 2,
                        };
                        (fault, rng.random_range(3_000..=7_000))
                    }
                    _ => {
                        let percent = rng.random_range(10..=30);
                        (NetFault::Loss { percent }, rng.random_range(3_000..=6_000))
                    }
                };
                NetEpisode {
                    at,
                    instance,
                    fault,
                    duration_ms,
                }
            })
            .collect();
        self
    }

    /// This plan with the second instance's clock shifted by `skew_ms`
    /// (`--clock-skew-ms`): +skew at its first start, then the sign flips at
    /// each restart; max(2, N/2500) extra SIGKILL restarts of that instance,
    /// drawn from their own stream of the seed, make both signs happen.
    pub fn with_clock_skew(mut self, skew_ms: i64) -> Plan {
        self.clock_skew_ms = skew_ms;
        if skew_ms == 0 || self.servers <= SKEWED_SERVER {
            return self;
        }
        let ops = self.ops.len();
        let mut rng = StdRng::seed_from_u64(self.seed ^ SKEW_STREAM);
        let lo = ops / 20;
        let hi = (ops * 9 / 10).max(lo + 1);
        for _ in 0..(ops / 2500).max(2) {
            let at = rng.random_range(lo..hi);
            self.server_faults.push((
                at,
                ServerFault::Kill {
                    server: SKEWED_SERVER,
                },
            ));
        }
        self.server_faults.sort_by_key(|(at, _)| *at);
        self
    }
}

/// What one network episode did, measured.
#[derive(Debug, Clone, Serialize)]
pub struct NetEpisodeRun {
    /// The instance whose link was hit.
    pub instance: usize,
    /// The fault.
    pub fault: NetFault,
    /// Planned start (operation index).
    pub planned_at_op: usize,
    /// Operations dispatched when it started (it starts late when the
    /// previous episode was still running).
    pub started_at_op: usize,
    /// Start, ms after the run started.
    pub started_at_ms: u64,
    /// From applying to healing, ms.
    pub duration_ms: u64,
    /// Packets the nftables rules dropped.
    pub packets_dropped: u64,
    /// Chunks the forwarder held for a delay.
    pub chunks_delayed: u64,
    /// The instance's database connections open when it started.
    pub db_connections_open_at_start: u64,
    /// Database connections that ended with an error (reset, broken pipe)
    /// from the start until 1 s after healing.
    pub db_connections_failed: u64,
    /// Database connections that ended in order in that time (the instance
    /// dropped them, for example after its operation timeout).
    pub db_connections_closed: u64,
    /// Database connections the instance opened in that time.
    pub db_connections_opened: u64,
    /// Answers in that time that made a client or an executor retry
    /// (timeouts, 5xx, transport errors), on any instance.
    pub retries_after_error: u64,
    /// Claims answered in that time too late for the executor to act (the
    /// lease would run out in flight), on any instance.
    pub claims_too_late: u64,
    /// Reports and heartbeats refused in that time with 409
    /// `STALE_GENERATION` (the lease ran out before they arrived; planned
    /// late reports included), on any instance.
    pub stale_refusals: u64,
}

/// The run's network: where each instance lives and what the episodes did.
#[derive(Debug, Clone, Serialize)]
pub struct NetworkReport {
    /// Per instance.
    pub links: Vec<LinkReport>,
    /// Namespaces of dead runs removed before this run.
    pub leftovers_removed: Vec<String>,
    /// Every episode, in order.
    pub episodes: Vec<NetEpisodeRun>,
}

/// One instance's namespace and addresses.
#[derive(Debug, Clone, Serialize)]
pub struct LinkReport {
    /// Instance.
    pub instance: usize,
    /// Namespace.
    pub namespace: String,
    /// Host-side veth and its address.
    pub host: String,
    /// Namespace-side address (the instance listens there).
    pub instance_addr: String,
    /// The forwarder the instance's store URL points to.
    pub forwarder: String,
}

impl LinkReport {
    pub(super) fn of(instance: usize, link: &Link) -> LinkReport {
        LinkReport {
            instance,
            namespace: link.ns.clone(),
            host: format!("{} {}", link.host_if, link.host_addr),
            instance_addr: link.ns_addr.to_string(),
            forwarder: link.forwarder.addr.to_string(),
        }
    }
}

struct Snapshot {
    opened: u64,
    ended: u64,
    failed: u64,
    refused: u64,
    delayed: u64,
    retries: u64,
    too_slow: u64,
    stale: u64,
}

impl Snapshot {
    fn take(ctx: &Ctx, link: &Link) -> Snapshot {
        let s = &link.forwarder.stats;
        Snapshot {
            opened: s.opened.load(Ordering::SeqCst),
            ended: s.ended.load(Ordering::SeqCst),
            failed: s.failed.load(Ordering::SeqCst),
            refused: s.refused.load(Ordering::SeqCst),
            delayed: s.delayed_chunks.load(Ordering::SeqCst),
            retries: ctx.realized_count(CLIENT_RETRY) + ctx.realized_count(EXECUTOR_RETRY),
            too_slow: ctx.realized_count(TOO_SLOW_TO_ACT),
            stale: ctx.realized_count(STALE_REFUSAL),
        }
    }
}

/// Runs the plan's episodes one after the other, each when its operation
/// is dispatched: applies it, holds it, heals it; records each in the
/// run's log. The dispatch of clients waits at an episode's operation until
/// the episode started ([`episode_gate`]), so each one begins amid the
/// client load it was planned into.
///
/// # Errors
/// When a rule cannot be loaded or removed (the run then ends, and
/// dropping the network removes every rule with the namespaces).
pub(super) async fn run_episodes(
    ctx: Arc<Ctx>,
    links: Vec<Arc<Link>>,
    started: Instant,
) -> Result<()> {
    struct Done(Arc<Ctx>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.episodes_started.store(usize::MAX, Ordering::SeqCst);
        }
    }
    let _done = Done(ctx.clone());
    for (n, ep) in ctx.plan.network.iter().enumerate() {
        while ctx.dispatched.load(Ordering::SeqCst) < ep.at && !ctx.stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let link = links
            .get(ep.instance)
            .with_context(|| format!("no link of instance {}", ep.instance))?;
        let before = Snapshot::take(&ctx, link);
        let open = link.forwarder.stats.open();
        let started_at_op = ctx.dispatched.load(Ordering::SeqCst);
        let t = Instant::now();
        match ep.fault {
            NetFault::Partition => link.drop_packets(100).await?,
            NetFault::Loss { percent } => link.drop_packets(percent).await?,
            NetFault::Delay {
                delay_ms,
                jitter_ms,
            } => link.forwarder.shape.set(delay_ms, jitter_ms),
        }
        ctx.episodes_started.fetch_max(n + 1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(ep.duration_ms)).await;
        link.forwarder.shape.clear();
        let packets_dropped = link.heal().await?;
        let duration = t.elapsed();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = Snapshot::take(&ctx, link);
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let run = NetEpisodeRun {
            instance: ep.instance,
            fault: ep.fault,
            planned_at_op: ep.at,
            started_at_op,
            started_at_ms: ms(t.duration_since(started)),
            duration_ms: ms(duration),
            packets_dropped,
            chunks_delayed: after.delayed - before.delayed,
            db_connections_open_at_start: open,
            db_connections_failed: after.failed - before.failed,
            db_connections_closed: after.ended - before.ended,
            db_connections_opened: (after.opened - before.opened)
                .saturating_sub(after.refused - before.refused),
            retries_after_error: after.retries - before.retries,
            claims_too_late: after.too_slow - before.too_slow,
            stale_refusals: after.stale - before.stale,
        };
        ctx.realized(ep.fault.name(), 1);
        ctx.realized(&format!("{}_ms", ep.fault.name()), run.duration_ms);
        ctx.realized("net_packets_dropped", run.packets_dropped);
        ctx.realized("net_chunks_delayed", run.chunks_delayed);
        ctx.realized("db_connections_failed", run.db_connections_failed);
        ctx.realized("db_connections_refused", after.refused - before.refused);
        ctx.log().network.push(run);
    }
    Ok(())
}

/// Waits (before operation `i` is dispatched) until every episode planned at
/// or before `i` has started, or the episode runner has ended.
pub(super) async fn episode_gate(ctx: &Ctx, i: usize) {
    loop {
        let started = ctx.episodes_started.load(Ordering::SeqCst);
        match ctx.plan.network.get(started) {
            Some(ep) if ep.at <= i => tokio::time::sleep(Duration::from_millis(5)).await,
            _ => return,
        }
    }
}
