//! The W3C `traceparent` request header (Trace Context Level 1, §3.2;
//! SPEC §4 `POST /v1/tasks`).
//!
//! A submit may carry the submitter's trace context; idem keeps it on the
//! task and hands it to every executor that claims one of the task's
//! attempts, so the executor's spans join the submitter's trace. It is
//! metadata of the request, not part of it: it takes no part in the
//! fingerprint, and a retry with another `traceparent` is the same request.
//!
//! The value is `version "-" trace-id "-" parent-id "-" trace-flags`, each
//! part lowercase hex (`0-9`, `a-f`) of exactly 2, 32, 16 and 2 digits
//! (55 characters in all). Refused (§3.2.2): version `ff`, a trace id of all
//! zeros, a parent id of all zeros, and anything else not of that shape
//! (upper-case hex, other lengths, extra fields, whitespace inside). A
//! request with more than one `traceparent` line is refused too: the header
//! is a single value. `idem-http` answers a refusal with 400
//! `INVALID_REQUEST` and writes nothing.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a `traceparent` value was refused. `Display` is suitable for a
/// problem `detail`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceParentError {
    /// More than one `traceparent` header line.
    #[error("the traceparent header must appear at most once")]
    Multiple,
    /// The value is not a W3C Trace Context Level 1 `traceparent`.
    #[error(
        "invalid traceparent header: {reason}; expected W3C Trace Context `VERSION-TRACEID-PARENTID-FLAGS` \
         in lowercase hex of 2, 32, 16 and 2 digits, e.g. `00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01`"
    )]
    Invalid {
        /// What is wrong with the value.
        reason: &'static str,
    },
}

/// A validated `traceparent` value (55 ASCII characters, see the module doc).
///
/// Serialised as the header value; deserialising re-applies
/// [`TraceParent::parse`]'s rules.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TraceParent(String);

impl TraceParent {
    /// Length of a value in bytes: `2 + 1 + 32 + 1 + 16 + 1 + 2`.
    pub const LEN: usize = 55;

    /// Parses one `traceparent` value.
    ///
    /// # Errors
    /// [`TraceParentError::Invalid`] for anything but four `-`-separated
    /// lowercase hex fields of 2, 32, 16 and 2 digits, version `ff`, or an
    /// all-zero trace id or parent id.
    pub fn parse(value: &str) -> Result<TraceParent, TraceParentError> {
        let invalid = |reason| Err(TraceParentError::Invalid { reason });
        let mut parts = value.split('-');
        let (Some(version), Some(trace_id), Some(parent_id), Some(flags), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return invalid("it must have exactly four fields separated by `-`");
        };
        for (field, len, reason) in [
            (version, 2, "the version must be 2 lowercase hex digits"),
            (trace_id, 32, "the trace id must be 32 lowercase hex digits"),
            (
                parent_id,
                16,
                "the parent id must be 16 lowercase hex digits",
            ),
            (flags, 2, "the flags must be 2 lowercase hex digits"),
        ] {
            if field.len() != len || !field.bytes().all(is_lower_hex) {
                return invalid(reason);
            }
        }
        if version == "ff" {
            return invalid("version ff is not allowed");
        }
        if trace_id.bytes().all(|b| b == b'0') {
            return invalid("the trace id must not be all zeros");
        }
        if parent_id.bytes().all(|b| b == b'0') {
            return invalid("the parent id must not be all zeros");
        }
        Ok(TraceParent(value.to_owned()))
    }

    /// Reads the value from every raw `traceparent` field line of a request
    /// (e.g. `HeaderMap::get_all`): `None` when there is none.
    ///
    /// # Errors
    /// [`TraceParentError::Multiple`] for more than one line;
    /// [`TraceParentError::Invalid`] for a line that is not UTF-8 or that
    /// [`TraceParent::parse`] refuses.
    pub fn from_header_values<'a>(
        values: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Option<TraceParent>, TraceParentError> {
        let mut values = values.into_iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(TraceParentError::Multiple);
        }
        let text = std::str::from_utf8(first).map_err(|_| TraceParentError::Invalid {
            reason: "it must be ASCII",
        })?;
        TraceParent::parse(text).map(Some)
    }

    /// The value as sent.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The value as sent, by value.
    #[must_use]
    pub fn into_string(self) -> String {
        self.0
    }

    /// The trace id: 32 lowercase hex digits.
    #[must_use]
    pub fn trace_id(&self) -> &str {
        self.0.get(3..35).unwrap_or_default()
    }

    /// The parent id (the caller's span): 16 lowercase hex digits.
    #[must_use]
    pub fn parent_id(&self) -> &str {
        self.0.get(36..52).unwrap_or_default()
    }

    /// The trace flags (bit 0: sampled).
    #[must_use]
    pub fn flags(&self) -> u8 {
        self.0
            .get(53..55)
            .and_then(|f| u8::from_str_radix(f, 16).ok())
            .unwrap_or_default()
    }
}

/// `0-9` or `a-f` (W3C Trace Context's HEXDIGLC).
fn is_lower_hex(b: u8) -> bool {
    b.is_ascii_digit() || (b'a'..=b'f').contains(&b)
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for TraceParent {
    type Err = TraceParentError;

    fn from_str(s: &str) -> Result<TraceParent, TraceParentError> {
        TraceParent::parse(s)
    }
}

impl Serialize for TraceParent {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for TraceParent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        TraceParent::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_value_parses_into_its_parts() {
        let tp = TraceParent::parse(VALID).unwrap();
        assert_eq!(tp.as_str(), VALID);
        assert_eq!(tp.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.parent_id(), "00f067aa0ba902b7");
        assert_eq!(tp.flags(), 1);
        assert_eq!(tp.as_str().len(), TraceParent::LEN);
        // Another version of the same shape, and unsampled flags.
        let tp =
            TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert_eq!(tp.flags(), 0);
    }

    /// Each rule of W3C Trace Context Level 1 §3.2 refuses its value.
    #[test]
    fn malformed_values_are_refused() {
        for bad in [
            "",
            "00",
            // version ff
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // all-zero trace id, parent id
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // upper case
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // lengths
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47366-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-011",
            // extra or missing fields, other separators, whitespace, non-hex
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            let e = TraceParent::parse(bad).unwrap_err();
            assert!(matches!(e, TraceParentError::Invalid { .. }), "{bad:?}");
            assert!(e.to_string().contains("W3C Trace Context"), "{e}");
        }
    }

    #[test]
    fn header_lines_are_none_one_or_refused() {
        assert_eq!(TraceParent::from_header_values([]), Ok(None));
        assert_eq!(
            TraceParent::from_header_values([VALID.as_bytes()]),
            Ok(Some(TraceParent::parse(VALID).unwrap()))
        );
        assert_eq!(
            TraceParent::from_header_values([VALID.as_bytes(), VALID.as_bytes()]),
            Err(TraceParentError::Multiple)
        );
        assert!(matches!(
            TraceParent::from_header_values([b"00-\xff".as_slice()]),
            Err(TraceParentError::Invalid { .. })
        ));
    }

    #[test]
    fn serde_round_trips_and_refuses_malformed_values() {
        let tp = TraceParent::parse(VALID).unwrap();
        let json = serde_json::to_string(&tp).unwrap();
        assert_eq!(json, format!("\"{VALID}\""));
        assert_eq!(serde_json::from_str::<TraceParent>(&json).unwrap(), tp);
        assert!(serde_json::from_str::<TraceParent>("\"00-zz\"").is_err());
    }
}
