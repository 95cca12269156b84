//! Tracing (SPEC §4 `traceparent`, §5 "Tracing"): a submit's W3C
//! `traceparent` is kept on the task and handed to executors with each
//! claimed attempt, a malformed one is refused before anything is written,
//! and with `IDEM_OTLP_ENDPOINT` set a real `idem serve` exports the
//! request's span and the attempt's span in the submitter's trace to an OTLP
//! receiver run by the test (OTLP/HTTP, protobuf bodies decoded with
//! `opentelemetry-proto`), flushing them on a graceful shutdown.

use std::sync::{Arc, Mutex};

use idem_client::{Client, ReportBody, TaskState};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use serde_json::json;

use crate::support::{Options, Server, ikey, payment, send};

/// A fresh sampled `traceparent` and its trace id and parent id (hex).
fn traceparent() -> (String, String, String) {
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let parent_id = uuid::Uuid::new_v4().simple().to_string()[..16].to_owned();
    (format!("00-{trace_id}-{parent_id}-01"), trace_id, parent_id)
}

/// An OTLP/HTTP trace receiver on 127.0.0.1: every export request it got,
/// decoded.
struct Receiver {
    /// `http://127.0.0.1:PORT` (the collector's base URL).
    url: String,
    got: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
}

impl Receiver {
    async fn start() -> Receiver {
        let got: Arc<Mutex<Vec<ExportTraceServiceRequest>>> = Arc::default();
        let keep = Arc::clone(&got);
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let keep = Arc::clone(&keep);
                async move {
                    let req = ExportTraceServiceRequest::decode(body)
                        .expect("an ExportTraceServiceRequest protobuf");
                    keep.lock().unwrap().push(req);
                    (
                        [("content-type", "application/x-protobuf")],
                        ExportTraceServiceResponse::default().encode_to_vec(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver { url, got }
    }

    /// Every span received, with its resource's `service.name`.
    fn spans(&self) -> Vec<(String, Span)> {
        let got = self.got.lock().unwrap();
        let mut out = Vec::new();
        for req in got.iter() {
            for rs in &req.resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .and_then(|r| attr(&r.attributes, "service.name"))
                    .unwrap_or_default();
                for ss in &rs.scope_spans {
                    for span in &ss.spans {
                        out.push((service.clone(), span.clone()));
                    }
                }
            }
        }
        out
    }
}

/// The value of attribute `key` as text (strings as they are, integers in
/// decimal).
fn attr(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    match value.value.as_ref()? {
        AnyValue::StringValue(s) => Some(s.clone()),
        AnyValue::IntValue(i) => Some(i.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Tracing export: with `IDEM_OTLP_ENDPOINT` pointed at a receiver, a submit
/// with a `traceparent` yields a request span and an attempt span of the
/// submitted trace id (both children of the submitter's span), the claim
/// carries the `traceparent`, and the store operation's span is a child of
/// its request's; the spans reach the receiver when the server shuts down
/// gracefully (the batch is flushed, not left behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_submit_exports_request_and_attempt_spans_of_its_trace() {
    let receiver = Receiver::start().await;
    let mut srv =
        Server::start_with(Options::default().env("IDEM_OTLP_ENDPOINT", &receiver.url)).await;
    let (tp, trace_id, parent_id) = traceparent();
    let client = Client::new(&srv.url, srv.keys.acme.clone()).unwrap();
    let submitted = client
        .submit_traced("payment.release", &payment(1250), &ikey(), &tp)
        .await
        .unwrap();
    assert_eq!(submitted.task.traceparent.as_deref(), Some(tp.as_str()));

    let executor = client.with_api_key(srv.keys.exec.clone());
    let claimed = executor
        .claim("ex-traced", &["payment.release"], 1, None, 0)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    let attempt = &claimed[0];
    assert_eq!(attempt.task_id, submitted.task.id);
    assert_eq!(
        attempt.traceparent.as_deref(),
        Some(tp.as_str()),
        "the claim carries the submit's traceparent"
    );
    let done = executor
        .report(
            attempt.id,
            &ReportBody::succeeded(attempt.generation, json!({"payout": "po_1"})),
        )
        .await
        .unwrap();
    assert_eq!(done.state, TaskState::Succeeded);

    let status = srv.terminate();
    assert!(status.success(), "graceful shutdown: {status:?}");

    let spans = receiver.spans();
    assert!(
        spans.iter().all(|(service, _)| service == "idem"),
        "service.name of every span: {:?}",
        spans.iter().map(|(s, _)| s).collect::<Vec<_>>()
    );
    let trace = hex_bytes(&trace_id);
    let parent = hex_bytes(&parent_id);
    let in_trace: Vec<&Span> = spans
        .iter()
        .map(|(_, s)| s)
        .filter(|s| s.trace_id == trace)
        .collect();
    let names: Vec<&str> = in_trace.iter().map(|s| s.name.as_str()).collect();

    let request = in_trace
        .iter()
        .find(|s| s.name == "POST /v1/tasks")
        .unwrap_or_else(|| panic!("no request span in the trace; spans of the trace: {names:?}"));
    assert_eq!(
        request.parent_span_id, parent,
        "child of the submitter's span"
    );
    assert_eq!(request.kind, SpanKind::Server as i32);
    assert_eq!(
        attr(&request.attributes, "http.request.method").as_deref(),
        Some("POST")
    );
    assert_eq!(
        attr(&request.attributes, "http.route").as_deref(),
        Some("/v1/tasks")
    );
    assert_eq!(
        attr(&request.attributes, "http.response.status_code").as_deref(),
        Some("201")
    );

    let store = in_trace
        .iter()
        .find(|s| attr(&s.attributes, "db.operation.name").as_deref() == Some("Submit"))
        .unwrap_or_else(|| panic!("no store span of the submit; spans of the trace: {names:?}"));
    assert_eq!(
        store.parent_span_id, request.span_id,
        "child of the request span"
    );
    assert_eq!(
        attr(&store.attributes, "db.system.name").as_deref(),
        Some("sqlite")
    );

    let attempt_span = in_trace
        .iter()
        .find(|s| s.name == "execute payment.release")
        .unwrap_or_else(|| panic!("no attempt span in the trace; spans of the trace: {names:?}"));
    assert_eq!(
        attempt_span.parent_span_id, parent,
        "child of the submitter's span"
    );
    assert_eq!(
        attr(&attempt_span.attributes, "idem.attempt.id"),
        Some(attempt.id.to_string())
    );
    assert_eq!(
        attr(&attempt_span.attributes, "idem.task.id"),
        Some(submitted.task.id.to_string())
    );
    assert_eq!(
        attr(&attempt_span.attributes, "idem.attempt.state").as_deref(),
        Some("succeeded")
    );
    assert!(
        attempt_span.start_time_unix_nano <= attempt_span.end_time_unix_nano
            && attempt_span.start_time_unix_nano > 0,
        "the attempt span runs from its lease to its report"
    );

    // The claim and the report carried no traceparent: their requests are
    // spans of traces of their own.
    for (route, method) in [
        ("/v1/attempts/claim", "POST"),
        ("/v1/attempts/{id}/report", "POST"),
    ] {
        let name = format!("{method} {route}");
        let found: Vec<&Span> = spans
            .iter()
            .map(|(_, s)| s)
            .filter(|s| s.name == name)
            .collect();
        assert_eq!(found.len(), 1, "one {name} span");
        assert_ne!(
            found[0].trace_id, trace,
            "{name} is not in the submit's trace"
        );
        assert!(found[0].parent_span_id.is_empty(), "{name} is a root span");
    }
}

/// A trace id or span id in hex as the bytes OTLP carries.
fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

/// A malformed `traceparent` (each rule of W3C Trace Context Level 1), or two
/// of them, is 400 `INVALID_REQUEST` naming the header, and writes nothing:
/// the same key then creates its task. A retry with another `traceparent`
/// is the same request: the task as first accepted, its `traceparent`
/// unchanged. A task submitted without one shows `null`.
#[tokio::test]
async fn a_malformed_traceparent_is_refused_and_writes_nothing() {
    let srv = Server::start().await;
    let (tp, _, _) = traceparent();
    let key = ikey();
    let body = json!({"operation": "payment.release", "params": payment(7)}).to_string();
    let submit = |traceparents: &[&str]| {
        let mut req = srv
            .submit_req(&srv.keys.acme)
            .header("Idempotency-Key", key.as_str())
            .body(body.clone());
        for t in traceparents {
            req = req.header("traceparent", *t);
        }
        send(req)
    };
    let upper = tp.to_uppercase();
    for bad in [
        vec!["ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"],
        vec!["00-00000000000000000000000000000000-00f067aa0ba902b7-01"],
        vec!["00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"],
        vec![upper.as_str()],
        vec!["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1"],
        vec!["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"],
        vec!["not a traceparent"],
        vec![tp.as_str(), tp.as_str()],
    ] {
        let r = submit(&bad).await;
        r.assert_problem(400, "INVALID_REQUEST");
        assert!(
            r.json["detail"]
                .as_str()
                .unwrap_or_default()
                .contains("traceparent"),
            "{bad:?}: {}",
            r.text
        );
    }
    let lookup = srv
        .get(
            &format!("/v1/tasks?operation=payment.release&idempotency_key={key}"),
            &srv.keys.acme,
        )
        .await;
    lookup.assert_problem(404, "NOT_FOUND");

    let created = submit(&[tp.as_str()]).await;
    let task = created.ok(201)["task"].clone();
    assert_eq!(
        created.json["meta"]["replayed"],
        json!(false),
        "nothing was written before"
    );
    assert_eq!(task["traceparent"], json!(tp));
    let (other, _, _) = traceparent();
    let retry = submit(&[other.as_str()]).await;
    assert_eq!(retry.ok(201)["meta"]["replayed"], json!(true));
    assert_eq!(
        retry.json["task"], task,
        "a retry's traceparent changes nothing"
    );
    assert_eq!(
        srv.task(task["id"].as_str().unwrap()).await["traceparent"],
        json!(tp)
    );

    let plain = srv.new_task(&ikey(), "payment.release", payment(8)).await;
    assert_eq!(plain["traceparent"], serde_json::Value::Null);
    let claimed = srv
        .claim(json!({"executor_id": "ex-1", "operations": ["payment.release"], "max": 2}))
        .await;
    let attempts = claimed.ok(200)["attempts"].as_array().unwrap().clone();
    assert_eq!(attempts.len(), 2, "{}", claimed.text);
    for a in &attempts {
        let expected = if a["task_id"] == task["id"] {
            json!(tp)
        } else {
            serde_json::Value::Null
        };
        assert_eq!(a["traceparent"], expected, "{a}");
    }
}
