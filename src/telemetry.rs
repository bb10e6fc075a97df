//! Traces: one OpenTelemetry span per delivery attempt, exported over OTLP/HTTP (protobuf),
//! and off unless `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set.
//!
//! The SDK reads the standard `OTEL_*` variables itself (the service name and resource
//! attributes, the exporter's headers, timeout and compression, the sampler, the batch
//! processor's schedule); this module only decides whether traces are on, checks the values
//! the SDK would otherwise drop or replace without a word (a header that is not `name=value`,
//! an unknown sampler, an endpoint that is not a URL), and refuses them with a line that names
//! the variable and never its value: the endpoint may carry credentials and the headers hold
//! API keys.
//!
//! The spans are `tracing` spans of the target [`SPAN_TARGET`] (made in `worker::attempt`),
//! turned into OpenTelemetry spans by the `tracing-opentelemetry` layer that
//! [`Traces::layer`] returns. That layer sees nothing else (no log event becomes a span event, so no field of
//! a log line reaches the exporter), and the log layers see none of these spans
//! ([`is_trace_span`]), so the text and JSON logs are the same with traces on or off. With
//! traces off no layer is interested in the target, `tracing` caches that per call site, and
//! an attempt costs one relaxed load for its span. A failed export drops its batch and is
//! one `WARN` line a minute at most, saying only the collector's status or that it did not
//! answer (the SDK's internal logs, which would say more, quote the endpoint, and are not
//! built).
//!
//! **Invariant:** a span holds what the attempt's log line holds (the message id, the key
//! through [`crate::text::escape`], the channel, the attempt number, the outcome, the class,
//! the status, `DeliveryError::message`), never a URL's path or query, a header or the
//! payload.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{FilterFn, LevelFilter, filter_fn};
use tracing_subscriber::registry::LookupSpan;

/// The `tracing` target of the spans that are exported (and of nothing else).
pub const SPAN_TARGET: &str = "outboxd::trace";

/// The service name when neither `OTEL_SERVICE_NAME` nor `service.name` in
/// `OTEL_RESOURCE_ATTRIBUTES` gives one (the SDK's own default is `unknown_service:…`).
const SERVICE_NAME: &str = "outboxd";

/// How long the shutdown waits for the last batch to reach the collector.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The trace ratio samplers, which take `OTEL_TRACES_SAMPLER_ARG`.
const RATIO_SAMPLERS: [&str; 2] = ["traceidratio", "parentbased_traceidratio"];

/// The samplers the SDK implements (its `Config::default` reads `OTEL_TRACES_SAMPLER`; any
/// other name it replaces by `parentbased_always_on` with only an internal warning).
const SAMPLERS: [&str; 6] = [
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
];

/// A setting of the trace exporter that cannot be used: one line naming the variable,
/// never its value.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TelemetryError(String);

/// Is `meta` one of the exported spans? The log layers filter these out.
pub fn is_trace_span(meta: &tracing::Metadata<'_>) -> bool {
    meta.target() == SPAN_TARGET
}

