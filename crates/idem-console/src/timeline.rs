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

use idem_core::model::{
    Attempt, AttemptKind, AttemptState, CancelStatus, Disposition, Event, EventKind, Evidence,
    EvidenceOutcome, Task, Timestamp,
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

// ---------------------------------------------------------------------------
// Time axis
// ---------------------------------------------------------------------------

/// Maps epoch ms `t0..=t1` onto x `x0..=x0 + PLOT_W`.
#[derive(Debug, Clone, Copy)]
struct Scale {
    t0: i64,
    t1: i64,
    x0: f64,
}

impl Scale {
    fn new((t0, t1): (i64, i64)) -> Scale {
        Scale {
            t0,
            t1: t1.max(t0.saturating_add(1)),
            x0: GUTTER_W,
        }
    }

    /// The axis's right end, px.
    fn x1(&self) -> f64 {
        self.x0 + PLOT_W
    }

    /// The x of epoch ms `t`, clamped to the axis.
    fn x(&self, t: i64) -> f64 {
        let span = (self.t1 - self.t0) as f64;
        let f = ((t - self.t0) as f64 / span).clamp(0.0, 1.0);
        self.x0 + f * PLOT_W
    }
}

/// The axis's span, epoch ms: from the task's acceptance to the latest
/// instant of its story (events, evidence, lease ends of ended attempts,
/// delivery and cancellation), and for a live task to `now` and its live
/// leases' ends. The key's release and expiry lie outside (they come a
/// retention period later and would squeeze the story into a corner).
fn axis_span(
    task: &Task,
    attempts: &[&Attempt],
    events: &[&Event],
    now: Timestamp,
    live: bool,
) -> (i64, i64) {
    let t0 = task.created_at.0;
    let mut t1 = task.updated_at.0;
    for e in events {
        if e.kind != EventKind::KeyReleased {
            t1 = t1.max(e.at.0);
        }
    }
    for a in attempts {
        t1 = t1.max(a.leased_at.0);
        for ev in &a.evidence {
            t1 = t1.max(ev.received_at.0);
        }
        if live && a.state.is_active() {
            t1 = t1.max(a.lease_expires_at.0);
        }
    }
    if let Some(c) = &task.cancellation {
        t1 = t1
            .max(c.requested_at.0)
            .max(c.confirmed_at.map_or(0, |t| t.0));
    }
    if let Some(d) = &task.delivery {
        t1 = t1.max(d.delivered_at.0);
        t1 = t1.max(d.acknowledged_at.map_or(0, |t| t.0));
    }
    if live {
        t1 = t1.max(now.0);
    }
    (t0, t1)
}

/// Tick instants and how to label them.
struct Ticks {
    at: Vec<i64>,
    format: Clock,
    /// Whether labels carry the date (the span crosses a UTC day).
    dated: bool,
}

impl Ticks {
    fn label(&self, t: i64) -> String {
        let time = clock(Timestamp(t), self.format);
        match self.format {
            Clock::Date => time,
            _ if self.dated => format!("{} {time}", month_day(t)),
            _ => time,
        }
    }
}

/// Tick steps, ms: round numbers of ms, seconds, minutes, hours and days.
const STEPS: &[i64] = &[
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1_000,
    2_000,
    5_000,
    10_000,
    15_000,
    30_000,
    60_000,
    120_000,
    300_000,
    600_000,
    900_000,
    1_800_000,
    3_600_000,
    7_200_000,
    10_800_000,
    21_600_000,
    43_200_000,
    86_400_000,
    172_800_000,
    604_800_000,
];

/// Ticks on whole multiples of a round step (UTC-aligned, as epoch ms
/// are), as many as fit their labels: at most [`MAX_TICKS`], each label
/// with room around it.
fn ticks(scale: &Scale) -> Ticks {
    let span = scale.t1 - scale.t0;
    let crosses_day = scale.t0.div_euclid(86_400_000) != scale.t1.div_euclid(86_400_000);
    let mut chosen = None;
    for &step in STEPS {
        let format = Clock::for_step(step);
        let dated = crosses_day && format != Clock::Date;
        let chars = format.chars() + if dated { 6 } else { 0 };
        let room = chars as f64 * CHAR_W + 24.0;
        let fit = ((PLOT_W / room) as usize).clamp(2, MAX_TICKS);
        if span / step < fit as i64 {
            chosen = Some((step, format, dated));
            break;
        }
    }
    let (step, format, dated) = chosen.unwrap_or_else(|| {
        let day = 86_400_000;
        let days = (span / day / (MAX_TICKS as i64 - 1)).max(1);
        (days * day, Clock::Date, false)
    });
    let first = scale
        .t0
        .div_euclid(step)
        .saturating_add(1)
        .saturating_mul(step);
    let at = (0..=MAX_TICKS as i64)
        .map(|i| first.saturating_add(i.saturating_mul(step)))
        .filter(|t| *t < scale.t1)
        .collect();
    Ticks { at, format, dated }
}

/// How much of an instant a label shows (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Clock {
    /// `HH:MM:SS.mmm`
    Millis,
    /// `HH:MM:SS`
    Seconds,
    /// `HH:MM`
    Minutes,
    /// `YYYY-MM-DD`
    Date,
}

