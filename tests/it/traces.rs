//! Traces: the real binary exports one span per attempt to an OTLP/HTTP receiver on
//! loopback, joined to the application's trace by the payload's `traceparent`, which the
//! webhook request forwards unchanged; no span holds a URL's path or query, a header value
//! or the payload. With no endpoint set nothing is exported, and a bad OTEL setting stops
//! the daemon at start-up with one line that names it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::HeaderMap;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::{Span, span::SpanKind, status::StatusCode};
use outboxd::NewMessage;
use prost::Message as _;
use serde_json::json;

use crate::common::TestDb;
use crate::common::binary::{Output, UNREACHABLE_URL, outboxd, run_within};
use crate::common::receiver::{Receiver, Reply};

/// The application's trace context, as its request handler would have it.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Secret-looking strings put where a span must not look: a URL's query, an application
/// header, the body, the collector's own API key.
const QUERY_SECRET: &str = "qs-4f1e9c0d7a";
const HEADER_SECRET: &str = "hdr-8b2a6e1f3c";
const BODY_SECRET: &str = "body-5d7c2b9e0a";
const OTLP_SECRET: &str = "otlp-1a3c5e7g9i";

/// An OTLP/HTTP receiver on 127.0.0.1:0: records every POST to /v1/traces (headers and
/// protobuf body) and answers 200 with an empty `ExportTraceServiceResponse`.
#[derive(Clone)]
struct Collector {
    addr: std::net::SocketAddr,
    got: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
}

impl Collector {
    async fn start() -> Collector {
        Collector::answering(Some(200)).await
    }

