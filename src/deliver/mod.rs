//! Channels: how a claimed message reaches its provider.
//!
//! Each channel turns a payload into one network call and classes the result at the
//! transport boundary, keeping the cause: a [`DeliveryError`] carries its
//! [`ErrorClass`], so the worker never inspects transport errors itself. The delivery code
//! never touches SQL and never holds a database transaction.

pub mod answer;
pub mod body;
pub mod classify;
pub mod client;
pub mod email;
pub mod guard;
pub mod http;
pub mod reconcile;
pub mod webhook;

use crate::model::Channel;
use std::time::Duration;

use crate::model::ErrorClass;

/// What a provider answered to an accepted message.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivered {
    /// HTTP status or SMTP reply code.
    pub status: Option<i32>,
    /// The provider said it had already seen this key (`Idempotent-Replayed: true`).
    pub deduplicated: bool,
    /// A summary for the `response` column (status, message id, replayed flag, and for a
    /// webhook `reconciled`; the body only when the payload asks `store_response`).
    pub response: serde_json::Value,
}

/// What one attempt did: its result, and the reconciliation lookup it made first, if any
/// (webhooks only; the worker logs it as a step of its own).
#[derive(Debug)]
pub struct Attempted {
    /// Delivered (by the request, or by a lookup that found the earlier attempt had taken
    /// effect: then `lookup` says [`Verdict::Happened`](reconcile::Verdict)), or
    /// why not.
    pub result: Result<Delivered, DeliveryError>,
    /// The lookup, when one was made.
    pub lookup: Option<reconcile::Lookup>,
    /// The request itself was made (or tried): `result` is the destination's answer. Not
    /// when a lookup settled the attempt, when too little time was left after one, or when
    /// nothing could be sent at all ([`Attempted::unsent`]).
    pub requested: bool,
}

impl Attempted {
    /// Did a lookup settle the attempt as delivered (the request was not sent)?
    pub fn reconciled(&self) -> bool {
        self.result.is_ok() && self.lookup_said(reconcile::Verdict::Happened)
    }

    /// An attempt that asked no one: refused before any request or lookup was made (an
    /// invalid payload, a channel not configured, an address the guard refuses).
    pub fn unsent(error: DeliveryError) -> Attempted {
        Attempted {
            result: Err(error),
            lookup: None,
            requested: false,
        }
    }

    /// Did this attempt's lookup answer `verdict`?
    pub fn lookup_said(&self, verdict: reconcile::Verdict) -> bool {
        self.lookup.as_ref().is_some_and(|l| l.verdict == verdict)
    }
}

/// An attempt that made no lookup.
impl From<Result<Delivered, DeliveryError>> for Attempted {
    fn from(result: Result<Delivered, DeliveryError>) -> Self {
        Attempted {
            result,
            lookup: None,
            requested: true,
        }
    }
}

/// A failed attempt, classed where it happened.
///
/// `message` is one line safe to store and log: it never contains a payload, a header value,
/// a password, or a URL's path or query.
#[derive(thiserror::Error)]
#[error("{message}")]
pub struct DeliveryError {
    /// What another attempt would cost.
    pub class: ErrorClass,
    /// HTTP status or SMTP reply code, when the provider answered.
    pub status: Option<i32>,
    /// The provider's `Retry-After`, when it gave one.
    pub retry_after: Option<Duration>,
    /// A summary for the `response` column, when the provider answered.
    pub response: Option<serde_json::Value>,
    /// One safe line.
    pub message: String,
    /// The transport error behind it, for debugging in-process; never stored.
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// The safe line and the facts, not `source` or `response`: a relay's reply quotes
/// addresses, a transport error may name a URL's path, and a response may hold a stored
/// body; `{:?}` of an error travels further than its author meant.
impl std::fmt::Debug for DeliveryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryError")
            .field("class", &self.class)
            .field("status", &self.status)
            .field("retry_after", &self.retry_after)
            .field("message", &self.message)
            .field("response", &self.response.as_ref().map(|_| "(not shown)"))
            .field("source", &self.source.as_ref().map(|_| "(not shown)"))
            .finish()
    }
}

