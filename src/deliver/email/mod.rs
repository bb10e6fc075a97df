//! E-mail delivery: one SMTP transaction per attempt, through the configured relay.
//!
//! Every attempt of a message carries the same `Message-ID`, derived from the message key
//! alone (`<H@domain>`, H the first 32 hex digits of SHA-256 of the key), so a recipient's
//! mail system and an operator grepping relay logs can tell a resend from a new message.
//! The key itself is not put in a header: keys are built from the application's internal
//! ids, and the hash identifies the message without showing them to recipients.
//!
//! # Why the connection is driven command by command
//!
//! lettre's `AsyncSmtpTransport::send` runs MAIL, RCPT, DATA and the content as one call,
//! so a lost connection at MAIL FROM (nothing was sent: safe to retry) and a lost
//! connection while waiting for the reply to the end of DATA (the relay may have queued
//! the message: retrying may send it twice) come back as the same error. We use lettre's
//! `AsyncSmtpConnection` and issue each command ourselves, recording the phase as we
//! go, so every failure is classed by where it happened:
//!
//! | phase | a reply 4xx | a reply 5xx | connection lost or timed out |
//! |---|---|---|---|
//! | session (connect, TLS, EHLO, AUTH) | transient | permanent | transient |
//! | MAIL FROM, RCPT TO, DATA | transient | permanent | transient |
//! | content (before its last byte left) | – | – | transient |
//! | after the end of DATA, before the reply | transient | permanent | **ambiguous** |
//!
//! A 5xx is permanent in every phase, as the contract has it ("SMTP 5xx → dead at once"):
//! a refused login (535) or a relay that will not serve this client (554 at the greeting)
//! kills the message at once, as the same relay's refusal at MAIL FROM or RCPT TO
//! (530 "authentication required", 554 "relay access denied") always did; after the
//! configuration is fixed, `outboxd replay --all-dead --error-class permanent` sends them
//! again with the same keys. A 4xx, a lost connection or a timeout while setting up is
//! transient.
//!
//! A message goes to all its recipients or to none: if the relay refuses any RCPT TO, no
//! DATA is sent (permanent for a 5xx, transient when only 4xx), because delivering to the
//! accepted recipients and then retrying would send them the message twice.
//!
//! Connections are pooled: at most `max_connections` are open, and one that ends a
//! transaction cleanly is kept idle for reuse for up to a minute. A reused connection
//! that turns out to be dead at its first command is replaced by a fresh one within the
//! same attempt, since nothing of the message had been sent.
//!
//! Nothing here logs, and no error message carries an address, a header value, the
//! content, the password, or the text of a server reply (replies often quote the
//! address); only reply codes and enhanced status codes.

pub mod mime;
pub mod payload;
pub mod pool;
pub mod redact;
pub mod reply;
pub mod session;
pub mod settings;

use std::sync::Mutex;
use std::sync::atomic::AtomicU8;
use std::time::Duration;

use lettre::transport::smtp::authentication::Credentials;
use lettre::transport::smtp::client::TlsParameters;
use tokio::sync::Semaphore;

use self::payload::parse_payload;
use self::pool::{Inner, SmtpSlot, hello_name};
use self::reply::{Fault, Phase, classify, code_of, enhanced_status, queue_id};
use self::session::Progress;
use self::settings::{EmailConfig, SmtpTls};
use super::{Delivered, DeliveryError, Outgoing};
use crate::model::{ConfigError, ErrorClass};

/// Sends e-mails through one SMTP relay, reusing connections.
///
/// Cheap to clone: clones share the connection pool.
#[derive(Clone)]
pub struct EmailSender {
    inner: std::sync::Arc<Inner>,
}

