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
//! [`AsyncSmtpConnection`] and issue each command ourselves, recording the phase as we
//! go, so every failure is classed by where it happened:
//!
//! | phase | a reply 4xx | a reply 5xx | connection lost or timed out |
//! |---|---|---|---|
//! | session (connect, TLS, EHLO, AUTH) | transient | transient | transient |
//! | MAIL FROM, RCPT TO, DATA | transient | permanent | transient |
//! | content (before its last byte left) | – | – | transient |
//! | after the end of DATA, before the reply | transient | permanent | **ambiguous** |
//!
//! Session errors are transient whatever the code: they are about the relay (a bad
//! password, a refused client, a missing STARTTLS), not about this message, and a fix of
//! the configuration should let the message through.
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

pub mod settings;

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use lettre::address::Envelope;
use lettre::message::header::{HeaderName, HeaderValue};
use lettre::message::{Mailbox, MultiPart, SinglePart};
use lettre::transport::smtp::authentication::{Credentials, Mechanism};
use lettre::transport::smtp::client::{AsyncSmtpConnection, TlsParameters};
use lettre::transport::smtp::commands::{Data, Mail, Rcpt, Rset};
use lettre::transport::smtp::extension::{ClientId, Extension, MailBodyParameter, MailParameter};
use lettre::transport::smtp::response::Response;
use lettre::{Address, Message};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use self::settings::{EmailConfig, SmtpTls};
use super::{Delivered, DeliveryError, Outgoing};
use crate::model::ConfigError;
use crate::model::ErrorClass;

/// How long an idle connection is kept for reuse. Relays close idle sessions after a few
/// minutes (Postfix: 300 s); a minute keeps most reused connections alive.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Headers the worker sets from the payload's own fields, or that define the MIME
/// structure; `payload.headers` may not give them.
const RESERVED_HEADERS: [&str; 12] = [
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

/// Sends e-mails through one SMTP relay, reusing connections.
///
/// Cheap to clone: clones share the connection pool.
#[derive(Clone)]
pub struct EmailSender {
    inner: std::sync::Arc<Inner>,
}

struct Inner {
    /// Host name or IP address of the relay.
    host: String,
    /// Its port.
    port: u16,
    /// `host:port`, for error messages.
    relay: String,
    /// How connections are secured.
    tls: SmtpTls,
    /// Built once: the rustls configuration with the platform's roots.
    tls_params: Option<TlsParameters>,
    /// AUTH credentials, when the URL has them.
    credentials: Option<Credentials>,
    /// Our name in EHLO.
    hello: ClientId,
    /// The whole attempt's deadline.
    timeout: Duration,
    /// `OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN`.
    message_id_domain: Option<String>,
    /// One permit per connection in use; bounds the connections open at once.
    slots: Semaphore,
    /// Connections between transactions, newest last.
    idle: Mutex<Vec<IdleConnection>>,
    /// Most connections open at once, and most idle connections kept.
    max_connections: usize,
}

/// The right to open or reuse one of the relay's connections for one attempt.
pub struct SmtpSlot<'a> {
    _permit: tokio::sync::SemaphorePermit<'a>,
}

