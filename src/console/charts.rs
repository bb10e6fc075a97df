//! The overview's latency and backlog charts: SVG drawn here, one bar (or pair of bars) per
//! minute of the last hour, oldest on the left, each with a `<title>` that gives its
//! figures in words (a tooltip, and what a screen reader reads), and a line of text under
//! the picture for readers without it.
//!
//! A minute with nothing to measure is a gap, never a zero: a latency needs deliveries,
//! and a backlog figure needs a worker running to sample it. Presentation comes from
//! classes in the stylesheet (the CSP allows no inline style), and every figure passes
//! through maud, which escapes it.

use maud::{Markup, html};

use crate::ops::{BacklogMinute, BacklogSample, MinuteLatency, Percentiles};

/// The picture's size in SVG units (it scales to the page's width).
const W: f64 = 720.0;
const H: f64 = 160.0;
/// Room above the plot for the scale's label, and below it for the time axis.
const TOP: f64 = 14.0;
const BOTTOM: f64 = 18.0;
/// The plot's height: a bar of the scale's full value is this tall.
const PLOT: f64 = H - TOP - BOTTOM;
/// A sampled minute is at least this tall, so that "nothing waited" (a sample of 0) is
/// told apart from "no sample" (no bar).
const MIN_BAR: f64 = 1.0;

/// One minute of a chart: its layers (a class and a value, drawn back to front, so the
/// tallest goes first), or none for a gap; and its title.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Bar {
    pub(crate) layers: Vec<(&'static str, f64)>,
    pub(crate) title: String,
}

/// A chart of `bars` (one per minute, oldest first) on a linear scale from 0 to the
/// largest value, which the top-left label names (through `unit`). Values that are not
/// finite are left out, like a gap.
pub(crate) fn bars(id: &str, label: &str, unit: fn(f64) -> String, bars: &[Bar]) -> Markup {
    let peak = bars
        .iter()
        .flat_map(|b| b.layers.iter().map(|(_, v)| *v))
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max);
    let n = bars.len().max(1) as f64;
    let slot = W / n;
    let y = |v: f64| {
        if peak > 0.0 {
            (PLOT * v / peak).clamp(0.0, PLOT)
        } else {
            0.0
        }
    };
    let base = H - BOTTOM;
    html! {
        svg id=(id) viewBox={ "0 0 " (W) " " (H) } role="img" aria-label=(label)
            xmlns="http://www.w3.org/2000/svg" {
            line.axis x1="0" y1=(fmt(base)) x2=(W) y2=(fmt(base)) {}
            line.grid x1="0" y1=(fmt(TOP)) x2=(W) y2=(fmt(TOP)) {}
            text.scale x="0" y="10" { (unit(peak)) }
            @for (i, b) in bars.iter().enumerate() {
                @let x = i as f64 * slot + 1.0;
                @let width = (slot - 2.0).max(0.5);
                @let drawn: Vec<&(&str, f64)> = b.layers.iter().filter(|(_, v)| v.is_finite()).collect();
                g {
                    title { (b.title) }
                    @if drawn.is_empty() {
                        // Nothing drawn, but the minute still answers a pointer.
                        rect.gap x=(fmt(x)) y=(fmt(TOP)) width=(fmt(width)) height=(fmt(PLOT)) {}
                    }
                    @for (class, v) in drawn {
                        @let h = y(*v).max(MIN_BAR);
                        rect class=(class) x=(fmt(x)) y=(fmt(base - h)) width=(fmt(width)) height=(fmt(h)) {}
                    }
                }
            }
            text x="0" y=(H - 4.0) { "60 min ago" }
            text x=(W / 2.0) y=(H - 4.0) text-anchor="middle" { "30 min ago" }
            text x=(W) y=(H - 4.0) text-anchor="end" { "now" }
        }
    }
}

/// One latency chart: p99 behind, p50 in front, per minute; `pick` chooses which latency
/// of the minute and how many deliveries it is made of.
pub(crate) fn latency(
    id: &str,
    what: &str,
    minutes: &[MinuteLatency],
    pick: fn(&MinuteLatency) -> (i64, Option<Percentiles>),
) -> Markup {
    let chart: Vec<Bar> = minutes
        .iter()
        .map(|m| {
            let (n, p) = pick(m);
            let when = minute_label(m.minute);
            match p {
                Some(p) => Bar {
                    layers: vec![("p99", p.p99), ("p50", p.p50)],
                    title: format!(
                        "{when}: p50 {}, p99 {} ({n} {})",
                        seconds_text(p.p50),
                        seconds_text(p.p99),
                        if n == 1 { "delivery" } else { "deliveries" }
                    ),
                },
                None => Bar {
                    layers: Vec::new(),
                    title: format!("{when}: no deliveries"),
                },
            }
        })
        .collect();
    let latest = minutes
        .iter()
        .rev()
        .find_map(|m| pick(m).1.map(|p| (m.minute, p)));
    let worst = minutes
        .iter()
        .filter_map(|m| pick(m).1)
        .map(|p| p.p99)
        .fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))));
    let label = match latest {
        Some((_, p)) => format!(
            "{what}: latest p50 {}, p99 {}",
            seconds_text(p.p50),
            seconds_text(p.p99)
        ),
        None => format!("{what}: no deliveries in the last hour"),
    };
    html! {
        (bars(id, &label, seconds_text, &chart))
        p.legend id={ (id) "-summary" } {
            @match latest {
                Some((minute, p)) => {
                    span.p50 { "p50 " b data-seconds=(p.p50) { (seconds_text(p.p50)) } }
                    span.p99 { "p99 " b data-seconds=(p.p99) { (seconds_text(p.p99)) } }
                    span.muted { "at " (minute_label(minute)) ", the latest minute with deliveries" }
                    @if let Some(w) = worst {
                        span.muted.worst { "highest p99 of the hour: " (seconds_text(w)) }
                    }
                }
                None => { span.muted { "No deliveries in the last hour." } }
            }
        }
    }
}

