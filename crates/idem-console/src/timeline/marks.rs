//! Marks and their placement: a mark's shape, label and tooltip, the rows
//! that push coinciding marks apart, and the SVG of a marker and a row.

use super::*;

/// The glyph of a mark, centred on its x and the row's bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
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
pub(super) struct Mark {
    /// When, epoch ms.
    pub(super) at: Timestamp,
    /// Tie-break among marks of one instant (event `seq`, evidence index).
    pub(super) order: i64,
    pub(super) shape: Shape,
    /// Classes besides `marker` (e.g. `report outcome-unknown`, `stale`).
    pub(super) class: String,
    /// Text drawn next to it (at most [`LABEL_CHARS`] characters); `None`
    /// for a minor mark.
    pub(super) label: Option<String>,
    /// Whether the label may be left out when marks crowd (heartbeats,
    /// retries, reconciliation required); other labels always show.
    pub(super) optional: bool,
    /// The tooltip's lines: kind and exact time, then every value,
    /// untruncated (drawn by [`Lines`]).
    pub(super) title: Vec<String>,
}

impl Mark {
    pub(super) fn new(at: Timestamp, order: i64, shape: Shape, class: impl Into<String>) -> Mark {
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
    pub(super) fn optional(mut self) -> Mark {
        self.optional = true;
        self
    }

    pub(super) fn label(mut self, text: &str) -> Mark {
        self.label = Some(truncate(&visible(text), LABEL_CHARS));
        self
    }

    /// The tooltip: `head` and the exact time on the first line, then `lines`.
    pub(super) fn title(mut self, head: &str, lines: &[String]) -> Mark {
        let mut t = vec![format!("{head} at {}", self.at.to_rfc3339())];
        t.extend(lines.iter().filter(|l| !l.is_empty()).cloned());
        self.title = t;
        self
    }
}

/// A mark's place: the x of its glyph, whether its label is drawn, the
/// centre of its label, the label line (0 above the bar, 1 below).
#[derive(Debug, Clone, Copy)]
pub(super) struct Spot {
    pub(super) x: f64,
    pub(super) labelled: bool,
    pub(super) label_x: f64,
    pub(super) line: usize,
}

/// A row's marks in time order with their places, and the rightmost px any
/// of them reaches.
pub(super) struct Row {
    pub(super) marks: Vec<(Mark, Spot)>,
    pub(super) extent: f64,
}

impl Row {
    /// Places `marks` left to right at their instant's x. A labelled mark
    /// is pushed right as little as keeps it [`MIN_GAP`] after the previous
    /// mark and its label clear of the previous label on its line; the label
    /// goes to whichever of the two lines needs the smaller push (the other
    /// one on a tie, so neighbours alternate). An optional label that would
    /// move its mark more than [`MAX_DRIFT`] is left out; an unlabelled mark
    /// keeps [`MINOR_GAP`] from the previous one only within that drift.
    pub(super) fn place(mut marks: Vec<Mark>, scale: &Scale) -> Row {
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
pub(super) fn label_width(label: &str) -> f64 {
    label.chars().count() as f64 * CHAR_W
}

/// `s` cut to `max` characters, the cut marked with `…`.
pub(super) fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// The `points` of a downward triangle centred on `(x, y)`.
pub(super) fn triangle(x: f64, y: f64) -> String {
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
pub(super) fn marker(m: &Mark, s: &Spot, y: f64) -> Markup {
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
pub(super) fn row_g(class: &str, y: f64, gutter: &[String], row: &Row) -> Markup {
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
pub(super) fn gutter_text(lines: &[String], y: f64) -> Markup {
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
