//! `parse_payload` on arbitrary UTF-8: it must never panic, and what it accepts must be
//! safe to send (http/https with a host, POST/PUT/PATCH, no control bytes in headers, the
//! body a slice of the input); what it refuses is `invalid` with a one-line message.

#![no_main]

use libfuzzer_sys::fuzz_target;
use outboxd::deliver::webhook::payload::parse_payload;
use outboxd::model::ErrorClass;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse_payload(text) {
        Ok(req) => {
            assert!(
                matches!(req.url.scheme(), "http" | "https"),
                "{}",
                req.url.scheme()
            );
            assert!(req.url.host().is_some());
            assert!(matches!(req.method.as_str(), "POST" | "PUT" | "PATCH"));
            for (name, value) in &req.headers {
                assert!(!name.as_str().is_empty());
                for &b in value.as_bytes() {
                    assert!(
                        (b >= 0x20 && b != 0x7f) || b == b'\t',
                        "control byte {b:#x}"
                    );
                }
            }
            // The body is sent exactly as the payload text had it.
            let body = std::str::from_utf8(&req.body).expect("the body is UTF-8");
            assert!(body == "null" || text.contains(body));
        }
        Err(e) => {
            assert_eq!(e.class, ErrorClass::Invalid);
            assert!(!e.message.is_empty());
            assert!(!e.message.contains(['\n', '\r']));
            assert!(e.message.chars().count() <= 500);
        }
    }
});
