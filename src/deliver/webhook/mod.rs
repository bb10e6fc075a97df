//! Webhook delivery: one HTTP request per attempt.
//!
//! Every attempt of a message sends the same bytes with the same identity: the body exactly
//! as PostgreSQL rendered it, `Idempotency-Key` and Standard Webhooks' `webhook-id` set to
//! the message key, and (when a secret is configured) a `webhook-signature` over
//! `id.timestamp.body`. Redirects are not followed and proxies are not used: both would send
//! the request somewhere the destination check did not look.
//!
//! After an ambiguous attempt, a payload with `reconcile.url` makes the next attempt a
//! lookup first ([`reconcile`](super::reconcile)), within the same timeout; with `store_response` the
//! delivering response's body is kept in the summary ([`body`]), read within bounds.

pub mod destination;
pub mod payload;
pub mod redact;
pub mod settings;
pub mod signing;
pub mod urls;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};

use self::payload::{Request, check, parse_payload_with};
use self::settings::{SigningKeys, WebhookConfig};
use self::signing::signatures;
use self::urls::UrlCache;
use super::answer::{answered, host_of};
use super::classify::classify_error;
use super::client::HttpClient;
use super::guard::{Guard, GuardedResolver};
use super::reconcile;
use super::{Attempted, Delivered, DeliveryError, Outgoing};
use crate::model::{ConfigError, ErrorClass};

// The identity headers' names, made once: a name given as text is parsed and checked on
// every insert (four per request).
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");

/// Sends webhooks through one shared HTTP client (keep-alive connection pools per host).
#[derive(Debug, Clone)]
pub struct WebhookSender {
    pub(in crate::deliver) client: HttpClient,
    guard: Guard,
    /// The client's resolver, also asked before a request whose reconcile URL names a host
    /// (see [`GuardedResolver::refuses`]).
    resolver: GuardedResolver,
    signing: std::sync::Arc<SigningKeys>,
    pub(in crate::deliver) timeout: Duration,
    /// Payload URLs parsed before, shared by every clone of the sender.
    urls: std::sync::Arc<UrlCache>,
}

/// One attempt's request, checked, with the identity every request of the attempt carries.
struct Prepared<'a> {
    req: Request,
    /// The message key as a header value.
    key: HeaderValue,
    /// The message key.
    msg_key: &'a str,
    /// `webhook-timestamp`: one for the attempt, lookup and request alike.
    timestamp: u64,
}

/// Whether the request is held back for lack of time, and why. After a lookup (it answered
/// 404 or 410, so the earlier attempt did not take effect) that took more than half the
/// timeout, the request is not sent: in the time left, a provider that is slow but well
/// would answer too late, and the attempt would end ambiguous, for a person to settle,
/// although the provider had just said nothing happened. Nothing was sent, so the attempt
/// is transient; the next one (after the usual delay) sends with the whole timeout,
/// without a lookup (a transient attempt is not followed by one). Not on the last attempt,
/// which has no next one: that one sends in the time left ([`Outgoing::last_attempt`]).
fn too_late(
    p: &Prepared<'_>,
    deadline: Instant,
    timeout: Duration,
    after_lookup: bool,
    last_attempt: bool,
) -> Option<DeliveryError> {
    let left = deadline.saturating_duration_since(Instant::now());
    let held = after_lookup && !last_attempt && left < timeout / 2;
    if !(left.is_zero() || held) {
        return None;
    }
    // Only after a lookup: a request's own deadline starts with the whole timeout.
    let next = if held {
        "; the next attempt sends it"
    } else {
        ""
    };
    Some(DeliveryError::new(
        ErrorClass::Transient,
        format!(
            "too little time left to send to {} after the reconciliation lookup{next}",
            host_of(&p.req.url)
        ),
    ))
}

impl WebhookSender {
    /// Builds the shared client.
    pub fn new(cfg: &WebhookConfig) -> Result<Self, ConfigError> {
        let guard = Guard::new(cfg.destinations.clone());
        let resolver = GuardedResolver::new(guard.clone());
        // A connect that times out sent nothing (transient); keep it distinct from the
        // whole-request timeout, after which the request may have been processed.
        let client = HttpClient::new(
            resolver.clone(),
            (cfg.timeout / 2).max(Duration::from_millis(100)),
        )?;
        Ok(WebhookSender {
            client,
            guard,
            resolver,
            signing: std::sync::Arc::new(cfg.signing.clone()),
            timeout: cfg.timeout,
            urls: std::sync::Arc::new(UrlCache::default()),
        })
    }

