//! Lanes: which channels one claim asks for, and how many of their messages may be in
//! flight at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
}

impl Lane {
    pub(super) fn plan(
        channels: &[Channel],
        deliverers: &Deliverers,
        capacity: usize,
    ) -> Vec<Lane> {
        let lane = |channels, cap| Lane {
            channels,
            cap,
            inflight: Arc::new(AtomicUsize::new(0)),
            backlog: false,
        };
        let mut lanes = Vec::new();
        let mut shared = Vec::new();
        for &c in channels {
            match deliverers.capacity(c) {
                Some(n) => lanes.push(lane(vec![c], n.clamp(1, capacity))),
                None => shared.push(c),
            }
        }
        if !shared.is_empty() {
            lanes.push(lane(shared, capacity));
        }
        lanes
    }

    /// How many more of this lane's messages may be claimed now.
    pub(super) fn room(&self) -> usize {
        self.cap
            .saturating_sub(self.inflight.load(Ordering::SeqCst))
    }

    /// The least room worth a claim.
    pub(super) fn threshold(&self, cfg: &WorkerConfig) -> usize {
        if self.backlog {
            (cfg.batch_size.min(cfg.concurrency).min(self.cap) / 4).max(1)
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
