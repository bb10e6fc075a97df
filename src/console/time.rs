//! Times as the console shows them: relative to the database's clock ("3 min ago", "in
//! 2 h"), with the exact time (RFC 3339, UTC, whole seconds) in a `<time>` element's
//! `datetime` and `title`. Computed here, on the server: the pages run no script.
//!
//! The one formatter of times for every page, so that they all read alike.

use maud::{Markup, html};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The database's clock when the page was made: what "ago" is counted from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock(pub OffsetDateTime);

impl Clock {
    /// A stored time (RFC 3339, as `ops` returns it) as a `<time>` element: relative text,
    /// the exact time in `datetime` and `title`. Text that is no time (`infinity`, a year
    /// past what can be read) is shown as it is.
    pub(crate) fn at(&self, stamp: &str) -> Markup {
        match parse(stamp) {
            Some(t) => {
                let exact = exact(t);
                html! { time datetime=(exact) title=(exact) { (relative(self.0, t)) } }
            }
            None => html! { span { (crate::text::escape(stamp)) } },
        }
    }

    /// [`Clock::at`] with the words around the span chosen by its side of now: `past`
    /// before a span that has passed ("closed 2 days ago"), `future` before one to come
    /// ("closes in 3 h").
    pub(crate) fn either(&self, stamp: &str, past: &str, future: &str) -> Markup {
        match parse(stamp) {
            Some(t) => {
                let exact = exact(t);
                let (words, span) = if t <= self.0 {
                    (past, relative(self.0, t))
                } else {
                    (future, relative(self.0, t))
                };
                html! { (words) " " time datetime=(exact) title=(exact) { (span) } }
            }
            None => html! { span { (crate::text::escape(stamp)) } },
        }
    }

    /// Has the stored time passed?
    pub(crate) fn passed(&self, stamp: &str) -> bool {
        parse(stamp).is_some_and(|t| t <= self.0)
    }
}

fn parse(stamp: &str) -> Option<OffsetDateTime> {
    OffsetDateTime::parse(stamp, &Rfc3339).ok()
}

/// RFC 3339 in UTC, to the second: `2026-12-07T09:30:05Z`.
pub(crate) fn exact(t: OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    let t = t.replace_nanosecond(0).unwrap_or(t);
    t.format(&Rfc3339).unwrap_or_else(|_| t.to_string())
}

/// How far `t` is from `now`, in the largest unit that fits, rounded down: "just now",
/// "42 s ago", "3 min ago", "in 2 h", "5 days ago", "4 months ago", "2 years ago".
pub(crate) fn relative(now: OffsetDateTime, t: OffsetDateTime) -> String {
    let secs = (t - now).whole_seconds();
    let n = secs.unsigned_abs();
    if n == 0 {
        return "just now".to_owned();
    }
    let span = if n < 60 {
        format!("{n} s")
    } else if n < 3600 {
        format!("{} min", n / 60)
    } else if n < 48 * 3600 {
        format!("{} h", n / 3600)
    } else if n < 90 * 86_400 {
        format!("{} days", n / 86_400)
    } else if n < 2 * 365 * 86_400 {
        format!("{} months", n / (30 * 86_400))
    } else {
        format!("{} years", n / (365 * 86_400))
    };
    if secs < 0 {
        format!("{span} ago")
    } else {
        format!("in {span}")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn at(s: &str) -> OffsetDateTime {
        OffsetDateTime::parse(s, &Rfc3339).unwrap()
    }

    #[test]
    fn spans_read_in_the_largest_unit_that_fits() {
        let now = at("2026-12-07T12:00:00Z");
        for (t, want) in [
            ("2026-12-07T12:00:00.400Z", "just now"),
            ("2026-12-07T11:59:18Z", "42 s ago"),
            ("2026-12-07T11:56:10Z", "3 min ago"),
            ("2026-12-07T14:00:00Z", "in 2 h"),
            ("2026-12-06T00:00:00Z", "36 h ago"),
            ("2026-12-02T11:00:00Z", "5 days ago"),
            ("2026-08-01T00:00:00Z", "4 months ago"),
            ("2023-01-01T00:00:00Z", "3 years ago"),
            ("2026-12-10T13:00:00Z", "in 3 days"),
        ] {
            assert_eq!(relative(now, at(t)), want, "{t}");
        }
    }

    #[test]
    fn the_exact_time_is_utc_to_the_second() {
        assert_eq!(
            exact(at("2026-12-07T13:30:05.123456+01:00")),
            "2026-12-07T12:30:05Z"
        );
    }

    #[test]
    fn a_time_element_carries_the_exact_time_and_text_that_is_no_time_stays_as_it_is() {
        let clock = Clock(at("2026-12-07T12:00:00Z"));
        let m = clock.at("2026-12-07T11:56:59.5Z").into_string();
        assert_eq!(
            m,
            "<time datetime=\"2026-12-07T11:56:59Z\" title=\"2026-12-07T11:56:59Z\">3 min ago</time>"
        );
        assert_eq!(clock.at("infinity").into_string(), "<span>infinity</span>");
        let w = clock
            .either("2026-12-07T15:00:00Z", "closed", "closes")
            .into_string();
        assert!(w.starts_with("closes <time"), "{w}");
        assert!(w.ends_with(">in 3 h</time>"), "{w}");
        let w = clock
            .either("2026-12-05T12:00:00Z", "closed", "closes")
            .into_string();
        assert!(w.ends_with(">2 days ago</time>"), "{w}");
        assert!(clock.passed("2026-12-05T12:00:00Z"));
    }
}
