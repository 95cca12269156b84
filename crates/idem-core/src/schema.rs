//! JSON Schemas that an operation class's `params` must match (SPEC §5
//! `params_schema`).
//!
//! A schema is compiled once, when the configuration is checked
//! ([`crate::config::Config::check`]), with the `jsonschema` crate (draft
//! 2020-12 unless the schema's `$schema` names another). Only the schema
//! itself is read: `jsonschema` is built without its HTTP and file
//! resolvers, so a `$ref` to another document refuses the schema instead of
//! fetching anything. Validation is pure computation over the parsed params.
//!
//! Numbers: JSON Schema's `integer` is a number whose value is an integer, so
//! `1.0` is an integer (as RFC 8785 equates `1.0` and `1` in the fingerprint);
//! `1.5` is not.

use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Longest message kept for one violation (characters); a message that
/// quotes a long submitted value is cut there and ends with `…`.
pub const MAX_MESSAGE_CHARS: usize = 200;

/// Violations listed at most for one submit; the rest are counted.
pub const MAX_VIOLATIONS: usize = 10;

/// A class's params schema: the JSON document as configured and, once
/// compiled, its validator. Equality and serialisation use the document only.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ParamsSchema {
    document: Value,
    #[serde(skip)]
    compiled: OnceLock<Arc<jsonschema::Validator>>,
}

impl PartialEq for ParamsSchema {
    fn eq(&self, other: &Self) -> bool {
        self.document == other.document
    }
}

impl std::fmt::Debug for ParamsSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamsSchema")
            .field("document", &self.document)
            .field("compiled", &self.compiled.get().is_some())
            .finish()
    }
}

/// One way the params fail their schema.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// JSON Pointer (RFC 6901) into the submit body of the failing value,
    /// always under `/params` (for a missing member: where it would be, e.g.
    /// `/params/currency`).
    pub pointer: String,
    /// What is wrong, e.g. `"currency" is a required property`.
    pub message: String,
}

/// Why params were not accepted by [`ParamsSchema::validate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    /// The params do not match: at most [`MAX_VIOLATIONS`] violations, in
    /// the validator's order, and how many there were in all.
    #[error("{}", describe(violations, *total))]
    Mismatch {
        /// The first violations.
        violations: Vec<Violation>,
        /// All violations found.
        total: usize,
    },
    /// The schema itself does not compile (a configuration that was not
    /// checked; [`crate::config::Config::check`] refuses it).
    #[error("params_schema does not compile: {0}")]
    Compile(String),
}

fn describe(violations: &[Violation], total: usize) -> String {
    let mut text = violations
        .iter()
        .map(|v| format!("{}: {}", v.pointer, v.message))
        .collect::<Vec<_>>()
        .join("; ");
    if total > violations.len() {
        text.push_str(&format!("; and {} more", total - violations.len()));
    }
    text
}

impl ParamsSchema {
    /// A schema from its JSON document, not yet compiled.
    pub fn new(document: Value) -> ParamsSchema {
        ParamsSchema {
            document,
            compiled: OnceLock::new(),
        }
    }

    /// The schema as configured.
    pub fn document(&self) -> &Value {
        &self.document
    }

    /// Compiles the schema (once; later calls return the same validator).
    ///
    /// # Errors
    /// [`SchemaError::Compile`] when the document is not a valid schema of
    /// its draft, has a bad regular expression, or refers (`$ref`) to a
    /// document other than itself.
    pub fn compile(&self) -> Result<&jsonschema::Validator, SchemaError> {
        if let Some(v) = self.compiled.get() {
            return Ok(v);
        }
        enforced_keywords_only(&self.document, "")?;
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .should_ignore_unknown_formats(false)
            .build(&self.document)
            .map_err(|e| SchemaError::Compile(e.to_string()))?;
        Ok(self.compiled.get_or_init(|| Arc::new(validator)))
    }

    /// Checks `params` (the submit body's `params` member) against the schema.
    ///
    /// # Errors
    /// [`SchemaError::Mismatch`] naming each failing value by its pointer into
    /// the submit body; [`SchemaError::Compile`] as [`ParamsSchema::compile`].
    pub fn validate(&self, params: &Value) -> Result<(), SchemaError> {
        let validator = self.compile()?;
        let mut violations = Vec::new();
        let mut total = 0;
        for e in validator.iter_errors(params) {
            total += 1;
            if violations.len() < MAX_VIOLATIONS {
                violations.push(violation(&e));
            }
        }
        if total == 0 {
            Ok(())
        } else {
            Err(SchemaError::Mismatch { violations, total })
        }
    }
}

