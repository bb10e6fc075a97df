//! The http channel: a call to a provider's API through a named endpoint, its credential
//! held by the daemon.
//!
//! A payload names an endpoint (`outbox.endpoints`), a method, a path under the endpoint's
//! URL, a query, and a `form` or `json` body ([`payload`]). The request goes through the
//! webhook channel's client (the destination guard on the connected address, no redirects,
//! no proxy), its connect timeout and its timeout, and its answers are classed the same
//! way. The headers are the endpoint's, then the payload's, then the idempotency header
//! with the message key and the auth header with the secret's value ([`settings`]), which
//! is sent and nowhere else: not in an error, a log line, a summary or a `Debug`.
//!
//! After an ambiguous attempt a payload with `reconcile` looks first, within the same
//! timeout: a GET to the same endpoint, `{key}` replaced by the message key, whose 2xx
//! means "it took effect" (with `found`, only when the pointer names a value), and whose
//! 404 or 410 (or a `found` that names nothing) lets the request go in the same attempt.

pub mod endpoint;
pub mod payload;
pub mod redact;
pub mod settings;

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};

use self::endpoint::{Endpoint, Endpoints, Known};
use self::payload::{Body, Call};
use self::settings::EndpointSecrets;
use super::answer::{answered, host_of};
use super::classify::classify_error;
use super::reconcile::{self, Lookup};
use super::webhook::WebhookSender;
use super::{Attempted, Delivered, DeliveryError, Outgoing};
use crate::model::ErrorClass;

/// Headers the worker sets itself or that belong to the request's framing; with the
/// endpoint's auth and idempotency headers, a payload may not give them.
const RESERVED: [&str; 7] = [
    "content-type",
    "content-length",
    "host",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
];

/// Sends http messages through the webhook channel's client.
#[derive(Debug, Clone)]
pub struct HttpSender {
    /// The client, guard and timeout shared with webhooks.
    transport: WebhookSender,
    /// The endpoints' secrets this worker read at start.
    secrets: Arc<EndpointSecrets>,
    /// The endpoints, refreshed by the worker.
    endpoints: Endpoints,
}

/// One attempt's request, checked and built.
struct Prepared {
    endpoint: Arc<Endpoint>,
    call: Call,
    url: url::Url,
    /// The headers every request of the attempt carries: the endpoint's, the payload's,
    /// the idempotency key and the credential.
    headers: HeaderMap,
}

impl HttpSender {
    /// A sender over `transport`'s client, with `secrets`.
    pub fn new(transport: &WebhookSender, secrets: EndpointSecrets) -> HttpSender {
        HttpSender {
            transport: transport.clone(),
            secrets: Arc::new(secrets),
            endpoints: Endpoints::default(),
        }
    }

    /// The endpoints, for the worker to refresh.
    pub fn endpoints(&self) -> &Endpoints {
        &self.endpoints
    }

    /// The whole attempt's timeout (the webhook channel's).
    pub fn timeout(&self) -> Duration {
        self.transport.timeout
    }

    /// Whether the worker should read the endpoints again before this payload's attempt:
    /// it names an endpoint the table does not hold (made since the last refresh), or one
    /// whose host is not the `destination` the insert trigger stored (its URL changed since).
    pub fn needs_refresh(&self, payload: &str, destination: Option<&str>) -> bool {
        match payload::endpoint_of(payload) {
            Some(name) => match self.endpoints.get(&name) {
                Known::No => true,
                Known::Yes(e) => {
                    super::webhook::destination::name_of(&e.base).as_deref() != destination
                }
                Known::Broken(_) => false,
            },
            None => false,
        }
    }

    /// Sends one attempt: after an ambiguous one, with a `reconcile`, the lookup first;
    /// then, unless the lookup settled it, the request.
    pub async fn send(&self, msg: Outgoing<'_>) -> Attempted {
        let deadline = Instant::now() + self.transport.timeout;
        let p = match self.prepare(msg) {
            Ok(p) => p,
            Err(e) => return Attempted::unsent(e),
        };
        let mut lookup = None;
        if msg.previous == Some(ErrorClass::Ambiguous)
            && msg.key_window_closed
            && p.call.reconcile.is_none()
        {
            return Attempted::unsent(DeliveryError::new(
                ErrorClass::Ambiguous,
                format!(
                    "not sent to {}: an earlier attempt may have taken effect",
                    host_of(&p.url)
                ),
            ));
        }
        if msg.previous == Some(ErrorClass::Ambiguous) {
            if let Some(r) = &p.call.reconcile {
                let (l, settled) = self.reconcile(&p, r, msg, deadline).await;
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
                let until = if msg.last_attempt {
                    deadline
                } else {
                    deadline
                        .checked_sub(self.transport.timeout / 2)
                        .unwrap_or(deadline)
                };
                let leave = match msg.limits {
                    Some(limits) => limits.wait_for_request(until).await,
                    None => true,
                };
                if !leave || Instant::now() >= until {
                    return Attempted {
                        result: Err(DeliveryError::new(
                            ErrorClass::Transient,
                            format!(
                                "too little time left to send to {} after the reconciliation lookup",
                                host_of(&p.url)
                            ),
                        )),
                        lookup,
                        requested: false,
                    };
                }
            }
        }
        let result = self.request(p, deadline).await;
        Attempted {
            result,
            lookup,
            requested: true,
        }
    }

