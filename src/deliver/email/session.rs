//! One SMTP transaction on a pooled connection, phase by phase: MAIL FROM (with a fresh
//! connection if a reused one turns out dead), every RCPT TO (all or none), then DATA and
//! the content, recording the phase as it goes so a failure is classed by where it
//! happened.

use std::sync::atomic::{AtomicU8, Ordering};

use lettre::address::Envelope;
use lettre::transport::smtp::client::AsyncSmtpConnection;
use lettre::transport::smtp::commands::{Data, Mail, Rcpt};
use lettre::transport::smtp::extension::{Extension, MailBodyParameter, MailParameter};
use lettre::transport::smtp::response::Response;

use super::pool::{Ended, Inner};
use super::reply::{Phase, code_of, enhanced_status, from_smtp_error, reply_error};
use crate::deliver::DeliveryError;
use crate::model::ErrorClass;

/// The enhanced status code of "too many recipients" (RFC 3463, X.5.3).
const TOO_MANY_RECIPIENTS: &str = "4.5.3";

/// The attempt's progress, shared with the future that may be cancelled by the deadline.
pub(super) struct Progress(pub(super) AtomicU8);

impl Progress {
    pub(super) fn set(&self, phase: Phase) {
        self.0.store(phase as u8, Ordering::SeqCst);
    }
    pub(super) fn get(&self) -> Phase {
        Phase::from_u8(self.0.load(Ordering::SeqCst))
    }
}

/// The message content as lettre's `message_iter` consumes it. lettre writes each chunk
/// before asking for the next, so the call that finds the iterator empty comes after the
/// whole content was written: from then on only the end-of-data marker and the reply
/// remain, and a lost connection may mean the relay has the message.
pub(super) struct Content<'a> {
    bytes: Option<&'a [u8]>,
    progress: &'a Progress,
}

impl<'a> Iterator for Content<'a> {
    type Item = &'a [u8];
    fn next(&mut self) -> Option<&'a [u8]> {
        let next = self.bytes.take();
        if next.is_none() {
            self.progress.set(Phase::EndOfData);
        }
        next
    }
}

/// Whether a failed command shows a connection that is no longer usable: no reply at all,
/// or 421 (the relay is closing it).
pub(super) fn is_dead_connection(e: &lettre::transport::smtp::Error) -> bool {
    match e.status() {
        Some(code) => u16::from(code) == 421,
        None => true,
    }
}

/// What a failed command leaves of the connection: a negative reply leaves it usable
/// (after RSET), anything else or a 421 does not.
pub(super) fn after_reply_error(e: &lettre::transport::smtp::Error) -> Ended {
    if is_dead_connection(e) {
        Ended::Broken
    } else {
        Ended::Reusable { dirty: true }
    }
}

impl Inner {
    /// One SMTP transaction, from taking a connection to the reply after the end of DATA.
    /// The caller holds a slot and bounds this with the attempt's deadline.
    pub(super) async fn transaction(
        &self,
        envelope: &Envelope,
        content: &[u8],
        progress: &Progress,
    ) -> Result<Response, DeliveryError> {
        progress.set(Phase::Session);
        let (conn, reused) = match self.checkout().await {
            Some(conn) => (conn, true),
            None => (self.connect().await?, false),
        };
        let conn = self
            .mail_from(conn, reused, envelope, content, progress)
            .await?;
        let conn = self.rcpt_all(conn, envelope, progress).await?;
        self.data(conn, content, progress).await
    }

    /// MAIL FROM, with the parameters the envelope and content need (SMTPUTF8, 8BITMIME).
    /// Returns the connection the transaction goes on with: a fresh one if the reused one
    /// turned out dead.
    async fn mail_from(
        &self,
        mut conn: AsyncSmtpConnection,
        reused: bool,
        envelope: &Envelope,
        content: &[u8],
        progress: &Progress,
    ) -> Result<AsyncSmtpConnection, DeliveryError> {
        let Some(from) = envelope.from().cloned() else {
            return Err(DeliveryError::invalid("the message has no sender address"));
        };
        let mut params = Vec::new();
        // A non-ASCII address in the envelope, or in a header: lettre encodes bodies and
        // display names as 7-bit, so content that is not ASCII holds an address written
        // as it is (a Reply-To's, which the envelope does not carry), which only
        // SMTPUTF8 allows (RFC 6532).
        let needs_utf8 = !content.is_ascii()
            || envelope
                .to()
                .iter()
                .chain(envelope.from())
                .any(|a| !a.to_string().is_ascii());
        if needs_utf8 {
            if !conn.server_info().supports_feature(Extension::SmtpUtfEight) {
                self.checkin(conn, Ended::Reusable { dirty: false });
                return Err(DeliveryError::new(
                    ErrorClass::Permanent,
                    format!(
                        "{} does not support SMTPUTF8, which a non-ASCII address needs",
                        self.relay
                    ),
                ));
            }
            params.push(MailParameter::SmtpUtfEight);
        }
        // lettre encodes bodies as 7bit, quoted-printable or base64, so this is a guard.
        if !content.is_ascii() {
            params.push(MailParameter::Body(MailBodyParameter::EightBitMime));
        }

        // MAIL FROM. A pooled connection may have been closed by the relay while idle; that
        // shows at its first command, and since nothing was sent, a fresh connection takes
        // over within this attempt.
        progress.set(Phase::Mail);
        let mail = Mail::new(Some(from.clone()), params.clone());
        let mut result = conn.command(mail).await;
        if reused && result.as_ref().err().is_some_and(is_dead_connection) {
            progress.set(Phase::Session);
            conn = self.connect().await?;
            progress.set(Phase::Mail);
            result = conn.command(Mail::new(Some(from), params)).await;
        }
        if let Err(e) = result {
            let ended = after_reply_error(&e);
            self.checkin(conn, ended);
            return Err(from_smtp_error(Phase::Mail, &self.relay, e));
        }
        Ok(conn)
    }

