//! The http payload: `endpoint`, `method`, `path`, `query`, `form` or `json`, `headers`,
//! `reconcile`, `store_response`, checked and turned into a [`Call`], or refused as
//! `invalid` with a message that names fields, never values. The endpoint's own rules (its
//! base URL, which headers are the worker's) apply later, in [`super::endpoint`].

use hyper::header::{HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::deliver::DeliveryError;

/// The payload as read from its JSON text, its members not yet checked.
#[derive(Deserialize)]
struct Read {
    endpoint: Option<Value>,
    method: Option<Value>,
    path: Option<Value>,
    query: Option<Value>,
    form: Option<Value>,
    json: Option<Box<RawValue>>,
    headers: Option<Value>,
    reconcile: Option<Value>,
    store_response: Option<Value>,
}

/// What is sent as the body.
#[derive(Clone, PartialEq, Eq)]
pub enum Body {
    /// No body (no `form`, no `json`).
    None,
    /// `form`, encoded as `application/x-www-form-urlencoded` in bracket notation.
    Form(String),
    /// `json`, exactly as stored.
    Json(Vec<u8>),
}

/// A checked http payload.
pub struct Call {
    /// The endpoint's name.
    pub endpoint: String,
    /// POST (default), PUT, PATCH or DELETE.
    pub method: hyper::Method,
    /// The path, appended to the endpoint's URL (starts with `/`).
    pub path: String,
    /// The query's pairs, in bracket notation.
    pub query: Vec<(String, String)>,
    /// The body.
    pub body: Body,
    /// The payload's headers, in order (checked against the endpoint's reserved names later).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The reconciliation lookup, when the payload names one.
    pub reconcile: Option<Lookup>,
    /// Keep the delivering response's body (default true).
    pub store_response: bool,
}

/// `reconcile`: a GET to the same endpoint.
pub struct Lookup {
    /// The path (`{key}` not yet replaced).
    pub path: String,
    /// The query's pairs (`{key}` not yet replaced in values).
    pub query: Vec<(String, String)>,
    /// `found`: a JSON pointer that must name a value for a 2xx to mean "it happened".
    pub found: Option<String>,
}

impl std::fmt::Debug for Call {
    /// The endpoint, the method, the query's and headers' names and the body's kind and
    /// length: never a path, a value or a body.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let body = match &self.body {
            Body::None => "none".to_owned(),
            Body::Form(s) => format!("form, {} bytes", s.len()),
            Body::Json(b) => format!("json, {} bytes", b.len()),
        };
        f.debug_struct("Call")
            .field("endpoint", &self.endpoint)
            .field("method", &self.method)
            .field("path_len", &self.path.len())
            .field(
                "query",
                &self.query.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("body", &body)
            .field(
                "headers",
                &self.headers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("reconcile", &self.reconcile.is_some())
            .field("store_response", &self.store_response)
            .finish()
    }
}

/// The endpoint's name a payload gives, if any (for the worker to see whether its table
/// knows it without checking the rest).
pub fn endpoint_of(payload: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Name {
        endpoint: Option<Value>,
    }
    let Name { endpoint } = serde_json::from_str(payload).ok()?;
    endpoint.and_then(|v| v.as_str().map(str::to_owned))
}

/// Checks an http payload (jsonb text) and turns it into a [`Call`].
pub fn parse(payload: &str) -> Result<Call, DeliveryError> {
    let p: Read = serde_json::from_str(payload)
        .map_err(|_| DeliveryError::invalid("payload is not a JSON object of the http shape"))?;
    let endpoint = match &p.endpoint {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => return Err(DeliveryError::invalid("payload.endpoint must be a string")),
    };
    let method = match &p.method {
        None | Some(Value::Null) => hyper::Method::POST,
        Some(Value::String(m)) => match m.to_ascii_uppercase().as_str() {
            "POST" => hyper::Method::POST,
            "PUT" => hyper::Method::PUT,
            "PATCH" => hyper::Method::PATCH,
            "DELETE" => hyper::Method::DELETE,
            _ => {
                return Err(DeliveryError::invalid(
                    "payload.method must be POST, PUT, PATCH or DELETE",
                ));
            }
        },
        Some(_) => return Err(DeliveryError::invalid("payload.method must be a string")),
    };
    let path = path("payload.path", p.path.as_ref())?;
    let query = pairs("payload.query", p.query.as_ref())?;
    let body = match (&p.form, &p.json) {
        (Some(_), Some(_)) if !matches!(p.form, Some(Value::Null)) => {
            return Err(DeliveryError::invalid(
                "payload has both form and json; give at most one",
            ));
        }
        (Some(Value::Null) | None, Some(raw)) => Body::Json(raw.get().as_bytes().to_vec()),
        (Some(Value::Null) | None, None) => Body::None,
        (Some(form @ Value::Object(_)), None) => Body::Form(encode_pairs(&flatten(form))),
        (Some(_), _) => return Err(DeliveryError::invalid("payload.form must be an object")),
    };
    let headers = headers(p.headers.as_ref())?;
    let reconcile = match &p.reconcile {
        None | Some(Value::Null) => None,
        Some(Value::Object(r)) => {
            match r.get("method") {
                None | Some(Value::Null) => {}
                Some(Value::String(m)) if m.eq_ignore_ascii_case("GET") => {}
                Some(_) => {
                    return Err(DeliveryError::invalid(
                        "payload.reconcile.method must be GET",
                    ));
                }
            }
            let found = match r.get("found") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if s.is_empty() || s.starts_with('/') => Some(s.clone()),
                Some(_) => {
                    return Err(DeliveryError::invalid(
                        "payload.reconcile.found must be a JSON pointer (\"/data/0\")",
                    ));
                }
            };
            Some(Lookup {
                path: self::path("payload.reconcile.path", r.get("path"))?,
                query: pairs("payload.reconcile.query", r.get("query"))?,
                found,
            })
        }
        Some(_) => {
            return Err(DeliveryError::invalid(
                "payload.reconcile must be an object with a path",
            ));
        }
    };
    let store_response = match &p.store_response {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(DeliveryError::invalid(
                "payload.store_response must be a boolean",
            ));
        }
    };
    Ok(Call {
        endpoint,
        method,
        path,
        query,
        body,
        headers,
        reconcile,
        store_response,
    })
}

