//! Header and body building beside lettre: CRLF line breaks only in bodies, header lines
//! folded within 78 octets (encoded words where the text needs them), mailbox lists and
//! display-name phrases.

use lettre::message::Mailbox;
use lettre::message::header::{HeaderName, HeaderValue};

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
pub(super) fn crlf_line_breaks(body: &str) -> String {
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

/// Header lines end here where the content allows (RFC 5322 §2.1.1: SHOULD be at most 78
/// characters) ...
pub(super) const FOLD_AT: usize = 78;

/// ... and never pass this (MUST: 998, the CRLF excluded).
pub(super) const MAX_LINE: usize = 998;

/// Most octets of text in one encoded word: `=?utf-8?b?` + 60 base64 characters + `?=`
/// is 72, within RFC 2047's 75.
pub(super) const ENCODED_WORD_TEXT: usize = 45;

/// The longest run of whitespace written as it is in a subject; a longer one goes in
/// encoded words (see [`unstructured`]).
pub(super) const LONG_WHITESPACE: usize = FOLD_AT / 2;

/// An encoded word's characters besides its base64.
pub(super) const ENCODED_WORD_FRAME: usize = "=?utf-8?b?".len() + "?=".len();

/// A header value being written and folded: tokens that stay whole, and the whitespace
/// between them, where a line may break. The break (CRLF) goes before the whitespace, so
/// unfolding (removing the CRLFs) gives back exactly what was written.
pub(super) struct Folded {
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
pub(super) fn unstructured(name: &str, value: &str, known_unstructured: bool) -> String {
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
    // A line breaks before whitespace, never inside it, so a run of whitespace longer
    // than a line (`"a" + 1 500 spaces + "b"`) made a line past the 998 octets RFC 5322
    // allows, which relays refuse. In the subject such a run goes into encoded words,
    // which hold it exactly and fold like any text.
    let long_run = |ws: usize, w: usize| known_unstructured && w - ws > LONG_WHITESPACE;
    let mut f = Folded::new(name);
    let mut k = 0;
    while k < words.len() {
        let (ws, w, end) = words[k];
        let run = long_run(ws, w);
        if run || (w < end && encode(&value[w..end])) {
            let mut last = k;
            while let Some(&(nws, nw, ne)) = words.get(last + 1) {
                if long_run(nws, nw) || (nw < ne && encode(&value[nw..ne])) {
                    last += 1;
                } else {
                    break;
                }
            }
            // The whitespace before encoded words stays outside them (it is where the
            // line may break, and a decoder keeps it); a long run keeps one character
            // there and the rest goes inside. Whitespace (space or tab) is one octet.
            let (space, from) = match (run, f.started) {
                (false, _) => (&value[ws..w], w),
                (true, true) => (&value[ws..ws + 1], ws + 1),
                (true, false) => ("", ws),
            };
            f.push_encoded(space, &value[from..words[last].2]);
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
pub(super) fn mailbox_header(name: &'static str, list: &[Mailbox]) -> HeaderValue {
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
pub(super) fn phrase(name: &str) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deliver::DeliveryError;
    use crate::deliver::email::payload::{Email, parse_payload};
    use crate::model::ErrorClass;

    fn parse(payload: serde_json::Value) -> Result<Email, DeliveryError> {
        parse_payload(&payload.to_string(), "order-42:paid:mail", None)
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

    /// A subject's whitespace runs longer than a line are folded too: before, a line broke
    /// only before a run, never inside it, and `"a" + 1 500 spaces + "b"` made a line of
    /// 1 501 octets.
    #[test]
    fn long_whitespace_in_a_subject_is_folded_too() {
        for subject in [
            format!("a{}b", " ".repeat(1500)),
            format!("{}lead", " ".repeat(1200)),
            format!("trail{}", "\t".repeat(1100)),
            " ".repeat(2000),
            format!("Grüße{}aus Köln{}✓ x", " ".repeat(300), "\t ".repeat(200)),
        ] {
            let email = parse(serde_json::json!({
                "from": "a@b.example", "to": "c@d.example", "text": "t", "subject": subject
            }))
            .expect("valid");
            for l in header_lines(&email) {
                assert!(l.len() <= 78, "{} octets: {l:?}", l.len());
            }
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
}