    /// RCPT TO, every recipient; the connection back when all were accepted.
    async fn rcpt_all(
        &self,
        mut conn: AsyncSmtpConnection,
        envelope: &Envelope,
        progress: &Progress,
    ) -> Result<AsyncSmtpConnection, DeliveryError> {
        // RCPT TO, every recipient. All or none: a refused recipient stops the message.
        progress.set(Phase::Rcpt);
        let total = envelope.to().len();
        let mut refused: Vec<(u16, Option<String>, lettre::transport::smtp::Error)> = Vec::new();
        let mut deferred: Vec<(u16, Option<String>, lettre::transport::smtp::Error)> = Vec::new();
        let mut closing = false;
        let mut accepted = 0usize;
        let mut over_limit = 0usize;
        for rcpt in envelope.to() {
            match conn.command(Rcpt::new(rcpt.clone(), vec![])).await {
                Ok(_) => accepted += 1,
                Err(e) => match e.status().map(u16::from) {
                    Some(code) => {
                        let enhanced = std::error::Error::source(&e)
                            .map(|s| s.to_string())
                            .and_then(|t| enhanced_status(&t));
                        closing |= code == 421;
                        if accepted > 0
                            && code < 500
                            && enhanced.as_deref() == Some(TOO_MANY_RECIPIENTS)
                        {
                            over_limit += 1;
                        }
                        if code >= 500 {
                            refused.push((code, enhanced, e));
                        } else {
                            deferred.push((code, enhanced, e));
                        }
                        // 421: the relay is closing the connection; ask no more.
                        if closing {
                            break;
                        }
                    }
                    None => return Err(from_smtp_error(Phase::Rcpt, &self.relay, e)),
                },
            }
        }
        let (n_refused, n_deferred) = (refused.len(), deferred.len());
        // `over_limit`: a `4.5.3` after some recipients were taken is the relay's limit of
        // recipients per message (Postfix's `smtpd_recipient_limit`, Exchange's and
        // Gmail's alike). RFC 5321 has the client send the rest in another transaction,
        // which would break all or none (a retry would resend the first part). The next
        // attempt meets the same limit, but the contract makes every SMTP 4xx transient,
        // so the message is retried to `exhausted`; its error says why, and what to do.
        // Before any recipient was taken the code says nothing about the count.
        let over_limit = if n_refused == 0 { over_limit } else { 0 };
        // A 5xx decides (the message can never reach every recipient), so the first
        // refusal is reported before any deferral.
        if let Some((code, enhanced, source)) = refused.into_iter().chain(deferred).next() {
            let (n, verb) = if n_refused > 0 {
                (n_refused, "refused")
            } else {
                (n_deferred, "deferred")
            };
            let what = if over_limit > 0 {
                let others = match n_deferred - over_limit {
                    0 => String::new(),
                    n => format!(" (and {n} for other reasons)"),
                };
                format!(
                    "the relay took {accepted} of {total} recipients and deferred {over_limit} as too many for one message{others}, which every attempt will meet; no DATA sent (a message goes to all its recipients or to none: enqueue it as several messages)"
                )
            } else {
                format!(
                    "{n} of {total} recipients {verb}; no DATA sent (a message goes to all its recipients or to none)"
                )
            };
            let mut err = reply_error(Phase::Rcpt, &self.relay, code, enhanced, Some(what), source);
            if let Some(r) = err.response.as_mut() {
                r["recipients"] = total.into();
                r["refused"] = n_refused.into();
                r["deferred"] = n_deferred.into();
            }
            let ended = if closing {
                Ended::Broken
            } else {
                Ended::Reusable { dirty: true }
            };
            self.checkin(conn, ended);
            return Err(err);
        }
        Ok(conn)
    }

    /// DATA, the content and the end-of-data marker, then the relay's reply.
    async fn data(
        &self,
        mut conn: AsyncSmtpConnection,
        content: &[u8],
        progress: &Progress,
    ) -> Result<Response, DeliveryError> {
        // DATA, then the content and the end-of-data marker.
        progress.set(Phase::Data);
        if let Err(e) = conn.command(Data).await {
            let ended = after_reply_error(&e);
            self.checkin(conn, ended);
            return Err(from_smtp_error(Phase::Data, &self.relay, e));
        }
        progress.set(Phase::Content);
        let chunks = Content {
            bytes: Some(content),
            progress,
        };
        match conn.message_iter(chunks).await {
            Ok(reply) => {
                if reply.code().severity
                    != lettre::transport::smtp::response::Severity::PositiveCompletion
                {
                    // A 3xx after the end of DATA is not SMTP; whether the relay took the
                    // message is unknown.
                    return Err(DeliveryError {
                        status: Some(i32::from(code_of(&reply))),
                        ..DeliveryError::new(
                            ErrorClass::Ambiguous,
                            format!(
                                "SMTP {} from {} after the end of DATA is not a final reply; the relay may have queued the message",
                                code_of(&reply),
                                self.relay
                            ),
                        )
                    });
                }
                self.checkin(conn, Ended::Reusable { dirty: false });
                Ok(reply)
            }
            Err(e) => {
                // Which phase: the iterator moved it to EndOfData once the content was out.
                let phase = progress.get();
                let ended = after_reply_error(&e);
                self.checkin(conn, ended);
                Err(from_smtp_error(phase, &self.relay, e))
            }
        }
    }
}