/// The backlog chart: per minute, how long the oldest due message had waited when a worker
/// sampled it.
pub(crate) fn backlog(minutes: &[BacklogMinute]) -> Markup {
    let chart: Vec<Bar> = minutes
        .iter()
        .map(|m| {
            let when = minute_label(m.minute);
            match m.sample {
                Some(s) => Bar {
                    layers: vec![("backlog", s.oldest_due_seconds)],
                    title: format!(
                        "{when}: oldest due {}, {} due",
                        seconds_text(s.oldest_due_seconds),
                        due_text(&s)
                    ),
                },
                None => Bar {
                    layers: Vec::new(),
                    title: format!("{when}: no sample (no worker was running)"),
                },
            }
        })
        .collect();
    let sampled = minutes.iter().filter(|m| m.sample.is_some()).count();
    let label =
        format!("Age of the oldest due message, sampled in {sampled} of the last 60 minutes");
    html! {
        (bars("backlog-chart", &label, seconds_text, &chart))
        p.legend id="backlog-summary" {
            span.backlog { "oldest due, as a worker sampled it each minute" }
            span.muted { (sampled) " of 60 minutes sampled; a gap is a minute no worker was running" }
        }
    }
}

/// A count of due messages as a sample holds it: counted up to a cap, so the cap itself
/// reads "at least".
fn due_text(s: &BacklogSample) -> String {
    if s.capped {
        format!("at least {}", s.due)
    } else {
        s.due.to_string()
    }
}

