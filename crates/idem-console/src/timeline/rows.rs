//! The task row (acceptance, retries, reconciliation, wake-ups, operator
//! actions) and the outcome row (cancellation, delivery, failure, key
//! expiry).

use super::*;

/// The task row's marks: acceptance, retries, reconciliation, wake-ups,
/// operator actions.
pub(super) fn task_marks(events: &[&Event]) -> Vec<Mark> {
    let mut marks = Vec::new();
    for e in events {
        let d = &e.data;
        let reason = || format!("reason {}", str_of(d, "reason").unwrap_or_default());
        let mark = |shape, class: &str| Mark::new(e.at, e.seq, shape, class);
        let m = match e.kind {
            EventKind::TaskSubmitted => mark(Shape::Dot, "submitted").label("accepted").title(
                "task accepted",
                &[
                    format!(
                        "idempotency key {}",
                        str_of(d, "idempotency_key").unwrap_or_default()
                    ),
                    format!(
                        "fingerprint {}",
                        str_of(d, "fingerprint").unwrap_or_default()
                    ),
                    format!("price {} (minor units)", opt(int_of(d, "price"))),
                ],
            ),
            EventKind::RetryScheduled => {
                let backoff = int_of(d, "backoff_ms").unwrap_or(0);
                let word = if backoff > 0 {
                    format!("retry in {}", duration(backoff))
                } else {
                    "retry".to_owned()
                };
                mark(Shape::Dot, "retry").label(&word).optional().title(
                    "another execute attempt may start",
                    &[
                        reason(),
                        format!("backoff {}", duration(backoff)),
                        ready_at(d),
                    ],
                )
            }
            EventKind::ReconciliationRequired => mark(Shape::Diamond, "reconcile")
                .label("reconciliation required")
                .optional()
                .title(
                    "reconciliation required: only reconcile attempts run",
                    &[reason(), ready_at(d)],
                ),
            EventKind::TaskWoken => mark(Shape::Dot, "woken").title("backoff over: queued", &[]),
            EventKind::OperatorRetryNow => operator(e, "retry now", &[]),
            EventKind::OperatorCancel => operator(e, "cancel", &[]),
            EventKind::OperatorResolved => {
                let outcome = str_of(d, "outcome").unwrap_or_default();
                let mut more = vec![format!("outcome {outcome}")];
                if let Some(t) = str_of(d, "external_txn_id") {
                    more.push(format!("external transaction id {t}"));
                }
                if let Some(r) = str_of(d, "retired_attempt_id") {
                    more.push(format!("retired attempt {r}"));
                }
                more.push(format!("generation {}", opt(int_of(d, "generation"))));
                operator(e, &format!("resolved {outcome}"), &more)
            }
            EventKind::OperatorRedriven => operator(
                e,
                "redrive",
                &[format!("execute limit {}", opt(int_of(d, "execute_limit")))],
            ),
            _ => continue,
        };
        marks.push(m);
    }
    marks
}

/// `ready at …` of an event that names when the task may be claimed again.
pub(super) fn ready_at(d: &Value) -> String {
    str_of(d, "ready_at").map_or_else(String::new, |t| format!("claimable from {t}"))
}

/// An operator action's mark: actor and reason in the title.
pub(super) fn operator(e: &Event, what: &str, more: &[String]) -> Mark {
    let d = &e.data;
    let actor = match d.get("actor") {
        Some(a) => match str_of(a, "type").as_deref() {
            Some("api_key") => {
                let id = str_of(a, "api_key_id").unwrap_or_default();
                format!("admin key {id}")
            }
            Some("cli") => {
                let user = str_of(a, "user").unwrap_or_default();
                format!("command line user {user}")
            }
            _ => a.to_string(),
        },
        None => "unknown".to_owned(),
    };
    let mut lines = vec![
        format!("by {actor}"),
        format!("reason {}", str_of(d, "reason").unwrap_or_default()),
        format!("state before {}", str_of(d, "state").unwrap_or_default()),
    ];
    lines.extend(more.iter().cloned());
    Mark::new(e.at, e.seq, Shape::Square, "operator")
        .label(&format!("operator: {what}"))
        .title(&format!("operator action: {what}"), &lines)
}

