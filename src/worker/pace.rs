//! How many rows to claim ahead of the free slots: enough to keep the slots busy while the
//! next claim is on its way, and no more.
//!
//! A row claimed ahead waits in its task for a slot. It is leased and its attempt counted
//! while it waits, so each one is a row that a killed worker leaves to be settled as an
//! ambiguous attempt that was never made, and one that is given back unsent if it waits
//! past what its lease allows (`WorkerConfig::attempt_fits`). Rows ahead pay for
//! themselves only by covering a claim's round trip, which takes milliseconds. So their
//! number follows how fast the slots turn over: `concurrency × horizon ÷ slot time` rows,
//! where the horizon is a few claims' round trips, bounded by two batches per claim in
//! flight (the most that helped a fast drain). With a
//! receiver that answers in a millisecond that is the bound; with one that takes a second,
//! a row or two.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The least horizon: rows ahead cover at least this long of the slots' starts, whatever
/// the claims' round trips (a few milliseconds under a backlog).
pub(super) const HORIZON_MIN: Duration = Duration::from_millis(50);

/// The horizon in claims' round trips: a claim started when the rows ahead run low comes
/// back before they run out, with room for a slow commit.
const HORIZON_CLAIMS: u32 = 4;

/// Each new sample moves an average by this fraction of its distance (1/16): steady
/// under the noise of single requests, and a few dozen deliveries to follow a change.
const EWMA_SHIFT: u32 = 4;

/// A moving average of durations, shared between tasks without a lock.
#[derive(Debug, Default)]
pub(super) struct Ewma {
    /// Microseconds; 0 until the first sample (a sample of 0 is stored as 1).
    micros: AtomicU64,
}

impl Ewma {
    /// Adds a sample.
    pub(super) fn record(&self, d: Duration) {
        let sample = u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1);
        // The closure always answers, so a race with another task retries: no sample is
        // lost.
        let _ = self
            .micros
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(if old == 0 {
                    sample
                } else if sample > old {
                    old.saturating_add(((sample - old) >> EWMA_SHIFT).max(1))
                } else if sample == old {
                    old
                } else {
                    old - ((old - sample) >> EWMA_SHIFT).max(1)
                })
            });
    }

    /// The average, or None before the first sample.
    pub(super) fn get(&self) -> Option<Duration> {
        match self.micros.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }
}

/// The horizon rows ahead should cover, from the claims' average round trip.
pub(super) fn horizon(claim_round_trip: Option<Duration>) -> Duration {
    claim_round_trip.map_or(HORIZON_MIN, |rtt| (rtt * HORIZON_CLAIMS).max(HORIZON_MIN))
}

/// Rows to claim ahead of `concurrency` slots that each hold a row for `slot_time` on
/// average: what the slots start within `horizon`, at most `most`. None before the first
/// delivery: the slots' pace is unknown, and a worker that starts against a backlog of
/// slow messages must not lease every place ahead at once; with a fast receiver the first
/// deliveries end within milliseconds and the bound applies from then on.
pub(super) fn ahead(
    concurrency: usize,
    most: usize,
    slot_time: Option<Duration>,
    horizon: Duration,
) -> usize {
    let Some(slot) = slot_time else {
        return 0;
    };
    let slot = slot.as_micros().max(1);
    let starts = (concurrency as u128 * horizon.as_micros()).div_ceil(slot);
    usize::try_from(starts).unwrap_or(usize::MAX).min(most)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn fast_slots_keep_the_whole_bound_and_unknown_ones_none() {
        // 64 slots of 2 ms start 1 600 rows in 50 ms: the bound, 256, holds.
        assert_eq!(ahead(64, 256, Some(2 * MS), HORIZON_MIN), 256);
        // Before the first delivery, none: the slots alone bound the first claims.
        assert_eq!(ahead(64, 256, None, HORIZON_MIN), 0);
    }

    #[test]
    fn slow_slots_keep_a_row_or_two_ahead() {
        // 64 slots of a second start 3.2 rows in 50 ms.
        assert_eq!(ahead(64, 256, Some(1000 * MS), HORIZON_MIN), 4);
        // 4 slots of 300 ms: 0.67 rows, rounded up.
        assert_eq!(ahead(4, 16, Some(300 * MS), HORIZON_MIN), 1);
        // 64 slots of 100 ms: 32.
        assert_eq!(ahead(64, 256, Some(100 * MS), HORIZON_MIN), 32);
        // A slot time of 0 (an instant refusal) counts as 1 µs, not a division by 0.
        assert_eq!(ahead(64, 256, Some(Duration::ZERO), HORIZON_MIN), 256);
    }

    #[test]
    fn the_horizon_is_four_claims_at_least_fifty_ms() {
        assert_eq!(horizon(None), HORIZON_MIN);
        assert_eq!(horizon(Some(4 * MS)), HORIZON_MIN);
        assert_eq!(horizon(Some(30 * MS)), 120 * MS);
    }

    #[test]
    fn the_average_starts_at_the_first_sample_and_follows() {
        let e = Ewma::default();
        assert_eq!(e.get(), None);
        e.record(300 * MS);
        assert_eq!(e.get(), Some(300 * MS));
        // A sixteenth of the way to each new sample.
        e.record(1300 * MS);
        assert_eq!(e.get(), Some(362_500 * Duration::from_micros(1)));
        for _ in 0..200 {
            e.record(2 * MS);
        }
        let now = e.get().unwrap_or_default();
        assert!(now < 3 * MS, "follows a faster receiver: {now:?}");
        e.record(Duration::ZERO);
        assert!(e.get().is_some(), "a zero sample is a sample");
    }
}
