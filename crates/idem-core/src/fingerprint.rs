//! Canonical request and fingerprint (SPEC §1, §2 invariants 1–3, IDEM-01).
//!
//! A submission's **canonical request** is the RFC 8785 (JCS) serialisation
//! of its *material document*:
//!
//! ```json
//! {"material": {"<JSON pointer>": <value at that pointer>, ...}, "operation": "<operation class>"}
//! ```
//!
//! The operation class owns the list of material pointers (RFC 6901). Only
//! pointers that resolve in `params` appear; an absent field and a field set
//! to `null` are therefore different requests. An empty pointer list means
//! "all of `params` is material", recorded under the pointer `""` (the whole
//! document, RFC 6901 §5).
//!
//! The **fingerprint** is SHA-256 (FIPS 180-4) of the canonical request's
//! UTF-8 bytes, written `sha256:<64 lowercase hex digits>` (SPEC §1). Same
//! scope + same fingerprint is a replay; same scope + different fingerprint
//! is a conflict (SPEC §2 invariants 2, 3).
//!
//! Consequences of JCS that are **intended**: object member order and
//! insignificant whitespace never matter (RFC 8785 §3.2.3, §3.2.1), and
//! numbers are compared as IEEE-754 doubles, so `1`, `1.0`, `1e0` and `10e-1`
//! are the same value (RFC 8785 §3.2.2.3). String escapes are normalised
//! (`"\u0061"` equals `"a"`). Integers beyond ±(2^53−1) would collide, which
//! is why `params` must come from [`crate::json::parse_strict`].

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use sha2::{Digest, Sha256};

mod diff;

pub use diff::differing_fields;

/// The prefix of a rendered [`Fingerprint`].
const PREFIX: &str = "sha256:";

/// Why a canonical request, fingerprint or JSON pointer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FingerprintError {
    /// `params` is not a JSON object (SPEC §4: the submit body's `params`
    /// must be `{…}`).
    #[error("params must be a JSON object")]
    ParamsNotObject,
    /// A string is not an RFC 6901 JSON pointer.
    #[error("invalid JSON pointer {pointer:?}: {reason}")]
    InvalidPointer {
        /// The refused text.
        pointer: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A string is not `sha256:` followed by 64 lowercase hex digits.
    #[error("invalid fingerprint: {reason}")]
    InvalidFingerprint {
        /// What is wrong with it.
        reason: String,
    },
    /// The RFC 8785 serialiser failed (cannot happen for a
    /// [`serde_json::Value`], which holds only finite numbers).
    #[error("cannot canonicalise request: {message}")]
    Canonicalize {
        /// The serialiser's message.
        message: String,
    },
}

/// SHA-256 of a canonical request: 32 bytes, rendered
/// `sha256:<64 lowercase hex>` (SPEC §1).
///
/// `Display`, `Debug`, [`FromStr`] and serde all use that rendering; parsing
/// is strict (prefix required, exactly 64 digits, lowercase only), so every
/// fingerprint has one spelling and string equality is byte equality.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps a raw 32-byte SHA-256 digest.
    #[must_use]
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw 32-byte digest.
    #[must_use]
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// SHA-256 of `data`.
    #[must_use]
    pub fn digest(data: &[u8]) -> Self {
        Self(Sha256::digest(data).into())
    }

    /// Just the 64 lowercase hex digits, without the `sha256:` prefix.
    #[must_use]
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Rendered on the stack: every submit renders one.
        let mut digits = [0_u8; 64];
        hex::encode_to_slice(self.0, &mut digits).map_err(|_| fmt::Error)?;
        f.write_str(PREFIX)?;
        f.write_str(std::str::from_utf8(&digits).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl FromStr for Fingerprint {
    type Err = FingerprintError;

    /// Parses `sha256:<64 lowercase hex>`.
    ///
    /// # Errors
    ///
    /// [`FingerprintError::InvalidFingerprint`] for a missing prefix, a
    /// length other than 64 digits, or any character outside `[0-9a-f]`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: &str| FingerprintError::InvalidFingerprint {
            reason: reason.to_owned(),
        };
        let digits = s
            .strip_prefix(PREFIX)
            .ok_or_else(|| invalid("must start with \"sha256:\""))?;
        if digits.len() != 64 {
            return Err(invalid("must have exactly 64 hex digits after \"sha256:\""));
        }
        if !digits
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(invalid("hex digits must be 0-9 or lowercase a-f"));
        }
        let mut bytes = [0_u8; 32];
        hex::decode_to_slice(digits, &mut bytes).map_err(|e| invalid(&format!("bad hex: {e}")))?;
        Ok(Self(bytes))
    }
}