/// A duration in seconds, as an operator reads it: `2.3 ms`, `340 ms`, `1.2 s`, `4.5 min`,
/// `2.0 h`.
pub(crate) fn seconds_text(s: f64) -> String {
    if !s.is_finite() {
        return "-".to_owned();
    }
    let s = s.max(0.0);
    if s == 0.0 {
        "0 s".to_owned()
    } else if s < 0.01 {
        format!("{:.1} ms", s * 1000.0)
    } else if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

fn fmt(v: f64) -> String {
    format!("{v:.1}")
}

/// `HH:MM UTC` of a minute given in unix seconds.
pub(crate) fn minute_label(unix: i64) -> String {
    let secs = unix.rem_euclid(86_400);
    format!("{:02}:{:02} UTC", secs / 3600, secs % 3600 / 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_700_000_000 - 1_700_000_000 % 60;

    fn hour(f: impl Fn(i64) -> MinuteLatency) -> Vec<MinuteLatency> {
        (0..60).map(|i| f(T0 + i * 60)).collect()
    }

    fn quiet(minute: i64) -> MinuteLatency {
        MinuteLatency {
            minute,
            attempts: 0,
            attempt: None,
            messages: 0,
            end_to_end: None,
        }
    }

    fn attempts(m: &MinuteLatency) -> (i64, Option<Percentiles>) {
        (m.attempts, m.attempt)
    }

    /// The `height` of every `rect` of `class`, in order.
    fn heights(svg: &str, class: &str) -> Vec<f64> {
        svg.split("<rect ")
            .skip(1)
            .filter(|r| r.starts_with(&format!("class=\"{class}\"")))
            .map(|r| {
                let h = r.split("height=\"").nth(1).expect("a rect has a height");
                let end = h.find('"').expect("a quoted height");
                h[..end].parse().expect("a height is a number")
            })
            .collect()
    }

    #[test]
    fn the_scale_is_the_largest_p99_and_p50_is_drawn_in_proportion() {
        let minutes = hour(|minute| {
            if minute == T0 + 10 * 60 {
                MinuteLatency {
                    attempts: 4,
                    attempt: Some(Percentiles { p50: 0.1, p99: 0.4 }),
                    ..quiet(minute)
                }
            } else if minute == T0 + 59 * 60 {
                MinuteLatency {
                    attempts: 1,
                    attempt: Some(Percentiles { p50: 0.2, p99: 0.2 }),
                    ..quiet(minute)
                }
            } else {
                quiet(minute)
            }
        });
        let svg = latency("lat", "Attempts", &minutes, attempts).into_string();
        assert_eq!(heights(&svg, "p99"), vec![PLOT, PLOT / 2.0]);
        assert_eq!(heights(&svg, "p50"), vec![PLOT / 4.0, PLOT / 2.0]);
        assert!(svg.contains(">400 ms</text>"), "the scale's label: {svg}");
        assert!(
            svg.contains("p50 100 ms, p99 400 ms (4 deliveries)"),
            "{svg}"
        );
        assert!(svg.contains("p50 200 ms, p99 200 ms (1 delivery)"), "{svg}");
        assert!(
            svg.contains("highest p99 of the hour: 400 ms"),
            "the summary: {svg}"
        );
        assert!(svg.contains("the latest minute with deliveries"), "{svg}");
        assert!(!svg.contains("style="), "the CSP forbids inline style");
    }

    #[test]
    fn a_minute_without_deliveries_is_a_gap_not_a_zero() {
        let minutes = hour(|minute| {
            if minute == T0 {
                MinuteLatency {
                    attempts: 2,
                    attempt: Some(Percentiles {
                        p50: 0.05,
                        p99: 0.08,
                    }),
                    ..quiet(minute)
                }
            } else {
                quiet(minute)
            }
        });
        let svg = latency("lat", "Attempts", &minutes, attempts).into_string();
        assert_eq!(
            svg.matches("<title>").count(),
            60,
            "every minute has a title"
        );
        assert_eq!(svg.matches("no deliveries</title>").count(), 59);
        assert_eq!(heights(&svg, "p50").len(), 1);
        assert_eq!(heights(&svg, "gap").len(), 59);
        assert!(!svg.contains(">0 s<") && !svg.contains("p50 0"), "{svg}");

        let none = latency("lat", "Attempts", &hour(quiet), attempts).into_string();
        assert!(none.contains("No deliveries in the last hour."), "{none}");
        assert!(heights(&none, "p50").is_empty());
    }

    #[test]
    fn every_bar_names_its_minute_and_the_axes_are_labelled() {
        let minutes: Vec<BacklogMinute> = (0..60)
            .map(|i| BacklogMinute {
                minute: T0 + i * 60,
                sample: (i >= 30).then_some(BacklogSample {
                    due: if i == 59 { 100_000 } else { 3 },
                    capped: i == 59,
                    oldest_due_seconds: if i == 59 { 7200.0 } else { 0.0 },
                }),
            })
            .collect();
        let svg = backlog(&minutes).into_string();
        for m in &minutes {
            assert!(svg.contains(&minute_label(m.minute)), "{}", m.minute);
        }
        for axis in ["60 min ago", "30 min ago", "now", ">2.0 h</text>"] {
            assert!(svg.contains(axis), "{axis}: {svg}");
        }
        assert!(
            svg.contains("oldest due 2.0 h, at least 100000 due"),
            "{svg}"
        );
        assert_eq!(svg.matches("no sample (no worker was running)").count(), 30);
        // A sample of nothing waiting is a sliver, not a gap.
        let drawn = heights(&svg, "backlog");
        assert_eq!(drawn.len(), 30);
        assert_eq!(drawn.iter().filter(|h| **h == MIN_BAR).count(), 29);
        assert!(
            svg.contains("sampled in 30 of the last 60 minutes"),
            "{svg}"
        );
    }

    #[test]
    fn titles_are_escaped_and_values_that_are_not_finite_are_gaps() {
        let svg = bars(
            "x",
            "a \"label\" <b>",
            seconds_text,
            &[
                Bar {
                    layers: vec![("p50", f64::NAN), ("p99", f64::INFINITY)],
                    title: "<script>alert(1)</script> & more".into(),
                },
                Bar {
                    layers: vec![("p50", 2.0)],
                    title: "ok".into(),
                },
            ],
        )
        .into_string();
        assert!(!svg.contains("<script>"), "{svg}");
        assert!(
            svg.contains("&lt;script&gt;alert(1)&lt;/script&gt; &amp; more"),
            "{svg}"
        );
        assert!(
            svg.contains("aria-label=\"a &quot;label&quot; &lt;b&gt;\""),
            "{svg}"
        );
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        assert_eq!(heights(&svg, "gap").len(), 1);
        assert_eq!(heights(&svg, "p50"), vec![PLOT]);
    }

    #[test]
    fn durations_read_in_their_own_unit() {
        assert_eq!(seconds_text(0.0), "0 s");
        assert_eq!(seconds_text(0.0023), "2.3 ms");
        assert_eq!(seconds_text(0.34), "340 ms");
        assert_eq!(seconds_text(1.25), "1.2 s");
        assert_eq!(seconds_text(270.0), "4.5 min");
        assert_eq!(seconds_text(7200.0), "2.0 h");
        assert_eq!(seconds_text(-1.0), "0 s");
        assert_eq!(seconds_text(f64::NAN), "-");
        assert_eq!(minute_label(3600 * 13 + 60 * 7 + 59), "13:07 UTC");
    }
}
