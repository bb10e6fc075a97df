//! What the relay answered, and what a failure means: the phases of the SMTP dialogue,
//! the classification table (phase × fault → error class), enhanced status codes and
//! queue ids read from replies, and the errors built from them (codes only, never the
//! reply's text).

use lettre::transport::smtp::response::Response;

use crate::deliver::DeliveryError;
use crate::model::ErrorClass;

/// Where in the SMTP dialogue an attempt is; decides what a failure means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Phase {
    /// Waiting for a connection slot, connecting, TLS, EHLO, AUTH, or resetting a reused
    /// connection. Nothing of the message has been sent.
    Session = 0,
    /// MAIL FROM.
    Mail = 1,
    /// RCPT TO.
    Rcpt = 2,
    /// The DATA command, before the relay's 354.
    Data = 3,
    /// Writing the content; its last byte has not yet left.
    Content = 4,
    /// The content has been written: the end-of-data marker and the reply remain. The
    /// relay may have queued the message.
    EndOfData = 5,
}

impl Phase {
    pub(super) fn from_u8(v: u8) -> Phase {
        match v {
            1 => Phase::Mail,
            2 => Phase::Rcpt,
            3 => Phase::Data,
            4 => Phase::Content,
            5 => Phase::EndOfData,
            _ => Phase::Session,
        }
    }

    /// For messages.
    pub(super) fn describe(self) -> &'static str {
        match self {
            Phase::Session => "setting up the SMTP session",
            Phase::Mail => "MAIL FROM",
            Phase::Rcpt => "RCPT TO",
            Phase::Data => "DATA",
            Phase::Content => "sending the message content",
            Phase::EndOfData => "after the end of DATA, before the reply",
        }
    }

    /// For the `response` column.
    pub(super) fn key(self) -> &'static str {
        match self {
            Phase::Session => "session",
            Phase::Mail => "mail",
            Phase::Rcpt => "rcpt",
            Phase::Data => "data",
            Phase::Content => "content",
            Phase::EndOfData => "end_of_data",
        }
    }
}

/// What went wrong, for [`classify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    /// The relay answered with this negative reply code.
    Reply(u16),
    /// The connection failed, closed, or carried something that is not SMTP.
    Connection,
    /// The attempt's deadline passed.
    Timeout,
}

/// The class of a failure, by phase: the table at the top of this file.
pub(super) fn classify(phase: Phase, fault: Fault) -> ErrorClass {
    match (phase, fault) {
        (_, Fault::Reply(code)) if code >= 500 => ErrorClass::Permanent,
        (Phase::Session, _) => ErrorClass::Transient,
        (_, Fault::Reply(_)) => ErrorClass::Transient,
        (Phase::EndOfData, Fault::Connection | Fault::Timeout) => ErrorClass::Ambiguous,
        (_, Fault::Connection | Fault::Timeout) => ErrorClass::Transient,
    }
}

/// The enhanced status code (`5.1.1`) at the start of a reply's text, if any. Only this
/// is kept from a reply's text: the rest often quotes addresses.
pub(super) fn enhanced_status(text: &str) -> Option<String> {
    let first = text.split_whitespace().next()?;
    let mut parts = first.split('.');
    let class = parts.next()?;
    let subject = parts.next()?;
    let detail = parts.next()?;
    let ok = parts.next().is_none()
        && matches!(class, "2" | "4" | "5")
        && (1..=3).contains(&subject.len())
        && (1..=3).contains(&detail.len())
        && subject
            .bytes()
            .chain(detail.bytes())
            .all(|b| b.is_ascii_digit());
    ok.then(|| first.to_owned())
}

/// The relay's queue id in an accepting reply, where it gives one: Postfix and Mailpit
/// (`queued as 4Bc1xyz`), Exim (`id=1abcDE-000123-AB`), SES and others (`Ok <id>`).
/// Only tokens made of letters, digits and `.-_+` (never an address) are taken.
pub fn queue_id(reply: &str) -> Option<String> {
    let token_ok = |t: &str| {
        (4..=100).contains(&t.len())
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b".-_+".contains(&b))
            && t.bytes().any(|b| b.is_ascii_digit())
    };
    let words: Vec<&str> = reply
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| matches!(c, '<' | '>' | '(' | ')' | ',' | ';')))
        .collect();
    for (i, w) in words.iter().enumerate() {
        let lower = w.to_ascii_lowercase();
        // "queued as ID", or "Ok ID" as the reply's last two words.
        let queued_as = lower == "as" && i > 0 && words[i - 1].eq_ignore_ascii_case("queued");
        let ok_then_id = matches!(lower.as_str(), "ok" | "ok:") && i + 2 == words.len();
        let candidate = if let Some(id) = lower.strip_prefix("id=") {
            Some(&w[w.len() - id.len()..])
        } else if queued_as || ok_then_id {
            words.get(i + 1).copied()
        } else {
            None
        };
        if let Some(c) = candidate.filter(|c| token_ok(c)) {
            return Some(c.to_owned());
        }
    }
    None
}

/// The reply's code as a number.
pub(super) fn code_of(response: &Response) -> u16 {
    u16::from(response.code())
}

