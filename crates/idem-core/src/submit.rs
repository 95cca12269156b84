//! A submit body, from its bytes to what is fingerprinted (SPEC §4
//! `POST /v1/tasks`, IDEM-02).
//!
//! [`prepare_submit`] is the whole of a submit's body handling that needs no
//! I/O: the strict JSON reading ([`crate::json::parse_strict`]), the submit
//! shape `{"operation": "<class>", "params": {…}}`, the operation class from
//! the configuration, the class's `params_schema` (SPEC §5) and the RFC 8785
//! canonical request with its SHA-256 fingerprint
//! ([`crate::fingerprint::canonical_request`]). It is a pure function of the
//! bytes and the configuration; the HTTP layer turns its errors into 400
//! problems and checks who may submit what.

use serde::Deserialize;
use serde_json::Value;

use crate::config::Config;
use crate::fingerprint::{CanonicalRequest, FingerprintError, canonical_json, canonical_request};
use crate::json::{JsonError, parse_strict};
use crate::schema::SchemaError;

/// A submit body that passed every check of [`prepare_submit`].
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedSubmit {
    /// The operation class named by the body (defined by the configuration).
    pub operation: String,
    /// The params with every number in its RFC 8785 form (a JSON object;
    /// from [`prepare_submit`], one that matches the class's
    /// `params_schema`, if it has one).
    pub params: Value,
    /// The canonical request of the class's material fields and its
    /// fingerprint (SPEC §1).
    pub canonical: CanonicalRequest,
    /// The body's `priority`, if it named one (SPEC §2.13; checked against
    /// the class's range by [`priority_of`]).
    pub priority: Option<i64>,
}

/// The priority of a submit naming `asked` (if any) to a class whose
/// allowed range is `[lo, hi]`: `asked` when within it; with none, 3
/// raised or lowered into the range (SPEC §2.13).
///
/// # Errors
/// The message of the 400 `INVALID_REQUEST` for a priority outside it.
pub fn priority_of(asked: Option<i64>, [lo, hi]: [i64; 2]) -> Result<i64, String> {
    match asked {
        None => Ok(crate::model::DEFAULT_PRIORITY.clamp(lo, hi)),
        Some(p) if (lo..=hi).contains(&p) => Ok(p),
        Some(p) => Err(format!(
            "`priority` {p} is outside this class's range {lo}–{hi}; nothing was created"
        )),
    }
}