/// A pooled connection.
struct IdleConnection {
    conn: AsyncSmtpConnection,
    since: Instant,
    /// A transaction was abandoned on it (refused recipients): it needs RSET first.
    dirty: bool,
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

/// The e-mail payload, as the contract has it. Each field is checked by hand so that
/// every error names the field and never repeats its value.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Payload {
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
#[derive(Debug)]
pub struct Email {
    /// The MIME message, with our `Message-ID`.
    pub message: Message,
    /// The SMTP envelope: the From address, and To, Cc and Bcc without duplicates.
    pub envelope: Envelope,
    /// The `Message-ID`, angle brackets included.
    pub message_id: String,
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
    let p: Payload = serde_json::from_str(payload).map_err(|e| {
        // serde names an unknown field by its key, which is not a value; anything else
        // (a wrong type for the whole payload) gets a generic line.
        let msg = e.to_string();
        match msg
            .strip_prefix("unknown field `")
            .and_then(|r| r.split('`').next())
        {
            Some(field) => DeliveryError::invalid(format!(
                "payload.{} is not a field of the email payload",
                printable(field)
            )),
            None => DeliveryError::invalid("payload is not a JSON object of the email shape"),
        }
    })?;

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
    for header in extra_headers(p.headers)? {
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

/// A body with every line break as CRLF: a lone CR and a lone LF each become CRLF.
///
/// RFC 5322 (and a text part's canonical form, RFC 2046 §4.1.1) allows CR and LF only
/// together. lettre turns a lone LF into CRLF but sends a lone CR as it is in a 7bit
/// part, and its dot-stuffing only knows lines that end in CRLF: `text\r.\r\n` reached
/// the relay as written, an end of data to a relay that takes a lone CR for a line end
/// (SMTP smuggling, 2023). Normalising here, rather than encoding such bodies
/// quoted-printable (where a lone CR survives as `=0D` into what the recipient's program
/// shows), gives one line-break convention on the wire and in the decoded text, and then
/// lettre's choice of encoding holds: 7bit only for ASCII whose lines are under 76
/// octets, quoted-printable or base64 (lines of 76) for anything else, never 8bit.
fn crlf_line_breaks(body: &str) -> String {
    let mut out = String::with_capacity(body.len() + body.len() / 32);
    let mut chars = body.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' => {
                out.push_str("\r\n");
                if chars.peek() == Some(&'\n') {
                    chars.next();
                }
            }
            '\n' => out.push_str("\r\n"),
            c => out.push(c),
        }
    }
    out
}

/// Refuses a value that would break out of its header line: CR, LF or any other control
/// character (a tab is allowed). lettre encodes what remains.
fn one_header_line(field: &str, value: &str) -> Result<(), DeliveryError> {
    if value.chars().any(|c| c.is_control() && c != '\t') {
        return Err(DeliveryError::invalid(format!(
            "{field} contains a line break or another control character"
        )));
    }
    Ok(())
}

/// One address, `addr@example.com` or `Name <addr@example.com>`.
fn mailbox(field: &str, value: &str) -> Result<Mailbox, DeliveryError> {
    one_header_line(field, value)?;
    value
        .trim()
        .parse::<Mailbox>()
        .map_err(|_| DeliveryError::invalid(format!("{field} is not a valid address")))
}

/// A list of addresses: an array of strings, or one string.
fn mailboxes(field: &str, value: Option<Value>) -> Result<Vec<Mailbox>, DeliveryError> {
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

fn optional_string(field: &str, value: Option<Value>) -> Result<Option<String>, DeliveryError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(DeliveryError::invalid(format!("{field} must be a string"))),
    }
}

