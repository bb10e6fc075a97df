//! Reconciliation: look before sending again, for both HTTP channels.
//!
//! After an attempt whose outcome is unknown (a timeout or a lost connection after the
//! request left, or a lease that expired while it ran), a payload with a `reconcile` has
//! the next attempt ask the provider first: a GET to the lookup's URL with the message's
//! identity, through the channel's client (the destination guard on the connected
//! address, no redirects, no proxy) and within the attempt's timeout. Each channel builds
//! the URL and the headers (a webhook's `reconcile.url` with its signature headers; an
//! http endpoint's lookup path with `{key}` filled in and its credential); [`ask`] sends
//! it and reads the answer. What the answer means is data, [`Verdict`] and
//! [`Verdict::next`]; a lookup is safe to repeat, so it needs no `retry_ambiguous` consent.

use std::time::{Duration, Instant};

use hyper::header::HeaderMap;

use super::answer::{answer_headers, host_of};
use super::body;
use super::classify::classify_error;
use super::client::{HttpClient, Response};
use super::{Delivered, DeliveryError};
use crate::model::ErrorClass;

/// What a lookup said about the earlier attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// 2xx: the provider has it; the earlier attempt took effect.
    Happened,
    /// 404 or 410: the provider has no such operation; it did not take effect.
    NotHappened,
    /// Any other status, a timeout or a failed connection: still unknown.
    Unknown,
    /// The destination guard refused the lookup's address: no request was made.
    Refused,
}

/// What the attempt does after the lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The message is delivered (history `reconciled`); the request is not sent.
    Delivered,
    /// The original request is sent, in this attempt.
    Send,
    /// The attempt fails with this class (and counts).
    Fail(ErrorClass),
}

impl Verdict {
    /// The verdict of an answered lookup.
    pub fn of_status(status: u16) -> Verdict {
        match status {
            200..=299 => Verdict::Happened,
            404 | 410 => Verdict::NotHappened,
            _ => Verdict::Unknown,
        }
    }

    /// The verdict of a lookup that got no answer: refused by the guard (its transport
    /// error is classed `invalid`), else unknown, whatever the transport error was (even a
    /// refused connection: the earlier attempt's outcome is no better known for it).
    pub fn of_failure(class: ErrorClass) -> Verdict {
        match class {
            ErrorClass::Invalid => Verdict::Refused,
            _ => Verdict::Unknown,
        }
    }

    /// The transition table of a lookup, one arm per verdict.
    pub fn next(self) -> Next {
        match self {
            Verdict::Happened => Next::Delivered,
            Verdict::NotHappened => Next::Send,
            Verdict::Unknown => Next::Fail(ErrorClass::Ambiguous),
            Verdict::Refused => Next::Fail(ErrorClass::Invalid),
        }
    }

    /// The name logged.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Happened => "happened",
            Verdict::NotHappened => "not_happened",
            Verdict::Unknown => "unknown",
            Verdict::Refused => "refused",
        }
    }
}

/// One lookup, for the attempt's log (`step=reconcile`): no URL path or query, no header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// What it said.
    pub verdict: Verdict,
    /// The HTTP status, when it was answered.
    pub status: Option<u16>,
    /// The lookup URL's host.
    pub host: String,
    /// How long it took.
    pub duration: Duration,
}

/// Asks the provider at `url` whether the earlier attempt took effect (both HTTP channels:
/// the channel builds the URL and the headers, this reads the answer). A GET with
/// `headers` and no body, through the channel's client, before `deadline`. Returns the
/// lookup and, unless the original request is to be sent now ([`Next::Send`]), the
/// attempt's result.
pub(crate) async fn ask(
    client: &HttpClient,
    timeout: Duration,
    url: &url::Url,
    headers: HeaderMap,
    store: bool,
    found: Option<&str>,
    deadline: tokio::time::Instant,
) -> (Lookup, Option<Result<Delivered, DeliveryError>>) {
    let host = host_of(url);
    let t0 = Instant::now();
    let sent = client
        .send(
            hyper::Method::GET,
            url,
            headers,
            bytes::Bytes::new(),
            deadline,
        )
        .await;
    let (verdict, status, result) = match sent {
        Ok(mut r) => {
            let (status, _, retry_after) = answer_headers(&r);
            let mut verdict = Verdict::of_status(status);
            let mut delivered = None;
            if verdict == Verdict::Happened {
                match found_in(&mut r, store, found, deadline).await {
                    Some(d) => delivered = Some(d),
                    None => verdict = Verdict::NotHappened,
                }
            }
            let result = match verdict.next() {
                Next::Send => None,
                Next::Delivered => delivered.map(Ok),
                Next::Fail(class) => Some(Err(DeliveryError {
                    status: Some(i32::from(status)),
                    retry_after,
                    ..lookup_failed(class, &format!("HTTP {status} from {host}"))
                })),
            };
            (verdict, Some(status), result)
        }
        Err(e) => {
            let err = classify_error(e, &host, timeout);
            let verdict = Verdict::of_failure(err.class);
            // A lookup without an answer never says found or missing.
            let class = match verdict.next() {
                Next::Fail(class) => class,
                Next::Delivered | Next::Send => ErrorClass::Ambiguous,
            };
            let failed = DeliveryError {
                source: err.source,
                ..lookup_failed(class, &err.message)
            };
            (verdict, None, Some(Err(failed)))
        }
    };
    let lookup = Lookup {
        verdict,
        status,
        host,
        duration: t0.elapsed(),
    };
    (lookup, result)
}