impl Clock {
    fn for_step(step: i64) -> Clock {
        if step < 1_000 {
            Clock::Millis
        } else if step < 60_000 {
            Clock::Seconds
        } else if step < 86_400_000 {
            Clock::Minutes
        } else {
            Clock::Date
        }
    }

    fn chars(self) -> usize {
        match self {
            Clock::Millis => 12,
            Clock::Seconds => 8,
            Clock::Minutes => 5,
            Clock::Date => 10,
        }
    }
}

/// Part of `t`'s RFC 3339 text (`YYYY-MM-DDTHH:MM:SS.mmmZ`), or the whole
/// text for an instant outside years 0000–9999.
fn clock(t: Timestamp, c: Clock) -> String {
    let range = match c {
        Clock::Millis => 11..23,
        Clock::Seconds => 11..19,
        Clock::Minutes => 11..16,
        Clock::Date => 0..10,
    };
    rfc3339_part(t, range)
}

fn rfc3339_part(t: Timestamp, range: std::ops::Range<usize>) -> String {
    let s = t.to_rfc3339();
    match s.get(range) {
        Some(part) if s.len() == 24 => part.to_owned(),
        _ => s,
    }
}

/// `YYYY-MM-DD` of epoch ms `t`.
fn date(t: i64) -> String {
    clock(Timestamp(t), Clock::Date)
}

/// `MM-DD` of epoch ms `t`.
fn month_day(t: i64) -> String {
    rfc3339_part(Timestamp(t), 5..10)
}

/// A duration in words: `850 ms`, `12.5 s`, `4 min 10 s`, `3 h 5 min`, `2 d 4 h`.
fn duration(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1_000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        let tenths = ms / 100;
        if tenths % 10 == 0 {
            format!("{} s", tenths / 10)
        } else {
            format!("{}.{} s", tenths / 10, tenths % 10)
        }
    } else if ms < 3_600_000 {
        format!("{} min {} s", ms / 60_000, ms % 60_000 / 1_000)
    } else if ms < 86_400_000 {
        format!("{} h {} min", ms / 3_600_000, ms % 3_600_000 / 60_000)
    } else {
        format!("{} d {} h", ms / 86_400_000, ms % 86_400_000 / 3_600_000)
    }
}

// ---------------------------------------------------------------------------
// Marks and their placement
// ---------------------------------------------------------------------------

/// The glyph of a mark, centred on its x and the row's bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// A dot of radius 5 (3 for a minor mark).
    Dot,
    /// A 10 px square.
    Square,
    /// A diamond 12 px across.
    Diamond,
    /// A downward triangle 12 px across.
    Triangle,
    /// A hollow ring of radius 6 (stale evidence).
    Ring,
}

