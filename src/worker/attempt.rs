//! One delivery task: wait for a slot and the channel, check the lease still has room
//! for the whole attempt, send, classify, decide. Never touches the database: its result
//! goes to the completer as a [`Done`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use uuid::Uuid;

use super::Shared;
use super::destinations::{Admission, Leave};
use super::lane::{InLane, Lane};
use crate::claim::{Claimed, Completion};
use crate::deliver::reconcile::{Lookup, Verdict};
use crate::deliver::webhook::destination::READ_ONCE_MAX;
use crate::deliver::webhook::payload::Read;
use crate::deliver::{Outgoing, Ready, RequestLimits};
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
    /// Whether this result gives its place back as soon as it is handed to the completer,
    /// not only once the completer has recorded it. Only a delivery does: the places held
    /// until recorded are there so that the breakers count a failure before its place is
    /// claimed again (ARCHITECTURE.md, "A claimed row holds its place…"), and a success
    /// opens no breaker. Holding a success's place through the completer's commit left
    /// places idle in a healthy drain, where nearly every result is a success.
    pub(super) fn frees_place_when_sent(&self) -> bool {
        matches!(self, Done::Completed(c, _) if c.transition.error_class().is_none())
    }

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

/// A claimed message on its way to its attempt, with a small webhook payload read once by
/// the claim task, off the attempt's path (`webhook::destination::READ_ONCE_MAX`). `None`
/// for e-mail, for a larger payload and for one that does not read (not a JSON object, or
/// a member serde cannot hold, such as a number beyond f64): the attempt reads and checks
/// those from the text.
pub(super) struct Job {
    pub(super) msg: Claimed,
    pub(super) webhook: Option<Read>,
}

impl Job {
    /// Reads `msg`'s payload, when it is a small webhook's.
    pub(super) fn new(msg: Claimed) -> Job {
        let webhook = (msg.channel == Channel::Webhook && msg.payload.len() <= READ_ONCE_MAX)
            .then(|| crate::deliver::webhook::payload::read(&msg.payload).ok())
            .flatten();
        Job { msg, webhook }
    }
}

