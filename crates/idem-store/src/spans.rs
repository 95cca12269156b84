//! idem's own trace spans (SPEC §5 "Tracing", docs/operations.md
//! "Tracing"): what they are, and the one switch that turns them on.
//!
//! Three kinds, all emitted under the `tracing` target [`TARGET`]:
//! - **request**: one per HTTP request (`idem-http`), named `METHOD ROUTE`,
//!   with its method, route and status; its parent is the request's W3C
//!   `traceparent` when it carries a valid one.
//! - **store**: one per store operation run for a request ([`Store`]'s every
//!   method; `db.operation.name` is the operation, e.g. `Submit`,
//!   `db.system.name` the store kind), a child of the request's span, from
//!   the call until the committed answer. Operations no request waits for
//!   (the sweeper's) have none.
//! - **attempt**: one per attempt, from its lease (`leased_at`) to its end
//!   (the report that ended it, the sweep that expired it, or the
//!   resolution that fenced it off), emitted once the transaction that ended
//!   it has committed ([`attempts_ended`]), with the task's stored
//!   `traceparent` as its parent: a submit with a `traceparent` and its
//!   attempts share one trace id.
//!
//! Nothing is built unless a subscriber enables [`TARGET`] ([`enabled`]):
//! `idem serve` enables it only when it exports spans over OTLP
//! (`IDEM_OTLP_ENDPOINT`), and then sets the OpenTelemetry global tracer
//! provider the attempt spans go to; without it a span costs one cached
//! callsite check.
//!
//! [`Store`]: crate::Store

use std::time::{Duration, SystemTime};

use idem_core::model::{Attempt, AttemptKind, AttemptState, Task, Timestamp};
use idem_core::trace::TraceParent;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use uuid::Uuid;

/// The `tracing` target of idem's spans: a subscriber that enables it gets
/// them (the OTLP layer of `idem serve`); the log output never shows them.
pub const TARGET: &str = "idem::spans";

/// Whether a subscriber wants idem's spans (a cached callsite check).
pub fn enabled() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::INFO)
}

/// The remote parent a valid `traceparent` names, for a span that continues
/// the caller's trace.
pub fn remote_parent(tp: &TraceParent) -> Context {
    let (Ok(trace_id), Ok(span_id)) = (
        TraceId::from_hex(tp.trace_id()),
        SpanId::from_hex(tp.parent_id()),
    ) else {
        return Context::new();
    };
    Context::new().with_remote_span_context(SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(tp.flags()),
        true,
        TraceState::NONE,
    ))
}

/// Makes `span` a child of the caller's span named by `tp` (no effect on a
/// disabled span, or when no OpenTelemetry layer is installed).
pub fn set_remote_parent(span: &tracing::Span, tp: &TraceParent) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    // Refused only for a span already started or without an OpenTelemetry
    // layer: it then stays a root span.
    let _ = span.set_parent(remote_parent(tp));
}

/// The span of one store operation `O` on a store of `kind`, a child of the
/// current span; `None` when spans are off or no span is current (the
/// sweeper's calls).
pub(crate) fn store_span<O>(kind: &'static str) -> Option<tracing::Span> {
    if !enabled() || tracing::Span::current().is_none() {
        return None;
    }
    let full = std::any::type_name::<O>();
    let op = full.rsplit("::").next().unwrap_or(full);
    Some(tracing::info_span!(
        target: TARGET,
        "store",
        otel.name = %format_args!("store {op}"),
        otel.kind = "client",
        db.system.name = db_system(kind),
        db.operation.name = op,
    ))
}

/// The OpenTelemetry `db.system.name` of a store kind.
fn db_system(kind: &'static str) -> &'static str {
    match kind {
        "postgres" => "postgresql",
        other => other,
    }
}

/// An attempt that a committed transaction ended, as its span needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct EndedAttempt {
    /// Attempt id.
    pub id: Uuid,
    /// Its task.
    pub task_id: Uuid,
    /// The task's operation class.
    pub operation: String,
    /// The task's stored `traceparent`: the span's parent.
    pub traceparent: Option<TraceParent>,
    /// 1-based number within the task.
    pub number: i64,
    /// Fencing generation.
    pub generation: i64,
    /// `execute` or `reconcile`.
    pub kind: AttemptKind,
    /// How it ended (`succeeded`, `failed`, `expired` …).
    pub state: AttemptState,
    /// The executor that held it.
    pub executor_id: String,
    /// When it was leased (the span's start).
    pub leased_at: Timestamp,
    /// When it ended (the span's end).
    pub ended_at: Timestamp,
}

