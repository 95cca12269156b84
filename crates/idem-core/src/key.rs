//! The `Idempotency-Key` request header
//! (draft-ietf-httpapi-idempotency-key-header-07, RFC 9651; SPEC §4).
//!
//! The draft defines the field as an RFC 9651 Item whose value is an
//! sf-string, so conforming clients send `Idempotency-Key: "abc"`. idem also
//! accepts the bare form `Idempotency-Key: abc` (SPEC §4); both give the key
//! `abc`.
//!
//! Whatever the form, the resulting key must be 1..=[`IdempotencyKey::MAX_LEN`]
//! (255) bytes of visible ASCII, `0x21..=0x7E` (SPEC §4 status table:
//! "empty, more than 255 bytes, not visible ASCII"). A space is therefore not allowed inside a
//! key even though an sf-string could carry one.
//!
//! Mapping to problems (SPEC §4, made by `idem-http`): [`KeyError::Missing`]
//! is 400 `IDEMPOTENCY_KEY_MISSING`; [`KeyError::Multiple`] and
//! [`KeyError::Invalid`] are 400 `IDEMPOTENCY_KEY_INVALID`.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why an `Idempotency-Key` was refused. `Display` is suitable for a problem
/// `detail`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// No `Idempotency-Key` header line at all (draft-07 §2.7: 400).
    #[error("the Idempotency-Key header is required")]
    Missing,
    /// More than one `Idempotency-Key` header line (RFC 9651 §3.3 allows one
    /// Item). Lines are not combined.
    #[error("the Idempotency-Key header must appear exactly once")]
    Multiple,
    /// The value is empty, blank, too long, not visible ASCII, or a quoted
    /// value that is not a valid parameter-less sf-string.
    #[error("invalid Idempotency-Key: {reason}")]
    Invalid {
        /// What is wrong with the value.
        reason: String,
    },
}

impl KeyError {
    fn invalid(reason: impl Into<String>) -> Self {
        Self::Invalid {
            reason: reason.into(),
        }
    }
}

/// A validated idempotency key: 1..=255 bytes, each in `0x21..=0x7E`.
///
/// Serialised as the plain key string; deserialising re-applies
/// [`IdempotencyKey::new`]'s rules.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Longest accepted key, in bytes (SPEC §4).
    pub const MAX_LEN: usize = 255;

    /// Validates an already-unquoted key (for CLI and SDK use).
    ///
    /// No trimming or unquoting happens here: `"abc"` with its quotes is the
    /// five-byte key `"abc"`.
    ///
    /// # Errors
    ///
    /// [`KeyError::Invalid`] if `key` is empty, longer than
    /// [`Self::MAX_LEN`] bytes, or has a byte outside `0x21..=0x7E` (space,
    /// control character, non-ASCII).
    pub fn new(key: &str) -> Result<Self, KeyError> {
        Self::from_bytes(key.as_bytes())
    }

    /// Parses one raw `Idempotency-Key` field value.
    ///
    /// Surrounding optional whitespace (SP, HTAB; RFC 9110 §5.5) is removed.
    /// A value starting with `"` is parsed as an RFC 9651 Item (§4.2) that
    /// must be a bare sf-string (§3.3.3) without parameters, and the string's
    /// unescaped content is the key (`"a\"b"` gives `a"b`). Any other value
    /// is taken verbatim as the key (so a key that itself starts with `"`
    /// can only be sent in the quoted form, `"\"abc"`). The key is then checked as in
    /// [`Self::new`].
    ///
    /// # Errors
    ///
    /// [`KeyError::Invalid`] for an empty or blank value, a malformed
    /// sf-string, an Item with parameters or of another type, or a key
    /// failing [`Self::new`]'s rules.
    pub fn parse_header(value: &[u8]) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        if value.is_empty() {
            return Err(KeyError::invalid("the value is empty"));
        }
        if value.first() != Some(&b'"') {
            return Self::from_bytes(value);
        }
        let item = sfv::Parser::new(value).parse::<sfv::Item>().map_err(|e| {
            KeyError::invalid(format!("a quoted value must be one RFC 9651 string ({e})"))
        })?;
        if !item.params.is_empty() {
            return Err(KeyError::invalid(
                "parameters are not allowed after the quoted key",
            ));
        }
        match item.bare_item {
            sfv::BareItem::String(s) => Self::new(s.as_str()),
            _ => Err(KeyError::invalid(
                "a quoted value must be an RFC 9651 string",
            )),
        }
    }

    /// The key text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key text, by value.
    #[must_use]
    pub fn into_string(self) -> String {
        self.0
    }

    fn from_bytes(key: &[u8]) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::invalid("the key is empty"));
        }
        if key.len() > Self::MAX_LEN {
            return Err(KeyError::invalid(format!(
                "the key is {} bytes long; at most {} are allowed",
                key.len(),
                Self::MAX_LEN
            )));
        }
        if let Some(pos) = key.iter().position(|b| !(0x21..=0x7E).contains(b)) {
            let what = match key.get(pos) {
                Some(b' ') => "a space",
                Some(b) if b.is_ascii_control() => "a control character",
                _ => "a non-ASCII byte",
            };
            return Err(KeyError::invalid(format!(
                "the key contains {what} at byte {pos}; only visible ASCII (0x21-0x7E) is allowed"
            )));
        }
        // All bytes are ASCII, so this cannot fail.
        String::from_utf8(key.to_vec())
            .map(Self)
            .map_err(|_| KeyError::invalid("the key is not ASCII"))
    }
}

