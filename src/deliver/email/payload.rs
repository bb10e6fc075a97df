//! The e-mail payload: the contract's shape (`from`, `to`, `cc`, `bcc`, `reply_to`,
//! `subject`, `text`, `html`, `headers`) checked and built into a message and its envelope,
//! or refused as `invalid` with a message that names fields, never values. Also the
//! `Message-ID` every attempt of a message shares.

use std::collections::HashSet;

use lettre::address::Envelope;
use lettre::message::header::{HeaderName, HeaderValue};
use lettre::message::{Mailbox, MultiPart, SinglePart};
use lettre::{Address, Message};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::mime::{MAX_LINE, crlf_line_breaks, mailbox_header, unstructured};
use crate::deliver::DeliveryError;

/// Headers the worker sets from the payload's own fields, or that define the MIME
/// structure; `payload.headers` may not give them.
pub(super) const RESERVED_HEADERS: [&str; 12] = [
    "from",
    "sender",
    "to",
    "cc",
    "bcc",
    "reply-to",
    "subject",
    "message-id",
    "date",
    "mime-version",
    "return-path",
    "content-type",
];

/// The e-mail payload, as the contract has it. Each field is checked by hand so that
/// every error names the field and never repeats its value.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Payload {
    from: Option<Value>,
    to: Option<Value>,
    cc: Option<Value>,
    bcc: Option<Value>,
    reply_to: Option<Value>,
    subject: Option<Value>,
    text: Option<Value>,
    html: Option<Value>,
    headers: Option<Value>,
}

/// A payload checked and built into a message.
pub struct Email {
    /// The MIME message, with our `Message-ID`.
    pub message: Message,
    /// The SMTP envelope: the From address, and To, Cc and Bcc without duplicates.
    pub envelope: Envelope,
    /// The `Message-ID`, angle brackets included.
    pub message_id: String,
}

impl std::fmt::Debug for Email {
    /// The `Message-ID` and how many recipients: never an address, a subject or a body.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Email")
            .field("message_id", &self.message_id)
            .field("recipients", &self.envelope.to().len())
            .finish_non_exhaustive()
    }
}

/// The `Message-ID` of a message key: `<H@domain>`, H the first 32 hex digits of the
/// SHA-256 of the key. The same key gives the same id on every attempt and every replay.
pub fn message_id(key: &str, domain: &str) -> String {
    let digest = hex::encode(Sha256::digest(key.as_bytes()));
    format!("<{}@{domain}>", &digest[..32])
}

/// Checks an e-mail payload (jsonb text) and builds the message, or says why it is
/// invalid. Errors name the field, never its value. No network call is made.
pub fn parse_payload(
    payload: &str,
    key: &str,
    message_id_domain: Option<&str>,
) -> Result<Email, DeliveryError> {
    let p = read(payload)?;
    let checked = envelope(p, key, message_id_domain)?;
    build(checked)
}

/// The payload's JSON read into its fields; an unknown field is named, nothing else is.
fn read(payload: &str) -> Result<Payload, DeliveryError> {
    serde_json::from_str(payload).map_err(|e| {
        // serde names an unknown field by its key, which is not a value; anything else
        // (a wrong type for the whole payload) gets a generic line.
        let msg = e.to_string();
        match msg
            .strip_prefix("unknown field `")
            .and_then(|r| r.split('`').next())
        {
            Some(field) => DeliveryError::invalid(format!(
                "payload.{} is not a field of the email payload",
                crate::text::stripped(field, 64)
            )),
            None => DeliveryError::invalid("payload is not a JSON object of the email shape"),
        }
    })
}

/// The addresses, subject and bodies checked, in the order their errors are reported,
/// with the `Message-ID` and the envelope: everything but the message itself.
struct Checked {
    from: Mailbox,
    to: Vec<Mailbox>,
    cc: Vec<Mailbox>,
    reply_to: Option<Mailbox>,
    subject: Option<String>,
    text: Option<String>,
    html: Option<String>,
    /// `payload.headers`, checked by [`extra_headers`] when the message is built.
    headers: Option<Value>,
    message_id: String,
    envelope: Envelope,
}