/// The log layers' half of the rule: everything but the exported spans. Its level hint is
/// the most verbose, so that combined (`and`) with `RUST_LOG`'s filter the logs' maximum level
/// stays `RUST_LOG`'s (a filter without a hint would lift it to `trace` for every call site).
pub fn without_trace_spans() -> FilterFn<fn(&tracing::Metadata<'_>) -> bool> {
    let keep: fn(&tracing::Metadata<'_>) -> bool = |m| !is_trace_span(m);
    filter_fn(keep).with_max_level_hint(LevelFilter::TRACE)
}

/// The traces pipeline: the SDK's tracer provider with a batch processor and the OTLP/HTTP
/// exporter. [`Traces::shutdown`] flushes it.
#[derive(Debug)]
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Traces {
    /// Traces as the process environment configures them: `None` when no OTLP endpoint is
    /// set (or `OTEL_SDK_DISABLED=true`, or `OTEL_TRACES_EXPORTER=none`), an error for a
    /// value the SDK could not use.
    pub fn from_env() -> Result<Option<Traces>, TelemetryError> {
        // The SDK reads many `OTEL_*` variables itself and takes one that is not UTF-8 as
        // unset (an endpoint: no traces; headers: exports without their credentials), as
        // would `check_env` below: refused instead, naming the variable.
        for (name, value) in std::env::vars_os() {
            use std::os::unix::ffi::OsStrExt as _;
            if name.as_bytes().starts_with(b"OTEL_") && value.to_str().is_none() {
                return Err(TelemetryError(
                    crate::support::NotUtf8::of(&name).to_string(),
                ));
            }
        }
        let env = |name: &str| std::env::var(name).ok();
        if !check_env(&env)? {
            return Ok(None);
        }
        Self::start().map(Some)
    }

    /// Builds the exporter (the SDK reads the endpoint, headers, timeout and compression
    /// from the environment), the resource and the provider.
    fn start() -> Result<Traces, TelemetryError> {
        use opentelemetry_otlp::{Protocol, WithExportConfig as _};
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()
            .map_err(|e| TelemetryError(safe_build_error(&e)))?;
        let detected = opentelemetry_sdk::Resource::builder().build();
        let named = detected
            .get(&opentelemetry::Key::from_static_str("service.name"))
            .is_some_and(|v| !v.as_str().starts_with("unknown_service"));
        let resource = if named {
            detected
        } else {
            opentelemetry_sdk::Resource::builder()
                .with_service_name(SERVICE_NAME)
                .build()
        };
        let provider = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_batch_exporter(Warned::new(exporter))
            .build();
        Ok(Traces { provider })
    }

    /// The layer that turns the attempt spans into OpenTelemetry spans, and sees nothing
    /// else: no log event, no span of another target. No code location, thread, level or
    /// timing attributes: a span carries the fields the attempt gives it and no more.
    pub fn layer<S>(&self) -> impl Layer<S> + Send + Sync + 'static
    where
        S: tracing::Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("outboxd"))
            .with_location(false)
            .with_threads(false)
            .with_level(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_error_fields_to_exceptions(false)
            .with_filter(
                filter_fn(|meta| meta.is_span() && is_trace_span(meta))
                    // The attempt span's level: with `RUST_LOG=warn` events below it are
                    // still refused at the first, cheapest check.
                    .with_max_level_hint(LevelFilter::INFO),
            )
    }

    /// A pipeline that exports nowhere, for the unit tests of the spans.
    #[cfg(test)]
    pub(crate) fn without_exporter() -> Traces {
        Traces {
            provider: SdkTracerProvider::builder().build(),
        }
    }

    /// Exports what is still queued and stops the exporter (the daemon's graceful stop and
    /// the end of `--drain` both come here). A collector that does not answer in time
    /// costs a warning, not the exit code.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
            tracing::warn!(
                cause = export_failure(&e),
                "traces: the last spans may not have been exported"
            );
        }
    }
}

/// The application's trace, as the payload's `traceparent` (and `tracestate`) name it, for
/// the attempt's span to be a child of: `None` when the propagator finds no valid remote span
/// in it (an all-zero id, say), and the span stays a root.
pub fn remote_parent(
    headers: &crate::deliver::webhook::payload::TraceHeaders,
) -> Option<opentelemetry::Context> {
    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry::trace::TraceContextExt as _;
    let cx =
        opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&Carrier(headers));
    cx.span().span_context().is_valid().then_some(cx)
}

/// The two headers as the propagator reads them.
struct Carrier<'a>(&'a crate::deliver::webhook::payload::TraceHeaders);

impl opentelemetry::propagation::Extractor for Carrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => Some(&self.0.traceparent),
            "tracestate" => self.0.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        let mut keys = vec!["traceparent"];
        if self.0.tracestate.is_some() {
            keys.push("tracestate");
        }
        keys
    }
}

/// The exporter, saying when an export fails: the SDK's own reports are internal logs,
/// which are not built (their messages quote the endpoint, and a transport error's text
/// quotes the URL). One `WARN` line at most per [`WARN_EVERY`], with the failures counted
/// since the last one, and only a status or the word `timeout`, never the SDK's text.
struct Warned<E> {
    inner: E,
    /// When the last warning was written, and the failures not reported since.
    last: std::sync::Mutex<(Option<std::time::Instant>, u64)>,
}

