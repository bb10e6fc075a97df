//! The state machine of a message, as data.
//!
//! A message is `pending` until a worker claims it (`running`, under a lease), and each
//! attempt ends in exactly one [`Transition`]. [`decide`] is the one place that maps what a
//! delivery returned to the next state; the SQL in [`crate::queries`] only writes what it is
//! given, and a test checks that the two agree on every arm.

use crate::model::{AttemptOutcome, State};
use std::time::Duration;

use crate::model::ErrorClass;
use crate::retry::RetryPolicy;

/// How an attempt ended, as [`decide`] takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The provider accepted the request.
    Delivered,
    /// A reconciliation lookup found that an earlier, ambiguous attempt took effect; the
    /// request was not sent again.
    Reconciled,
    /// It failed, with this class.
    Failed(ErrorClass),
}

/// `None` is a delivery and `Some(class)` a failure: the form most callers have at hand.
impl From<Option<ErrorClass>> for Ended {
    fn from(failure: Option<ErrorClass>) -> Self {
        match failure {
            None => Ended::Delivered,
            Some(class) => Ended::Failed(class),
        }
    }
}

/// What the worker writes after an attempt: the next state and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transition {
    /// `running → delivered`.
    Delivered,
    /// `running → delivered`, found by a reconciliation lookup (history outcome
    /// `reconciled`): the effect of an earlier attempt was confirmed by the provider.
    Reconciled,
    /// `running → pending`, due again after `delay`. `class` is the failure that caused it.
    Retry {
        /// Why the attempt failed (`transient` or `ambiguous`).
        class: ErrorClass,
        /// How long until the next attempt may be claimed.
        delay: Duration,
    },
    /// `running → dead`.
    Dead {
        /// Why: the failure's own class, or `exhausted` when a retryable failure used up
        /// the budget.
        class: ErrorClass,
    },
}

impl Transition {
    /// The state this transition leads to.
    pub fn next_state(&self) -> State {
        match self {
            Transition::Delivered | Transition::Reconciled => State::Delivered,
            Transition::Retry { .. } => State::Pending,
            Transition::Dead { .. } => State::Dead,
        }
    }

    /// The outcome recorded in the attempt history.
    pub fn outcome(&self) -> AttemptOutcome {
        match self {
            Transition::Delivered => AttemptOutcome::Delivered,
            Transition::Reconciled => AttemptOutcome::Reconciled,
            Transition::Retry { .. } => AttemptOutcome::Retry,
            Transition::Dead { .. } => AttemptOutcome::Dead,
        }
    }

    /// The error class stored on the message, if the attempt failed.
    pub fn error_class(&self) -> Option<ErrorClass> {
        match self {
            Transition::Delivered | Transition::Reconciled => None,
            Transition::Retry { class, .. } | Transition::Dead { class } => Some(*class),
        }
    }
}

/// Why a claimed message was given back unsent, to be tried again later: a decision about
/// *when* to send, not about how an attempt ended, so it spends none of the budget
/// (`attempts - 1`) and writes no history row (a breaker open for an hour would otherwise
/// write a row per message per poll). The message keeps its key and bytes. Written by
/// `queries::DEFER`; logged per message as `deferred=<reason>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeferReason {
    /// The destination's circuit breaker is open (or another worker holds its probe).
    Breaker,
    /// The destination's rate limit (`OUTBOXD_WEBHOOK_RATE_LIMITS`) has no token to spare.
    RateLimit,
    /// The destination already has `--host-concurrency` requests in flight.
    HostBusy,
    /// An earlier message of its ordering group is not finished.
    Ordering,
    /// A person paused its destination (`outboxd destinations --pause`): parked with the
    /// destination's backlog until resumed.
    Paused,
}

impl DeferReason {
    /// Every reason, for tests and metric descriptions.
    pub const ALL: [DeferReason; 5] = [
        DeferReason::Breaker,
        DeferReason::RateLimit,
        DeferReason::HostBusy,
        DeferReason::Ordering,
        DeferReason::Paused,
    ];

    /// The name in logs (`deferred=rate_limit`) and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            DeferReason::Breaker => "breaker",
            DeferReason::RateLimit => "rate_limit",
            DeferReason::HostBusy => "host_busy",
            DeferReason::Ordering => "ordering",
            DeferReason::Paused => "paused",
        }
    }
}

