//! Strict JSON reading of a raw request body.
//!
//! idem fingerprints what the client sent (SPEC §1 "canonical request"), so
//! the body must be read without any silent loss of information. Plain
//! `serde_json::from_slice::<Value>` loses information in two ways
//! (both would let two different requests share one fingerprint):
//!
//! - a repeated object member name keeps only the **last** value
//!   (`{"a":1,"a":2}` reads as `{"a":2}`), so two different bodies would get
//!   one fingerprint;
//! - an integer beyond ±(2^53−1) is read as (or canonicalised through) an
//!   IEEE-754 double, so `9007199254740993` and `9007199254740992` would get
//!   one fingerprint.
//!
//! [`parse_strict`] therefore enforces the I-JSON profile (RFC 7493 §2.3 unique
//! member names, §2.2 integers within ±(2^53−1)) plus a nesting limit, and
//! reports every violation as a [`JsonError`] whose `Display` text is fit for
//! the `detail` of a 400 `INVALID_REQUEST` problem (SPEC §4 status table).
//!
//! Tokenising is left to `serde_json`: the rules are enforced by a
//! [`serde::de::DeserializeSeed`] / [`serde::de::Visitor`] pair that builds the
//! [`serde_json::Value`] itself.

use std::cell::RefCell;
use std::fmt;

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Deepest container nesting [`parse_strict`] accepts (SPEC §4: "nesting > 64"
/// is a 400).
///
/// Depth counts containers, not values: a scalar at top level (`1`, `"x"`,
/// `null`) has depth 0, `{}` and `[]` have depth 1, `{"a":[1]}` has depth 2,
/// and in general a document's depth is the largest number of arrays/objects
/// enclosing-or-being any single value in it. Depth 64 is accepted, 65 is
/// rejected with [`JsonError::TooDeep`]. (serde_json's own recursion limit is
/// 128, so it never triggers first.)
pub const MAX_DEPTH: usize = 64;

/// Largest integer magnitude [`parse_strict`] accepts: 2^53−1, the largest
/// integer an IEEE-754 double represents exactly together with its neighbours
/// (RFC 7493 §2.2, I-JSON; RFC 8785 §3.2.2.3 serialises numbers as doubles).
pub const MAX_SAFE_INTEGER: u64 = 9_007_199_254_740_991;

/// Why a request body was refused by [`parse_strict`].
///
/// Every variant maps to 400 `INVALID_REQUEST` (SPEC §4); the `Display` text is
/// meant for the problem's `detail` and never echoes more than one member name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JsonError {
    /// An object contains the same member name twice (compared after
    /// unescaping, so `"a"` and `"\u0061"` are the same name).
    /// Rule: RFC 7493 §2.3 (I-JSON), RFC 8259 §4 "names SHOULD be unique".
    #[error("duplicate object key {key:?}: each member name may appear only once per object")]
    DuplicateKey {
        /// The repeated member name, unescaped.
        key: String,
    },
    /// A number whose magnitude exceeds 2^53−1 ([`MAX_SAFE_INTEGER`]).
    ///
    /// This covers integers written as such (`9007199254740992`) and any
    /// other notation whose value is an integer of that magnitude (`1e20`,
    /// `9007199254740993.0`): every double of magnitude ≥ 2^53 is integral,
    /// and its neighbouring integers would silently collapse onto it.
    /// Rule: RFC 7493 §2.2 (I-JSON).
    #[error(
        "number out of range: integers must lie within ±(2^53−1) = ±9007199254740991; send larger values as strings"
    )]
    UnsafeInteger,
    /// Arrays/objects nested deeper than [`MAX_DEPTH`] (64).
    #[error("JSON nested too deeply: at most 64 levels of arrays/objects are allowed")]
    TooDeep,
    /// Anything else serde_json refuses: a syntax error, trailing characters,
    /// invalid UTF-8, a lone surrogate escape (`"\ud800"`), a number out of
    /// the double range (`1e400`), an empty body.
    #[error("invalid JSON: {message}")]
    Syntax {
        /// serde_json's description, with line and column.
        message: String,
    },
}

/// Parses `bytes` (a raw request body) as one strict JSON document.
///
/// Accepts exactly RFC 8259 JSON text (surrounding whitespace allowed) that
/// also satisfies: unique member names per object, every number within
/// ±(2^53−1) when integral, nesting depth ≤ [`MAX_DEPTH`] (see its docs for
/// how depth is counted).
///
/// # Errors
///
/// - [`JsonError::DuplicateKey`] for a repeated member name;
/// - [`JsonError::UnsafeInteger`] for a number whose magnitude exceeds
///   [`MAX_SAFE_INTEGER`];
/// - [`JsonError::TooDeep`] for nesting deeper than [`MAX_DEPTH`];
/// - [`JsonError::Syntax`] for everything serde_json itself rejects.
///
/// When several problems are present the first one met in document order
/// wins.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, JsonError> {
    let violation = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed = StrictSeed {
        depth: 0,
        violation: &violation,
    }
    .deserialize(&mut de)
    .and_then(|value| de.end().map(|()| value));
    match parsed {
        Ok(value) => Ok(value),
        // A rule violation is smuggled out of serde as a custom error; the
        // typed error is waiting in `violation`.
        Err(err) => Err(violation.into_inner().unwrap_or_else(|| JsonError::Syntax {
            message: err.to_string(),
        })),
    }
}

