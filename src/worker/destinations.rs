//! The limits per destination of this process (`--host-concurrency`, rate limits), applied
//! by each delivery task just before it sends.
//!
//! A message that may not go now is never waited for while holding a delivery slot: a
//! stalled receiver would then hold every slot, and the wait could outlast the lease. It is
//! given back unsent and uncounted instead ([`Admission::Defer`], written by the completer
//! as a [`Deferral`](crate::state::Deferral)), due again at the time it may go. The
//! deferrals are spaced so that a backlog comes back about as fast as it can be sent, not
//! all at once: each destination keeps the next free time (`next`) and hands out one slot
//! after another.
//!
//! * Rate limits: a request may go when the destination's theoretical arrival time (the
//!   GCRA's `tat`) has come; each request moves it one interval on. A request that comes
//!   back late by under one interval keeps the schedule (the round trip through the
//!   database makes every deferred message a little late, and the rate should not drift
//!   below the limit for it); one later than that starts it afresh. So any window of `k`
//!   intervals holds at most `k + 1` requests.
//! * Host concurrency: at most N requests in flight. When all N are busy, the next comes
//!   back after about one request's time divided by N (the mean of recent attempts to that
//!   host), each later one a step after, but never later than one webhook timeout ahead:
//!   past that every request in flight has ended one way or the other, and a receiver that
//!   recovers should not find its backlog parked for hours.
//!
//! A reconciliation lookup is a request to its own host, admitted as above against the
//! lookup's host; the request that its 404 or 410 lets through is the one exception to
//! "never waited for": it waits in its attempt for its own token and place ([`Leave`]),
//! within the attempt's timeout, because a deferral would undo the lookup's attempt and the
//! next one would look up again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::limits::DestinationLimits;
use crate::state::DeferReason;
use crate::support::lock;

/// The shortest deferral: below this the round trip through the database costs more than
/// the wait.
const MIN_DEFER: Duration = Duration::from_millis(10);

/// Per-process state of the limits, keyed by destination.
pub(super) struct Gates {
    limits: DestinationLimits,
    /// The webhook timeout: the longest one request holds a slot.
    timeout: Duration,
    hosts: Mutex<HashMap<String, Host>>,
    /// One schedule per rate-limit entry (several destinations can share an entry: a host
    /// on any port).
    rates: Mutex<Vec<Schedule>>,
}

/// One destination's requests in flight.
#[derive(Default)]
struct Host {
    inflight: usize,
    /// A running mean of how long its requests took.
    mean: Option<Duration>,
    /// When the next deferred message is due back.
    next: Option<Instant>,
}

/// One rate limit's schedule.
#[derive(Default, Clone, Copy)]
struct Schedule {
    /// The earliest time the next request may go (GCRA's theoretical arrival time).
    tat: Option<Instant>,
    /// When the next deferred message is due back.
    next: Option<Instant>,
}

/// Whether a message may be sent now.
pub(super) enum Admission<'a> {
    /// Send it; hold the permit until the request has ended.
    Go(Permit<'a>),
    /// Give it back unsent, due again after this.
    Defer(DeferReason, Duration),
}

/// One request in flight to a destination under `--host-concurrency`.
pub(super) struct Permit<'a> {
    held: Option<(&'a Gates, String, Instant)>,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if let Some((gates, destination, started)) = self.held.take() {
            gates.finished(&destination, started.elapsed());
        }
    }
}

impl Gates {
    pub(super) fn new(limits: DestinationLimits, timeout: Duration) -> Gates {
        let rates = vec![Schedule::default(); limits.rate_limits.0.len()];
        Gates {
            limits,
            timeout,
            hosts: Mutex::new(HashMap::new()),
            rates: Mutex::new(rates),
        }
    }