    /// The whole-request timeout of one attempt (`--webhook-timeout`). It bounds the whole
    /// attempt: a reconciliation lookup and the request after it share it.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends one attempt: after an ambiguous one, with a `reconcile` URL, the lookup first
    /// (see [`reconcile`]); then, unless the lookup settled it, the request.
    pub async fn send(&self, msg: Outgoing<'_>) -> Attempted {
        let deadline = Instant::now() + self.timeout;
        let p = match self.prepare(msg) {
            Ok(p) => p,
            Err(e) => return Attempted::unsent(e),
        };
        let mut lookup = None;
        if let Some(url) = &p.req.reconcile {
            if msg.previous == Some(ErrorClass::Ambiguous) {
                let (l, settled) = self.reconcile(&p, url, deadline).await;
                if let Some(limits) = msg.limits {
                    limits.lookup_ended();
                }
                lookup = Some(l);
                if let Some(result) = settled {
                    return Attempted {
                        result,
                        lookup,
                        requested: false,
                    };
                }
                // The time the lookup left is judged before any wait for the limits.
                if let Some(late) = too_late(&p, deadline, self.timeout, true, msg.last_attempt) {
                    return Attempted {
                        result: Err(late),
                        lookup,
                        requested: false,
                    };
                }
                if let Some(limits) = msg.limits {
                    if let Some(held) = self.leave_to_send(limits, &p, deadline, msg).await {
                        return Attempted {
                            result: Err(held),
                            lookup,
                            requested: false,
                        };
                    }
                }
            } else if let Some(blocked) = self.refused_early(url, deadline).await {
                return Attempted::unsent(blocked);
            }
        }
        // Now only a deadline already passed holds the request back: a wait for the limits
        // ends with half the timeout left, or on the last attempt, which sends in what is
        // left, at the deadline.
        if let Some(late) = too_late(&p, deadline, self.timeout, false, msg.last_attempt) {
            return Attempted {
                result: Err(late),
                lookup,
                requested: false,
            };
        }
        let result = self.request(p, deadline).await;
        Attempted {
            result,
            lookup,
            requested: true,
        }
    }

    /// Waits for the limits of the webhook's host to let the request after a lookup go
    /// (the lookup answered 404 or 410). It waits here, inside the attempt, rather than
    /// have the message deferred: the contract sends that request in the same attempt as
    /// the lookup, and a deferral would undo the attempt, so the next one would look up
    /// again and take another token (under one rate shared by the lookup and the request,
    /// a message could look up for ever and never send). The wait holds the delivery slot,
    /// but never past the attempt's deadline, and it ends where [`too_late`] would hold the
    /// request back anyway: at half the timeout left, or at the deadline on the last
    /// attempt. A request that got no leave by then is not sent, and the attempt ends as
    /// one whose lookup took too long: transient, and the next attempt sends without a
    /// lookup, admitted as any first request is (deferred while over the limit, not
    /// counted). None: the request may go.
    async fn leave_to_send(
        &self,
        limits: &dyn super::RequestLimits,
        p: &Prepared<'_>,
        deadline: Instant,
        msg: Outgoing<'_>,
    ) -> Option<DeliveryError> {
        let until = if msg.last_attempt {
            deadline
        } else {
            deadline.checked_sub(self.timeout / 2).unwrap_or(deadline)
        };
        if limits.wait_for_request(until).await {
            return None;
        }
        let next = if msg.last_attempt {
            ""
        } else {
            "; the next attempt sends it"
        };
        Some(DeliveryError::new(
            ErrorClass::Transient,
            format!(
                "the limits of {} (a rate limit or --host-concurrency) left no room to send \
                 in time after the reconciliation lookup{next}",
                host_of(&p.req.url)
            ),
        ))
    }

