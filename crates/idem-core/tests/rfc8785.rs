//! RFC 8785's own test vectors against idem's canonical form.
//!
//! The vectors are typed in from the RFC text: the Appendix B number table
//! (IEEE 754 bit patterns and their JSON form), the §3.2.2 example with its
//! §3.2.4 UTF-8 bytes, and the §3.2.3 sorting example. They guard the
//! canonicaliser the fingerprint uses (`idem_core::fingerprint::canonical_json`,
//! the serialiser of `canonical_request`) and the strict reader in front of
//! it: a number the RFC writes must either come back unchanged through
//! `parse_strict` + `canonical_json`, or be refused by `parse_strict` because
//! it is an integer beyond ±(2^53−1) (I-JSON, RFC 7493 §2.2), which idem
//! refuses by design. The same vectors run in scripts/differential-canonical.py
//! against an independent implementation.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use idem_core::fingerprint::{canonical_json, canonical_request};
use idem_core::json::{JsonError, MAX_SAFE_INTEGER, parse_strict};
use serde_json::{Number, Value, json};

/// RFC 8785 Appendix B: big-endian IEEE 754 bit patterns of finite doubles
/// and their canonical JSON text.
const APPENDIX_B: [(u64, &str); 24] = [
    (0x0000_0000_0000_0000, "0"),
    (0x8000_0000_0000_0000, "0"),
    (0x0000_0000_0000_0001, "5e-324"),
    (0x8000_0000_0000_0001, "-5e-324"),
    (0x7fef_ffff_ffff_ffff, "1.7976931348623157e+308"),
    (0xffef_ffff_ffff_ffff, "-1.7976931348623157e+308"),
    (0x4340_0000_0000_0000, "9007199254740992"),
    (0xc340_0000_0000_0000, "-9007199254740992"),
    (0x4430_0000_0000_0000, "295147905179352830000"),
    (0x44b5_2d02_c7e1_4af5, "9.999999999999997e+22"),
    (0x44b5_2d02_c7e1_4af6, "1e+23"),
    (0x44b5_2d02_c7e1_4af7, "1.0000000000000001e+23"),
    (0x444b_1ae4_d6e2_ef4e, "999999999999999700000"),
    (0x444b_1ae4_d6e2_ef4f, "999999999999999900000"),
    (0x444b_1ae4_d6e2_ef50, "1e+21"),
    (0x3eb0_c6f7_a0b5_ed8c, "9.999999999999997e-7"),
    (0x3eb0_c6f7_a0b5_ed8d, "0.000001"),
    (0x41b3_de43_5555_5553, "333333333.3333332"),
    (0x41b3_de43_5555_5554, "333333333.33333325"),
    (0x41b3_de43_5555_5555, "333333333.3333333"),
    (0x41b3_de43_5555_5556, "333333333.3333334"),
    (0x41b3_de43_5555_5557, "333333333.33333343"),
    (0xbecb_f647_612f_3696, "-0.0000033333333333333333"),
    (0x4314_3ff3_c1cb_0959, "1424953923781206.2"),
];

/// RFC 8785 Appendix B, the two rows without a JSON form: NaN and Infinity.
const APPENDIX_B_NOT_JSON: [u64; 2] = [0x7fff_ffff_ffff_ffff, 0x7ff0_0000_0000_0000];

fn double(bits: u64) -> Value {
    Value::Number(Number::from_f64(f64::from_bits(bits)).expect("finite"))
}

#[test]
fn appendix_b_numbers_serialise_as_the_rfc_writes_them() {
    for (bits, expected) in APPENDIX_B {
        assert_eq!(
            canonical_json(&double(bits)).unwrap(),
            expected,
            "{bits:016x}"
        );
    }
}

#[test]
fn appendix_b_numbers_through_the_strict_reader() {
    let mut refused = 0;
    for (bits, expected) in APPENDIX_B {
        let x = f64::from_bits(bits);
        let beyond_i_json = x.fract() == 0.0 && x.abs() > MAX_SAFE_INTEGER as f64;
        // The RFC's own text and Rust's shortest round-trip spelling of the
        // same double read as the same number.
        for text in [expected.to_owned(), format!("{x:e}")] {
            match parse_strict(text.as_bytes()) {
                Ok(v) => {
                    assert!(!beyond_i_json, "{text} accepted");
                    assert_eq!(canonical_json(&v).unwrap(), expected, "{text}");
                }
                Err(e) => {
                    assert!(beyond_i_json, "{text}: {e}");
                    assert_eq!(e, JsonError::UnsafeInteger, "{text}");
                    refused += 1;
                }
            }
        }
    }
    // ±max, ±2^53, ~2^68, the three around 1e23 and the three around 1e21,
    // in both spellings.
    assert_eq!(refused, 2 * 11);
}

