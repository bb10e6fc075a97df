//! One delivery task: wait for a slot and the channel, check the lease still has room
//! for the whole attempt, send, classify, decide. Never touches the database: its result
//! goes to the completer as a [`Done`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use uuid::Uuid;

use super::Shared;
use super::destinations::Admission;
use super::lane::{InLane, Lane};
use crate::claim::{Claimed, Completion};
use crate::deliver::webhook::reconcile::Lookup;
use crate::deliver::{Outgoing, Ready};
use crate::model::{Channel, ErrorClass};
use crate::state::{Budget, DeferReason, Deferral, Ended, decide};

/// What a delivery task hands to the completer.
pub(super) enum Done {
    Completed(Completion, AttemptLog),
    Released(i64, Uuid),
    /// Not sent now (a breaker, a rate limit, a busy host): pending again after the delay,
    /// uncounted, no history row.
    Deferred(Deferred),
}

/// A claimed message given back unsent, to be tried again later ([`Deferral`]).
pub(super) struct Deferred {
    pub(super) id: i64,
    pub(super) lease_token: Uuid,
    pub(super) key: String,
    pub(super) channel: Channel,
    pub(super) deferral: Deferral,
}

impl Done {
    /// Defers `msg` for `reason`, due again after `delay`.
    pub(super) fn deferred(msg: Claimed, reason: DeferReason, delay: Duration) -> Done {
        Done::Deferred(Deferred {
            id: msg.id,
            lease_token: msg.lease_token,
            key: msg.key,
            channel: msg.channel,
            deferral: Deferral { reason, delay },
        })
    }
}

/// What the attempt's log event needs beyond the completion.
pub(super) struct AttemptLog {
    pub(super) key: String,
    pub(super) channel: Channel,
    pub(super) max_attempts: i32,
    pub(super) duration: Duration,
}

/// One task for one claimed row: it waits for a delivery slot and for its channel, then
/// makes the attempt if it still fits in the lease, or gives the row back unsent.
pub(super) fn spawn_attempt(
    tasks: &mut JoinSet<()>,
    shared: &Arc<Shared>,
    slots: &Arc<Semaphore>,
    done_tx: &mpsc::Sender<Done>,
    lane: &Lane,
    msg: Claimed,
    claimed_at: Instant,
) {
    shared.inflight.fetch_add(1, Ordering::SeqCst);
    let in_lane = InLane::enter(&lane.inflight);
    let shared = shared.clone();
    let tx = done_tx.clone();
    let slots = slots.clone();
    tasks.spawn(async move {
        // Wait for a delivery slot; at shutdown, give the row back instead.
        let permit = tokio::select! {
            p = slots.acquire_owned() => p.ok(),
            _ = shared.stopping.cancelled() => None,
        };
        let done = match permit {
            Some(_) => attempt_if_it_fits(&shared, msg, claimed_at).await,
            None => Done::Released(msg.id, msg.lease_token),
        };
        // Keep the slot until the completer has room: that is the backpressure that stops
        // claims while the database cannot keep up.
        let _ = tx.send(done).await;
        drop(permit);
        drop(in_lane);
        shared.wake.notify_one();
    });
}

/// Waits until the channel can send, then starts the attempt only if its whole timeout
/// still fits in the lease with a margin ([`WorkerConfig::attempt_fits`]): a row that
/// waited too long for a slot or a connection is given back unsent, rather than sent with a
/// lease that may run out mid-request (another worker would then send it again while this
/// request is still in flight).
pub(super) async fn attempt_if_it_fits(shared: &Shared, msg: Claimed, claimed_at: Instant) -> Done {
    let ready = tokio::select! {
        r = shared.deliverers.ready(msg.channel) => r,
        _ = shared.stopping.cancelled() => return Done::Released(msg.id, msg.lease_token),
    };
    // An unconfigured channel has no timeout: its attempt fails at once, without a call.
    let timeout = shared.deliverers.timeout(msg.channel).unwrap_or_default();
    if !shared.cfg.attempt_fits(claimed_at.elapsed(), timeout) {
        tracing::debug!(
            message_id = msg.id,
            waited_ms = claimed_at.elapsed().as_millis() as u64,
            "the attempt would not end inside its lease; giving the row back unsent"
        );
        return Done::Released(msg.id, msg.lease_token);
    }
    // The limits per destination decide last, just before the request: a slot or a rate
    // token is taken only by a message that is really about to be sent.
    let permit = match shared.gates.admit(msg.destination.as_deref()) {
        Admission::Go(permit) => permit,
        Admission::Defer(reason, delay) => return Done::deferred(msg, reason, delay),
    };
    let done = attempt(shared, msg, ready).await;
    drop(permit);
    done
}

/// One attempt: send, classify, decide. Never touches the database.
async fn attempt(shared: &Shared, msg: Claimed, ready: Ready<'_>) -> Done {
    if shared.stopping.is_cancelled() {
        return Done::Released(msg.id, msg.lease_token);
    }
    let started_at = SystemTime::now();
    let t0 = Instant::now();
    let attempted = ready
        .send(Outgoing {
            key: &msg.key,
            payload: &msg.payload,
            previous: msg.previous_class,
        })
        .await;
    let duration = t0.elapsed();
    if let Some(lookup) = &attempted.lookup {
        log_lookup(&msg, lookup);
    }
    let budget = Budget {
        attempt: msg.attempt,
        max_attempts: msg.max_attempts,
        retry_ambiguous: msg.retry_ambiguous,
        reconcile: msg.reconcile,
    };
    let jitter: f64 = rand::random();
    let reconciled = attempted.reconciled();
    let completion = match attempted.result {
        Ok(ok) => Completion {
            id: msg.id,
            lease_token: msg.lease_token,
            attempt: msg.attempt,
            transition: decide(
                if reconciled {
                    Ended::Reconciled
                } else {
                    Ended::Delivered
                },
                budget,
                &shared.cfg.retry,
                None,
                jitter,
            ),
            error: None,
            status: ok.status,
            deduplicated: ok.deduplicated,
            response: Some(ok.response),
            started_at,
        },
        Err(err) => {
            let transition = decide(
                Some(err.class),
                budget,
                &shared.cfg.retry,
                err.retry_after,
                jitter,
            );
            let error = match transition.error_class() {
                Some(ErrorClass::Exhausted) => {
                    format!(
                        "{} (attempt {} of {}: retries exhausted)",
                        err.message, msg.attempt, msg.max_attempts
                    )
                }
                _ => err.message.clone(),
            };
            Completion {
                id: msg.id,
                lease_token: msg.lease_token,
                attempt: msg.attempt,
                transition,
                error: Some(error),
                status: err.status,
                deduplicated: false,
                response: err.response,
                started_at,
            }
        }
    };
    let log = AttemptLog {
        key: msg.key,
        channel: msg.channel,
        max_attempts: msg.max_attempts,
        duration,
    };
    Done::Completed(completion, log)
}

/// The reconciliation lookup, logged as a step of its own before the attempt's event: the
/// host and the verdict, never the URL's path or query, nor a header.
fn log_lookup(msg: &Claimed, lookup: &Lookup) {
    tracing::info!(
        message_id = msg.id,
        key = %crate::text::Escaped(&msg.key),
        channel = %msg.channel,
        attempt = %format_args!("{}/{}", msg.attempt, msg.max_attempts),
        step = "reconcile",
        host = %crate::text::Escaped(&lookup.host),
        verdict = lookup.verdict.as_str(),
        status = lookup.status,
        duration_ms = lookup.duration.as_millis() as u64,
        "reconciliation lookup"
    );
}