/// One thing that happened at one instant, as drawn on a row.
#[derive(Debug, Clone)]
struct Mark {
    /// When, epoch ms.
    at: Timestamp,
    /// Tie-break among marks of one instant (event `seq`, evidence index).
    order: i64,
    shape: Shape,
    /// Classes besides `marker` (e.g. `report outcome-unknown`, `stale`).
    class: String,
    /// Text drawn next to it (at most [`LABEL_CHARS`] characters); `None`
    /// for a minor mark.
    label: Option<String>,
    /// Whether the label may be left out when marks crowd (heartbeats,
    /// retries, reconciliation required); other labels always show.
    optional: bool,
    /// The tooltip's lines: kind and exact time, then every value,
    /// untruncated (drawn by [`Lines`]).
    title: Vec<String>,
}

impl Mark {
    fn new(at: Timestamp, order: i64, shape: Shape, class: impl Into<String>) -> Mark {
        Mark {
            at,
            order,
            shape,
            class: class.into(),
            label: None,
            optional: false,
            title: Vec::new(),
        }
    }

    /// Lets [`Row::place`] leave the label out when marks crowd.
    fn optional(mut self) -> Mark {
        self.optional = true;
        self
    }

    fn label(mut self, text: &str) -> Mark {
        self.label = Some(truncate(&visible(text), LABEL_CHARS));
        self
    }

    /// The tooltip: `head` and the exact time on the first line, then `lines`.
    fn title(mut self, head: &str, lines: &[String]) -> Mark {
        let mut t = vec![format!("{head} at {}", self.at.to_rfc3339())];
        t.extend(lines.iter().filter(|l| !l.is_empty()).cloned());
        self.title = t;
        self
    }
}

/// A mark's place: the x of its glyph, whether its label is drawn, the
/// centre of its label, the label line (0 above the bar, 1 below).
#[derive(Debug, Clone, Copy)]
struct Spot {
    x: f64,
    labelled: bool,
    label_x: f64,
    line: usize,
}

/// A row's marks in time order with their places, and the rightmost px any
/// of them reaches.
struct Row {
    marks: Vec<(Mark, Spot)>,
    extent: f64,
}

impl Row {
    /// Places `marks` left to right at their instant's x. A labelled mark
    /// is pushed right as little as keeps it [`MIN_GAP`] after the previous
    /// mark and its label clear of the previous label on its line; the label
    /// goes to whichever of the two lines needs the smaller push (the other
    /// one on a tie, so neighbours alternate). An optional label that would
    /// move its mark more than [`MAX_DRIFT`] is left out; an unlabelled mark
    /// keeps [`MINOR_GAP`] from the previous one only within that drift.
    fn place(mut marks: Vec<Mark>, scale: &Scale) -> Row {
        marks.sort_by_key(|m| (m.at, m.order));
        let mut out = Vec::with_capacity(marks.len());
        let mut prev: Option<f64> = None;
        let mut line_end = [f64::NEG_INFINITY; 2];
        let mut last_line = 1;
        let mut extent = scale.x0;
        for m in marks {
            let at = scale.x(m.at.0);
            let labelled = m.label.as_deref().and_then(|label| {
                let x = prev.map_or(at, |p| at.max(p + MIN_GAP));
                let half = label_width(label) / 2.0;
                let push = |line: usize| (line_end[line] + LABEL_PAD + half - x).max(0.0);
                let other = 1 - last_line;
                let line = if push(last_line) < push(other) {
                    last_line
                } else {
                    other
                };
                let x = x + push(line);
                (!m.optional || x - at <= MAX_DRIFT).then(|| {
                    let label_x = x.max(scale.x0 + half);
                    Spot {
                        x,
                        labelled: true,
                        label_x,
                        line,
                    }
                })
            });
            let spot = match labelled {
                Some(spot) => {
                    let half = m.label.as_deref().map_or(0.0, label_width) / 2.0;
                    line_end[spot.line] = spot.label_x + half;
                    last_line = spot.line;
                    extent = extent.max(spot.label_x + half);
                    spot
                }
                None => {
                    let x = prev.map_or(at, |p| at.max(p + MINOR_GAP));
                    let x = if x - at <= MAX_DRIFT { x } else { at };
                    Spot {
                        x,
                        labelled: false,
                        label_x: x,
                        line: 0,
                    }
                }
            };
            extent = extent.max(spot.x + 8.0);
            prev = Some(prev.map_or(spot.x, |p| p.max(spot.x)));
            out.push((m, spot));
        }
        Row { marks: out, extent }
    }
}

