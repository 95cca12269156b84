//! The committed OpenAPI document (docs/openapi.json) is the one the handlers
//! generate: a change of the API shows up in review. Regenerate with
//! `cargo run -- openapi > docs/openapi.json`.

#[test]
fn committed_openapi_matches_generated() {
    let generated = serde_json::to_value(idem_http::openapi()).unwrap();
    let committed: serde_json::Value =
        serde_json::from_str(include_str!("../../../docs/openapi.json")).unwrap();
    assert_eq!(
        generated, committed,
        "docs/openapi.json is stale: run `cargo run -- openapi > docs/openapi.json`"
    );
    assert!(generated["openapi"].as_str().unwrap().starts_with("3.1"));
    for path in [
        "/v1/tasks",
        "/v1/tasks/{id}",
        "/v1/tasks/{id}/attempts",
        "/v1/tasks/{id}/events",
        "/v1/tasks/{id}/cancel",
        "/v1/tasks/{id}/delivery/ack",
        "/v1/attempts/claim",
        "/v1/attempts/{id}/heartbeat",
        "/v1/attempts/{id}/ack",
        "/v1/attempts/{id}/report",
        "/v1/attempts/{id}/release",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
    ] {
        assert!(generated["paths"].get(path).is_some(), "missing {path}");
    }
}

/// Every Response Object has a description (OpenAPI 3.1 §4.8.17: required).
#[test]
fn every_response_has_a_description() {
    let doc = serde_json::to_value(idem_http::openapi_for(["payment.release"])).unwrap();
    let mut seen = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            for (status, response) in op["responses"].as_object().unwrap() {
                seen += 1;
                let d = response["description"].as_str().unwrap_or("");
                assert!(
                    !d.trim().is_empty(),
                    "{method} {path} {status}: no description"
                );
            }
        }
    }
    assert!(seen > 50, "{seen} responses");
}

/// A report may name only the failure classes an executor observes; the
/// document lists exactly those for `ReportBody.failure_class`, while a task's
/// `failure.class` keeps every class.
#[test]
fn report_failure_class_lists_only_reportable_classes() {
    use idem_core::model::FailureClass;
    let doc = serde_json::to_value(idem_http::openapi()).unwrap();
    let schemas = &doc["components"]["schemas"];
    let listed = &schemas["ReportBody"]["properties"]["failure_class"]["oneOf"][0]["enum"];
    let reportable: Vec<&str> = FailureClass::ALL
        .iter()
        .filter(|c| c.is_reportable())
        .map(|c| c.as_str())
        .collect();
    assert_eq!(listed, &serde_json::json!(reportable), "{listed}");
    assert_eq!(
        schemas["FailureClass"]["enum"].as_array().map(Vec::len),
        Some(FailureClass::ALL.len())
    );
}

/// `external_txn_id` of an acknowledgment is required though it may be
/// `null` (SPEC §4 "Operator actions": `null` names the second effect
/// reported without an id, a missing one is 400): the document lists it
/// among the body's `required` members, so a generated client sends it.
#[test]
fn acknowledge_effect_body_requires_external_txn_id() {
    let doc = serde_json::to_value(idem_http::openapi()).unwrap();
    let body = &doc["components"]["schemas"]["AcknowledgeEffectBody"];
    let required: Vec<&str> = body["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for member in ["external_txn_id", "resolution", "reason"] {
        assert!(
            required.contains(&member),
            "{member} not required: {required:?}"
        );
    }
    assert_eq!(
        body["properties"]["external_txn_id"]["type"],
        serde_json::json!(["string", "null"])
    );
}