impl DeliveryError {
    /// A failure of the given class with a safe one-line message.
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        DeliveryError {
            class,
            status: None,
            retry_after: None,
            response: None,
            message: one_line(&message.into()),
            source: None,
        }
    }

    /// The payload is unusable: dead at once, no network call.
    pub fn invalid(message: impl Into<String>) -> Self {
        DeliveryError::new(ErrorClass::Invalid, message)
    }
}

/// A message as one line of at most 500 characters: control characters (and the others
/// [`crate::text::escape`] names) shown as visible escapes, so stored and printed errors
/// can neither break a line nor act on a terminal; trailing whitespace dropped.
pub fn one_line(s: &str) -> String {
    let mut out = crate::text::escape_truncated(s.trim_end(), 500);
    out.truncate(out.trim_end().len());
    out
}

/// A claimed message as a channel sees it.
#[derive(Clone, Copy)]
pub struct Outgoing<'a> {
    /// The message key: sent as the idempotency key.
    pub key: &'a str,
    /// The payload, as jsonb's text form.
    pub payload: &'a str,
    /// A webhook's payload as the claim already read it
    /// ([`webhook::payload::read`]): the channel checks it rather than `payload` again.
    pub webhook: Option<&'a webhook::payload::Read>,
    /// Where a webhook goes and where its lookup goes, as the insert trigger named them
    /// (`claim::Claimed::destination`): the request is made only to the host named.
    pub destination: Option<&'a str>,
    /// See [`Outgoing::destination`].
    pub lookup_destination: Option<&'a str>,
    /// The class the previous attempt ended with, as the claim found it on the row
    /// (`ambiguous` after a timeout or an expired lease): a webhook with a `reconcile` URL
    /// asks before it sends again.
    pub previous: Option<ErrorClass>,
    /// This is the message's last allowed attempt: a webhook whose lookup answered 404 or
    /// 410 late sends in what time is left rather than leave the request to an attempt
    /// that will not come.
    pub last_attempt: bool,
    /// The worker's limits per destination, for an attempt that looks up before it sends
    /// ([`RequestLimits`]); `None`: no limits.
    pub limits: Option<&'a dyn RequestLimits>,
    /// The provider may have forgotten the message key (an http endpoint's `key_ttl` has
    /// passed since the first attempt): after an ambiguous attempt nothing is sent blind,
    /// only a lookup.
    pub key_window_closed: bool,
}

/// The worker's limits per destination (`--host-concurrency`, rate limits) as an attempt
/// that makes a reconciliation lookup meets them. The lookup is a request to its own host
/// (`reconcile.url` may name another host than the webhook's): the worker admitted it
/// against that host before the attempt began, and it holds that host's place only while
/// the lookup runs. The request that a 404 or 410 lets through is a second request, to the
/// webhook's host: it takes a token and a place of its own.
pub trait RequestLimits: Sync {
    /// The lookup has ended: its place at its host is given back.
    fn lookup_ended(&self);

    /// Waits until the request may go to the webhook's host, or until `until`. True: it
    /// may, and holds its place until the attempt ends; false: not in time.
    fn wait_for_request(
        &self,
        until: std::time::Instant,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>>;
}

impl std::fmt::Debug for Outgoing<'_> {
    /// The payload's length, never its values (as [`crate::claim::Claimed`]'s).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("key", &self.key)
            .field("payload_len", &self.payload.len())
            .field("webhook", &self.webhook)
            .field("previous", &self.previous)
            .field("last_attempt", &self.last_attempt)
            .field("limits", &self.limits.is_some())
            .field("key_window_closed", &self.key_window_closed)
            .finish()
    }
}

/// The channels a worker can deliver on.
#[derive(Debug, Clone)]
pub struct Deliverers {
    /// Webhook delivery (always available).
    pub webhook: webhook::WebhookSender,
    /// E-mail delivery, when an SMTP relay is configured.
    pub email: Option<email::EmailSender>,
    /// Calls to providers' APIs through named endpoints (over the webhook client).
    pub http: http::HttpSender,
}

