//! The overview: counts by state and channel, the oldest due message, and the last hour
//! minute by minute: deliveries and failures as an SVG chart drawn here, delivery latency
//! and the backlog's age as the charts of `charts`. `?refresh=N` reloads the page every N
//! seconds (a `<meta http-equiv="refresh">`: no script).

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use super::auth::Signed;
use super::charts::{self, minute_label};
use super::{Failure, Shared, client, field, layout, pairs, quoted};
use crate::model::State as MessageState;
use crate::ops::MinuteCount;

/// The refresh intervals the overview offers, in seconds. Anything else is refused (400)
/// rather than ignored: a link that asked for a refresh and silently got none would leave
/// an operator watching a page that never changes.
pub(crate) const REFRESH_CHOICES: [u32; 3] = [10, 30, 60];

/// Reads `refresh`: absent or empty is off, one of [`REFRESH_CHOICES`] (written as
/// digits, exactly) is that many seconds, anything else a one-line 400.
pub(crate) fn parse_refresh(q: &[(String, String)]) -> Result<Option<u32>, Failure> {
    let Some(v) = field(q, "refresh") else {
        return Ok(None);
    };
    REFRESH_CHOICES
        .iter()
        .find(|c| c.to_string() == v)
        .map(|c| Some(*c))
        .ok_or_else(|| {
            Failure::BadRequest(format!(
                "refresh must be 10, 30 or 60 (seconds), or absent for none; got {}",
                quoted(v)
            ))
        })
}