/// The outcome row's marks, from the task's records: cancellation,
/// delivery and its acknowledgment, failure.
pub(super) fn outcome_marks(task: &Task, events: &[&Event]) -> Vec<Mark> {
    let mut marks = Vec::new();
    let seq_of = |kind: EventKind| {
        events
            .iter()
            .find(|e| e.kind == kind)
            .map_or(i64::MAX, |e| e.seq)
    };
    if let Some(c) = &task.cancellation {
        marks.push(
            Mark::new(
                c.requested_at,
                seq_of(EventKind::CancelRequested),
                Shape::Diamond,
                "cancel-requested",
            )
            .label("cancel requested")
            .title(
                "cancellation requested",
                &[format!("status now {}", c.status)],
            ),
        );
        if let Some(at) = c.confirmed_at {
            let fee = opt(c.fee);
            let (class, word, head, kind) = match c.status {
                CancelStatus::Confirmed => (
                    "cancel-confirmed",
                    format!("cancelled · fee {fee}"),
                    "cancellation confirmed: the task is cancelled",
                    EventKind::CancelConfirmed,
                ),
                _ => (
                    "cancel-too-late",
                    format!("cancel too late · fee {fee}"),
                    "cancellation too late: delivery won or the task had ended",
                    EventKind::CancelTooLate,
                ),
            };
            marks.push(
                Mark::new(at, seq_of(kind), Shape::Diamond, class)
                    .label(&word)
                    .title(
                        head,
                        &[
                            format!("fee {fee} (minor units)"),
                            format!("requested at {}", c.requested_at.to_rfc3339()),
                        ],
                    ),
            );
        }
    }
    if let Some(d) = &task.delivery {
        let mut lines = vec![format!("charge {} (minor units), charged once", d.charge)];
        if let Some(t) = &d.external_txn_id {
            lines.push(format!("external transaction id {t}"));
        }
        lines.push(format!("result {}", d.result));
        marks.push(
            Mark::new(
                d.delivered_at,
                seq_of(EventKind::Delivered),
                Shape::Square,
                "delivered",
            )
            .label(&format!("delivered · charge {}", d.charge))
            .title("delivered", &lines),
        );
        if let Some(at) = d.acknowledged_at {
            marks.push(
                Mark::new(
                    at,
                    seq_of(EventKind::DeliveryAcknowledged),
                    Shape::Dot,
                    "delivery-ack",
                )
                .label("delivery acknowledged")
                .title("the client acknowledged the delivery", &[]),
            );
        }
    }
    if let Some(f) = &task.failure {
        let failed = events
            .iter()
            .rev()
            .find(|e| e.kind == EventKind::TaskFailed);
        let at = failed
            .map(|e| e.at)
            .or(task.control.terminal_at)
            .unwrap_or(task.updated_at);
        marks.push(
            Mark::new(
                at,
                failed.map_or(i64::MAX, |e| e.seq),
                Shape::Triangle,
                "failed",
            )
            .label(&format!("failed: {}", f.class))
            .title(
                "task failed",
                &[
                    format!("failure class {}", f.class),
                    format!("message {}", f.message),
                ],
            ),
        );
    }
    marks
}

/// The idempotency key's end: when it expires (a terminal task whose key is
/// kept), or when the sweeper released it.
pub(super) struct KeyExpiry {
    pub(super) at: Timestamp,
    pub(super) word: &'static str,
    pub(super) class: &'static str,
    pub(super) key: String,
}

impl KeyExpiry {
    pub(super) fn title(&self) -> Vec<String> {
        let what = if self.class == "key-released" {
            "idempotency key released"
        } else {
            "idempotency key expires (a submit after it starts a new task)"
        };
        vec![
            format!("{what} at {}", self.at.to_rfc3339()),
            format!("idempotency key {}", self.key),
        ]
    }

    pub(super) fn mark(&self) -> Mark {
        let mut m = Mark::new(self.at, i64::MAX, Shape::Triangle, self.class).label(self.word);
        m.title = self.title();
        m
    }
}

pub(super) fn key_expiry(task: &Task, events: &[&Event]) -> Option<KeyExpiry> {
    let key = task.idempotency_key.clone();
    if let Some(e) = events
        .iter()
        .rev()
        .find(|e| e.kind == EventKind::KeyReleased)
    {
        return Some(KeyExpiry {
            at: e.at,
            word: "key released",
            class: "key-released",
            key,
        });
    }
    task.control.key_expires_at.map(|at| KeyExpiry {
        at,
        word: "key expires",
        class: "key-expiry",
        key,
    })
}

/// The outcome row's second gutter line.
pub(super) fn outcome_summary(task: &Task) -> String {
    if let Some(d) = &task.delivery {
        format!("delivered · charge {}", d.charge)
    } else if let Some(c) = &task.cancellation {
        format!("cancellation {}", c.status)
    } else if let Some(f) = &task.failure {
        format!("failed: {}", f.class)
    } else {
        "pending".to_owned()
    }
}