/// A path: a string that starts with `/`, without control characters, backslashes, `?`
/// or `#` (the query has its own member); absent, the endpoint's URL as it is (as enqueue's
/// rule has it). Where it leads is checked once it is joined to the endpoint's URL
/// ([`super::endpoint::Endpoint::url_for`]).
fn path(field: &str, value: Option<&Value>) -> Result<String, DeliveryError> {
    let p = match value {
        None | Some(Value::Null) => return Ok(String::new()),
        Some(Value::String(p)) => p,
        Some(_) => return Err(DeliveryError::invalid(format!("{field} must be a string"))),
    };
    if !p.starts_with('/') {
        return Err(DeliveryError::invalid(format!("{field} must start with /")));
    }
    if p.chars()
        .any(|c| c.is_control() || matches!(c, '\\' | '?' | '#'))
    {
        return Err(DeliveryError::invalid(format!(
            "{field} has control characters, a backslash, ? or #; write the path plainly and give the query as payload.query"
        )));
    }
    Ok(p.clone())
}

/// `query`: absent, null or an object, flattened in bracket notation like `form`.
fn pairs(field: &str, value: Option<&Value>) -> Result<Vec<(String, String)>, DeliveryError> {
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v @ Value::Object(_)) => Ok(flatten(v)),
        Some(_) => Err(DeliveryError::invalid(format!("{field} must be an object"))),
    }
}

/// The payload's `headers`: an object of strings, names valid, values without control
/// characters.
fn headers(value: Option<&Value>) -> Result<Vec<(HeaderName, HeaderValue)>, DeliveryError> {
    let map = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(DeliveryError::invalid(
                "payload.headers must be an object of strings",
            ));
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (name, value) in map {
        let shown = crate::text::stripped(name, 64);
        let Value::String(value) = value else {
            return Err(DeliveryError::invalid(format!(
                "payload.headers.{shown} must be a string"
            )));
        };
        let hname = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            DeliveryError::invalid(format!(
                "payload.headers: {shown:?} is not a valid header name"
            ))
        })?;
        let hvalue = HeaderValue::from_str(value).map_err(|_| {
            DeliveryError::invalid(format!(
                "payload.headers.{} has a value with control characters",
                hname.as_str()
            ))
        })?;
        out.push((hname, hvalue));
    }
    Ok(out)
}

/// A JSON object as the (name, value) pairs of a form in the bracket notation Stripe and
/// Rack read: `{"metadata": {"order": 42}}` is `metadata[order]=42`, `{"items": [{"price":
/// "p_1"}]}` is `items[0][price]=p_1`. Strings as they are, numbers as JSON writes them,
/// booleans as `true` and `false`, members in the order the stored payload has them (jsonb's,
/// the same on every attempt). A `null` is left out (Stripe reads `name=` as "unset";
/// a payload that means that writes the empty string), and so is an empty object or array
/// (nothing names it in this notation).
pub fn flatten(value: &Value) -> Vec<(String, String)> {
    fn walk(prefix: String, v: &Value, out: &mut Vec<(String, String)>) {
        match v {
            Value::Null => {}
            Value::Bool(b) => out.push((prefix, b.to_string())),
            Value::Number(n) => out.push((prefix, n.to_string())),
            Value::String(s) => out.push((prefix, s.clone())),
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    walk(format!("{prefix}[{i}]"), item, out);
                }
            }
            Value::Object(map) => {
                for (k, item) in map {
                    let name = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}[{k}]")
                    };
                    walk(name, item, out);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(String::new(), value, &mut out);
    out
}