impl EndedAttempt {
    /// `attempt` of `task`, ended at `now`, when spans are on ([`enabled`])
    /// and this transition ended it (it held its lease before and holds it
    /// no more); else `None`, and nothing is copied.
    pub fn of(
        task: &Task,
        attempt: &Attempt,
        was_active: bool,
        now: Timestamp,
    ) -> Option<EndedAttempt> {
        if !was_active || attempt.state.is_active() || !enabled() {
            return None;
        }
        Some(EndedAttempt {
            id: attempt.id,
            task_id: task.id,
            operation: task.operation.clone(),
            traceparent: task.traceparent.clone(),
            number: attempt.number,
            generation: attempt.generation,
            kind: attempt.kind,
            state: attempt.state,
            executor_id: attempt.executor_id.clone(),
            leased_at: attempt.leased_at,
            ended_at: now,
        })
    }
}

/// An operation's reply with the attempts its transaction ended: the store
/// emits their spans ([`attempts_ended`]) once the transaction committed and
/// hands the reply on.
#[derive(Debug, Clone, PartialEq)]
pub struct Ending<R> {
    /// The operation's reply.
    pub reply: R,
    /// The attempts it ended (always empty while spans are off).
    pub ended: Vec<EndedAttempt>,
}

impl<R> Ending<R> {
    /// `reply` of a transaction that ended no attempt.
    pub fn only(reply: R) -> Ending<R> {
        Ending {
            reply,
            ended: Vec::new(),
        }
    }
}

/// Emits one attempt span per entry of `ended` (attempts of committed
/// transactions) to the OpenTelemetry global tracer provider: named
/// `KIND OPERATION` (e.g. `execute payment.release`), from `leased_at` to
/// `ended_at`, a child of the task's `traceparent` when it has one; status
/// error for a `failed` or `expired` attempt.
pub fn attempts_ended(ended: &[EndedAttempt]) {
    if ended.is_empty() {
        return;
    }
    let tracer = opentelemetry::global::tracer("idem");
    for e in ended {
        let parent = e
            .traceparent
            .as_ref()
            .map_or_else(Context::new, remote_parent);
        let mut span = tracer
            .span_builder(format!("{} {}", e.kind, e.operation))
            .with_kind(SpanKind::Internal)
            .with_start_time(system_time(e.leased_at))
            .with_attributes([
                KeyValue::new("idem.task.id", e.task_id.to_string()),
                KeyValue::new("idem.operation", e.operation.clone()),
                KeyValue::new("idem.attempt.id", e.id.to_string()),
                KeyValue::new("idem.attempt.number", e.number),
                KeyValue::new("idem.attempt.generation", e.generation),
                KeyValue::new("idem.attempt.kind", e.kind.as_str()),
                KeyValue::new("idem.attempt.state", e.state.as_str()),
                KeyValue::new("idem.executor.id", e.executor_id.clone()),
            ])
            .start_with_context(&tracer, &parent);
        if matches!(e.state, AttemptState::Failed | AttemptState::Expired) {
            span.set_status(Status::error(format!("attempt {}", e.state)));
        }
        span.end_with_timestamp(system_time(e.ended_at));
    }
}

/// A store timestamp (ms since the Unix epoch) as a `SystemTime`.
fn system_time(t: Timestamp) -> SystemTime {
    let ms = u64::try_from(t.ms()).unwrap_or_default();
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_traceparent_names_a_remote_sampled_parent() {
        let tp =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let cx = remote_parent(&tp);
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_id().to_string(), tp.trace_id());
        assert_eq!(sc.span_id().to_string(), tp.parent_id());
    }

    #[test]
    fn spans_are_off_without_a_subscriber_that_wants_them() {
        assert!(!enabled());
        assert!(store_span::<crate::ops::Submit>("sqlite").is_none());
    }
}