/// A lettre error, classed in its phase, with a message safe to store.
pub(super) fn from_smtp_error(
    phase: Phase,
    relay: &str,
    err: lettre::transport::smtp::Error,
) -> DeliveryError {
    if let Some(code) = err.status() {
        let code = u16::from(code);
        let enhanced = std::error::Error::source(&err)
            .map(|s| s.to_string())
            .and_then(|t| enhanced_status(&t));
        return reply_error(phase, relay, code, enhanced, None, err);
    }
    // lettre's "response" errors (a reply that does not parse) may quote the reply's
    // text; only connection, TLS and client errors have safe details.
    let detail = if err.is_response() {
        "the server's reply is not valid SMTP".to_owned()
    } else {
        let d = crate::support::causes(&err)
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(": ");
        if d.is_empty() { err.to_string() } else { d }
    };
    connection_error(phase, relay, &detail, Box::new(err))
}

/// A failure with no reply (the connection, TLS, the relay's name), classed in its phase:
/// `detail` is safe to store.
pub(super) fn connection_error(
    phase: Phase,
    relay: &str,
    detail: &str,
    source: Box<dyn std::error::Error + Send + Sync>,
) -> DeliveryError {
    let class = classify(phase, Fault::Connection);
    let message = match phase {
        Phase::EndOfData => format!(
            "connection to {relay} lost {} ({detail}); the relay may have queued the message",
            phase.describe()
        ),
        _ => format!("{} with {relay} failed: {detail}", phase.describe()),
    };
    DeliveryError {
        response: Some(serde_json::json!({ "phase": phase.key() })),
        source: Some(source),
        ..DeliveryError::new(class, message)
    }
}

/// A negative reply, classed in its phase.
pub(super) fn reply_error(
    phase: Phase,
    relay: &str,
    code: u16,
    enhanced: Option<String>,
    what: Option<String>,
    source: lettre::transport::smtp::Error,
) -> DeliveryError {
    let class = classify(phase, Fault::Reply(code));
    let code_text = match &enhanced {
        Some(e) => format!("SMTP {code} {e}"),
        None => format!("SMTP {code}"),
    };
    let message = match what {
        Some(what) => format!("{code_text} from {relay}: {what}"),
        None => format!("{code_text} from {relay} at {}", phase.describe()),
    };
    let mut response = serde_json::json!({ "status": code, "phase": phase.key() });
    if let Some(e) = enhanced {
        response["enhanced_status"] = e.into();
    }
    DeliveryError {
        class,
        status: Some(i32::from(code)),
        retry_after: None,
        response: Some(response),
        message: crate::deliver::one_line(&message),
        source: Some(Box::new(source)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_table() {
        use ErrorClass::*;
        use Fault::*;
        let table = [
            (Phase::Session, Reply(421), Transient),
            (Phase::Session, Reply(535), Permanent),
            (Phase::Session, Reply(554), Permanent),
            (Phase::Session, Connection, Transient),
            (Phase::Session, Timeout, Transient),
            (Phase::Mail, Reply(451), Transient),
            (Phase::Mail, Reply(550), Permanent),
            (Phase::Mail, Connection, Transient),
            (Phase::Mail, Timeout, Transient),
            (Phase::Rcpt, Reply(450), Transient),
            (Phase::Rcpt, Reply(550), Permanent),
            (Phase::Rcpt, Timeout, Transient),
            (Phase::Data, Reply(554), Permanent),
            (Phase::Data, Connection, Transient),
            (Phase::Content, Connection, Transient),
            (Phase::Content, Timeout, Transient),
            (Phase::EndOfData, Reply(451), Transient),
            (Phase::EndOfData, Reply(552), Permanent),
            (Phase::EndOfData, Connection, Ambiguous),
            (Phase::EndOfData, Timeout, Ambiguous),
        ];
        for (phase, fault, want) in table {
            assert_eq!(classify(phase, fault), want, "{phase:?} {fault:?}");
        }
    }

    #[test]
    fn reply_details() {
        assert_eq!(
            enhanced_status("5.1.1 <a@b>: unknown").as_deref(),
            Some("5.1.1")
        );
        assert_eq!(
            enhanced_status("2.0.0 Ok: queued").as_deref(),
            Some("2.0.0")
        );
        assert_eq!(enhanced_status("Ok").as_deref(), None);
        assert_eq!(enhanced_status("1.2.3.4 x").as_deref(), None);
        assert_eq!(
            queue_id("2.0.0 Ok: queued as 4BcZ9x1Qz3").as_deref(),
            Some("4BcZ9x1Qz3")
        );
        assert_eq!(
            queue_id("OK id=1tXyZa-0001Ab-2c").as_deref(),
            Some("1tXyZa-0001Ab-2c")
        );
        assert_eq!(
            queue_id("Ok 0100018c4a1b2c3d-abc").as_deref(),
            Some("0100018c4a1b2c3d-abc")
        );
        assert_eq!(queue_id("OK").as_deref(), None);
        assert_eq!(
            queue_id("2.0.0 Ok: queued as <bob@example.com>").as_deref(),
            None
        );
    }
}
