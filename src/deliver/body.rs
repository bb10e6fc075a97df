//! Response bodies: drained and dropped (every attempt), or kept for `store_response`.
//!
//! Either way the read is bounded twice: by size (at most [`MAX_BODY`] bytes are kept, and
//! reading stops one byte past it) and by time (the request's timeout covers the body, so a
//! receiver that never ends it costs the attempt's timeout, not more).

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::header::CONTENT_TYPE;
use serde_json::Value;
use tokio::time::Instant;

use super::client::Response;

/// Most bytes of a response body read: drained to keep the connection reusable, or kept
/// for `store_response` (the contract's 64 KiB).
pub const MAX_BODY: usize = 64 * 1024;

/// Most characters of a stored `content_type`: a media type with its parameters fits in
/// far fewer; a longer header is cut rather than stored whole.
const MAX_CONTENT_TYPE: usize = 255;

/// The next piece of the body before `deadline`: `Ok(None)` at its end, `Err` when it
/// failed or the deadline passed (trailers are skipped).
async fn chunk(response: &mut Response, deadline: Instant) -> Result<Option<Bytes>, ()> {
    loop {
        match tokio::time::timeout_at(deadline, response.body_mut().frame()).await {
            Err(_) | Ok(Some(Err(_))) => return Err(()),
            Ok(None) => return Ok(None),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    return Ok(Some(data));
                }
            }
        }
    }
}

/// Reads (and drops) up to [`MAX_BODY`] bytes so the connection can be reused. A failure
/// here does not change the outcome: the status line has answered.
pub(in crate::deliver) async fn drain(response: &mut Response, deadline: Instant) {
    let mut read = 0usize;
    while read < MAX_BODY {
        match chunk(response, deadline).await {
            Ok(Some(chunk)) => read += chunk.len(),
            Ok(None) | Err(()) => break,
        }
    }
}

/// Reads the body for `store_response` and adds `body`, `body_truncated` and
/// `content_type` to `summary` (an object).
///
/// Memory: at most [`MAX_BODY`] + 1 bytes are copied; past that the rest of the body is
/// never read (the response is dropped, and its connection with it).
///
/// A body that fails or never ends (the request's timeout fires while it is read) leaves
/// the outcome as it is: the status line was 2xx, so the provider accepted the request and
/// the message is delivered; sending it again because the receipt was cut would make a
/// duplicate. What arrived is kept, as text, with `body_truncated = true`.
pub(in crate::deliver) async fn keep(
    response: &mut Response,
    summary: &mut Value,
    deadline: Instant,
) {
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .map(|v| crate::text::stripped(&String::from_utf8_lossy(v.as_bytes()), MAX_CONTENT_TYPE));
    let mut buf: Vec<u8> = Vec::new();
    let mut complete = true;
    loop {
        match chunk(response, deadline).await {
            Ok(Some(chunk)) => {
                let room = MAX_BODY + 1 - buf.len();
                buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if buf.len() > MAX_BODY {
                    complete = false;
                    break;
                }
            }
            Ok(None) => break,
            Err(()) => {
                complete = false;
                break;
            }
        }
    }
    let (body, truncated) = stored(&buf, complete);
    if let Value::Object(map) = summary {
        map.insert("body".to_owned(), body);
        map.insert("body_truncated".to_owned(), Value::Bool(truncated));
        map.insert(
            "content_type".to_owned(),
            content_type.map_or(Value::Null, Value::String),
        );
    }
}

/// The stored form of a body: the JSON value when the whole body is JSON, else the text
/// (at most [`MAX_BODY`] bytes of it, cut on a character boundary). The flag is true when
/// the body was longer or did not end (`complete` false): then it is always text, since a
/// prefix of a JSON document is not the document.
///
/// PostgreSQL's `jsonb` cannot hold the character U+0000: a JSON body with one (escaped as
/// `\u0000`) is kept as text, and in text it is replaced by U+FFFD, as bytes that are not
/// UTF-8 are. (Without that, the completion statement holding it would fail, again and
/// again, for every attempt written with it.)
///
/// A JSON body nested more than [`MAX_DEPTH`] levels is kept as text too: the readers of
/// `response` (tokio-postgres reads `jsonb` with serde_json, which stops at 128 levels)
/// could not take it back, and `lookup` of the key would fail for good.
///
/// So is a JSON body with a number serde_json cannot hold exactly (an integer beyond 64
/// bits, a decimal of more digits than a double keeps): as a value it would be stored
/// rounded (a tracking number `9400111899223856925311` as `9400111899223857000000`), which
/// is not what the provider answered; as text it is kept whole.
pub fn stored(bytes: &[u8], complete: bool) -> (Value, bool) {
    let fits = bytes.len() <= MAX_BODY;
    if complete && fits {
        if let Ok(v) = serde_json::from_slice::<Value>(bytes) {
            if !has_nul(&v) && depth(&v) <= MAX_DEPTH && numbers_exact(bytes) {
                return (v, false);
            }
        }
    }
    let whole = complete && fits;
    let (text, cut_short) = text(&bytes[..bytes.len().min(MAX_BODY)], whole);
    (Value::String(text), cut_short || !whole)
}

