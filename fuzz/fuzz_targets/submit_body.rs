//! A submit body from its bytes to params, canonical request and fingerprint
//! (`idem_core::submit::prepare_submit`) under the bundled configuration
//! (examples/idem.toml: `payment.release` with material pointers and a
//! params schema, `generation.dispatch` with all params material).
//!
//! The first byte chooses the mode: even, the rest is the body as sent;
//! odd, the rest drives a builder of a body of the submit shape (a
//! configured, unknown or arbitrary operation; params with or without the
//! schema's members, of right or wrong types, and arbitrary extra members),
//! written with serde_json.
//!
//! Properties, besides never panicking:
//! - a refusal for bad JSON is exactly the strict reader's refusal;
//! - an accepted body names a configured class, its params are an object,
//!   its canonical request is `canonical_request` of the class's material
//!   pointers, its fingerprint is SHA-256 of that text, and the canonical
//!   text is a fixed point of the strict reader and the canonicaliser;
//! - the same operation and params written another way (members reversed,
//!   params in their canonical form, whitespace) give the same fingerprint.

#![no_main]

use std::sync::OnceLock;

use idem_core::config::Config;
use idem_core::fingerprint::{Fingerprint, canonical_json, canonical_request};
use idem_core::json::parse_strict;
use idem_core::submit::{SubmitBodyError, prepare_submit};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Number, Value, json};

fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| Config::bundled().expect("bundled configuration"))
}

fn scalar(u: &mut Unstructured<'_>) -> Result<Value> {
    Ok(match u.int_in_range(0..=6)? {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => json!(u.int_in_range(-(1_i64 << 53) + 1..=(1_i64 << 53) - 1)?),
        3 => json!(u.int_in_range(-3_i64..=1_000_000)?),
        4 => Number::from_f64(f64::from_bits(u.arbitrary()?)).map_or(Value::Null, Value::Number),
        5 => json!(u.choose(&["EUR", "USD", "eur", "", "EURO", "p-1"])?),
        _ => Value::String(u.arbitrary()?),
    })
}

fn value(u: &mut Unstructured<'_>, depth: u32) -> Result<Value> {
    if depth >= 4 || u.ratio(2, 3)? {
        return scalar(u);
    }
    let n = u.int_in_range(0..=4)?;
    if u.arbitrary()? {
        Ok(Value::Array(
            (0..n).map(|_| value(u, depth + 1)).collect::<Result<_>>()?,
        ))
    } else {
        let mut m = Map::new();
        for _ in 0..n {
            m.insert(u.arbitrary()?, value(u, depth + 1)?);
        }
        Ok(Value::Object(m))
    }
}

fn body(u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
    let operation = match u.int_in_range(0..=4)? {
        0 | 1 => json!("payment.release"),
        2 => json!("generation.dispatch"),
        3 => Value::String(u.arbitrary()?),
        _ => value(u, 3)?,
    };
    let mut params = Map::new();
    for name in ["payee", "amount", "currency"] {
        if u.ratio(4, 5)? {
            params.insert(name.to_owned(), scalar(u)?);
        }
    }
    for _ in 0..u.int_in_range(0..=3)? {
        params.insert(u.arbitrary()?, value(u, 1)?);
    }
    let params = if u.ratio(9, 10)? {
        Value::Object(params)
    } else {
        value(u, 2)?
    };
    let mut doc = Map::new();
    if u.ratio(15, 16)? {
        doc.insert("operation".to_owned(), operation);
    }
    if u.ratio(15, 16)? {
        doc.insert("params".to_owned(), params);
    }
    Ok(serde_json::to_vec(&Value::Object(doc)).unwrap_or_default())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let built;
    let bytes = if mode % 2 == 0 {
        rest
    } else {
        match body(&mut Unstructured::new(rest)) {
            Ok(b) => {
                built = b;
                &built[..]
            }
            Err(_) => return,
        }
    };
    let prepared = match prepare_submit(config(), bytes) {
        Ok(p) => p,
        Err(SubmitBodyError::Json(e)) => {
            assert_eq!(parse_strict(bytes), Err(e));
            return;
        }
        Err(_) => {
            assert!(parse_strict(bytes).is_ok());
            return;
        }
    };
    let class = config()
        .operations
        .get(&prepared.operation)
        .expect("a configured class");
    assert!(prepared.params.is_object());
    let canonical = &prepared.canonical;
    assert_eq!(
        canonical_request(&prepared.operation, &prepared.params, &class.fingerprint).as_ref(),
        Ok(canonical)
    );
    assert_eq!(
        canonical.fingerprint,
        Fingerprint::digest(canonical.canonical.as_bytes())
    );
    let reread =
        parse_strict(canonical.canonical.as_bytes()).expect("canonical text is strict JSON");
    assert_eq!(canonical_json(&reread).unwrap(), canonical.canonical);

    let params = canonical_json(&prepared.params).unwrap();
    let operation = serde_json::to_string(&prepared.operation).unwrap();
    let again = format!("\t{{ \"params\" : {params} ,\r\n\"operation\":{operation} }} ");
    let other = prepare_submit(config(), again.as_bytes()).expect("rewritten body accepted");
    assert_eq!(other.canonical, prepared.canonical, "{again}");
});
