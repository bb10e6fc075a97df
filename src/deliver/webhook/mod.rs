//! Webhook delivery: one HTTP request per attempt.
//!
//! Every attempt of a message sends the same bytes with the same identity: the body exactly
//! as PostgreSQL rendered it, `Idempotency-Key` and Standard Webhooks' `webhook-id` set to
//! the message key, and (when a secret is configured) a `webhook-signature` over
//! `id.timestamp.body`. Redirects are not followed and proxies are not used: both would send
//! the request somewhere the destination check did not look.

pub mod settings;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::value::RawValue;
use sha2::Sha256;

use self::settings::WebhookConfig;
use super::guard::{BlockedDestination, Guard, GuardedResolver};
use super::{Delivered, DeliveryError, Outgoing};
use crate::model::ConfigError;
use crate::model::ErrorClass;
use crate::retry::classify_http_status;

/// Most bytes of a response body read (and discarded) to keep the connection reusable.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

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

/// Sends webhooks through one shared HTTP client (keep-alive connection pools per host).
#[derive(Debug, Clone)]
pub struct WebhookSender {
    client: reqwest::Client,
    guard: Guard,
    signing_key: Option<Vec<u8>>,
    timeout: Duration,
}

/// The webhook payload, as the contract has it.
#[derive(Deserialize)]
struct Payload<'a> {
    url: Option<serde_json::Value>,
    method: Option<serde_json::Value>,
    headers: Option<serde_json::Value>,
    #[serde(borrow)]
    body: Option<&'a RawValue>,
}

/// A payload checked and ready to send.
#[derive(Debug)]
pub struct Request {
    /// Where to.
    pub url: url::Url,
    /// POST, PUT or PATCH.
    pub method: reqwest::Method,
    /// The application's own headers.
    pub headers: HeaderMap,
    /// The body bytes, identical on every attempt.
    pub body: Vec<u8>,
}