#[test]
fn appendix_b_nan_and_infinity_have_no_json_form() {
    for bits in APPENDIX_B_NOT_JSON {
        assert!(Number::from_f64(f64::from_bits(bits)).is_none(), "{bits:x}");
    }
    for text in ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"] {
        assert!(
            matches!(parse_strict(text.as_bytes()), Err(JsonError::Syntax { .. })),
            "{text}"
        );
    }
}

/// RFC 8785 §3.2.2: the input (whitespace as in the RFC).
const SECTION_3_2_2_INPUT: &str = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50,
              2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;

/// RFC 8785 §3.2.2: the canonical output.
const SECTION_3_2_2_OUTPUT: &str = "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";

/// RFC 8785 §3.2.4: the UTF-8 bytes of the §3.2.2 output.
const SECTION_3_2_4_BYTES: &str = "
    7b 22 6c 69 74 65 72 61 6c 73 22 3a 5b 6e 75 6c 6c 2c 74 72
    75 65 2c 66 61 6c 73 65 5d 2c 22 6e 75 6d 62 65 72 73 22 3a
    5b 33 33 33 33 33 33 33 33 33 2e 33 33 33 33 33 33 33 2c 31
    65 2b 33 30 2c 34 2e 35 2c 30 2e 30 30 32 2c 31 65 2d 32 37
    5d 2c 22 73 74 72 69 6e 67 22 3a 22 e2 82 ac 24 5c 75 30 30
    30 66 5c 6e 41 27 42 5c 22 5c 5c 5c 5c 5c 22 2f 22 7d";

#[test]
fn section_3_2_2_example() {
    // `1E30` is an integer beyond ±(2^53−1): the strict reader refuses the
    // example (I-JSON, RFC 7493 §2.2), so the canonicaliser is checked on
    // serde_json's reading of it (the example has no duplicate names).
    assert_eq!(
        parse_strict(SECTION_3_2_2_INPUT.as_bytes()),
        Err(JsonError::UnsafeInteger)
    );
    let parsed: Value = serde_json::from_str(SECTION_3_2_2_INPUT).unwrap();
    let canonical = canonical_json(&parsed).unwrap();
    assert_eq!(canonical, SECTION_3_2_2_OUTPUT);
    let bytes: Vec<u8> = SECTION_3_2_4_BYTES
        .split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect();
    assert_eq!(canonical.as_bytes(), bytes);
    // Without `1E30` the strict reader accepts it and the rest is unchanged.
    let strict = parse_strict(SECTION_3_2_2_INPUT.replace("1E30, ", "").as_bytes()).unwrap();
    assert_eq!(
        canonical_json(&strict).unwrap(),
        SECTION_3_2_2_OUTPUT.replace("1e+30,", "")
    );
}

/// RFC 8785 §3.2.3: the input.
const SECTION_3_2_3_INPUT: &str = r#"{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}"#;

/// RFC 8785 §3.2.3: the property values in the order the RFC sorts them.
const SECTION_3_2_3_ORDER: [&str; 7] = [
    "Carriage Return",
    "One",
    "Control",
    "Latin Small Letter O With Diaeresis",
    "Euro Sign",
    "Emoji: Grinning Face",
    "Hebrew Letter Dalet With Dagesh",
];

#[test]
fn section_3_2_3_sorting() {
    let parsed = parse_strict(SECTION_3_2_3_INPUT.as_bytes()).unwrap();
    let canonical = canonical_json(&parsed).unwrap();
    assert_eq!(
        canonical,
        "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
         \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\
         \"\u{1f600}\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
    );
    // The order of the values alone, as the RFC lists it.
    let reparsed: serde_json::Map<String, Value> = serde_json::from_str(&canonical).unwrap();
    let mut positions: Vec<(usize, &str)> = SECTION_3_2_3_ORDER
        .iter()
        .map(|v| (canonical.find(&format!("\"{v}\"")).unwrap(), *v))
        .collect();
    positions.sort_unstable();
    let in_output: Vec<&str> = positions.into_iter().map(|(_, v)| v).collect();
    assert_eq!(in_output, SECTION_3_2_3_ORDER);
    assert_eq!(reparsed.len(), 7);
}

/// The canonical request embeds the same RFC 8785 form of params as
/// `canonical_json` gives for them alone.
#[test]
fn canonical_request_uses_the_same_serialiser() {
    let params = parse_strict(SECTION_3_2_3_INPUT.as_bytes()).unwrap();
    let request = canonical_request("op.x", &params, &[]).unwrap();
    assert_eq!(
        request.canonical,
        format!(
            "{{\"material\":{{\"\":{}}},\"operation\":\"op.x\"}}",
            canonical_json(&params).unwrap()
        )
    );
    assert_eq!(
        canonical_json(&json!({"operation": "op.x", "material": {"": params}})).unwrap(),
        request.canonical
    );
}
