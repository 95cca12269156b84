//! Network namespaces of `idem-lab chaos --netns`: each `idem serve` instance in
//! a namespace of its own, joined to the root namespace by a veth pair, its
//! database traffic carried by a TCP forwarder (the `forward` module), and an
//! nftables table inside the namespace whose rules cut (partition) or thin
//! (random loss) that traffic, and nothing else.
//!
//! Layout of run `P` (the harness's pid), instance `i` (0 or 1), with
//! `k = (P mod 8192)·2 + i` choosing the `/30` at `10.213.0.0 + 4k`:
//!
//! ```text
//!  root namespace                                 namespace idem-chaos-P-i
//!  ──────────────                                 ───────────────────────
//!  clients, executors ──HTTP──► ic<P>h<i> ═══veth═══ ic<P>n<i>
//!                               10.213.x.y+1          10.213.x.y+2
//!                                    │                 idem serve --listen 10.213.x.y+2:0
//!  PostgreSQL ◄── forwarder i ◄──────┘ 10.213.x.y+1:F ◄── its store URL (host:port rewritten)
//!  127.0.0.1:5432  (delay)                            nft table inet idem_chaos:
//!                                                     drops to/from 10.213.x.y+1:F only
//! ```
//!
//! Only loopback and the run's own namespaces and veth addresses are used.
//! `Network` removes its namespaces (after killing every process inside)
//! and its host-side veths when dropped: on a normal end, on an error, on a
//! panic (unwinding) and on Ctrl-C (the run's future is dropped). A run
//! killed with SIGKILL leaves them behind, with its servers running inside;
//! the next run kills those and removes every namespace of the
//! `idem-chaos-` prefix whose pid no longer lives (or is its own).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use super::forward::{self, Forwarder};

/// Prefix of the namespaces a run creates: `idem-chaos-<pid>-<instance>`.
pub const NS_PREFIX: &str = "idem-chaos-";

/// The nftables table each namespace holds (family `inet`).
const NFT_TABLE: &str = "idem_chaos";

/// Why the network of a run cannot be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// This machine cannot create network namespaces, veth pairs or nftables
    /// rules (not root, a tool missing, a sandbox refusing `unshare`).
    #[error("network namespaces are not available here: {0}")]
    Unavailable(String),
    /// A command of the setup or of a fault failed.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status and stderr, or the spawn error.
        detail: String,
    },
    /// The run's address block is already assigned (another run whose pid
    /// is equal modulo 8192).
    #[error("address {0} is already assigned on this machine (another idem-lab chaos run?)")]
    AddressInUse(Ipv4Addr),
    /// The forwarder could not bind.
    #[error("binding the database forwarder on {addr}: {source}")]
    Forwarder {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// `nft -j` printed something that is not its JSON.
    #[error("reading the nftables counters: {0}")]
    Counters(String),
}

/// Runs `args[0]` with `args[1..]` (and `stdin`), returning its stdout.
fn run(args: &[&str], stdin: Option<&str>) -> Result<String, NetnsError> {
    use std::io::Write as _;
    let command = args.join(" ");
    let fail = |detail: String| NetnsError::Command {
        command: command.clone(),
        detail,
    };
    let (bin, rest) = args.split_first().ok_or_else(|| fail("empty".into()))?;
    let mut child = Command::new(bin)
        .args(rest)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .map_err(|e| fail(e.to_string()))?;
    }
    let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(fail(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// [`run`] on the blocking pool.
async fn run_async(args: Vec<String>, stdin: Option<String>) -> Result<String, NetnsError> {
    tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        run(&a, stdin.as_deref())
    })
    .await
    .map_err(|e| NetnsError::Command {
        command: "a blocking task".into(),
        detail: e.to_string(),
    })?
}

/// The nftables table of a namespace: empty chains on the output and input
/// hooks; faults add rules and healing flushes them.
fn nft_table() -> String {
    format!(
        "table inet {NFT_TABLE} {{\n\
         \tchain out {{ type filter hook output priority 0; policy accept; }}\n\
         \tchain in {{ type filter hook input priority 0; policy accept; }}\n\
         }}\n"
    )
}

