//! The webhook payload: the contract's shape (`url`, `method`, `headers`, `body`, and the
//! optional `reconcile` lookup and `store_response` flag) checked and turned into a
//! [`Request`], or refused as `invalid` with a message that names fields, never values.

use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::urls::UrlCache;
use crate::deliver::DeliveryError;

/// Headers the worker sets itself; a payload may not override them.
const RESERVED_HEADERS: [&str; 7] = [
    "content-type",
    "content-length",
    "host",
    "idempotency-key",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
];

/// Headers that belong to the HTTP client's framing of the request, not to the
/// application: a payload's `Transfer-Encoding: gzip` made hyper send `gzip, chunked`
/// around plain JSON. Refused like the reserved ones.
const FRAMING_HEADERS: [&str; 4] = ["transfer-encoding", "te", "trailer", "upgrade"];

/// Is `name` (lower case, as `HeaderName` holds it) one the payload may not give? Also
/// with `_` for `-`: CGI, WSGI and Rack map both to the same variable, so
/// `Idempotency_Key` would reach such a receiver as the worker's own header.
fn reserved(name: &str) -> bool {
    let check = |n: &str| RESERVED_HEADERS.contains(&n) || FRAMING_HEADERS.contains(&n);
    check(name) || (name.contains('_') && check(&name.replace('_', "-")))
}

/// The header map's first capacity: the seven headers the map ends up with on every
/// request (the five of [`RESERVED_HEADERS`] the worker sets, all but `content-length`
/// and `host`, which hyper writes; the client's `user-agent` and `accept`) and a few of
/// the application's.
const HEADER_ROOM: usize = 12;

/// A webhook payload read from its JSON text, its members not yet checked: what
/// [`read`] gives and [`check`] turns into a [`Request`]. The claim reads each small
/// webhook payload once, off the attempt's path, and hands it to the attempt.
#[derive(Clone, Deserialize)]
pub struct Read {
    url: Option<serde_json::Value>,
    method: Option<serde_json::Value>,
    headers: Option<serde_json::Value>,
    body: Option<Box<RawValue>>,
    reconcile: Option<serde_json::Value>,
    store_response: Option<serde_json::Value>,
    secret: Option<serde_json::Value>,
}

impl std::fmt::Debug for Read {
    /// Which members the payload has, and the body's length: never a value (URLs carry
    /// tokens in their paths and queries, headers carry credentials).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let has = |v: &Option<serde_json::Value>| v.is_some();
        f.debug_struct("Read")
            .field("url", &has(&self.url))
            .field("method", &has(&self.method))
            .field("headers", &has(&self.headers))
            .field("body_len", &self.body.as_ref().map(|b| b.get().len()))
            .field("reconcile", &has(&self.reconcile))
            .field("store_response", &has(&self.store_response))
            .field("secret", &has(&self.secret))
            .finish()
    }
}

impl Read {
    /// `url`, when it is a string.
    pub fn url(&self) -> Option<&str> {
        self.url.as_ref().and_then(serde_json::Value::as_str)
    }

    /// [`trace_headers`] of the payload this was read from, without reading it again.
    pub fn trace_headers(&self) -> Option<TraceHeaders> {
        trace_headers_in(self.headers.as_ref())
    }
}

/// Reads a webhook payload (jsonb text): a JSON object, its members unchecked.
pub fn read(payload: &str) -> Result<Read, DeliveryError> {
    serde_json::from_str(payload)
        .map_err(|_| DeliveryError::invalid("payload is not a JSON object of the webhook shape"))
}

/// A payload checked and ready to send.
pub struct Request {
    /// Where to.
    pub url: url::Url,
    /// POST, PUT or PATCH.
    pub method: hyper::Method,
    /// The application's own headers.
    pub headers: HeaderMap,
    /// The body bytes, identical on every attempt.
    pub body: Vec<u8>,
    /// `reconcile.url`: where to ask, after an ambiguous attempt, whether it took effect.
    pub reconcile: Option<url::Url>,
    /// `reconcile.found`: a JSON pointer that must name a value in the lookup's 2xx answer
    /// for it to mean "it took effect".
    pub found: Option<String>,
    /// `store_response`: keep the delivering response's body in the `response` summary.
    pub store_response: bool,
    /// `secret`: the name of the signing keys to use (upper-cased), None for the default.
    pub secret: Option<String>,
}