    /// A collector that answers `status`, or never (`None`: it reads the request and stalls).
    async fn answering(status: Option<u16>) -> Collector {
        let got: Arc<Mutex<Vec<(HeaderMap, Bytes)>>> = Arc::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let store = got.clone();
        let app = axum::Router::new()
            .route(
                "/v1/traces",
                axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                    let store = store.clone();
                    async move {
                        store.lock().unwrap().push((headers, body));
                        let Some(status) = status else {
                            return std::future::pending().await;
                        };
                        (
                            axum::http::StatusCode::from_u16(status).unwrap(),
                            [("content-type", "application/x-protobuf")],
                            Vec::<u8>::new(),
                        )
                    }
                }),
            )
            .fallback(|| async { axum::http::StatusCode::NOT_FOUND });
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Collector { addr, got }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn requests(&self) -> Vec<(HeaderMap, Bytes)> {
        self.got.lock().unwrap().clone()
    }

    /// Every span received so far, with its resource's `service.name`.
    fn spans(&self) -> Vec<(String, Span)> {
        let mut out = Vec::new();
        for (_, body) in self.requests() {
            let req = ExportTraceServiceRequest::decode(body.as_ref()).expect("OTLP protobuf");
            for rs in req.resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                    .and_then(|a| a.value.as_ref())
                    .and_then(|v| match &v.value {
                        Some(Any::StringValue(s)) => Some(s.clone()),
                        _ => None,
                    })
                    .unwrap_or_default();
                for ss in rs.scope_spans {
                    for span in ss.spans {
                        out.push((service.clone(), span));
                    }
                }
            }
        }
        out
    }

    /// Waits until `n` spans have arrived (or fails at the deadline).
    async fn wait_for_spans(&self, n: usize, timeout: Duration) -> Vec<(String, Span)> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if spans.len() >= n {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {n} spans within {timeout:?}",
                spans.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A span's attributes as text (integers as their decimal).
fn attrs(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Any::StringValue(s)) => s.clone(),
                Some(Any::IntValue(i)) => i.to_string(),
                Some(Any::BoolValue(b)) => b.to_string(),
                Some(Any::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

/// `outboxd run --drain` with a quick schedule and `env`, to its end, off the runtime's
/// threads (the receivers run on them).
async fn drain(db_url: Option<String>, env: Vec<(&'static str, String)>) -> Output {
    tokio::task::spawn_blocking(move || {
        let mut cmd = outboxd(db_url.as_deref());
        cmd.args([
            "run",
            "--drain",
            "--retry-base",
            "100ms",
            "--retry-max",
            "200ms",
            "--poll-interval",
            "100ms",
            "--worker-id",
            "traces-test",
        ])
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true");
        for (k, v) in env {
            cmd.env(k, v);
        }
        run_within(&mut cmd, Duration::from_secs(60))
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_span_per_attempt_joined_to_the_applications_trace() {
    let db = TestDb::new().await;
    let collector = Collector::start().await;
    let ok = Receiver::start().await;
    let flaky = Receiver::start().await;
    flaky.script([Reply::Status(500)]);

    let client = db.client().await;
    let traced = NewMessage::webhook(
        "trace:joined",
        json!({
            "url": ok.url(&format!("/hooks/orders?token={QUERY_SECRET}")),
            "headers": {
                "traceparent": TRACEPARENT,
                "tracestate": "vendor=opaque",
                "X-Api-Key": HEADER_SECRET,
            },
            "body": {"note": BODY_SECRET},
        }),
    );
    let retried = NewMessage::webhook(
        "trace:retried",
        json!({
            "url": flaky.url(&format!("/hooks/retried?sig={QUERY_SECRET}")),
            "headers": {"Authorization": format!("Bearer {HEADER_SECRET}")},
            "body": {"note": BODY_SECRET},
        }),
    );
    // A malformed traceparent: no parent (a root span), and forwarded as given.
    let malformed_tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1";
    let malformed = NewMessage::webhook(
        "trace:malformed",
        json!({"url": ok.url("/hooks/m"), "headers": {"traceparent": malformed_tp}}),
    );
    for msg in [&traced, &retried, &malformed] {
        outboxd::enqueue(&client, msg).await.unwrap();
    }
    // A key with control characters, as an old row may hold (enqueue refuses them now, so
    // the insert trigger is bypassed): not a valid header, so dead at once as invalid with
    // no request made, and still one span, its key escaped as the logs show it.
    let hostile_key = "trace:esc\u{1b}[31m\r\nforged\u{202e}";
    let payload = json!({"url": ok.url(&format!("/hooks/x?token={QUERY_SECRET}")), "body": 1});
    client
        .batch_execute("ALTER TABLE outbox.messages DISABLE TRIGGER USER")
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO outbox.messages (message_key, channel, payload, request_hash) \
             VALUES ($1, 'webhook', $2, outbox.request_hash('webhook', $2))",
            &[&hostile_key, &payload],
        )
        .await
        .unwrap();
    client
        .batch_execute("ALTER TABLE outbox.messages ENABLE TRIGGER USER")
        .await
        .unwrap();

    let out = drain(
        Some(db.url()),
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint()),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                format!("x-api-key={OTLP_SECRET}"),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
            // With traces the logs' filter is the log layer's own: tokio-postgres' query
            // events (their parameters carry stored bodies and errors) stay off there too,
            // even under a directive naming a field, which the plain target does not beat.
            (
                "RUST_LOG",
                "debug,tokio_postgres::query[{message}]=debug".to_owned(),
            ),
        ],
    )
    .await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    // The log never shows the span (nor its fields as a span prefix).
    assert!(!out.stderr.contains("outboxd.attempt"), "{}", out.stderr);
    assert!(!out.stderr.contains(OTLP_SECRET), "{}", out.stderr);
    assert!(out.stderr.contains("tokio_postgres"), "{}", out.stderr);
    assert!(!out.stderr.contains("with parameters"), "{}", out.stderr);

    // Five attempts: joined, retried twice, hostile, malformed. `--drain` returned only
    // after the shutdown flushed them, so they are already there.
    let spans = collector.wait_for_spans(5, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 5, "{spans:#?}");
    for (service, span) in &spans {
        assert_eq!(service, "outboxd");
        assert_eq!(span.name, "outboxd.attempt");
        assert_eq!(span.kind, SpanKind::Client as i32);
    }
    let by_key = |key: &str| -> Vec<(HashMap<String, String>, &Span)> {
        let mut v: Vec<_> = spans
            .iter()
            .map(|(_, s)| (attrs(s), s))
            .filter(|(a, _)| a.get("outbox.message_key").map(String::as_str) == Some(key))
            .collect();
        v.sort_by_key(|(a, _)| a["outbox.attempt"].clone());
        v
    };

    // The joined one: a child of the application's span, in its trace.
    let joined = by_key("trace:joined");
    assert_eq!(joined.len(), 1);
    let (a, span) = &joined[0];
    assert_eq!(hex::encode(&span.trace_id), TRACE_ID);
    assert_eq!(hex::encode(&span.parent_span_id), PARENT_ID);
    assert_ne!(hex::encode(&span.span_id), PARENT_ID);
    // The tracestate is the trace's, and travels with it (W3C Trace Context): the one
    // header value a span carries, because the application put it there for that.
    assert_eq!(span.trace_state, "vendor=opaque");
    assert_eq!(a["outbox.channel"], "webhook");
    assert_eq!(a["outbox.attempt"], "1");
    assert_eq!(a["outbox.max_attempts"], "3");
    assert_eq!(a["outbox.outcome"], "delivered");
    assert_eq!(a["http.response.status_code"], "204");
    assert!(!a.contains_key("outbox.error_class"), "{a:?}");
    let id: i64 = db
        .scalar("select id from outbox.messages where message_key = 'trace:joined'")
        .await;
    assert_eq!(a["outbox.message_id"], id.to_string());
    assert_ne!(
        span.status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32)
    );
    // The receiver got the application's traceparent and tracestate exactly as given:
    // outboxd neither replaced them nor added its own.
    let got = ok.requests_for("trace:joined");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].header("traceparent").as_deref(), Some(TRACEPARENT));
    assert_eq!(
        got[0].header("tracestate").as_deref(),
        Some("vendor=opaque")
    );
    assert_eq!(got[0].headers.get_all("traceparent").iter().count(), 1);

    // The retried one: two root spans of their own traces, 500 then 204.
    let retried = by_key("trace:retried");
    assert_eq!(retried.len(), 2, "{retried:#?}");
    let (first, s1) = &retried[0];
    let (second, s2) = &retried[1];
    assert_eq!(first["outbox.attempt"], "1");
    assert_eq!(first["outbox.outcome"], "retry");
    assert_eq!(first["outbox.error_class"], "transient");
    assert_eq!(first["http.response.status_code"], "500");
    let status = s1.status.as_ref().expect("a status");
    assert_eq!(status.code, StatusCode::Error as i32);
    assert_eq!(status.message, "HTTP 500 from 127.0.0.1");
    assert_eq!(second["outbox.attempt"], "2");
    assert_eq!(second["outbox.outcome"], "delivered");
    assert_eq!(second["http.response.status_code"], "204");
    for s in [s1, s2] {
        assert!(s.parent_span_id.is_empty(), "a root: {s:?}");
        assert_ne!(hex::encode(&s.trace_id), TRACE_ID);
    }
    for r in flaky.requests() {
        assert_eq!(r.header("traceparent"), None, "outboxd adds no traceparent");
    }

    // The hostile key: escaped as the logs escape it; dead, invalid, no status.
    let shown = outboxd::text::escape(hostile_key).to_string();
    assert!(
        !shown.contains('\u{1b}') && !shown.contains('\n'),
        "{shown}"
    );
    let hostile = by_key(&shown);
    assert_eq!(hostile.len(), 1, "{spans:#?}");
    let (a, span) = &hostile[0];
    assert_eq!(a["outbox.outcome"], "dead");
    assert_eq!(a["outbox.error_class"], "invalid");
    assert!(!a.contains_key("http.response.status_code"));
    assert_eq!(
        span.status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32)
    );

    // The malformed traceparent: a root span, and the header forwarded as given.
    let malformed = by_key("trace:malformed");
    assert_eq!(malformed.len(), 1);
    assert!(malformed[0].1.parent_span_id.is_empty());
    assert_ne!(hex::encode(&malformed[0].1.trace_id), TRACE_ID);
    let got = ok.requests_for("trace:malformed");
    assert_eq!(got[0].header("traceparent").as_deref(), Some(malformed_tp));

    // The collector got the API key of OTEL_EXPORTER_OTLP_HEADERS; no exported byte holds
    // a URL's path or query, a header value or the body.
    let requests = collector.requests();
    for (headers, body) in &requests {
        assert_eq!(
            headers.get("x-api-key").and_then(|v| v.to_str().ok()),
            Some(OTLP_SECRET)
        );
        assert_eq!(
            headers.get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/x-protobuf")
        );
        let text = String::from_utf8_lossy(body);
        for needle in [
            QUERY_SECRET,
            HEADER_SECRET,
            BODY_SECRET,
            OTLP_SECRET,
            "/hooks",
            "token=",
        ] {
            assert!(!text.contains(needle), "{needle} in an exported span");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_endpoint_no_export_and_bad_settings_stop_the_start() {
    let collector = Collector::start().await;

    // Every OTEL_ setting but an endpoint: traces stay off, the message is delivered, the
    // collector hears nothing.
    let db = TestDb::new().await;
    let ok = Receiver::start().await;
    let client = db.client().await;
    let msg = NewMessage::webhook(
        "trace:off",
        json!({"url": ok.url("/h"), "headers": {"traceparent": TRACEPARENT}}),
    );
    outboxd::enqueue(&client, &msg).await.unwrap();
    let out = drain(
        Some(db.url()),
        vec![
            ("OTEL_SERVICE_NAME", "not-used".to_owned()),
            ("OTEL_BSP_SCHEDULE_DELAY", "10".to_owned()),
            ("OTEL_TRACES_SAMPLER", "always_on".to_owned()),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                format!("x-api-key={OTLP_SECRET}"),
            ),
        ],
    )
    .await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    assert_eq!(ok.requests_for("trace:off").len(), 1);
    // The endpoint is the collector's, had it been set: give a stray export time to arrive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(collector.requests().is_empty(), "exported with no endpoint");

    // A bad setting: exit 2 before anything else (the database is unreachable), one line
    // naming the variable, never its value.
    for (name, value, needle) in [
        (
            "OTEL_EXPORTER_OTLP_HEADERS",
            format!("x-api-key:{OTLP_SECRET}"),
            "OTEL_EXPORTER_OTLP_HEADERS: entry 1 is not name=value",
        ),
        (
            "OTEL_EXPORTER_OTLP_HEADERS",
            format!("x-api-key={OTLP_SECRET}%0d%0aX-Injected: 1"),
            "OTEL_EXPORTER_OTLP_HEADERS: entry 1 has a value with control characters",
        ),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("ftp://user:{OTLP_SECRET}@127.0.0.1/"),
            "OTEL_EXPORTER_OTLP_ENDPOINT is not an http or https URL",
        ),
        (
            "OTEL_TRACES_SAMPLER",
            OTLP_SECRET.to_owned(),
            "OTEL_TRACES_SAMPLER must be one of",
        ),
        (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "grpc".to_owned(),
            "OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf",
        ),
    ] {
        let mut env = vec![("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint())];
        env.retain(|(k, _)| *k != name);
        env.push((name, value));
        let out = drain(Some(UNREACHABLE_URL.to_owned()), env).await;
        assert_eq!(out.code, Some(2), "{name}: {}", out.stderr);
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{name}: {lines:?}");
        assert!(lines[0].starts_with("error: "), "{lines:?}");
        assert!(lines[0].contains(needle), "{name}: {lines:?}");
        assert!(!out.stderr.contains(OTLP_SECRET), "{name}: {}", out.stderr);
    }
    assert!(collector.requests().is_empty());
}

/// A collector that refuses the spans, or never answers: the daemon says so in one safe
/// warning (a status at most, never the endpoint's URL), delivers all the same, and its
/// `--drain` still ends soon after the work is done (the flush at shutdown is bounded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_collector_costs_a_warning_not_the_delivery() {
    for status in [Some(500), None] {
        let collector = Collector::answering(status).await;
        let db = TestDb::new().await;
        let ok = Receiver::start().await;
        let client = db.client().await;
        let msg = NewMessage::webhook("trace:warned", json!({"url": ok.url("/h")}));
        outboxd::enqueue(&client, &msg).await.unwrap();
        let started = Instant::now();
        let out = drain(
            Some(db.url()),
            vec![
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    format!("{}/v1/traces?key={OTLP_SECRET}", collector.endpoint()),
                ),
                ("OTEL_BSP_SCHEDULE_DELAY", "50".to_owned()),
            ],
        )
        .await;
        let took = started.elapsed();
        assert_eq!(out.code, Some(0), "{status:?}: {}", out.stderr);
        assert_eq!(ok.requests_for("trace:warned").len(), 1);
        assert!(!collector.requests().is_empty(), "{status:?}: never tried");
        assert!(
            took < Duration::from_secs(15),
            "{status:?}: drain took {took:?}"
        );
        let warnings: Vec<&str> = out
            .stderr
            .lines()
            // A refused export says so; one still waiting at the end is cut short by the
            // shutdown, which says so.
            .filter(|l| {
                l.contains("WARN")
                    && (l.contains("spans could not be exported")
                        || l.contains("the last spans may not have been exported"))
            })
            .collect();
        assert!(!warnings.is_empty(), "{status:?}: {}", out.stderr);
        if status.is_some() {
            assert!(warnings[0].contains("HTTP 500"), "{warnings:?}");
        }
        assert!(!out.stderr.contains(OTLP_SECRET), "{}", out.stderr);
        assert!(!out.stderr.contains("v1/traces"), "{}", out.stderr);
    }
}

