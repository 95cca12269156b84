//! The database link of one namespaced instance: a TCP forwarder in the root
//! namespace, bound to the host side of the instance's veth pair, that carries
//! its PostgreSQL connections to the database (which listens on loopback only,
//! out of the namespace's reach) and delays them on command.
//!
//! Delay is applied here, per chunk read from a socket, because this kernel
//! has no `sch_netem` (`tc qdisc … netem` answers "Specified qdisc kind is
//! unknown"): every chunk is held for the link's delay plus a uniform jitter
//! of ± the link's jitter before it is written on. Within one connection the
//! byte order is kept (a chunk is never written before the one read ahead of
//! it); across connections the jitter reorders requests, as netem's per-packet
//! jitter would. Partitions and packet loss are not made here but by
//! nftables rules inside the namespace (see [`super::netns`]), so the kernel's
//! TCP stack sees the drops and retransmits.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// The delay of a link, changed while connections run: each chunk is held
/// `delay_ms ± jitter_ms` (uniform), ms; 0 and 0 forward at once.
#[derive(Debug, Default)]
pub(super) struct Shape {
    delay_ms: AtomicU64,
    jitter_ms: AtomicU64,
}

impl Shape {
    /// Holds every chunk from now on for `delay_ms ± jitter_ms` (jitter at most the delay).
    pub(super) fn set(&self, delay_ms: u64, jitter_ms: u64) {
        self.jitter_ms
            .store(jitter_ms.min(delay_ms), Ordering::SeqCst);
        self.delay_ms.store(delay_ms, Ordering::SeqCst);
    }

    /// Forwards chunks at once from now on (chunks already held keep their time).
    pub(super) fn clear(&self) {
        self.set(0, 0);
    }

    fn sample(&self, rng: &mut SmallRng) -> Duration {
        let d = self.delay_ms.load(Ordering::SeqCst);
        let j = self.jitter_ms.load(Ordering::SeqCst).min(d);
        if d == 0 {
            return Duration::ZERO;
        }
        Duration::from_millis(rng.random_range(d - j..=d + j))
    }
}

/// What a forwarder saw, counted since it started.
#[derive(Debug, Default)]
pub(super) struct ForwardStats {
    /// Connections accepted from the instance.
    pub(super) opened: AtomicU64,
    /// Connections that ended with both directions closed in order.
    pub(super) ended: AtomicU64,
    /// Connections that ended with a read or write error on either side
    /// (reset, broken pipe): the connection failed.
    pub(super) failed: AtomicU64,
    /// Connections accepted whose connect to PostgreSQL failed.
    pub(super) refused: AtomicU64,
    /// Chunks held for a delay.
    pub(super) delayed_chunks: AtomicU64,
    /// Longest single hold, ms.
    pub(super) max_hold_ms: AtomicU64,
}

impl ForwardStats {
    /// Connections open now.
    pub(super) fn open(&self) -> u64 {
        let o = self.opened.load(Ordering::SeqCst);
        let done = self.ended.load(Ordering::SeqCst)
            + self.failed.load(Ordering::SeqCst)
            + self.refused.load(Ordering::SeqCst);
        o.saturating_sub(done)
    }
}

/// A running forwarder; dropping it closes its listener and every connection.
pub(super) struct Forwarder {
    /// Where the instance connects (the host side of its veth pair).
    pub(super) addr: SocketAddr,
    /// The link's delay.
    pub(super) shape: Arc<Shape>,
    /// Counters.
    pub(super) stats: Arc<ForwardStats>,
    accept: tokio::task::AbortHandle,
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        // The accept task owns the connections' tasks: aborting it ends them all.
        self.accept.abort();
    }
}

