//! Logging and span export: the `tracing` subscriber every command logs
//! through, and for `idem serve --otlp-endpoint` (`IDEM_OTLP_ENDPOINT`) the
//! OpenTelemetry pipeline idem's spans ([`idem_store::spans`]) are exported
//! by, over OTLP/HTTP with protobuf bodies.
//!
//! Without an endpoint the subscriber is the log output alone, idem's span
//! target is off in it, and no OpenTelemetry layer or provider exists: a span
//! costs a cached callsite check. With one, a second layer gets idem's spans
//! (and nothing else) and hands them to a batch processor that sends them
//! from a thread of its own; [`Telemetry::shutdown`] sends what is left.
//!
//! The standard `OTEL_*` variables of the OpenTelemetry SDK apply on top
//! (e.g. `OTEL_TRACES_SAMPLER`, `OTEL_BSP_SCHEDULE_DELAY`,
//! `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`); the endpoint is idem's own setting.

use std::time::Duration;

use anyhow::{Context, Result};
use idem_store::spans::TARGET;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

/// The OTLP/HTTP path of traces (OTLP specification, "OTLP/HTTP Request"),
/// added to an endpoint given as the collector's base URL.
const TRACES_PATH: &str = "/v1/traces";

/// How long [`Telemetry::shutdown`] waits for the last spans to be sent.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The span export of a running process (none without an endpoint).
#[must_use = "call `shutdown` to send the spans still buffered"]
pub(crate) struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// Installs the process's `tracing` subscriber: logs on stderr filtered by
/// `RUST_LOG` (default `info`), and, with `otlp_endpoint`, idem's spans
/// exported to it.
///
/// # Errors
/// An endpoint that is not an `http://` or `https://` URL, or an exporter
/// that cannot be built.
pub(crate) fn init(otlp_endpoint: Option<&str>) -> Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info"))
        // Spans go to the exporter, not to the log (a directive for a target
        // replaces any `RUST_LOG` gives it).
        .add_directive(
            format!("{TARGET}=off")
                .parse()
                .context("the span target's log directive")?,
        );
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let Some(endpoint) = otlp_endpoint else {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            // A log line that cannot be written (stderr closed) is dropped;
            // the default reports that with `eprintln!`, which panics on a
            // closed stderr.
            .log_internal_errors(false)
            .init();
        return Ok(Telemetry { provider: None });
    };
    let url = traces_url(endpoint)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url.clone())
        .build()
        .with_context(|| format!("building the OTLP exporter for {url}"))?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("idem");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            resource
                .with_attribute(opentelemetry::KeyValue::new(
                    "service.version",
                    env!("CARGO_PKG_VERSION"),
                ))
                .build(),
        )
        .build();
    // Attempt spans are built with the global provider.
    opentelemetry::global::set_tracer_provider(provider.clone());
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("idem"))
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::INFO));
    let logs = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .log_internal_errors(false)
        .with_filter(filter);
    tracing_subscriber::registry().with(logs).with(spans).init();
    tracing::info!(endpoint = %url, "exporting spans over OTLP/HTTP");
    Ok(Telemetry {
        provider: Some(provider),
    })
}

/// The URL spans are sent to: `endpoint` when it already ends in
/// `/v1/traces`, else `endpoint` (the collector's base URL, e.g.
/// `http://localhost:4318`) with `/v1/traces` added.
///
/// # Errors
/// An endpoint that is not an `http://` or `https://` URL.
fn traces_url(endpoint: &str) -> Result<String> {
    let endpoint = endpoint.trim();
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        anyhow::bail!(
            "--otlp-endpoint / IDEM_OTLP_ENDPOINT must be an http:// or https:// URL (the collector's OTLP/HTTP receiver, e.g. http://localhost:4318), got `{endpoint}`"
        );
    }
    let base = endpoint.trim_end_matches('/');
    Ok(if base.ends_with(TRACES_PATH) {
        base.to_owned()
    } else {
        format!("{base}{TRACES_PATH}")
    })
}

impl Telemetry {
    /// Sends the spans still buffered and stops the exporter (at most
    /// [`SHUTDOWN_TIMEOUT`]); a failure is logged, not returned: the
    /// command's own outcome stands.
    pub(crate) async fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        // The provider blocks until its thread has sent the last batch.
        let done =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT))
                .await;
        match done {
            Ok(Ok(())) => tracing::info!("span exporter flushed and stopped"),
            Ok(Err(e)) => tracing::warn!(error = %e, "span exporter did not flush"),
            Err(e) => tracing::warn!(error = %e, "span exporter did not flush"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_endpoint_is_the_collectors_base_url() {
        assert_eq!(
            traces_url("http://localhost:4318").unwrap(),
            "http://localhost:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://otel.example:4318/").unwrap(),
            "https://otel.example:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://c:4318/v1/traces").unwrap(),
            "http://c:4318/v1/traces"
        );
        assert!(traces_url("localhost:4318").is_err());
        assert!(traces_url("").is_err());
    }
}