/// The least time between two warnings of failed exports: a collector that is down would
/// otherwise write one per batch.
const WARN_EVERY: Duration = Duration::from_secs(60);

impl<E> std::fmt::Debug for Warned<E> {
    /// Not the exporter: its `Debug` shows the collector's endpoint and the
    /// `OTEL_EXPORTER_OTLP_HEADERS` values (API keys).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Warned").finish_non_exhaustive()
    }
}

impl<E> Warned<E> {
    fn new(inner: E) -> Self {
        Warned {
            inner,
            last: std::sync::Mutex::new((None, 0)),
        }
    }

    fn failed(&self, e: &opentelemetry_sdk::error::OTelSdkError) {
        let missed = {
            let mut last = crate::support::lock(&self.last);
            let now = std::time::Instant::now();
            last.1 += 1;
            if last.0.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
                return;
            }
            let missed = std::mem::take(&mut last.1);
            last.0 = Some(now);
            missed
        };
        tracing::warn!(
            failed_exports = missed,
            cause = export_failure(e),
            "traces: spans could not be exported to the OTLP endpoint (dropped)"
        );
    }
}

/// What a failed export says without the SDK's text: the collector's status, or why none.
fn export_failure(e: &opentelemetry_sdk::error::OTelSdkError) -> String {
    use opentelemetry_sdk::error::OTelSdkError as E;
    match e {
        E::Timeout(_) => "timeout".to_owned(),
        E::AlreadyShutdown => "already shut down".to_owned(),
        E::InternalFailure(msg) => msg
            .split("status code: ")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .filter(|code| code.len() == 3)
            .map(|code| format!("HTTP {code}"))
            .unwrap_or_else(|| "no answer from the endpoint".to_owned()),
    }
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for Warned<E>
{
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let result = self.inner.export(batch).await;
        if let Err(e) = &result {
            self.failed(e);
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn shutdown(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown()
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The SDK's build error without any value it may quote (its messages quote the endpoint):
/// the setting's name for a configuration error, the failure itself otherwise.
fn safe_build_error(e: &opentelemetry_otlp::ExporterBuildError) -> String {
    use opentelemetry_otlp::ExporterBuildError as E;
    match e {
        E::InvalidConfiguration(msg) => {
            let name = msg.split(':').next().unwrap_or("").trim();
            if !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b' ')
            {
                format!("{name} is not a valid setting for the OTLP trace exporter")
            } else {
                "the OTLP trace exporter's settings are not valid".to_owned()
            }
        }
        E::InternalFailure(msg) => format!(
            "cannot start the OTLP trace exporter: {}",
            crate::deliver::one_line(msg)
        ),
    }
}

/// Are traces on, and are the settings the SDK reads usable? `env` looks a variable up
/// (the process environment in [`Traces::from_env`], a table in the tests).
fn check_env(env: &dyn Fn(&str) -> Option<String>) -> Result<bool, TelemetryError> {
    let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(false);
    }
    match set("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
        None | Some("otlp") => {}
        Some("none") => return Ok(false),
        Some(_) => {
            return Err(TelemetryError(
                "OTEL_TRACES_EXPORTER must be otlp or none (outboxd exports OTLP only)".into(),
            ));
        }
    }
    let endpoints = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ];
    if endpoints.iter().all(|name| set(name).is_none()) {
        return Ok(false);
    }
    for name in endpoints {
        if let Some(v) = set(name) {
            check_endpoint(name, &v)?;
        }
    }
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(v) = set(name) {
            if v.trim() != "http/protobuf" {
                return Err(TelemetryError(format!(
                    "{name} must be http/protobuf (outboxd exports OTLP over HTTP only)"
                )));
            }
        }
    }
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_EXPORTER_OTLP_HEADERS",
    ] {
        if let Some(v) = set(name) {
            check_headers(name, &v)?;
        }
    }
    if let Some(sampler) = set("OTEL_TRACES_SAMPLER") {
        let sampler = sampler.trim();
        if !SAMPLERS.contains(&sampler) {
            return Err(TelemetryError(format!(
                "OTEL_TRACES_SAMPLER must be one of {}",
                SAMPLERS.join(", ")
            )));
        }
        if RATIO_SAMPLERS.contains(&sampler) {
            let ratio = set("OTEL_TRACES_SAMPLER_ARG").and_then(|v| v.trim().parse::<f64>().ok());
            if !ratio.is_some_and(|r| (0.0..=1.0).contains(&r)) {
                return Err(TelemetryError(format!(
                    "OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1 for {sampler}"
                )));
            }
        }
    }
    Ok(true)
}