    /// May a message to `destination` go now? `None` (e-mail, or a URL without a name) and
    /// a worker without limits always may.
    pub(super) fn admit(&self, destination: Option<&str>) -> Admission<'_> {
        let none = Admission::Go(Permit { held: None });
        let Some(destination) = destination else {
            return none;
        };
        if self.limits.is_off() {
            return none;
        }
        self.admit_at(destination, Instant::now())
    }

    fn admit_at(&self, destination: &str, now: Instant) -> Admission<'_> {
        let cap = self.limits.host_concurrency;
        let mut hosts = lock(&self.hosts);
        if cap > 0 {
            let host = host_mut(&mut hosts, destination);
            if host.inflight >= cap {
                let step = self.busy_step(host.mean, cap);
                let delay = next_slot(&mut host.next, now, step, self.timeout);
                return Admission::Defer(DeferReason::HostBusy, delay);
            }
        }
        if let Some((index, rate)) = self.limits.rate_limits.for_destination(destination) {
            let mut rates = lock(&self.rates);
            let s = &mut rates[index];
            let interval = rate.interval();
            match s.tat {
                Some(tat) if tat > now => {
                    // Not yet: come back at the next free slot, at or after `tat`.
                    let wait = tat - now;
                    let step = interval.max(MIN_DEFER);
                    let slot = match s.next {
                        Some(n) if n > tat => n,
                        _ => tat,
                    };
                    s.next = Some(slot + step);
                    return Admission::Defer(
                        DeferReason::RateLimit,
                        (slot - now).max(wait).max(MIN_DEFER),
                    );
                }
                Some(tat) if now.saturating_duration_since(tat) < interval => {
                    s.tat = Some(tat + interval);
                }
                _ => s.tat = Some(now + interval),
            }
        }
        if cap == 0 {
            return Admission::Go(Permit { held: None });
        }
        host_mut(&mut hosts, destination).inflight += 1;
        Admission::Go(Permit {
            held: Some((self, destination.to_owned(), now)),
        })
    }

    /// Books the request that follows a reconciliation lookup in its attempt
    /// ([`Leave`]): it waits in the attempt for its turn rather than be deferred. At a busy
    /// host it is told when to ask again; under a rate limit it books the next token, if
    /// that comes by `until`, ahead of the messages deferred to it (they are deferred again
    /// when they come back): it has its lease and its slot already, and its lookup's answer
    /// is fresh.
    fn book_at(&self, destination: &str, now: Instant, until: Instant) -> Booking<'_> {
        let cap = self.limits.host_concurrency;
        let mut hosts = lock(&self.hosts);
        if cap > 0 {
            if let Some(host) = hosts.get(destination) {
                if host.inflight >= cap {
                    return Booking::Busy(self.busy_step(host.mean, cap));
                }
            }
        }
        let mut wait = Duration::ZERO;
        if let Some((index, rate)) = self.limits.rate_limits.for_destination(destination) {
            let mut rates = lock(&self.rates);
            let s = &mut rates[index];
            let interval = rate.interval();
            match s.tat {
                Some(tat) if tat > until => return Booking::TooLate,
                Some(tat) if tat > now => {
                    wait = tat - now;
                    s.tat = Some(tat + interval);
                }
                Some(tat) if now.saturating_duration_since(tat) < interval => {
                    s.tat = Some(tat + interval);
                }
                _ => s.tat = Some(now + interval),
            }
        }
        if cap == 0 {
            return Booking::Go(Permit { held: None }, wait);
        }
        // The place is taken now, for the wait too: the token is no use without it.
        host_mut(&mut hosts, destination).inflight += 1;
        Booking::Go(
            Permit {
                held: Some((self, destination.to_owned(), now + wait)),
            },
            wait,
        )
    }

    /// How long a request that finds its host busy waits before it asks again: about one
    /// request's time divided among the host's places, within the shortest deferral and the
    /// timeout.
    fn busy_step(&self, mean: Option<Duration>, cap: usize) -> Duration {
        let mean = mean.unwrap_or(self.timeout / 4);
        // Not `clamp`: a webhook timeout under MIN_DEFER (`--webhook-timeout 5ms` is
        // allowed) would make its bounds cross, and it panics then.
        (mean / u32::try_from(cap).unwrap_or(u32::MAX))
            .max(MIN_DEFER)
            .min(self.timeout.max(MIN_DEFER))
    }

    /// A request to `destination` ended after `took`.
    fn finished(&self, destination: &str, took: Duration) {
        let mut hosts = lock(&self.hosts);
        let Some(host) = hosts.get_mut(destination) else {
            return;
        };
        host.inflight = host.inflight.saturating_sub(1);
        host.mean = Some(match host.mean {
            Some(m) => m.mul_f64(0.8) + took.mul_f64(0.2),
            None => took,
        });
        // A destination with nothing in flight and no deferral outstanding is forgotten,
        // so the map holds only the destinations being sent to.
        if host.inflight == 0 && host.next.is_none_or(|n| n <= Instant::now()) {
            hosts.remove(destination);
        }
    }
}

/// What [`Gates::book_at`] gives the request after a lookup.
enum Booking<'a> {
    /// It may go after this wait (zero: at once), holding the permit.
    Go(Permit<'a>, Duration),
    /// Its host is busy: ask again after this.
    Busy(Duration),
    /// The rate's next token comes too late.
    TooLate,
}

