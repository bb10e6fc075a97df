//! The configuration parsers on arbitrary UTF-8: `parse_duration` (and its round trip
//! through `format_duration`), `parse_webhook_secret` (and its round trip through base64),
//! `parse_bool` and the destination policy. None may panic.

#![no_main]

use base64::Engine as _;
use libfuzzer_sys::fuzz_target;
use outboxd::config::{format_duration, parse_duration};
use outboxd::deliver::webhook::settings::{DestinationPolicy, parse_bool, parse_webhook_secret};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(d) = parse_duration(text) {
        assert_eq!(parse_duration(&format_duration(d)), Ok(d), "{text:?}");
    }
    if let Ok(key) = parse_webhook_secret(text) {
        assert!(!key.is_empty());
        let again = format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode(&key)
        );
        assert_eq!(parse_webhook_secret(&again).ok(), Some(key));
    }
    let _ = parse_bool("X", text);
    let _ = DestinationPolicy::from_values(Some(text), Some(text));
    let _ = DestinationPolicy::from_values(None, Some(text));
});