/// Does every number of the JSON text `json` keep its value when serde_json reads it?
/// `json` is known to be JSON (serde_json read it): a number is a run of `-+.eE` and
/// digits outside a string.
fn numbers_exact(json: &[u8]) -> bool {
    let mut i = 0;
    let mut in_string = false;
    while i < json.len() {
        let b = json[i];
        if in_string {
            match b {
                b'\\' => i += 1,
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < json.len()
                    && matches!(json[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                if !number_exact(&json[start..i]) {
                    return false;
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    true
}

/// Is the number `token` (JSON text) the same value once read by serde_json (as an
/// integer of 64 bits, or as a double, written back as the shortest text that reads back
/// the same)?
fn number_exact(token: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(token) else {
        return false;
    };
    let Ok(read) = serde_json::from_str::<serde_json::Number>(text) else {
        return false;
    };
    decimal(text) == decimal(&read.to_string())
}

/// A decimal number as its sign, its significant digits and its exponent: `-1.50e3` is
/// `(true, "15", 2)`, and every zero is `(false, "", 0)`. `None` for an exponent beyond
/// 64 bits.
fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all = format!("{int}{frac}");
    let digits = all.trim_start_matches('0').trim_end_matches('0');
    if digits.is_empty() {
        return Some((false, String::new(), 0));
    }
    let trailing = all.len() - all.trim_end_matches('0').len();
    let exponent = exponent
        .checked_sub(i64::try_from(frac.len()).ok()?)?
        .checked_add(i64::try_from(trailing).ok()?)?;
    Some((negative, digits.to_owned(), exponent))
}

/// The deepest nesting a stored JSON body keeps as a value: far more than any API's
/// response, and far from the 128 levels serde_json reads back (`response` adds one).
pub const MAX_DEPTH: usize = 64;

/// How deeply `v` nests: 0 for a scalar, 1 for a flat array or object.
fn depth(v: &Value) -> usize {
    match v {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => 0,
    }
}

/// Does any string or key of `v` hold U+0000?
fn has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

/// `bytes` as text of at most [`MAX_BODY`] bytes: a character cut at the end of a body
/// that was cut (not `whole`) is dropped, bytes that are not UTF-8 and U+0000 become
/// U+FFFD. True when the text had to be cut to fit (a replacement character takes three
/// bytes for the one it replaces).
fn text(bytes: &[u8], whole: bool) -> (String, bool) {
    let decoded = match std::str::from_utf8(bytes) {
        Ok(s) => s.to_owned(),
        // An incomplete character at the very end, where the cut fell: drop it. (At the
        // end of a whole body it is the provider's, and shown as U+FFFD below.)
        Err(e) if e.error_len().is_none() && !whole => {
            String::from_utf8_lossy(&bytes[..e.valid_up_to()]).into_owned()
        }
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    };
    let mut out = decoded.replace('\0', "\u{FFFD}");
    // A replacement character is longer than the byte it replaces: cut again, on a
    // character boundary.
    if out.len() > MAX_BODY {
        let mut end = MAX_BODY;
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
        return (out, true);
    }
    (out, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_bodies_are_values_and_others_text() {
        assert_eq!(
            stored(br#"{"id": "ch_1", "amount": 1250}"#, true),
            (json!({"id": "ch_1", "amount": 1250}), false)
        );
        assert_eq!(stored(b"[1, 2]", true), (json!([1, 2]), false));
        assert_eq!(stored(b"\"ok\"", true), (json!("ok"), false));
        assert_eq!(stored(b"accepted", true), (json!("accepted"), false));
        assert_eq!(stored(b"", true), (json!(""), false));
        assert_eq!(stored(b"{\"a\": ", true), (json!("{\"a\": "), false));
    }

    /// A number serde_json would round is not stored rounded: the body is kept as its
    /// text. Numbers it holds exactly keep the body a value.
    #[test]
    fn json_with_numbers_a_double_cannot_hold_is_kept_as_text() {
        for body in [
            "9400111899223856925311",
            r#"{"tracking": 9400111899223856925311}"#,
            "[1, -18446744073709551616]",
            "0.1000000000000000055511151231257827",
            "123456789012345678.5",
            "1e-99999999999999999999",
        ] {
            assert_eq!(
                stored(body.as_bytes(), true),
                (json!(body), false),
                "{body}"
            );
        }
        for (body, value) in [
            ("18446744073709551615", json!(18446744073709551615u64)),
            ("-9223372036854775808", json!(-9223372036854775808i64)),
            (
                r#"{"amount": 12.50, "rate": 1e-7, "z": -0.0}"#,
                json!({"amount": 12.5, "rate": 1e-7, "z": -0.0}),
            ),
            ("[0, 1.10, 2E+3, 0.1]", json!([0, 1.1, 2000.0, 0.1])),
            // Read one step off its text without serde_json's float_roundtrip, and then
            // kept as text: an everyday double must stay a value.
            (
                r#"{"score": 0.9788705789462011, "x": -908026.2059720843}"#,
                json!({"score": 0.9788705789462011, "x": -908026.2059720843}),
            ),
            (r#""-1.5e300 in a string""#, json!("-1.5e300 in a string")),
            (r#"{"k\"1": 5}"#, json!({"k\"1": 5})),
        ] {
            assert_eq!(stored(body.as_bytes(), true), (value, false), "{body}");
        }
    }

    #[test]
    fn json_nested_past_the_limit_is_kept_as_text() {
        let nested = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let (v, t) = stored(nested(MAX_DEPTH).as_bytes(), true);
        assert!(v.is_array() && !t, "{MAX_DEPTH} levels are a value");
        let (v, t) = stored(
            format!("{{\"a\": {}}}", nested(MAX_DEPTH - 1)).as_bytes(),
            true,
        );
        assert!(v.is_object() && !t, "objects count as levels too");
        let deeper = nested(MAX_DEPTH + 1);
        assert_eq!(stored(deeper.as_bytes(), true), (json!(deeper), false));
        let deeper = format!("{{\"a\": {}}}", nested(MAX_DEPTH));
        assert_eq!(stored(deeper.as_bytes(), true), (json!(deeper), false));
    }

    #[test]
    fn nul_never_reaches_jsonb() {
        let (v, t) = stored(br#"{"a": "x\u0000y"}"#, true);
        assert_eq!(v, json!(r#"{"a": "x\u0000y"}"#), "kept as its text");
        assert!(!t);
        let (v, _) = stored(b"a\0b", true);
        assert_eq!(v, json!("a\u{FFFD}b"));
        let (v, _) = stored(br#"{"k\u0000": 1}"#, true);
        assert!(v.is_string());
    }

    #[test]
    fn not_utf8_is_replaced() {
        let (v, t) = stored(b"ok \xff\xfe end", true);
        assert_eq!(v, json!("ok \u{FFFD}\u{FFFD} end"));
        assert!(!t);
    }

    #[test]
    fn long_or_unfinished_bodies_are_cut_text() {
        let mut big = vec![b'a'; MAX_BODY + 1];
        let (v, t) = stored(&big, false);
        assert!(t);
        assert_eq!(v.as_str().map(str::len), Some(MAX_BODY));
        // A JSON document one byte too long is still text: its prefix is not JSON.
        big = format!("\"{}\"", "b".repeat(MAX_BODY - 1)).into_bytes();
        assert_eq!(big.len(), MAX_BODY + 1);
        let (v, t) = stored(&big, false);
        assert!(t && v.is_string());
        // A cut through a multi-byte character drops the partial character.
        let mut euro = vec![b'x'; MAX_BODY - 1];
        euro.extend_from_slice("€€".as_bytes());
        let (v, t) = stored(&euro, false);
        assert!(t);
        let s = v.as_str().unwrap_or_default();
        assert_eq!(s.len(), MAX_BODY - 1);
        assert!(s.chars().all(|c| c == 'x'));
        // A body that did not end is text even when what arrived parses.
        assert_eq!(stored(b"123", false), (json!("123"), true));
    }

    #[test]
    fn replacements_never_grow_past_the_limit() {
        let bad = vec![0xffu8; MAX_BODY];
        let (v, truncated) = stored(&bad, true);
        let s = v.as_str().unwrap_or_default();
        assert!(s.len() <= MAX_BODY, "{}", s.len());
        assert!(s.chars().all(|c| c == '\u{FFFD}'));
        // The whole body arrived, but its text had to be cut: that is said (it was not).
        assert!(truncated);
        assert_eq!(
            stored(&[0xff; 10], true),
            (json!("\u{FFFD}".repeat(10)), false)
        );
        // A whole body that ends inside a character: nothing was cut, the bad byte shows.
        assert_eq!(stored(b"caf\xc3", true), (json!("caf\u{FFFD}"), false));
    }
}