impl Serialize for Fingerprint {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Fingerprint {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// An RFC 6901 JSON pointer naming one material field of `params`.
///
/// `""` is the whole document; anything else is a sequence of `/token`
/// where `~` only appears as the escapes `~0` (`~`) and `~1` (`/`)
/// (RFC 6901 §3). Serialised as the plain pointer string.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct JsonPointer(String);

impl JsonPointer {
    /// Validates `s` as an RFC 6901 pointer.
    ///
    /// # Errors
    ///
    /// [`FingerprintError::InvalidPointer`] when `s` is non-empty and does not
    /// start with `/`, or contains a `~` not followed by `0` or `1`.
    pub fn parse(s: &str) -> Result<Self, FingerprintError> {
        let invalid = |reason: &str| FingerprintError::InvalidPointer {
            pointer: s.to_owned(),
            reason: reason.to_owned(),
        };
        if !s.is_empty() && !s.starts_with('/') {
            return Err(invalid(
                "must be empty (whole document) or start with '/' (RFC 6901 §3)",
            ));
        }
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
                return Err(invalid("'~' must be followed by '0' or '1' (RFC 6901 §3)"));
            }
        }
        Ok(Self(s.to_owned()))
    }

    /// The pointer to `tokens` (unescaped member names / array indices),
    /// escaping `~` as `~0` and `/` as `~1` (RFC 6901 §4). No tokens gives
    /// the whole-document pointer `""`.
    #[must_use]
    pub fn from_tokens<I, S>(tokens: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut out = String::new();
        for token in tokens {
            out.push('/');
            out.push_str(&token.as_ref().replace('~', "~0").replace('/', "~1"));
        }
        Self(out)
    }