/// One attempt's standing with the limits when it looks up before it sends
/// ([`crate::deliver::RequestLimits`]): the lookup's permit, at the lookup's host, taken
/// before the attempt began and given back when the lookup ends; then, if the lookup lets
/// the request through, the request's own permit at the webhook's host, waited for.
/// Dropped when the attempt ends, which gives back what it still holds.
pub(super) struct Leave<'g> {
    gates: &'g Gates,
    /// The webhook's destination (`None`: not limited).
    destination: Option<String>,
    lookup: Mutex<Option<Permit<'g>>>,
    request: Mutex<Option<Permit<'g>>>,
}

impl<'g> Leave<'g> {
    /// `lookup`: the permit the lookup was admitted with.
    pub(super) fn new(gates: &'g Gates, destination: Option<String>, lookup: Permit<'g>) -> Self {
        Leave {
            gates,
            destination,
            lookup: Mutex::new(Some(lookup)),
            request: Mutex::new(None),
        }
    }

    async fn wait(&self, until: Instant) -> bool {
        let Some(destination) = self.destination.as_deref() else {
            return true;
        };
        if self.gates.limits.is_off() {
            return true;
        }
        loop {
            let now = Instant::now();
            match self.gates.book_at(destination, now, until) {
                Booking::Go(permit, wait) => {
                    *lock(&self.request) = Some(permit);
                    if !wait.is_zero() {
                        tokio::time::sleep(wait).await;
                    }
                    return true;
                }
                Booking::Busy(step) => {
                    if now >= until {
                        return false;
                    }
                    tokio::time::sleep(step.min(until - now)).await;
                }
                Booking::TooLate => return false,
            }
        }
    }
}

impl crate::deliver::RequestLimits for Leave<'_> {
    fn lookup_ended(&self) {
        let permit = lock(&self.lookup).take();
        drop(permit);
    }

    fn wait_for_request(
        &self,
        until: Instant,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>> {
        Box::pin(self.wait(until))
    }
}

/// The entry of `destination`, made on first use.
fn host_mut<'m>(hosts: &'m mut HashMap<String, Host>, destination: &str) -> &'m mut Host {
    hosts.entry(destination.to_owned()).or_default()
}