/// Checks the fields of a read payload and derives the envelope and `Message-ID`.
fn envelope(
    p: Payload,
    key: &str,
    message_id_domain: Option<&str>,
) -> Result<Checked, DeliveryError> {
    let from = match p.from {
        Some(Value::String(s)) => mailbox("payload.from", &s)?,
        None | Some(Value::Null) => {
            return Err(DeliveryError::invalid("payload.from is required"));
        }
        Some(_) => return Err(DeliveryError::invalid("payload.from must be a string")),
    };
    let to = mailboxes("payload.to", p.to)?;
    if to.is_empty() {
        return Err(DeliveryError::invalid(
            "payload.to must name at least one address",
        ));
    }
    let cc = mailboxes("payload.cc", p.cc)?;
    let bcc = mailboxes("payload.bcc", p.bcc)?;
    let reply_to = match p.reply_to {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(mailbox("payload.reply_to", &s)?),
        Some(_) => {
            return Err(DeliveryError::invalid("payload.reply_to must be a string"));
        }
    };
    let subject = optional_string("payload.subject", p.subject)?;
    if let Some(s) = &subject {
        one_header_line("payload.subject", s)?;
    }
    let text = optional_string("payload.text", p.text)?.map(|t| crlf_line_breaks(&t));
    let html = optional_string("payload.html", p.html)?.map(|h| crlf_line_breaks(&h));

    let domain = match message_id_domain {
        Some(d) => d.to_owned(),
        None => ascii_domain(from.email.domain()).ok_or_else(|| {
            DeliveryError::invalid(
                "payload.from has a domain that cannot go into a Message-ID; set OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN",
            )
        })?,
    };
    let message_id = message_id(key, &domain);

    // The envelope lists every recipient once, whichever of To, Cc and Bcc names it, so the
    // relay gets one RCPT TO per address and the count of refused recipients is true.
    let mut seen = HashSet::new();
    let recipients: Vec<Address> = to
        .iter()
        .chain(&cc)
        .chain(&bcc)
        .map(|m| m.email.clone())
        .filter(|a| seen.insert(a.to_string().to_ascii_lowercase()))
        .collect();
    let envelope = Envelope::new(Some(from.email.clone()), recipients)
        .map_err(|_| DeliveryError::invalid("payload.to must name at least one address"))?;
    Ok(Checked {
        from,
        to,
        cc,
        reply_to,
        subject,
        text,
        html,
        headers: p.headers,
        message_id,
        envelope,
    })
}

/// Builds the message from checked fields: headers encoded and folded here, then the
/// payload's own headers, then the body (text, html, or both as alternatives).
fn build(checked: Checked) -> Result<Email, DeliveryError> {
    let Checked {
        from,
        to,
        cc,
        reply_to,
        subject,
        text,
        html,
        headers,
        message_id,
        envelope,
    } = checked;
    // lettre 0.11 folds only inside encoded words and at spaces of a text value: a list
    // of plain addresses, or a word longer than a line, comes out as one line (5 000
    // recipients made a `To:` line of some 100 KB, and adding them one by one re-parsed
    // the header each time). So the headers made from the payload are encoded and folded
    // here (`Folded`) and handed to lettre as they are. Bcc recipients are in the
    // envelope only.
    let mut builder = Message::builder()
        .from(from.clone())
        .raw_header(mailbox_header("From", std::slice::from_ref(&from)))
        .message_id(Some(message_id.clone()))
        .envelope(envelope.clone())
        .raw_header(mailbox_header("To", &to));
    if !cc.is_empty() {
        builder = builder.raw_header(mailbox_header("Cc", &cc));
    }
    if let Some(m) = reply_to {
        builder = builder.raw_header(mailbox_header("Reply-To", &[m]));
    }
    if let Some(s) = subject {
        let encoded = unstructured("Subject", &s, true);
        builder = builder.raw_header(HeaderValue::dangerous_new_pre_encoded(
            HeaderName::new_from_ascii_str("Subject"),
            s,
            encoded,
        ));
    }
    for header in extra_headers(headers)? {
        builder = builder.raw_header(header);
    }
    let built = match (text, html) {
        (Some(text), Some(html)) => {
            builder.multipart(MultiPart::alternative_plain_html(text, html))
        }
        (Some(text), None) => builder.singlepart(SinglePart::plain(text)),
        (None, Some(html)) => builder.singlepart(SinglePart::html(html)),
        (None, None) => {
            return Err(DeliveryError::invalid(
                "payload must have text, html, or both",
            ));
        }
    };
    let message =
        built.map_err(|e| DeliveryError::invalid(format!("cannot build the message ({e})")))?;
    Ok(Email {
        message,
        envelope,
        message_id,
    })
}

