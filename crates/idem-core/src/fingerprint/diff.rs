//! Which material fields differ between two requests of one scope (SPEC §4,
//! `IDEMPOTENCY_CONFLICT`'s `differing_fields`).
//!
//! Two requests conflict when their canonical requests differ (see the
//! parent module); [`differing_fields`] names where, as RFC 6901 JSON
//! Pointers into `params`, and never what: a pointer is built from member
//! names and array indices only, so a client learns which of its fields to
//! check without idem echoing a stored value (SPEC §4: a conflict answer
//! never carries the original's params).
//!
//! The comparison is the fingerprint's: only material fields count, values
//! are compared as RFC 8785 compares them (numbers as IEEE-754 doubles, so
//! `1` and `1.0` are equal; object member order never matters), and a field
//! present in one request and absent from the other differs (as `null` and
//! absent differ). Inside a material field that is an object or an array the
//! walk descends to the deepest member or element that differs: a changed
//! `/items/1/sku` is listed as that, not as `/items`. An array that grew or
//! shrank lists the indices only one side has.

use std::collections::BTreeSet;

use serde_json::Value;

use super::JsonPointer;

/// The JSON Pointers, sorted and each once, of the material fields whose
/// canonical values differ between the `stored` params and the `new` ones,
/// for the material pointers `material` (empty: all of `params`, as
/// [`super::canonical_request`] takes it).
///
/// Empty exactly when both have the same fingerprint under `material`.
#[must_use]
pub fn differing_fields(stored: &Value, new: &Value, material: &[JsonPointer]) -> Vec<JsonPointer> {
    let whole = [JsonPointer(String::new())];
    let roots = if material.is_empty() {
        &whole[..]
    } else {
        material
    };
    let mut out = BTreeSet::new();
    for root in roots {
        walk(
            root.as_str().to_owned(),
            stored.pointer(root.as_str()),
            new.pointer(root.as_str()),
            &mut out,
        );
    }
    out.into_iter().map(JsonPointer).collect()
}

/// Adds to `out` the pointers under `at` where `a` and `b` differ.
fn walk(at: String, a: Option<&Value>, b: Option<&Value>, out: &mut BTreeSet<String>) {
    match (a, b) {
        (None, None) => {}
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                walk(child(&at, k), x.get(k), y.get(k), out);
            }
        }
        (Some(Value::Array(x)), Some(Value::Array(y))) => {
            for i in 0..x.len().max(y.len()) {
                walk(child(&at, &i.to_string()), x.get(i), y.get(i), out);
            }
        }
        (Some(x), Some(y)) if same_scalar(x, y) => {}
        _ => {
            out.insert(at);
        }
    }
}

/// The pointer to member or index `token` under `at` (RFC 6901 §4 escapes).
fn child(at: &str, token: &str) -> String {
    format!("{at}/{}", token.replace('~', "~0").replace('/', "~1"))
}