impl std::fmt::Debug for EmailSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmailSender")
            .field("relay", &self.inner.relay)
            .field("tls", &self.inner.tls)
            .field("auth", &self.inner.credentials.is_some())
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl EmailSender {
    /// Prepares the sender (TLS configuration, credentials); connects only when sending.
    pub fn new(cfg: &EmailConfig) -> Result<Self, ConfigError> {
        let smtp = &cfg.smtp;
        // `SmtpUrl::parse` checks this too; a URL built by hand reaches us unchecked.
        smtp.check_clear_text_auth()?;
        let tls_params = match smtp.tls {
            SmtpTls::None => None,
            SmtpTls::StartTls | SmtpTls::Implicit => {
                Some(TlsParameters::new_rustls(smtp.host.clone()).map_err(|e| {
                    ConfigError(format!("OUTBOXD_SMTP_URL: cannot set up TLS: {e}"))
                })?)
            }
        };
        let credentials = smtp
            .user
            .as_ref()
            .map(|user| Credentials::new(user.clone(), smtp.password.clone().unwrap_or_default()));
        if cfg.timeout.is_zero() {
            return Err(ConfigError("--smtp-timeout must be positive".into()));
        }
        let max = cfg.max_connections.max(1);
        let relay = if smtp.host.contains(':') {
            format!("[{}]:{}", smtp.host, smtp.port)
        } else {
            format!("{}:{}", smtp.host, smtp.port)
        };
        Ok(EmailSender {
            inner: std::sync::Arc::new(Inner {
                host: smtp.host.clone(),
                port: smtp.port,
                relay,
                tls: smtp.tls,
                tls_params,
                credentials,
                hello: hello_name(),
                timeout: cfg.timeout,
                message_id_domain: cfg.message_id_domain.clone(),
                slots: Semaphore::new(max),
                idle: Mutex::new(Vec::new()),
                max_connections: max,
            }),
        })
    }

    /// Most connections open at once: also how many e-mails the worker should have in
    /// flight, since any more would only wait for one of them.
    pub fn max_connections(&self) -> usize {
        self.inner.max_connections
    }

    /// The whole attempt's deadline (`--smtp-timeout`).
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Waits for one of the pool's connections to be free. The wait is not part of any
    /// attempt: an attempt's clock starts in [`EmailSender::send`], once it holds a slot
    /// (a queue for connections counted against the timeout turned a slow relay into
    /// attempts that timed out before, or while, they were sent).
    pub async fn slot(&self) -> Result<SmtpSlot<'_>, DeliveryError> {
        // The semaphore is never closed; the error arm is unreachable but not a panic.
        let permit = self.inner.slots.acquire().await.map_err(|_| {
            DeliveryError::new(ErrorClass::Transient, "the e-mail sender is shutting down")
        })?;
        Ok(SmtpSlot { _permit: permit })
    }

    /// Sends one attempt on a slot from [`EmailSender::slot`]: builds the message (no
    /// network call if it is invalid), then one SMTP transaction within the timeout.
    pub async fn send(
        &self,
        _slot: SmtpSlot<'_>,
        msg: Outgoing<'_>,
    ) -> Result<Delivered, DeliveryError> {
        let inner = &*self.inner;
        let email = parse_payload(msg.payload, msg.key, inner.message_id_domain.as_deref())?;
        let content = email.message.formatted();
        let progress = Progress(AtomicU8::new(Phase::Session as u8));
        let sent = tokio::time::timeout(
            inner.timeout,
            inner.transaction(&email.envelope, &content, &progress),
        )
        .await;
        match sent {
            Ok(Ok(reply)) => {
                let code = code_of(&reply);
                let text: Vec<&str> = reply.message().collect();
                let text = text.join(" ");
                let mut response =
                    serde_json::json!({ "status": code, "message_id": email.message_id });
                if let Some(e) = enhanced_status(&text) {
                    response["enhanced_status"] = e.into();
                }
                if let Some(q) = queue_id(&text) {
                    response["queue_id"] = q.into();
                }
                Ok(Delivered {
                    status: Some(i32::from(code)),
                    deduplicated: false,
                    response,
                })
            }
            Ok(Err(e)) => Err(e),
            Err(_) => {
                // The transaction's future (and with it the connection) was dropped.
                let phase = progress.get();
                let class = classify(phase, Fault::Timeout);
                let ms = inner.timeout.as_millis();
                let message = match phase {
                    Phase::EndOfData => format!(
                        "no reply from {} within {ms}ms after the end of DATA; the relay may have queued the message",
                        inner.relay
                    ),
                    _ => format!(
                        "timed out after {ms}ms ({}) with {}",
                        phase.describe(),
                        inner.relay
                    ),
                };
                Err(DeliveryError {
                    response: Some(serde_json::json!({ "phase": phase.key(), "timeout": true })),
                    ..DeliveryError::new(class, message)
                })
            }
        }
    }
}