/// A deferral: `running → pending`, due again after `delay`, the attempt not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deferral {
    /// Why it was not sent now.
    pub reason: DeferReason,
    /// How long until it may be claimed again.
    pub delay: Duration,
}

impl Deferral {
    /// The state a deferral leads to: always `pending`.
    pub fn next_state(&self) -> State {
        State::Pending
    }
}

/// The facts about a message that decide what a failure costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The attempt that just ended, counting from 1.
    pub attempt: i32,
    /// The whole budget, the first attempt included.
    pub max_attempts: i32,
    /// May an attempt whose outcome is unknown be sent again?
    pub retry_ambiguous: bool,
    /// Does the message name a lookup (a webhook's `reconcile.url`)? Then an ambiguous
    /// outcome can be settled by asking the provider, which is safe to repeat: the next
    /// attempt asks first and sends again only if the provider says the request never
    /// took effect. So an ambiguous failure with budget left goes on to that attempt even
    /// when `retry_ambiguous` is false.
    pub reconcile: bool,
    /// Is the message still "may have taken effect" from an earlier attempt (its stored
    /// class is `ambiguous`, and no lookup of this attempt said it did not happen)? Then a
    /// failure of this attempt, whatever its class (`transient`: refused before sending;
    /// `invalid`: its destination or its lookup refused by the guard, a secret not
    /// configured on this worker; `permanent`), leaves the message as unknown as it found
    /// it, and counts as ambiguous: retried by the ambiguous rule, and at the end `dead`
    /// with class `ambiguous`, for a person to find out (and `outboxd confirm` to settle),
    /// not `exhausted` or `invalid`, which say nothing took effect and invite a replay.
    pub after_ambiguous: bool,
}

/// Why a message whose provider may have forgotten its key is not sent again: the end of
/// its error when [`Budget::key_window`] withdrew the consent to resend.
pub const KEY_WINDOW_CLOSED: &str = "the provider's key window (the endpoint's key_ttl) has \
     closed since the first attempt, so it is not sent again blind";

impl Budget {
    /// The budget of a message whose provider may have forgotten its key (an endpoint's
    /// `key_ttl` has passed since the first attempt, `closed`): the same key no longer
    /// protects a resend, so an ambiguous outcome is never retried blind. With a lookup
    /// (`reconcile`) it is retried as before, since that attempt asks first and sends only
    /// after the provider said the earlier one did not happen; without one it is `dead`,
    /// class `ambiguous`, for a person to settle.
    pub fn key_window(self, closed: bool) -> Budget {
        Budget {
            retry_ambiguous: self.retry_ambiguous && !closed,
            ..self
        }
    }
}

