//! `GET /channels` and `POST /channels/{channel}`: the channels, paused or not, and pausing
//! or resuming a whole channel (a provider's incident: the SMTP relay is down).
//!
//! Pause and resume go as the destinations' do ([`super::destinations`]): the first POST
//! changes nothing and shows a confirmation page; that page posts the channel's state as
//! shown (`seen=paused|running`) with `confirmed=yes`, and only then does the action run,
//! through the CLI's functions (`outbox.pause_channel`, `outbox.resume_channel`), recorded
//! as `console:<name>`. A channel paused or resumed by someone else between the two steps
//! makes the action refused (409). Both steps check the CSRF token first. The overview
//! shows the same table ([`table`]) and, at its top, a paused channel in red ([`notice`]).

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use super::auth::Signed;
use super::time::Clock;
use super::{Failure, Shared, bad, client, field, layout, pairs, quoted};
use crate::model::Channel;
use crate::ops::{ChannelPause, ChannelPauseError};

/// Stored text, one line of visible characters (maud escapes the HTML).
fn t(s: &str) -> String {
    crate::text::escape(s).into_owned()
}

fn href(channel: &str) -> String {
    format!("/channels/{channel}")
}

/// In red, which channels are paused, by whom, since when and why (nothing when none is).
pub(crate) fn notice(clock: &Clock, channels: &[ChannelPause]) -> Markup {
    let paused: Vec<&ChannelPause> = channels.iter().filter(|c| c.paused).collect();
    html! {
        @if !paused.is_empty() {
            section.error id="paused-channels" {
                h2 { "Paused channels" }
                @for c in &paused {
                    p data-channel=(c.channel) {
                        b { (c.channel) } " is paused: none of its messages is sent until someone resumes it. "
                        "Paused by " b.paused-by { (t(c.paused_by.as_deref().unwrap_or("?"))) }
                        " " (when(clock, c.paused_at.as_deref()))
                        @if let Some(r) = &c.pause_reason { ": " span.pause-reason { (t(r)) } }
                    }
                }
            }
        }
    }
}