/// Pairs encoded as `application/x-www-form-urlencoded`, the brackets of the names left
/// as they are (`metadata[order]=42`); everything else of names and values encoded.
pub fn encode_pairs(pairs: &[(String, String)]) -> String {
    let mut out = String::new();
    for (name, value) in pairs {
        if !out.is_empty() {
            out.push('&');
        }
        for (i, part) in name.split('[').enumerate() {
            if i > 0 {
                out.push('[');
            }
            let (inner, closed) = match part.strip_suffix(']') {
                Some(inner) if i > 0 => (inner, true),
                _ => (part, false),
            };
            out.extend(url::form_urlencoded::byte_serialize(inner.as_bytes()));
            if closed {
                out.push(']');
            }
        }
        out.push('=');
        out.extend(url::form_urlencoded::byte_serialize(value.as_bytes()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ErrorClass;

    #[test]
    fn forms_in_bracket_notation() {
        let form = serde_json::json!({"amount": 2000, "currency": "eur", "capture": false,
            "metadata": {"order": 42, "note": "a&b=c d"}, "items": [{"price": "p_1"}, {"price": "p_2"}],
            "gone": null, "empty": {}});
        assert_eq!(
            encode_pairs(&flatten(&form)),
            "amount=2000&capture=false&currency=eur&items[0][price]=p_1&items[1][price]=p_2\
             &metadata[note]=a%26b%3Dc+d&metadata[order]=42"
        );
    }

    #[test]
    fn payload_rules() {
        let c = parse(
            r#"{"endpoint": "stripe", "path": "/v1/charges", "form": {"a": 1},
                "query": {"expand": ["x"]}, "headers": {"Stripe-Account": "acct_1"}}"#,
        )
        .expect("valid");
        assert_eq!(c.method, hyper::Method::POST);
        assert!(c.store_response);
        assert!(c.body == Body::Form("a=1".into()));
        assert_eq!(c.query, [("expand[0]".to_owned(), "x".to_owned())]);
        let j = parse(r#"{"endpoint": "e", "method": "delete", "path": "/x", "json": {"b": 1.50}, "store_response": false}"#)
            .expect("valid");
        assert_eq!(j.method, hyper::Method::DELETE);
        assert!(j.body == Body::Json(br#"{"b": 1.50}"#.to_vec()));
        assert!(!j.store_response);
        // No path: the endpoint's URL as it is.
        assert_eq!(parse(r#"{"endpoint": "e"}"#).expect("valid").path, "");
        for (payload, needle) in [
            (r#"{"path": "/x"}"#, "payload.endpoint"),
            (
                r#"{"endpoint": "e", "path": 5}"#,
                "payload.path must be a string",
            ),
            (r#"{"endpoint": "e", "path": "x"}"#, "must start with /"),
            (r#"{"endpoint": "e", "path": "/a\\evil"}"#, "backslash"),
            (r#"{"endpoint": "e", "path": "/a\u0000b"}"#, "control"),
            (r#"{"endpoint": "e", "path": "/a\nb"}"#, "control"),
            (
                r#"{"endpoint": "e", "path": "/a?token=SECRET"}"#,
                "payload.query",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "method": "GET"}"#,
                "payload.method",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "form": {}, "json": 1}"#,
                "at most one",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "form": [1]}"#,
                "payload.form",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "query": "a=SECRET"}"#,
                "payload.query",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "headers": {"X": "a\r\nSECRET: 1"}}"#,
                "control",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "reconcile": {"path": "/l", "method": "POST"}}"#,
                "reconcile.method",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "reconcile": {"path": "/l", "found": "data"}}"#,
                "reconcile.found",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "reconcile": {"path": 5}}"#,
                "reconcile.path",
            ),
            (
                r#"{"endpoint": "e", "path": "/x", "store_response": "yes"}"#,
                "store_response",
            ),
        ] {
            let err = parse(payload).expect_err(payload);
            assert_eq!(err.class, ErrorClass::Invalid, "{payload}");
            assert!(err.message.contains(needle), "{payload}: {}", err.message);
            assert!(!err.message.contains("SECRET"), "{}", err.message);
        }
    }
}