/// Whether this machine can build a run's network: `ip` and `nft` present,
/// a namespace, a veth pair and an nftables table in the namespace created
/// (and removed again).
///
/// # Errors
/// [`NetnsError::Unavailable`] naming what is missing or refused.
pub fn probe() -> Result<(), NetnsError> {
    let unavailable = |what: &str, e: NetnsError| NetnsError::Unavailable(format!("{what}: {e}"));
    run(&["ip", "-V"], None).map_err(|e| unavailable("`ip` (iproute2) cannot run", e))?;
    run(&["nft", "--version"], None).map_err(|e| {
        unavailable(
            "`nft` (Debian package nftables) cannot run; partitions and loss are nftables rules",
            e,
        )
    })?;
    let pid = std::process::id();
    let ns = format!("{NS_PREFIX}{pid}-probe");
    let host_if = format!("ic{pid}hp");
    let result = (|| {
        run(&["ip", "netns", "add", &ns], None).map_err(|e| {
            unavailable(
                "cannot create a network namespace (root or CAP_SYS_ADMIN is needed)",
                e,
            )
        })?;
        run(
            &[
                "ip", "link", "add", &host_if, "type", "veth", "peer", "name", "probe0", "netns",
                &ns,
            ],
            None,
        )
        .map_err(|e| unavailable("cannot create a veth pair", e))?;
        run(
            &["ip", "netns", "exec", &ns, "nft", "-f", "-"],
            Some(&nft_table()),
        )
        .map_err(|e| unavailable("cannot load an nftables table in a namespace", e))?;
        Ok(())
    })();
    remove_namespace(&ns, &host_if);
    result
}

/// Kills every process in namespace `ns`, deletes it and the host-side veth
/// `host_if`; what does not exist is skipped.
fn remove_namespace(ns: &str, host_if: &str) {
    if let Ok(pids) = run(&["ip", "netns", "pids", ns], None) {
        for pid in pids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
    let _ = run(&["ip", "netns", "del", ns], None);
    // The kernel removes a namespace's veths when the namespace goes, but
    // asynchronously; the host side is deleted here so its address is free
    // at once.
    let _ = run(&["ip", "link", "del", host_if], None);
}

/// The namespace names present on this machine.
fn namespaces() -> Vec<String> {
    run(&["ip", "netns", "list"], None)
        .map(|out| {
            out.lines()
                .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether process `pid` lives. A pid taken over by another process keeps
/// a dead run's namespaces until that process ends too: a live run's
/// namespaces are never removed.
fn is_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes namespaces of [`NS_PREFIX`] left by runs whose process no longer
/// lives (killed with SIGKILL) or by an earlier process with this pid;
/// returns their names.
pub fn remove_leftovers() -> Vec<String> {
    let me = std::process::id();
    let mut removed = Vec::new();
    for ns in namespaces() {
        let Some(rest) = ns.strip_prefix(NS_PREFIX) else {
            continue;
        };
        let mut parts = rest.splitn(2, '-');
        let (Some(pid), Some(inst)) = (
            parts.next().and_then(|p| p.parse::<u32>().ok()),
            parts.next(),
        ) else {
            continue;
        };
        if pid != me && is_alive(pid) {
            continue;
        }
        let host_if = match inst {
            "probe" => format!("ic{pid}hp"),
            i => format!("ic{pid}h{i}"),
        };
        remove_namespace(&ns, &host_if);
        removed.push(ns);
    }
    removed
}

/// One instance's namespace and database link.
pub(super) struct Link {
    /// Namespace name.
    pub(super) ns: String,
    /// Host-side veth.
    pub(super) host_if: String,
    /// Address of the host side (the forwarder's and the clients' source).
    pub(super) host_addr: Ipv4Addr,
    /// Address of the namespace side (where the instance listens).
    pub(super) ns_addr: Ipv4Addr,
    /// The instance's database forwarder.
    pub(super) forwarder: Forwarder,
}

impl Link {
    /// `ip netns exec <ns>`: the command prefix that runs a program in this namespace.
    pub(super) fn exec_prefix(&self) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), self.ns.clone()]
    }

    fn nft_args(&self, rest: &[&str]) -> Vec<String> {
        let mut a = self.exec_prefix();
        a.push("nft".into());
        a.extend(rest.iter().map(|s| (*s).to_owned()));
        a
    }

    /// The nftables rules that drop `percent` % (100: all) of the packets to
    /// and from the forwarder, with counters.
    fn drop_rules(&self, percent: u8) -> String {
        let port = self.forwarder.addr.port();
        let host = self.host_addr;
        let sample = if percent >= 100 {
            String::new()
        } else {
            format!("numgen random mod 100 < {percent} ")
        };
        format!(
            "add rule inet {NFT_TABLE} out ip daddr {host} tcp dport {port} {sample}counter drop\n\
             add rule inet {NFT_TABLE} in ip saddr {host} tcp sport {port} {sample}counter drop\n"
        )
    }

    /// Drops `percent` % of the database packets (100: a full partition).
    pub(super) async fn drop_packets(&self, percent: u8) -> Result<(), NetnsError> {
        run_async(self.nft_args(&["-f", "-"]), Some(self.drop_rules(percent))).await?;
        Ok(())
    }

    /// Removes every drop rule; returns the packets they dropped.
    pub(super) async fn heal(&self) -> Result<u64, NetnsError> {
        let listed = run_async(
            self.nft_args(&["-j", "list", "table", "inet", NFT_TABLE]),
            None,
        )
        .await?;
        run_async(self.nft_args(&["flush", "table", "inet", NFT_TABLE]), None).await?;
        dropped_packets(&listed)
    }
}

/// The sum of the `counter` packets of every rule in `nft -j` output.
fn dropped_packets(json: &str) -> Result<u64, NetnsError> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| NetnsError::Counters(e.to_string()))?;
    let items = v
        .get("nftables")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| NetnsError::Counters("no `nftables` array".into()))?;
    Ok(items
        .iter()
        .filter_map(|i| i.get("rule")?.get("expr")?.as_array())
        .flatten()
        .filter_map(|e| e.get("counter")?.get("packets")?.as_u64())
        .sum())
}

