//! The webhook payload: the contract's shape (`url`, `method`, `headers`, `body`, and the
//! optional `reconcile` lookup and `store_response` flag) checked and turned into a
//! [`Request`], or refused as `invalid` with a message that names fields, never values.

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
    reconcile: Option<serde_json::Value>,
    store_response: Option<serde_json::Value>,
    secret: Option<serde_json::Value>,
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
    /// `reconcile.url`: where to ask, after an ambiguous attempt, whether it took effect.
    pub reconcile: Option<url::Url>,
    /// `store_response`: keep the delivering response's body in the `response` summary.
    pub store_response: bool,
    /// `secret`: the name of the signing keys to use (upper-cased), None for the default.
    pub secret: Option<String>,
}

/// Parses a destination URL (`field` names it in errors): http or https, with a host.
fn parse_url(field: &str, value: Option<serde_json::Value>) -> Result<url::Url, DeliveryError> {
    let url = match value {
        Some(serde_json::Value::String(s)) => s,
        _ => return Err(DeliveryError::invalid(format!("{field} must be a string"))),
    };
    let url = url::Url::parse(&url)
        .map_err(|e| DeliveryError::invalid(format!("{field} is not a valid URL ({e})")))?;
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

/// `reconcile`: absent or null, or an object with a string `url` (other members are
/// ignored, so a provider's lookup can grow settings later).
fn parse_reconcile(value: Option<serde_json::Value>) -> Result<Option<url::Url>, DeliveryError> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Object(mut map)) => {
            parse_url("payload.reconcile.url", map.remove("url")).map(Some)
        }
        Some(_) => Err(DeliveryError::invalid(
            "payload.reconcile must be an object with a string url",
        )),
    }
}

/// Checks a webhook payload (jsonb text) and turns it into a request, or says why it is
/// invalid. The message names fields, never values.
pub fn parse_payload(payload: &str) -> Result<Request, DeliveryError> {
    let p: Payload<'_> = serde_json::from_str(payload)
        .map_err(|_| DeliveryError::invalid("payload is not a JSON object of the webhook shape"))?;
    let url = parse_url("payload.url", p.url)?;
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
    let reconcile = parse_reconcile(p.reconcile)?;
    let store_response = match p.store_response {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Bool(b)) => b,
        Some(_) => {
            return Err(DeliveryError::invalid(
                "payload.store_response must be a boolean",
            ));
        }
    };
    let secret = match p.secret {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(name))
            if crate::deliver::webhook::settings::is_secret_name(&name) =>
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
        .map(|b| b.get().as_bytes().to_vec())
        .unwrap_or_else(|| b"null".to_vec());
    Ok(Request {
        url,
        method,
        headers,
        body,
        reconcile,
        store_response,
        secret,
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
}