impl std::fmt::Debug for Request {
    /// The URLs' origins, the headers' names and the body's length: never a path, a
    /// query, a header's value or the body.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("url", &self.url.origin().ascii_serialization())
            .field("method", &self.method)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("body_len", &self.body.len())
            .field(
                "reconcile",
                &self
                    .reconcile
                    .as_ref()
                    .map(|u| u.origin().ascii_serialization()),
            )
            .field("found", &self.found)
            .field("store_response", &self.store_response)
            .field("secret", &self.secret)
            .finish()
    }
}

/// Parses a destination URL (`field` names it in errors): http or https, with a host.
/// Through `urls` when given (the sender's cache), else parsed afresh.
fn parse_url(
    field: &str,
    value: Option<&serde_json::Value>,
    urls: Option<&UrlCache>,
) -> Result<url::Url, DeliveryError> {
    let url = match value {
        Some(serde_json::Value::String(s)) => s,
        _ => return Err(DeliveryError::invalid(format!("{field} must be a string"))),
    };
    let parsed = match urls {
        Some(cache) => cache.parse(url),
        None => url::Url::parse(url),
    };
    let url =
        parsed.map_err(|e| DeliveryError::invalid(format!("{field} is not a valid URL ({e})")))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(DeliveryError::invalid(format!(
            "{field} scheme {:?} is not allowed (only http and https)",
            url.scheme()
        )));
    }
    if url.host().is_none() {
        return Err(DeliveryError::invalid(format!("{field} has no host")));
    }
    Ok(url)
}

/// `reconcile`: absent or null, or an object with a string `url` and optionally a `found`
/// JSON pointer (other members are ignored, so a provider's lookup can grow settings
/// later).
#[allow(clippy::type_complexity)]
fn parse_reconcile(
    value: Option<&serde_json::Value>,
    urls: Option<&UrlCache>,
) -> Result<Option<(url::Url, Option<String>)>, DeliveryError> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Object(map)) => {
            let url = parse_url("payload.reconcile.url", map.get("url"), urls)?;
            let found = match map.get("found") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) if s.is_empty() || s.starts_with('/') => {
                    Some(s.clone())
                }
                Some(_) => {
                    return Err(DeliveryError::invalid(
                        "payload.reconcile.found must be a JSON pointer (\"/data/0\")",
                    ));
                }
            };
            Ok(Some((url, found)))
        }
        Some(_) => Err(DeliveryError::invalid(
            "payload.reconcile must be an object with a string url",
        )),
    }
}

/// Checks a webhook payload (jsonb text) and turns it into a request, or says why it is
/// invalid. The message names fields, never values.
pub fn parse_payload(payload: &str) -> Result<Request, DeliveryError> {
    parse_payload_with(payload, None)
}

/// [`parse_payload`], its URLs parsed through `urls` (the sender's cache) when given.
pub fn parse_payload_with(
    payload: &str,
    urls: Option<&UrlCache>,
) -> Result<Request, DeliveryError> {
    check(&read(payload)?, urls)
}

/// Checks a [`read`] payload and turns it into a request, or says why it is invalid; its
/// URLs parsed through `urls` (the sender's cache) when given.
pub fn check(p: &Read, urls: Option<&UrlCache>) -> Result<Request, DeliveryError> {
    let url = parse_url("payload.url", p.url.as_ref(), urls)?;
    let method = match &p.method {
        None | Some(serde_json::Value::Null) => hyper::Method::POST,
        Some(serde_json::Value::String(m)) => match m.to_ascii_uppercase().as_str() {
            "POST" => hyper::Method::POST,
            "PUT" => hyper::Method::PUT,
            "PATCH" => hyper::Method::PATCH,
            _ => {
                return Err(DeliveryError::invalid(
                    "payload.method must be POST, PUT or PATCH",
                ));
            }
        },
        Some(_) => return Err(DeliveryError::invalid("payload.method must be a string")),
    };
    // One allocation for every header of the request, where an empty map grew on the way.
    let mut headers = HeaderMap::with_capacity(HEADER_ROOM);
    match &p.headers {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (name, value) in map {
                let serde_json::Value::String(value) = value else {
                    return Err(DeliveryError::invalid(format!(
                        "payload.headers.{} must be a string",
                        crate::text::stripped(name, 64)
                    )));
                };
                let hname = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                    DeliveryError::invalid(format!(
                        "payload.headers: {:?} is not a valid header name",
                        crate::text::stripped(name, 64)
                    ))
                })?;
                if reserved(hname.as_str()) {
                    return Err(DeliveryError::invalid(format!(
                        "payload.headers.{} is set by the worker and may not be given",
                        hname.as_str()
                    )));
                }
                // HeaderValue refuses CR, LF and other control bytes: no header injection.
                let hvalue = HeaderValue::from_str(value).map_err(|_| {
                    DeliveryError::invalid(format!(
                        "payload.headers.{} has a value with control characters",
                        hname.as_str()
                    ))
                })?;
                headers.append(hname, hvalue);
            }
        }
        Some(_) => {
            return Err(DeliveryError::invalid(
                "payload.headers must be an object of strings",
            ));
        }
    }
    let (reconcile, found) = match parse_reconcile(p.reconcile.as_ref(), urls)? {
        Some((url, found)) => (Some(url), found),
        None => (None, None),
    };
    let store_response = match &p.store_response {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(_) => {
            return Err(DeliveryError::invalid(
                "payload.store_response must be a boolean",
            ));
        }
    };
    let secret = match &p.secret {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(name))
            if crate::deliver::webhook::settings::is_secret_name(name) =>
        {
            Some(name.to_ascii_uppercase())
        }
        Some(_) => {
            return Err(DeliveryError::invalid(
                "payload.secret must be a name of letters, digits and _ (at most 64)",
            ));
        }
    };
    let body = p
        .body
        .as_ref()
        .map(|b| b.get().as_bytes().to_vec())
        .unwrap_or_else(|| b"null".to_vec());
    Ok(Request {
        url,
        method,
        headers,
        body,
        reconcile,
        found,
        store_response,
        secret,
    })
}