/// Keywords whose value is one subschema.
const ONE_SCHEMA: &[&str] = &[
    "not",
    "if",
    "then",
    "else",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "additionalItems",
    "items",
];

/// Keywords whose value is an array of subschemas (`items` of older drafts
/// may be one too).
const SCHEMA_LIST: &[&str] = &["allOf", "anyOf", "oneOf", "prefixItems", "items"];

/// Keywords whose value maps names to subschemas.
const SCHEMA_MAP: &[&str] = &[
    "properties",
    "patternProperties",
    "dependentSchemas",
    "$defs",
    "definitions",
];

/// Assertions that `jsonschema` enforces, and keywords that only name,
/// identify or annotate (they promise nothing about the params).
const OTHER_KEYWORDS: &[&str] = &[
    "type",
    "enum",
    "const",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "maxContains",
    "minContains",
    "maxProperties",
    "minProperties",
    "required",
    "dependentRequired",
    "dependencies",
    "format",
    "$ref",
    "$dynamicRef",
    "$anchor",
    "$dynamicAnchor",
    "$id",
    "$schema",
    "$comment",
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
];

/// The `format` names `jsonschema` checks (built without IDNA support): a
/// schema naming another would accept any string there.
const FORMATS: &[&str] = &[
    "date",
    "date-time",
    "time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "iri",
    "iri-reference",
    "json-pointer",
    "relative-json-pointer",
    "regex",
    "uri",
    "uri-reference",
    "uri-template",
    "uuid",
];

/// Refuses a schema that uses a keyword idem does not enforce (a typo such
/// as `requird`, or `contentMediaType`, an annotation only since draft
/// 2019-09) or a `format` it does not check: each would let params through
/// that the schema's author meant to refuse. `at` is the JSON Pointer of
/// `schema` within the document, for the message.
fn enforced_keywords_only(schema: &Value, at: &str) -> Result<(), SchemaError> {
    let Value::Object(members) = schema else {
        // `true` / `false` are schemas; anything else the compiler refuses.
        return Ok(());
    };
    let refuse = |what: String| Err(SchemaError::Compile(what));
    for (name, value) in members {
        let here = format!("{at}/{}", name.replace('~', "~0").replace('/', "~1"));
        let list = SCHEMA_LIST.contains(&name.as_str());
        let one = ONE_SCHEMA.contains(&name.as_str());
        if SCHEMA_MAP.contains(&name.as_str()) {
            if let Value::Object(map) = value {
                for (key, sub) in map {
                    let key = key.replace('~', "~0").replace('/', "~1");
                    enforced_keywords_only(sub, &format!("{here}/{key}"))?;
                }
            }
        } else if list && value.is_array() {
            for (i, sub) in value.as_array().into_iter().flatten().enumerate() {
                enforced_keywords_only(sub, &format!("{here}/{i}"))?;
            }
        } else if one || list {
            enforced_keywords_only(value, &here)?;
        } else if name == "format" {
            match value.as_str() {
                Some(f) if FORMATS.contains(&f) => {}
                _ => {
                    return refuse(format!(
                        "{here}: format {value} is not one idem checks ({})",
                        FORMATS.join(", ")
                    ));
                }
            }
        } else if !OTHER_KEYWORDS.contains(&name.as_str()) {
            return refuse(format!(
                "{here}: `{name}` is not a keyword idem enforces; params would not be checked \
                 against it"
            ));
        }
    }
    Ok(())
}

