//! When deferred messages come due again: the idle claim loop wakes at the earliest alarm
//! instead of waiting for the poll interval, so a message given back for 200 ms is not sent
//! a second late.
//!
//! The completer sets an alarm for each deferral it records, the lease sweep one for each
//! due time it makes; the claim loop sleeps until the earliest and drops the passed ones
//! once it has armed every lane.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Mutex;
use std::time::Instant;

use crate::support::lock;

/// Most alarms kept: beyond this a deferred message is found by the next poll instead.
const MAX_ALARMS: usize = 4096;

#[derive(Default)]
pub(super) struct Alarms(Mutex<BinaryHeap<Reverse<Instant>>>);

impl Alarms {
    /// Wakes the idle claim loop at `at`.
    pub(super) fn set(&self, at: Instant) {
        let mut alarms = lock(&self.0);
        if alarms.len() < MAX_ALARMS {
            alarms.push(Reverse(at));
        }
    }

    /// The earliest alarm, even one that has passed: an alarm that passed while the loop was
    /// busy still wakes it once ([`Alarms::served`] drops it then). Dropping it here instead
    /// lost it: the row it was for waited for the next poll.
    pub(super) fn next(&self) -> Option<Instant> {
        lock(&self.0).peek().map(|Reverse(at)| *at)
    }

    /// Drops the alarms that have passed by `now`: the loop has just armed every lane.
    pub(super) fn served(&self, now: Instant) {
        let mut alarms = lock(&self.0);
        while alarms.peek().is_some_and(|Reverse(at)| *at <= now) {
            alarms.pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// An alarm that passed before the loop looked still wakes it, once. (It used to be
    /// dropped unseen when the loop was busy past it, and its row waited for the next poll.)
    #[test]
    fn a_passed_alarm_is_seen_once_then_served() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        alarms.set(t0);
        let later = t0 + Duration::from_millis(1);
        assert_eq!(
            alarms.next(),
            Some(t0),
            "a passed alarm still wakes the loop"
        );
        alarms.served(later);
        assert_eq!(alarms.next(), None, "and only once");
    }

    #[test]
    fn the_earliest_comes_first_and_future_ones_outlive_a_serving() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        let (a, b, c) = (
            t0 + Duration::from_millis(30),
            t0 + Duration::from_millis(10),
            t0 + Duration::from_millis(20),
        );
        for at in [a, b, c] {
            alarms.set(at);
        }
        assert_eq!(alarms.next(), Some(b));
        alarms.served(t0 + Duration::from_millis(15));
        assert_eq!(alarms.next(), Some(c));
        alarms.served(t0 + Duration::from_millis(30));
        assert_eq!(alarms.next(), None, "an alarm due exactly now is served");
    }

    #[test]
    fn alarms_beyond_the_cap_are_not_kept() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        for i in 0..MAX_ALARMS as u64 + 10 {
            alarms.set(t0 + Duration::from_millis(i));
        }
        assert_eq!(lock(&alarms.0).len(), MAX_ALARMS);
    }
}
