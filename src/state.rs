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

/// What the worker writes after an attempt: the next state and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transition {
    /// `running → delivered`.
    Delivered,
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
            Transition::Delivered => State::Delivered,
            Transition::Retry { .. } => State::Pending,
            Transition::Dead { .. } => State::Dead,
        }
    }

    /// The outcome recorded in the attempt history.
    pub fn outcome(&self) -> AttemptOutcome {
        match self {
            Transition::Delivered => AttemptOutcome::Delivered,
            Transition::Retry { .. } => AttemptOutcome::Retry,
            Transition::Dead { .. } => AttemptOutcome::Dead,
        }
    }

    /// The error class stored on the message, if the attempt failed.
    pub fn error_class(&self) -> Option<ErrorClass> {
        match self {
            Transition::Delivered => None,
            Transition::Retry { class, .. } | Transition::Dead { class } => Some(*class),
        }
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
}

/// Maps the class of an attempt's failure (`None` when it was delivered) to the next state.
///
/// * transient: retried while the budget lasts, then `dead` with class `exhausted`;
/// * ambiguous: retried like transient only when the message allows it; on the last attempt,
///   or when it does not, `dead` with class `ambiguous`, because a person must find out
///   whether it took effect before replaying it;
/// * permanent and invalid: `dead` at once.
///
/// `retry_after` is the provider's own wish (HTTP `Retry-After`), honoured up to the
/// policy's maximum; `jitter` is a sample in `[0, 1)` (passed in so this stays pure).
pub fn decide(
    failure: Option<ErrorClass>,
    budget: Budget,
    policy: &RetryPolicy,
    retry_after: Option<Duration>,
    jitter: f64,
) -> Transition {
    let Some(class) = failure else {
        return Transition::Delivered;
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
        ErrorClass::Ambiguous if budget_left && budget.retry_ambiguous => Transition::Retry {
            class,
            delay: delay(),
        },
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
        }
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
        let cases: &[(Option<ErrorClass>, Budget, Transition)] = &[
            (None, budget(1, 3, true), Transition::Delivered),
            (None, budget(3, 3, false), Transition::Delivered),
            (Some(Transient), budget(1, 3, true), retry(Transient)),
            (
                Some(Transient),
                budget(2, 3, false),
                Transition::Retry {
                    class: Transient,
                    delay: Duration::from_secs(10),
                },
            ),
            (Some(Transient), budget(3, 3, true), dead(Exhausted)),
            (Some(Transient), budget(1, 1, true), dead(Exhausted)),
            (Some(Ambiguous), budget(1, 3, true), retry(Ambiguous)),
            (Some(Ambiguous), budget(1, 3, false), dead(Ambiguous)),
            (Some(Ambiguous), budget(3, 3, true), dead(Ambiguous)),
            (Some(Permanent), budget(1, 3, true), dead(Permanent)),
            (Some(Invalid), budget(1, 3, true), dead(Invalid)),
            (Some(Exhausted), budget(1, 3, true), dead(Exhausted)),
        ];
        for (failure, budget, want) in cases {
            let got = decide(*failure, *budget, &policy(), None, 0.0);
            assert_eq!(got, *want, "{failure:?} at {budget:?}");
            assert_eq!(got.next_state(), want.next_state());
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