/// Estimated width of `label` drawn at 11 px, px.
fn label_width(label: &str) -> f64 {
    label.chars().count() as f64 * CHAR_W
}

/// `s` cut to `max` characters, the cut marked with `…`.
fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// The `points` of a downward triangle centred on `(x, y)`.
fn triangle(x: f64, y: f64) -> String {
    format!(
        "{},{} {},{} {},{}",
        n(x - 6.0),
        n(y - 5.0),
        n(x + 6.0),
        n(y - 5.0),
        n(x),
        n(y + 6.0)
    )
}

/// One mark's markup on a row whose top is `y`.
fn marker(m: &Mark, s: &Spot, y: f64) -> Markup {
    let cy = y + 31.0;
    let minor = !s.labelled;
    let label_y = if s.line == 0 { y + 18.0 } else { y + 51.0 };
    html! {
        g class=(format!("marker {}", m.class)) data-at=(m.at.0) {
            title { (Lines(&m.title)) }
            @match m.shape {
                Shape::Dot => circle cx=(n(s.x)) cy=(n(cy)) r=(if minor { "3" } else { "5" }) {},
                Shape::Square => rect x=(n(s.x - 5.0)) y=(n(cy - 5.0)) width="10" height="10" {},
                Shape::Diamond => polygon points=(format!("{},{} {},{} {},{} {},{}",
                    n(s.x), n(cy - 6.0), n(s.x + 6.0), n(cy), n(s.x), n(cy + 6.0), n(s.x - 6.0), n(cy))) {},
                Shape::Triangle => polygon points=(triangle(s.x, cy)) {},
                Shape::Ring => circle cx=(n(s.x)) cy=(n(cy)) r="6" {},
            }
            @if let Some(label) = m.label.as_ref().filter(|_| s.labelled) {
                text x=(n(s.label_x)) y=(n(label_y)) text-anchor="middle" { (label) }
            }
        }
    }
}

/// A row that is not an attempt (task, outcome), its top at `y`:
/// background, gutter lines, marks.
fn row_g(class: &str, y: f64, gutter: &[String], row: &Row) -> Markup {
    html! {
        g class=(format!("row {class}")) {
            rect class="lane-bg" x="0" y=(n(y)) width="100%" height=(n(LANE_H)) {}
            (gutter_text(gutter, y))
            line class="track" x1=(n(GUTTER_W)) x2=(n(GUTTER_W + PLOT_W)) y1=(n(y + 31.0)) y2=(n(y + 31.0)) {}
            @for (m, s) in &row.marks { (marker(m, s, y)) }
        }
    }
}

