//! Property tests of the pure functions the worker's decisions rest on: payload parsing,
//! status classes, the retry schedule, the state machine and the destination check.
//!
//! Case counts are modest (the whole file runs in a few seconds); `PROPTEST_CASES` raises
//! them for a longer hunt.

#![allow(clippy::unwrap_used)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use outboxd::deliver::guard::is_forbidden;
use outboxd::deliver::webhook::payload::parse_payload;
use outboxd::model::ErrorClass;
use outboxd::retry::{RetryPolicy, classify_http_status};
use outboxd::state::{Budget, Transition, decide};
use proptest::prelude::*;
use serde_json::{Map, Value};

/// Planted in header values: no error message may repeat it.
const HEADER_MARKER: &str = "hv-S3cr3t-7f3a";
/// Planted in bodies.
const BODY_MARKER: &str = "body-S3cr3t-91c2";
/// Planted in URL paths and queries.
const PATH_MARKER: &str = "path-S3cr3t-44d0";

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(cases),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON numbers are finite", |f| f.is_finite())
            .prop_map(Value::from),
        any::<String>().prop_map(Value::String),
    ]
}

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A JSON value carrying `marker` somewhere inside (a string, an array, an object).
fn json_with_marker(marker: &'static str) -> impl Strategy<Value = Value> {
    let s = (".{0,6}", ".{0,6}").prop_map(move |(a, b)| Value::String(format!("{a}{marker}{b}")));
    s.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            (inner.clone(), json_value()).prop_map(|(v, w)| Value::Array(vec![w, v])),
            ("[a-z]{1,5}", inner).prop_map(|(k, v)| {
                let mut m = Map::new();
                m.insert(k, v);
                Value::Object(m)
            }),
        ]
    })
}

/// URL text: plausible pieces glued together (so that many parse), or anything at all.
fn url_text() -> impl Strategy<Value = String> {
    let scheme = prop::sample::select(vec![
        "http",
        "https",
        "HTTP",
        "HtTpS",
        "ftp",
        "file",
        "javascript",
        "gopher",
        "data",
        "ws",
        "",
    ]);
    let sep = prop::sample::select(vec!["://", ":", ":/", ":///", "//", ":\\\\"]);
    let host = prop_oneof![
        "[a-z0-9.-]{0,16}",
        "[0-9a-fA-Fx.]{1,16}",
        "\\[[0-9a-f:.]{0,24}\\]",
        "[a-z]{1,5}@[a-z]{1,5}",
        ".{0,12}",
    ];
    let port = prop_oneof![
        Just(String::new()),
        (0u32..100_000).prop_map(|p| format!(":{p}"))
    ];
    let tail = prop_oneof![
        Just(String::new()),
        Just(format!("/{PATH_MARKER}")),
        Just(format!("/hooks/{PATH_MARKER}?token={PATH_MARKER}")),
        ".{0,12}".prop_map(|s| format!("/{s}")),
    ];
    let good_host = prop_oneof![
        4 => "[a-z]{1,8}\\.example",
        1 => "[0-9]{1,10}",
        1 => "\\[::ffff:[0-9.]{7,15}\\]",
    ];
    let good_scheme = prop::sample::select(vec!["http", "https", "HTTPS"]);
    let port2 = prop_oneof![
        Just(String::new()),
        (0u32..100_000).prop_map(|p| format!(":{p}"))
    ];
    let tail2 = prop_oneof![
        Just(String::new()),
        Just(format!("/hooks/{PATH_MARKER}?token={PATH_MARKER}")),
    ];
    prop_oneof![
        6 => (good_scheme, good_host, port2, tail2)
            .prop_map(|(s, h, p, t)| format!("{s}://{h}{p}{t}")),
        4 => (scheme, sep, host, port, tail)
            .prop_map(|(s, sep, h, p, t)| format!("{s}{sep}{h}{p}{t}")),
        1 => any::<String>(),
    ]
}

