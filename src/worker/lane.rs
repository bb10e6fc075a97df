//! Lanes: which channels one claim asks for, and how many of their messages may be in
//! flight at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::MAX_CLAIMS;
use crate::config::WorkerConfig;
use crate::deliver::Deliverers;
use crate::model::Channel;

/// Channels claimed together under one bound on how many of their messages are in flight.
///
/// A channel that bounds its own sends (e-mail: the relay's connections) has a lane of its
/// own, capped there: rows claimed beyond that bound would only queue for a connection
/// while their leases run. The other channels share one lane, bounded by the loop's
/// capacity alone.
pub(super) struct Lane {
    pub(super) channels: Vec<Channel>,
    /// Most of this lane's messages in flight at once.
    pub(super) cap: usize,
    /// This lane's delivery tasks that have not ended.
    pub(super) inflight: Arc<AtomicUsize>,
    /// The lane's last claim came back full: more is due.
    pub(super) backlog: bool,
    /// The lane may claim without waiting for a wake-up: its last claim came back full, or
    /// something happened since (a place freed, new messages, the poll interval).
    pub(super) armed: bool,
    /// Claims of this lane in flight.
    pub(super) claiming: usize,
    /// Rows those claims may bring: places kept for them.
    pub(super) reserved: usize,
    /// How many rows the lane's last claim picked (`--drain` stops once every lane's last
    /// claim found none and nothing is in flight).
    pub(super) last_picked: Option<usize>,
}

impl Lane {
    pub(super) fn plan(
        channels: &[Channel],
        deliverers: &Deliverers,
        capacity: usize,
    ) -> Vec<Lane> {
        let mut lanes = Vec::new();
        let mut shared = Vec::new();
        for &c in channels {
            match deliverers.capacity(c) {
                Some(n) => lanes.push(Lane::new(vec![c], n.clamp(1, capacity))),
                None => shared.push(c),
            }
        }
        if !shared.is_empty() {
            lanes.push(Lane::new(shared, capacity));
        }
        lanes
    }

    /// A lane of `channels`, at most `cap` of their messages in flight, nothing claimed yet.
    pub(super) fn new(channels: Vec<Channel>, cap: usize) -> Lane {
        Lane {
            channels,
            cap,
            inflight: Arc::new(AtomicUsize::new(0)),
            backlog: false,
            armed: true,
            claiming: 0,
            reserved: 0,
            last_picked: None,
        }
    }

    /// A claim of up to `want` rows starts: its places are kept for it.
    pub(super) fn claim_started(&mut self, want: usize) {
        self.claiming += 1;
        self.reserved += want;
    }

    /// A claim that asked for `want` rows ended (answered, failed or lost): its places are
    /// no longer kept (the rows it brought are counted by their tasks from now on).
    pub(super) fn claim_ended(&mut self, want: usize) {
        self.claiming = self.claiming.saturating_sub(1);
        self.reserved = self.reserved.saturating_sub(want);
    }

    /// How many more of this lane's messages may be claimed now, the rows of its claims in
    /// flight counted as claimed.
    pub(super) fn room(&self) -> usize {
        self.cap
            .saturating_sub(self.inflight.load(Ordering::SeqCst))
            .saturating_sub(self.reserved)
    }

    /// May the lane start a claim now, with `free` places left in the loop and `ahead`
    /// rows to be claimed ahead of the slots? Armed, with fewer claims in flight than it
    /// may have (two under a backlog, so that one runs while the other waits for its
    /// commit; one otherwise), and room for at least [`Lane::threshold`] rows.
    pub(super) fn may_claim(&self, free: usize, ahead: usize, cfg: &WorkerConfig) -> bool {
        let most = if self.backlog { MAX_CLAIMS } else { 1 };
        self.armed && self.claiming < most && free.min(self.room()) >= self.threshold(ahead, cfg)
    }

    /// The least room worth a claim: under a backlog a quarter of a batch, so that each
    /// claim fetches a batch rather than a row per finished delivery, but never more than
    /// a quarter of the rows ahead, or slow slots would sit idle waiting for a quarter of a
    /// batch to free.
    pub(super) fn threshold(&self, ahead: usize, cfg: &WorkerConfig) -> usize {
        if self.backlog {
            (cfg.batch_size.min(cfg.concurrency).min(self.cap).min(ahead) / 4).max(1)
        } else {
            1
        }
    }
}

/// Counts a delivery task in its lane until the task ends.
pub(super) struct InLane(Arc<AtomicUsize>);

impl InLane {
    pub(super) fn enter(count: &Arc<AtomicUsize>) -> InLane {
        count.fetch_add(1, Ordering::SeqCst);
        InLane(count.clone())
    }
}

impl Drop for InLane {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(cap: usize) -> Lane {
        Lane::new(vec![Channel::Webhook], cap)
    }

    /// 64 in flight, batches of up to 100: a quarter of 64 is worth a claim under a backlog.
    fn cfg() -> WorkerConfig {
        WorkerConfig {
            concurrency: 64,
            batch_size: 100,
            ..WorkerConfig::default()
        }
    }

    #[test]
    fn a_lane_without_a_backlog_has_one_claim_in_flight_and_one_with_a_backlog_two() {
        let cfg = cfg();
        let mut l = lane(320);
        assert!(l.may_claim(320, 256, &cfg));
        l.claiming = 1;
        assert!(!l.may_claim(320, 256, &cfg), "idle: one claim at a time");
        l.backlog = true;
        assert!(
            l.may_claim(320, 256, &cfg),
            "a backlog: a second claim while the first waits"
        );
        l.claiming = 2;
        assert!(!l.may_claim(320, 256, &cfg), "never a third");
    }

    #[test]
    fn the_rows_of_claims_in_flight_count_against_the_room() {
        let cfg = cfg();
        let mut l = lane(320);
        l.backlog = true;
        l.inflight.store(200, Ordering::SeqCst);
        assert_eq!(l.room(), 120);
        l.claiming = 1;
        l.reserved = 100;
        assert_eq!(l.room(), 20);
        assert!(
            l.may_claim(320, 256, &cfg),
            "20 rows are worth a claim (at least 16)"
        );
        l.reserved = 110;
        assert!(!l.may_claim(320, 256, &cfg), "10 are not");
        // The loop's own free places bound it too.
        l.reserved = 0;
        assert!(!l.may_claim(15, 256, &cfg));
    }

    #[test]
    fn few_rows_ahead_lower_the_least_claim() {
        let cfg = cfg();
        let mut l = lane(320);
        l.backlog = true;
        assert_eq!(l.threshold(256, &cfg), 16);
        assert_eq!(l.threshold(20, &cfg), 5);
        // Slow slots, a row or two ahead: a claim for each freed place.
        assert_eq!(l.threshold(2, &cfg), 1);
        assert_eq!(l.threshold(0, &cfg), 1);
        l.inflight.store(319, Ordering::SeqCst);
        assert!(l.may_claim(1, 2, &cfg));
        assert!(!l.may_claim(1, 256, &cfg));
    }

    #[test]
    fn a_lane_that_is_not_armed_waits_for_a_wake_up() {
        let cfg = cfg();
        let mut l = lane(320);
        l.armed = false;
        assert!(!l.may_claim(320, 256, &cfg));
        // With no backlog any free place is worth a claim once armed.
        l.armed = true;
        assert!(l.may_claim(1, 256, &cfg));
    }
}