/// The next free slot of a schedule, `step` apart, but never more than `horizon` ahead:
/// beyond that, a slot in the last half of the horizon, spread by chance.
fn next_slot(
    next: &mut Option<Instant>,
    now: Instant,
    step: Duration,
    horizon: Duration,
) -> Duration {
    let slot = match *next {
        Some(n) if n > now => n,
        _ => now + step,
    };
    let delay = slot - now;
    if delay <= horizon {
        *next = Some(slot + step);
        return delay.max(MIN_DEFER);
    }
    horizon
        .mul_f64(0.5 + 0.5 * rand::random::<f64>())
        .max(MIN_DEFER)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::limits::RateLimits;

    fn gates(cap: usize, rates: &str) -> Gates {
        Gates::new(
            DestinationLimits {
                host_concurrency: cap,
                rate_limits: RateLimits::parse(rates).unwrap(),
            },
            Duration::from_secs(10),
        )
    }

    fn defer(a: Admission<'_>) -> Option<(DeferReason, Duration)> {
        match a {
            Admission::Go(_) => None,
            Admission::Defer(r, d) => Some((r, d)),
        }
    }

    /// A webhook timeout shorter than the shortest deferral is allowed, and a busy host
    /// must not panic the delivery task then (it did, through `clamp`'s crossed bounds).
    #[test]
    fn a_timeout_below_the_shortest_deferral_still_defers() {
        let g = Gates::new(
            DestinationLimits {
                host_concurrency: 1,
                rate_limits: RateLimits::parse("").unwrap(),
            },
            Duration::from_millis(5),
        );
        let t = Instant::now();
        let _held = g.admit_at("a.example", t);
        let (reason, delay) = defer(g.admit_at("a.example", t)).unwrap();
        assert_eq!(reason, DeferReason::HostBusy);
        assert!(delay >= MIN_DEFER, "{delay:?}");
    }

    #[test]
    fn host_concurrency_caps_requests_in_flight_per_destination() {
        let g = gates(2, "");
        let t = Instant::now();
        let a = g.admit_at("a.example", t);
        let b = g.admit_at("a.example", t);
        assert!(matches!(a, Admission::Go(_)) && matches!(b, Admission::Go(_)));
        // A third to the same destination waits; another destination does not.
        let (reason, first) = defer(g.admit_at("a.example", t)).unwrap();
        assert_eq!(reason, DeferReason::HostBusy);
        assert!(matches!(g.admit_at("b.example", t), Admission::Go(_)));
        // Later ones come back one step after another, never past the timeout.
        let (_, second) = defer(g.admit_at("a.example", t)).unwrap();
        assert!(second > first, "{first:?} then {second:?}");
        for _ in 0..10_000 {
            let (_, d) = defer(g.admit_at("a.example", t)).unwrap();
            assert!(d <= Duration::from_secs(10), "{d:?}");
        }
        drop(a);
        assert!(matches!(g.admit_at("a.example", t), Admission::Go(_)));
    }

    #[test]
    fn a_rate_limit_spaces_requests_and_defers_the_rest_to_their_turn() {
        let g = gates(0, "h.example=5/s");
        let t0 = Instant::now();
        assert!(matches!(g.admit_at("h.example", t0), Admission::Go(_)));
        // Forty more at once: each deferred to its own turn, 200 ms apart.
        let delays: Vec<Duration> = (0..40)
            .map(|_| defer(g.admit_at("h.example", t0)).unwrap().1)
            .collect();
        assert_eq!(delays[0], Duration::from_millis(200));
        assert_eq!(delays[1], Duration::from_millis(400));
        assert_eq!(delays[39], Duration::from_millis(8000));
        // Coming back on time (a little late), each goes; never two in one interval.
        let mut sent = 1;
        let mut at = t0;
        for i in 1..=15u32 {
            at = t0 + Duration::from_millis(200) * i + Duration::from_millis(15);
            if matches!(g.admit_at("h.example", at), Admission::Go(_)) {
                sent += 1;
            }
            assert!(
                defer(g.admit_at("h.example", at)).is_some(),
                "a second in one interval"
            );
        }
        assert_eq!(sent, 16, "one per interval over 3 s, with no drift");
        // Another port of the same host shares the entry.
        assert!(defer(g.admit_at("h.example:8443", at)).is_some());
        // A destination without an entry is not limited.
        assert!(matches!(g.admit_at("other.example", at), Admission::Go(_)));
    }

    #[test]
    fn the_request_after_a_lookup_books_the_next_token_ahead_of_deferred_messages() {
        let g = gates(0, "h.example=1/s");
        let t = Instant::now();
        let second = Duration::from_secs(1);
        // The lookup takes a token; a message deferred meanwhile is due back at the next.
        assert!(matches!(g.admit_at("h.example", t), Admission::Go(_)));
        assert_eq!(defer(g.admit_at("h.example", t)).unwrap().1, second);
        // The request after the lookup books that next token and waits for it.
        match g.book_at("h.example", t, t + 5 * second) {
            Booking::Go(_, wait) => assert_eq!(wait, second),
            _ => panic!("the next token comes in time"),
        }
        // The deferred message, back on time, finds it taken and is deferred again.
        let back = t + second + Duration::from_millis(5);
        assert!(defer(g.admit_at("h.example", back)).is_some());
        // A token that comes after `until` is not booked.
        assert!(matches!(
            g.book_at("h.example", t, t + second / 2),
            Booking::TooLate
        ));
    }

    #[test]
    fn the_request_after_a_lookup_waits_for_a_place_and_then_holds_it() {
        let g = gates(1, "");
        let t = Instant::now();
        let until = t + Duration::from_secs(5);
        let lookup = g.admit_at("h.example", t);
        assert!(matches!(
            g.book_at("h.example", t, until),
            Booking::Busy(step) if step >= MIN_DEFER
        ));
        drop(lookup);
        let request = g.book_at("h.example", t, until);
        assert!(matches!(&request, Booking::Go(_, wait) if wait.is_zero()));
        assert!(
            defer(g.admit_at("h.example", t)).is_some(),
            "the place is held"
        );
        drop(request);
        assert!(matches!(g.admit_at("h.example", t), Admission::Go(_)));
    }

    #[test]
    fn no_limits_cost_nothing_and_e_mail_is_never_limited() {
        let g = gates(0, "");
        for _ in 0..1000 {
            assert!(matches!(g.admit(Some("a.example")), Admission::Go(_)));
        }
        assert!(lock(&g.hosts).is_empty());
        let g = gates(1, "a.example=1/m");
        let _held = g.admit(Some("a.example"));
        assert!(matches!(g.admit(None), Admission::Go(_)));
    }
}
