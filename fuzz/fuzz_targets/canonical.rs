//! The RFC 8785 canonicaliser of the fingerprint
//! (`idem_core::fingerprint::canonical_json`), on documents the strict reader
//! accepts and on JSON values built directly from the input.
//!
//! The first byte chooses the mode: even, the rest is JSON text read with
//! `parse_strict`; odd, the rest drives a builder of arbitrary values (any
//! string, any finite double, nesting up to 8).
//!
//! Properties, besides never panicking:
//! - canonicalisation succeeds on every such value;
//! - it is a fixed point: reading the canonical text back (with
//!   `parse_strict` for strict documents, which must accept it, and with
//!   serde_json for built values, whose doubles may lie beyond ±(2^53−1)) and
//!   canonicalising again gives the same bytes;
//! - the canonical text has no insignificant whitespace and no raw control
//!   character (RFC 8785 §3.2.1, §3.2.2.2);
//! - an object's members come out sorted by the UTF-16 code units of their
//!   names (§3.2.3), checked on the top-level object;
//! - the canonical request of an object embeds the same canonical text.

#![no_main]

use std::fmt;

use idem_core::fingerprint::{canonical_json, canonical_request};
use idem_core::json::parse_strict;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::{Map, Number, Value};

fn build(u: &mut Unstructured<'_>, depth: u32) -> Result<Value> {
    let kind = if depth >= 8 {
        u.int_in_range(0..=4)?
    } else {
        u.int_in_range(0..=6)?
    };
    Ok(match kind {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => match Number::from_f64(f64::from_bits(u.arbitrary()?)) {
            Some(n) => Value::Number(n),
            None => Value::Number(Number::from(u.arbitrary::<i32>()?)),
        },
        3 => Value::Number(Number::from(
            u.int_in_range(-(1_i64 << 53) + 1..=(1_i64 << 53) - 1)?,
        )),
        4 => Value::String(u.arbitrary()?),
        5 => {
            let n = u.int_in_range(0..=6)?;
            Value::Array((0..n).map(|_| build(u, depth + 1)).collect::<Result<_>>()?)
        }
        _ => {
            let n = u.int_in_range(0..=6)?;
            let mut m = Map::new();
            for _ in 0..n {
                let key: String = u.arbitrary()?;
                m.insert(key, build(u, depth + 1)?);
            }
            Value::Object(m)
        }
    })
}

/// The member names of a top-level object, in the order written.
struct TopLevelNames(Vec<String>);

impl<'de> serde::Deserialize<'de> for TopLevelNames {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TopLevelNames;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut names = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    map.next_value::<IgnoredAny>()?;
                    names.push(k);
                }
                Ok(TopLevelNames(names))
            }
        }
        d.deserialize_map(V)
    }
}

fn check(value: &Value, strict: bool) {
    let canonical = canonical_json(value).expect("canonicalises");
    let reread = if strict {
        parse_strict(canonical.as_bytes()).expect("strict reader accepts canonical text")
    } else {
        serde_json::from_str::<Value>(&canonical).expect("serde_json reads canonical text")
    };
    assert_eq!(
        canonical_json(&reread).unwrap(),
        canonical,
        "not a fixed point"
    );
    assert!(
        !canonical.chars().any(|c| c < ' '),
        "raw control character or whitespace: {canonical:?}"
    );
    if let Value::Object(_) = value {
        let names = serde_json::from_str::<TopLevelNames>(&canonical).unwrap().0;
        let units: Vec<Vec<u16>> = names.iter().map(|n| n.encode_utf16().collect()).collect();
        assert!(
            units.windows(2).all(|w| w[0] < w[1]),
            "member order: {names:?}"
        );
        let request = canonical_request("op", value, &[]).unwrap();
        assert_eq!(
            request.canonical,
            format!("{{\"material\":{{\"\":{canonical}}},\"operation\":\"op\"}}")
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        if let Ok(value) = parse_strict(rest) {
            check(&value, true);
        }
    } else if let Ok(value) = build(&mut Unstructured::new(rest), 0) {
        check(&value, false);
    }
});