/// The namespaces, veths and forwarders of one run; dropping it removes them.
pub(super) struct Network {
    /// Per instance.
    pub(super) links: Vec<Arc<Link>>,
    /// Every namespace and host veth this run created or tried to create.
    created: Vec<(String, String)>,
}

impl Drop for Network {
    fn drop(&mut self) {
        self.links.clear();
        for (ns, host_if) in &self.created {
            remove_namespace(ns, host_if);
        }
    }
}

impl Network {
    /// Builds `instances` namespaces with their veth pairs and nftables
    /// tables, and a forwarder per instance to `upstream` (jitter seeded by
    /// `seed`). Leftovers of dead runs are removed first ([`remove_leftovers`]).
    ///
    /// # Errors
    /// [`NetnsError::Unavailable`] when this machine cannot ([`probe`]);
    /// [`NetnsError::AddressInUse`] when the run's address block is taken;
    /// any failing command. Whatever was built is removed again.
    pub(super) async fn create(
        instances: usize,
        upstream: SocketAddr,
        seed: u64,
    ) -> Result<(Network, Vec<String>), NetnsError> {
        let leftovers = tokio::task::spawn_blocking(|| {
            probe()?;
            Ok::<_, NetnsError>(remove_leftovers())
        })
        .await
        .map_err(|e| NetnsError::Command {
            command: "a blocking task".into(),
            detail: e.to_string(),
        })??;
        let pid = std::process::id();
        let mut net = Network {
            links: Vec::new(),
            created: Vec::new(),
        };
        for i in 0..instances {
            let k = (pid % 8192) * 2 + u32::try_from(i).unwrap_or(0);
            let base = u32::from(Ipv4Addr::new(10, 213, 0, 0)) + 4 * k;
            let host_addr = Ipv4Addr::from(base + 1);
            let ns_addr = Ipv4Addr::from(base + 2);
            if address_assigned(host_addr) || address_assigned(ns_addr) {
                return Err(NetnsError::AddressInUse(host_addr));
            }
            let ns = format!("{NS_PREFIX}{pid}-{i}");
            let host_if = format!("ic{pid}h{i}");
            let ns_if = format!("ic{pid}n{i}");
            net.created.push((ns.clone(), host_if.clone()));
            let host_cidr = format!("{host_addr}/30");
            let ns_cidr = format!("{ns_addr}/30");
            let steps: Vec<Vec<&str>> = vec![
                vec!["ip", "netns", "add", &ns],
                vec![
                    "ip", "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if, "netns",
                    &ns,
                ],
                vec!["ip", "addr", "add", &host_cidr, "dev", &host_if],
                vec!["ip", "link", "set", &host_if, "up"],
                vec!["ip", "-n", &ns, "addr", "add", &ns_cidr, "dev", &ns_if],
                vec!["ip", "-n", &ns, "link", "set", &ns_if, "up"],
                vec!["ip", "-n", &ns, "link", "set", "lo", "up"],
            ];
            for step in steps {
                run_async(step.iter().map(|s| (*s).to_owned()).collect(), None).await?;
            }
            run_async(
                vec![
                    "ip".into(),
                    "netns".into(),
                    "exec".into(),
                    ns.clone(),
                    "nft".into(),
                    "-f".into(),
                    "-".into(),
                ],
                Some(nft_table()),
            )
            .await?;
            let bind = SocketAddr::from((host_addr, 0));
            let forwarder = forward::start(bind, upstream, seed ^ u64::from(k))
                .await
                .map_err(|source| NetnsError::Forwarder { addr: bind, source })?;
            net.links.push(Arc::new(Link {
                ns,
                host_if,
                host_addr,
                ns_addr,
                forwarder,
            }));
        }
        Ok((net, leftovers))
    }
}

