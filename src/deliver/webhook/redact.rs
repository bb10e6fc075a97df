//! A webhook payload as an operator may see it (`outboxd show`, the console): no more than
//! the logs and `outbox.attempts` keep.

use serde_json::{Map, Value};

/// Redacts a webhook payload's members in place:
///
/// * every header value is `[redacted]` (the names are kept);
/// * `url` (and `reconcile.url`) is reduced to its scheme, host and port, as errors name a
///   destination: no user name or password, path, query or fragment (tokens sit there);
///   `/[redacted]` marks that there was more. A URL that does not parse is not shown at all;
/// * `body` and `method` are shown: an operator needs them to judge a replay; so are the
///   names the worker reads (`secret`, the signing secret's name, and `store_response`),
///   in the shapes the worker takes;
/// * `reconcile`'s members other than its URL, and members the worker does not read (which
///   may hold a token), are `[redacted]`.
pub fn redact(fields: &mut Map<String, Value>) {
    for (name, value) in fields.iter_mut() {
        *value = match (name.as_str(), value.take()) {
            ("headers", v) => crate::deliver::redact_headers(v),
            ("url", url) => Value::String(redact_url(&url)),
            // The reconciliation lookup's URL carries tokens as often as the main one.
            // Its other members are the provider's settings, which may be tokens too.
            ("reconcile", Value::Object(mut r)) => {
                for (k, v) in r.iter_mut() {
                    *v = if k == "url" {
                        Value::String(redact_url(v))
                    } else {
                        Value::String("[redacted]".into())
                    };
                }
                Value::Object(r)
            }
            // Anything else (a reconcile URL written as a bare string, a member the worker
            // ignores) is refused as invalid or ignored by the worker, and may hold a token.
            ("body", v) => v,
            ("method" | "secret", v @ Value::String(_)) => v,
            ("store_response", v @ Value::Bool(_)) => v,
            (_, Value::Null) => Value::Null,
            (_, _) => Value::String("[redacted]".into()),
        };
    }
}

/// A webhook URL as errors and logs name its destination: `scheme://host[:port]/`, and
/// `[redacted]` after it when the URL had a path, query or fragment.
fn redact_url(url: &Value) -> String {
    let Some(text) = url.as_str() else {
        return "[redacted: not a string]".into();
    };
    let Ok(parsed) = url::Url::parse(text) else {
        return "[redacted: not a valid URL]".into();
    };
    let Some(host) = parsed.host_str() else {
        return format!("{}:[redacted]", parsed.scheme());
    };
    let port = parsed.port().map(|p| format!(":{p}")).unwrap_or_default();
    let more = parsed.path() != "/" || parsed.query().is_some() || parsed.fragment().is_some();
    format!(
        "{}://{host}{port}/{}",
        parsed.scheme(),
        if more { "[redacted]" } else { "" }
    )
}
