//! Webhook delivery: one HTTP request per attempt.
//!
//! Every attempt of a message sends the same bytes with the same identity: the body exactly
//! as PostgreSQL rendered it, `Idempotency-Key` and Standard Webhooks' `webhook-id` set to
//! the message key, and (when a secret is configured) a `webhook-signature` over
//! `id.timestamp.body`. Redirects are not followed and proxies are not used: both would send
//! the request somewhere the destination check did not look.

pub mod classify;
pub mod payload;
pub mod settings;
pub mod signing;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::HeaderValue;

use self::classify::{classify_error, parse_retry_after};
use self::payload::parse_payload;
use self::settings::WebhookConfig;
use self::signing::sign;
use super::guard::{Guard, GuardedResolver};
use super::{Delivered, DeliveryError, Outgoing};
use crate::model::ConfigError;
use crate::retry::classify_http_status;

/// Most bytes of a response body read (and discarded) to keep the connection reusable.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// Sends webhooks through one shared HTTP client (keep-alive connection pools per host).
#[derive(Debug, Clone)]
pub struct WebhookSender {
    client: reqwest::Client,
    guard: Guard,
    signing_key: Option<Vec<u8>>,
    timeout: Duration,
}

/// The host of a URL, for error messages (never the path or query, which often carry
/// tokens).
fn host_of(url: &url::Url) -> String {
    url.host_str().unwrap_or("?").to_owned()
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
            Err(e) => return Err(classify_error(e, &host, self.timeout)),
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
}
