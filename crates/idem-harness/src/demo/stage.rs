//! The demo's state and its means of telling: the clients, the provider and
//! the report being written, the wording helpers (wrapping, counts, money with
//! units, statuses), and the steps every scene uses (submit, claim, wait).

use super::*;

pub(super) struct Demo {
    /// The agent (client key), through the flaky link, with a short timeout:
    /// used for submissions, always with [`Client::submit_with_retry`].
    pub(super) agent: Client,
    /// The agent through the same link with a patient timeout (cancel, acknowledge,
    /// conflicting submissions), so that a slow machine does not fail the demo.
    pub(super) agent_patient: Client,
    /// The same client key, direct (reads that must not be lost).
    pub(super) reader: Client,
    /// The executors' key.
    pub(super) exec: Client,
    pub(super) link: FlakyLink,
    pub(super) provider: Provider,
    /// An admin of the demo's tenant (scene f's acknowledgment); `None`
    /// without `--admin-key` against a running idem.
    pub(super) admin: Option<Client>,
    run_id: String,
    echo: bool,
    pub(super) report: DemoReport,
    scene: String,
    scene_first_check: usize,
    /// Every task this run created.
    pub(super) tasks: Vec<Uuid>,
    /// Tasks whose outcome became unknown (expired execute lease).
    pub(super) unknown_outcome: Vec<Uuid>,
}

/// Report lines are wrapped at this many columns.
const WIDTH: usize = 100;

/// Word-wraps `text` to `width` columns: the first line starts with `first`, the others with `rest`.
pub(super) fn wrap(text: &str, width: usize, first: &str, rest: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = first.to_owned();
    let mut empty = true;
    for word in text.split_whitespace() {
        if !empty && current.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::replace(&mut current, rest.to_owned()));
            empty = true;
        }
        if !empty {
            current.push(' ');
        }
        current.push_str(word);
        empty = false;
    }
    lines.push(current);
    lines
}

/// "once", "twice", "3 times".
pub(super) fn times(n: usize) -> String {
    match n {
        1 => "once".into(),
        2 => "twice".into(),
        n => format!("{n} times"),
    }
}

/// "1 request", "2 requests".
pub(super) fn count(n: usize, noun: &str) -> String {
    match (n, noun.strip_suffix('y')) {
        (1, _) => format!("1 {noun}"),
        (_, Some(stem)) => format!("{n} {stem}ies"),
        _ => format!("{n} {noun}s"),
    }
}

/// Last 8 characters of an id (UUID v7 ids share their leading, time-based digits).
pub(super) fn short(id: Uuid) -> String {
    let s = id.simple().to_string();
    format!("…{}", &s[s.len() - 8..])
}

/// An amount of integer minor units of the ISO 4217 `currency` (a payment's
/// own amount, cents for EUR), as [`Money`] writes it: `EUR 12.50`.
pub(super) fn money(amount: i64, currency: &str) -> String {
    Money::new(amount, Currency::from_code(currency).ok()).to_string()
}

/// `amount` minor units of the fee currency frozen into `contract`
/// (`fees.currency`, `fees.exponent`), or of no named currency.
pub(super) fn fee_money(contract: &Contract, amount: i64) -> Money {
    let currency = contract.currency().map(|(code, exponent)| Currency {
        code: code.to_owned(),
        exponent,
    });
    Money::new(amount, currency)
}

/// What idem charged for a delivery, in the contract's currency: `a charge of
/// EUR 1.00`, or `no charge` ([`money::charge_words`]).
pub(super) fn charge(amount: Option<i64>, contract: &Contract) -> String {
    money::charge_words(amount.map(|a| fee_money(contract, a)).as_ref())
}

/// A cancellation's fee, in the contract's currency: `a cancellation fee of
/// EUR 0.14` ([`money::fee_words`]).
pub(super) fn cancel_fee(amount: Option<i64>, contract: &Contract) -> String {
    money::fee_words(amount.map(|a| fee_money(contract, a)).as_ref())
}

/// A cancellation that lost to delivery: the one charge, the delivery's, and
/// that the fee is that same charge ([`money::too_late_words`]).
pub(super) fn too_late(charge: i64, contract: &Contract) -> String {
    money::too_late_words(&fee_money(contract, charge))
}

pub(super) fn status_of(r: &Result<impl Sized, ClientError>) -> String {
    match r {
        Ok(_) => "200".into(),
        Err(e) => describe_error(e),
    }
}

pub(super) fn describe_error(e: &ClientError) -> String {
    match (e.status(), e.code()) {
        (Some(s), Some(c)) => format!("{s} {c}"),
        (Some(s), None) => format!("HTTP {s}"),
        _ if e.is_timeout() => "a timeout".into(),
        _ => {
            let mut chain = String::from("a transport error");
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                let _ = write!(chain, ": {s}");
                source = s.source();
            }
            chain
        }
    }
}

/// The fields of a task that a report, cancel or submission may change (not
/// `updated_at`, which moves whenever an audit event is appended).
pub(super) fn material(t: &Task) -> Value {
    json!({
        "state": t.state, "generation": t.generation, "attempt_count": t.attempt_count,
        "usage": t.usage, "params": t.params, "fingerprint": t.fingerprint,
        "delivery": t.delivery, "cancellation": t.cancellation, "failure": t.failure,
    })
}

