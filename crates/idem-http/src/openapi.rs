//! The OpenAPI 3.1 document of the API: the handlers' own documentation
//! (collected by [`crate::api_router`]), the two routes served beside them,
//! bearer authentication, links from a submit's and a claim's answer to the
//! operations on their ids, and the operation classes of a configuration.

use idem_core::model::{Attempt, Event, Outcome, Task};
use utoipa::OpenApi;

use crate::api::wire::{ClaimedAttempt, FeedEvent};
use crate::problem::Problem;

#[derive(OpenApi)]
#[openapi(
    info(title = "idem", description = "A durable coordinator for duplicate-sensitive work: idempotency keys bound to request fingerprints, leased attempts with fencing generations, retries by failure class, reconciliation of unknown outcomes, cancellation ordered against delivery."),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    // The records and words the generic documents of `idem-api` carry: their
    // fields only refer to these schemas, so they are listed here.
    components(schemas(Task, Attempt, Event, ClaimedAttempt, FeedEvent, Outcome)),
    tags((name = "tasks", description = "Clients: submit and follow tasks"), (name = "attempts", description = "Executors: claim, heartbeat, acknowledge, report, release"), (name = "operator", description = "Admins: retry-now, resolve, redrive (and cancel with a reason), each recorded with the key and the reason"), (name = "operations", description = "Health, readiness, metrics"))
)]
pub(crate) struct ApiDoc;

struct BearerAuth;

/// The two routes [`crate::router`] serves outside [`crate::api_router`], in the document.
#[derive(OpenApi)]
#[openapi(paths(metrics_doc, openapi_doc))]
struct ServedDocs;

/// Prometheus metrics (text exposition format 0.0.4; docs/operations.md).
#[utoipa::path(get, path = "/metrics", operation_id = "metrics", tag = "operations", security(()),
    responses((status = 200, body = String, content_type = "text/plain"), (status = 503, body = Problem, content_type = "application/problem+json")))]
#[allow(dead_code)]
fn metrics_doc() {}

/// This OpenAPI 3.1 document, listing this server's operation classes.
#[utoipa::path(get, path = "/openapi.json", operation_id = "openapi", tag = "operations", security(()),
    responses((status = 200, body = Object, content_type = "application/json")))]
#[allow(dead_code)]
fn openapi_doc() {}

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI 3.1 document of this API, for any configuration (`operation`
/// is any string; [`crate::router`] serves the document of its own configuration,
/// whose operation classes are listed, see [`openapi_for`]).
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = crate::api_router().split_for_parts().1;
    doc.merge(ServedDocs::openapi());
    add_links(&mut doc);
    describe_responses(&mut doc);
    reportable_failure_classes(&mut doc);
    doc
}

/// A report's `failure_class` lists only the classes an executor may report
/// (`transient`, `invalid_input`, `permission_denied`;
/// [`idem_core::model::FailureClass::is_reportable`]): the others are decided
/// by idem, and a report naming one gets 400 `INVALID_REQUEST`. The task's own
/// `failure.class` keeps the whole `FailureClass` list.
fn reportable_failure_classes(doc: &mut utoipa::openapi::OpenApi) {
    use idem_core::model::FailureClass;
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Schema, Type};
    let Some(RefOr::T(Schema::Object(body))) = doc
        .components
        .as_mut()
        .and_then(|c| c.schemas.get_mut("ReportBody"))
    else {
        return;
    };
    let reportable = FailureClass::ALL
        .iter()
        .filter(|c| c.is_reportable())
        .map(|c| c.as_str());
    let class = ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(reportable))
        .description(Some(
            "Required with `failed`: `transient`, `invalid_input` or `permission_denied` (idem decides the other failure classes itself).",
        ));
    let nullable = OneOfBuilder::new()
        .item(class)
        .item(ObjectBuilder::new().schema_type(Type::Null))
        .build();
    body.properties.insert(
        "failure_class".to_owned(),
        RefOr::T(Schema::OneOf(nullable)),
    );
}