/// Listens on `bind` (port 0: any) and forwards each connection to
/// `upstream`, delayed by the returned forwarder's [`Shape`]; `seed` seeds
/// the jitter.
///
/// # Errors
/// When `bind` cannot be bound.
pub(super) async fn start(
    bind: SocketAddr,
    upstream: SocketAddr,
    seed: u64,
) -> io::Result<Forwarder> {
    let listener = TcpListener::bind(bind).await?;
    let addr = listener.local_addr()?;
    let shape = Arc::new(Shape::default());
    let stats = Arc::new(ForwardStats::default());
    let (s, st) = (shape.clone(), stats.clone());
    let accept = tokio::spawn(async move {
        let mut conns = JoinSet::new();
        let mut n: u64 = 0;
        loop {
            tokio::select! {
                got = listener.accept() => match got {
                    Ok((down, _)) => {
                        n += 1;
                        let rng = SmallRng::seed_from_u64(seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                        conns.spawn(connection(down, upstream, s.clone(), st.clone(), rng));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    })
    .abort_handle();
    Ok(Forwarder {
        addr,
        shape,
        stats,
        accept,
    })
}

async fn connection(
    down: TcpStream,
    upstream: SocketAddr,
    shape: Arc<Shape>,
    stats: Arc<ForwardStats>,
    mut rng: SmallRng,
) {
    stats.opened.fetch_add(1, Ordering::SeqCst);
    let up = match TcpStream::connect(upstream).await {
        Ok(s) => s,
        Err(_) => {
            stats.refused.fetch_add(1, Ordering::SeqCst);
            return;
        }
    };
    let _ = down.set_nodelay(true);
    let _ = up.set_nodelay(true);
    let (dr, dw) = down.into_split();
    let (ur, uw) = up.into_split();
    let back = SmallRng::seed_from_u64(rng.random());
    let r = tokio::try_join!(
        pipe(dr, uw, &shape, &stats, rng),
        pipe(ur, dw, &shape, &stats, back)
    );
    // On an error both halves of both sockets are dropped here, so the other
    // side sees the connection end too, as it would on a real link failure.
    match r {
        Ok(_) => stats.ended.fetch_add(1, Ordering::SeqCst),
        Err(_) => stats.failed.fetch_add(1, Ordering::SeqCst),
    };
}

/// Copies `from` to `to`, each chunk held for a sample of `shape` and never
/// written before the chunk read ahead of it; EOF is passed on as a write
/// shutdown.
async fn pipe(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shape: &Shape,
    stats: &ForwardStats,
    mut rng: SmallRng,
) -> io::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        let mut last = Instant::now();
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, io::Error>(());
            }
            let hold = shape.sample(&mut rng);
            if !hold.is_zero() {
                stats.delayed_chunks.fetch_add(1, Ordering::Relaxed);
                let ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX);
                stats.max_hold_ms.fetch_max(ms, Ordering::Relaxed);
            }
            let at = (Instant::now() + hold).max(last);
            last = at;
            if tx.send((at, buf[..n].to_vec())).is_err() {
                return Ok(());
            }
        }
    };
    let writer = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            to.write_all(&chunk).await?;
        }
        to.shutdown().await
    };
    tokio::try_join!(reader, writer).map(|_| ())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    /// Bytes come back complete and in order through a delayed, jittered
    /// link, and no earlier than two holds (there and back) of the smallest
    /// delay.
    #[tokio::test]
    async fn a_delayed_link_keeps_the_byte_order_and_holds_each_way() {
        let echo = echo_server().await;
        let f = start("127.0.0.1:0".parse().unwrap(), echo, 7)
            .await
            .unwrap();
        f.shape.set(60, 40);
        let mut c = TcpStream::connect(f.addr).await.unwrap();
        let sent: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let started = std::time::Instant::now();
        let (mut r, mut w) = c.split();
        let write = async {
            for part in sent.chunks(997) {
                w.write_all(part).await.unwrap();
                tokio::task::yield_now().await;
            }
            w.shutdown().await.unwrap();
        };
        let mut got = Vec::new();
        let read = r.read_to_end(&mut got);
        let (_, n) = tokio::join!(write, read);
        n.unwrap();
        assert_eq!(got, sent);
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert!(f.stats.delayed_chunks.load(Ordering::SeqCst) >= 2);
        assert!(f.stats.max_hold_ms.load(Ordering::SeqCst) <= 100);
        f.shape.clear();
        assert_eq!(
            f.shape.sample(&mut SmallRng::seed_from_u64(1)),
            Duration::ZERO
        );
    }

    /// A connection whose upstream refuses is counted, and the instance's side is closed.
    #[tokio::test]
    async fn a_refused_upstream_is_counted() {
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead = closed.local_addr().unwrap();
        drop(closed);
        let f = start("127.0.0.1:0".parse().unwrap(), dead, 1)
            .await
            .unwrap();
        let mut c = TcpStream::connect(f.addr).await.unwrap();
        let mut buf = [0u8; 1];
        let n = c.read(&mut buf).await.unwrap_or(0);
        assert_eq!(n, 0);
        assert_eq!(f.stats.refused.load(Ordering::SeqCst), 1);
        assert_eq!(f.stats.open(), 0);
    }
}