/// Strips leading and trailing SP / HTAB (RFC 9110 §5.6.3 OWS).
fn trim_ows(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

/// Reads the key from every raw `Idempotency-Key` field line of a request
/// (e.g. `HeaderMap::get_all`), in order.
///
/// # Errors
///
/// [`KeyError::Missing`] for no line, [`KeyError::Multiple`] for more than
/// one (even if identical), otherwise whatever
/// [`IdempotencyKey::parse_header`] returns for the single line.
pub fn parse_header_values<'a>(
    values: impl IntoIterator<Item = &'a [u8]>,
) -> Result<IdempotencyKey, KeyError> {
    let mut values = values.into_iter();
    let first = values.next().ok_or(KeyError::Missing)?;
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    IdempotencyKey::parse_header(first)
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Serialize for IdempotencyKey {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for IdempotencyKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        Self::new(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(v: &str) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::parse_header(v.as_bytes())
    }

    fn assert_invalid(r: Result<IdempotencyKey, KeyError>, needle: &str) {
        match r {
            Err(e @ KeyError::Invalid { .. }) => {
                assert!(e.to_string().contains(needle), "{e} lacks {needle:?}");
            }
            other => panic!("expected Invalid ({needle}), got {other:?}"),
        }
    }

    #[test]
    fn quoted_and_bare_forms_agree() {
        assert_eq!(header("\"k1\"").unwrap().as_str(), "k1");
        assert_eq!(header("k1").unwrap().as_str(), "k1");
        assert_eq!(header("\"k1\"").unwrap(), header("k1").unwrap());
        assert_eq!(header(" \t\"k1\"\t ").unwrap().as_str(), "k1");
        assert_eq!(header("\tk1 ").unwrap().as_str(), "k1");
        assert_eq!(
            header("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")
                .unwrap()
                .as_str(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
    }

    #[test]
    fn sf_string_escapes() {
        assert_eq!(header(r#""a\"b""#).unwrap().as_str(), "a\"b");
        assert_eq!(header(r#""a\\b""#).unwrap().as_str(), "a\\b");
        assert_invalid(header(r#""a\nb""#), "RFC 9651");
        assert_invalid(header(r#""abc"#), "RFC 9651");
        assert_invalid(header(r#""abc"x"#), "RFC 9651");
        assert_invalid(header(r#""a", "b""#), "RFC 9651");
    }

    #[test]
    fn missing_and_multiple() {
        let none: [&[u8]; 0] = [];
        let e = parse_header_values(none).unwrap_err();
        assert_eq!(e, KeyError::Missing);
        let e = parse_header_values([&b"\"a\""[..], b"\"a\""]).unwrap_err();
        assert_eq!(e, KeyError::Multiple);
        assert_eq!(
            parse_header_values([&b"\"a\""[..], b"b", b"c"]),
            Err(KeyError::Multiple)
        );
        assert_eq!(parse_header_values([&b"\"a\""[..]]).unwrap().as_str(), "a");
        assert_invalid(parse_header_values([&b""[..]]), "empty");
    }

    #[test]
    fn empty_and_blank_are_invalid_not_missing() {
        assert_invalid(header(""), "empty");
        assert_invalid(header("   "), "empty");
        assert_invalid(header(" \t "), "empty");
        assert_invalid(header("\"\""), "empty");
        assert_invalid(header(" \"\" "), "empty");
        assert_invalid(IdempotencyKey::new(""), "empty");
    }

    #[test]
    fn length_limit() {
        let max = "k".repeat(IdempotencyKey::MAX_LEN);
        assert_eq!(header(&max).unwrap().as_str(), max);
        assert_eq!(header(&format!("\"{max}\"")).unwrap().as_str(), max);
        assert_eq!(IdempotencyKey::new(&max).unwrap().as_str(), max);
        let long = "k".repeat(IdempotencyKey::MAX_LEN + 1);
        assert_invalid(header(&long), "256 bytes");
        assert_invalid(header(&format!("\"{long}\"")), "256 bytes");
        assert_invalid(IdempotencyKey::new(&long), "256 bytes");
        // Escapes count once the string is unescaped: 255 bytes after.
        let escaped = format!("\"{}\\\"\"", "k".repeat(254));
        assert_eq!(header(&escaped).unwrap().as_str().len(), 255);
    }

    #[test]
    fn only_visible_ascii() {
        assert_invalid(header("a b"), "a space");
        assert_invalid(header("\"a b\""), "a space");
        assert_invalid(header("a\tb"), "a control character");
        assert_invalid(IdempotencyKey::new("a\u{7f}"), "a control character");
        assert_invalid(IdempotencyKey::new("a\0"), "a control character");
        assert_invalid(header("clé"), "non-ASCII");
        assert_invalid(IdempotencyKey::parse_header(b"a\xffb"), "non-ASCII");
        assert_invalid(IdempotencyKey::parse_header(b"\"a\xffb\""), "RFC 9651");
        assert_invalid(IdempotencyKey::new("a\nb"), "control");
        // Every visible ASCII character is fine.
        let all: String = (0x21_u8..=0x7E).map(char::from).collect();
        assert_eq!(IdempotencyKey::new(&all).unwrap().as_str(), all);
    }

    #[test]
    fn quoted_items_must_be_plain_strings() {
        assert_invalid(header("\"abc\";p=1"), "parameters");
        assert_invalid(header("\"abc\";p"), "parameters");
        assert_invalid(header("\"abc\"; p=\"x\""), "parameters");
        // Bare values are taken verbatim, whatever sf-type they would be.
        assert_eq!(header("123").unwrap().as_str(), "123");
        assert_eq!(header("abc;p=1").unwrap().as_str(), "abc;p=1");
        assert_eq!(header("tok/en:x").unwrap().as_str(), "tok/en:x");
        assert_eq!(header("a\"b").unwrap().as_str(), "a\"b");
    }

    #[test]
    fn new_does_not_unquote() {
        assert_eq!(IdempotencyKey::new("\"abc\"").unwrap().as_str(), "\"abc\"");
        assert_invalid(IdempotencyKey::new(" abc"), "a space");
    }

    #[test]
    fn display_and_serde() {
        let k = header("\"k-1\"").unwrap();
        assert_eq!(k.to_string(), "k-1");
        assert_eq!(serde_json::to_string(&k).unwrap(), "\"k-1\"");
        assert_eq!(
            serde_json::from_str::<IdempotencyKey>("\"k-1\"").unwrap(),
            k
        );
        assert!(serde_json::from_str::<IdempotencyKey>("\"\"").is_err());
        assert!(serde_json::from_str::<IdempotencyKey>("\"a b\"").is_err());
        assert_eq!(k.clone().into_string(), "k-1");
        assert_eq!(
            KeyError::Missing.to_string(),
            "the Idempotency-Key header is required"
        );
        assert_eq!(
            KeyError::Multiple.to_string(),
            "the Idempotency-Key header must appear exactly once"
        );
    }

    proptest! {
        #[test]
        fn valid_keys_round_trip_both_forms(key in "[!-~]{1,255}") {
            let k = IdempotencyKey::new(&key).unwrap();
            prop_assert_eq!(k.as_str(), key.as_str());
            // Bare form (a bare key cannot start with a quote).
            if !key.starts_with('"') {
                prop_assert_eq!(&header(&key).unwrap(), &k);
            }
            // Quoted form, escaping per RFC 9651 §4.1.6.
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            prop_assert_eq!(&header(&quoted).unwrap(), &k);
        }

        #[test]
        fn never_panics_and_accepted_keys_are_valid(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(k) = IdempotencyKey::parse_header(&bytes) {
                prop_assert!((1..=IdempotencyKey::MAX_LEN).contains(&k.as_str().len()));
                prop_assert!(k.as_str().bytes().all(|b| (0x21..=0x7E).contains(&b)));
            }
        }
    }
}