/// Whether two values that are not both objects or both arrays are equal
/// under RFC 8785: numbers as doubles (§3.2.2.3), the rest as parsed.
fn same_scalar(x: &Value, y: &Value) -> bool {
    match (x, y) {
        (Value::Number(m), Value::Number(n)) => m.as_f64() == n.as_f64(),
        (Value::Object(_) | Value::Array(_), _) | (_, Value::Object(_) | Value::Array(_)) => false,
        _ => x == y,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::canonical_request;
    use crate::fingerprint::tests::ptrs;
    use crate::json::{parse_strict, tests::arb_value};
    use proptest::prelude::*;
    use serde_json::json;

    fn texts(v: Vec<JsonPointer>) -> Vec<String> {
        v.into_iter().map(|p| p.0).collect()
    }

    fn diff(a: &Value, b: &Value, m: &[&str]) -> Vec<String> {
        texts(differing_fields(a, b, &ptrs(m)))
    }

    #[test]
    fn names_the_changed_amount_only() {
        let a = json!({"payee": "acct-1", "amount": 100, "currency": "EUR", "memo": "x"});
        let mut b = a.clone();
        b["amount"] = json!(250);
        b["memo"] = json!("y");
        let m = ["/payee", "/amount", "/currency"];
        assert_eq!(diff(&a, &b, &m), ["/amount"]);
        // All of params material: the memo differs too.
        assert_eq!(diff(&a, &b, &[]), ["/amount", "/memo"]);
    }

    #[test]
    fn descends_into_objects_and_arrays() {
        let a = json!({"order": {"items": [{"sku": "A", "qty": 1}, {"sku": "B", "qty": 2}], "to": {"city": "Oslo"}}});
        let b = json!({"order": {"items": [{"sku": "A", "qty": 1.0}, {"sku": "C", "qty": 2}, {"sku": "D"}], "to": {"city": "Oslo", "zip": null}}});
        assert_eq!(
            diff(&a, &b, &["/order"]),
            ["/order/items/1/sku", "/order/items/2", "/order/to/zip"]
        );
        // A pointer into an array names the element's fields.
        assert_eq!(diff(&a, &b, &["/order/items/0"]), Vec::<String>::new());
        assert_eq!(diff(&a, &b, &["/order/items/1"]), ["/order/items/1/sku"]);
    }

    #[test]
    fn compares_as_rfc8785_does() {
        let a = parse_strict(br#"{"n": 1, "s": "\u0061", "z": 0}"#).unwrap();
        let b = parse_strict(br#"{"s": "a", "n": 1.0e0, "z": -0}"#).unwrap();
        assert!(diff(&a, &b, &[]).is_empty());
        // Absent and null differ; a type change is a change.
        assert_eq!(diff(&json!({}), &json!({"n": null}), &["/n"]), ["/n"]);
        assert_eq!(diff(&json!({"n": {}}), &json!({"n": []}), &[]), ["/n"]);
        assert_eq!(diff(&json!({"n": [1]}), &json!({"n": "1"}), &[]), ["/n"]);
        // Absent from both: not a difference.
        assert!(diff(&json!({}), &json!({}), &["/missing"]).is_empty());
    }

    #[test]
    fn escapes_member_names() {
        let a = json!({"a/b": {"c~d": 1}});
        let b = json!({"a/b": {"c~d": 2}});
        assert_eq!(diff(&a, &b, &["/a~1b"]), ["/a~1b/c~0d"]);
    }

    /// Every pointer to a scalar or empty container of `v`, with its tokens.
    fn leaves(v: &Value, at: &str, out: &mut Vec<String>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, x) in m {
                    leaves(x, &child(at, k), out);
                }
            }
            Value::Array(a) if !a.is_empty() => {
                for (i, x) in a.iter().enumerate() {
                    leaves(x, &child(at, &i.to_string()), out);
                }
            }
            _ => out.push(at.to_owned()),
        }
    }

    fn arb_params() -> impl Strategy<Value = Value> {
        prop::collection::btree_map("[a-z~/]{1,4}", arb_value(), 1..6)
            .prop_map(|m| Value::Object(m.into_iter().collect()))
    }

    /// Params, some of their leaves (by pointer) and a mark per leaf.
    fn arb_params_and_leaves() -> impl Strategy<Value = (Value, Vec<String>)> {
        arb_params().prop_flat_map(|v| {
            let mut all = Vec::new();
            leaves(&v, "", &mut all);
            let n = all.len();
            (Just(v), prop::sample::subsequence(all, 0..=n))
        })
    }

    fn fingerprint(v: &Value, m: &[JsonPointer]) -> String {
        canonical_request("op", v, m)
            .unwrap()
            .fingerprint
            .to_string()
    }

    proptest! {
        /// Replacing some leaves lists exactly those leaves, and no pointer
        /// carries a value (the new values are marked `SECRET`, which no
        /// generated member name can contain).
        #[test]
        fn lists_exactly_the_changed_leaves_and_never_a_value((a, changed) in arb_params_and_leaves()) {
            let mut b = a.clone();
            for (i, p) in changed.iter().enumerate() {
                *b.pointer_mut(p).unwrap() = json!(format!("SECRET-{i}-longer-than-any-generated-string"));
            }
            let got = differing_fields(&a, &b, &[]);
            let got = texts(got);
            let mut want = changed.clone();
            want.sort();
            prop_assert_eq!(&got, &want);
            prop_assert!(got.iter().all(|p| !p.contains("SECRET")));
            prop_assert_eq!(got.is_empty(), fingerprint(&a, &[]) == fingerprint(&b, &[]));
        }

        /// Changes outside the material fields are never listed; changes
        /// inside them are listed under a material pointer.
        #[test]
        fn non_material_fields_are_never_listed((a, changed) in arb_params_and_leaves(), take in 0usize..4) {
            let Value::Object(members) = &a else { unreachable!() };
            let material: Vec<JsonPointer> = members
                .keys()
                .take(take)
                .map(|k| JsonPointer::from_tokens([k]))
                .collect();
            let mut b = a.clone();
            for p in &changed {
                *b.pointer_mut(p).unwrap() = json!("SECRET-changed-longer-than-generated");
            }
            let got = differing_fields(&a, &b, &material);
            let m: Vec<&str> = material.iter().map(JsonPointer::as_str).collect();
            let inside = |p: &str| m.iter().any(|r| p == *r || p.starts_with(&format!("{r}/")));
            let mut want: Vec<String> = changed.iter().filter(|p| inside(p)).cloned().collect();
            want.sort();
            if material.is_empty() {
                // No material pointers: all of params is material.
                want = changed.clone();
                want.sort();
            }
            prop_assert_eq!(texts(got.clone()), want);
            prop_assert_eq!(got.is_empty(), fingerprint(&a, &material) == fingerprint(&b, &material));
        }

        /// For any two params and any material pointers drawn from either,
        /// the list is empty exactly when the fingerprints are equal, and
        /// every listed pointer resolves differently in the two.
        #[test]
        fn empty_exactly_when_fingerprints_match(a in arb_params(), b in arb_params(), same in any::<bool>(), pick in prop::collection::vec(any::<prop::sample::Index>(), 0..4)) {
            let b = if same { a.clone() } else { b };
            let mut all = Vec::new();
            leaves(&a, "", &mut all);
            leaves(&b, "", &mut all);
            let material: Vec<JsonPointer> = pick.iter().map(|i| JsonPointer(i.get(&all).clone())).collect();
            let got = differing_fields(&a, &b, &material);
            prop_assert_eq!(got.is_empty(), fingerprint(&a, &material) == fingerprint(&b, &material));
            for p in &got {
                let (x, y) = (a.pointer(p.as_str()), b.pointer(p.as_str()));
                prop_assert!(x.is_some() || y.is_some());
                prop_assert!(!matches!((x, y), (Some(x), Some(y)) if same_scalar(x, y)));
            }
        }
    }
}
