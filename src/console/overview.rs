//! The overview: counts by state and channel, the oldest due message, and deliveries and
//! failures per minute over the last hour as an SVG chart drawn here.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use super::auth::Signed;
use super::{Failure, Shared, client, layout};
use crate::model::State as MessageState;
use crate::ops::MinuteCount;

pub(crate) async fn page(State(app): State<Shared>, signed: Signed) -> Result<Response, Failure> {
    let c = client(&app).await?;
    let st = crate::status::status(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let minutes = crate::ops::attempts_per_minute(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let destinations = crate::ops::destinations(&**c)
        .await
        .map_err(|e| Failure::db(&e))?;
    let channels: Vec<&String> = st.by_channel.keys().collect();
    let body = html! {
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
                                td { (d.open_until.as_deref().unwrap_or("-")) }
                            }
                        }
                    }
                }
                p.muted { "Close one by hand: " code { "outboxd destinations --close HOST" } }
            }
            p { a href="/destinations" id="all-destinations" { "All destinations, what waits for each, pause and resume" } }
        }
        section.chart {
            h2 { "Deliveries and failures per minute, last hour" }
            (chart(&minutes))
        }
    };
    Ok(layout::page("Overview", Some(&signed), body).into_response())
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

/// `HH:MM UTC` of a minute given in unix seconds.
fn minute_label(unix: i64) -> String {
    let secs = unix.rem_euclid(86_400);
    format!("{:02}:{:02} UTC", secs / 3600, secs % 3600 / 60)
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
}