pub(crate) async fn page(
    State(app): State<Shared>,
    signed: Signed,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let q = pairs(raw.as_deref().unwrap_or("").as_bytes());
    let refresh = parse_refresh(&q)?;
    let c = client(&app).await?;
    let clock = super::time::Clock(
        crate::ops::database_now(&**c)
            .await
            .map_err(|e| Failure::db(&e))?,
    );
    let st = crate::status::status(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let activity = crate::ops::activity_per_minute(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let minutes = &activity.counts;
    let backlog = crate::ops::backlog_per_minute(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let due_now: i64 = st.due_by_channel.values().map(|d| d.due).sum();
    let destinations = crate::ops::destinations(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let channels: Vec<&String> = st.by_channel.keys().collect();
    let channel_pauses = crate::ops::channels(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let body = html! {
        (refresh_links(refresh))
        // First: a paused channel sends nothing, whatever the counts below say.
        (super::channels::notice(&clock, &channel_pauses))
        section.scroll {
            h2 { "Messages by state" }
            table id="counts" {
                thead { tr {
                    th { "state" }
                    th.num { "total" }
                    @for ch in &channels { th.num { (ch) } }
                } }
                tbody {
                    @for state in MessageState::ALL {
                        tr data-state=(state.as_str()) {
                            td { (state_link(state)) }
                            // Each count links to the messages it counts.
                            td.num.total {
                                a href={ "/messages?state=" (state.as_str()) } { (st.total.get(state)) }
                            }
                            @for ch in &channels {
                                td.num data-channel=(ch) {
                                    a href={ "/messages?state=" (state.as_str()) "&channel=" (ch) } {
                                        (st.by_channel.get(*ch).map_or(0, |n| n.get(state)))
                                    }
                                }
                            }
                        }
                    }
                }
            }
            p id="oldest-due" {
                "Oldest due message: "
                b { (format!("{:.1}", st.oldest_due_seconds)) " s" }
                @if st.oldest_due_seconds == 0.0 { span.muted { " (none is waiting)" } }
            }
        }
        // Circuit breakers: hosts open, half-open or counting failures. Names
        // only (a destination is a host and port, never a path or query); closing one by
        // hand is `outboxd destinations --close HOST`.
        section.scroll id="open-destinations" {
            h2 { "Open destinations" }
            p { "Open or half-open: " b.open-count { (st.open_destinations) } }
            @if destinations.is_empty() {
                p.muted { "No destination is open or failing." }
            } @else {
                table {
                    thead { tr {
                        th { "destination" } th { "state" } th.num { "failures in a row" } th { "probe after" }
                    } }
                    tbody {
                        @for d in &destinations {
                            tr data-host=(d.host) data-state=(d.state) {
                                td { (d.host) }
                                td { (d.state) }
                                td.num { (d.consecutive_failures) }
                                td { @match d.open_until.as_deref() { Some(t) => (clock.at(t)), None => "-" } }
                            }
                        }
                    }
                }
                p.muted { "Close one by hand: " code { "outboxd destinations --close HOST" } }
            }
            p { a href="/destinations" id="all-destinations" { "All destinations, what waits for each, pause and resume" } }
        }
        (super::channels::table(&signed, &clock, &channel_pauses))
        section.chart {
            h2 { "Deliveries and failures per minute, last hour" }
            (chart(minutes))
        }
        (latency_section(&activity.latency))
        section.chart id="backlog" {
            h2 { "Backlog: age of the oldest due message, last hour" }
            p id="backlog-now" {
                "Now: oldest due "
                b data-seconds=(st.oldest_due_seconds) { (charts::seconds_text(st.oldest_due_seconds)) }
                ", " b.due-count { (due_now) } " due"
                span.muted { " (pending and past their run_after; read live)" }
            }
            (charts::backlog(&backlog))
        }
    };
    Ok(layout::page_refreshing("Overview", Some(&signed), refresh, body).into_response())
}

/// Delivery latency two ways, each its own chart on its own scale: the attempt (what the
/// receiver took) and end to end (what the application waited: the attempt, plus the wait
/// for a worker, retries, and any delay asked for, often larger by orders of magnitude).
fn latency_section(minutes: &[crate::ops::MinuteLatency]) -> Markup {
    html! {
        section.chart id="latency" {
            h2 { "Delivery latency per minute, last hour" }
            p.muted {
                "p50 and p99 of each minute (PostgreSQL's " code { "percentile_cont" } "); "
                "a minute without deliveries is a gap."
            }
            h3 { "Attempt duration: what the receiver took" }
            (charts::latency("latency-attempt", "Attempt duration", minutes, |m| (m.attempts, m.attempt)))
            p.muted {
                "Attempts that delivered, by the minute they ended: from the worker's start to the "
                "recorded end (" code { "outbox.attempts" } "), as "
                code { "outboxd_delivery_duration_seconds" } " gives Grafana."
            }
            h3 { "End to end: what the application waited" }
            (charts::latency("latency-e2e", "End to end", minutes, |m| (m.messages, m.end_to_end)))
            p.muted {
                "Messages delivered in the minute, from enqueue to delivery ("
                code { "delivered_at − created_at" } "): retries included, and any wait asked "
                "for (a later " code { "run_after" } ") or caused by a person (held, replayed)."
            }
        }
    }
}

/// The refresh switch: links, since a form or a script would be no simpler.
fn refresh_links(current: Option<u32>) -> Markup {
    html! {
        nav.refresh id="refresh" aria-label="Refresh" {
            span.muted { "Refresh this page: " }
            @if current.is_none() {
                b aria-current="true" { "off" }
            } @else {
                a href="/" { "off" }
            }
            @for s in REFRESH_CHOICES {
                @if current == Some(s) {
                    b aria-current="true" { "every " (s) " s" }
                } @else {
                    a href={ "/?refresh=" (s) } { "every " (s) " s" }
                }
            }
        }
    }
}

fn state_link(state: MessageState) -> Markup {
    match state {
        MessageState::Dead => html! { a href="/dead" { "dead" } },
        MessageState::Held => html! { a href="/held" { "held" } },
        other => html! { (other.as_str()) },
    }
}

/// A stacked bar per minute (delivered below, failed above), oldest on the left, with a
/// `<title>` per bar for a tooltip and a one-line summary for readers without the picture.
/// Presentation comes from classes in the stylesheet: the CSP allows no inline style.
pub(crate) fn chart(minutes: &[MinuteCount]) -> Markup {
    const W: f64 = 720.0;
    const H: f64 = 160.0;
    const TOP: f64 = 14.0;
    const BOTTOM: f64 = 18.0;
    let delivered: i64 = minutes.iter().map(|m| m.delivered).sum();
    let failed: i64 = minutes.iter().map(|m| m.failed).sum();
    let peak = minutes
        .iter()
        .map(|m| m.delivered + m.failed)
        .max()
        .unwrap_or(0)
        .max(1);
    let n = minutes.len().max(1) as f64;
    let slot = W / n;
    let plot = H - TOP - BOTTOM;
    let y = |v: i64| plot * v as f64 / peak as f64;
    let label = format!("{delivered} delivered and {failed} failed in the last hour");
    html! {
        svg id="chart" viewBox={ "0 0 " (W) " " (H) } role="img" aria-label=(label)
            xmlns="http://www.w3.org/2000/svg" {
            line.axis x1="0" y1=(H - BOTTOM) x2=(W) y2=(H - BOTTOM) {}
            text x="0" y="10" { "peak " (peak) "/min" }
            @for (i, m) in minutes.iter().enumerate() {
                @let x = i as f64 * slot + 1.0;
                @let hd = y(m.delivered);
                @let hf = y(m.failed);
                g {
                    title { (minute_label(m.minute)) ": " (m.delivered) " delivered, " (m.failed) " failed" }
                    @if m.delivered > 0 {
                        rect.delivered x=(fmt(x)) y=(fmt(H - BOTTOM - hd)) width=(fmt(slot - 2.0)) height=(fmt(hd)) {}
                    }
                    @if m.failed > 0 {
                        rect.failed x=(fmt(x)) y=(fmt(H - BOTTOM - hd - hf)) width=(fmt(slot - 2.0)) height=(fmt(hf)) {}
                    }
                }
            }
            text x="0" y=(H - 4.0) { "60 min ago" }
            text x=(W) y=(H - 4.0) text-anchor="end" { "now" }
        }
        p.legend id="chart-summary" {
            span.ok { (delivered) " delivered" }
            span.bad { (failed) " failed" }
            span.muted { "(retried, dead or lease lost; by minute of the attempt's end)" }
        }
    }
}

fn fmt(v: f64) -> String {
    format!("{v:.1}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_scales_to_the_busiest_minute_and_labels_every_bar() {
        let minutes: Vec<MinuteCount> = (0..60)
            .map(|i| MinuteCount {
                minute: 1_700_000_000 - 1_700_000_000 % 60 + i * 60,
                delivered: if i == 59 { 8 } else { 0 },
                failed: if i == 59 { 2 } else { 0 },
            })
            .collect();
        let svg = chart(&minutes).into_string();
        assert!(
            svg.contains("8 delivered and 2 failed in the last hour"),
            "{svg}"
        );
        assert!(svg.contains("peak 10/min"));
        assert_eq!(svg.matches("<title>").count(), 60);
        assert_eq!(svg.matches("class=\"delivered\"").count(), 1);
        assert!(!svg.contains("style="), "the CSP forbids inline style");
    }

    #[test]
    fn minute_labels() {
        assert_eq!(minute_label(0), "00:00 UTC");
        assert_eq!(minute_label(3600 * 13 + 60 * 7 + 59), "13:07 UTC");
    }

    fn refresh_of(query: &str) -> Result<Option<u32>, String> {
        parse_refresh(&pairs(query.as_bytes())).map_err(|e| format!("{e:?}"))
    }

    #[test]
    fn refresh_is_off_unless_one_of_the_choices_is_asked_for() {
        assert_eq!(refresh_of(""), Ok(None));
        assert_eq!(refresh_of("refresh="), Ok(None));
        assert_eq!(refresh_of("refresh=30"), Ok(Some(30)));
        assert_eq!(refresh_of("refresh=10&refresh=999"), Ok(Some(10)));
        for bad in [
            "refresh=0",
            "refresh=5",
            "refresh=030",
            "refresh=30.0",
            "refresh=+30",
            "refresh=-30",
            "refresh=30s",
            "refresh=%2030",
            "refresh=30%0d%0aSet-Cookie:%20x",
            "refresh=%3Cscript%3E",
            "refresh=99999999999999999999999",
        ] {
            let e = refresh_of(bad).expect_err(bad);
            assert!(e.contains("refresh must be 10, 30 or 60"), "{bad}: {e}");
            // One line; the page's template escapes the markup.
            assert!(!e.contains('\r') && !e.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn the_refresh_switch_marks_the_current_choice() {
        let off = refresh_links(None).into_string();
        assert!(off.contains("<b aria-current=\"true\">off</b>"), "{off}");
        assert!(off.contains("href=\"/?refresh=30\""), "{off}");
        let on = refresh_links(Some(30)).into_string();
        assert!(on.contains("<a href=\"/\">off</a>"), "{on}");
        assert!(
            on.contains("<b aria-current=\"true\">every 30 s</b>"),
            "{on}"
        );
        assert!(!on.contains("href=\"/?refresh=30\""), "{on}");
    }
}