fn header_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[A-Za-z][A-Za-z0-9-]{0,10}",
        1 => prop::sample::select(vec![
            "Idempotency-Key",
            "webhook-signature",
            "Content-Type",
            "Host",
            "Content-Length",
            "",
            "Bad Name",
            "X-A\r\nB",
            "X:Y",
        ])
        .prop_map(str::to_owned),
        1 => ".{0,8}",
    ]
}

fn header_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => "[ -~]{0,4}".prop_map(|a| Value::String(format!("{a}{HEADER_MARKER}"))),
        // Strings with the marker, sometimes with control characters around it.
        4 => ("[ -~]{0,4}", prop::sample::select(vec!["", "\r\n", "\n", "\0", "\t", "\u{7f}", "\u{1b}", "é"]), "[ -~]{0,4}")
            .prop_map(|(a, c, b)| Value::String(format!("{a}{c}{HEADER_MARKER}{b}"))),
        1 => json_with_marker(HEADER_MARKER),
    ]
}

fn headers() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        3 => Just(None),
        4 => prop::collection::vec((header_name(), header_value()), 0..4).prop_map(|kv| {
            Some(Value::Object(kv.into_iter().collect()))
        }),
        1 => json_with_marker(HEADER_MARKER).prop_map(Some),
        1 => json_value().prop_map(Some),
    ]
}

fn method() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        4 => Just(None),
        4 => prop::sample::select(vec![
            "POST", "post", "Put", "PATCH", "GET", "DELETE", "HEAD", "", "POST ", "P\u{0}ST",
        ])
        .prop_map(|m| Some(Value::String(m.to_owned()))),
        1 => json_value().prop_map(Some),
    ]
}

fn body() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        1 => Just(None),
        2 => json_with_marker(BODY_MARKER).prop_map(Some),
        2 => json_value().prop_map(Some),
    ]
}

/// A payload of the webhook shape with hostile values in every field.
fn webhook_payload() -> impl Strategy<Value = (Value, Option<Value>)> {
    let url = prop_oneof![
        5 => url_text().prop_map(Value::String),
        1 => json_value(),
    ];
    (
        prop::option::weighted(0.95, url),
        method(),
        headers(),
        body(),
    )
        .prop_map(|(url, method, headers, body)| {
            let mut m = Map::new();
            if let Some(u) = url {
                m.insert("url".into(), u);
            }
            if let Some(v) = method {
                m.insert("method".into(), v);
            }
            if let Some(h) = headers {
                m.insert("headers".into(), h);
            }
            if let Some(b) = &body {
                m.insert("body".into(), b.clone());
            }
            (Value::Object(m), body)
        })
}

