//! `GET /destinations`, `GET /destinations/{host}` and `POST /destinations/{host}`: where
//! messages go, what waits for each destination, and pausing, resuming or closing one.
//!
//! The listing and the page come from [`crate::ops::destinations_waiting`] (the breakers'
//! table and the hosts that pending or held messages wait for, counted over
//! `messages_destination_idx`, each count bounded). A destination is a host and port,
//! never a path or query; a recent attempt shows its outcome, class, status and time,
//! never its error text.
//!
//! Pause, resume and close go as the other actions do ([`super::action`]): the first POST
//! changes nothing and shows a confirmation page; that page posts the destination's state
//! as shown (`seen=paused|running`) with `confirmed=yes`, and only then does the action run,
//! through the CLI's functions (`outbox.pause_destination`, `outbox.resume_destination`,
//! the breakers' close), recorded as `console:<name>`. A destination paused or resumed by
//! someone else between the two steps makes the action refused (409). Both steps check
//! the CSRF token first.

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};

use super::auth::Signed;
use super::time::Clock;
use super::{Failure, Shared, bad, client, field, layout, pairs, quoted};
use crate::ops::{DestinationWaiting, PauseError, WAITING_CAP};

/// Most destinations the listing shows.
const LIST_LIMIT: i64 = 500;

/// Recent attempts and operator actions on one destination's page.
const RECENT: i64 = 25;

/// Stored text, one line of visible characters (maud escapes the HTML).
fn t(s: &str) -> String {
    crate::text::escape(s).into_owned()
}

/// A destination named in a path, as `outboxd destinations --pause` takes one: lower
/// case, 1 to 1000 characters of a host name, an IPv6 address in brackets and a port.
/// `outbox.destination_name` has the last word; this only keeps hostile text out.
fn parse_host(raw: &str) -> Result<String, Failure> {
    let ok = !raw.is_empty()
        && raw.len() <= 1000
        && raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:[]".contains(&b));
    if ok {
        Ok(raw.to_ascii_lowercase())
    } else {
        Err(Failure::NotFound(format!(
            "no such destination: {} (a destination is host or host:port)",
            quoted(raw)
        )))
    }
}

/// The path of a destination's page: the name's bytes outside `A-Z a-z 0-9 - . _ ~ :`
/// percent-encoded (the brackets of an IPv6 address).
/// A time as every page shows it ([`Clock::at`]), or `-`.
fn when(clock: &Clock, stamp: Option<&str>) -> Markup {
    match stamp {
        Some(s) => clock.at(s),
        None => html! { "-" },
    }
}

