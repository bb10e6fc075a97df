//! An http payload as `show` and the console may see it: the endpoint, the method and the
//! flags kept; of the path, the query, the body and the headers only their names (a path
//! and a query carry ids and search terms, header values carry credentials, bodies carry
//! everything).

use serde_json::{Map, Value};

const REDACTED: &str = "[redacted]";

/// Redacts the members of an http payload in place.
pub fn redact(fields: &mut Map<String, Value>) {
    for (name, value) in fields.iter_mut() {
        match name.as_str() {
            "endpoint" | "method" | "store_response" => {
                if !matches!(value, Value::String(_) | Value::Bool(_) | Value::Null) {
                    *value = Value::String(REDACTED.into());
                }
            }
            "path" => *value = path(value),
            "query" | "form" | "headers" => *value = names(value),
            "json" => *value = Value::String(REDACTED.into()),
            "reconcile" => {
                if let Value::Object(r) = value {
                    for (k, v) in r.iter_mut() {
                        match k.as_str() {
                            "method" | "found" if v.is_string() => {}
                            "path" => *v = path(v),
                            "query" => *v = names(v),
                            _ => *v = Value::String(REDACTED.into()),
                        }
                    }
                } else if !value.is_null() {
                    *value = Value::String(REDACTED.into());
                }
            }
            _ => *value = Value::String(REDACTED.into()),
        }
    }
}

/// A path as shown: whether there is one (its segments are ids and names).
fn path(v: &Value) -> Value {
    match v {
        Value::Null => Value::Null,
        _ => Value::String(REDACTED.into()),
    }
}

/// An object's members, each value redacted (names kept, one level).
fn names(v: &Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.keys()
                .map(|k| (k.clone(), Value::String(REDACTED.into())))
                .collect(),
        ),
        Value::Null => Value::Null,
        _ => Value::String(REDACTED.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_names_never_values() {
        let mut p = serde_json::json!({"endpoint": "stripe", "method": "POST",
            "path": "/v1/customers/cus_SECRET", "query": {"expand": "SECRET"},
            "form": {"amount": "SECRET", "metadata": {"k": "SECRET"}},
            "headers": {"Stripe-Account": "SECRET"}, "store_response": true,
            "reconcile": {"path": "/v1/charges/search", "query": {"query": "SECRET"}, "found": "/data/0"},
            "other": "SECRET"});
        redact(p.as_object_mut().expect("an object"));
        let shown = p.to_string();
        assert!(!shown.contains("SECRET"), "{shown}");
        assert_eq!(p["endpoint"], "stripe");
        assert_eq!(p["path"], "[redacted]");
        assert_eq!(p["form"]["metadata"], "[redacted]");
        assert_eq!(p["headers"]["Stripe-Account"], "[redacted]");
        assert_eq!(p["reconcile"]["found"], "/data/0");
        let mut j =
            serde_json::json!({"endpoint": "e", "path": "/SECRET", "json": {"a": "SECRET"}});
        redact(j.as_object_mut().expect("an object"));
        assert!(!j.to_string().contains("SECRET"), "{j}");
    }
}
