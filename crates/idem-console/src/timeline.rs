//! The task timeline: a task's whole story drawn as one inline SVG picture
//! (docs/console.md, "Task page").
//!
//! Shape of the picture, top to bottom, all rows sharing one time axis:
//! - the **axis**: UTC tick labels from the task's acceptance to its last
//!   event (a live task: to `now`, or to its live lease's end when later),
//!   with a `now` line while the task is live;
//! - the **task** row: acceptance, retries, reconciliation required, task
//!   woken, operator actions;
//! - one **lane per attempt** (`g.lane[data-attempt-id][data-generation]
//!   [data-kind]`): number, kind, generation, executor and state in the left
//!   gutter; the lease window as a bar (claimed → report, lease end, or the
//!   live lease's expiry); heartbeats with usage, the device acknowledgment,
//!   the applied report (outcome, failure class), repeats, duplicates, lease
//!   expiry, and stale evidence (class `stale`, text "stale");
//! - the **outcome** row: cancellation requested / confirmed / too late with
//!   its fee, delivery with result, charge and acknowledgment, the failure,
//!   and the idempotency key's expiry (drawn past the axis's end, in a zone of
//!   its own, when it lies beyond the story).
//!
//! Every mark is a `g.marker` with a `<title>` child (the browser's native
//! tooltip) giving the exact RFC 3339 time and the full values; labels on the
//! picture are truncated to [`LABEL_CHARS`]. Marks that coincide are pushed
//! apart: two marks of one row are at least [`MIN_GAP`] px apart, and two
//! labels on one label line never overlap (each row has a line above and one
//! below its bar). The picture grows wider, never taller, when marks crowd:
//! each row is [`LANE_H`] px high whatever it holds.
//!
//! The markup has no `style=` attribute and no script (the console's
//! Content-Security-Policy forbids both): geometry is in presentation
//! attributes, colours by class in `static/timeline.css` (served as part of
//! `console.css`). Every text taken from the data is escaped by maud, and its
//! hidden characters are shown as escapes ([`crate::shown`]); a tooltip's lines
//! are separated by [`crate::shown::LINE_BREAK`].

use std::collections::BTreeMap;

use idem_core::machine::operator::Actor;
use idem_core::model::{
    Attempt, AttemptKind, AttemptState, CancelStatus, Disposition, Event, EventData, EventKind,
    Evidence, EvidenceOutcome, Task, TaskState, Timestamp,
};
use maud::{Markup, html};
use serde_json::Value;

use crate::shown::{Lines, visible};

/// Width of the left gutter holding the row labels, px.
const GUTTER_W: f64 = 220.0;
/// Width of the time axis, px (the picture grows past it when marks crowd).
const PLOT_W: f64 = 760.0;
/// Space after the last mark or the axis's end, px.
const RIGHT_PAD: f64 = 28.0;
/// Width of the zone past the axis that holds a key expiry beyond the story, px.
const KEY_ZONE_W: f64 = 240.0;
/// Height of the axis band at the top, px.
const AXIS_H: f64 = 40.0;
/// Height of every row (task, attempt, outcome), px.
pub const LANE_H: f64 = 56.0;
/// Height of the "no attempts yet" row, px.
const EMPTY_H: f64 = 30.0;
/// Space under the last row, px.
const BOTTOM_PAD: f64 = 8.0;
/// Least distance between two labelled (or otherwise major) marks of one row, px.
pub const MIN_GAP: f64 = 14.0;
/// Least distance before an unlabelled mark, px, kept only while it moves the
/// mark no more than [`MAX_DRIFT`] (unlabelled marks may overlap).
const MINOR_GAP: f64 = 4.0;
/// Furthest an unlabelled mark, or one whose label may be left out, is drawn
/// from its instant's x, px: an optional label that would push its mark
/// further is left out (the tooltip keeps it).
pub const MAX_DRIFT: f64 = 6.0;
/// Estimated advance of one character of an 11 px label, px.
const CHAR_W: f64 = 6.6;
/// Least space between two labels on one label line, px.
const LABEL_PAD: f64 = 8.0;
/// Most characters of a label drawn on the picture (the title keeps all).
pub const LABEL_CHARS: usize = 28;
/// Most characters of a gutter line.
const GUTTER_CHARS: usize = 31;
/// Heartbeats of one lane that get a usage label when there are more (the
/// last one always has one).
const LABELLED_HEARTBEATS: usize = 6;
/// Attempts the description names one by one; earlier ones are counted.
const DESC_ATTEMPTS: usize = 6;
/// Most tick labels on the axis.
const MAX_TICKS: usize = 12;