impl Deliverers {
    /// The channels over `webhook`'s client: http with no endpoint secrets (a worker's
    /// start-up gives them: [`http::HttpSender::new`]).
    pub fn new(webhook: webhook::WebhookSender, email: Option<email::EmailSender>) -> Self {
        let http = http::HttpSender::new(&webhook, http::settings::EndpointSecrets::default());
        Deliverers {
            webhook,
            email,
            http,
        }
    }

    /// How many messages of `channel` can be sent at once, when the channel itself bounds
    /// it (e-mail: the relay's connections). The worker claims no more than that, so that
    /// claimed rows do not queue for a connection while their leases run.
    pub fn capacity(&self, channel: Channel) -> Option<usize> {
        match channel {
            Channel::Webhook | Channel::Http => None,
            Channel::Email => self.email.as_ref().map(|e| e.max_connections()),
        }
    }

    /// The longest one attempt on `channel` can take, when the channel is configured.
    pub fn timeout(&self, channel: Channel) -> Option<Duration> {
        match channel {
            Channel::Webhook => Some(self.webhook.timeout()),
            Channel::Email => self.email.as_ref().map(|e| e.timeout()),
            Channel::Http => Some(self.http.timeout()),
        }
    }

    /// Waits until `channel` can start an attempt at once (e-mail: a free connection). The
    /// wait is no part of the attempt: its timeout starts with [`Ready::send`], so the
    /// caller can still decide, after the wait, whether the attempt fits in its lease.
    pub async fn ready(&self, channel: Channel) -> Ready<'_> {
        match channel {
            Channel::Webhook => Ready::Webhook(&self.webhook),
            Channel::Email => match &self.email {
                Some(sender) => match sender.slot().await {
                    Ok(slot) => Ready::Email(sender, slot),
                    Err(e) => Ready::Refused(e),
                },
                None => Ready::Refused(DeliveryError::invalid(
                    "the email channel is not configured on this worker",
                )),
            },
            Channel::Http => Ready::Http(&self.http),
        }
    }
}

/// A channel ready to start one attempt now.
pub enum Ready<'a> {
    /// Webhooks need no slot of their own.
    Webhook(&'a webhook::WebhookSender),
    /// E-mail, holding one of the relay's connection slots.
    Email(&'a email::EmailSender, email::pool::SmtpSlot<'a>),
    /// Http calls share the webhook client and need no slot of their own.
    Http(&'a http::HttpSender),
    /// The channel cannot send: the attempt fails with this, no network call made.
    Refused(DeliveryError),
}

impl Ready<'_> {
    /// Makes the attempt; its timeout starts now.
    ///
    /// Each channel's future is boxed: unboxed, the request's state machine (hyper's,
    /// lettre's, the reconciliation lookup's) made the delivery task's future about 10 KB,
    /// and tokio moves a task's future whole when it spawns it, stores it and reads its
    /// output: 10 % of the daemon's CPU samples were `memmove` of it.
    /// One heap allocation per attempt costs far less.
    pub async fn send(self, msg: Outgoing<'_>) -> Attempted {
        match self {
            Ready::Webhook(sender) => Box::pin(sender.send(msg)).await,
            Ready::Email(sender, slot) => Box::pin(sender.send(slot, msg)).await.into(),
            Ready::Http(sender) => Box::pin(sender.send(msg)).await,
            Ready::Refused(e) => Attempted::unsent(e),
        }
    }
}

/// A payload as an operator may see it (`outboxd show`, the console), keeping no more than
/// the logs and `outbox.attempts` do: each channel redacts its own members
/// ([`webhook::redact`], [`email::redact`], [`http::redact`]). A payload that is not a JSON object is not
/// shown at all.
pub fn redact_payload(channel: Channel, mut payload: serde_json::Value) -> serde_json::Value {
    let Some(fields) = payload.as_object_mut() else {
        return serde_json::Value::String("[redacted]".into());
    };
    match channel {
        Channel::Webhook => webhook::redact::redact(fields),
        Channel::Email => email::redact::redact(fields),
        Channel::Http => http::redact::redact(fields),
    }
    payload
}

