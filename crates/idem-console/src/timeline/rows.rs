//! The task row (acceptance, retries, reconciliation, wake-ups, operator
//! actions) and the outcome row (cancellation, delivery, failure, key
//! expiry).

use super::*;

/// The task row's marks: acceptance, retries, reconciliation, wake-ups,
/// operator actions.
pub(super) fn task_marks(events: &[&Event]) -> Vec<Mark> {
    let mut marks = Vec::new();
    for e in events {
        let mark = |shape, class: &str| Mark::new(e.at, e.seq, shape, class);
        let m = match &e.data {
            EventData::TaskSubmitted(d) => mark(Shape::Dot, "submitted").label("accepted").title(
                "task accepted",
                &[
                    format!("idempotency key {}", d.idempotency_key),
                    format!("fingerprint {}", d.fingerprint),
                    format!("price {} (minor units)", d.price),
                ],
            ),
            EventData::RetryScheduled(d) => {
                let backoff = d.backoff_ms;
                let word = if backoff > 0 {
                    format!("retry in {}", duration(backoff))
                } else {
                    "retry".to_owned()
                };
                mark(Shape::Dot, "retry").label(&word).optional().title(
                    "another execute attempt may start",
                    &[
                        format!("reason {}", d.reason),
                        format!("backoff {}", duration(backoff)),
                        ready_at(d.ready_at),
                    ],
                )
            }
            EventData::ReconciliationRequired(d) => mark(Shape::Diamond, "reconcile")
                .label("reconciliation required")
                .optional()
                .title(
                    "reconciliation required: only reconcile attempts run",
                    &[format!("reason {}", d.reason), ready_at(Some(d.ready_at))],
                ),
            EventData::TaskWoken(_) => mark(Shape::Dot, "woken").title("backoff over: queued", &[]),
            EventData::OperatorRetryNow(d) => {
                operator(e, (&d.actor, &d.reason, d.state), "retry now", &[])
            }
            EventData::OperatorCancel(d) => {
                operator(e, (&d.actor, &d.reason, d.state), "cancel", &[])
            }
            EventData::OperatorResolved(d) => {
                let outcome = d.outcome;
                let mut more = vec![format!("outcome {outcome}")];
                if let Some(t) = &d.external_txn_id {
                    more.push(format!("external transaction id {t}"));
                }
                if let Some(r) = d.retired_attempt_id {
                    more.push(format!("retired attempt {r}"));
                }
                more.push(format!("generation {}", d.generation));
                let by = (&d.actor, d.reason.as_str(), d.state);
                operator(e, by, &format!("resolved {outcome}"), &more)
            }
            EventData::OperatorRedriven(d) => operator(
                e,
                (&d.actor, &d.reason, d.state),
                "redrive",
                &[format!("execute limit {}", d.execute_limit)],
            ),
            _ => continue,
        };
        marks.push(m);
    }
    marks
}

/// `claimable from …` of an event that names when the task may be claimed
/// again (empty when it does not).
pub(super) fn ready_at(at: Option<Timestamp>) -> String {
    at.map_or_else(String::new, |t| {
        format!("claimable from {}", t.to_rfc3339())
    })
}

/// An operator action's mark: who acted, why, and the task's state before it
/// in the title.
pub(super) fn operator(
    e: &Event,
    (actor, reason, state): (&Actor, &str, TaskState),
    what: &str,
    more: &[String],
) -> Mark {
    let actor = match actor {
        Actor::ApiKey(id) => format!("admin key {id}"),
        Actor::Cli { user } => format!("command line user {user}"),
    };
    let mut lines = vec![
        format!("by {actor}"),
        format!("reason {reason}"),
        format!("state before {state}"),
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
            // A cancellation that lost to delivery has the delivery's charge
            // as its fee: the same money, drawn once (beside `delivered`).
            let same_charge = c.status == CancelStatus::TooLate
                && task
                    .delivery
                    .as_ref()
                    .is_some_and(|d| Some(d.charge) == c.fee);
            let fee = c.fee.map_or_else(|| "-".to_owned(), |f| money(task, f));
            let fee_line = if same_charge {
                "fee: the delivery's charge, not a second charge".to_owned()
            } else {
                format!("fee {fee}")
            };
            let (class, word, head, kind) = match c.status {
                CancelStatus::Confirmed => (
                    "cancel-confirmed",
                    format!("cancelled · fee {fee}"),
                    "cancellation confirmed: the task is cancelled",
                    EventKind::CancelConfirmed,
                ),
                // At most LABEL_CHARS: the label is drawn whole.
                _ if same_charge => (
                    "cancel-too-late",
                    "too late: fee is the charge".to_owned(),
                    "cancellation too late: delivery won",
                    EventKind::CancelTooLate,
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
                            fee_line,
                            format!("requested at {}", c.requested_at.to_rfc3339()),
                        ],
                    ),
            );
        }
    }
    if let Some(d) = &task.delivery {
        let mut lines = vec![format!("charge {}, charged once", money(task, d.charge))];
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
            .label(&format!("delivered · charge {}", money(task, d.charge)))
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
        format!("delivered · charge {}", money(task, d.charge))
    } else if let Some(c) = &task.cancellation {
        format!("cancellation {}", c.status)
    } else if let Some(f) = &task.failure {
        format!("failed: {}", f.class)
    } else {
        "pending".to_owned()
    }
}