/// Refuses a value that would break out of its header line: CR, LF or any other control
/// character (a tab is allowed). lettre encodes what remains.
pub(super) fn one_header_line(field: &str, value: &str) -> Result<(), DeliveryError> {
    if value.chars().any(|c| c.is_control() && c != '\t') {
        return Err(DeliveryError::invalid(format!(
            "{field} contains a line break or another control character"
        )));
    }
    Ok(())
}

/// One address, `addr@example.com` or `Name <addr@example.com>`. An international domain
/// is written in its ASCII form (`kunde@xn--bcher-kva.example` for `kunde@bücher.example`),
/// in the envelope and in the header alike: it names the same mailbox, and needs no
/// SMTPUTF8, which many relays do not offer. Only a local part that is not ASCII needs it.
pub(super) fn mailbox(field: &str, value: &str) -> Result<Mailbox, DeliveryError> {
    one_header_line(field, value)?;
    let invalid = || DeliveryError::invalid(format!("{field} is not a valid address"));
    let mailbox = value.trim().parse::<Mailbox>().map_err(|_| invalid())?;
    if mailbox.email.domain().is_ascii() {
        return Ok(mailbox);
    }
    let domain = ascii_domain(mailbox.email.domain()).ok_or_else(invalid)?;
    let email = Address::new(mailbox.email.user(), domain).map_err(|_| invalid())?;
    Ok(Mailbox::new(mailbox.name, email))
}

/// A list of addresses: an array of strings, or one string.
pub(super) fn mailboxes(field: &str, value: Option<Value>) -> Result<Vec<Mailbox>, DeliveryError> {
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![mailbox(field, &s)?]),
        Some(Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => mailbox(&format!("{field}[{i}]"), &s),
                _ => Err(DeliveryError::invalid(format!(
                    "{field}[{i}] must be a string"
                ))),
            })
            .collect(),
        Some(_) => Err(DeliveryError::invalid(format!(
            "{field} must be an address or an array of addresses"
        ))),
    }
}

pub(super) fn optional_string(
    field: &str,
    value: Option<Value>,
) -> Result<Option<String>, DeliveryError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(DeliveryError::invalid(format!("{field} must be a string"))),
    }
}

/// `payload.headers`: an object of strings, none of them reserved, no line breaks.
pub(super) fn extra_headers(value: Option<Value>) -> Result<Vec<HeaderValue>, DeliveryError> {
    let map = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(DeliveryError::invalid(
                "payload.headers must be an object of strings",
            ));
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (name, value) in map {
        // RFC 5322 field names: printable ASCII except the colon; lettre also caps the
        // length at 76 so the name fits on the first line.
        let valid = !name.is_empty()
            && name.len() <= 76
            && name.bytes().all(|b| (33..=126).contains(&b) && b != b':');
        if !valid {
            return Err(DeliveryError::invalid(format!(
                "payload.headers: {:?} is not a valid header name",
                crate::text::stripped(&name, 64)
            )));
        }
        let lower = name.to_ascii_lowercase();
        if RESERVED_HEADERS.contains(&lower.as_str()) || lower.starts_with("content-") {
            return Err(DeliveryError::invalid(format!(
                "payload.headers.{name} is set by the worker and may not be given"
            )));
        }
        let Value::String(value) = value else {
            return Err(DeliveryError::invalid(format!(
                "payload.headers.{name} must be a string"
            )));
        };
        one_header_line(&format!("payload.headers.{name}"), &value)?;
        let hname = HeaderName::new_from_ascii(name.clone()).map_err(|_| {
            DeliveryError::invalid(format!(
                "payload.headers: {:?} is not a valid header name",
                crate::text::stripped(&name, 64)
            ))
        })?;
        // Folded at its spaces, non-ASCII words as encoded words; a long word is left
        // whole (the header may be structured, a URL in List-Unsubscribe), so one that
        // cannot fit a line at all is refused.
        let encoded = unstructured(&name, &value, false);
        if encoded
            .split("\r\n")
            .enumerate()
            .any(|(i, line)| line.len() + if i == 0 { name.len() + 2 } else { 0 } > MAX_LINE)
        {
            return Err(DeliveryError::invalid(format!(
                "payload.headers.{name} has a word too long for a header line ({MAX_LINE} octets)"
            )));
        }
        out.push(HeaderValue::dangerous_new_pre_encoded(
            hname, value, encoded,
        ));
    }
    Ok(out)
}

