//! One message with its history, and lookup by id or key.
//!
//! The message comes from [`crate::ops::show`], the function behind `outboxd show`, so the
//! payload is redacted exactly as there ([`crate::ops::redact_payload`]: header values, a
//! URL's user info, path and query, e-mail addresses and bodies).

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};

use super::auth::Signed;
use super::{Failure, Shared, client, field, layout, pairs, quoted};
use crate::ops::{MessageDetail, Target};

/// An id in a path or a form: digits only, within `bigint`.
pub(crate) fn parse_id(s: &str) -> Result<i64, Failure> {
    if !s.is_empty() && s.len() <= 19 && s.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(id) = s.parse::<i64>() {
            return Ok(id);
        }
    }
    Err(Failure::BadRequest(format!(
        "a message id is a number (got {})",
        quoted(s)
    )))
}

pub(crate) async fn page(
    State(app): State<Shared>,
    signed: Signed,
    Path(id): Path<String>,
) -> Result<Response, Failure> {
    let id = parse_id(&id)?;
    let c = client(&app).await?;
    let detail = crate::ops::show(&**c, &Target::Id(id))
        .await
        .map_err(|e| Failure::db(&e))?
        .ok_or_else(|| Failure::NotFound(format!("no such message: id {id}")))?;
    let title = format!("Message {}", detail.id);
    Ok(layout::page(&title, Some(&signed), body(&detail, &signed)).into_response())
}

/// Stored text, one line of visible characters (maud escapes the HTML).
fn t(s: &str) -> String {
    crate::text::escape(s).into_owned()
}

fn opt(s: &Option<String>) -> String {
    s.as_deref().map_or_else(|| "-".into(), t)
}

fn body(d: &MessageDetail, signed: &Signed) -> Markup {
    // JSON escapes control characters in strings but not U+2028, U+2029 or the
    // bidirectional overrides, which would make the page show text other than what is
    // stored: each line goes through `text::escape` (the pretty printer's newlines stay).
    let pretty = |v: &serde_json::Value| {
        let text = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
        text.lines()
            .map(crate::text::escape)
            .collect::<Vec<_>>()
            .join("\n")
    };
    html! {
        section {
            dl id="fields" {
                dt { "key" } dd id="key" { (t(&d.message_key)) }
                dt { "channel" } dd { (t(&d.channel)) }
                dt { "state" } dd id="state" { b { (t(&d.state)) } }
                dt { "attempts" } dd { (d.attempts) " of " (d.max_attempts) " (retry ambiguous: " (d.retry_ambiguous) ")" }
                @if let Some(k) = &d.ordering_key { dt { "ordering key" } dd { (t(k)) } }
                dt { "run after" } dd { (d.run_after) }
                dt { "created" } dd { (d.created_at) }
                dt { "updated" } dd { (d.updated_at) }
                @if d.lease_owner.is_some() {
                    dt { "lease" } dd { (opt(&d.lease_owner)) " until " (opt(&d.lease_expires_at)) }
                }
                @if let Some(x) = &d.delivered_at { dt { "delivered" } dd { (x) } }
                @if let Some(x) = &d.dead_at { dt { "dead" } dd { (x) } }
                @if let Some(x) = &d.cancelled_at { dt { "cancelled" } dd { (x) } }
                @if d.error_class.is_some() {
                    dt { "error" } dd id="error-line" { (opt(&d.error_class)) ": " (opt(&d.last_error)) }
                }
            }
            (actions(d, signed))
        }
        section {
            h2 { "Payload " span.muted { "(header values, URL paths and queries redacted, as outboxd show does)" } }
            pre id="payload" { (pretty(&d.payload)) }
            @if let Some(r) = &d.response {
                h2 { "Last response" }
                pre id="response" { (pretty(r)) }
            }
        }
        section.scroll {
            h2 { "History" }
            @if d.history.is_empty() {
                p.muted { "No attempts yet." }
            } @else {
                table id="history" {
                    thead { tr {
                        th.num { "attempt" } th { "outcome" } th { "class" } th.num { "status" }
                        th.hide-narrow { "dedup" } th { "worker" } th.hide-narrow { "started" } th { "error" }
                    } }
                    tbody {
                        @for a in &d.history {
                            tr {
                                td.num { (a.attempt) }
                                td.outcome { (t(&a.outcome)) }
                                td { (opt(&a.error_class)) }
                                td.num { (a.status.map_or_else(|| "-".to_owned(), |s| s.to_string())) }
                                td.hide-narrow { (if a.deduplicated { "yes" } else { "no" }) }
                                td.worker { (opt(&a.worker)) }
                                td.hide-narrow { (a.started_at) }
                                td.err { (opt(&a.error)) }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The actions this message's state allows, each through the confirmation step.
fn actions(d: &MessageDetail, signed: &Signed) -> Markup {
    let dead = d.state == "dead";
    let held = d.state == "held";
    let cancellable = dead || held || d.state == "pending";
    let ambiguous = dead && d.error_class.as_deref() == Some("ambiguous");
    html! {
        @if cancellable {
            form method="post" action="/action" id="message-actions" {
                input type="hidden" name="csrf" value=(signed.csrf);
                input type="hidden" name="from" value="message";
                input type="hidden" name="id" value=(d.id);
                div.actions {
                    @if dead { button type="submit" name="do" value="replay:selected" id="replay" { "Replay" } }
                    @if ambiguous { button.secondary type="submit" name="do" value="confirm:selected" id="confirm" { "Confirm delivered" } }
                    @if held { button type="submit" name="do" value="approve:selected" id="approve" { "Approve" } }
                    button.danger type="submit" name="do" value="cancel:selected" id="cancel" { "Cancel" }
                }
            }
        }
    }
}

/// `GET /lookup?q=ID|KEY`: to the message's page, or a 404 naming what was looked up.
pub(crate) async fn lookup(
    State(app): State<Shared>,
    _signed: Signed,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let q = pairs(raw.unwrap_or_default().as_bytes());
    let Some(arg) = field(&q, "q") else {
        return Err(Failure::BadRequest(
            "look up what? give an id or a key".into(),
        ));
    };
    // Keys are 1 to 255 characters: anything longer names nothing, and is not sent on.
    if arg.chars().count() > 255 {
        return Err(Failure::BadRequest(
            "a message key is at most 255 characters".into(),
        ));
    }
    // PostgreSQL's text cannot hold NUL: no key has one, and sent on it would come back as
    // a database error, which reads as an outage.
    if arg.contains('\0') {
        return Err(Failure::BadRequest(
            "a message key has no NUL character".into(),
        ));
    }
    let target = Target::parse(arg);
    let c = client(&app).await?;
    let (mut found, _) = crate::ops::resolve(&**c, std::slice::from_ref(&target))
        .await
        .map_err(|e| Failure::db(&e))?;
    // Digits are an id first, as on the command line; but the console has one box for
    // both, and a key of digits only (an order number) could not be found at all. When no
    // message has that id, the digits are looked up as a key.
    if found.is_empty() && matches!(target, Target::Id(_)) {
        (found, _) = crate::ops::resolve(&**c, &[Target::Key(arg.to_owned())])
            .await
            .map_err(|e| Failure::db(&e))?;
    }
    match found.first() {
        Some((id, _)) => Ok(Redirect::to(&format!("/message/{id}")).into_response()),
        None => Err(Failure::NotFound(format!(
            "no such message: {}",
            match &target {
                Target::Id(id) => format!("id {id}"),
                Target::Key(k) => format!("key {}", quoted(k)),
            }
        ))),
    }
}