    /// Checks the payload against its endpoint and builds what every request of the
    /// attempt carries; `invalid` (no request) when anything is wrong.
    fn prepare(&self, msg: Outgoing<'_>) -> Result<Prepared, DeliveryError> {
        let call = payload::parse(msg.payload)?;
        let endpoint = match self.endpoints.get(&call.endpoint) {
            Known::Yes(e) => e,
            Known::Broken(why) => return Err(DeliveryError::invalid(why)),
            Known::No => {
                return Err(DeliveryError::invalid(format!(
                    "payload.endpoint {} is not in outbox.endpoints",
                    crate::text::stripped(&call.endpoint, 64)
                )));
            }
        };
        let secret = match &endpoint.auth_secret {
            None => None,
            Some(name) if settings::is_secret_name(name) => match self.secrets.get(name) {
                Some(s) => Some(s),
                None => {
                    let upper = name.to_ascii_uppercase();
                    return Err(DeliveryError::invalid(format!(
                        "endpoint {}: its secret {upper} is not configured on this worker (no {p}{upper} or {p}{upper}_FILE)",
                        endpoint.name,
                        p = settings::SECRET_PREFIX
                    )));
                }
            },
            Some(_) => {
                return Err(DeliveryError::invalid(format!(
                    "endpoint {}: auth_secret is not a secret name (letters, digits and _)",
                    endpoint.name
                )));
            }
        };
        let reserved = |name: &HeaderName| {
            let n = name.as_str();
            let is = |n: &str| {
                RESERVED.contains(&n)
                    || n == endpoint.auth_header.as_str()
                    || endpoint
                        .idempotency_header
                        .as_ref()
                        .is_some_and(|h| h.as_str() == n)
            };
            is(n) || (n.contains('_') && is(&n.replace('_', "-")))
        };
        for (name, _) in &call.headers {
            if reserved(name) {
                return Err(DeliveryError::invalid(format!(
                    "payload.headers.{} is set by the worker and may not be given",
                    name.as_str()
                )));
            }
        }
        let url = endpoint.url_for(&call.path, &call.query, "payload.path")?;
        self.transport.check_literal_host(&url, "")?;
        let key = HeaderValue::from_bytes(msg.key.as_bytes()).map_err(|_| {
            DeliveryError::invalid(
                "the message key has control characters and cannot be sent as a header",
            )
        })?;
        super::webhook::destination::check(&url, msg.destination, "payload.path")?;
        let mut headers = endpoint.headers.clone();
        for (name, value) in &call.headers {
            headers.insert(name.clone(), value.clone());
        }
        if let Some(h) = &endpoint.idempotency_header {
            headers.insert(h.clone(), key);
        }
        if let Some(secret) = secret {
            // Checked at start-up: a secret is a valid header value.
            let mut value = HeaderValue::from_str(secret.expose()).map_err(|_| {
                DeliveryError::invalid(format!(
                    "endpoint {}: its secret cannot be sent as a header value",
                    endpoint.name
                ))
            })?;
            value.set_sensitive(true);
            headers.insert(endpoint.auth_header.clone(), value);
        }
        Ok(Prepared {
            endpoint,
            call,
            url,
            headers,
        })
    }

    /// The request itself, within what is left of the attempt's timeout.
    async fn request(&self, p: Prepared, deadline: Instant) -> Result<Delivered, DeliveryError> {
        let host = host_of(&p.url);
        let mut headers = p.headers;
        let body = match p.call.body {
            Body::None => bytes::Bytes::new(),
            Body::Form(s) => {
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/x-www-form-urlencoded"),
                );
                bytes::Bytes::from(s)
            }
            Body::Json(b) => {
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                bytes::Bytes::from(b)
            }
        };
        let deadline = tokio::time::Instant::from_std(deadline);
        let sent = self
            .transport
            .client
            .send(p.call.method.clone(), &p.url, headers, body, deadline)
            .await;
        let response = match sent {
            Ok(r) => r,
            Err(e) => return Err(classify_error(e, &host, self.transport.timeout)),
        };
        answered(response, &host, p.call.store_response, deadline).await
    }

    /// Asks the endpoint whether the earlier attempt took effect: a GET to the lookup's
    /// path and query (`{key}` replaced by the message key, percent-encoded where it
    /// lands), with the attempt's headers ([`reconcile::ask`]). Returns the lookup and,
    /// unless the request is to be sent now, the attempt's result.
    async fn reconcile(
        &self,
        p: &Prepared,
        r: &payload::Lookup,
        msg: Outgoing<'_>,
        deadline: Instant,
    ) -> (Lookup, Option<Result<Delivered, DeliveryError>>) {
        let url = match self.lookup_url(p, r, msg) {
            Ok(u) => u,
            Err(e) => return reconcile::refused(host_of(&p.url), e),
        };
        reconcile::ask(
            &self.transport.client,
            self.transport.timeout,
            &url,
            p.headers.clone(),
            p.call.store_response,
            r.found.as_deref(),
            tokio::time::Instant::from_std(deadline),
        )
        .await
    }

    /// The lookup's URL: its path and query with `{key}` replaced, held to the endpoint
    /// and to the lookup's stored destination.
    fn lookup_url(
        &self,
        p: &Prepared,
        r: &payload::Lookup,
        msg: Outgoing<'_>,
    ) -> Result<url::Url, DeliveryError> {
        // In the path, the key is one segment's worth, percent-encoded (a `/` in a key
        // stays inside its segment); in a query value the encoder does it.
        let segment: String =
            url::form_urlencoded::byte_serialize(msg.key.as_bytes()).collect::<String>();
        let segment = segment.replace('+', "%20");
        let path = r.path.replace("{key}", &segment);
        let query: Vec<(String, String)> = r
            .query
            .iter()
            .map(|(k, v)| (k.clone(), v.replace("{key}", msg.key)))
            .collect();
        let url = p
            .endpoint
            .url_for(&path, &query, "payload.reconcile.path")?;
        super::webhook::destination::check(
            &url,
            msg.lookup_destination.or(msg.destination),
            "payload.reconcile.path",
        )?;
        Ok(url)
    }
}