fn violation(e: &jsonschema::ValidationError<'_>) -> Violation {
    let mut pointer = format!("/params{}", e.instance_path().as_str());
    if let jsonschema::error::ValidationErrorKind::Required {
        property: Value::String(name),
    } = e.kind()
    {
        pointer.push('/');
        pointer.push_str(&name.replace('~', "~0").replace('/', "~1"));
    }
    let mut message = e.to_string();
    if message.chars().count() > MAX_MESSAGE_CHARS {
        message = message.chars().take(MAX_MESSAGE_CHARS - 1).collect();
        message.push('…');
    }
    Violation { pointer, message }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    fn payment() -> ParamsSchema {
        ParamsSchema::new(json!({
            "type": "object",
            "required": ["payee", "amount", "currency"],
            "properties": {
                "payee": {"type": "string", "minLength": 1},
                "amount": {"type": "integer", "minimum": 1},
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"}
            }
        }))
    }

    fn mismatch(schema: &ParamsSchema, params: Value) -> Vec<Violation> {
        match schema.validate(&params) {
            Err(SchemaError::Mismatch { violations, .. }) => violations,
            other => panic!("{params}: {other:?}"),
        }
    }

    /// `format` is enforced (`2026-02-30` is no date), and a schema with a
    /// keyword or format idem does not enforce does not compile.
    #[test]
    fn formats_are_checked_and_unenforced_keywords_refused() {
        let dated = ParamsSchema::new(json!({
            "type": "object",
            "properties": {"on": {"type": "string", "format": "date"}}
        }));
        assert!(dated.validate(&json!({"on": "2026-02-28"})).is_ok());
        let v = mismatch(&dated, json!({"on": "2026-02-30"}));
        assert_eq!(v[0].pointer, "/params/on");
        for (schema, named) in [
            (json!({"type": "object", "requird": ["a"]}), "/requird"),
            (
                json!({"properties": {"a": {"type": "string", "contentMediaType": "application/json"}}}),
                "/properties/a/contentMediaType",
            ),
            (
                json!({"allOf": [{"properties": {"x": {"format": "credit-card"}}}]}),
                "/allOf/0/properties/x/format",
            ),
            (
                json!({"$defs": {"d": {"maxLenght": 3}}}),
                "/$defs/d/maxLenght",
            ),
        ] {
            match ParamsSchema::new(schema.clone()).compile() {
                Err(SchemaError::Compile(m)) => assert!(m.starts_with(named), "{m}"),
                other => panic!("{schema}: {other:?}"),
            }
        }
    }

    #[test]
    fn names_the_pointer_into_the_body() {
        let s = payment();
        let v = mismatch(&s, json!({"payee": "p", "amount": 5}));
        assert_eq!(
            v,
            [Violation {
                pointer: "/params/currency".into(),
                message: "\"currency\" is a required property".into()
            }]
        );
        let v = mismatch(&s, json!({"payee": "p", "amount": -5, "currency": "EUR"}));
        assert_eq!(v[0].pointer, "/params/amount");
        assert_eq!(v[0].message, "-5 is less than the minimum of 1");
        let v = mismatch(&s, json!({"payee": "p", "amount": 1.5, "currency": "EUR"}));
        assert_eq!(v[0].pointer, "/params/amount");
        assert_eq!(v[0].message, "1.5 is not of type \"integer\"");
        let v = mismatch(&s, json!({"payee": "", "amount": 1, "currency": "eur"}));
        let pointers: Vec<&str> = v.iter().map(|v| v.pointer.as_str()).collect();
        assert_eq!(pointers.len(), 2);
        assert!(pointers.contains(&"/params/payee"), "{pointers:?}");
        assert!(pointers.contains(&"/params/currency"), "{pointers:?}");
    }

    /// JSON Schema's `integer` is about the value: `1.0` is one.
    #[test]
    fn an_integral_float_is_an_integer_and_extra_members_are_allowed() {
        let s = payment();
        let params: Value =
            crate::json::parse_strict(br#"{"payee":"p","amount":1.0,"currency":"EUR","memo":"x"}"#)
                .unwrap();
        s.validate(&params).unwrap();
        s.validate(&json!({"payee": "p", "amount": 1, "currency": "EUR"}))
            .unwrap();
    }

    #[test]
    fn says_how_many_more_and_cuts_long_messages() {
        let s = ParamsSchema::new(json!({
            "type": "object",
            "additionalProperties": {"type": "integer"}
        }));
        let params: serde_json::Map<String, Value> = (0..15)
            .map(|i| (format!("k{i:02}"), Value::String("x".repeat(500))))
            .collect();
        match s.validate(&Value::Object(params)) {
            Err(e @ SchemaError::Mismatch { .. }) => {
                let SchemaError::Mismatch { violations, total } = &e else {
                    unreachable!()
                };
                assert_eq!((violations.len(), *total), (MAX_VIOLATIONS, 15));
                assert!(violations.iter().all(|v| v.message.chars().count() <= 200));
                assert!(e.to_string().ends_with("; and 5 more"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_bad_schema_or_a_remote_reference_does_not_compile() {
        for doc in [
            json!({"type": "nope"}),
            json!({"type": "string", "pattern": "("}),
            json!({"$ref": "https://example.invalid/schema.json"}),
            json!({"$ref": "file:///etc/passwd"}),
        ] {
            let s = ParamsSchema::new(doc.clone());
            assert!(matches!(s.compile(), Err(SchemaError::Compile(_))), "{doc}");
        }
        // A reference inside the schema itself is fine.
        let s = ParamsSchema::new(json!({
            "$defs": {"code": {"type": "string"}},
            "properties": {"c": {"$ref": "#/$defs/code"}}
        }));
        assert!(s.validate(&json!({"c": 1})).is_err());
        s.validate(&json!({"c": "x"})).unwrap();
    }
}