/// Why a submit body was refused by [`prepare_submit`]. Every variant is a
/// 400 `INVALID_REQUEST` (SPEC §4); the HTTP layer words the detail.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitBodyError {
    /// Not strict JSON (duplicate member name, integer beyond ±(2^53−1),
    /// nesting deeper than 64, or a syntax error).
    #[error(transparent)]
    Json(#[from] JsonError),
    /// Strict JSON, but not of the submit shape (`operation` a string,
    /// `params` present); `message` is serde's description.
    #[error("body: {message}")]
    Shape {
        /// serde's description, e.g. ``missing field `params` ``.
        message: String,
    },
    /// The configuration defines no class named `operation`.
    #[error("unknown operation `{operation}`")]
    UnknownOperation {
        /// The name the body gave.
        operation: String,
    },
    /// `params` is not a JSON object.
    #[error("`params` must be a JSON object")]
    ParamsNotObject,
    /// `params` do not match the class's `params_schema` (SPEC §5), or the
    /// schema does not compile.
    #[error("`params` do not match the params_schema of `{operation}`: {error}")]
    Schema {
        /// The operation class.
        operation: String,
        /// The violations, or the compile error.
        error: SchemaError,
    },
    /// The canonical request could not be built.
    #[error(transparent)]
    Fingerprint(#[from] FingerprintError),
}

/// The submit body's shape (the wire type is `idem_api::SubmitBody`; this
/// one has the same fields and serde derive, so refusals read the same).
#[derive(Deserialize)]
struct SubmitBody {
    operation: String,
    params: Value,
    #[serde(default)]
    priority: Option<i64>,
}

/// Reads `bytes` as a submit body for `config` and fingerprints it: every
/// check of [`read_submit`], then the class's `params_schema`
/// ([`check_schema`]).
///
/// # Errors
///
/// The first check that fails, as a [`SubmitBodyError`].
pub fn prepare_submit(config: &Config, bytes: &[u8]) -> Result<PreparedSubmit, SubmitBodyError> {
    let prepared = read_submit(config, bytes)?;
    check_schema(config, &prepared)?;
    Ok(prepared)
}

/// Reads `bytes` as a submit body for `config` and fingerprints it, without
/// the class's `params_schema`: what a retry of an accepted request is
/// judged by, since the schema a task was accepted under is frozen with it
/// (SPEC §5: a retry replays even after the class's schema was tightened;
/// only a new key meets the current schema).
///
/// Checks, in order: strict JSON, the submit shape (an object with
/// `operation` and `params`), a known operation class, `params` an object;
/// then every number of the params is put in its RFC 8785 form (`1250.0`
/// and `1.25e3` become `1250`), so that what is
/// stored, answered and handed to executors is exactly what was
/// fingerprinted, and the canonical request of the class's material
/// pointers is built.
///
/// # Errors
///
/// The first check that fails, as a [`SubmitBodyError`].
pub fn read_submit(config: &Config, bytes: &[u8]) -> Result<PreparedSubmit, SubmitBodyError> {
    let value = parse_strict(bytes)?;
    // serde's derived struct also reads a sequence of the fields in order
    // (`["op", {…}]`); the body is an object (SPEC §4, the OpenAPI schema).
    if !value.is_object() {
        return Err(SubmitBodyError::Shape {
            message: "the body must be a JSON object with `operation` and `params`".into(),
        });
    }
    let body: SubmitBody = serde_json::from_value(value).map_err(|e| SubmitBodyError::Shape {
        message: e.to_string(),
    })?;
    let Some(class) = config.operations.get(&body.operation) else {
        return Err(SubmitBodyError::UnknownOperation {
            operation: body.operation,
        });
    };
    if !body.params.is_object() {
        return Err(SubmitBodyError::ParamsNotObject);
    }
    let params = canonical_params(&body.params)?;
    let canonical = canonical_request(&body.operation, &params, &class.fingerprint)?;
    Ok(PreparedSubmit {
        operation: body.operation,
        params,
        canonical,
        priority: body.priority,
    })
}

/// Checks `prepared`'s params against its class's current `params_schema`
/// (SPEC §5); a class without one accepts any params.
///
/// # Errors
///
/// [`SubmitBodyError::Schema`] with the violations.
pub fn check_schema(config: &Config, prepared: &PreparedSubmit) -> Result<(), SubmitBodyError> {
    let schema = config
        .operations
        .get(&prepared.operation)
        .and_then(|class| class.params_schema.as_ref());
    match schema {
        Some(schema) => {
            schema
                .validate(&prepared.params)
                .map_err(|error| SubmitBodyError::Schema {
                    operation: prepared.operation.clone(),
                    error,
                })
        }
        None => Ok(()),
    }
}

/// `params` in RFC 8785 canonical form, as a value: every number as JCS
/// writes it, so an integral one has neither fraction nor exponent and
/// reads as an integer ([`crate::fingerprint::canonical_json`] read back).
fn canonical_params(params: &Value) -> Result<Value, SubmitBodyError> {
    let text = canonical_json(params)?;
    Ok(parse_strict(text.as_bytes())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;

    fn bundled() -> Config {
        Config::bundled().unwrap()
    }

    #[test]
    fn fingerprints_the_material_fields() {
        let config = bundled();
        let p = prepare_submit(
            &config,
            br#"{"params":{"note":"x","currency":"EUR","amount":100.0,"payee":"p"},"operation":"payment.release"}"#,
        )
        .unwrap();
        assert_eq!(p.operation, "payment.release");
        assert_eq!(p.params["note"], "x");
        assert_eq!(
            p.canonical.canonical,
            r#"{"material":{"/amount":100,"/currency":"EUR","/payee":"p"},"operation":"payment.release"}"#
        );
        assert_eq!(
            p.canonical.fingerprint,
            Fingerprint::digest(p.canonical.canonical.as_bytes())
        );
    }

    #[test]
    fn each_check_in_order() {
        let config = bundled();
        let refuse = |body: &str| prepare_submit(&config, body.as_bytes()).unwrap_err();
        assert_eq!(
            refuse(r#"{"operation":"x","operation":"y"}"#),
            SubmitBodyError::Json(JsonError::DuplicateKey {
                key: "operation".into()
            })
        );
        for not_an_object in [r#"["generation.dispatch",{"a":1}]"#, "1", r#""x""#, "null"] {
            assert_eq!(
                refuse(not_an_object),
                SubmitBodyError::Shape {
                    message: "the body must be a JSON object with `operation` and `params`".into()
                },
                "{not_an_object}"
            );
        }
        assert_eq!(
            refuse(r#"{"operation":"generation.dispatch"}"#),
            SubmitBodyError::Shape {
                message: "missing field `params`".into()
            }
        );
        assert!(matches!(
            refuse(r#"{"operation":1,"params":{}}"#),
            SubmitBodyError::Shape { .. }
        ));
        assert_eq!(
            refuse(r#"{"operation":"nope","params":{}}"#),
            SubmitBodyError::UnknownOperation {
                operation: "nope".into()
            }
        );
        assert_eq!(
            refuse(r#"{"operation":"generation.dispatch","params":[]}"#),
            SubmitBodyError::ParamsNotObject
        );
        match refuse(r#"{"operation":"payment.release","params":{"payee":"p","amount":0}}"#) {
            SubmitBodyError::Schema {
                operation,
                error: SchemaError::Mismatch { violations, .. },
            } => {
                assert_eq!(operation, "payment.release");
                assert!(violations.len() >= 2, "{violations:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    proptest::proptest! {
        /// An integral number in any JSON spelling (`1250`, `1250.0`,
        /// `1.25e3`, `12500e-1`, `1250E+0`) is kept, fingerprinted and
        /// answered as the integer: one stored form, the one fingerprinted.
        #[test]
        fn integral_numbers_in_any_spelling_become_integers(
            n in -(1i64 << 53) + 1..(1i64 << 53),
            spelling in 0usize..5,
        ) {
            let written = match spelling {
                0 => format!("{n}"),
                1 => format!("{n}.0"),
                2 => format!("{n}E+0"),
                3 => format!("{}e-1", i128::from(n) * 10),
                _ => {
                    let zeros = (0..3u32)
                        .take_while(|k| n != 0 && n % 10i64.pow(k + 1) == 0)
                        .count();
                    let digits = n.to_string();
                    let (mantissa, tail) = digits.split_at(digits.len() - zeros);
                    format!("{mantissa}.{tail}0e{zeros}")
                }
            };
            let body = format!(
                r#"{{"operation":"generation.dispatch","params":{{"n":{written},"deep":[{{"m":{written}}}]}}}}"#
            );
            let p = prepare_submit(&bundled(), body.as_bytes()).unwrap();
            proptest::prop_assert_eq!(&p.params["n"], &Value::from(n));
            proptest::prop_assert_eq!(&p.params["deep"][0]["m"], &Value::from(n));
            proptest::prop_assert_eq!(p.params["n"].as_i64(), Some(n));
            let plain = format!(
                r#"{{"operation":"generation.dispatch","params":{{"n":{n},"deep":[{{"m":{n}}}]}}}}"#
            );
            let q = prepare_submit(&bundled(), plain.as_bytes()).unwrap();
            proptest::prop_assert_eq!(&p.canonical, &q.canonical);
            proptest::prop_assert_eq!(
                serde_json::to_string(&p.params).unwrap(),
                serde_json::to_string(&q.params).unwrap()
            );
        }
    }

    #[test]
    fn whole_params_when_the_class_names_no_material() {
        let p = prepare_submit(
            &bundled(),
            br#"{"operation":"generation.dispatch","params":{"b":[1e0],"a":"\u00e9"}}"#,
        )
        .unwrap();
        assert_eq!(
            p.canonical.canonical,
            "{\"material\":{\"\":{\"a\":\"\u{e9}\",\"b\":[1]}},\"operation\":\"generation.dispatch\"}"
        );
    }
}