/// Checks a webhook payload (jsonb text) and turns it into a request, or says why it is
/// invalid. The message names fields, never values.
pub fn parse_payload(payload: &str) -> Result<Request, DeliveryError> {
    let p: Payload<'_> = serde_json::from_str(payload)
        .map_err(|_| DeliveryError::invalid("payload is not a JSON object of the webhook shape"))?;
    let url = match p.url {
        Some(serde_json::Value::String(s)) => s,
        _ => return Err(DeliveryError::invalid("payload.url must be a string")),
    };
    let url = url::Url::parse(&url)
        .map_err(|e| DeliveryError::invalid(format!("payload.url is not a valid URL ({e})")))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(DeliveryError::invalid(format!(
            "payload.url scheme {:?} is not allowed (only http and https)",
            url.scheme()
        )));
    }
    if url.host().is_none() {
        return Err(DeliveryError::invalid("payload.url has no host"));
    }
    let method = match p.method {
        None | Some(serde_json::Value::Null) => reqwest::Method::POST,
        Some(serde_json::Value::String(m)) => match m.to_ascii_uppercase().as_str() {
            "POST" => reqwest::Method::POST,
            "PUT" => reqwest::Method::PUT,
            "PATCH" => reqwest::Method::PATCH,
            _ => {
                return Err(DeliveryError::invalid(
                    "payload.method must be POST, PUT or PATCH",
                ));
            }
        },
        Some(_) => return Err(DeliveryError::invalid("payload.method must be a string")),
    };
    let mut headers = HeaderMap::new();
    match p.headers {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (name, value) in map {
                let serde_json::Value::String(value) = value else {
                    return Err(DeliveryError::invalid(format!(
                        "payload.headers.{} must be a string",
                        printable(&name)
                    )));
                };
                let hname = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                    DeliveryError::invalid(format!(
                        "payload.headers: {:?} is not a valid header name",
                        printable(&name)
                    ))
                })?;
                if RESERVED_HEADERS.contains(&hname.as_str()) {
                    return Err(DeliveryError::invalid(format!(
                        "payload.headers.{} is set by the worker and may not be given",
                        hname.as_str()
                    )));
                }
                // HeaderValue refuses CR, LF and other control bytes: no header injection.
                let hvalue = HeaderValue::from_str(&value).map_err(|_| {
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
    let body = p
        .body
        .map(|b| b.get().as_bytes().to_vec())
        .unwrap_or_else(|| b"null".to_vec());
    Ok(Request {
        url,
        method,
        headers,
        body,
    })
}

/// A header name (untrusted) shortened and stripped for an error message.
fn printable(s: &str) -> String {
    s.chars().filter(|c| !c.is_control()).take(64).collect()
}

/// The Standard Webhooks signature: `v1,` and the base64 HMAC-SHA256 of `id.timestamp.body`.
pub fn sign(key: &[u8], msg_id: &str, timestamp: u64, body: &[u8]) -> String {
    // HMAC accepts keys of any length; new_from_slice cannot fail for it.
    let mut mac = match Hmac::<Sha256>::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    format!("v1,{sig}")
}

/// The host of a URL, for error messages (never the path or query, which often carry
/// tokens).
fn host_of(url: &url::Url) -> String {
    url.host_str().unwrap_or("?").to_owned()
}

/// Parses `Retry-After`: delay-seconds or an HTTP date.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

impl WebhookSender {
    /// Builds the shared client.
    pub fn new(cfg: &WebhookConfig) -> Result<Self, ConfigError> {
        let guard = Guard::new(cfg.destinations.clone());
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(cfg.timeout)
            // A connect that times out sent nothing (transient); keep it distinct from the
            // whole-request timeout, after which the request may have been processed.
            .connect_timeout((cfg.timeout / 2).max(Duration::from_millis(100)))
            .pool_idle_timeout(Duration::from_secs(30))
            .tcp_nodelay(true)
            .user_agent(concat!("outboxd/", env!("CARGO_PKG_VERSION")))
            .dns_resolver(GuardedResolver::new(guard.clone()))
            .build()
            .map_err(|e| ConfigError(format!("cannot build the HTTP client: {e}")))?;
        Ok(WebhookSender {
            client,
            guard,
            signing_key: cfg.signing_key.clone(),
            timeout: cfg.timeout,
        })
    }

    /// The whole-request timeout of one attempt (`--webhook-timeout`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends one attempt.
    pub async fn send(&self, msg: Outgoing<'_>) -> Result<Delivered, DeliveryError> {
        let req = parse_payload(msg.payload)?;
        self.check_literal_host(&req.url)?;
        let host = host_of(&req.url);

        let now = SystemTime::now();
        let timestamp = now
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // from_bytes accepts any key without control characters (UTF-8 included).
        let key = HeaderValue::from_bytes(msg.key.as_bytes()).map_err(|_| {
            DeliveryError::invalid(
                "the message key has control characters and cannot be sent as a header",
            )
        })?;
        let mut headers = req.headers;
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert("idempotency-key", key.clone());
        headers.insert("webhook-id", key);
        headers.insert("webhook-timestamp", HeaderValue::from(timestamp));
        if let Some(signing_key) = &self.signing_key {
            let sig = sign(signing_key, msg.key, timestamp, &req.body);
            if let Ok(v) = HeaderValue::from_str(&sig) {
                headers.insert("webhook-signature", v);
            }
        }

        let result = self
            .client
            .request(req.method, req.url)
            .headers(headers)
            .body(req.body)
            .send()
            .await;
        let mut response = match result {
            Ok(r) => r,
            Err(e) => return Err(self.classify_error(e, &host)),
        };

        let status = response.status().as_u16();
        let deduplicated = response
            .headers()
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let retry_after = if status == 429 || status == 503 {
            response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| parse_retry_after(v, SystemTime::now()))
        } else {
            None
        };
        // Read (and drop) a bounded amount of the body so the connection can be reused.
        // A failure here does not change the outcome: the status line has answered.
        let mut read = 0usize;
        while read < MAX_RESPONSE_BYTES {
            match response.chunk().await {
                Ok(Some(chunk)) => read += chunk.len(),
                Ok(None) | Err(_) => break,
            }
        }
        let summary = serde_json::json!({ "status": status, "replayed": deduplicated });
        match classify_http_status(status) {
            None => Ok(Delivered {
                status: Some(i32::from(status)),
                deduplicated,
                response: summary,
            }),
            Some(class) => Err(DeliveryError {
                class,
                status: Some(i32::from(status)),
                retry_after,
                response: Some(summary),
                message: format!("HTTP {status} from {host}"),
                source: None,
            }),
        }
    }

    /// A URL whose host is an IP literal never reaches the resolver: check it here.
    fn check_literal_host(&self, url: &url::Url) -> Result<(), DeliveryError> {
        let ip = match url.host() {
            Some(url::Host::Ipv4(v4)) => std::net::IpAddr::V4(v4),
            Some(url::Host::Ipv6(v6)) => std::net::IpAddr::V6(v6),
            _ => return Ok(()),
        };
        let host = host_of(url);
        if self.guard.host_exempt(&host) || self.guard.ip_allowed(ip) {
            Ok(())
        } else {
            Err(DeliveryError::invalid(format!(
                "destination not allowed: {host} is a private or reserved address"
            )))
        }
    }

    /// Classes a transport error, keeping the cause but never the URL.
    ///
    /// * The destination check refused every address: `invalid`.
    /// * Connecting failed (refused, DNS, TLS, connect timeout), or the connection was lost
    ///   before the request was written out (hyper says canceled, or the body write
    ///   failed): nothing usable was sent, so `transient`.
    /// * Anything after the connection was made (a timeout waiting for the response, a
    ///   reset, a closed connection): the provider may have processed the request, so
    ///   `ambiguous`. hyper does not tell us reliably whether the last byte of the request
    ///   left, and calling a sent request "transient" would send it twice without the
    ///   message's consent; when in doubt, ambiguous.
    fn classify_error(&self, err: reqwest::Error, host: &str) -> DeliveryError {
        let err = err.without_url();
        let mut detail = String::new();
        let mut blocked = None;
        let mut unsent = false;
        let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&err);
        while let Some(e) = src {
            if let Some(b) = e.downcast_ref::<BlockedDestination>() {
                blocked = Some(b.to_string());
            }
            if let Some(h) = e.downcast_ref::<hyper::Error>() {
                // Canceled: the connection closed before the request was dispatched to it.
                // A failed body write: the request was cut short. Either way the receiver
                // never had a whole request to act on. (hyper has no predicate for the
                // body-write kind; its message is stable.)
                if h.is_canceled() || h.to_string() == "error writing a body to connection" {
                    unsent = true;
                }
            }
            if !detail.is_empty() {
                detail.push_str(": ");
            }
            detail.push_str(&e.to_string());
            src = e.source();
        }
        let (class, what) = if let Some(b) = blocked {
            return DeliveryError::invalid(b);
        } else if err.is_builder() {
            (ErrorClass::Invalid, "cannot build the request")
        } else if err.is_connect() {
            (ErrorClass::Transient, "cannot connect")
        } else if unsent {
            (
                ErrorClass::Transient,
                "connection lost before the request was sent",
            )
        } else if err.is_timeout() {
            (ErrorClass::Ambiguous, "timed out waiting for the response")
        } else {
            (
                ErrorClass::Ambiguous,
                "connection failed after the request was sent",
            )
        };
        let message = if err.is_timeout() && class == ErrorClass::Ambiguous {
            format!("{what} from {host} after {}ms", self.timeout.as_millis())
        } else {
            format!("{what} to {host}: {detail}")
        };
        DeliveryError {
            source: Some(Box::new(err)),
            ..DeliveryError::new(class, message)
        }
    }
}