/// The task's timeline as an inline
/// `<svg class="timeline" role="img" aria-labelledby="timeline-title timeline-desc">`,
/// with `<title id="timeline-title">` and a `<desc id="timeline-desc">` that
/// tells the story in words.
///
/// - `task`: the task as the store reads it (`GetTask` / `TaskHistory`);
///   its control fields give the key expiry.
/// - `attempts`: its attempts with their evidence (`ListAttempts`), any order.
/// - `events`: its audit events (`ListEvents` / `TaskHistory`), any order.
/// - `now`: the current time (epoch ms, UTC); the axis of a live
///   (non-terminal) task runs to it.
///
/// Size, in CSS px (its `width`/`height` attributes and `viewBox` agree):
/// at least 1008 wide (220 gutter, 760 axis, 28 pad), wider when crowded
/// marks or a key expiry past the axis need room; `40 + (attempts + 2) ×`
/// [`LANE_H`] `+ 8` high (no attempts: a 30 px "No attempts yet" row in
/// their place). Wrap it in a horizontally scrolling container. The axis's
/// span is on the root as `data-axis-start` / `data-axis-end` (epoch ms).
pub fn svg(task: &Task, attempts: &[Attempt], events: &[Event], now: Timestamp) -> Markup {
    let mut events: Vec<&Event> = events.iter().collect();
    events.sort_by_key(|e| (e.seq, e.at));
    let mut attempts: Vec<&Attempt> = attempts.iter().collect();
    attempts.sort_by_key(|a| (a.number, a.generation));

    let live = !task.state.is_terminal();
    let key = key_expiry(task, &events);
    let scale = Scale::new(axis_span(task, &attempts, &events, now, live));
    let key_beyond = key.as_ref().is_some_and(|k| k.at.0 > scale.t1);

    let task_row = Row::place(task_marks(&events), &scale);
    let lanes: Vec<(&Attempt, Row)> = attempts
        .iter()
        .map(|a| (*a, Row::place(attempt_marks(a, &events), &scale)))
        .collect();
    let mut outcome = outcome_marks(task, &events);
    if let Some(k) = &key
        && !key_beyond
    {
        outcome.push(k.mark());
    }
    let outcome_row = Row::place(outcome, &scale);

    let extent = lanes
        .iter()
        .map(|(_, r)| r.extent)
        .chain([task_row.extent, outcome_row.extent, scale.x1()])
        .fold(0.0, f64::max);
    let key_x = extent + 24.0;
    let width = if key_beyond {
        key_x + KEY_ZONE_W
    } else {
        extent + RIGHT_PAD
    };
    let attempts_h = if attempts.is_empty() {
        EMPTY_H
    } else {
        LANE_H * attempts.len() as f64
    };
    let height = AXIS_H + 2.0 * LANE_H + attempts_h + BOTTOM_PAD;
    let rows_top = AXIS_H;
    let rows_bottom = height - BOTTOM_PAD;
    let outcome_y = AXIS_H + LANE_H + attempts_h;
    let ticks = ticks(&scale);

    html! {
        svg class="timeline" role="img" aria-labelledby="timeline-title timeline-desc"
            width=(n(width)) height=(n(height)) viewBox=(format!("0 0 {} {}", n(width), n(height)))
            data-axis-start=(scale.t0) data-axis-end=(scale.t1)
        {
            title id="timeline-title" { "Timeline of task " (task.idempotency_key) }
            desc id="timeline-desc" { (describe(task, &attempts, &events)) }
            rect class="backdrop" x="0" y="0" width=(n(width)) height=(n(height)) {}
            g class="axis" {
                text class="gutter-head" x="8" y="16" { "Time (UTC)" }
                text class="gutter-sub" x="8" y="31" { (date(scale.t0)) }
                @for t in &ticks.at {
                    line class="grid" x1=(n(scale.x(*t))) x2=(n(scale.x(*t)))
                        y1="22" y2=(n(rows_bottom)) {}
                    text class="tick" x=(n(scale.x(*t))) y="16" text-anchor="middle" {
                        title { (Timestamp(*t).to_rfc3339()) }
                        (ticks.label(*t))
                    }
                }
                line class="axis-line" x1=(n(scale.x0)) x2=(n(scale.x1()))
                    y1="22" y2="22" {}
            }
            (row_g("task-row", rows_top, &["Task".to_owned(),
                format!("{} · {}", task.operation, task.state),
                format!("generation {} · usage {}", task.generation, task.usage)], &task_row))
            @if attempts.is_empty() {
                g class="no-attempts" {
                    text class="gutter-sub" x="8" y=(n(AXIS_H + LANE_H + 19.0)) { "No attempts yet" }
                }
            }
            @for (i, (a, row)) in lanes.iter().enumerate() {
                (lane(a, row, AXIS_H + LANE_H * (i as f64 + 1.0), i % 2 == 1, &scale, live))
            }
            (row_g("outcome-row", outcome_y, &["Outcome".to_owned(),
                outcome_summary(task), String::new()], &outcome_row))
            @if live {
                g class="now" {
                    title { "now: " (now.to_rfc3339()) }
                    line x1=(n(scale.x(now.0))) x2=(n(scale.x(now.0)))
                        y1="22" y2=(n(rows_bottom)) {}
                    text x=(n(scale.x(now.0) + 3.0)) y="34" { "now" }
                }
            }
            @if let Some(k) = key.as_ref().filter(|_| key_beyond) {
                g class="key-zone" {
                    line class="zone-edge" x1=(n(key_x - 12.0)) x2=(n(key_x - 12.0))
                        y1="22" y2=(n(rows_bottom)) {}
                    g class=(format!("marker {}", k.class)) {
                        title { (Lines(&k.title())) }
                        polygon points=(triangle(key_x + 6.0, outcome_y + 27.0)) {}
                        text x=(n(key_x + 16.0)) y=(n(outcome_y + 31.0)) {
                            (k.word) " " (date(k.at.0)) " " (clock(k.at, Clock::Minutes))
                        }
                    }
                }
            }
        }
    }
}

