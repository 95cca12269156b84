//! The task's timeline as an SVG picture (placeholder: an empty picture with
//! its title; the drawing replaces it).

use idem_core::model::{Attempt, Event, Task, Timestamp};
use maud::{Markup, html};

/// The timeline of `task` with its `attempts` (by number, with evidence) and
/// `events` (by sequence) as of `now`: an inline `<svg role="img">` labelled
/// by its `<title>`.
pub fn svg(task: &Task, attempts: &[Attempt], events: &[Event], now: Timestamp) -> Markup {
    let _ = (events, now);
    let title = format!(
        "Timeline of task {}: {} attempts, state {}",
        task.idempotency_key,
        attempts.len(),
        task.state.as_str()
    );
    html! {
        svg role="img" aria-labelledby="timeline-svg-title" xmlns="http://www.w3.org/2000/svg" width="600" height="40" viewBox="0 0 600 40" {
            title #timeline-svg-title { (title) }
        }
    }
}