/// `payload.headers`: an object of strings, none of them reserved, no line breaks.
fn extra_headers(value: Option<Value>) -> Result<Vec<HeaderValue>, DeliveryError> {
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
                printable(&name)
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
                printable(&name)
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

/// Header lines end here where the content allows (RFC 5322 §2.1.1: SHOULD be at most 78
/// characters) ...
const FOLD_AT: usize = 78;
/// ... and never pass this (MUST: 998, the CRLF excluded).
const MAX_LINE: usize = 998;
/// Most octets of text in one encoded word: `=?utf-8?b?` + 60 base64 characters + `?=`
/// is 72, within RFC 2047's 75.
const ENCODED_WORD_TEXT: usize = 45;
/// An encoded word's characters besides its base64.
const ENCODED_WORD_FRAME: usize = "=?utf-8?b?".len() + "?=".len();

/// A header value being written and folded: tokens that stay whole, and the whitespace
/// between them, where a line may break. The break (CRLF) goes before the whitespace, so
/// unfolding (removing the CRLFs) gives back exactly what was written.
struct Folded {
    out: String,
    /// Octets on the current line, the first line's `Name: ` included.
    line: usize,
    /// Whether a token was written: no break before the first one.
    started: bool,
}

impl Folded {
    fn new(name: &str) -> Folded {
        Folded {
            out: String::new(),
            line: name.len() + ": ".len(),
            started: false,
        }
    }

    fn can_break(&self, space: &str) -> bool {
        self.started && !space.is_empty()
    }

    fn write(&mut self, space: &str, token: &str) {
        self.out.push_str(space);
        self.out.push_str(token);
        self.line += space.len() + token.len();
        self.started = true;
    }

    fn new_line(&mut self) {
        self.out.push_str("\r\n");
        self.line = 0;
    }

    /// `space` (whitespace, possibly none) then `token`, on a new line if the token would
    /// end past [`FOLD_AT`] and there is a space to break at.
    fn push(&mut self, space: &str, token: &str) {
        if self.can_break(space)
            && !token.is_empty()
            && self.line + space.len() + token.len() > FOLD_AT
        {
            self.new_line();
        }
        self.write(space, token);
    }

    /// `space` then `text` as RFC 2047 encoded words (UTF-8, base64), as many as it takes:
    /// each holds whole characters and is sized to fit the line it goes on. Decoders drop
    /// the spaces between adjacent encoded words, so `text` comes back exactly.
    fn push_encoded(&mut self, space: &str, text: &str) {
        use base64::Engine as _;
        let mut rest = text;
        let mut space = space;
        while let Some(first) = rest.chars().next() {
            let room = |line: usize| {
                (FOLD_AT.saturating_sub(line + space.len() + ENCODED_WORD_FRAME) / 4 * 3)
                    .min(ENCODED_WORD_TEXT)
            };
            let mut max = room(self.line);
            if max < first.len_utf8().max(12) && self.can_break(space) {
                self.new_line();
                max = room(0);
            }
            let mut take = first.len_utf8();
            for (i, c) in rest.char_indices().skip(1) {
                if i + c.len_utf8() > max {
                    break;
                }
                take = i + c.len_utf8();
            }
            let word = format!(
                "=?utf-8?b?{}?=",
                base64::engine::general_purpose::STANDARD.encode(&rest.as_bytes()[..take])
            );
            self.write(space, &word);
            rest = &rest[take..];
            space = " ";
        }
    }
}

/// Unstructured text (RFC 5322 §3.2.5: `Subject`, and how extra headers are treated):
/// folded at its spaces and tabs; runs of words that are not plain ASCII go as encoded
/// words (with the whitespace between them inside, since decoders drop whitespace
/// between encoded words). With `known_unstructured` (the subject, not an extra header,
/// which may be structured), so do words too long for a line and words that a decoder
/// would take for encoded words.
fn unstructured(name: &str, value: &str, known_unstructured: bool) -> String {
    let is_space = |c: char| c == ' ' || c == '\t';
    // (start of the whitespace, start of the word, end of the word), in order.
    let mut words: Vec<(usize, usize, usize)> = Vec::new();
    let mut i = 0;
    while i < value.len() {
        let ws = i;
        i += value[i..].find(|c| !is_space(c)).unwrap_or(value.len() - i);
        let w = i;
        i += value[i..].find(is_space).unwrap_or(value.len() - i);
        words.push((ws, w, i));
    }
    let encode = |w: &str| {
        !w.is_ascii() || (known_unstructured && (w.contains("=?") || w.len() + 1 > FOLD_AT))
    };
    let mut f = Folded::new(name);
    let mut k = 0;
    while k < words.len() {
        let (ws, w, end) = words[k];
        if w < end && encode(&value[w..end]) {
            let mut last = k;
            while let Some(&(_, nw, ne)) = words.get(last + 1) {
                if nw < ne && encode(&value[nw..ne]) {
                    last += 1;
                } else {
                    break;
                }
            }
            f.push_encoded(&value[ws..w], &value[w..words[last].2]);
            k = last + 1;
        } else {
            f.push(&value[ws..w], &value[w..end]);
            k += 1;
        }
    }
    f.out
}

/// `From`, `To`, `Cc` or `Reply-To`: the addresses, folded after their commas and
/// between a display name and its address. A name goes as lettre would write it (an
/// atom, or a quoted string) when that fits a line, else as encoded words; an address is
/// one token (at most 64 + 1 + 255 octets, so always within a line).
fn mailbox_header(name: &'static str, list: &[Mailbox]) -> HeaderValue {
    let mut f = Folded::new(name);
    for (i, m) in list.iter().enumerate() {
        let comma = if i + 1 < list.len() { "," } else { "" };
        let space = if i == 0 { "" } else { " " };
        let display = m.name.as_deref().map(str::trim).filter(|n| !n.is_empty());
        match display {
            None => f.push(space, &format!("{}{comma}", m.email)),
            Some(display) => {
                match phrase(display).filter(|p| p.len() < FOLD_AT) {
                    Some(p) => f.push(space, &p),
                    None => f.push_encoded(space, display),
                }
                f.push(" ", &format!("<{}>{comma}", m.email));
            }
        }
    }
    let raw = list
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    HeaderValue::dangerous_new_pre_encoded(HeaderName::new_from_ascii_str(name), raw, f.out)
}

/// A display name as an atom (letters, digits, `-_.`) or a quoted string, if it is
/// printable ASCII; `None` when it needs encoded words.
fn phrase(name: &str) -> Option<String> {
    if name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Some(name.to_owned());
    }
    if !name
        .bytes()
        .all(|b| (b' '..=b'~').contains(&b) || b == b'\t')
    {
        return None;
    }
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for c in name.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    Some(out)
}

