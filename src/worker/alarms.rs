//! When deferred messages come due again: the idle claim loop wakes at the earliest alarm
//! instead of waiting for the poll interval, so a message given back for 200 ms is not sent
//! a second late.
//!
//! The completer sets an alarm for each deferral it records, the lease sweep one for each
//! due time it makes; the claim loop sleeps until the earliest and drops the passed ones
//! once it has armed every lane.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Instant;

use crate::support::lock;

/// Most alarms kept: beyond this the latest are dropped, and the messages they were for are
/// found by the next poll instead.
const MAX_ALARMS: usize = 4096;

/// The alarms in time order; the number tells apart alarms set for the same instant.
#[derive(Default)]
pub(super) struct Alarms(Mutex<(BTreeSet<(Instant, u64)>, u64)>);

impl Alarms {
    /// Wakes the idle claim loop at `at`. When full, the latest alarm goes: a breaker's
    /// backlog deferred 40 s out must not crowd out a rate limit's 20 ms.
    pub(super) fn set(&self, at: Instant) {
        let mut guard = lock(&self.0);
        let (alarms, seq) = &mut *guard;
        *seq = seq.wrapping_add(1);
        alarms.insert((at, *seq));
        if alarms.len() > MAX_ALARMS {
            alarms.pop_last();
        }
    }

    /// The earliest alarm, even one that has passed: an alarm that passed while the loop was
    /// busy still wakes it once ([`Alarms::served`] drops it then). Dropping it here instead
    /// lost it: the row it was for waited for the next poll.
    pub(super) fn next(&self) -> Option<Instant> {
        lock(&self.0).0.first().map(|(at, _)| *at)
    }

    /// Drops the alarms that have passed by `now`: the loop has just armed every lane.
    pub(super) fn served(&self, now: Instant) {
        let mut guard = lock(&self.0);
        let alarms = &mut guard.0;
        while alarms.first().is_some_and(|(at, _)| *at <= now) {
            alarms.pop_first();
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
    fn alarms_for_the_same_instant_are_each_kept() {
        let alarms = Alarms::default();
        let t = Instant::now() + Duration::from_secs(1);
        alarms.set(t);
        alarms.set(t);
        assert_eq!(lock(&alarms.0).0.len(), 2);
    }

    /// Full of far alarms (a breaker's backlog deferred 40 s out), a near one (a rate
    /// limit's) still counts, and the latest goes instead.
    #[test]
    fn when_full_the_latest_alarms_go() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        for i in 0..MAX_ALARMS as u64 {
            alarms.set(t0 + Duration::from_secs(40) + Duration::from_millis(i));
        }
        let near = t0 + Duration::from_millis(20);
        alarms.set(near);
        assert_eq!(alarms.next(), Some(near));
        let kept = lock(&alarms.0).0.len();
        assert_eq!(kept, MAX_ALARMS);
        let last = lock(&alarms.0).0.last().map(|(at, _)| *at);
        assert_eq!(
            last,
            Some(t0 + Duration::from_secs(40) + Duration::from_millis(MAX_ALARMS as u64 - 2)),
            "the latest was dropped"
        );
    }
}