pub(crate) fn href(host: &str) -> String {
    let mut s = String::from("/destinations/");
    for b in host.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:".contains(&b) {
            s.push(char::from(b));
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// A count read over at most [`WAITING_CAP`] entries: at the cap it means "at least".
fn count(n: i64) -> String {
    if n >= WAITING_CAP {
        format!("{n}+")
    } else {
        n.to_string()
    }
}

/// The state shown first: `paused` while paused, else the circuit's.
fn state(d: &DestinationWaiting) -> &str {
    if d.paused() {
        "paused"
    } else {
        d.circuit.as_deref().unwrap_or("closed")
    }
}

fn limits_note() -> Markup {
    html! {
        p.muted id="limits" {
            "Limits per destination are settings of each worker process, not stored in the "
            "database, so this page cannot show them: " code { "--host-concurrency" } " (requests "
            "in flight to one destination) and " code { "--webhook-rate-limits" } " (e.g. "
            code { "api.example.com=10/s" } "), each per worker process."
        }
    }
}

pub(crate) async fn list(
    State(app): State<Shared>,
    signed: Signed,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    // The form that opens one destination by name, known or not (a host may be paused
    // before its first message).
    let q = pairs(raw.unwrap_or_default().as_bytes());
    if let Some(host) = field(&q, "host") {
        let host = parse_host(host.trim())?;
        return Ok(Redirect::to(&href(&host)).into_response());
    }
    let c = client(&app).await?;
    let clock = Clock(
        crate::ops::database_now(&**c)
            .await
            .map_err(|e| Failure::db(&e))?,
    );
    let rows = crate::ops::destinations_waiting(&**c, LIST_LIMIT, None)
        .await
        .map_err(|e| Failure::db(&e))?;
    let paused = rows.iter().filter(|d| d.paused()).count();
    let body = html! {
        section {
            p id="summary" {
                b { (rows.len()) } " destination" @if rows.len() != 1 { "s" }
                " known or with messages waiting"
                @if rows.len() as i64 >= LIST_LIMIT { " (the first " (LIST_LIMIT) ")" }
                "; " b id="paused-count" { (paused) } " paused."
            }
            (limits_note())
            form.filters method="get" action="/destinations" id="open-host" {
                label { "Destination (host or host:port)"
                    input type="text" name="host" id="f-host" maxlength="1000";
                }
                button type="submit" id="open" { "Open" }
            }
        }
        section.scroll {
            @if rows.is_empty() {
                p.muted id="none" { "No destination is known and no message waits." }
            } @else {
                table id="destinations" {
                    thead { tr {
                        th { "destination" } th { "state" } th.num { "failures" }
                        th.num { "due" } th.num { "held back" } th.num { "later" }
                        th.num { "held" } th.num { "running" } th { "oldest due" }
                        th { "paused" }
                    } }
                    tbody {
                        @for d in &rows {
                            tr data-host=(d.host) data-state=(state(d)) {
                                td.host { a href=(href(&d.host)) { (d.host) } }
                                td {
                                    (state(d))
                                    @if d.paused() && d.circuit.as_deref().is_some_and(|c| c != "closed") {
                                        span.muted { " (circuit " (d.circuit.as_deref().unwrap_or("")) ")" }
                                    }
                                }
                                td.num { (d.consecutive_failures) }
                                td.num.due { (count(d.due)) }
                                td.num.parked { (count(d.parked)) }
                                td.num { (count(d.later)) }
                                td.num { (count(d.held)) }
                                td.num { (d.running) }
                                td { (when(&clock, d.oldest_due.as_deref())) }
                                td.err {
                                    @if d.paused() {
                                        "by " (t(d.paused_by.as_deref().unwrap_or("?")))
                                        " since " (when(&clock, d.paused_at.as_deref()))
                                        @if let Some(r) = &d.pause_reason { ": " (t(r)) }
                                    } @else { "-" }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(layout::page("Destinations", Some(&signed), body).into_response())
}

pub(crate) async fn page(
    State(app): State<Shared>,
    signed: Signed,
    Path(raw): Path<String>,
) -> Result<Response, Failure> {
    let host = parse_host(&raw)?;
    let c = client(&app).await?;
    let clock = Clock(
        crate::ops::database_now(&**c)
            .await
            .map_err(|e| Failure::db(&e))?,
    );
    let d = crate::ops::destinations_waiting(&**c, 1, Some(&host))
        .await
        .map_err(|e| Failure::db(&e))?
        .into_iter()
        .next();
    let Some(d) = d else {
        return Err(Failure::NotFound(format!(
            "no such destination: {}",
            quoted(&host)
        )));
    };
    let outcomes = crate::ops::destination_outcomes(&**c, &host, RECENT)
        .await
        .map_err(|e| Failure::db(&e))?;
    let actions = crate::ops::destination_actions(&**c, &host, RECENT)
        .await
        .map_err(|e| Failure::db(&e))?;
    let unknown = d.circuit.is_none()
        && d.due + d.parked + d.later + d.held + d.running == 0
        && actions.is_empty();
    let body = html! {
        section {
            @if unknown {
                p.muted id="unknown" {
                    "Nothing is known of this destination yet: no message waits for it and the "
                    "breakers never saw it. Pausing it holds its messages back from the first."
                }
            }
            dl id="destination" {
                dt { "destination" } dd.host { (d.host) }
                dt { "state" } dd id="state" { (state(&d)) }
                dt { "circuit" } dd id="circuit" { (d.circuit.as_deref().unwrap_or("closed")) }
                dt { "failures in a row" } dd { (d.consecutive_failures) }
                dt { "probe after" } dd { (when(&clock, d.open_until.as_deref())) }
                @if d.paused() {
                    dt { "paused by" } dd id="paused-by" { (t(d.paused_by.as_deref().unwrap_or("?"))) }
                    dt { "paused since" } dd { (when(&clock, d.paused_at.as_deref())) }
                    dt { "why" } dd id="pause-reason" { (d.pause_reason.as_deref().map_or_else(|| "-".into(), t)) }
                }
            }
            (limits_note())
        }
        section {
            h2 { "What waits" }
            dl id="waiting" {
                dt { "due now" } dd.due { (count(d.due)) }
                dt { "held back by the pause" } dd.parked { (count(d.parked)) }
                dt { "due later (retries, schedules)" } dd { (count(d.later)) }
                dt { "held for approval" } dd { (count(d.held)) }
                dt { "running" } dd { (d.running) }
                dt { "oldest due" } dd { (when(&clock, d.oldest_due.as_deref())) }
            }
        }
        section id="actions" {
            h2 { "Actions" }
            form method="post" action=(href(&d.host)) {
                input type="hidden" name="csrf" value=(signed.csrf);
                @if d.paused() {
                    p { "Resuming makes the messages the pause held back due at once." }
                    div.actions {
                        button type="submit" name="do" value="resume" id="resume" { "Resume" }
                    }
                } @else {
                    label { "Reason (optional, one line, kept with the pause)"
                        input type="text" name="reason" id="reason" maxlength="500";
                    }
                    div.actions {
                        button.danger type="submit" name="do" value="pause" id="pause" { "Pause" }
                    }
                }
                @if d.circuit.as_deref().is_some_and(|c| c != "closed") {
                    div.actions {
                        button.secondary type="submit" name="do" value="close" id="close" { "Close circuit" }
                    }
                }
            }
        }
        section.scroll {
            h2 { "Recent attempts" }
            p.muted {
                "The last " (RECENT) " attempts at this destination among the newest "
                (crate::ops::OUTCOMES_LOOKED_AT) " recorded; outcome, class, status and time only."
            }
            @if outcomes.is_empty() {
                p.muted id="no-outcomes" { "None." }
            } @else {
                table id="outcomes" {
                    thead { tr {
                        th { "started" } th.num { "message" } th.num { "attempt" } th { "outcome" }
                        th { "class" } th.num { "status" } th.num { "ms" }
                    } }
                    tbody {
                        @for o in &outcomes {
                            tr data-outcome=(o.outcome) {
                                td { (when(&clock, o.started_at.as_deref())) }
                                td.num { a href={ "/message/" (o.message_id) } { (o.message_id) } }
                                td.num { (o.attempt) }
                                td { (o.outcome) }
                                td { (o.error_class.as_deref().unwrap_or("-")) }
                                td.num { (o.status.map_or_else(|| "-".into(), |s| s.to_string())) }
                                td.num { (o.millis.map_or_else(|| "-".into(), |m| format!("{m:.0}"))) }
                            }
                        }
                    }
                }
            }
        }
        section.scroll {
            h2 { "Operators' actions" }
            @if actions.is_empty() {
                p.muted id="no-actions" { "None." }
            } @else {
                table id="history" {
                    thead { tr { th { "at" } th { "action" } th { "by" } th.num { "messages" } th { "why" } } }
                    tbody {
                        @for a in &actions {
                            tr data-action=(a.action) {
                                td { (when(&clock, a.at.as_deref())) }
                                td { (a.action) }
                                td.key { (t(&a.actor)) }
                                td.num { (a.messages.map_or_else(|| "-".into(), |n| n.to_string())) }
                                td.err { (a.reason.as_deref().map_or_else(|| "-".into(), t)) }
                            }
                        }
                    }
                }
            }
        }
    };
    let title = format!("Destination {}", d.host);
    Ok(layout::page(&title, Some(&signed), body).into_response())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verb {
    Pause,
    Resume,
    Close,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Verb::Pause => "pause",
            Verb::Resume => "resume",
            Verb::Close => "close",
        }
    }
}

pub(crate) async fn post(
    State(app): State<Shared>,
    signed: Signed,
    Path(raw): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let form = pairs(&body);
    // Before anything else, so a forged request learns nothing and changes nothing.
    signed.check_csrf(&form)?;
    let host = parse_host(&raw)?;
    let verb = match field(&form, "do") {
        Some("pause") => Verb::Pause,
        Some("resume") => Verb::Resume,
        Some("close") => Verb::Close,
        Some(other) => return Err(bad(&format!("unknown action {}", quoted(other)))),
        None => return Err(bad("no action given (do=pause|resume|close)")),
    };
    let reason = match verb {
        Verb::Pause => field(&form, "reason"),
        _ => None,
    };
    let c = client(&app).await?;
    let d = crate::ops::destinations_waiting(&**c, 1, Some(&host))
        .await
        .map_err(|e| Failure::db(&e))?
        .into_iter()
        .next()
        .ok_or_else(|| Failure::NotFound(format!("no such destination: {}", quoted(&host))))?;
    let now = if d.paused() { "paused" } else { "running" };
    if field(&form, "confirmed") != Some("yes") {
        return Ok(confirmation(&signed, verb, &d, reason).into_response());
    }
    // The state the confirmation page showed: a destination paused or resumed by someone
    // else meanwhile is left as they left it.
    if field(&form, "seen") != Some(now) {
        return Err(Failure::Refused(format!(
            "{} is {now} now, not as the confirmation page showed it; nothing changed",
            d.host
        )));
    }
    let actor = signed.actor();
    let refused = |e: PauseError| match e {
        PauseError::Invalid(m) => Failure::BadRequest(m),
        PauseError::Unknown(m) => Failure::NotFound(m),
        PauseError::Database(e) => Failure::db(&e),
    };
    let (name, line) = match verb {
        Verb::Pause => {
            let p = crate::ops::pause_destination(&**c, &host, reason, &actor)
                .await
                .map_err(refused)?;
            if !p.changed {
                return Err(Failure::Refused(format!(
                    "{} was already paused; nothing changed",
                    p.destination
                )));
            }
            (p.destination, format!("{} messages held back", p.messages))
        }
        Verb::Resume => {
            let p = crate::ops::resume_destination(&**c, &host, &actor)
                .await
                .map_err(refused)?;
            if !p.changed {
                return Err(Failure::Refused(format!(
                    "{} was not paused; nothing changed",
                    p.destination
                )));
            }
            (
                p.destination,
                format!("{} held-back messages due now", p.messages),
            )
        }
        Verb::Close => {
            let n = crate::ops::close_destination(&**c, &host, &actor)
                .await
                .map_err(|e| Failure::db(&e))?
                .ok_or_else(|| {
                    Failure::NotFound(format!(
                        "the breakers never saw {}; nothing changed",
                        quoted(&host)
                    ))
                })?;
            (
                host.clone(),
                format!("circuit closed, {n} held-back messages due now"),
            )
        }
    };
    tracing::info!(
        operator = %signed.name,
        action = verb.as_str(),
        destination = %crate::text::Escaped(&host),
        "console: destination action"
    );
    let done = match verb {
        Verb::Pause => "Paused",
        Verb::Resume => "Resumed",
        Verb::Close => "Closed the circuit of",
    };
    let body = html! {
        section.notice id="result" {
            p { b { (done) " " (name) } ": " (line) "; recorded as " code { (actor) } "." }
            p { a href=(href(&name)) { "Back to " (name) } " · " a href="/destinations" { "Destinations" } }
        }
    };
    Ok(layout::page(&format!("{done} {name}"), Some(&signed), body).into_response())
}

/// The confirmation step: what the action does to this destination, and the button.
fn confirmation(
    signed: &Signed,
    verb: Verb,
    d: &DestinationWaiting,
    reason: Option<&str>,
) -> axum::response::Html<String> {
    let (title, button) = match verb {
        Verb::Pause => (format!("Pause {}?", d.host), "Pause"),
        Verb::Resume => (format!("Resume {}?", d.host), "Resume"),
        Verb::Close => (format!("Close the circuit of {}?", d.host), "Close circuit"),
    };
    let body = html! {
        section id="confirmation" {
            p id="touches" {
                @match verb {
                    Verb::Pause => {
                        "Nothing is sent to " b { (d.host) } " until someone resumes it: "
                        b { (count(d.due)) } " message" @if d.due != 1 { "s" } " due now and every one that "
                        "comes due are held back, their attempts not counted. Requests under way ("
                        (d.running) ") finish."
                    }
                    Verb::Resume => {
                        "The " b { (count(d.parked)) } " message" @if d.parked != 1 { "s" }
                        " the pause held back become due at once."
                    }
                    Verb::Close => {
                        "The circuit closes as if its probe had succeeded, and the messages its "
                        "opening held back become due at once. A pause stays."
                    }
                }
            }
            form method="post" action=(href(&d.host)) {
                input type="hidden" name="csrf" value=(signed.csrf);
                input type="hidden" name="do" value=(verb.as_str());
                input type="hidden" name="confirmed" value="yes";
                input type="hidden" name="seen" value=(if d.paused() { "paused" } else { "running" });
                @if verb == Verb::Pause {
                    label { "Reason (optional, one line, kept with the pause)"
                        input type="text" name="reason" id="reason" maxlength="500" value=[reason];
                    }
                }
                div.actions {
                    button type="submit" id="do-it" { (button) }
                    a href=(href(&d.host)) { "Back, change nothing" }
                }
            }
        }
    };
    layout::page(&title, Some(signed), body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_path_is_encoded_and_parsed_back() {
        assert_eq!(
            href("api.example.com:8443"),
            "/destinations/api.example.com:8443"
        );
        assert_eq!(href("[::1]:9000"), "/destinations/%5B::1%5D:9000");
        assert_eq!(
            parse_host("API.Example.com").ok().as_deref(),
            Some("api.example.com")
        );
        for hostile in ["", "a b", "<script>", "a/b", "bücher.example", "x';--"] {
            assert!(parse_host(hostile).is_err(), "{hostile}");
        }
        assert!(parse_host(&"a".repeat(1001)).is_err());
    }
}