/// Gives every response without a description its status's reason phrase
/// (`Unauthorized`, `Service Unavailable` …): OpenAPI 3.1 §4.8.17 requires a
/// description on every Response Object.
fn describe_responses(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::RefOr;
    for item in doc.paths.paths.values_mut() {
        for op in [&mut item.get, &mut item.post].into_iter().flatten() {
            for (status, response) in &mut op.responses.responses {
                if let RefOr::T(r) = response
                    && r.description.trim().is_empty()
                {
                    r.description = status
                        .parse::<u16>()
                        .ok()
                        .and_then(|s| axum::http::StatusCode::from_u16(s).ok())
                        .and_then(|s| s.canonical_reason())
                        .unwrap_or("Response")
                        .to_owned();
                }
            }
        }
    }
}

/// [`openapi`] for a server configured with the operation classes
/// `classes`: the submit body's `operation`, the lookup's `operation` and the
/// claim's `operations` list them (`enum`), so a client generated from
/// `/openapi.json` knows what this server accepts.
pub fn openapi_for<'a>(classes: impl IntoIterator<Item = &'a str>) -> utoipa::openapi::OpenApi {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::{ArrayItems, Schema};
    let names: Vec<serde_json::Value> = classes.into_iter().map(Into::into).collect();
    let mut doc = openapi();
    let listed = |schema: &mut RefOr<Schema>| {
        if let RefOr::T(Schema::Object(o)) = schema {
            o.enum_values = Some(names.clone());
        }
    };
    if let Some(schemas) = doc.components.as_mut().map(|c| &mut c.schemas) {
        if let Some(RefOr::T(Schema::Object(body))) = schemas.get_mut("SubmitBody")
            && let Some(operation) = body.properties.get_mut("operation")
        {
            listed(operation);
        }
        if let Some(RefOr::T(Schema::Object(body))) = schemas.get_mut("ClaimBody")
            && let Some(RefOr::T(Schema::Array(list))) = body.properties.get_mut("operations")
            && let ArrayItems::RefOrSchema(item) = &mut list.items
        {
            listed(item);
        }
    }
    if let Some(lookup) = doc
        .paths
        .paths
        .get_mut("/v1/tasks")
        .and_then(|p| p.get.as_mut())
    {
        for param in lookup.parameters.iter_mut().flatten() {
            if let RefOr::T(param) = param
                && param.name == "operation"
                && let Some(schema) = param.schema.as_mut()
            {
                listed(schema);
            }
        }
    }
    doc
}

/// OpenAPI links (3.1 §4.8.20): the task a submit answers with is the `id` of
/// the task's own operations, and a claimed attempt's `id` that of the
/// attempt's, so a client (or schemathesis's stateful phase) can follow them.
fn add_links(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::link::Link;
    let mut link = |path: &str, status: &str, source: &str, targets: &[(&str, &str)]| {
        let Some(RefOr::T(response)) = doc
            .paths
            .paths
            .get_mut(path)
            .and_then(|p| p.post.as_mut())
            .and_then(|op| op.responses.responses.get_mut(status))
        else {
            return;
        };
        for (name, operation_id) in targets {
            let to = Link::builder()
                .operation_id(*operation_id)
                .parameter("id", source)
                .build();
            response.links.insert((*name).to_owned(), RefOr::T(to));
        }
    };
    link(
        "/v1/tasks",
        "201",
        "$response.body#/task/id",
        &[
            ("GetTask", "get_task"),
            ("ListAttempts", "list_attempts"),
            ("ListEvents", "list_events"),
            ("CancelTask", "cancel_task"),
            ("AcknowledgeDelivery", "acknowledge_delivery"),
        ],
    );
    link(
        "/v1/attempts/claim",
        "200",
        "$response.body#/attempts/0/id",
        &[
            ("Heartbeat", "heartbeat"),
            ("Acknowledge", "acknowledge"),
            ("Report", "report"),
            ("Release", "release"),
        ],
    );
}
