//! Clock skew of `idem-lab chaos --clock-skew-ms N`: the second instance runs
//! under libfaketime (`LD_PRELOAD`, `FAKETIME="±N/1000"`), its wall clock
//! shifted +N at its first start and the sign flipped at each restart, so one
//! run sees both directions. Monotonic clocks are not shifted
//! (`FAKETIME_DONT_FAKE_MONOTONIC=1`): a skew is a wrong wall clock, and
//! timers keep their length.
//!
//! After every start the instance's HTTP `Date` header is compared with this
//! process's clock: a skew the instance does not show (libfaketime missing or
//! not loaded, a static binary) ends the run with an error instead of letting
//! it pass. With a PostgreSQL store, leases, backoffs and expiries must follow
//! the database clock (`clock_timestamp()`) only; the checker's invariants
//! find a decision made by a process clock.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::*;

/// Where Debian (package libfaketime) and other distributions put the library.
const LIBFAKETIME_PATHS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
];

/// Smallest skew, ms: the `Date` header has whole seconds, so a smaller
/// shift could not be told apart from none.
pub const MIN_CLOCK_SKEW_MS: i64 = 5_000;

/// Largest skew, ms (one day): far beyond every lease, backoff, deadline
/// and retention window of the chaos configuration. Shifts of centuries
/// leave the instance a wall clock it cannot start with (at `i64::MAX` ms it
/// resets its first connection).
pub const MAX_CLOCK_SKEW_MS: i64 = 86_400_000;

/// Checks the size of a non-zero `--clock-skew-ms`: from
/// [`MIN_CLOCK_SKEW_MS`] to [`MAX_CLOCK_SKEW_MS`] either way.
///
/// # Errors
/// A message naming the bound `skew_ms` is outside of.
pub fn check_clock_skew(skew_ms: i64) -> Result<()> {
    let size = skew_ms.unsigned_abs();
    if size < MIN_CLOCK_SKEW_MS.unsigned_abs() {
        bail!(
            "--clock-skew-ms must be at least {MIN_CLOCK_SKEW_MS} in size (the Date header that proves it has whole seconds)"
        );
    }
    if size > MAX_CLOCK_SKEW_MS.unsigned_abs() {
        bail!("--clock-skew-ms must be at most {MAX_CLOCK_SKEW_MS} (one day) in size");
    }
    Ok(())
}

/// How far the observed shift may be from the intended one, ms, besides the
/// request's round trip: `Date` is truncated to the second.
const SKEW_TOLERANCE_MS: i64 = 1_500;

/// libfaketime: `explicit`, or the first that exists of the paths where
/// Debian (`/usr/lib/<triplet>/faketime/`) and other distributions install it.
///
/// # Errors
/// When none exists.
pub fn find_libfaketime(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!("--libfaketime {}: no such file", p.display());
    }
    LIBFAKETIME_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "--clock-skew-ms needs libfaketime (Debian: apt-get install faketime); looked in {}",
                LIBFAKETIME_PATHS.join(", ")
            )
        })
}

/// One check of the skewed instance's clock after a start.
#[derive(Debug, Clone, Serialize)]
pub struct SkewCheck {
    /// Start of the instance (0: the first).
    pub start: usize,
    /// The shift it was started with, ms.
    pub intended_ms: i64,
    /// Its `Date` header minus this process's clock, ms.
    pub observed_ms: i64,
}

/// The clock skew of a run.
#[derive(Debug, Clone, Serialize)]
pub struct SkewReport {
    /// The instance under libfaketime.
    pub instance: usize,
    /// |shift|, ms.
    pub skew_ms: i64,
    /// The library preloaded.
    pub libfaketime: String,
    /// One per start of the instance.
    pub checks: Vec<SkewCheck>,
}

/// The shifted clock of [`SKEWED_SERVER`].
pub(super) struct Skew {
    pub(super) ms: i64,
    pub(super) lib: PathBuf,
    starts: AtomicUsize,
    pub(super) checks: Mutex<Vec<SkewCheck>>,
}