/// The W3C trace context an application put in a payload's `headers`: `traceparent` and,
/// if given, `tracestate`, for the attempt's span to join the application's trace. The
/// request forwards both as given, like any other header; this is only the worker's reading
/// of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceHeaders {
    /// A well-formed `traceparent` (W3C Trace Context: `vv-<32 hex>-<16 hex>-ff`, lower-case,
    /// version not `ff`).
    pub traceparent: String,
    /// `tracestate`, when given once and at most [`MAX_TRACESTATE`] bytes long.
    pub tracestate: Option<String>,
}

/// The longest `tracestate` read (W3C Trace Context: 512 characters is what a platform must
/// propagate; anything longer is dropped here, and still forwarded as given).
pub const MAX_TRACESTATE: usize = 512;

/// The longest `traceparent` read (version 00 is 55 bytes; a later version may add fields).
const MAX_TRACEPARENT: usize = 256;

/// The payload's trace context, if its `headers` hold exactly one well-formed `traceparent`
/// (names compared without regard to case, as HTTP does). Anything else (no `traceparent`, two
/// of them, a value too long, with control characters or of another shape) gives `None`: the
/// attempt's span is then a root. This parses the payload again, so the worker asks only when
/// traces are on, and asks [`Read::trace_headers`] instead when the claim read the payload.
pub fn trace_headers(payload: &str) -> Option<TraceHeaders> {
    #[derive(Deserialize)]
    struct Headers {
        headers: Option<serde_json::Value>,
    }
    let Headers { headers } = serde_json::from_str(payload).ok()?;
    trace_headers_in(headers.as_ref())
}

/// The rule of [`trace_headers`], on the payload's `headers` member.
fn trace_headers_in(headers: Option<&serde_json::Value>) -> Option<TraceHeaders> {
    let Some(serde_json::Value::Object(map)) = headers else {
        return None;
    };
    // The only value under `name`, when there is exactly one.
    let only = |name: &str| -> Result<Option<&str>, ()> {
        let mut found = map
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str().ok_or(()));
        match (found.next(), found.next()) {
            (None, _) => Ok(None),
            (Some(v), None) => v.map(Some),
            (Some(_), Some(_)) => Err(()),
        }
    };
    let traceparent = only("traceparent").ok()??;
    if !well_formed_traceparent(traceparent) {
        return None;
    }
    let tracestate = only("tracestate")
        .ok()
        .flatten()
        .filter(|v| v.len() <= MAX_TRACESTATE && HeaderValue::from_str(v).is_ok())
        .map(str::to_owned);
    Some(TraceHeaders {
        traceparent: traceparent.to_owned(),
        tracestate,
    })
}