/// Deserialises one JSON value whose enclosing containers number `depth`.
#[derive(Clone, Copy)]
struct StrictSeed<'v> {
    /// How many arrays/objects enclose the value about to be read.
    depth: usize,
    /// Where the first rule violation is recorded for [`parse_strict`].
    violation: &'v RefCell<Option<JsonError>>,
}

impl StrictSeed<'_> {
    /// Records `err` and returns a serde error that aborts deserialisation.
    fn fail<E: serde::de::Error>(&self, err: JsonError) -> E {
        let message = err.to_string();
        let mut slot = self.violation.borrow_mut();
        if slot.is_none() {
            *slot = Some(err);
        }
        E::custom(message)
    }

    /// The seed for the children of a container opened here, or `TooDeep`.
    fn enter<E: serde::de::Error>(&self) -> Result<Self, E> {
        let depth = self.depth + 1;
        if depth > MAX_DEPTH {
            return Err(self.fail(JsonError::TooDeep));
        }
        Ok(Self {
            depth,
            violation: self.violation,
        })
    }

    fn check_u64<E: serde::de::Error>(&self, magnitude: u64) -> Result<(), E> {
        if magnitude > MAX_SAFE_INTEGER {
            return Err(self.fail(JsonError::UnsafeInteger));
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for StrictSeed<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictSeed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        self.check_u64(v.unsigned_abs())?;
        Ok(Value::Number(Number::from(v)))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        self.check_u64(v)?;
        Ok(Value::Number(Number::from(v)))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        // Every double of magnitude > 2^53−1 is an integer that stands for a
        // whole range of written integers; reject it rather than round.
        // 2^53−1 is exactly representable, so this cast is lossless.
        let limit = MAX_SAFE_INTEGER as f64;
        if v.is_finite() && v.fract() == 0.0 && v.abs() > limit {
            return Err(self.fail(JsonError::UnsafeInteger));
        }
        match Number::from_f64(v) {
            Some(n) => Ok(Value::Number(n)),
            // serde_json never hands out NaN or infinities, but do not panic.
            None => Err(E::custom("number is not finite")),
        }
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let child = self.enter()?;
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(child)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let child = self.enter()?;
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(self.fail(JsonError::DuplicateKey { key }));
            }
            let value = map.next_value_seed(child)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn nested_arrays(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    fn nested_objects(depth: usize) -> String {
        // depth 1: {}, depth 2: {"a":{}}, ...
        let mut s = String::new();
        for _ in 1..depth {
            s.push_str("{\"a\":");
        }
        s.push_str("{}");
        for _ in 1..depth {
            s.push('}');
        }
        s
    }

    #[test]
    fn accepts_plain_documents() {
        let v = parse_strict(br#" {"a": [1, -2, 3.5, "x", true, false, null], "b": {}} "#).unwrap();
        assert_eq!(
            v,
            json!({"a": [1, -2, 3.5, "x", true, false, null], "b": {}})
        );
        assert_eq!(parse_strict(b"1").unwrap(), json!(1));
        assert_eq!(parse_strict(b"\"s\"").unwrap(), json!("s"));
        assert_eq!(parse_strict(b"null").unwrap(), Value::Null);
    }

    #[test]
    fn rejects_duplicate_keys() {
        assert_eq!(
            parse_strict(br#"{"a":1,"a":2}"#),
            Err(JsonError::DuplicateKey { key: "a".into() })
        );
        // Compared after unescaping.
        assert_eq!(
            parse_strict(br#"{"a":1,"\u0061":2}"#),
            Err(JsonError::DuplicateKey { key: "a".into() })
        );
        // Nested.
        assert_eq!(
            parse_strict(br#"{"x":[{"k":1,"j":2,"k":3}]}"#),
            Err(JsonError::DuplicateKey { key: "k".into() })
        );
        // Same key in sibling objects is fine.
        assert!(parse_strict(br#"[{"a":1},{"a":2}]"#).is_ok());
    }

    #[test]
    fn integer_boundaries() {
        assert_eq!(
            parse_strict(b"9007199254740991").unwrap(),
            json!(9_007_199_254_740_991_u64)
        );
        assert_eq!(
            parse_strict(b"-9007199254740991").unwrap(),
            json!(-9_007_199_254_740_991_i64)
        );
        for bad in [
            "9007199254740992",
            "-9007199254740992",
            "9007199254740993",
            "18446744073709551615",
            "-9223372036854775808",
            "100000000000000000000000",
            "1e20",
            "-1e300",
            "9007199254740993.0",
            "[1,{\"a\":9007199254740992}]",
        ] {
            assert_eq!(
                parse_strict(bad.as_bytes()),
                Err(JsonError::UnsafeInteger),
                "{bad}"
            );
        }
        // Non-integral and in-range floats pass.
        assert!(parse_strict(b"1.5").is_ok());
        assert!(parse_strict(b"9007199254740991.0").is_ok());
        assert!(parse_strict(b"1e15").is_ok());
        assert!(parse_strict(b"-0").is_ok());
        assert!(parse_strict(b"1e-300").is_ok());
    }

    #[test]
    fn depth_boundary_arrays() {
        assert!(parse_strict(nested_arrays(MAX_DEPTH).as_bytes()).is_ok());
        assert_eq!(
            parse_strict(nested_arrays(MAX_DEPTH + 1).as_bytes()),
            Err(JsonError::TooDeep)
        );
        // Far beyond serde_json's own limit of 128 still reports TooDeep.
        assert_eq!(
            parse_strict(nested_arrays(1000).as_bytes()),
            Err(JsonError::TooDeep)
        );
        // Unterminated deep nesting also hits the depth rule first.
        assert_eq!(
            parse_strict("[".repeat(100).as_bytes()),
            Err(JsonError::TooDeep)
        );
    }

    #[test]
    fn depth_boundary_objects() {
        assert!(parse_strict(nested_objects(MAX_DEPTH).as_bytes()).is_ok());
        assert_eq!(
            parse_strict(nested_objects(MAX_DEPTH + 1).as_bytes()),
            Err(JsonError::TooDeep)
        );
    }

    #[test]
    fn depth_counts_containers_not_scalars() {
        // 63 arrays around an object holding a scalar: depth 64.
        let s = format!("{}{{\"a\":1}}{}", "[".repeat(63), "]".repeat(63));
        assert!(parse_strict(s.as_bytes()).is_ok());
        // 63 arrays around an object holding an empty array: depth 65.
        let s = format!("{}{{\"a\":[]}}{}", "[".repeat(63), "]".repeat(63));
        assert_eq!(parse_strict(s.as_bytes()), Err(JsonError::TooDeep));
        assert!(parse_strict(nested_arrays(1).as_bytes()).is_ok());
    }

    #[test]
    fn other_failures_are_syntax() {
        for bad in [
            &b""[..],
            b"   ",
            b"{",
            b"{\"a\":1} x",
            b"{\"a\":1}{}",
            b"[1,]",
            b"{'a':1}",
            b"\"\\ud800\"",
            b"1e400",
            b"-1e400",
            b"NaN",
            b"\"\xff\"",
            b"01",
        ] {
            match parse_strict(bad) {
                Err(JsonError::Syntax { message }) => assert!(!message.is_empty()),
                other => panic!("{:?}: {other:?}", String::from_utf8_lossy(bad)),
            }
        }
    }

    #[test]
    fn first_violation_wins() {
        assert_eq!(
            parse_strict(br#"{"a":1,"a":9007199254740992}"#),
            Err(JsonError::DuplicateKey { key: "a".into() })
        );
        assert_eq!(
            parse_strict(br#"[9007199254740992,{"a":1,"a":2}]"#),
            Err(JsonError::UnsafeInteger)
        );
    }

    #[test]
    fn display_messages_are_readable() {
        assert_eq!(
            JsonError::DuplicateKey { key: "a".into() }.to_string(),
            "duplicate object key \"a\": each member name may appear only once per object"
        );
        assert!(JsonError::TooDeep.to_string().contains("64"));
        assert!(
            JsonError::UnsafeInteger
                .to_string()
                .contains("9007199254740991")
        );
        let Err(e) = parse_strict(b"{") else {
            panic!("accepted")
        };
        assert!(e.to_string().starts_with("invalid JSON: "), "{e}");
    }

    /// Arbitrary strict-valid JSON values.
    pub(crate) fn arb_value() -> impl Strategy<Value = Value> {
        let safe = MAX_SAFE_INTEGER as i64;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            (-safe..=safe).prop_map(|n| json!(n)),
            (-1.0e15_f64..1.0e15_f64).prop_map(|f| json!(f)),
            "[^\u{0}]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(6, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map("[a-z~/\"]{0,4}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn round_trips_serde_json_output(v in arb_value()) {
            let compact = serde_json::to_vec(&v).unwrap();
            prop_assert_eq!(parse_strict(&compact).unwrap(), v.clone());
            let pretty = serde_json::to_vec_pretty(&v).unwrap();
            prop_assert_eq!(parse_strict(&pretty).unwrap(), v);
        }

        #[test]
        fn agrees_with_serde_json_on_safe_ints(n in -(MAX_SAFE_INTEGER as i64)..=(MAX_SAFE_INTEGER as i64)) {
            prop_assert_eq!(parse_strict(n.to_string().as_bytes()).unwrap(), json!(n));
        }

        #[test]
        fn rejects_every_unsafe_int(n in (MAX_SAFE_INTEGER + 1)..=u64::MAX, neg in any::<bool>()) {
            let text = if neg { format!("-{n}") } else { n.to_string() };
            prop_assert_eq!(parse_strict(text.as_bytes()), Err(JsonError::UnsafeInteger));
        }

        #[test]
        fn never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse_strict(&bytes);
        }
    }
}