/// The ASCII form of an address's domain for a `Message-ID`: IDNA for an international
/// name, an address literal (`[192.0.2.1]`) as it is.
fn ascii_domain(domain: &str) -> Option<String> {
    if domain.starts_with('[') {
        return domain.is_ascii().then(|| domain.to_owned());
    }
    match url::Host::parse(domain).ok()? {
        url::Host::Domain(d) => Some(d),
        _ => None,
    }
}

/// A name from the payload (not a value), stripped and shortened for an error message.
fn printable(s: &str) -> String {
    s.chars().filter(|c| !c.is_control()).take(64).collect()
}

/// Where in the SMTP dialogue an attempt is; decides what a failure means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Phase {
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
    fn from_u8(v: u8) -> Phase {
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
    fn describe(self) -> &'static str {
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
    fn key(self) -> &'static str {
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
enum Fault {
    /// The relay answered with this negative reply code.
    Reply(u16),
    /// The connection failed, closed, or carried something that is not SMTP.
    Connection,
    /// The attempt's deadline passed.
    Timeout,
}

/// The class of a failure, by phase: the table at the top of this file.
fn classify(phase: Phase, fault: Fault) -> ErrorClass {
    match (phase, fault) {
        (Phase::Session, _) => ErrorClass::Transient,
        (_, Fault::Reply(code)) if code >= 500 => ErrorClass::Permanent,
        (_, Fault::Reply(_)) => ErrorClass::Transient,
        (Phase::EndOfData, Fault::Connection | Fault::Timeout) => ErrorClass::Ambiguous,
        (_, Fault::Connection | Fault::Timeout) => ErrorClass::Transient,
    }
}

/// The attempt's progress, shared with the future that may be cancelled by the deadline.
struct Progress(AtomicU8);

impl Progress {
    fn set(&self, phase: Phase) {
        self.0.store(phase as u8, Ordering::SeqCst);
    }
    fn get(&self) -> Phase {
        Phase::from_u8(self.0.load(Ordering::SeqCst))
    }
}

/// The message content as lettre's `message_iter` consumes it. lettre writes each chunk
/// before asking for the next, so the call that finds the iterator empty comes after the
/// whole content was written: from then on only the end-of-data marker and the reply
/// remain, and a lost connection may mean the relay has the message.
struct Content<'a> {
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

/// The enhanced status code (`5.1.1`) at the start of a reply's text, if any. Only this
/// is kept from a reply's text: the rest often quotes addresses.
fn enhanced_status(text: &str) -> Option<String> {
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
fn code_of(response: &Response) -> u16 {
    u16::from(response.code())
}

/// A lettre error, classed in its phase, with a message safe to store.
fn from_smtp_error(
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
        let mut d = String::new();
        let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&err);
        while let Some(e) = src {
            if !d.is_empty() {
                d.push_str(": ");
            }
            d.push_str(&e.to_string());
            src = e.source();
        }
        if d.is_empty() { err.to_string() } else { d }
    };
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
        source: Some(Box::new(err)),
        ..DeliveryError::new(class, message)
    }
}