/// An http or https URL with a host (the value is never shown: it may hold credentials).
fn check_endpoint(name: &str, value: &str) -> Result<(), TelemetryError> {
    let ok = url::Url::parse(value.trim())
        .ok()
        .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
        .and_then(|_| value.trim().parse::<hyper::Uri>().ok())
        .is_some();
    if ok {
        Ok(())
    } else {
        Err(TelemetryError(format!(
            "{name} is not an http or https URL"
        )))
    }
}

/// `name=value` pairs separated by commas, values percent-encoded, as the OpenTelemetry
/// specification has them. The SDK drops a malformed pair without a word, and so would
/// send no API key; an error names the pair by its position, never by its text.
fn check_headers(name: &str, value: &str) -> Result<(), TelemetryError> {
    for (i, item) in value.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            continue;
        }
        let bad = |why: &str| TelemetryError(format!("{name}: entry {} {why}", i + 1));
        let Some((key, val)) = item.split_once('=') else {
            return Err(bad("is not name=value"));
        };
        let (key, val) = (key.trim(), val.trim());
        if key.is_empty() || val.is_empty() {
            return Err(bad("has an empty name or value"));
        }
        if hyper::header::HeaderName::from_bytes(key.as_bytes()).is_err() {
            return Err(bad("has a name that is not a valid header name"));
        }
        let decoded = percent_encoding::percent_decode_str(val)
            .decode_utf8()
            .map(|v| v.into_owned())
            .unwrap_or_else(|_| val.to_owned());
        if hyper::header::HeaderValue::from_str(&decoded).is_err() {
            return Err(bad("has a value with control characters"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn the_exporter_wrapper_does_not_show_the_exporter() {
        // An exporter's Debug shows its endpoint and the OTEL_EXPORTER_OTLP_HEADERS values.
        struct Exporter(&'static str);
        impl std::fmt::Debug for Exporter {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        let shown = format!("{:?}", Warned::new(Exporter("api-key=SECRET")));
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.starts_with("Warned"), "{shown}");
    }

    fn check(vars: &[(&str, &str)]) -> Result<bool, TelemetryError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        check_env(&move |name: &str| map.get(name).cloned())
    }

    const EP: (&str, &str) = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");

    #[test]
    fn off_unless_an_endpoint_is_set() {
        assert!(!check(&[]).expect("ok"));
        assert!(!check(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "  ")]).expect("ok"));
        // Other OTEL_ settings alone turn nothing on (and are not checked).
        assert!(!check(&[("OTEL_TRACES_SAMPLER", "bogus")]).expect("ok"));
        assert!(check(&[EP]).expect("ok"));
        assert!(
            check(&[(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "https://collector.example/v1/traces"
            )])
            .expect("ok")
        );
        assert!(!check(&[EP, ("OTEL_SDK_DISABLED", "true")]).expect("ok"));
        assert!(!check(&[EP, ("OTEL_TRACES_EXPORTER", "none")]).expect("ok"));
        assert!(
            check(&[
                EP,
                ("OTEL_TRACES_EXPORTER", "otlp"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=abc%20def, x-b = 2,"),
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ])
            .expect("ok")
        );
    }

    #[test]
    fn bad_values_name_the_variable_never_the_value() {
        let secret = "s3cr3t-token";
        for (vars, needle) in [
            (
                vec![(
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    "ftp://user:s3cr3t-token@x.example",
                )],
                "OTEL_EXPORTER_OTLP_ENDPOINT is not an http",
            ),
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "s3cr3t-token")],
                "OTEL_EXPORTER_OTLP_ENDPOINT is not an http",
            ),
            (
                vec![(
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://x.example/\ns3cr3t-token",
                )],
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is not an http",
            ),
            (
                vec![EP, ("OTEL_EXPORTER_OTLP_HEADERS", "api-key:s3cr3t-token")],
                "OTEL_EXPORTER_OTLP_HEADERS: entry 1 is not name=value",
            ),
            (
                vec![
                    EP,
                    ("OTEL_EXPORTER_OTLP_HEADERS", "a=1,api key=s3cr3t-token"),
                ],
                "entry 2 has a name that is not a valid header name",
            ),
            (
                vec![
                    EP,
                    ("OTEL_EXPORTER_OTLP_HEADERS", "k=s3cr3t-token%0D%0AX: y"),
                ],
                "entry 1 has a value with control characters",
            ),
            (
                vec![EP, ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "k=")],
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS: entry 1 has an empty",
            ),
            (
                vec![EP, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")],
                "OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf",
            ),
            (
                vec![EP, ("OTEL_TRACES_EXPORTER", "jaeger")],
                "OTEL_TRACES_EXPORTER must be otlp or none",
            ),
            (
                vec![EP, ("OTEL_TRACES_SAMPLER", "s3cr3t-token")],
                "OTEL_TRACES_SAMPLER must be one of",
            ),
            (
                vec![EP, ("OTEL_TRACES_SAMPLER", "traceidratio")],
                "OTEL_TRACES_SAMPLER_ARG must be a ratio",
            ),
            (
                vec![
                    EP,
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
                ],
                "OTEL_TRACES_SAMPLER_ARG must be a ratio",
            ),
        ] {
            let err = check(&vars).expect_err(needle).to_string();
            assert!(err.contains(needle), "{vars:?}: {err}");
            assert!(!err.contains(secret), "{vars:?}: {err}");
            assert!(!err.contains('\n'), "{vars:?}: {err}");
        }
    }

    #[test]
    fn the_sdks_build_errors_lose_the_values_they_quote() {
        use opentelemetry_otlp::ExporterBuildError as E;
        let e = E::InvalidConfiguration(
            "OTEL_EXPORTER_OTLP_ENDPOINT: invalid endpoint 'http://u:s3cr3t@x': bad".into(),
        );
        let shown = safe_build_error(&e);
        assert!(
            shown.starts_with("OTEL_EXPORTER_OTLP_ENDPOINT is not"),
            "{shown}"
        );
        assert!(!shown.contains("s3cr3t"), "{shown}");
        let e = E::InvalidConfiguration("invalid endpoint 'http://u:s3cr3t@x'".into());
        assert!(!safe_build_error(&e).contains("s3cr3t"));
    }

    #[test]
    fn remote_parent_is_the_traceparents_span() {
        use crate::deliver::webhook::payload::TraceHeaders;
        use opentelemetry::trace::TraceContextExt as _;
        let tp = |s: &str| TraceHeaders {
            traceparent: s.to_owned(),
            tracestate: Some("vendor=abc".to_owned()),
        };
        let cx = remote_parent(&tp(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ))
        .expect("valid");
        let span = cx.span();
        let sc = span.span_context();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_state().header(), "vendor=abc");
        // All-zero ids are well formed but name no span.
        for zero in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        ] {
            assert!(remote_parent(&tp(zero)).is_none(), "{zero}");
        }
    }

    /// The logs keep `RUST_LOG`'s maximum level: a hint lost in the combination would make
    /// every disabled `debug!` and `trace!` call site in the process pay a check.
    #[test]
    fn the_logs_keep_their_level_hint() {
        use tracing_subscriber::filter::FilterExt as _;
        use tracing_subscriber::layer::Filter;
        let logs = tracing_subscriber::EnvFilter::new("info").and(without_trace_spans());
        assert_eq!(
            Filter::<tracing_subscriber::Registry>::max_level_hint(&logs),
            Some(LevelFilter::INFO)
        );
    }

    #[test]
    fn export_failures_show_a_status_at_most() {
        use opentelemetry_sdk::error::OTelSdkError as E;
        for (e, shown) in [
            (
                E::InternalFailure("HTTP export failed with status code: 503".into()),
                "HTTP 503",
            ),
            (
                E::InternalFailure(
                    "error sending request for url (http://u:s3cr3t@x/v1/traces?k=s3cr3t)".into(),
                ),
                "no answer from the endpoint",
            ),
            (E::Timeout(Duration::from_secs(10)), "timeout"),
        ] {
            assert_eq!(export_failure(&e), shown);
        }
    }
}