/// The ASCII form of an address's domain for a `Message-ID`: IDNA for an international
/// name, an address literal (`[192.0.2.1]`) as it is.
pub(super) fn ascii_domain(domain: &str) -> Option<String> {
    if domain.starts_with('[') {
        return domain.is_ascii().then(|| domain.to_owned());
    }
    match url::Host::parse(domain).ok()? {
        url::Host::Domain(d) => Some(d),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ErrorClass;

    fn parse(payload: serde_json::Value) -> Result<Email, DeliveryError> {
        parse_payload(&payload.to_string(), "order-42:paid:mail", None)
    }

    #[test]
    fn message_id_is_the_key_hash_at_the_domain() {
        // sha256("order-42:paid:mail"), first 32 hex digits.
        let digest = hex::encode(Sha256::digest(b"order-42:paid:mail"));
        assert_eq!(
            message_id("order-42:paid:mail", "shop.example"),
            format!("<{}@shop.example>", &digest[..32])
        );
        assert_eq!(
            message_id("k", "a.example"),
            message_id("k", "a.example"),
            "stable"
        );
        assert_ne!(message_id("k1", "a.example"), message_id("k2", "a.example"));
    }

    #[test]
    fn a_full_payload_builds_a_multipart_message() {
        let email = parse(serde_json::json!({
            "from": "Shop <shop@shop.example>",
            "to": ["a@example.com", "B <b@example.com>"],
            "cc": ["c@example.com"],
            "bcc": ["hidden@example.com", "A@example.com"],
            "reply_to": "help@shop.example",
            "subject": "Ihre Bestellung – Grüße",
            "text": "plain",
            "html": "<p>html</p>",
            "headers": {"X-Campaign": "spring", "List-Unsubscribe": "<mailto:u@shop.example>"}
        }))
        .expect("valid");
        assert!(email.message_id.ends_with("@shop.example>"));
        let text = String::from_utf8(email.message.formatted()).expect("ASCII");
        assert!(text.contains(&format!("Message-ID: {}\r\n", email.message_id)));
        assert!(text.contains("X-Campaign: spring\r\n"));
        assert!(text.contains("multipart/alternative"));
        assert!(!text.contains("hidden@example.com"), "no Bcc header");
        assert!(
            text.contains("Subject: Ihre Bestellung =?utf-8?b?"),
            "encoded word: {text}"
        );
        // Recipients once each, Bcc included; A@ and a@ are one address.
        let rcpts: Vec<String> = email.envelope.to().iter().map(|a| a.to_string()).collect();
        assert_eq!(
            rcpts,
            [
                "a@example.com",
                "b@example.com",
                "c@example.com",
                "hidden@example.com"
            ]
        );
        assert_eq!(
            email.envelope.from().map(|a| a.to_string()).as_deref(),
            Some("shop@shop.example")
        );
    }

    #[test]
    fn the_domain_override_wins_and_international_domains_are_encoded() {
        let p = serde_json::json!({"from": "a@bücher.example", "to": "b@example.com", "text": "x"});
        let email = parse(p.clone()).expect("valid");
        assert!(
            email.message_id.ends_with("@xn--bcher-kva.example>"),
            "{}",
            email.message_id
        );
        let email = parse_payload(&p.to_string(), "k", Some("mail.example.net")).expect("valid");
        assert!(email.message_id.ends_with("@mail.example.net>"));
    }

    #[test]
    fn invalid_payloads_name_the_field_never_the_value() {
        let ok = || serde_json::json!({"from": "shop@shop.example", "to": ["a@example.com"], "text": "t"});
        let with = |k: &str, v: serde_json::Value| {
            let mut p = ok();
            p[k] = v;
            p
        };
        let cases: Vec<(serde_json::Value, &str)> = vec![
            (serde_json::json!([1]), "email shape"),
            (with("to", serde_json::json!([])), "payload.to"),
            (
                with("to", serde_json::json!(["secret-not-an-address"])),
                "payload.to[0] is not a valid address",
            ),
            (
                with("to", serde_json::json!(["a@example.com", 7])),
                "payload.to[1] must be a string",
            ),
            (
                with("to", serde_json::json!({"a": 1})),
                "payload.to must be",
            ),
            (
                with("cc", serde_json::json!(["secret@@x"])),
                "payload.cc[0]",
            ),
            (
                with("bcc", serde_json::json!(["secret\r\nBcc: x@y.example"])),
                "payload.bcc[0] contains a line break",
            ),
            (
                with("from", serde_json::json!(null)),
                "payload.from is required",
            ),
            (
                with("from", serde_json::json!("secret <nope>")),
                "payload.from is not a valid address",
            ),
            (
                with("from", serde_json::json!("Secret\r\n <a@b.example>")),
                "payload.from contains a line break",
            ),
            (
                with("reply_to", serde_json::json!(["a@b.example"])),
                "payload.reply_to must be a string",
            ),
            (
                with(
                    "subject",
                    serde_json::json!("hi secret\r\nBcc: victim@example.com"),
                ),
                "payload.subject contains a line break",
            ),
            (
                with("subject", serde_json::json!("secret\nX: y")),
                "payload.subject contains a line break",
            ),
            (
                with("subject", serde_json::json!(3)),
                "payload.subject must be a string",
            ),
            (
                with("text", serde_json::json!(["x"])),
                "payload.text must be a string",
            ),
            (
                serde_json::json!({"from": "a@b.example", "to": "c@d.example"}),
                "text, html",
            ),
            (
                with(
                    "headers",
                    serde_json::json!({"X-A": "secret\r\nBcc: v@example.com"}),
                ),
                "payload.headers.X-A contains a line break",
            ),
            (
                with("headers", serde_json::json!({"X-A": 1})),
                "payload.headers.X-A must be a string",
            ),
            (
                with("headers", serde_json::json!({"Bad Name": "v"})),
                "not a valid header name",
            ),
            (
                with("headers", serde_json::json!({"X\r\nBcc": "v"})),
                "not a valid header name",
            ),
            (
                with("headers", serde_json::json!({"Message-ID": "<secret@x>"})),
                "payload.headers.Message-ID is set by the worker",
            ),
            (
                with("headers", serde_json::json!({"bcc": "secret@x.example"})),
                "is set by the worker",
            ),
            (
                with(
                    "headers",
                    serde_json::json!({"Content-Type": "text/secret"}),
                ),
                "is set by the worker",
            ),
            (
                with("headers", serde_json::json!(["x"])),
                "payload.headers must be an object",
            ),
            (
                with("attachments", serde_json::json!([])),
                "payload.attachments is not a field",
            ),
        ];
        for (payload, needle) in cases {
            let err = parse(payload.clone()).expect_err(&payload.to_string());
            assert_eq!(err.class, ErrorClass::Invalid, "{payload}");
            assert!(err.message.contains(needle), "{payload}: {}", err.message);
            assert!(
                !err.message.contains("secret") && !err.message.contains('@'),
                "{payload}: a value leaked into {:?}",
                err.message
            );
        }
    }
}
