//! The time axis: the span a timeline covers, its scale, tick steps and
//! their labels, and how times and durations are written.

use super::*;

/// Maps epoch ms `t0..=t1` onto x `x0..=x0 + PLOT_W`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Scale {
    pub(super) t0: i64,
    pub(super) t1: i64,
    pub(super) x0: f64,
}

impl Scale {
    pub(super) fn new((t0, t1): (i64, i64)) -> Scale {
        Scale {
            t0,
            t1: t1.max(t0.saturating_add(1)),
            x0: GUTTER_W,
        }
    }

    /// The axis's right end, px.
    pub(super) fn x1(&self) -> f64 {
        self.x0 + PLOT_W
    }

    /// The x of epoch ms `t`, clamped to the axis.
    pub(super) fn x(&self, t: i64) -> f64 {
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
pub(super) fn axis_span(
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
pub(super) struct Ticks {
    pub(super) at: Vec<i64>,
    pub(super) format: Clock,
    /// Whether labels carry the date (the span crosses a UTC day).
    pub(super) dated: bool,
}

impl Ticks {
    pub(super) fn label(&self, t: i64) -> String {
        let time = clock(Timestamp(t), self.format);
        match self.format {
            Clock::Date => time,
            _ if self.dated => format!("{} {time}", month_day(t)),
            _ => time,
        }
    }
}

/// Tick steps, ms: round numbers of ms, seconds, minutes, hours and days.
pub(super) const STEPS: &[i64] = &[
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
pub(super) fn ticks(scale: &Scale) -> Ticks {
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
pub(super) enum Clock {
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
    pub(super) fn for_step(step: i64) -> Clock {
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

    pub(super) fn chars(self) -> usize {
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
pub(super) fn clock(t: Timestamp, c: Clock) -> String {
    let range = match c {
        Clock::Millis => 11..23,
        Clock::Seconds => 11..19,
        Clock::Minutes => 11..16,
        Clock::Date => 0..10,
    };
    rfc3339_part(t, range)
}

pub(super) fn rfc3339_part(t: Timestamp, range: std::ops::Range<usize>) -> String {
    let s = t.to_rfc3339();
    match s.get(range) {
        Some(part) if s.len() == 24 => part.to_owned(),
        _ => s,
    }
}

/// `YYYY-MM-DD` of epoch ms `t`.
pub(super) fn date(t: i64) -> String {
    clock(Timestamp(t), Clock::Date)
}

/// `MM-DD` of epoch ms `t`.
pub(super) fn month_day(t: i64) -> String {
    rfc3339_part(Timestamp(t), 5..10)
}

/// A duration in words: `850 ms`, `12.5 s`, `4 min 10 s`, `3 h 5 min`, `2 d 4 h`.
pub(super) fn duration(ms: i64) -> String {
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