/// A negative reply, classed in its phase.
fn reply_error(
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
        message: super::one_line(&message),
        source: Some(Box::new(source)),
    }
}

/// How one attempt's transaction ended, before the connection goes back to the pool.
enum Ended {
    /// Keep the connection: clean, or `dirty` when a transaction was abandoned on it.
    Reusable { dirty: bool },
    /// Close it.
    Broken,
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

impl Inner {
    /// One SMTP transaction, from taking a connection to the reply after the end of DATA.
    /// The caller holds a slot and bounds this with the attempt's deadline.
    async fn transaction(
        &self,
        envelope: &Envelope,
        content: &[u8],
        progress: &Progress,
    ) -> Result<Response, DeliveryError> {
        progress.set(Phase::Session);
        let (mut conn, reused) = match self.checkout().await {
            Some(conn) => (conn, true),
            None => (self.connect().await?, false),
        };

        let Some(from) = envelope.from().cloned() else {
            return Err(DeliveryError::invalid("the message has no sender address"));
        };
        let mut params = Vec::new();
        let needs_utf8 = envelope
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

        // RCPT TO, every recipient. All or none: a refused recipient stops the message.
        progress.set(Phase::Rcpt);
        let total = envelope.to().len();
        let mut refused: Vec<(u16, Option<String>, lettre::transport::smtp::Error)> = Vec::new();
        let mut deferred: Vec<(u16, Option<String>, lettre::transport::smtp::Error)> = Vec::new();
        let mut closing = false;
        for rcpt in envelope.to() {
            match conn.command(Rcpt::new(rcpt.clone(), vec![])).await {
                Ok(_) => {}
                Err(e) => match e.status().map(u16::from) {
                    Some(code) => {
                        let enhanced = std::error::Error::source(&e)
                            .map(|s| s.to_string())
                            .and_then(|t| enhanced_status(&t));
                        closing |= code == 421;
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
        // A 5xx decides (the message can never reach every recipient), so the first
        // refusal is reported before any deferral.
        if let Some((code, enhanced, source)) = refused.into_iter().chain(deferred).next() {
            let (n, verb) = if n_refused > 0 {
                (n_refused, "refused")
            } else {
                (n_deferred, "deferred")
            };
            let what = format!(
                "{n} of {total} recipients {verb}; no DATA sent (a message goes to all its recipients or to none)"
            );
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

    /// A new connection, secured and authenticated as configured.
    async fn connect(&self) -> Result<AsyncSmtpConnection, DeliveryError> {
        let session = |e| from_smtp_error(Phase::Session, &self.relay, e);
        let implicit = match self.tls {
            SmtpTls::Implicit => self.tls_params.clone(),
            _ => None,
        };
        let mut conn = AsyncSmtpConnection::connect_tokio1(
            (self.host.as_str(), self.port),
            Some(self.timeout),
            &self.hello,
            implicit,
            None,
        )
        .await
        .map_err(session)?;
        if self.tls == SmtpTls::StartTls {
            let Some(params) = self.tls_params.clone() else {
                return Err(DeliveryError::new(
                    ErrorClass::Transient,
                    "STARTTLS is configured but TLS is not set up",
                ));
            };
            if !conn.can_starttls() {
                // Refuse to go on in plain text: the URL asked for TLS.
                conn.abort().await;
                return Err(DeliveryError::new(
                    ErrorClass::Transient,
                    format!(
                        "{} does not offer STARTTLS, which OUTBOXD_SMTP_URL requires (use ?tls=none only for a relay on a trusted network)",
                        self.relay
                    ),
                ));
            }
            conn.starttls(params, &self.hello).await.map_err(session)?;
        }
        if let Some(credentials) = &self.credentials {
            conn.auth(&[Mechanism::Plain, Mechanism::Login], credentials)
                .await
                .map_err(session)?;
        }
        Ok(conn)
    }

    /// An idle connection, if one is fresh enough; one left dirty is reset first.
    async fn checkout(&self) -> Option<AsyncSmtpConnection> {
        loop {
            let idle = lock(&self.idle).pop()?;
            if idle.since.elapsed() > IDLE_TIMEOUT || idle.conn.has_broken() {
                continue;
            }
            let mut conn = idle.conn;
            if idle.dirty && conn.command(Rset).await.is_err() {
                continue;
            }
            return Some(conn);
        }
    }

    /// Returns a connection to the pool, or closes it.
    fn checkin(&self, conn: AsyncSmtpConnection, ended: Ended) {
        let Ended::Reusable { dirty } = ended else {
            return;
        };
        if conn.has_broken() {
            return;
        }
        let mut idle = lock(&self.idle);
        if idle.len() < self.max_connections {
            idle.push(IdleConnection {
                conn,
                since: Instant::now(),
                dirty,
            });
        }
    }
}

/// Whether a failed command shows a connection that is no longer usable: no reply at all,
/// or 421 (the relay is closing it).
fn is_dead_connection(e: &lettre::transport::smtp::Error) -> bool {
    match e.status() {
        Some(code) => u16::from(code) == 421,
        None => true,
    }
}

/// What a failed command leaves of the connection: a negative reply leaves it usable
/// (after RSET), anything else or a 421 does not.
fn after_reply_error(e: &lettre::transport::smtp::Error) -> Ended {
    if is_dead_connection(e) {
        Ended::Broken
    } else {
        Ended::Reusable { dirty: true }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Our name in EHLO: the host name, else `localhost`.
fn hello_name() -> ClientId {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        })
        .unwrap_or_else(|| "localhost".to_owned());
    ClientId::Domain(host)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn bodies_get_crlf_line_breaks_only() {
        assert_eq!(
            crlf_line_breaks("a\rb\nc\r\nd\r\r\ne\n\rf\r"),
            "a\r\nb\r\nc\r\nd\r\n\r\ne\r\n\r\nf\r\n"
        );
        assert_eq!(crlf_line_breaks("Grüße\r.\r"), "Grüße\r\n.\r\n");
        // Built, the part carries the normalised text as 7bit, and a line that would be
        // too long, or 8-bit text, goes quoted-printable or base64 in lines of 76.
        let email = parse(
            serde_json::json!({"from": "a@b.example", "to": "c@d.example",
            "text": "x\r.\r\nMAIL FROM:<e@f.example>", "html": format!("{}\r€", "y".repeat(2000))}),
        )
        .expect("valid");
        let wire = email.message.formatted();
        let text = String::from_utf8(wire.clone()).expect("ASCII");
        assert!(
            text.contains("7bit\r\n\r\nx\r\n.\r\nMAIL FROM:<e@f.example>\r\n"),
            "{text}"
        );
        for (i, &b) in wire.iter().enumerate() {
            assert!(
                b != b'\r' || wire.get(i + 1) == Some(&b'\n'),
                "lone CR at {i}"
            );
            assert!(
                b != b'\n' || (i > 0 && wire[i - 1] == b'\r'),
                "lone LF at {i}"
            );
        }
        assert!(text.split("\r\n").all(|l| l.len() <= 78), "{text}");
    }

    /// The header section of a built message, as lines.
    fn header_lines(email: &Email) -> Vec<String> {
        let text = String::from_utf8(email.message.formatted()).expect("ASCII");
        let head = text.split("\r\n\r\n").next().expect("a header section");
        head.split("\r\n").map(str::to_owned).collect()
    }

    /// A header's value with the folds taken out.
    fn unfolded(lines: &[String], name: &str) -> String {
        let start = lines
            .iter()
            .position(|l| l.starts_with(&format!("{name}: ")))
            .expect(name);
        let mut v = lines[start][name.len() + 2..].to_owned();
        for l in lines[start + 1..].iter().take_while(|l| l.starts_with(' ')) {
            v.push_str(l);
        }
        v
    }

    #[test]
    fn every_header_line_is_folded_within_78_octets() {
        let to: Vec<String> = (0..5000).map(|i| format!("user{i}@example.com")).collect();
        let email = parse(serde_json::json!({
            "from": format!("\"{}\" <shop@shop.example>", "Shop ".repeat(40).trim_end()),
            "to": to,
            "cc": ["Jörg Müller <j@example.com>", format!("{} <n@example.com>", "n".repeat(300))],
            "reply_to": format!("{} <help@shop.example>", "Grüße".repeat(100)),
            "subject": "x".repeat(5000),
            "text": "t",
            "headers": {"X-Long": "word ".repeat(1000).trim_end(), "X-Umlaut": "ä".repeat(500)}
        }))
        .expect("valid");
        let lines = header_lines(&email);
        for l in &lines {
            assert!(l.len() <= 78, "{} octets: {l:?}", l.len());
            assert!(!l.trim().is_empty(), "a line of whitespace only");
        }
        // Unfolded, the plain parts are what the payload said.
        let to_value = unfolded(&lines, "To");
        assert_eq!(to_value, to.join(", "));
        assert_eq!(unfolded(&lines, "X-Long"), "word ".repeat(1000).trim_end());
        // The subject is one word: encoded words of at most 75 characters hold it.
        let subject = unfolded(&lines, "Subject");
        for word in subject.split(' ') {
            assert!(
                word.starts_with("=?utf-8?b?") && word.ends_with("?="),
                "{word}"
            );
            assert!(word.len() <= 75, "{word}");
        }
    }

    #[test]
    fn a_word_too_long_for_any_header_line_is_refused_in_extra_headers() {
        let url = format!("<https://shop.example/u?t={}>", "t".repeat(990));
        let err = parse(
            serde_json::json!({"from": "a@b.example", "to": "c@d.example", "text": "t",
            "headers": {"List-Unsubscribe": url}}),
        )
        .expect_err("too long");
        assert_eq!(err.class, ErrorClass::Invalid);
        assert!(
            err.message
                .contains("payload.headers.List-Unsubscribe has a word too long"),
            "{}",
            err.message
        );
        assert!(!err.message.contains("ttt"), "{}", err.message);
        // Up to 998 octets it goes whole, on a line of its own.
        let url = format!("<https://shop.example/u?t={}>", "t".repeat(900));
        let email = parse(
            serde_json::json!({"from": "a@b.example", "to": "c@d.example", "text": "t",
            "headers": {"List-Unsubscribe": url}}),
        )
        .expect("fits");
        let lines = header_lines(&email);
        assert!(
            lines.contains(&format!("List-Unsubscribe: {url}")),
            "{lines:?}"
        );
    }

    #[test]
    fn classification_table() {
        use ErrorClass::*;
        use Fault::*;
        let table = [
            (Phase::Session, Reply(421), Transient),
            (Phase::Session, Reply(535), Transient),
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