impl Skew {
    pub(super) fn new(ms: i64, lib: PathBuf) -> Skew {
        Skew {
            ms,
            lib,
            starts: AtomicUsize::new(0),
            checks: Mutex::new(Vec::new()),
        }
    }

    /// The next start's number and shift (+ms, −ms, +ms, …) and its environment.
    pub(super) fn next_start(&self) -> (usize, i64, Vec<(String, String)>) {
        let n = self.starts.fetch_add(1, Ordering::SeqCst);
        let offset = if n.is_multiple_of(2) {
            self.ms
        } else {
            -self.ms
        };
        let abs = offset.unsigned_abs();
        let faketime = format!(
            "{}{}.{:03}",
            if offset < 0 { '-' } else { '+' },
            abs / 1000,
            abs % 1000
        );
        let env = vec![
            ("LD_PRELOAD".to_owned(), self.lib.display().to_string()),
            ("FAKETIME".to_owned(), faketime),
            ("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
            // The name older libfaketime releases read.
            ("DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
        ];
        (n, offset, env)
    }

    /// Reads the `Date` of `url`'s `/healthz` and records the check.
    ///
    /// # Errors
    /// When the instance does not answer, sends no `Date`, or its clock is
    /// not shifted by about `intended_ms`.
    pub(super) async fn verify(
        &self,
        http: &reqwest::Client,
        url: &str,
        start: usize,
        intended_ms: i64,
    ) -> Result<()> {
        let before = SystemTime::now();
        let resp = http
            .get(format!("{url}/healthz"))
            .send()
            .await
            .with_context(|| format!("checking the clock of {url}"))?;
        let after = SystemTime::now();
        let date = resp
            .headers()
            .get(reqwest::header::DATE)
            .and_then(|v| v.to_str().ok())
            .context("the skewed instance sent no Date header")?;
        let shown = httpdate::parse_http_date(date)
            .with_context(|| format!("the skewed instance's Date `{date}`"))?;
        let rtt = after.duration_since(before).unwrap_or_default();
        let mid = before + rtt / 2;
        let observed_ms = signed_ms(shown, mid);
        // `Date` is truncated to the second: it reads up to 1 s early.
        let slack = SKEW_TOLERANCE_MS + i64::try_from(rtt.as_millis()).unwrap_or(i64::MAX);
        if (observed_ms - intended_ms).abs() > slack {
            bail!(
                "clock skew not in effect: instance {SKEWED_SERVER} (start {start}) shows a clock {observed_ms} ms off, \
                 {intended_ms} ms intended (libfaketime {} not loaded?)",
                self.lib.display()
            );
        }
        self.checks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(SkewCheck {
                start,
                intended_ms,
                observed_ms,
            });
        Ok(())
    }
}

/// `a − b` in ms.
fn signed_ms(a: SystemTime, b: SystemTime) -> i64 {
    match a.duration_since(b) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn starts_alternate_the_sign_and_spell_faketime_offsets() {
        let s = Skew::new(30_250, PathBuf::from("/lib/x.so"));
        let (n0, o0, env0) = s.next_start();
        let (n1, o1, env1) = s.next_start();
        let (_, o2, _) = s.next_start();
        assert_eq!((n0, o0, n1, o1, o2), (0, 30_250, 1, -30_250, 30_250));
        let get =
            |env: &[(String, String)], k: &str| env.iter().find(|(n, _)| n == k).unwrap().1.clone();
        assert_eq!(get(&env0, "FAKETIME"), "+30.250");
        assert_eq!(get(&env1, "FAKETIME"), "-30.250");
        assert_eq!(get(&env0, "LD_PRELOAD"), "/lib/x.so");
    }

    #[test]
    fn signed_differences() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        assert_eq!(signed_ms(t + Duration::from_millis(1500), t), 1500);
        assert_eq!(signed_ms(t, t + Duration::from_millis(1500)), -1500);
    }
}