/// Whether `addr` is assigned to an interface of the root namespace.
fn address_assigned(addr: Ipv4Addr) -> bool {
    run(&["ip", "-o", "-4", "addr", "show"], None).is_ok_and(|out| {
        out.split_whitespace()
            .any(|w| w.split('/').next() == Some(&addr.to_string()))
    })
}

/// Whether namespace `ns` exists.
pub fn namespace_exists(ns: &str) -> bool {
    namespaces().iter().any(|n| n == ns)
}

/// Whether interface `name` exists in the root namespace.
pub fn interface_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn counters_are_summed_over_every_rule() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
            {"chain": {"family": "inet", "table": "idem_chaos", "name": "out"}},
            {"rule": {"chain": "out", "expr": [{"match": {}}, {"counter": {"packets": 7, "bytes": 420}}, {"drop": null}]}},
            {"rule": {"chain": "in", "expr": [{"counter": {"packets": 5, "bytes": 300}}, {"drop": null}]}}]}"#;
        assert_eq!(dropped_packets(json).unwrap(), 12);
        assert!(dropped_packets("table inet").is_err());
    }

    /// Builds a two-instance network where the machine can, checks the
    /// instance side reaches the forwarder and a partition cuts it, and that
    /// dropping the network removes namespaces and veths. Skipped (with a
    /// message) where namespaces cannot be made.
    #[tokio::test]
    async fn a_network_is_built_cut_healed_and_removed() {
        if let Err(e) = tokio::task::spawn_blocking(probe).await.unwrap() {
            eprintln!("skipped: {e}");
            return;
        }
        let up = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = up.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = up.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let (net, _) = Network::create(2, upstream, 1).await.unwrap();
        let names: Vec<(String, String)> = net
            .links
            .iter()
            .map(|l| (l.ns.clone(), l.host_if.clone()))
            .collect();
        for (ns, host_if) in &names {
            assert!(namespace_exists(ns));
            assert!(interface_exists(host_if));
        }
        let link = net.links[0].clone();
        let fwd = link.forwarder.addr.to_string();
        // From inside the namespace, through the forwarder to the echo server.
        let echo = |timeout: &str| {
            let mut a = link.exec_prefix();
            a.extend(
                [
                    "socat",
                    "-T",
                    timeout,
                    "-",
                    &format!("TCP:{fwd},connect-timeout={timeout}"),
                ]
                .map(str::to_owned),
            );
            a
        };
        if run(&["socat", "-V"], None).is_ok() {
            let out = run_async(echo("2"), Some("ping\n".into())).await.unwrap();
            assert_eq!(out, "ping\n");
            link.drop_packets(100).await.unwrap();
            assert!(run_async(echo("1"), Some("ping\n".into())).await.is_err());
            assert!(
                link.heal().await.unwrap() > 0,
                "the partition dropped the SYNs"
            );
            let out = run_async(echo("2"), Some("ping\n".into())).await.unwrap();
            assert_eq!(out, "ping\n");
        }
        drop(link);
        drop(net);
        for (ns, host_if) in &names {
            assert!(!namespace_exists(ns), "{ns} removed");
            assert!(!interface_exists(host_if), "{host_if} removed");
        }
    }
}