/// Up to three gutter lines: a heading and two details.
fn gutter_text(lines: &[String], y: f64) -> Markup {
    html! {
        @for (i, l) in lines.iter().enumerate().filter(|(_, l)| !l.is_empty()) {
            text class=(if i == 0 { "gutter-head" } else { "gutter-sub" })
                x="8" y=(n(y + 17.0 + 15.0 * i as f64)) {
                @let shown = visible(l);
                @if shown.chars().count() > GUTTER_CHARS { title { (l) } }
                (truncate(&shown, GUTTER_CHARS))
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Attempt lanes
// ---------------------------------------------------------------------------

/// One attempt's lane, its top at `y`.
fn lane(a: &Attempt, row: &Row, y: f64, alt: bool, scale: &Scale, live: bool) -> Markup {
    let (end, end_word) = lease_end(a, live);
    let x_from = scale.x(a.leased_at.0);
    let x_to = scale.x(end.0).max(x_from + 2.0);
    let open = live && a.state.is_active();
    let bar_class = format!(
        "lease state-{}{}",
        slug(a.state.as_str()),
        if open { " live" } else { "" }
    );
    let lease_title = [
        format!(
            "lease of attempt {} (generation {}, {})",
            a.number, a.generation, a.kind
        ),
        format!(
            "claimed at {} by executor {}",
            a.leased_at.to_rfc3339(),
            a.executor_id
        ),
        format!(
            "{end_word} at {} ({})",
            end.to_rfc3339(),
            duration(end.0 - a.leased_at.0)
        ),
        format!("lease length {} per heartbeat", duration(a.lease_ms)),
    ];
    let stale = a
        .evidence
        .iter()
        .filter(|e| e.disposition == Disposition::StaleGeneration)
        .count();
    let mut detail = format!("{} · usage {}", state_word(a.state), a.usage);
    if stale > 0 {
        detail.push_str(&format!(" · {stale} stale"));
    }
    let gutter = [
        format!("#{} {} · gen {}", a.number, a.kind, a.generation),
        format!("executor {}", a.executor_id),
        detail,
    ];
    html! {
        g class=(format!("lane kind-{}", a.kind)) data-attempt-id=(a.id) data-number=(a.number)
            data-generation=(a.generation) data-kind=(a.kind.as_str()) data-state=(a.state.as_str())
        {
            rect class=(if alt { "lane-bg alt" } else { "lane-bg" }) x="0" y=(n(y))
                width="100%" height=(n(LANE_H)) {}
            (gutter_text(&gutter, y))
            line class="track" x1=(n(GUTTER_W)) x2=(n(GUTTER_W + PLOT_W))
                y1=(n(y + 31.0)) y2=(n(y + 31.0)) {}
            rect class=(bar_class) x=(n(x_from)) y=(n(y + 26.0)) width=(n(x_to - x_from))
                height="10" rx="2" {
                title { (Lines(&lease_title)) }
            }
            @for (m, s) in &row.marks { (marker(m, s, y)) }
        }
    }
}

/// Where an attempt's lease bar ends and what ended it: a live lease at its
/// expiry; else the applied report, or the lease's end (expiry, or the
/// instant an operator or a cancellation retired it).
fn lease_end(a: &Attempt, live: bool) -> (Timestamp, &'static str) {
    if a.state.is_active() {
        return (
            a.lease_expires_at,
            if live { "lease expires" } else { "lease ended" },
        );
    }
    let applied = a
        .evidence
        .iter()
        .find(|e| e.disposition == Disposition::Applied && e.outcome != EvidenceOutcome::Ack);
    match applied {
        Some(e) if e.received_at <= a.lease_expires_at => (e.received_at, "reported"),
        _ => (a.lease_expires_at, "lease ended"),
    }
}

/// The marks of one attempt's lane: its evidence (reports, acknowledgments,
/// repeats, duplicates, stale evidence) and its events (heartbeats that
/// raised usage, lease expiry).
fn attempt_marks(a: &Attempt, events: &[&Event]) -> Vec<Mark> {
    let mut marks: Vec<Mark> = a
        .evidence
        .iter()
        .enumerate()
        .map(|(i, e)| evidence_mark(a, e, i as i64))
        .collect();
    let id = a.id.to_string();
    let mine: Vec<&&Event> = events
        .iter()
        .filter(|e| str_of(&e.data, "attempt_id").is_some_and(|s| s == id))
        .collect();
    let heartbeats = mine
        .iter()
        .filter(|e| e.kind == EventKind::UsageRecorded)
        .count();
    let mut beat = 0;
    for e in mine {
        match e.kind {
            EventKind::UsageRecorded => {
                beat += 1;
                let usage = int_of(&e.data, "usage");
                let labelled = heartbeats <= LABELLED_HEARTBEATS || beat == heartbeats;
                let mut m = Mark::new(e.at, e.seq, Shape::Dot, "heartbeat").title(
                    "heartbeat",
                    &[
                        format!("attempt usage {}", opt(usage)),
                        format!("task usage {}", opt(int_of(&e.data, "task_usage"))),
                        format!("generation {}", opt(int_of(&e.data, "generation"))),
                    ],
                );
                if labelled {
                    m = m.label(&format!("usage {}", opt(usage))).optional();
                }
                marks.push(m);
            }
            EventKind::LeaseExpired => {
                let ended = str_of(&e.data, "lease_expires_at").unwrap_or_default();
                marks.push(
                    Mark::new(e.at, e.seq, Shape::Triangle, "expired")
                        .label("lease expired")
                        .title(
                            "lease expired without a report",
                            &[
                                format!("lease end {ended}"),
                                format!("generation {}", a.generation),
                            ],
                        ),
                );
            }
            EventKind::AttemptReleased => {
                marks.push(
                    Mark::new(e.at, e.seq, Shape::Triangle, "expired")
                        .label("released")
                        .title(
                            "released by its executor before it started",
                            &[format!("generation {}", a.generation)],
                        ),
                );
            }
            _ => {}
        }
    }
    marks
}

/// The mark of one piece of evidence; index `i` orders marks of one instant.
fn evidence_mark(a: &Attempt, e: &Evidence, i: i64) -> Mark {
    let outcome = e.outcome.as_str();
    let body = &e.body;
    let class_of_failure = str_of(body, "failure_class");
    let mut details = vec![
        format!("generation presented {}", e.generation),
        format!("outcome {outcome}"),
    ];
    if let Some(c) = &class_of_failure {
        details.push(format!("failure class {c}"));
    }
    if let Some(m) = str_of(body, "message") {
        details.push(format!("message {m}"));
    }
    if let Some(u) = int_of(body, "usage") {
        details.push(format!("usage {u}"));
    }
    if let Some(t) = str_of(body, "external_txn_id") {
        details.push(format!("external transaction id {t}"));
    }
    if let Some(r) = body.get("result") {
        details.push(format!("result {r}"));
    }
    details.push(format!("disposition {}", e.disposition));
    let order = 1_000_000 + i;
    match (e.disposition, e.outcome) {
        (Disposition::StaleGeneration, _) => {
            details.insert(
                0,
                format!(
                    "kept as evidence, nothing changed: attempt {} holds generation {}, its lease ended at {}",
                    a.number,
                    a.generation,
                    a.lease_expires_at.to_rfc3339()
                ),
            );
            let what = if e.outcome == EvidenceOutcome::Ack {
                "stale ack".to_owned()
            } else {
                format!("stale {outcome}")
            };
            Mark::new(e.received_at, order, Shape::Ring, "stale")
                .label(&what)
                .title("stale evidence", &details)
        }
        (Disposition::Applied, EvidenceOutcome::Ack) => {
            Mark::new(e.received_at, order, Shape::Diamond, "ack")
                .label("ack")
                .title("command acknowledged", &details)
        }
        (Disposition::Applied, _) => {
            let word = match &class_of_failure {
                Some(c) => format!("{outcome}: {c}"),
                None => outcome.to_owned(),
            };
            Mark::new(
                e.received_at,
                order,
                Shape::Square,
                format!("report outcome-{}", slug(outcome)),
            )
            .label(&word)
            .title("report", &details)
        }
        (Disposition::Repeat, _) => {
            Mark::new(e.received_at, order, Shape::Dot, "repeat").title("exact repeat", &details)
        }
        (Disposition::AlreadyReported, _) => {
            Mark::new(e.received_at, order, Shape::Square, "duplicate")
                .label(&format!("duplicate {outcome}"))
                .title(
                    "different report after the attempt's outcome; nothing changed",
                    &details,
                )
        }
    }
}

// ---------------------------------------------------------------------------
// Task and outcome rows
// ---------------------------------------------------------------------------

/// The task row's marks: acceptance, retries, reconciliation, wake-ups,
/// operator actions.
fn task_marks(events: &[&Event]) -> Vec<Mark> {
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
fn ready_at(d: &Value) -> String {
    str_of(d, "ready_at").map_or_else(String::new, |t| format!("claimable from {t}"))
}

/// An operator action's mark: actor and reason in the title.
fn operator(e: &Event, what: &str, more: &[String]) -> Mark {
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
fn outcome_marks(task: &Task, events: &[&Event]) -> Vec<Mark> {
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
struct KeyExpiry {
    at: Timestamp,
    word: &'static str,
    class: &'static str,
    key: String,
}

impl KeyExpiry {
    fn title(&self) -> Vec<String> {
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

    fn mark(&self) -> Mark {
        let mut m = Mark::new(self.at, i64::MAX, Shape::Triangle, self.class).label(self.word);
        m.title = self.title();
        m
    }
}

fn key_expiry(task: &Task, events: &[&Event]) -> Option<KeyExpiry> {
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
fn outcome_summary(task: &Task) -> String {
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

// ---------------------------------------------------------------------------
// The description
// ---------------------------------------------------------------------------

/// The story in words, e.g. `3 attempts: attempt 1 generation 1 execute
/// reported unknown; attempt 2 generation 2 reconcile lease expired; …
/// Delivered, charge 500. State succeeded.`
fn describe(task: &Task, attempts: &[&Attempt], events: &[&Event]) -> String {
    let mut parts = Vec::new();
    let count = attempts.len();
    parts.push(match count {
        0 => "No attempts yet".to_owned(),
        1 => "1 attempt".to_owned(),
        _ => format!("{count} attempts"),
    });
    let named = if count > DESC_ATTEMPTS {
        let (earlier, last) = attempts.split_at(count - (DESC_ATTEMPTS - 1));
        let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
        for a in earlier {
            *by_state.entry(state_phrase(a.state)).or_default() += 1;
        }
        let counts: Vec<String> = by_state.iter().map(|(s, c)| format!("{c} {s}")).collect();
        parts.push(format!(
            "attempts 1 to {}: {}",
            earlier.len(),
            counts.join(", ")
        ));
        last
    } else {
        attempts
    };
    for a in named {
        let mut s = format!(
            "attempt {} generation {} {} {}",
            a.number,
            a.generation,
            a.kind,
            state_phrase(a.state)
        );
        if a.kind == AttemptKind::Execute
            && let Some(c) = a
                .report
                .as_ref()
                .and_then(|r| str_of(&r.body, "failure_class"))
        {
            s.push_str(&format!(" ({c})"));
        }
        parts.push(s);
    }
    let stale: Vec<String> = attempts
        .iter()
        .flat_map(|a| {
            a.evidence
                .iter()
                .filter(|e| e.disposition == Disposition::StaleGeneration)
                .map(move |e| {
                    format!(
                        "stale {} from attempt {} generation {}",
                        e.outcome, a.number, e.generation
                    )
                })
        })
        .collect();
    match stale.len() {
        0 => {}
        1..=3 => parts.push(format!("stale evidence kept: {}", stale.join(", "))),
        k => parts.push(format!("{k} pieces of stale evidence kept")),
    }
    for e in events {
        if e.kind == EventKind::OperatorResolved {
            parts.push(format!(
                "resolved {} by an operator",
                str_of(&e.data, "outcome").unwrap_or_default()
            ));
        }
    }
    if let Some(c) = &task.cancellation {
        parts.push(match c.status {
            CancelStatus::Requested => "cancellation requested".to_owned(),
            CancelStatus::Confirmed => format!("cancelled, fee {}", opt(c.fee)),
            CancelStatus::TooLate => format!("cancellation too late, fee {}", opt(c.fee)),
        });
    }
    if let Some(d) = &task.delivery {
        let mut s = format!("delivered, charge {}", d.charge);
        if d.acknowledged_at.is_some() {
            s.push_str(", acknowledged");
        }
        parts.push(s);
    }
    if let Some(f) = &task.failure {
        parts.push(format!("failed: {}", f.class));
    }
    format!(
        "Task {} ({}), state {}. {}.",
        task.idempotency_key,
        task.operation,
        task.state,
        parts.join("; ")
    )
}

/// An attempt's state as the description says it.
fn state_phrase(s: AttemptState) -> &'static str {
    match s {
        AttemptState::Leased => "holds the lease",
        AttemptState::Acknowledged => "acknowledged by the device",
        AttemptState::Succeeded => "reported succeeded",
        AttemptState::Failed => "reported failed",
        AttemptState::Unknown => "reported unknown",
        AttemptState::Expired => "lease expired",
        AttemptState::Cancelled => "cancelled",
        AttemptState::Committed => "reconciled committed",
        AttemptState::NotCommitted => "reconciled not committed",
        AttemptState::Released => "released unstarted by its executor",
    }
}

/// An attempt's state for its gutter line.
fn state_word(s: AttemptState) -> String {
    s.as_str().replace('_', " ")
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

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

/// An optional number, `-` when absent.
fn opt(v: Option<i64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// A word as a class name part (`not_committed` → `not-committed`).
fn slug(word: &str) -> String {
    word.replace('_', "-")
}

#[cfg(test)]
mod tests;
