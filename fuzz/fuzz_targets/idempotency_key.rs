//! The `Idempotency-Key` header parser (`idem_core::key`) on arbitrary field
//! values.
//!
//! Properties, besides never panicking:
//! - an accepted key is 1..=255 bytes of visible ASCII (0x21..=0x7E) and
//!   passes `IdempotencyKey::new` unchanged;
//! - the key's own sf-string form (RFC 9651 §4.1.6: quoted, `\` and `"`
//!   escaped) and, when it does not start with `"`, its bare form both parse
//!   back to it, with or without surrounding SP/HTAB;
//! - a value not starting with `"` (after SP/HTAB) is accepted exactly when it
//!   is 1..=255 visible ASCII bytes, and is then the key itself;
//! - one field line reads as `parse_header`, none as Missing, two as Multiple;
//! - the key's JSON (serde) form reads back to it.

#![no_main]

use idem_core::key::{IdempotencyKey, KeyError, parse_header_values};
use libfuzzer_sys::fuzz_target;

fn visible(bytes: &[u8]) -> bool {
    (1..=IdempotencyKey::MAX_LEN).contains(&bytes.len())
        && bytes.iter().all(|b| (0x21..=0x7E).contains(b))
}

fn trim(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

fn sf_string(key: &str) -> String {
    let mut out = String::from("\"");
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fuzz_target!(|data: &[u8]| {
    let parsed = IdempotencyKey::parse_header(data);
    assert_eq!(parse_header_values([data]), parsed);
    assert_eq!(parse_header_values([data, data]), Err(KeyError::Multiple));
    assert_eq!(
        parse_header_values(std::iter::empty::<&[u8]>()),
        Err(KeyError::Missing)
    );

    let trimmed = trim(data);
    if trimmed.first() != Some(&b'"') {
        match &parsed {
            Ok(key) => assert_eq!(key.as_str().as_bytes(), trimmed),
            Err(_) => assert!(!visible(trimmed), "bare visible key refused"),
        }
    }

    let Ok(key) = parsed else { return };
    let k = key.as_str();
    assert!(visible(k.as_bytes()), "accepted {k:?}");
    assert_eq!(IdempotencyKey::new(k).as_ref(), Ok(&key));
    let quoted = sf_string(k);
    for form in [quoted.clone(), format!(" \t{quoted}\t ")] {
        assert_eq!(
            IdempotencyKey::parse_header(form.as_bytes()).as_ref(),
            Ok(&key),
            "{form}"
        );
    }
    if !k.starts_with('"') {
        assert_eq!(
            IdempotencyKey::parse_header(format!("\t{k} ").as_bytes()).as_ref(),
            Ok(&key)
        );
    }
    let json = serde_json::to_string(&key).unwrap();
    assert_eq!(serde_json::from_str::<IdempotencyKey>(&json).unwrap(), key);
});
