//! `idem`'s JSON output, printed through [`idem_server::output`].

use anyhow::Result;
use idem_server::output::say;

/// Prints `v` as indented JSON. It goes through a [`serde_json::Value`] first:
/// a task's contract is serialized as embedded raw JSON (compact), which
/// `to_string_pretty` would copy as it is instead of indenting.
pub(crate) fn print_json(v: &impl serde::Serialize) -> Result<()> {
    Ok(say(serde_json::to_string_pretty(&serde_json::to_value(
        v,
    )?)?)?)
}
