//! A report's free text within idem's limits (SPEC §7): the message is
//! trimmed to [`MAX_MESSAGE_CHARS`] before it is sent (a longer one is
//! refused with nothing stored, so the outcome would be lost), and a report
//! refused for its size (413: a body over idem's limit, or a smaller limit of
//! a proxy in between) is cut further and sent again, never dropped.

use crate::ReportBody;

/// The longest report message idem stores, in characters (Unicode scalar
/// values; SPEC §7).
pub const MAX_MESSAGE_CHARS: usize = 4096;

/// What ends a message that was cut.
const CUT_MARK: char = '…';

/// `body` with its message trimmed to [`MAX_MESSAGE_CHARS`].
pub(super) fn trimmed(mut body: ReportBody) -> ReportBody {
    if let Some(m) = body.message.take() {
        body.message = Some(cut(m, MAX_MESSAGE_CHARS));
    }
    body
}

/// `body` with its message cut to half its length (then removed), or `None`
/// when it has no message left to cut.
pub(super) fn cut_further(body: &ReportBody) -> Option<ReportBody> {
    let chars = body.message.as_ref()?.chars().count();
    let mut smaller = body.clone();
    smaller.message = (chars > 1).then(|| {
        let m = body.message.clone().unwrap_or_default();
        cut(m, chars / 2)
    });
    Some(smaller)
}

/// `text` if it has at most `max` characters, else its first `max − 1`
/// characters and [`CUT_MARK`].
fn cut(text: String, max: usize) -> String {
    if text.chars().count() <= max {
        return text;
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    if max > 0 {
        out.push(CUT_MARK);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FailureClass;

    fn failed(message: &str) -> ReportBody {
        ReportBody::failed(1, FailureClass::InvalidInput, message)
    }

    #[test]
    fn messages_are_trimmed_to_the_limit_in_characters() {
        let long = "é".repeat(MAX_MESSAGE_CHARS + 10);
        let m = trimmed(failed(&long)).message.unwrap_or_default();
        assert_eq!(m.chars().count(), MAX_MESSAGE_CHARS);
        assert!(m.ends_with(CUT_MARK));
        let exact = "x".repeat(MAX_MESSAGE_CHARS);
        assert_eq!(trimmed(failed(&exact)).message, Some(exact));
    }

    #[test]
    fn a_report_refused_for_its_size_is_cut_until_no_message_is_left() {
        let mut body = trimmed(failed(&"x".repeat(MAX_MESSAGE_CHARS)));
        let mut lengths = Vec::new();
        while let Some(smaller) = cut_further(&body) {
            body = smaller;
            lengths.push(body.message.as_ref().map(|m| m.chars().count()));
        }
        assert_eq!(lengths.first(), Some(&Some(MAX_MESSAGE_CHARS / 2)));
        assert_eq!(lengths.last(), Some(&None));
        assert!(lengths.len() <= 14, "{lengths:?}");
        // The outcome and class stay.
        assert_eq!(body.failure_class, Some(FailureClass::InvalidInput));
    }
}
