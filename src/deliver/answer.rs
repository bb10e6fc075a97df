//! A request's answer, for both HTTP channels: its status classed, the provider's
//! deduplication flag (`Idempotent-Replayed`), `Retry-After`, and the body kept or drained.

use std::time::{Duration, SystemTime};

use hyper::header;

use super::body;
use super::classify::parse_retry_after;
use super::client::Response;
use super::{Delivered, DeliveryError};
use crate::retry::classify_http_status;

/// The host of a URL, for error messages (never the path or query, which often carry
/// tokens).
pub(crate) fn host_of(url: &url::Url) -> String {
    url.host_str().unwrap_or("?").to_owned()
}

/// The status, the provider's deduplication flag and its `Retry-After` (on 429 and 503).
pub(crate) fn answer_headers(response: &Response) -> (u16, bool, Option<Duration>) {
    let status = response.status().as_u16();
    let deduplicated = response
        .headers()
        .get("idempotent-replayed")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let retry_after = if status == 429 || status == 503 {
        response
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()))
    } else {
        None
    };
    (status, deduplicated, retry_after)
}

/// A request's answer as an attempt's result: its status classed, the provider's
/// deduplication flag and `Retry-After` read, and its body kept (`store`, on success) or
/// drained, within `deadline`. Both HTTP channels end their request here.
pub(crate) async fn answered(
    mut response: Response,
    host: &str,
    store: bool,
    deadline: tokio::time::Instant,
) -> Result<Delivered, DeliveryError> {
    let (status, deduplicated, retry_after) = answer_headers(&response);
    let mut summary = serde_json::json!({ "status": status, "replayed": deduplicated });
    let class = classify_http_status(status);
    if store && class.is_none() {
        body::keep(&mut response, &mut summary, deadline).await;
    } else {
        body::drain(&mut response, deadline).await;
    }
    match class {
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
