//! Stored text made safe to print: the one place that decides how a message key, an error
//! or a payload reaches a terminal or a log line.
//!
//! A message key is chosen by an application, and rows written before enqueue refused
//! control characters may hold them: printed raw, a key with a newline and a fake log line
//! forges a line of the daemon's log, and `ESC ]0;…BEL` or a right-to-left override moves
//! or retitles the operator's terminal. [`escape`] renders every character that acts on a
//! terminal instead of being shown as a visible escape, so one stored value always prints
//! as one line of inert text. JSON output needs none of this: its encoder escapes.

use std::borrow::Cow;
use std::fmt;

/// Does `c` act on a terminal or a line-oriented reader instead of being shown?
///
/// C0 controls (newline, carriage return, tab and ESC included), DEL, C1 controls
/// (U+0080–U+009F: `U+009B` is a one-character CSI on some terminals), the line and paragraph
/// separators (U+2028, U+2029), and the bidirectional formatting characters (U+061C,
/// U+200E, U+200F, U+202A–U+202E, U+2066–U+2069), which reorder what is displayed after them.
pub fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}'
                | '\u{2029}'
                | '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// Does `s` hold an [unsafe](is_unsafe) character? Printable ASCII (what keys, hosts and
/// the daemon's own messages are made of) is checked a byte at a time; only text with
/// other bytes is decoded. Every field of every log line passes here.
pub fn has_unsafe(s: &str) -> bool {
    !s.bytes().all(|b| (0x20..0x7f).contains(&b)) && s.chars().any(is_unsafe)
}

/// Writes the visible form of one unsafe character: `\n`, `\r`, `\t`, else `\u{hex}`
/// (Rust's escape syntax, e.g. `\u{1b}` for ESC).
fn write_escape(out: &mut impl fmt::Write, c: char) -> fmt::Result {
    match c {
        '\n' => out.write_str("\\n"),
        '\r' => out.write_str("\\r"),
        '\t' => out.write_str("\\t"),
        c => write!(out, "\\u{{{:x}}}", c as u32),
    }
}

/// `s` with every [unsafe](is_unsafe) character written as a visible escape; borrowed
/// when there is none (the usual case). Other text, a backslash included, is unchanged, so
/// an ordinary key prints exactly as it is stored.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !has_unsafe(s) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(Escaped(s).to_string())
}

/// [`escape`] cut to at most `max` characters, never in the middle of an escape.
pub fn escape_truncated(s: &str, max: usize) -> String {
    let mut out = String::new();
    let mut len = 0;
    let mut piece = String::new();
    for c in s.chars() {
        piece.clear();
        if is_unsafe(c) {
            let _ = write_escape(&mut piece, c);
        } else {
            piece.push(c);
        }
        let n = piece.chars().count();
        if len + n > max {
            break;
        }
        len += n;
        out.push_str(&piece);
    }
    out
}

/// A name from untrusted input (a header or field name, never a value) for an error
/// message: control characters dropped rather than escaped, cut to `max` characters. The
/// message then goes through [`escape`] where it is stored or printed, like any other.
pub fn stripped(s: &str, max: usize) -> String {
    s.chars().filter(|c| !c.is_control()).take(max).collect()
}

/// Displays a string as [`escape`] renders it, without allocating: for log fields
/// (`key = %Escaped(&key)`) and `format!` arguments.
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !has_unsafe(self.0) {
            return f.write_str(self.0);
        }
        let mut rest = self.0;
        while let Some(i) = rest.find(is_unsafe) {
            f.write_str(&rest[..i])?;
            let c = rest[i..].chars().next().unwrap_or_default();
            write_escape(f, c)?;
            rest = &rest[i + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_characters_become_visible_escapes() {
        let cases = [
            ("order-42:paid", "order-42:paid"),
            ("a\nb", r"a\nb"),
            ("a\r\nb\tc", r"a\r\nb\tc"),
            ("\x1b]0;pwned\x07", r"\u{1b}]0;pwned\u{7}"),
            ("\x00\x7f", r"\u{0}\u{7f}"),
            ("\u{85}\u{9b}31m", r"\u{85}\u{9b}31m"),
            ("abc\u{202e}fed", r"abc\u{202e}fed"),
            (
                "\u{2066}x\u{2069}\u{200f}\u{61c}",
                r"\u{2066}x\u{2069}\u{200f}\u{61c}",
            ),
            ("line\u{2028}sep", r"line\u{2028}sep"),
            // Printable text is untouched, backslashes and non-ASCII letters included.
            (r"C:\path é ü 日本", r"C:\path é ü 日本"),
        ];
        for (raw, shown) in cases {
            assert_eq!(escape(raw), shown, "{raw:?}");
            assert_eq!(Escaped(raw).to_string(), shown, "{raw:?}");
            assert!(!escape(raw).chars().any(is_unsafe), "{raw:?}");
        }
        assert!(matches!(escape("plain"), Cow::Borrowed("plain")));
    }

    #[test]
    fn truncation_keeps_escapes_whole() {
        assert_eq!(escape_truncated("abc", 2), "ab");
        assert_eq!(escape_truncated("a\x1bb", 4), "a");
        assert_eq!(escape_truncated("a\x1bb", 7), r"a\u{1b}");
        assert_eq!(escape_truncated("a\nb", 10), r"a\nb");
    }

    #[test]
    fn stripped_drops_controls_and_cuts() {
        assert_eq!(stripped("X-\r\nA\x1b", 64), "X-A");
        assert_eq!(stripped(&"é".repeat(70), 64), "é".repeat(64));
    }
}
