//! Error classes and the retry schedule.
//!
//! Every failed attempt is classed once, at the transport boundary (see
//! [`crate::deliver::DeliveryError`]); the class alone decides whether another attempt is
//! safe ([`crate::state::decide`]) and this module decides when.

use crate::model::ErrorClass;
use std::time::Duration;

/// Classifies an HTTP status that is not a success.
///
/// 408, 425, 429 and 5xx are worth retrying; every other 4xx and every 3xx (redirects are
/// not followed: a redirect to another host would escape the destination check) is
/// permanent.
pub fn classify_http_status(status: u16) -> Option<ErrorClass> {
    match status {
        200..=299 => None,
        408 | 425 | 429 | 500..=599 => Some(ErrorClass::Transient),
        _ => Some(ErrorClass::Permanent),
    }
}

/// The schedule of retries: exponential from `base`, doubling per attempt, capped at `max`.
///
/// The delay before attempt `n + 1` is `min(max, base · 2^(n−1))`, scaled by a factor drawn
/// uniformly from `[0.8, 1.0]` so that a batch that failed together (a receiver outage) does
/// not come back as one thundering herd. With the defaults (5 s, 15 min) the retries of one
/// message wait about 5 s, 10 s, 20 s, … 15 min.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The delay after the first failed attempt.
    pub base: Duration,
    /// No delay exceeds this, `Retry-After` included.
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(15 * 60),
        }
    }
}

impl RetryPolicy {
    /// The share of a delay the jitter may take off: a delay is scaled by a factor in
    /// `[1 − JITTER, 1]`.
    pub const JITTER: f64 = 0.2;

    /// The delay after failed attempt `attempt` (counting from 1).
    ///
    /// `retry_after` (the provider's `Retry-After`) replaces the computed delay, capped at
    /// `max`: the provider knows when it will be ready better than a formula does.
    /// `jitter` is a sample in `[0, 1)`.
    pub fn delay(&self, attempt: i32, retry_after: Option<Duration>, jitter: f64) -> Duration {
        if let Some(wish) = retry_after {
            return wish.min(self.max);
        }
        let exp = u32::try_from(attempt.saturating_sub(1))
            .unwrap_or(0)
            .min(32);
        let raw = self
            .base
            .saturating_mul(2u32.saturating_pow(exp))
            .min(self.max);
        // A sample outside [0, 1], NaN included, counts as no jitter rather than a panic
        // in Duration::mul_f64.
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let factor = 1.0 - Self::JITTER * jitter;
        raw.mul_f64(factor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_base_and_caps_at_max() {
        let p = RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(60),
        };
        let d: Vec<u64> = (1..=6).map(|n| p.delay(n, None, 0.0).as_secs()).collect();
        assert_eq!(d, [5, 10, 20, 40, 60, 60]);
        // Huge attempt numbers neither overflow nor exceed the cap.
        assert_eq!(p.delay(i32::MAX, None, 0.0), Duration::from_secs(60));
        assert_eq!(p.delay(0, None, 0.0), Duration::from_secs(5));
    }

    #[test]
    fn jitter_shortens_by_at_most_a_fifth() {
        let p = RetryPolicy {
            base: Duration::from_secs(10),
            max: Duration::from_secs(60),
        };
        assert_eq!(p.delay(1, None, 0.0), Duration::from_secs(10));
        assert_eq!(p.delay(1, None, 0.5), Duration::from_secs(9));
        let low = p.delay(1, None, 0.999_999);
        assert!(
            low >= Duration::from_secs(8) && low < Duration::from_secs(10),
            "{low:?}"
        );
        // Out-of-range samples are clamped, never negative or above the schedule.
        assert_eq!(p.delay(1, None, 7.0), Duration::from_secs(8));
        assert_eq!(p.delay(1, None, -1.0), Duration::from_secs(10));
        assert_eq!(p.delay(1, None, f64::NAN), Duration::from_secs(10));
        assert_eq!(p.delay(1, None, f64::INFINITY), Duration::from_secs(10));
    }

    #[test]
    fn retry_after_replaces_the_schedule_up_to_max() {
        let p = RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(60),
        };
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(30)), 0.5),
            Duration::from_secs(30)
        );
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(1)), 0.5),
            Duration::from_secs(1)
        );
        assert_eq!(
            p.delay(4, Some(Duration::from_secs(3600)), 0.0),
            Duration::from_secs(60)
        );
    }

    #[test]
    fn http_status_classes() {
        use ErrorClass::*;
        let table = [
            (200, None),
            (204, None),
            (299, None),
            (301, Some(Permanent)),
            (302, Some(Permanent)),
            (304, Some(Permanent)),
            (400, Some(Permanent)),
            (401, Some(Permanent)),
            (404, Some(Permanent)),
            (408, Some(Transient)),
            (409, Some(Permanent)),
            (410, Some(Permanent)),
            (422, Some(Permanent)),
            (425, Some(Transient)),
            (429, Some(Transient)),
            (500, Some(Transient)),
            (502, Some(Transient)),
            (503, Some(Transient)),
            (599, Some(Transient)),
            (100, Some(Permanent)),
        ];
        for (status, want) in table {
            assert_eq!(classify_http_status(status), want, "status {status}");
        }
    }

    #[test]
    fn classes_round_trip_through_text() {
        for c in ErrorClass::ALL {
            assert_eq!(ErrorClass::parse(c.as_str()), Some(c));
        }
    }
}