/// Checks what `parse_payload` promises for one input: an accepted payload is safe to
/// send, a refused one is `invalid` with a message that repeats no secret.
fn check_parse(text: &str, body: Option<&Value>) -> Result<(), TestCaseError> {
    match parse_payload(text) {
        Ok(req) => {
            prop_assert!(
                matches!(req.url.scheme(), "http" | "https"),
                "scheme {:?} accepted in {text:?}",
                req.url.scheme()
            );
            prop_assert!(req.url.host().is_some(), "no host in {text:?}");
            prop_assert!(
                matches!(req.method.as_str(), "POST" | "PUT" | "PATCH"),
                "method {} accepted",
                req.method
            );
            for (name, value) in &req.headers {
                for b in value.as_bytes() {
                    // HTAB is the one control byte RFC 9110 allows inside a field value.
                    prop_assert!(
                        (*b >= 0x20 && *b != 0x7f) || *b == b'\t',
                        "control byte {b:#x} in header {name} from {text:?}"
                    );
                }
                prop_assert!(
                    name.as_str()
                        .bytes()
                        .all(|b| b.is_ascii_graphic() && b != b':'),
                    "header name {name:?}"
                );
                prop_assert!(
                    ![
                        "idempotency-key",
                        "webhook-id",
                        "webhook-timestamp",
                        "webhook-signature",
                        "content-type",
                        "content-length",
                        "host",
                    ]
                    .contains(&name.as_str()),
                    "reserved header {name} accepted"
                );
            }
            if let Some(body) = body {
                // Sent exactly as the payload text had it.
                prop_assert_eq!(req.body, serde_json::to_vec(body).unwrap());
            }
        }
        Err(e) => {
            prop_assert_eq!(e.class, ErrorClass::Invalid);
            prop_assert!(!e.message.is_empty());
            prop_assert!(!e.message.contains('\n') && !e.message.contains('\r'));
            for marker in [HEADER_MARKER, BODY_MARKER, PATH_MARKER] {
                prop_assert!(
                    !e.message.contains(marker),
                    "error {:?} repeats {marker} from {text:?}",
                    e.message
                );
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// parse_payload
// ---------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn parse_payload_never_panics_on_any_string(s in any::<String>()) {
        let _ = parse_payload(&s);
    }

    #[test]
    fn parse_payload_never_panics_on_json_like_text(s in "[{}\\[\\]\":,. a-z0-9\\\\-]{0,80}") {
        let _ = parse_payload(&s);
        let _ = parse_payload(&format!("{{\"url\": \"http://x.example\", {s}"));
    }

    #[test]
    fn parse_payload_on_any_json_value(v in json_value()) {
        let text = serde_json::to_string(&v).unwrap();
        check_parse(&text, None)?;
    }

    #[test]
    fn parse_payload_of_hostile_webhook_shapes((v, body) in webhook_payload()) {
        let compact = serde_json::to_string(&v).unwrap();
        check_parse(&compact, body.as_ref())?;
        // jsonb's text form (what the worker really parses) puts spaces after ':' and ','.
        let spaced = serde_json::to_string_pretty(&v).unwrap();
        let accepted_compact = parse_payload(&compact).is_ok();
        prop_assert_eq!(parse_payload(&spaced).is_ok(), accepted_compact);
    }
}

/// The hostile-shape strategy must exercise both sides of `parse_payload`, or the property
/// above would hold vacuously.
#[test]
fn hostile_shapes_reach_both_acceptance_and_refusal() {
    use proptest::strategy::ValueTree as _;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = webhook_payload();
    let (mut ok, mut err) = (0, 0);
    for _ in 0..1000 {
        let (v, _) = strategy.new_tree(&mut runner).unwrap().current();
        match parse_payload(&v.to_string()) {
            Ok(_) => ok += 1,
            Err(_) => err += 1,
        }
    }
    assert!(
        ok >= 100 && err >= 100,
        "accepted {ok}, refused {err} of 1000"
    );
}

// ---------------------------------------------------------------------------------------
// classify_http_status
// ---------------------------------------------------------------------------------------

#[test]
fn classify_http_status_is_total_over_0_to_999() {
    for status in 0u16..=999 {
        let got = classify_http_status(status);
        let success = (200..=299).contains(&status);
        let transient = matches!(status, 408 | 425 | 429 | 500..=599);
        assert_eq!(got.is_none(), success, "{status}: 2xx ⇔ None");
        assert_eq!(
            got == Some(ErrorClass::Transient),
            transient,
            "{status}: 5xx/408/425/429 ⇔ Transient"
        );
        if !success && !transient {
            assert_eq!(got, Some(ErrorClass::Permanent), "{status}");
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn classify_http_status_never_says_invalid_or_ambiguous(status in any::<u16>()) {
        let got = classify_http_status(status);
        prop_assert!(matches!(got, None | Some(ErrorClass::Transient) | Some(ErrorClass::Permanent)));
        prop_assert_eq!(got.is_none(), (200..=299).contains(&status));
    }
}

// ---------------------------------------------------------------------------------------
// RetryPolicy::delay
// ---------------------------------------------------------------------------------------

/// Policies from 1 ms to 1 h of base and up to 7 days of maximum, base ≤ max.
fn policy() -> impl Strategy<Value = RetryPolicy> {
    (1u64..3_600_000, 0u64..7 * 86_400_000).prop_map(|(base_ms, extra_ms)| RetryPolicy {
        base: Duration::from_millis(base_ms),
        max: Duration::from_millis(base_ms + extra_ms),
    })
}

/// `min(base · 2^(n−1), max)` in nanoseconds, exactly (attempts below 1 count as 1).
fn schedule_ns(p: &RetryPolicy, attempt: i32) -> u128 {
    let exp = u32::try_from(attempt.max(1) - 1).unwrap().min(64);
    let raw = p.base.as_nanos().saturating_mul(1u128 << exp);
    raw.min(p.max.as_nanos())
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn delay_stays_within_the_jittered_schedule(
        p in policy(),
        attempt in prop_oneof![1i32..40, any::<i32>()],
        jitter in 0.0f64..1.0,
    ) {
        let d = p.delay(attempt, None, jitter).as_nanos();
        let upper = schedule_ns(&p, attempt);
        // 0.8 · upper, rounded down; the float product may round 1 ns further down.
        let lower = (upper * 4 / 5).saturating_sub(1);
        prop_assert!(d <= p.max.as_nanos(), "{d} ns above max {:?}", p.max);
        prop_assert!(d <= upper, "{d} ns above the schedule {upper} ns (attempt {attempt})");
        prop_assert!(d >= lower, "{d} ns below 0.8 × {upper} ns (attempt {attempt}, jitter {jitter})");
    }

    #[test]
    fn out_of_range_jitter_is_clamped(
        p in policy(),
        attempt in 1i32..40,
        jitter in any::<f64>().prop_filter("finite", |j| j.is_finite()),
    ) {
        let d = p.delay(attempt, None, jitter).as_nanos();
        let upper = schedule_ns(&p, attempt);
        prop_assert!(d <= upper);
        prop_assert!(d >= (upper * 4 / 5).saturating_sub(1));
    }

    #[test]
    fn retry_after_replaces_the_schedule_capped_at_max(
        p in policy(),
        attempt in any::<i32>(),
        wish_ms in prop_oneof![0u64..10_000, any::<u64>()],
        jitter in 0.0f64..1.0,
    ) {
        let wish = Duration::from_millis(wish_ms);
        prop_assert_eq!(p.delay(attempt, Some(wish), jitter), wish.min(p.max));
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// The worker draws jitter with `rand` (always in [0, 1)), but `delay` must not panic
    /// on any sample: NaN and the infinities count as no jitter (a regression test: NaN
    /// used to reach `Duration::mul_f64` and panic).
    #[test]
    fn delay_never_panics_on_any_jitter(
        p in policy(),
        attempt in any::<i32>(),
        jitter in prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-0.0),
            any::<f64>(),
        ],
    ) {
        let d = p.delay(attempt, None, jitter);
        prop_assert!(d <= p.max);
        prop_assert!(d.as_nanos() >= (schedule_ns(&p, attempt) * 4 / 5).saturating_sub(1));
        if !jitter.is_finite() {
            prop_assert_eq!(d, p.delay(attempt, None, 0.0));
        }
    }
}

// ---------------------------------------------------------------------------------------
// state::decide
// ---------------------------------------------------------------------------------------

fn failure() -> impl Strategy<Value = Option<ErrorClass>> {
    prop_oneof![
        1 => Just(None),
        4 => prop::sample::select(ErrorClass::ALL.to_vec()).prop_map(Some),
    ]
}

proptest! {
    #![proptest_config(config(1024))]

    #[test]
    fn decide_follows_the_transition_rules(
        failure in failure(),
        attempt in -2i32..25,
        max_attempts in 1i32..20,
        retry_ambiguous in any::<bool>(),
        reconcile in any::<bool>(),
        p in policy(),
        retry_after in prop::option::of((0u64..7_200_000).prop_map(Duration::from_millis)),
        jitter in 0.0f64..1.0,
    ) {
        let budget = Budget { attempt, max_attempts, retry_ambiguous, reconcile, after_ambiguous: false };
        let t = decide(failure, budget, &p, retry_after, jitter);
        let last = attempt >= max_attempts;

        // Delivered iff there was no failure.
        prop_assert_eq!(t == Transition::Delivered, failure.is_none());
        // Never a retry once the budget is spent.
        if last {
            prop_assert!(!matches!(t, Transition::Retry { .. }), "{t:?} at {budget:?}");
        }
        match failure {
            None => {}
            Some(c @ (ErrorClass::Permanent | ErrorClass::Invalid | ErrorClass::Exhausted)) => {
                prop_assert_eq!(t, Transition::Dead { class: c });
            }
            Some(ErrorClass::Transient) => {
                if last {
                    prop_assert_eq!(t, Transition::Dead { class: ErrorClass::Exhausted });
                } else {
                    prop_assert!(matches!(t, Transition::Retry { class: ErrorClass::Transient, .. }), "{t:?}");
                }
            }
            Some(ErrorClass::Ambiguous) => {
                // A reconcile URL makes the next attempt a lookup first: safe to repeat.
                if last || !(retry_ambiguous || reconcile) {
                    prop_assert_eq!(t, Transition::Dead { class: ErrorClass::Ambiguous });
                } else {
                    prop_assert!(matches!(t, Transition::Retry { class: ErrorClass::Ambiguous, .. }), "{t:?}");
                }
            }
        }
        if let Transition::Retry { class, delay } = t {
            prop_assert_eq!(Some(class), failure);
            prop_assert_eq!(delay, p.delay(attempt, retry_after, jitter));
            prop_assert!(delay <= p.max);
        }
    }
}

// ---------------------------------------------------------------------------------------
// guard::is_forbidden
// ---------------------------------------------------------------------------------------

/// IPv4 addresses, half of them in or next to the interesting ranges.
fn ipv4() -> impl Strategy<Value = Ipv4Addr> {
    prop_oneof![
        any::<u32>().prop_map(Ipv4Addr::from),
        (
            prop::sample::select(vec![
                0u8, 10, 100, 126, 127, 128, 169, 172, 192, 198, 223, 224, 239, 240, 255
            ]),
            any::<[u8; 3]>()
        )
            .prop_map(|(a, [b, c, d])| Ipv4Addr::new(a, b, c, d)),
    ]
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn ipv4_mapped_ipv6_is_forbidden_iff_the_ipv4_is(v4 in ipv4()) {
        let direct = is_forbidden(IpAddr::V4(v4));
        prop_assert_eq!(is_forbidden(IpAddr::V6(v4.to_ipv6_mapped())), direct, "::ffff:{}", v4);
    }

    #[test]
    fn other_ipv6_forms_embedding_ipv4_are_judged_by_it(v4 in ipv4()) {
        let direct = is_forbidden(IpAddr::V4(v4));
        let [a, b, c, d] = v4.octets();
        let lo = [u16::from_be_bytes([a, b]), u16::from_be_bytes([c, d])];
        let compatible = Ipv6Addr::new(0, 0, 0, 0, 0, 0, lo[0], lo[1]);
        let nat64 = Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, lo[0], lo[1]);
        prop_assert_eq!(is_forbidden(IpAddr::V6(compatible)), direct, "{}", compatible);
        prop_assert_eq!(is_forbidden(IpAddr::V6(nat64)), direct, "{}", nat64);
    }

    /// However the URL spells an IPv4 host (decimal, hex, mapped IPv6), the address the
    /// guard sees is the same one.
    #[test]
    fn url_spellings_of_an_ipv4_host_reach_the_guard_as_that_address(v4 in ipv4()) {
        let n = u32::from(v4);
        for text in [
            format!("http://{n}/"),
            format!("http://{n:#x}/"),
            format!("http://[::ffff:{v4}]/"),
        ] {
            let req = parse_payload(&serde_json::json!({ "url": text }).to_string());
            let req = req.map_err(|e| TestCaseError::fail(format!("{text}: {}", e.message)))?;
            let ip = match req.url.host() {
                Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip),
                Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip),
                other => return Err(TestCaseError::fail(format!("{text}: host {other:?}"))),
            };
            prop_assert_eq!(is_forbidden(ip), is_forbidden(IpAddr::V4(v4)), "{}", text);
        }
    }
}
