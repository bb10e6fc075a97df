//! An e-mail payload as an operator may see it (`outboxd show`, the console): no address,
//! subject or body, only their sizes.

use serde_json::{Map, Value};

/// Redacts an e-mail payload's members in place: every header value is `[redacted]` (the
/// names are kept); each address field becomes a count (`[redacted: 2 addresses]`) and each
/// text a length (`[redacted: 42 characters]`); anything else is `[redacted]`.
pub fn redact(fields: &mut Map<String, Value>) {
    for (name, value) in fields.iter_mut() {
        *value = match (name.as_str(), value.take()) {
            ("headers", v) => crate::deliver::redact_headers(v),
            (_, Value::Null) => Value::Null,
            ("from" | "to" | "cc" | "bcc" | "reply_to", v) => {
                let n = match &v {
                    Value::Array(a) => a.len(),
                    _ => 1,
                };
                Value::String(format!(
                    "[redacted: {n} address{}]",
                    if n == 1 { "" } else { "es" }
                ))
            }
            (_, Value::String(text)) => {
                let n = text.chars().count();
                Value::String(format!(
                    "[redacted: {n} character{}]",
                    if n == 1 { "" } else { "s" }
                ))
            }
            (_, _) => Value::String("[redacted]".into()),
        };
    }
}