/// An e-mail attempt's span carries the SMTP reply code as `outbox.status` (not as an HTTP
/// status), and neither the recipients nor the content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_email_attempts_span_has_the_smtp_code() {
    use crate::common::smtp::{FakeSmtp, Plan, reply};
    let db = TestDb::new().await;
    let collector = Collector::start().await;
    let fake = FakeSmtp::start().await;
    fake.plan([Plan::at_end_of_data(reply("550 5.7.1 Content rejected"))]);
    let client = db.client().await;
    let msg = NewMessage::email(
        "trace:mail",
        json!({"from": "shop@shop.example", "to": ["someone@example.com"],
               "subject": BODY_SECRET, "text": BODY_SECRET}),
    );
    outboxd::enqueue(&client, &msg).await.unwrap();
    let out = drain(
        Some(db.url()),
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint()),
            ("OTEL_BSP_SCHEDULE_DELAY", "50".to_owned()),
            ("OUTBOXD_SMTP_URL", fake.url()),
        ],
    )
    .await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    let spans = collector.wait_for_spans(1, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 1, "{spans:#?}");
    let a = attrs(&spans[0].1);
    assert_eq!(a["outbox.channel"], "email");
    assert_eq!(a["outbox.outcome"], "dead");
    assert_eq!(a["outbox.error_class"], "permanent");
    assert_eq!(a["outbox.status"], "550");
    assert!(!a.contains_key("http.response.status_code"), "{a:?}");
    for (_, body) in collector.requests() {
        let text = String::from_utf8_lossy(&body);
        for needle in [BODY_SECRET, "someone@example.com"] {
            assert!(!text.contains(needle), "{needle} in an exported span");
        }
    }
}
