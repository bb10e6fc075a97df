//! Parsed webhook URLs, kept per URL string.
//!
//! Parsing a URL (WHATWG rules, with IDNA mapping of the host) was about 6 000 instructions
//! of the roughly 110 000 the daemon spent per delivery besides memory moves (callgrind of a
//! 20 000-webhook drain), and most messages go to a few URLs. A parsed
//! [`url::Url`] is a pure function of its string, so handing out a copy of an earlier parse
//! changes nothing the payload rules check: `payload::parse_url` still checks the scheme
//! and the host of every copy.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::support::lock;

/// Most URLs kept. Past it the cache is emptied and fills again: a worker sending to more
/// distinct URLs than this only loses the saving, and memory stays bounded.
pub const MAX_ENTRIES: usize = 1024;

/// Longer URLs are parsed every time, not kept: bounds the cache's memory at about
/// `MAX_ENTRIES × 2 × MAX_URL_LEN` bytes (the string and the parsed copy).
pub const MAX_URL_LEN: usize = 2048;

/// Parsed URLs by their string.
#[derive(Default)]
pub struct UrlCache {
    parsed: Mutex<HashMap<Box<str>, url::Url>>,
}

impl std::fmt::Debug for UrlCache {
    /// How many URLs are kept, never one of them: their paths and queries often carry
    /// tokens. Without waiting for the lock (a `{:?}` where it is held must not hang).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("UrlCache");
        match self.parsed.try_lock() {
            Ok(map) => d.field("len", &map.len()),
            Err(_) => d.field("len", &"locked"),
        };
        d.finish()
    }
}

impl UrlCache {
    /// `url::Url::parse(s)`, from the cache when `s` was parsed before. Failures are not
    /// kept (they are rare, and the message is dead at once).
    pub fn parse(&self, s: &str) -> Result<url::Url, url::ParseError> {
        if s.len() > MAX_URL_LEN {
            return url::Url::parse(s);
        }
        if let Some(u) = lock(&self.parsed).get(s) {
            return Ok(u.clone());
        }
        // Parsed outside the lock: another task may parse the same string meanwhile, and
        // the second insert replaces an equal value.
        let u = url::Url::parse(s)?;
        let mut map = lock(&self.parsed);
        if map.len() >= MAX_ENTRIES {
            map.clear();
        }
        map.insert(s.into(), u.clone());
        Ok(u)
    }

    /// How many URLs are kept (for tests).
    pub fn len(&self) -> usize {
        lock(&self.parsed).len()
    }

    /// Is nothing kept?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_parse_equals_a_fresh_one() {
        let cache = UrlCache::default();
        for s in [
            "https://Example.COM:443/a/../b?x=1#f",
            "http://127.1/h",
            "https://bücher.example/p",
        ] {
            let fresh = url::Url::parse(s).expect("valid");
            assert_eq!(cache.parse(s).expect("first"), fresh);
            assert_eq!(cache.parse(s).expect("cached"), fresh);
        }
        assert_eq!(cache.len(), 3);
        assert!(cache.parse("not a url").is_err());
        assert_eq!(cache.len(), 3, "failures are not kept");
        let long = format!("https://x.example/{}", "a".repeat(MAX_URL_LEN));
        assert!(cache.parse(&long).is_ok());
        assert_eq!(cache.len(), 3, "long URLs are not kept");
    }

    #[test]
    fn the_cache_stays_bounded() {
        let cache = UrlCache::default();
        for i in 0..(MAX_ENTRIES + 10) {
            let s = format!("https://h{i}.example/");
            assert_eq!(cache.parse(&s).expect("valid").as_str(), s);
        }
        assert!(cache.len() <= MAX_ENTRIES);
    }
}