/// The channels' table with a Pause or Resume button each (the button leads to the
/// confirmation page).
pub(crate) fn table(signed: &Signed, clock: &Clock, channels: &[ChannelPause]) -> Markup {
    html! {
        section.scroll id="channels" {
            h2 { "Channels" }
            table.rows {
                thead { tr {
                    th { "channel" } th { "state" } th { "paused by" } th { "since" } th { "why" } th { "action" }
                } }
                tbody {
                    @for c in channels {
                        tr data-channel=(c.channel) data-state=(state(c)) {
                            td data-label="channel" { b { (c.channel) } }
                            td data-label="state" { (state(c)) }
                            td.key data-label="paused by" { (c.paused_by.as_deref().map_or_else(|| "-".into(), t)) }
                            td data-label="since" { (when(clock, c.paused_at.as_deref())) }
                            td.err data-label="why" { (c.pause_reason.as_deref().map_or_else(|| "-".into(), t)) }
                            td {
                                form method="post" action=(href(&c.channel)) {
                                    input type="hidden" name="csrf" value=(signed.csrf);
                                    @if c.paused {
                                        button type="submit" name="do" value="resume" id={ "resume-" (c.channel) } { "Resume" }
                                    } @else {
                                        button.danger type="submit" name="do" value="pause" id={ "pause-" (c.channel) } { "Pause" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            p.muted {
                "A paused channel's messages stay due, unsent and uncounted; workers see a pause "
                "within a poll interval, and attempts under way finish. The CLI: "
                code { "outboxd channels --pause CHANNEL" } "."
            }
        }
    }
}

fn state(c: &ChannelPause) -> &'static str {
    if c.paused { "paused" } else { "running" }
}

/// A time as every page shows it ([`Clock::at`]), or `-`.
fn when(clock: &Clock, stamp: Option<&str>) -> Markup {
    match stamp {
        Some(s) => clock.at(s),
        None => html! { "-" },
    }
}

async fn read(c: &tokio_postgres::Client) -> Result<(Clock, Vec<ChannelPause>), Failure> {
    let clock = Clock(
        crate::ops::database_now(c)
            .await
            .map_err(|e| Failure::db(&e))?,
    );
    let channels = crate::ops::channels(c).await.map_err(|e| Failure::db(&e))?;
    Ok((clock, channels))
}

pub(crate) async fn page(State(app): State<Shared>, signed: Signed) -> Result<Response, Failure> {
    let c = client(&app).await?;
    let (clock, channels) = read(&c).await?;
    let body = html! { (notice(&clock, &channels)) (table(&signed, &clock, &channels)) };
    Ok(layout::page("Channels", Some(&signed), body).into_response())
}

/// A channel named in a path: one of outboxd's, exactly as it is written.
fn parse_channel(raw: &str) -> Result<Channel, Failure> {
    Channel::parse(raw).ok_or_else(|| {
        Failure::NotFound(format!(
            "no such channel: {} (webhook, http or email)",
            quoted(raw)
        ))
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verb {
    Pause,
    Resume,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Verb::Pause => "pause",
            Verb::Resume => "resume",
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
    let channel = parse_channel(&raw)?;
    let verb = match field(&form, "do") {
        Some("pause") => Verb::Pause,
        Some("resume") => Verb::Resume,
        Some(other) => return Err(bad(&format!("unknown action {}", quoted(other)))),
        None => return Err(bad("no action given (do=pause|resume)")),
    };
    let reason = match verb {
        Verb::Pause => field(&form, "reason").filter(|r| !r.is_empty()),
        Verb::Resume => None,
    };
    let c = client(&app).await?;
    let (_, channels) = read(&c).await?;
    let Some(now) = channels.iter().find(|p| p.channel == channel.as_str()) else {
        return Err(Failure::NotFound(format!(
            "no such channel: {}",
            channel.as_str()
        )));
    };
    if field(&form, "confirmed") != Some("yes") {
        return Ok(confirmation(&signed, verb, now, reason).into_response());
    }
    // The state the confirmation page showed: a channel paused or resumed by someone else
    // meanwhile is left as they left it.
    if field(&form, "seen") != Some(state(now)) {
        return Err(Failure::Refused(format!(
            "{} is {} now, not as the confirmation page showed it; nothing changed",
            channel.as_str(),
            state(now)
        )));
    }
    let actor = signed.actor();
    let refused = |e: ChannelPauseError| match e {
        ChannelPauseError::Invalid(m) => Failure::BadRequest(m),
        ChannelPauseError::Unknown(m) => Failure::NotFound(m),
        ChannelPauseError::Database(e) => Failure::db(&e),
    };
    let change = match verb {
        Verb::Pause => crate::ops::pause_channel(&**c, channel.as_str(), reason, &actor).await,
        Verb::Resume => crate::ops::resume_channel(&**c, channel.as_str(), &actor).await,
    }
    .map_err(refused)?;
    if !change.changed {
        let was = match verb {
            Verb::Pause => "was already paused",
            Verb::Resume => "was not paused",
        };
        return Err(Failure::Refused(format!(
            "{} {was}; nothing changed",
            change.channel
        )));
    }
    tracing::info!(
        operator = %signed.name,
        action = verb.as_str(),
        channel = channel.as_str(),
        "console: channel action"
    );
    let (done, line) = match verb {
        Verb::Pause => (
            "Paused",
            "none of its messages is sent until someone resumes it",
        ),
        Verb::Resume => ("Resumed", "its messages are sent again"),
    };
    let body = html! {
        section.notice id="result" {
            p { b { (done) " " (change.channel) } ": " (line) "; recorded as " code { (actor) } "." }
            p { a href="/channels" { "Channels" } " · " a href="/" { "Overview" } }
        }
    };
    Ok(layout::page(&format!("{done} {}", change.channel), Some(&signed), body).into_response())
}

/// The confirmation step: what the action does to this channel, and the button.
fn confirmation(
    signed: &Signed,
    verb: Verb,
    c: &ChannelPause,
    reason: Option<&str>,
) -> axum::response::Html<String> {
    let (title, button) = match verb {
        Verb::Pause => (format!("Pause the {} channel?", c.channel), "Pause"),
        Verb::Resume => (format!("Resume the {} channel?", c.channel), "Resume"),
    };
    let body = html! {
        section id="confirmation" {
            p id="touches" {
                @match verb {
                    Verb::Pause => {
                        "No " b { (c.channel) } " message is sent until someone resumes the channel: "
                        "workers stop claiming them within a poll interval, and they stay due, their "
                        "attempts not counted. Attempts under way finish."
                    }
                    Verb::Resume => {
                        "The " b { (c.channel) } " channel's messages are claimed again at once."
                    }
                }
            }
            form method="post" action=(href(&c.channel)) {
                input type="hidden" name="csrf" value=(signed.csrf);
                input type="hidden" name="do" value=(verb.as_str());
                input type="hidden" name="confirmed" value="yes";
                input type="hidden" name="seen" value=(state(c));
                @if verb == Verb::Pause {
                    label { "Reason (optional, one line, kept with the pause)"
                        input type="text" name="reason" id="reason" maxlength="500" value=[reason];
                    }
                }
                div.actions {
                    button type="submit" id="do-it" { (button) }
                    a href="/channels" { "Back, change nothing" }
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
    fn only_outboxds_channels_are_named_in_a_path() {
        assert!(parse_channel("email").is_ok());
        for hostile in ["", "Email", "sms", "<script>", "x';--", "email/../"] {
            assert!(parse_channel(hostile).is_err(), "{hostile}");
        }
    }
}