/// A lookup the channel refused before asking (its URL broke a host rule): no request.
pub(crate) fn refused(
    url_host: String,
    err: DeliveryError,
) -> (Lookup, Option<Result<Delivered, DeliveryError>>) {
    let lookup = Lookup {
        verdict: Verdict::Refused,
        status: None,
        host: url_host,
        duration: Duration::ZERO,
    };
    (lookup, Some(Err(err)))
}

/// The delivered result of a lookup that found the operation: its summary says
/// `reconciled`, and with `store_response` it keeps the lookup's body (the provider's
/// record of the operation is the result there is to keep). With a `found` pointer the
/// 2xx counts only when the pointer names a value (not null, an empty array or an empty
/// object), and that value is what is kept; `None` when it names none: the operation was
/// not found.
async fn found_in(
    response: &mut Response,
    store: bool,
    found: Option<&str>,
    deadline: tokio::time::Instant,
) -> Option<Delivered> {
    let (status, deduplicated, _) = answer_headers(response);
    let mut summary = serde_json::json!({
        "status": status,
        "replayed": deduplicated,
        "reconciled": true,
    });
    if store || found.is_some() {
        body::keep(response, &mut summary, deadline).await;
    }
    if let Some(pointer) = found {
        let value = found_value(&summary, pointer)?;
        if let Some(map) = summary.as_object_mut() {
            map.insert("body".into(), value);
        }
    }
    if !store {
        if let Some(map) = summary.as_object_mut() {
            for k in ["body", "body_truncated", "content_type"] {
                map.remove(k);
            }
        }
    }
    Some(Delivered {
        status: Some(i32::from(status)),
        deduplicated,
        response: summary,
    })
}

/// The value a `found` pointer names in a kept body (a lookup's summary), when it names
/// one that is not null, an empty array or an empty object. A truncated body names
/// nothing.
pub(crate) fn found_value(summary: &serde_json::Value, pointer: &str) -> Option<serde_json::Value> {
    use serde_json::Value;
    if summary.get("body_truncated") == Some(&Value::Bool(true)) {
        return None;
    }
    match summary.get("body")?.pointer(pointer)? {
        Value::Null => None,
        Value::Array(a) if a.is_empty() => None,
        Value::Object(o) if o.is_empty() => None,
        v => Some(v.clone()),
    }
}

/// The failure of an attempt whose lookup did not settle it; `what` is one safe line.
fn lookup_failed(class: ErrorClass, what: &str) -> DeliveryError {
    let message = match class {
        ErrorClass::Invalid => format!("reconciliation lookup refused: {what}"),
        _ => format!(
            "reconciliation lookup failed ({what}): the earlier attempt may have taken effect"
        ),
    };
    DeliveryError::new(class, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_and_what_follows() {
        let table = [
            (200, Verdict::Happened, Next::Delivered),
            (204, Verdict::Happened, Next::Delivered),
            (299, Verdict::Happened, Next::Delivered),
            (404, Verdict::NotHappened, Next::Send),
            (410, Verdict::NotHappened, Next::Send),
            (301, Verdict::Unknown, Next::Fail(ErrorClass::Ambiguous)),
            (400, Verdict::Unknown, Next::Fail(ErrorClass::Ambiguous)),
            (409, Verdict::Unknown, Next::Fail(ErrorClass::Ambiguous)),
            (429, Verdict::Unknown, Next::Fail(ErrorClass::Ambiguous)),
            (500, Verdict::Unknown, Next::Fail(ErrorClass::Ambiguous)),
            (503, Verdict::Unknown, Next::Fail(ErrorClass::Ambiguous)),
        ];
        for (status, verdict, next) in table {
            assert_eq!(Verdict::of_status(status), verdict, "{status}");
            assert_eq!(verdict.next(), next, "{status}");
        }
        for class in ErrorClass::ALL {
            let v = Verdict::of_failure(class);
            let want = if class == ErrorClass::Invalid {
                Next::Fail(ErrorClass::Invalid)
            } else {
                Next::Fail(ErrorClass::Ambiguous)
            };
            assert_eq!(v.next(), want, "{class}");
        }
    }

    #[test]
    fn found_names_a_value_or_nothing() {
        let s = |body: serde_json::Value| serde_json::json!({"status": 200, "body": body});
        let page = s(serde_json::json!({"data": [{"id": "ch_1"}], "more": {}, "none": null}));
        assert_eq!(
            found_value(&page, "/data/0"),
            Some(serde_json::json!({"id": "ch_1"}))
        );
        assert_eq!(found_value(&page, "/data/1"), None);
        assert_eq!(found_value(&page, "/more"), None);
        assert_eq!(found_value(&page, "/none"), None);
        assert_eq!(
            found_value(&s(serde_json::json!({"data": []})), "/data"),
            None
        );
        assert_eq!(found_value(&s(serde_json::json!("text")), "/data/0"), None);
    }
}