/// W3C Trace Context's `traceparent`: `version-traceid-parentid-flags`, lower-case hex of 2,
/// 32, 16 and 2 digits; version `ff` is invalid, version `00` has exactly these four
/// fields, a later one may add fields after a `-`. (The zero ids are refused by the
/// propagator that reads it.)
fn well_formed_traceparent(v: &str) -> bool {
    let b = v.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b[r].iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    b.len() >= 55
        && b.len() <= MAX_TRACEPARENT
        && hex(0..2)
        && &b[0..2] != b"ff"
        && b[2] == b'-'
        && hex(3..35)
        && b[35] == b'-'
        && hex(36..52)
        && b[52] == b'-'
        && hex(53..55)
        && if &b[0..2] == b"00" {
            b.len() == 55
        } else {
            b.len() == 55 || (b[55] == b'-' && HeaderValue::from_bytes(b).is_ok())
        }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ErrorClass;

    #[test]
    fn payload_rules() {
        let ok = parse_payload(
            r#"{"url": "https://example.com/h?t=1", "body": {"b": 1.50, "a": [1, 2]}}"#,
        )
        .expect("valid");
        assert_eq!(ok.method, hyper::Method::POST);
        // The body is sent exactly as stored, byte for byte.
        assert_eq!(ok.body, br#"{"b": 1.50, "a": [1, 2]}"#);
        let put = parse_payload(
            r#"{"url": "http://x.example", "method": "put", "headers": {"X-A": "1"}}"#,
        )
        .expect("valid");
        assert_eq!(put.method, hyper::Method::PUT);
        assert_eq!(put.body, b"null");
        assert_eq!(
            put.headers.get("x-a").map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );

        for (payload, needle) in [
            (r#"{"url": 5}"#, "payload.url must be a string"),
            (r#"{}"#, "payload.url must be a string"),
            (r#"{"url": "ftp://x.example/f"}"#, "scheme"),
            (r#"{"url": "file:///etc/passwd"}"#, "scheme"),
            (r#"{"url": "not a url"}"#, "not a valid URL"),
            (
                r#"{"url": "https://x.example", "method": "GET"}"#,
                "payload.method",
            ),
            (
                r#"{"url": "https://x.example", "method": 1}"#,
                "payload.method",
            ),
            (
                r#"{"url": "https://x.example", "headers": []}"#,
                "payload.headers",
            ),
            (
                r#"{"url": "https://x.example", "headers": {"X": 1}}"#,
                "payload.headers.X",
            ),
            (
                r#"{"url": "https://x.example", "headers": {"X": "a\r\nB: c"}}"#,
                "control characters",
            ),
            (
                r#"{"url": "https://x.example", "headers": {"Bad Name": "v"}}"#,
                "header name",
            ),
            (
                r#"{"url": "https://x.example", "headers": {"Idempotency-Key": "v"}}"#,
                "set by the worker",
            ),
            (
                r#"{"url": "https://x.example", "headers": {"Idempotency_Key": "v"}}"#,
                "set by the worker",
            ),
            (
                r#"{"url": "https://x.example", "headers": {"WEBHOOK_SIGNATURE": "v"}}"#,
                "set by the worker",
            ),
            (
                r#"{"url": "https://x.example", "headers": {"Transfer-Encoding": "gzip"}}"#,
                "set by the worker",
            ),
            (
                r#"{"url": "https://x.example", "headers": {"Upgrade": "h2c"}}"#,
                "set by the worker",
            ),
            (r#"[1]"#, "webhook shape"),
            (
                r#"{"url": "https://x.example", "reconcile": "https://x.example/l"}"#,
                "payload.reconcile must be an object",
            ),
            (
                r#"{"url": "https://x.example", "reconcile": ["https://x.example/l"]}"#,
                "payload.reconcile must be an object",
            ),
            (
                r#"{"url": "https://x.example", "reconcile": {}}"#,
                "payload.reconcile.url must be a string",
            ),
            (
                r#"{"url": "https://x.example", "reconcile": {"url": 7}}"#,
                "payload.reconcile.url must be a string",
            ),
            (
                r#"{"url": "https://x.example", "reconcile": {"url": "gopher://x.example/l"}}"#,
                "payload.reconcile.url scheme",
            ),
            (
                r#"{"url": "https://x.example", "reconcile": {"url": "file:///etc/passwd"}}"#,
                "payload.reconcile.url scheme",
            ),
            (
                r#"{"url": "https://x.example", "reconcile": {"url": "/relative?t=secret"}}"#,
                "payload.reconcile.url is not a valid URL",
            ),
            (
                r#"{"url": "https://x.example", "store_response": "yes"}"#,
                "payload.store_response must be a boolean",
            ),
            (
                r#"{"url": "https://x.example", "store_response": 1}"#,
                "payload.store_response must be a boolean",
            ),
        ] {
            let err = parse_payload(payload).expect_err(payload);
            assert_eq!(err.class, ErrorClass::Invalid, "{payload}");
            assert!(err.message.contains(needle), "{payload}: {}", err.message);
            assert!(
                !err.message.contains("a\r\nB"),
                "no header value in {}",
                err.message
            );
            assert!(!err.message.contains("secret"), "no URL in {}", err.message);
        }
    }

    #[test]
    fn reconcile_and_store_response() {
        let plain = parse_payload(r#"{"url": "https://x.example"}"#).expect("valid");
        assert_eq!(plain.reconcile, None);
        assert!(!plain.store_response);
        let both = parse_payload(
            r#"{"url": "https://x.example", "store_response": true,
                "reconcile": {"url": "https://x.example/charges?key=k", "extra": 1}}"#,
        )
        .expect("valid");
        assert_eq!(
            both.reconcile.as_ref().map(url::Url::as_str),
            Some("https://x.example/charges?key=k")
        );
        assert!(both.store_response);
        let nulls = parse_payload(
            r#"{"url": "https://x.example", "store_response": null, "reconcile": null}"#,
        )
        .expect("valid");
        assert_eq!(nulls.reconcile, None);
        assert!(!nulls.store_response);
    }

    #[test]
    fn trace_headers_rules() {
        const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        // Both readings, from the text and from the claim's read payload, agree on every case.
        let with = |headers: &str| {
            let text = format!(
                r#"{{"url": "https://x.example", "headers": {headers}, "body": {{"a": [1]}}}}"#
            );
            let from_text = trace_headers(&text);
            let from_read = read(&text).expect("reads").trace_headers();
            assert_eq!(from_text, from_read, "{text}");
            from_text
        };
        let got = with(&format!(
            r#"{{"traceparent": "{TP}", "tracestate": "k=v"}}"#
        ))
        .expect("well formed");
        assert_eq!(got.traceparent, TP);
        assert_eq!(got.tracestate.as_deref(), Some("k=v"));
        // Names in any case, as HTTP has them; tracestate optional.
        let got = with(&format!(r#"{{"TraceParent": "{TP}", "X-Other": "1"}}"#)).expect("ok");
        assert_eq!((got.traceparent.as_str(), got.tracestate), (TP, None));
        // A later version may carry more fields.
        let v1 = format!("01{}-what-comes-next", &TP[2..]);
        assert!(with(&format!(r#"{{"traceparent": "{v1}"}}"#)).is_some());
        // A tracestate too long or with control characters is dropped, not the parent.
        let long = "k=".to_owned() + &"v".repeat(MAX_TRACESTATE);
        let got = with(&format!(
            r#"{{"traceparent": "{TP}", "tracestate": "{long}"}}"#
        ));
        assert_eq!(got.expect("parent kept").tracestate, None);
        let got = with(&format!(
            r#"{{"traceparent": "{TP}", "tracestate": "k=v\u0007"}}"#
        ));
        assert_eq!(got.expect("parent kept").tracestate, None);

        let upper = TP.to_ascii_uppercase();
        let short = &TP[..54];
        let extra00 = format!("{TP}-00");
        let ff = format!("ff{}", &TP[2..]);
        let ctl = format!("{}\\u0000{}", &TP[..10], &TP[11..]);
        let nl = format!("{TP}\\r\\nX-Injected: 1");
        let huge = format!("01{}-{}", &TP[2..], "a".repeat(300));
        let bad_sep = TP.replace('-', "_");
        for headers in [
            r#"{}"#.to_owned(),
            r#"null"#.to_owned(),
            r#"{"traceparent": 7}"#.to_owned(),
            format!(r#"{{"traceparent": "{upper}"}}"#),
            format!(r#"{{"traceparent": "{short}"}}"#),
            format!(r#"{{"traceparent": "{extra00}"}}"#),
            format!(r#"{{"traceparent": "{ff}"}}"#),
            format!(r#"{{"traceparent": "{ctl}"}}"#),
            format!(r#"{{"traceparent": "{nl}"}}"#),
            format!(r#"{{"traceparent": "{huge}"}}"#),
            format!(r#"{{"traceparent": "{bad_sep}"}}"#),
            format!(r#"{{"traceparent": " {TP}"}}"#),
            r#"{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e47é6-00f067aa0ba902b7-01"}"#
                .to_owned(),
            // Two of them: which one the receiver reads is its business; the span takes neither.
            format!(r#"{{"traceparent": "{TP}", "Traceparent": "{TP}"}}"#),
        ] {
            assert_eq!(with(&headers), None, "{headers}");
        }
        assert_eq!(trace_headers("not json"), None);
        assert_eq!(trace_headers(r#"[{"headers": {}}]"#), None);
    }
}