/// A payload's `headers` as shown: the names kept, every value `[redacted]`.
fn redact_headers(headers: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match headers {
        Value::Object(mut headers) => {
            for v in headers.values_mut() {
                *v = Value::String("[redacted]".into());
            }
            Value::Object(headers)
        }
        Value::Null => Value::Null,
        _ => Value::String("[redacted]".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The payload as a channel named by its stored text redacts it.
    fn redact_payload(channel: &str, payload: serde_json::Value) -> serde_json::Value {
        super::redact_payload(Channel::parse(channel).expect("a channel"), payload)
    }

    #[test]
    fn payloads_are_redacted_as_the_logs_name_things() {
        let p = serde_json::json!({"url": "https://u:pw@x.example/hooks/a?token=t0k", "headers": {"Authorization": "Bearer s3cret"}, "body": 1});
        let r = redact_payload("webhook", p);
        assert_eq!(r["headers"]["Authorization"], "[redacted]");
        assert_eq!(r["url"], "https://x.example/[redacted]");
        assert_eq!(r["body"], 1);
        for (url, shown) in [
            (
                "http://TOKEN@h.example/p?q=SECRET",
                "http://h.example/[redacted]",
            ),
            ("http://h.example:8080", "http://h.example:8080/"),
            ("https://h.example/", "https://h.example/"),
            ("https://h.example/#frag", "https://h.example/[redacted]"),
            ("http://[::1]:9/x", "http://[::1]:9/[redacted]"),
            (
                "http://bad host/?token=SECRET",
                "[redacted: not a valid URL]",
            ),
            ("mailto:SECRET@h.example", "mailto:[redacted]"),
        ] {
            let r = redact_payload("webhook", serde_json::json!({ "url": url }));
            assert_eq!(r["url"], shown, "{url}");
        }
        // The lookup's settings and members the worker does not read may be tokens.
        let r = redact_payload(
            "webhook",
            serde_json::json!({"url": "https://h.example/", "method": "PUT", "secret": "billing",
                "store_response": true, "token": "SECRET", "extra": {"k": "SECRET"}, "none": null,
                "reconcile": {"url": "https://l.example/ops?t=SECRET", "token": "SECRET", "n": 5}}),
        );
        assert_eq!(
            r,
            serde_json::json!({"url": "https://h.example/", "method": "PUT", "secret": "billing",
                "store_response": true, "token": "[redacted]", "extra": "[redacted]", "none": null,
                "reconcile": {"url": "https://l.example/[redacted]", "token": "[redacted]",
                    "n": "[redacted]"}})
        );
        // In shapes the worker refuses, each is hidden too.
        let r = redact_payload(
            "webhook",
            serde_json::json!({"reconcile": "https://l.example/ops?t=SECRET",
                "method": {"t": "SECRET"}, "secret": ["SECRET"], "store_response": "SECRET"}),
        );
        assert_eq!(
            r,
            serde_json::json!({"reconcile": "[redacted]", "method": "[redacted]",
                "secret": "[redacted]", "store_response": "[redacted]"})
        );
        let r = redact_payload(
            "webhook",
            serde_json::json!({"url": {"token": "SECRET"}, "headers": "SECRET"}),
        );
        assert_eq!(
            r,
            serde_json::json!({"url": "[redacted: not a string]", "headers": "[redacted]"})
        );
        let r = redact_payload(
            "email",
            serde_json::json!({"from": "A <a@x.example>", "to": ["b@x.example", "c@x.example"],
                "cc": [], "bcc": null, "reply_to": "r@x.example", "subject": "Hi there",
                "text": "T", "html": "<p>H</p>", "headers": {"X-Trace": "SECRET"}, "other": {"k": 1}}),
        );
        assert_eq!(
            r,
            serde_json::json!({"from": "[redacted: 1 address]", "to": "[redacted: 2 addresses]",
                "cc": "[redacted: 0 addresses]", "bcc": null, "reply_to": "[redacted: 1 address]",
                "subject": "[redacted: 8 characters]", "text": "[redacted: 1 character]",
                "html": "[redacted: 8 characters]", "headers": {"X-Trace": "[redacted]"},
                "other": "[redacted]"})
        );
    }
}
