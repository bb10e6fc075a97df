//! What a failed webhook attempt means: a transport error classed by how far the request
//! got (nothing sent: transient; maybe processed: ambiguous; refused destination:
//! invalid), and the provider's `Retry-After`. HTTP statuses are classed by
//! [`crate::retry::classify_http_status`].

use std::time::{Duration, SystemTime};

use super::client::SendError;
use crate::deliver::DeliveryError;
use crate::deliver::guard::BlockedDestination;
use crate::model::ErrorClass;

/// Parses `Retry-After`: delay-seconds or an HTTP date.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
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
pub(in crate::deliver) fn classify_error(
    err: SendError,
    host: &str,
    timeout: Duration,
) -> DeliveryError {
    let client = match err {
        SendError::Build(why) => {
            return DeliveryError::invalid(format!("cannot build the request to {host}: {why}"));
        }
        SendError::TimedOutUnsent => {
            return DeliveryError::new(
                ErrorClass::Transient,
                format!(
                    "timed out before the request to {host} was sent (the attempt's {}ms ran out while connecting)",
                    timeout.as_millis()
                ),
            );
        }
        SendError::TimedOut => {
            return DeliveryError::new(
                ErrorClass::Ambiguous,
                format!(
                    "timed out waiting for the response from {host} after {}ms",
                    timeout.as_millis()
                ),
            );
        }
        SendError::Client(e) => e,
    };
    let mut detail = String::new();
    let mut blocked = None;
    let mut unsent = false;
    for e in crate::support::causes(&client) {
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
    }
    let (class, what) = if let Some(b) = blocked {
        return DeliveryError::invalid(b);
    } else if client.is_connect() {
        (ErrorClass::Transient, "cannot connect")
    } else if unsent {
        (
            ErrorClass::Transient,
            "connection lost before the request was sent",
        )
    } else {
        (
            ErrorClass::Ambiguous,
            "connection failed after the request was sent",
        )
    };
    DeliveryError {
        source: Some(Box::new(client)),
        ..DeliveryError::new(class, format!("{what} to {host}: {detail}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

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