    /// Checks the payload and both destinations as far as can be done without a request:
    /// a bad URL, scheme or literal address is `invalid` before anything is sent.
    fn prepare<'a>(&self, msg: Outgoing<'a>) -> Result<Prepared<'a>, DeliveryError> {
        let req = match msg.webhook {
            Some(read) => check(read, Some(&self.urls))?,
            None => parse_payload_with(msg.payload, Some(&self.urls))?,
        };
        if let Some(name) = &req.secret {
            if self.signing.for_name(Some(name)).is_none() {
                // The name is letters, digits and _ (parse_payload): safe to show.
                return Err(DeliveryError::invalid(format!(
                    "payload.secret {name} is not configured (no {}_{name})",
                    settings::SECRET_VAR
                )));
            }
        }
        self.check_literal_host(&req.url, "")?;
        if let Some(url) = &req.reconcile {
            self.check_literal_host(url, "reconcile.url ")?;
        }
        // from_bytes accepts any key without control characters (UTF-8 included).
        let key = HeaderValue::from_bytes(msg.key.as_bytes()).map_err(|_| {
            DeliveryError::invalid(
                "the message key has control characters and cannot be sent as a header",
            )
        })?;
        // Last: a refusal of the guard's or of the key's says more than this one.
        destination::check(&req.url, msg.destination, "url")?;
        if let Some(url) = &req.reconcile {
            destination::check(url, msg.lookup_destination, "reconcile.url")?;
        }
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Ok(Prepared {
            req,
            key,
            msg_key: msg.key,
            timestamp,
        })
    }

    /// A reconcile URL naming a host whose every address the guard refuses: `invalid`
    /// before the request is sent (the lookup it would need later could never be made).
    /// The name lookup is a courtesy, not the boundary: it may take a tenth of the
    /// attempt's timeout, no more (a slow resolver took the request's time, which then
    /// timed out, ambiguous); one that does not answer in time proves nothing, and the
    /// request goes ahead (the lookup, if ever needed, is checked on its own connection).
    async fn refused_early(&self, url: &url::Url, deadline: Instant) -> Option<DeliveryError> {
        let Some(url::Host::Domain(host)) = url.host() else {
            return None;
        };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .min(self.timeout / 10);
        let blocked = tokio::time::timeout(left, self.resolver.refuses(host))
            .await
            .ok()??;
        Some(DeliveryError::invalid(format!("reconcile.url: {blocked}")))
    }

    /// Asks `url` whether the earlier attempt took effect, with the message's identity
    /// (`Idempotency-Key`, `webhook-id`, `webhook-timestamp` and a signature over an empty
    /// body) and the payload's headers ([`reconcile::ask`]).
    async fn reconcile(
        &self,
        p: &Prepared<'_>,
        url: &url::Url,
        deadline: Instant,
    ) -> (reconcile::Lookup, Option<Result<Delivered, DeliveryError>>) {
        reconcile::ask(
            &self.client,
            self.timeout,
            url,
            self.identity_headers(p.req.headers.clone(), p, b""),
            p.req.store_response,
            p.req.found.as_deref(),
            tokio::time::Instant::from_std(deadline),
        )
        .await
    }

    /// `headers` (the application's) with the message's identity, signed over `body`.
    fn identity_headers(&self, mut headers: HeaderMap, p: &Prepared<'_>, body: &[u8]) -> HeaderMap {
        headers.insert(IDEMPOTENCY_KEY, p.key.clone());
        headers.insert(WEBHOOK_ID, p.key.clone());
        headers.insert(WEBHOOK_TIMESTAMP, HeaderValue::from(p.timestamp));
        // prepare() refused a payload naming a secret that is not configured.
        let keys = self
            .signing
            .for_name(p.req.secret.as_deref())
            .unwrap_or(&[]);
        if let Some(sigs) = signatures(keys, p.msg_key, p.timestamp, body) {
            if let Ok(v) = HeaderValue::from_str(&sigs) {
                headers.insert(WEBHOOK_SIGNATURE, v);
            }
        }
        headers
    }

    /// Sends the request itself, within what is left of the attempt's timeout
    /// ([`too_late`] has said there is enough).
    async fn request(
        &self,
        mut p: Prepared<'_>,
        deadline: Instant,
    ) -> Result<Delivered, DeliveryError> {
        let host = host_of(&p.req.url);
        // The request is the last use of the payload's headers: moved, not copied.
        let app_headers = std::mem::take(&mut p.req.headers);
        let mut headers = self.identity_headers(app_headers, &p, &p.req.body);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let store = p.req.store_response;
        // The deadline covers the response's body too: a receiver that never ends it costs
        // the attempt's timeout, not more.
        let deadline = tokio::time::Instant::from_std(deadline);
        let body = bytes::Bytes::from(std::mem::take(&mut p.req.body));
        let result = self
            .client
            .send(p.req.method.clone(), &p.req.url, headers, body, deadline)
            .await;
        let response = match result {
            Ok(r) => r,
            Err(e) => return Err(classify_error(e, &host, self.timeout)),
        };
        answered(response, &host, store, deadline).await
    }

    /// A URL whose host is an IP literal never reaches the resolver: check it here.
    /// `field` names the URL in the error (empty for the request's own).
    pub(in crate::deliver) fn check_literal_host(
        &self,
        url: &url::Url,
        field: &str,
    ) -> Result<(), DeliveryError> {
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
                "destination not allowed: {field}{host} is a private or reserved address ({})",
                crate::deliver::guard::HOW_TO_ALLOW
            )))
        }
    }
}