impl Demo {
    pub(super) async fn new(opts: &DemoOptions, target: &Target) -> Result<Demo> {
        let reader = Client::new(&target.url, target.client_key.clone())?
            .with_timeout(Duration::from_secs(10));
        let exec = Client::new(&target.url, target.executor_key.clone())?
            .with_timeout(Duration::from_secs(10));
        reader
            .ready()
            .await
            .with_context(|| format!("idem at {} is not ready", target.url))?;
        let link = FlakyLink::start(&target.url).await?;
        let agent_patient = Client::new(&link.url, target.client_key.clone())?
            .with_timeout(Duration::from_secs(10));
        let agent = agent_patient.clone().with_timeout(AGENT_TIMEOUT);
        let run_id = Uuid::new_v4().simple().to_string();
        Ok(Demo {
            agent,
            agent_patient,
            reader,
            exec,
            link,
            provider: Provider::default(),
            admin: target
                .admin_key
                .as_ref()
                .map(|k| Client::new(&target.url, k.clone()))
                .transpose()?
                .map(|c| c.with_timeout(Duration::from_secs(10))),
            run_id: format!("demo-{}", &run_id[..8]),
            echo: opts.echo,
            report: DemoReport::default(),
            scene: String::new(),
            scene_first_check: 0,
            tasks: Vec::new(),
            unknown_outcome: Vec::new(),
        })
    }

    // --- output -----------------------------------------------------------

    pub(super) fn line(&mut self, s: impl Into<String>) {
        let s = s.into();
        if self.echo {
            // A closed stdout (e.g. `idem-lab demo | head`) must not end the run.
            use std::io::Write as _;
            let _ = writeln!(std::io::stdout().lock(), "{s}");
        }
        self.report.lines.push(s);
    }

    /// One sentence of the current scene's paragraph, wrapped at [`WIDTH`] columns.
    pub(super) fn say(&mut self, s: impl Into<String>) {
        for l in wrap(&s.into(), WIDTH, "    ", "      ") {
            self.line(l);
        }
    }

    pub(super) fn check(
        &mut self,
        invariant: Invariant,
        passed: bool,
        expectation: impl Into<String>,
    ) {
        self.report.checks.push(Check {
            invariant,
            scene: self.scene.clone(),
            passed,
            expectation: expectation.into(),
        });
    }

    pub(super) fn header(&mut self, target: &Target) {
        self.line(
            "idem-lab demo: releasing a payment safely when networks, executors and clients misbehave",
        );
        self.line(format!("  idem      {}", target.description));
        self.line("  provider  a simulated payout provider that is itself idempotent by task id");
        self.line("            (scene f: its entry that takes no idempotency key)");
        self.line(format!(
            "  agent     an HTTP client with a {} ms timeout, behind a link that can lose answers",
            AGENT_TIMEOUT.as_millis()
        ));
        self.line(format!(
            "  (keys of this run start with {}; ids are shortened to their last 8 characters)",
            self.run_id
        ));
    }

    pub(super) fn begin(&mut self, id: &str, title: &str) {
        self.scene = id.to_owned();
        self.scene_first_check = self.report.checks.len();
        self.line(String::new());
        if id.len() == 1 {
            self.line(format!("({id}) {title}"));
        } else {
            self.line(title.to_owned());
        }
    }

    pub(super) fn end(&mut self, res: Result<()>) {
        let checks = &self.report.checks[self.scene_first_check..];
        let failed: Vec<String> = checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.expectation.clone())
            .collect();
        let total = checks.len();
        if let Err(e) = res {
            let msg = format!("scene ({}) could not finish: {e:#}", self.scene);
            self.say(format!("FAIL: {msg}"));
            self.report.errors.push(msg);
        }
        if failed.is_empty() {
            if total > 0 {
                self.say(format!("PASS ({total} checks)"));
            }
        } else {
            self.say(format!(
                "FAIL: {} of {total} checks did not hold:",
                failed.len()
            ));
            for f in failed {
                self.say(format!("  expected: {f}"));
            }
        }
    }

    // --- helpers ----------------------------------------------------------

    pub(super) fn key(&self, name: &str) -> String {
        format!("{}-{name}", self.run_id)
    }

    pub(super) async fn submit_new(&mut self, key: &str, params: &Value) -> Result<Task> {
        let s = self
            .reader
            .submit(OPERATION, params, key)
            .await
            .with_context(|| format!("submitting {key}"))?;
        self.tasks.push(s.task.id);
        Ok(s.task)
    }

    /// Claims the next attempt, which must belong to `task_id`.
    pub(super) async fn claim(
        &self,
        executor: &str,
        task_id: Uuid,
        lease_ms: u64,
    ) -> Result<ClaimedAttempt> {
        let started = Instant::now();
        loop {
            let got = self
                .exec
                .claim(executor, &[OPERATION], 1, Some(lease_ms), 2_000)
                .await
                .context("claiming an attempt")?;
            if let Some(a) = got.into_iter().next() {
                if a.task_id != task_id {
                    bail!(
                        "claimed an attempt of task {} instead of {}: the tenant has other pending payment.release work; run the demo with keys of a dedicated tenant",
                        a.task_id,
                        task_id
                    );
                }
                return Ok(a);
            }
            if started.elapsed() > PATIENCE {
                bail!("no attempt of task {} became available", short(task_id));
            }
        }
    }

    /// Polls until the task is in `state`; returns it and the time waited.
    pub(super) async fn wait_for(
        &self,
        task_id: Uuid,
        state: TaskState,
    ) -> Result<(Task, Duration)> {
        let started = Instant::now();
        loop {
            let t = self.reader.get_task(task_id).await?;
            if t.state == state {
                return Ok((t, started.elapsed()));
            }
            if started.elapsed() > PATIENCE {
                bail!(
                    "task {} stayed `{}` instead of becoming `{state}`",
                    short(task_id),
                    t.state
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}
