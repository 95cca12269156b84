//! The strict JSON reader (`idem_core::json::parse_strict`) on arbitrary bytes.
//!
//! Properties, besides never panicking:
//! - what it accepts, serde_json also reads, to the same value; the value has
//!   no container deeper than 64 and no number beyond ±(2^53−1) when integral,
//!   and serde_json's rendering of it reads back to the same value;
//! - what serde_json reads but the strict reader refuses is refused for one of
//!   the strict rules (duplicate name, unsafe integer, depth), never as a
//!   syntax error.

#![no_main]

use idem_core::json::{JsonError, MAX_DEPTH, MAX_SAFE_INTEGER, parse_strict};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn numbers_safe(v: &Value) -> bool {
    match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u <= MAX_SAFE_INTEGER
            } else if let Some(i) = n.as_i64() {
                i.unsigned_abs() <= MAX_SAFE_INTEGER
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                f.is_finite() && !(f.fract() == 0.0 && f.abs() > MAX_SAFE_INTEGER as f64)
            }
        }
        Value::Array(a) => a.iter().all(numbers_safe),
        Value::Object(m) => m.values().all(numbers_safe),
        _ => true,
    }
}

fuzz_target!(|data: &[u8]| {
    let strict = parse_strict(data);
    let plain = serde_json::from_slice::<Value>(data);
    match (&strict, &plain) {
        (Ok(v), Ok(p)) => {
            assert_eq!(v, p, "strict and serde_json read different values");
            assert!(depth(v) <= MAX_DEPTH);
            assert!(numbers_safe(v), "unsafe number accepted: {v}");
            let text = serde_json::to_vec(v).unwrap();
            assert_eq!(parse_strict(&text).as_ref(), Ok(v), "round trip");
        }
        (Ok(v), Err(e)) => panic!("strict accepts what serde_json refuses ({e}): {v}"),
        (Err(JsonError::Syntax { message }), Ok(_)) => {
            panic!("serde_json reads it, strict calls it a syntax error: {message}")
        }
        (Err(_), _) => {}
    }
});
