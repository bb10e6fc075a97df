//! The webhook payload: the contract's shape (`url`, `method`, `headers`, `body`) checked
//! and turned into a [`Request`], or refused as `invalid` with a message that names fields,
//! never values.

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::value::RawValue;

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
                        crate::text::stripped(&name, 64)
                    )));
                };
                let hname = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                    DeliveryError::invalid(format!(
                        "payload.headers: {:?} is not a valid header name",
                        crate::text::stripped(&name, 64)
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
}