/// The header names of a payload, for `outboxd show` (values are redacted).
pub fn header_names(payload: &serde_json::Value) -> BTreeMap<String, &'static str> {
    payload
        .get("headers")
        .and_then(|h| h.as_object())
        .map(|m| m.keys().map(|k| (k.clone(), "[redacted]")).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_the_standard_webhooks_vector() {
        let vector: serde_json::Value = serde_json::from_str(include_str!(
            "../../../tests/data/standard-webhooks-vector.json"
        ))
        .expect("vector parses");
        let secret = vector["secret"].as_str().expect("secret");
        let key = settings::parse_webhook_secret(secret).expect("secret decodes");
        let sig = sign(
            &key,
            vector["webhook_id"].as_str().expect("id"),
            vector["webhook_timestamp"].as_u64().expect("ts"),
            vector["body"].as_str().expect("body").as_bytes(),
        );
        assert_eq!(sig, vector["webhook_signature"].as_str().expect("sig"));
    }

    #[test]
    fn payload_rules() {
        let ok = parse_payload(
            r#"{"url": "https://example.com/h?t=1", "body": {"b": 1.50, "a": [1, 2]}}"#,
        )
        .expect("valid");
        assert_eq!(ok.method, reqwest::Method::POST);
        // The body is sent exactly as stored, byte for byte.
        assert_eq!(ok.body, br#"{"b": 1.50, "a": [1, 2]}"#);
        let put = parse_payload(
            r#"{"url": "http://x.example", "method": "put", "headers": {"X-A": "1"}}"#,
        )
        .expect("valid");
        assert_eq!(put.method, reqwest::Method::PUT);
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
            (r#"[1]"#, "webhook shape"),
        ] {
            let err = parse_payload(payload).expect_err(payload);
            assert_eq!(err.class, ErrorClass::Invalid, "{payload}");
            assert!(err.message.contains(needle), "{payload}: {}", err.message);
            assert!(
                !err.message.contains("a\r\nB"),
                "no header value in {}",
                err.message
            );
        }
    }

    #[test]
    fn retry_after_forms() {
        let now = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Thu, 01 Jan 2026 00:01:00 GMT", now),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            parse_retry_after("Wed, 31 Dec 2025 00:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon", now), None);
    }
}
