//! The Standard Webhooks signature (`webhook-signature: v1,<base64 HMAC-SHA256>`), over
//! `id.timestamp.body`, so a receiver can check that the request came from us unaltered.

use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The Standard Webhooks signature: `v1,` and the base64 HMAC-SHA256 of `id.timestamp.body`.
pub fn sign(key: &[u8], msg_id: &str, timestamp: u64, body: &[u8]) -> String {
    // HMAC accepts keys of any length; new_from_slice cannot fail for it.
    let mut mac = match Hmac::<Sha256>::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    format!("v1,{sig}")
}

/// The `webhook-signature` value for several keys: one `v1,<sig>` per key, space-separated,
/// in the keys' order (a receiver accepts the request if any of them verifies). None
/// without keys.
pub fn signatures(keys: &[Vec<u8>], msg_id: &str, timestamp: u64, body: &[u8]) -> Option<String> {
    let mut out: Option<String> = None;
    for key in keys {
        let sig = sign(key, msg_id, timestamp, body);
        match &mut out {
            Some(s) => {
                s.push(' ');
                s.push_str(&sig);
            }
            None => out = Some(sig),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deliver::webhook::settings;

    #[test]
    fn signature_matches_the_standard_webhooks_vector() {
        let vector: serde_json::Value = serde_json::from_str(include_str!(
            "../../../tests/data/standard-webhooks-vector.json"
        ))
        .expect("vector parses");
        let secret = vector["secret"].as_str().expect("secret");
        let key = settings::parse_webhook_secret(secret).expect("secret decodes");
        let sig = sign(
            &key,
            vector["webhook_id"].as_str().expect("id"),
            vector["webhook_timestamp"].as_u64().expect("ts"),
            vector["body"].as_str().expect("body").as_bytes(),
        );
        assert_eq!(sig, vector["webhook_signature"].as_str().expect("sig"));
    }
}