/// Maps how an attempt ended ([`Ended`], or the class of its failure: `None` when it was
/// delivered) to the next state.
///
/// * delivered: `delivered`; reconciled (a lookup found an earlier attempt took effect):
///   `delivered`, history outcome `reconciled`;
/// * transient: retried while the budget lasts, then `dead` with class `exhausted`;
/// * ambiguous: retried like transient only when the message allows it, or when it names a
///   lookup (`reconcile`: the next attempt asks before it sends); on the last attempt, or
///   when neither holds, `dead` with class `ambiguous`, because a person must find out
///   whether it took effect before replaying it;
/// * permanent and invalid: `dead` at once; but an invalid attempt after an ambiguous one
///   sent nothing, so the earlier one's outcome is still unknown: it counts as ambiguous.
///
/// `retry_after` is the provider's own wish (HTTP `Retry-After`), honoured up to the
/// policy's maximum; `jitter` is a sample in `[0, 1)` (passed in so this stays pure).
pub fn decide(
    ended: impl Into<Ended>,
    budget: Budget,
    policy: &RetryPolicy,
    retry_after: Option<Duration>,
    jitter: f64,
) -> Transition {
    let class = match ended.into() {
        Ended::Delivered => return Transition::Delivered,
        Ended::Reconciled => return Transition::Reconciled,
        Ended::Failed(class) => class,
    };
    // Once an attempt may have taken effect, the message stays "may have taken effect"
    // until an attempt proves otherwise (delivered, reconciled, or a lookup that found
    // nothing, which clears `after_ambiguous`). A later failure of any class proves
    // nothing about the earlier attempt: it counts as ambiguous, so the message is retried
    // by the ambiguous rule and a dead end is class `ambiguous`, for a person to settle,
    // never `exhausted` or `invalid`, which would invite a blind resend. A permanent
    // refusal still ends it at once.
    let class = match class {
        ErrorClass::Permanent if budget.after_ambiguous => {
            return Transition::Dead {
                class: ErrorClass::Ambiguous,
            };
        }
        _ if budget.after_ambiguous => ErrorClass::Ambiguous,
        class => class,
    };
    let budget_left = budget.attempt < budget.max_attempts;
    let delay = || policy.delay(budget.attempt, retry_after, jitter);
    match class {
        ErrorClass::Transient if budget_left => Transition::Retry {
            class,
            delay: delay(),
        },
        ErrorClass::Transient => Transition::Dead {
            class: ErrorClass::Exhausted,
        },
        ErrorClass::Ambiguous if budget_left && (budget.retry_ambiguous || budget.reconcile) => {
            Transition::Retry {
                class,
                delay: delay(),
            }
        }
        ErrorClass::Ambiguous => Transition::Dead {
            class: ErrorClass::Ambiguous,
        },
        ErrorClass::Permanent | ErrorClass::Invalid | ErrorClass::Exhausted => {
            Transition::Dead { class }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(900),
        }
    }

    fn budget(attempt: i32, max_attempts: i32, retry_ambiguous: bool) -> Budget {
        Budget {
            attempt,
            max_attempts,
            retry_ambiguous,
            reconcile: false,
            after_ambiguous: false,
        }
    }

    fn after_ambiguous(attempt: i32, max_attempts: i32, retry_ambiguous: bool) -> Budget {
        Budget {
            after_ambiguous: true,
            ..budget(attempt, max_attempts, retry_ambiguous)
        }
    }

    fn reconciling(attempt: i32, max_attempts: i32, retry_ambiguous: bool) -> Budget {
        Budget {
            reconcile: true,
            ..budget(attempt, max_attempts, retry_ambiguous)
        }
    }

    /// A closed key window withdraws the consent to resend blind, not the lookup's.
    #[test]
    fn a_closed_key_window_sends_nothing_blind() {
        let p = policy();
        let amb = Some(ErrorClass::Ambiguous);
        // Open: retried by consent. Closed: dead, ambiguous, with budget left.
        assert!(matches!(
            decide(amb, budget(1, 5, true).key_window(false), &p, None, 0.5),
            Transition::Retry { .. }
        ));
        assert_eq!(
            decide(amb, budget(1, 5, true).key_window(true), &p, None, 0.5),
            Transition::Dead {
                class: ErrorClass::Ambiguous
            }
        );
        // A refusal to send blind after an ambiguous attempt ends the same way.
        assert_eq!(
            decide(
                amb,
                after_ambiguous(2, 5, true).key_window(true),
                &p,
                None,
                0.5
            ),
            Transition::Dead {
                class: ErrorClass::Ambiguous
            }
        );
        // With a lookup, the next attempt asks first: retried as before.
        assert!(matches!(
            decide(amb, reconciling(1, 5, true).key_window(true), &p, None, 0.5),
            Transition::Retry { .. }
        ));
        // Other outcomes do not change.
        assert_eq!(
            decide(None, budget(1, 5, true).key_window(true), &p, None, 0.5),
            Transition::Delivered
        );
        assert!(matches!(
            decide(
                Some(ErrorClass::Transient),
                budget(1, 5, true).key_window(true),
                &p,
                None,
                0.5
            ),
            Transition::Retry { .. }
        ));
    }

    /// Every arm of the transition table, as a table.
    #[test]
    fn transition_table() {
        use ErrorClass::*;
        let retry = |class| Transition::Retry {
            class,
            delay: Duration::from_secs(5),
        };
        let dead = |class| Transition::Dead { class };
        let failed = |c| Ended::Failed(c);
        let cases: &[(Ended, Budget, Transition)] = &[
            (Ended::Delivered, budget(1, 3, true), Transition::Delivered),
            (Ended::Delivered, budget(3, 3, false), Transition::Delivered),
            (
                Ended::Reconciled,
                reconciling(2, 3, false),
                Transition::Reconciled,
            ),
            (
                Ended::Reconciled,
                reconciling(3, 3, true),
                Transition::Reconciled,
            ),
            (failed(Transient), budget(1, 3, true), retry(Transient)),
            (
                failed(Transient),
                budget(2, 3, false),
                Transition::Retry {
                    class: Transient,
                    delay: Duration::from_secs(10),
                },
            ),
            (failed(Transient), budget(3, 3, true), dead(Exhausted)),
            (failed(Transient), budget(1, 1, true), dead(Exhausted)),
            (failed(Ambiguous), budget(1, 3, true), retry(Ambiguous)),
            (failed(Ambiguous), budget(1, 3, false), dead(Ambiguous)),
            (failed(Ambiguous), budget(3, 3, true), dead(Ambiguous)),
            // A lookup settles an ambiguous outcome: another attempt (which asks first) even
            // without retry_ambiguous, but never past the budget.
            (
                failed(Ambiguous),
                reconciling(1, 3, false),
                retry(Ambiguous),
            ),
            (failed(Ambiguous), reconciling(1, 3, true), retry(Ambiguous)),
            (failed(Ambiguous), reconciling(3, 3, false), dead(Ambiguous)),
            (failed(Ambiguous), reconciling(1, 1, true), dead(Ambiguous)),
            (failed(Transient), reconciling(3, 3, false), dead(Exhausted)),
            (failed(Permanent), reconciling(1, 3, false), dead(Permanent)),
            (failed(Permanent), budget(1, 3, true), dead(Permanent)),
            (failed(Invalid), budget(1, 3, true), dead(Invalid)),
            // Nothing sent after an attempt that may have taken effect: still unknown.
            (
                failed(Invalid),
                after_ambiguous(2, 3, true),
                Transition::Retry {
                    class: Ambiguous,
                    delay: Duration::from_secs(10),
                },
            ),
            (
                failed(Invalid),
                after_ambiguous(2, 3, false),
                dead(Ambiguous),
            ),
            (
                failed(Invalid),
                after_ambiguous(3, 3, true),
                dead(Ambiguous),
            ),
            // A later failure proves nothing about the earlier attempt: still unknown.
            (
                failed(Transient),
                after_ambiguous(3, 3, true),
                dead(Ambiguous),
            ),
            (
                failed(Transient),
                after_ambiguous(2, 3, true),
                Transition::Retry {
                    class: Ambiguous,
                    delay: Duration::from_secs(10),
                },
            ),
            (
                failed(Transient),
                Budget {
                    reconcile: true,
                    ..after_ambiguous(3, 3, false)
                },
                dead(Ambiguous),
            ),
            (
                failed(Permanent),
                after_ambiguous(2, 3, true),
                dead(Ambiguous),
            ),
            (failed(Exhausted), budget(1, 3, true), dead(Exhausted)),
        ];
        for (ended, budget, want) in cases {
            let got = decide(*ended, *budget, &policy(), None, 0.0);
            assert_eq!(got, *want, "{ended:?} at {budget:?}");
            assert_eq!(got.next_state(), want.next_state());
        }
    }

    /// After an ambiguous attempt, no failure ends the message in a class that says
    /// nothing took effect, and none is retried under another class (the stored class is
    /// what keeps it unknown for the next attempt).
    #[test]
    fn after_an_ambiguous_attempt_every_failure_stays_ambiguous() {
        use ErrorClass::*;
        for class in [Transient, Ambiguous, Permanent, Invalid, Exhausted] {
            for (attempt, max) in [(1, 1), (2, 3), (3, 3), (1, 5)] {
                for (retry_ambiguous, reconcile) in
                    [(false, false), (true, false), (false, true), (true, true)]
                {
                    let b = Budget {
                        reconcile,
                        ..after_ambiguous(attempt, max, retry_ambiguous)
                    };
                    let t = decide(Ended::Failed(class), b, &policy(), None, 0.5);
                    assert_eq!(
                        t.error_class(),
                        Some(Ambiguous),
                        "{class:?} at {b:?}: {t:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn transitions_map_to_states_and_outcomes() {
        let retry = Transition::Retry {
            class: ErrorClass::Transient,
            delay: Duration::ZERO,
        };
        assert_eq!(retry.next_state(), State::Pending);
        assert_eq!(retry.outcome(), AttemptOutcome::Retry);
        assert_eq!(Transition::Delivered.next_state(), State::Delivered);
        assert_eq!(Transition::Delivered.error_class(), None);
        let dead = Transition::Dead {
            class: ErrorClass::Permanent,
        };
        assert_eq!(dead.outcome(), AttemptOutcome::Dead);
        assert_eq!(dead.error_class(), Some(ErrorClass::Permanent));
        assert_eq!(Transition::Reconciled.next_state(), State::Delivered);
        assert_eq!(Transition::Reconciled.outcome(), AttemptOutcome::Reconciled);
        assert_eq!(Transition::Reconciled.error_class(), None);
    }

    #[test]
    fn states_round_trip_through_text() {
        for st in State::ALL {
            assert_eq!(State::parse(st.as_str()), Some(st));
        }
        assert_eq!(State::parse("done"), None);
        for o in AttemptOutcome::ALL {
            assert_eq!(AttemptOutcome::parse(o.as_str()), Some(o));
        }
    }
}

/// A destination's circuit breaker (`outbox.destinations.state`), closed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Circuit {
    /// Sending; failures in a row are counted towards the threshold.
    Closed,
    /// Not sending until `open_until`, when one probe may go.
    Open,
    /// One probe in flight (until `probe_until`); the others wait for its answer.
    HalfOpen,
}

impl Circuit {
    /// Every state.
    pub const ALL: [Circuit; 3] = [Circuit::Closed, Circuit::Open, Circuit::HalfOpen];

    /// The name in `outbox.destinations.state`.
    pub fn as_str(self) -> &'static str {
        match self {
            Circuit::Closed => "closed",
            Circuit::Open => "open",
            Circuit::HalfOpen => "half_open",
        }
    }

    /// The state named `s`, if it is one.
    pub fn parse(s: &str) -> Option<Circuit> {
        Circuit::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The one rule of a breaker: where a destination goes after one completer batch of
    /// its outcomes. `failures` is its count in a row before the batch; `threshold` is
    /// `--breaker-threshold`. [`crate::queries::BREAKER_RECORD`] writes exactly this (a
    /// test runs both on every case).
    ///
    /// - A batch of only successes (or permanent refusals: the receiver answered) closes it.
    /// - Failures while it is open (requests that were in flight when it opened) add to the
    ///   count and keep its cooldown; a failure while half-open is the probe failing: open
    ///   again, the cooldown doubled (at most `--retry-max`).
    /// - Otherwise failures after the batch's last success count from zero, others from
    ///   `failures`; reaching the threshold opens it with the base cooldown.
    pub fn after(self, failures: i32, batch: BreakerBatch, threshold: i32) -> CircuitStep {
        if batch.fails == 0 {
            return CircuitStep {
                circuit: Circuit::Closed,
                failures: 0,
                cooldown: Cooldown::Base,
            };
        }
        if !batch.reset {
            match self {
                Circuit::Open => {
                    return CircuitStep {
                        circuit: Circuit::Open,
                        failures: failures + batch.fails,
                        cooldown: Cooldown::Kept,
                    };
                }
                Circuit::HalfOpen => {
                    return CircuitStep {
                        circuit: Circuit::Open,
                        failures: failures + batch.fails,
                        cooldown: Cooldown::Doubled,
                    };
                }
                Circuit::Closed => {}
            }
        }
        let count = if batch.reset { 0 } else { failures } + batch.fails;
        CircuitStep {
            circuit: if count >= threshold {
                Circuit::Open
            } else {
                Circuit::Closed
            },
            failures: count,
            cooldown: Cooldown::Base,
        }
    }
}

/// What one completer batch saw of one destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerBatch {
    /// A success or a permanent refusal came in the batch.
    pub reset: bool,
    /// Transient or ambiguous failures after the batch's last such answer.
    pub fails: i32,
}

/// Where [`Circuit::after`] leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitStep {
    /// The new state.
    pub circuit: Circuit,
    /// Failures in a row now.
    pub failures: i32,
    /// What becomes of the cooldown.
    pub cooldown: Cooldown,
}

/// The cooldown after a step of [`Circuit::after`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cooldown {
    /// `--breaker-cooldown` (and, if the step opens the circuit, open until now + it).
    Base,
    /// The current opening's, unchanged (its `open_until` too).
    Kept,
    /// Twice the last one, at most `--retry-max`, open until now + it.
    Doubled,
}