impl std::ops::Deref for Job {
    type Target = Claimed;
    fn deref(&self) -> &Claimed {
        &self.msg
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
    msg: Job,
    claimed_at: Instant,
) {
    shared.inflight.fetch_add(1, Ordering::SeqCst);
    let in_lane = InLane::enter(&lane.inflight);
    let shared = shared.clone();
    let tx = done_tx.clone();
    let slots = slots.clone();
    let task = async move {
        // Wait for a delivery slot; at shutdown, give the row back instead.
        let permit = tokio::select! {
            p = slots.acquire_owned() => p.ok(),
            _ = shared.stopping.cancelled() => None,
        };
        let held = permit.as_ref().map(|_| Instant::now());
        let done = match permit {
            Some(_) => attempt_if_it_fits(&shared, msg, claimed_at).await,
            None => Done::Released(msg.id, msg.lease_token),
        };
        // Keep the slot until the completer has room: that is the backpressure that stops
        // claims while the database cannot keep up.
        let frees_place = done.frees_place_when_sent();
        if tx.send(done).await.is_ok() && frees_place {
            shared.inflight.fetch_sub(1, Ordering::SeqCst);
        }
        // The whole time the slot was held, the wait for the completer included: that is
        // how fast slots turn over, which the rows claimed ahead follow.
        if let Some(held) = held {
            shared.slot_time.record(held.elapsed());
        }
        drop(permit);
        drop(in_lane);
        shared.wake.notify_one();
    };
    // Boxed: the future is about 2.5 kB, and tokio moves a task's future by value into its
    // cell and its stage (set again when the task ends and when its output is taken), each
    // a copy of the whole future; boxed, those are copies of a pointer.
    tasks.spawn(Box::pin(task));
}

/// Waits until the channel can send, then starts the attempt only if its whole timeout
/// still fits in the lease with a margin ([`WorkerConfig::attempt_fits`]): a row that
/// waited too long for a slot or a connection is given back unsent, rather than sent with a
/// lease that may run out mid-request (another worker would then send it again while this
/// request is still in flight).
pub(super) async fn attempt_if_it_fits(shared: &Shared, msg: Job, claimed_at: Instant) -> Done {
    // A channel paused since the claim: given back unsent and uncounted (due at once,
    // or parked if its destination is paused too); the claims leave the channel out.
    if shared.pauses.holds_channel(msg.channel) {
        return Done::deferred(msg.msg, DeferReason::Paused, Duration::ZERO);
    }
    // A breaker that opened while this row waited for its slot stops it here. Asked first,
    // so that the lease check below counts the time it may wait for a failure's record.
    if let Some(host) = msg.destination.as_deref() {
        // A pause seen since the claim: parked with its destination's backlog.
        if shared.pauses.holds(host) {
            return Done::deferred(msg.msg, DeferReason::Paused, Duration::ZERO);
        }
        if let Some(delay) = shared.breakers.recheck(msg.id, host).await {
            return Done::deferred(msg.msg, DeferReason::Breaker, delay);
        }
    }
    // An endpoint made or moved since the last reading of the table: read it again first,
    // so the message is not refused for a name or a host this worker has not seen yet.
    if msg.channel == Channel::Http
        && shared
            .deliverers
            .http
            .needs_refresh(&msg.payload, msg.destination.as_deref())
    {
        let table = shared.deliverers.http.endpoints();
        if let Err(e) = super::endpoints::refresh(&shared.pools.general, table).await {
            tracing::warn!(error = %e, "reading outbox.endpoints failed; will try again");
        }
    }
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
    // token is taken only by a message that is really about to be sent. An attempt that
    // looks up first sends the lookup first, to the lookup's host (`reconcile.url` may name
    // another): that host admits it, and the request after it asks its own host again, in
    // the attempt (`Leave`, `WebhookSender::send`).
    let looks_up = matches!(msg.channel, Channel::Webhook | Channel::Http)
        && msg.reconcile
        && msg.previous_class == Some(ErrorClass::Ambiguous);
    let first = if looks_up {
        msg.lookup_destination.as_deref()
    } else {
        msg.destination.as_deref()
    };
    // A lookup at a paused host is not sent either; its message asks again later.
    if looks_up && first.is_some_and(|h| shared.pauses.holds(h)) {
        return Done::deferred(
            msg.msg,
            DeferReason::Paused,
            super::pauses::LOOKUP_PAUSED_WAIT,
        );
    }
    let permit = match shared.gates.admit(first) {
        Admission::Go(permit) => permit,
        Admission::Defer(reason, delay) => return Done::deferred(msg.msg, reason, delay),
    };
    let done = if looks_up {
        let leave = Leave::new(&shared.gates, msg.destination.clone(), permit);
        attempt(shared, msg, ready, Some(&leave)).await
    } else {
        let done = attempt(shared, msg, ready, None).await;
        drop(permit);
        done
    };
    // Before the completer can record it: rows of the same host waiting in `recheck` then
    // wait for this failure to be counted.
    if let Done::Completed(c, _) = &done {
        shared
            .breakers
            .failure_seen(c.id, c.transition.error_class());
    }
    done
}

/// One attempt: send, classify, decide. Never touches the database.
async fn attempt(
    shared: &Shared,
    msg: Job,
    ready: Ready<'_>,
    limits: Option<&dyn RequestLimits>,
) -> Done {
    if shared.stopping.is_cancelled() {
        return Done::Released(msg.id, msg.lease_token);
    }
    let span = attempt_span(&msg);
    let started_at = SystemTime::now();
    let key_window_closed = key_window_closed(&msg, started_at);
    let t0 = Instant::now();
    let attempted = ready
        .send(Outgoing {
            key: &msg.key,
            payload: &msg.payload,
            webhook: msg.webhook.as_ref(),
            destination: msg.destination.as_deref(),
            lookup_destination: msg.lookup_destination.as_deref(),
            previous: msg.previous_class,
            last_attempt: msg.attempt >= msg.max_attempts,
            limits,
            key_window_closed,
        })
        .instrument(span.clone())
        .await;
    let duration = t0.elapsed();
    if let Some(lookup) = &attempted.lookup {
        log_lookup(&msg, lookup);
    }
    if !speaks_for_destination(&msg, &attempted) {
        // Not this host's answer: its breaker neither counts it nor waits for it.
        shared
            .breakers
            .forget(std::iter::once((msg.id, msg.lease_token)));
    }
    let budget = Budget {
        attempt: msg.attempt,
        max_attempts: msg.max_attempts,
        retry_ambiguous: msg.retry_ambiguous,
        reconcile: msg.reconcile,
        // Unless a lookup has just said the earlier attempt did not happen: then whatever
        // this attempt sends or fails to send, nothing is unknown (an address the guard
        // refuses now is `invalid`, not a question for a person).
        after_ambiguous: msg.previous_class == Some(ErrorClass::Ambiguous)
            && !attempted.lookup_said(Verdict::NotHappened),
    }
    .key_window(key_window_closed || key_window_closed_now(&msg));
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
                // `decide` counted it as ambiguous: say why, since the error is not.
                // Not sent blind once the provider may have forgotten the key.
                Some(ErrorClass::Ambiguous) if !msg.reconcile && key_window_closed_now(&msg) => {
                    format!("{}; {}", err.message, crate::state::KEY_WINDOW_CLOSED)
                }
                Some(ErrorClass::Ambiguous) if err.class == ErrorClass::Invalid => format!(
                    "{}; nothing was sent, and an earlier attempt may have taken effect",
                    err.message
                ),
                Some(ErrorClass::Ambiguous) if err.class != ErrorClass::Ambiguous => {
                    format!("{}; an earlier attempt may have taken effect", err.message)
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
    record_end(&span, msg.channel, &completion);
    drop(span);
    let msg = msg.msg;
    let log = AttemptLog {
        key: msg.key,
        channel: msg.channel,
        max_attempts: msg.max_attempts,
        duration,
    };
    Done::Completed(completion, log)
}

/// Whether the provider may have forgotten `msg`'s key at `now`: its key window, as the
/// claim read it from `outbox.key_expires_at`, has closed.
fn key_window_closed(msg: &Claimed, now: SystemTime) -> bool {
    msg.key_expires_at.is_some_and(|closes| closes <= now)
}

/// [`key_window_closed`] now.
fn key_window_closed_now(msg: &Claimed) -> bool {
    key_window_closed(msg, SystemTime::now())
}

/// The attempt's trace span ([`crate::telemetry`]): the message, its key escaped as the logs
/// have it, the channel and the attempt's number of the budget; the end's fields are
/// declared empty, as `tracing` wants every field named at creation, and [`record_end`]
/// fills them. Disabled, and then free, unless a layer exports traces. A webhook whose
/// payload carries a well-formed `traceparent` is a child of that remote span; reading it
/// parses the payload a second time, which is why only an enabled span asks.
fn attempt_span(msg: &Job) -> tracing::Span {
    let span = tracing::info_span!(
        target: crate::telemetry::SPAN_TARGET,
        "outboxd.attempt",
        otel.kind = "client",
        outbox.message_id = msg.id,
        outbox.message_key = %crate::text::Escaped(&msg.key),
        outbox.channel = msg.channel.as_str(),
        outbox.attempt = msg.attempt,
        outbox.max_attempts = msg.max_attempts,
        outbox.outcome = tracing::field::Empty,
        outbox.error_class = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        outbox.status = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
    );
    if !span.is_disabled() && msg.channel == Channel::Webhook {
        // From the payload the claim read, if it did; else from the text.
        let headers = match &msg.webhook {
            Some(read) => read.trace_headers(),
            None => crate::deliver::webhook::payload::trace_headers(&msg.payload),
        };
        let parent = headers.and_then(|h| crate::telemetry::remote_parent(&h));
        if let Some(cx) = parent {
            // Only fails for a span already started or not exported: neither is the case
            // here, and a root span would do then.
            let _ = span.set_parent(cx);
        }
    }
    span
}

/// The attempt's end on its span: the outcome and class as the history names them, the
/// provider's status (HTTP, or the SMTP reply code as `outbox.status`), and on failure the
/// error status with the attempt's one safe line ([`crate::deliver::DeliveryError`]'s
/// message: no URL path or query, header or payload).
fn record_end(span: &tracing::Span, channel: Channel, completion: &Completion) {
    if span.is_disabled() {
        return;
    }
    span.record("outbox.outcome", completion.transition.outcome().as_str());
    if let Some(class) = completion.transition.error_class() {
        span.record("outbox.error_class", class.as_str());
    }
    if let Some(status) = completion.status {
        match channel {
            Channel::Webhook | Channel::Http => {
                span.record("http.response.status_code", i64::from(status))
            }
            Channel::Email => span.record("outbox.status", i64::from(status)),
        };
    }
    if let Some(error) = &completion.error {
        span.record("otel.status_description", error.as_str());
    }
}

/// Whether an attempt's result is its destination's answer, which the breakers count
/// against the destination (the claimed row's entry names the request's host). A result
/// the lookup settled is the lookup host's: it counts only when that is the same
/// destination (a failing lookup service must not open a healthy destination, nor a
/// found operation close a failing one). An attempt that asked the destination nothing
/// (held back for lack of time after a lookup, refused before any request) is no one's:
/// after an ambiguous attempt its `invalid` becomes `ambiguous`, which would count.
fn speaks_for_destination(msg: &Claimed, attempted: &crate::deliver::Attempted) -> bool {
    if attempted.requested {
        return true;
    }
    match &attempted.lookup {
        Some(l) if !matches!(l.verdict, Verdict::NotHappened | Verdict::Refused) => {
            msg.destination.is_some() && msg.lookup_destination == msg.destination
        }
        // Held back after a 404, a lookup the guard refused, or nothing made at all.
        Some(_) | None => false,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;

    fn job(payload: &str) -> Job {
        Job {
            msg: claimed(payload),
            webhook: None,
        }
    }

    fn claimed(payload: &str) -> Claimed {
        Claimed {
            id: 7,
            key: "order:1\n".into(),
            channel: Channel::Webhook,
            payload: payload.into(),
            attempt: 1,
            max_attempts: 3,
            retry_ambiguous: false,
            lease_token: Uuid::nil(),
            previous_class: None,
            reconcile: false,
            destination: None,
            lookup_destination: None,
            key_expires_at: None,
        }
    }

    /// The log layer as `logging::init_logging` filters it, at its most verbose.
    fn logs<S>() -> impl tracing_subscriber::Layer<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use tracing_subscriber::filter::FilterExt as _;
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::sink)
            .with_filter(tracing_subscriber::EnvFilter::new("trace").and(
                tracing_subscriber::filter::filter_fn(|m| !crate::telemetry::is_trace_span(m)),
            ))
    }

    /// With traces off the attempt's span is disabled, even under `RUST_LOG=trace`: no
    /// layer wants its target, so it costs one cached check per attempt and the payload is
    /// not read for a `traceparent`. With the exporting
    /// layer it is enabled, and a payload's `traceparent` becomes its parent.
    #[test]
    fn the_span_is_free_unless_traces_are_on() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let msg = job(&format!(
            r#"{{"url": "https://x.example", "headers": {{"traceparent": "{tp}"}}}}"#
        ));
        let off = tracing_subscriber::registry().with(logs());
        tracing::subscriber::with_default(off, || {
            assert!(attempt_span(&msg).is_disabled());
        });
        let traces = crate::telemetry::Traces::without_exporter();
        let on = tracing_subscriber::registry()
            .with(logs())
            .with(traces.layer());
        tracing::subscriber::with_default(on, || {
            use opentelemetry::trace::TraceContextExt as _;
            let span = attempt_span(&msg);
            assert!(!span.is_disabled());
            let cx = span.context();
            let otel = cx.span();
            let sc = otel.span_context();
            assert_eq!(sc.trace_id().to_string(), &tp[3..35]);
            assert_ne!(
                sc.span_id().to_string(),
                &tp[36..52],
                "a child, not the parent"
            );
            // No traceparent, or a malformed one: a root of its own trace.
            let bad = job(r#"{"url": "https://x.example", "headers": {"traceparent": "00-x"}}"#);
            let root = attempt_span(&bad);
            assert_ne!(
                root.context().span().span_context().trace_id().to_string(),
                &tp[3..35]
            );
        });
    }

    /// Only a delivery gives its place back when its task hands it over; every other result
    /// keeps it until the completer has recorded it (a failure must reach the breakers
    /// first, and a release or deferral must be written before its row may be claimed).
    #[test]
    fn only_a_delivery_gives_its_place_back_before_it_is_recorded() {
        use crate::state::{DeferReason, Transition};
        let completed = |transition| {
            let msg = claimed(r#"{"url": "https://x.example"}"#);
            Done::Completed(
                Completion {
                    id: msg.id,
                    lease_token: msg.lease_token,
                    attempt: 1,
                    transition,
                    error: None,
                    status: None,
                    deduplicated: false,
                    response: None,
                    started_at: SystemTime::now(),
                },
                AttemptLog {
                    key: msg.key,
                    channel: msg.channel,
                    max_attempts: 3,
                    duration: Duration::ZERO,
                },
            )
        };
        assert!(completed(Transition::Delivered).frees_place_when_sent());
        assert!(completed(Transition::Reconciled).frees_place_when_sent());
        for class in [
            ErrorClass::Transient,
            ErrorClass::Ambiguous,
            ErrorClass::Permanent,
            ErrorClass::Invalid,
            ErrorClass::Exhausted,
        ] {
            let retry = Transition::Retry {
                class,
                delay: Duration::from_secs(1),
            };
            assert!(!completed(retry).frees_place_when_sent(), "{class:?}");
            assert!(!completed(Transition::Dead { class }).frees_place_when_sent());
        }
        assert!(!Done::Released(7, Uuid::nil()).frees_place_when_sent());
        for reason in &DeferReason::ALL {
            let d = Done::deferred(
                claimed(r#"{"url": "https://x.example"}"#),
                *reason,
                Duration::from_secs(1),
            );
            assert!(!d.frees_place_when_sent(), "{reason:?}");
        }
    }
}