/// A number as an SVG coordinate: at most one decimal.
fn n(v: f64) -> String {
    let r = (v * 10.0).round() / 10.0;
    if r.fract() == 0.0 {
        format!("{r:.0}")
    } else {
        format!("{r:.1}")
    }
}

// Small helpers, used by every part of the picture.

/// `v[key]` as text (a JSON string as is, any other value as JSON).
fn str_of(v: &Value, key: &str) -> Option<String> {
    match v.get(key)? {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

fn int_of(v: &Value, key: &str) -> Option<i64> {
    v.get(key).and_then(Value::as_i64)
}

/// `minor` minor units in `task`'s frozen currency ([`crate::html::money`]).
fn money(task: &Task, minor: i64) -> String {
    crate::html::money(task, minor)
}

/// An optional amount of `task`'s money, `-` when absent.
fn opt_money(task: &Task, minor: Option<i64>) -> String {
    minor.map_or_else(|| "-".to_owned(), |m| money(task, m))
}

/// A word as a class name part (`not_committed` → `not-committed`).
fn slug(word: &str) -> String {
    word.replace('_', "-")
}

mod axis;
mod lanes;
mod marks;
mod prose;
mod rows;

use {axis::*, lanes::*, marks::*, prose::*, rows::*};

#[cfg(test)]
mod tests;