    /// The pointer text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for JsonPointer {
    type Err = FingerprintError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl AsRef<str> for JsonPointer {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Serialize for JsonPointer {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for JsonPointer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// A request reduced to its material fields, and its fingerprint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CanonicalRequest {
    /// The RFC 8785 serialisation of the material document (stored for audit,
    /// SPEC §2 invariant 10).
    pub canonical: String,
    /// SHA-256 of `canonical`'s UTF-8 bytes.
    pub fingerprint: Fingerprint,
}

/// The material document before canonicalisation.
#[derive(Serialize)]
struct MaterialDocument<'a> {
    operation: &'a str,
    material: BTreeMap<&'a str, &'a Value>,
}

/// Builds the canonical request of `params` for `operation` and fingerprints
/// it (see the module docs for the document shape).
///
/// `material` lists the operation class's material pointers; pointers that
/// do not resolve in `params` are left out, duplicates count once, and an
/// empty list makes all of `params` material under the key `""`. `params`
/// should have been read with [`crate::json::parse_strict`] so that no
/// integer beyond ±(2^53−1) reaches the double-based JCS number form.
///
/// # Errors
///
/// - [`FingerprintError::ParamsNotObject`] if `params` is not an object;
/// - [`FingerprintError::Canonicalize`] if the RFC 8785 serialiser fails
///   (not expected for a `Value`).
pub fn canonical_request(
    operation: &str,
    params: &Value,
    material: &[JsonPointer],
) -> Result<CanonicalRequest, FingerprintError> {
    if !params.is_object() {
        return Err(FingerprintError::ParamsNotObject);
    }
    let material = if material.is_empty() {
        BTreeMap::from([("", params)])
    } else {
        material
            .iter()
            .filter_map(|p| params.pointer(p.as_str()).map(|v| (p.as_str(), v)))
            .collect()
    };
    let document = MaterialDocument {
        operation,
        material,
    };
    let canonical = jcs(&document)?;
    let fingerprint = Fingerprint::digest(canonical.as_bytes());
    Ok(CanonicalRequest {
        canonical,
        fingerprint,
    })
}

/// The RFC 8785 (JCS) serialisation of one JSON value: members sorted by
/// their names' UTF-16 code units (§3.2.3), numbers in the ECMAScript
/// double form (§3.2.2.3), strings with the minimal escapes (§3.2.2.2), no
/// insignificant whitespace (§3.2.1).
///
/// This is the serialiser [`canonical_request`] applies to the material
/// document; it is public so that tools can compare idem's canonical form
/// with other RFC 8785 implementations (docs/verification.md, "Differential
/// canonicalisation"). As there, `value` should come from
/// [`crate::json::parse_strict`]: JCS writes every number as a double, so
/// integers beyond ±(2^53−1) lose digits.
///
/// # Errors
///
/// [`FingerprintError::Canonicalize`] if the serialiser fails (not expected
/// for a [`Value`], which holds only finite numbers and unique member names).
pub fn canonical_json(value: &Value) -> Result<String, FingerprintError> {
    jcs(value)
}

/// RFC 8785 serialisation of `value` (serde_json_canonicalizer).
fn jcs<T: Serialize>(value: &T) -> Result<String, FingerprintError> {
    serde_json_canonicalizer::to_string(value).map_err(|e| FingerprintError::Canonicalize {
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::{parse_strict, tests::arb_value};
    use proptest::prelude::*;
    use proptest::sample::Index;
    use serde_json::json;

    pub(super) fn ptrs(list: &[&str]) -> Vec<JsonPointer> {
        list.iter()
            .map(|p| JsonPointer::parse(p).unwrap())
            .collect()
    }

    fn jcs(v: &Value) -> String {
        serde_json_canonicalizer::to_string(v).unwrap()
    }

    fn fp(params: &Value, material: &[JsonPointer]) -> Fingerprint {
        canonical_request("op.x", params, material)
            .unwrap()
            .fingerprint
    }

    #[test]
    fn rfc8785_key_order_and_numbers() {
        assert_eq!(jcs(&json!({"b": 1, "a": 2})), r#"{"a":2,"b":1}"#);
        // Intended: JCS compares numbers as doubles (RFC 8785 §3.2.2.3).
        let one = parse_strict(b"1").unwrap();
        for same in ["1.0", "1e0", "10e-1", "1.00000"] {
            assert_eq!(jcs(&parse_strict(same.as_bytes()).unwrap()), jcs(&one));
        }
        assert_eq!(
            fp(&parse_strict(br#"{"a":1.0}"#).unwrap(), &[]),
            fp(&json!({"a": 1}), &[])
        );
        // Keys sort by UTF-16 code units (RFC 8785 §3.2.3): U+20AC < U+1F600
        // (D83D…) < U+FB33, unlike code-point order.
        assert_eq!(
            jcs(&json!({"\u{FB33}": 1, "\u{1F600}": 2, "\u{20AC}": 3})),
            "{\"\u{20AC}\":3,\"\u{1F600}\":2,\"\u{FB33}\":1}"
        );
        // Escapes are normalised.
        assert_eq!(jcs(&parse_strict(br#""\u0061\/""#).unwrap()), r#""a/""#);
    }

    #[test]
    fn golden_whole_params() {
        let r = canonical_request("payment.release", &json!({"b": 1, "a": 2}), &[]).unwrap();
        assert_eq!(
            r.canonical,
            r#"{"material":{"":{"a":2,"b":1}},"operation":"payment.release"}"#
        );
        assert_eq!(
            r.fingerprint.to_string(),
            "sha256:bf7c10a69375b31e1a37faddd394a637af324281b06240af72e230fe52301b69"
        );
    }

    #[test]
    fn selected_material() {
        let params =
            json!({"amount": 100, "currency": "EUR", "note": "hi", "a/b": {"c~d": [5, 6]}});
        let r = canonical_request(
            "payment.release",
            &params,
            &ptrs(&[
                "/currency",
                "/amount",
                "/missing",
                "/a~1b/c~0d/1",
                "/amount",
            ]),
        )
        .unwrap();
        assert_eq!(
            r.canonical,
            // '~' (0x7E) sorts after 'm'.
            r#"{"material":{"/amount":100,"/a~1b/c~0d/1":6,"/currency":"EUR"},"operation":"payment.release"}"#
        );
        // Only material counts.
        let mut other = params.clone();
        other["note"] = json!("changed");
        let m = ptrs(&["/amount", "/currency"]);
        assert_eq!(fp(&params, &m), fp(&other, &m));
        other["amount"] = json!(101);
        assert_ne!(fp(&params, &m), fp(&other, &m));
        // Absent and null differ.
        assert_ne!(fp(&json!({}), &m), fp(&json!({"amount": null}), &m));
        // Operation is material.
        assert_ne!(
            canonical_request("a", &params, &m).unwrap().fingerprint,
            canonical_request("b", &params, &m).unwrap().fingerprint
        );
        // Explicit "" is the whole document.
        assert_eq!(fp(&params, &ptrs(&[""])), fp(&params, &[]));
    }

    #[test]
    fn params_must_be_object() {
        for bad in [json!([]), json!(1), json!(null), json!("x")] {
            assert_eq!(
                canonical_request("op", &bad, &[]),
                Err(FingerprintError::ParamsNotObject)
            );
        }
    }

    #[test]
    fn fingerprint_text_form() {
        let f = Fingerprint::digest(b"");
        let s = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(f.to_string(), s);
        assert_eq!(format!("{f:?}"), format!("Fingerprint({s})"));
        assert_eq!(s.parse::<Fingerprint>().unwrap(), f);
        assert_eq!(serde_json::to_string(&f).unwrap(), format!("\"{s}\""));
        assert_eq!(
            serde_json::from_str::<Fingerprint>(&format!("\"{s}\"")).unwrap(),
            f
        );
        assert_eq!(Fingerprint::from_bytes(*f.as_bytes()), f);
        for bad in [
            "",
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b8555",
            "sha256:g3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "SHA256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85é",
        ] {
            assert!(
                matches!(
                    bad.parse::<Fingerprint>(),
                    Err(FingerprintError::InvalidFingerprint { .. })
                ),
                "{bad}"
            );
        }
        assert!(serde_json::from_str::<Fingerprint>("\"sha256:00\"").is_err());
    }

    #[test]
    fn json_pointer_syntax() {
        for ok in ["", "/", "/a", "/a/0", "/~0~1", "//", "/a b", "/é"] {
            let p = JsonPointer::parse(ok).unwrap();
            assert_eq!(p.as_str(), ok);
            assert_eq!(
                serde_json::to_string(&p).unwrap(),
                serde_json::to_string(ok).unwrap()
            );
            assert_eq!(
                serde_json::from_str::<JsonPointer>(&serde_json::to_string(ok).unwrap()).unwrap(),
                p
            );
        }
        for bad in ["a", "a/b", "/~", "/~2", "/a~", "#/a"] {
            assert!(
                matches!(
                    JsonPointer::parse(bad),
                    Err(FingerprintError::InvalidPointer { .. })
                ),
                "{bad}"
            );
        }
        assert!(serde_json::from_str::<JsonPointer>("\"x\"").is_err());
        assert_eq!(
            JsonPointer::from_tokens(["a/b", "c~d"]).as_str(),
            "/a~1b/c~0d"
        );
        assert_eq!(JsonPointer::from_tokens(Vec::<String>::new()).as_str(), "");
    }

    // ---- property tests ----

    const WS: [&str; 5] = ["", " ", "\n", "\t", "\r\n  "];

    fn mix(salt: u64, s: &str) -> u64 {
        // FNV-1a seeded with `salt`: a deterministic pseudo-random order.
        s.bytes().fold(salt ^ 0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// Writes `v` as JSON text with members in a salt-dependent order,
    /// salt-dependent whitespace, escapes and number spellings.
    fn write_varied(v: &Value, salt: u64, out: &mut String) {
        let ws = WS[(salt % WS.len() as u64) as usize];
        match v {
            Value::Object(m) => {
                let mut entries: Vec<_> = m.iter().collect();
                entries.sort_by_key(|(k, _)| mix(salt, k));
                if salt & 8 != 0 {
                    entries.reverse();
                }
                out.push('{');
                out.push_str(ws);
                for (i, (k, val)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                        out.push_str(ws);
                    }
                    write_string(k, salt, out);
                    out.push_str(ws);
                    out.push(':');
                    out.push_str(ws);
                    write_varied(val, mix(salt, k), out);
                }
                out.push_str(ws);
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(ws);
                    write_varied(item, salt.rotate_left(5) ^ i as u64, out);
                }
                out.push(']');
            }
            Value::String(s) => write_string(s, salt, out),
            Value::Number(n) if n.is_i64() || n.is_u64() => {
                out.push_str(&n.to_string());
                match salt % 3 {
                    0 => out.push_str(".0"),
                    1 => out.push_str("e0"),
                    _ => {}
                }
            }
            other => out.push_str(&other.to_string()),
        }
    }

    fn write_string(s: &str, salt: u64, out: &mut String) {
        if salt & 16 == 0 {
            out.push_str(&serde_json::to_string(s).unwrap());
            return;
        }
        // Escape every character as \uXXXX (surrogate pairs beyond the BMP).
        out.push('"');
        for unit in s.encode_utf16() {
            out.push_str(&format!("\\u{unit:04x}"));
        }
        out.push('"');
    }

    fn arb_object() -> impl Strategy<Value = Value> {
        prop::collection::btree_map("[a-z/~]{0,3}", arb_value(), 0..5)
            .prop_map(|m| Value::Object(m.into_iter().collect()))
    }

    /// Every non-root node of `v` with its path tokens.
    fn nodes(v: &Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        let children: Vec<(String, &Value)> = match v {
            Value::Object(m) => m.iter().map(|(k, c)| (k.clone(), c)).collect(),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .map(|(i, c)| (i.to_string(), c))
                .collect(),
            _ => Vec::new(),
        };
        for (token, child) in children {
            path.push(token);
            out.push(path.clone());
            nodes(child, path, out);
            path.pop();
        }
    }

    /// `params` with the node at `path` replaced by a value that differs
    /// from it under JCS (a string no JSON rendering of the old value equals).
    fn mutate(params: &Value, path: &[String]) -> Value {
        let mut changed = params.clone();
        let slot = changed
            .pointer_mut(JsonPointer::from_tokens(path).as_str())
            .unwrap();
        *slot = Value::String(format!("changed:{slot}"));
        changed
    }

    proptest! {
        #[test]
        fn canonical_form_is_a_fixed_point(params in arb_object(), m in prop::collection::vec("[a-z/~]{0,3}", 0..3)) {
            let material: Vec<JsonPointer> =
                m.iter().map(|t| JsonPointer::from_tokens([t])).collect();
            let r = canonical_request("op.x", &params, &material).unwrap();
            let reparsed = parse_strict(r.canonical.as_bytes()).unwrap();
            prop_assert_eq!(jcs(&reparsed), r.canonical.clone());
            prop_assert_eq!(Fingerprint::digest(r.canonical.as_bytes()), r.fingerprint);
            // And the params themselves survive a canonical round trip.
            let p2 = parse_strict(jcs(&params).as_bytes()).unwrap();
            prop_assert_eq!(canonical_request("op.x", &p2, &material).unwrap(), r);
        }

        #[test]
        fn member_order_whitespace_and_spelling_never_matter(params in arb_object(), salt in any::<u64>()) {
            let mut text = String::new();
            write_varied(&params, salt, &mut text);
            let reparsed = parse_strict(text.as_bytes()).unwrap();
            prop_assert_eq!(fp(&reparsed, &[]), fp(&params, &[]), "text: {}", text);
        }

        #[test]
        fn changing_material_changes_fingerprint(
            params in arb_object(),
            pick in any::<Index>(),
            cut in any::<Index>(),
        ) {
            let mut all = Vec::new();
            nodes(&params, &mut Vec::new(), &mut all);
            prop_assume!(!all.is_empty());
            let path = pick.get(&all);
            let changed = mutate(&params, path);
            // Whole params material.
            prop_assert_ne!(fp(&params, &[]), fp(&changed, &[]));
            // Material pointer at the changed node or any ancestor of it.
            let prefix = &path[..=cut.index(path.len())];
            let m = vec![JsonPointer::from_tokens(prefix), JsonPointer::parse("/nope").unwrap()];
            prop_assert_ne!(fp(&params, &m), fp(&changed, &m));
        }

        #[test]
        fn changing_non_material_keeps_fingerprint(
            material in arb_value(),
            other in arb_value(),
            pick in any::<Index>(),
        ) {
            let params = json!({"m": material, "x": other});
            let mut all = Vec::new();
            nodes(&params["x"], &mut vec!["x".to_owned()], &mut all);
            all.push(vec!["x".to_owned()]);
            let path = pick.get(&all);
            let changed = mutate(&params, path);
            let m = ptrs(&["/m", "/absent"]);
            prop_assert_eq!(fp(&params, &m), fp(&changed, &m));
            prop_assert_ne!(fp(&params, &[]), fp(&changed, &[]));
        }

        #[test]
        fn fingerprint_text_round_trips(bytes in any::<[u8; 32]>()) {
            let f = Fingerprint::from_bytes(bytes);
            prop_assert_eq!(f.to_string().parse::<Fingerprint>().unwrap(), f);
            prop_assert_eq!(f.to_string().len(), 71);
        }

        #[test]
        fn pointer_tokens_round_trip(tokens in prop::collection::vec("[a-z/~01]{0,4}", 0..4)) {
            let p = JsonPointer::from_tokens(&tokens);
            prop_assert_eq!(JsonPointer::parse(p.as_str()).unwrap(), p);
        }
    }
}
