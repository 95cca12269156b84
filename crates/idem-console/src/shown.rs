//! What the console shows is what is stored: every character that would be
//! invisible on a page, or would reorder the text around it, is drawn as a
//! visible escape `⟨U+XXXX⟩` (four to six upper-case hex digits).
//!
//! The hidden characters ([`is_hidden`]) are those of Unicode general
//! category Cc (C0 controls U+0000–U+001F, DEL U+007F, C1 controls
//! U+0080–U+009F), Cf (format characters: the bidirectional embeddings,
//! overrides and isolates U+202A–U+202E and U+2066–U+2069, the marks U+200E,
//! U+200F and U+061C, the zero-width space, non-joiner and joiner
//! U+200B–U+200D, U+2060–U+2064, the byte-order mark U+FEFF, the soft hyphen
//! U+00AD, tags …), Zl (U+2028) and Zp (U+2029). Categories from
//! `unicode-general-category`, as the core's rule for reasons.
//!
//! The rule is applied at one depth: to the whole HTML of every console
//! answer ([`html_answer`], a layer of [`crate::router`]), after `maud` has
//! escaped its values. No markup of the console's own holds a hidden
//! character, so each one in an answer came from data — in text, in an
//! attribute value, in the timeline's SVG labels and tooltips alike — and
//! replacing it cannot change the document's structure. Line breaks the
//! console means (between the lines of a tooltip, of pretty-printed JSON) are
//! written as the character reference `&#10;` ([`Lines`], [`json`]), which
//! the browser reads as a line break and the rule leaves alone; a line break
//! inside a stored value is shown as `⟨U+000A⟩`.
//!
//! The page's script inserts no text of its own: it swaps in the task's
//! fragment, an HTML answer that went through the same rule.

use std::borrow::Cow;
use std::fmt::Write as _;

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::{Escaper, Markup, PreEscaped, Render};
use unicode_general_category::{GeneralCategory, get_general_category};

/// Whether `c` is drawn as an escape: Unicode general category Cc, Cf, Zl
/// or Zp.
pub fn is_hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            get_general_category(c),
            GeneralCategory::Format
                | GeneralCategory::LineSeparator
                | GeneralCategory::ParagraphSeparator
        )
}

/// `s` with every hidden character ([`is_hidden`]) replaced by its escape
/// `⟨U+XXXX⟩`; borrowed when there is none.
pub fn visible(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_hidden) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if is_hidden(c) {
            // Writing to a String cannot fail.
            let _ = write!(out, "⟨U+{:04X}⟩", u32::from(c));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A line break the console means, inside a `<pre>` or an SVG `<title>`:
/// the character reference, which [`visible`] leaves alone.
pub const LINE_BREAK: &str = "&#10;";

/// Lines of text shown one under the other (a tooltip): each line escaped by
/// `maud`, joined by [`LINE_BREAK`]. A line break inside a line is data and
/// is shown as its escape.
#[derive(Debug, Clone, Copy)]
pub struct Lines<'a>(pub &'a [String]);

impl Render for Lines<'_> {
    fn render_to(&self, buf: &mut String) {
        for (i, line) in self.0.iter().enumerate() {
            if i > 0 {
                buf.push_str(LINE_BREAK);
            }
            // Escaping into a String cannot fail.
            let _ = Escaper::new(buf).write_str(line);
        }
    }
}

/// A JSON document pretty-printed for a `<pre>`: escaped by `maud`, its line
/// breaks written as [`LINE_BREAK`]. (JSON text holds no raw control
/// character inside a string, so every line break in it is the layout's.)
pub fn json(v: &serde_json::Value) -> Markup {
    let text = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    let mut escaped = String::with_capacity(text.len());
    let _ = Escaper::new(&mut escaped).write_str(&text);
    PreEscaped(escaped.replace('\n', LINE_BREAK))
}

/// The console's HTML answers with [`visible`] applied to their whole text
/// (a `map_response` layer of the console's router); other answers (static
/// files, the live stream) pass untouched.
pub async fn html_answer(res: Response) -> Response {
    let html = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/html"));
    if !html {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "console: an HTML answer could not be read");
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
    };
    let text = String::from_utf8_lossy(&bytes);
    let shown = visible(&text).into_owned();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(shown))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every character the console must never show raw.
    fn listed() -> Vec<char> {
        let mut cs: Vec<char> = ('\u{0}'..='\u{1f}').collect();
        cs.extend('\u{7f}'..='\u{9f}');
        cs.extend('\u{200b}'..='\u{200f}');
        cs.extend('\u{202a}'..='\u{202e}');
        cs.extend('\u{2066}'..='\u{2069}');
        cs.extend([
            '\u{61c}', '\u{feff}', '\u{2028}', '\u{2029}', '\u{ad}', '\u{2060}',
        ]);
        cs
    }

    #[test]
    fn every_listed_character_is_hidden_and_escaped() {
        for c in listed() {
            assert!(is_hidden(c), "U+{:04X}", u32::from(c));
            let text = format!("a{c}b");
            assert_eq!(visible(&text), format!("a⟨U+{:04X}⟩b", u32::from(c)));
        }
    }

    #[test]
    fn a_reversed_file_name_reads_as_stored() {
        assert_eq!(visible("x\u{202e}gnp.exe"), "x⟨U+202E⟩gnp.exe");
        assert_eq!(visible("\u{1}\u{10ffff}"), "⟨U+0001⟩\u{10ffff}");
        assert_eq!(visible("tag\u{e0041}"), "tag⟨U+E0041⟩");
    }

    #[test]
    fn visible_text_is_borrowed_unchanged() {
        for s in [
            "",
            "payee: Ana Müller, 12.50 €",
            "שלום",
            "漢字 😀",
            "a b\u{a0}c",
        ] {
            assert!(matches!(visible(s), Cow::Borrowed(_)), "{s}");
        }
    }

    #[test]
    fn meant_line_breaks_survive_and_data_line_breaks_show() {
        let lines = ["head".to_owned(), "a\nb <i>".to_owned()];
        let html = visible(&Lines(&lines).render().into_string()).into_owned();
        assert_eq!(html, "head&#10;a⟨U+000A⟩b &lt;i&gt;");
        let doc = serde_json::json!({"k": "a\nb\u{202e}c", "n": 1});
        let html = visible(&json(&doc).into_string()).into_owned();
        assert!(!html.contains('\n'), "{html}");
        assert!(html.contains("&#10;"), "{html}");
        assert!(html.contains(r"a\nb⟨U+202E⟩c"), "{html}");
    }
}
