//! One message with its history, and lookup by id or key.
//!
//! The message comes from [`crate::ops::show`], the function behind `outboxd show`, so the
//! payload is redacted exactly as there ([`crate::ops::redact_payload`]: header values, a
//! URL's user info, path and query, e-mail addresses and bodies).

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};

use super::auth::Signed;
use super::time::Clock;
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
    let clock = Clock(
        crate::ops::database_now(&**c)
            .await
            .map_err(|e| Failure::db(&e))?,
    );
    let title = format!("Message {}", detail.id);
    Ok(layout::page(&title, Some(&signed), body(&detail, &signed, &clock)).into_response())
}

/// Stored text, one line of visible characters (maud escapes the HTML).
fn t(s: &str) -> String {
    crate::text::escape(s).into_owned()
}

fn opt(s: &Option<String>) -> String {
    s.as_deref().map_or_else(|| "-".into(), t)
}

fn body(d: &MessageDetail, signed: &Signed, clock: &Clock) -> Markup {
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
                dt { "channel" } dd {
                    (t(&d.channel))
                    @if d.paused_channel {
                        span id="paused-channel" { " (" a href="/channels" { "paused" } ": not sent until a person resumes the channel)" }
                    }
                }
                dt { "state" } dd id="state" { b { (t(&d.state)) } }
                dt { "attempts" } dd { (d.attempts) " of " (d.max_attempts) " (retry ambiguous: " (d.retry_ambiguous) ")" }
                @if let Some(k) = &d.ordering_key { dt { "ordering key" } dd { (t(k)) } }
                @if let Some(host) = &d.paused_destination {
                    dt { "due" } dd id="paused" {
                        "held back: " a href=(super::destinations::href(host)) { (t(host)) } " is paused; not sent until a person resumes it"
                    }
                } @else if d.state == "pending" { dt { "due" } dd { (clock.at(&d.run_after)) } }
                dt { "created" } dd { (clock.at(&d.created_at)) }
                dt { "updated" } dd { (clock.at(&d.updated_at)) }
                @if d.lease_owner.is_some() {
                    dt { "lease" } dd {
                        (opt(&d.lease_owner))
                        @if let Some(until) = &d.lease_expires_at { ", until " (clock.at(until)) }
                    }
                }
                @if let Some(x) = &d.delivered_at { dt { "delivered" } dd { (clock.at(x)) } }
                @if let Some(x) = &d.dead_at { dt { "dead" } dd { (clock.at(x)) } }
                @if let Some(x) = &d.cancelled_at { dt { "cancelled" } dd { (clock.at(x)) } }
                @if d.error_class.is_some() {
                    dt { "error" } dd.err id="error-line" { (opt(&d.error_class)) ": " (opt(&d.last_error)) }
                }
                @if let Some(window) = key_window(d) {
                    dt { "key window" } dd id="key-window" {
                        (clock.either(window, "closed", "closes"))
                        @if clock.passed(window) {
                            span.muted { " (the provider may have forgotten the key: a replay sends it as new)" }
                        }
                    }
                }
            }
            (actions(d, signed))
        }
        section {
            h2 { "Payload " span.muted { "(header values, URL paths and queries redacted, as outboxd show does)" } }
            pre id="payload" { (pretty(&d.payload)) }
            @if let Some(r) = &d.response {
                (response(r, d, &pretty))
            }
        }
        section.scroll {
            h2 { "History" }
            @if d.history.is_empty() {
                p.muted { "No attempts yet." }
            } @else {
                table.rows id="history" {
                    thead { tr {
                        th.num { "attempt" } th { "outcome" } th { "class" } th.num { "status" }
                        th.hide-narrow { "dedup" } th { "worker" } th { "started" } th { "error" }
                    } }
                    tbody {
                        @for a in &d.history {
                            tr {
                                td.num data-label="attempt" { (a.attempt) }
                                td.outcome data-label="outcome" { (t(&a.outcome)) }
                                td data-label="class" { (opt(&a.error_class)) }
                                td.num data-label="status" { (a.status.map_or_else(|| "-".to_owned(), |s| s.to_string())) }
                                td.hide-narrow data-label="dedup" { (if a.deduplicated { "yes" } else { "no" }) }
                                td.worker.host data-label="worker" { (opt(&a.worker)) }
                                td data-label="started" { (clock.at(&a.started_at)) }
                                td.err data-label="error" { (opt(&a.error)) }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// When the provider's key window closes (`outbox.key_expires_at`, as `show --json` has
/// it), where it matters: a held or dead message, or one whose last attempt may have taken
/// effect (`ambiguous`), is the one a person may send again.
fn key_window(d: &MessageDetail) -> Option<&str> {
    let matters = matches!(d.state.as_str(), "held" | "dead")
        || d.error_class.as_deref() == Some("ambiguous");
    d.key_expires_at.as_deref().filter(|_| matters)
}

/// The stored response's member that holds the provider's body (`store_response`).
const BODY: &str = "body";

/// Most characters of a stored body shown on the page; `outboxd show --json` has all of it.
const BODY_SHOWN: usize = 4096;

/// The stored response, as `outboxd show` has it (`response`): the status and the content
/// type on a line each, the body (kept with `store_response`) as text or indented JSON,
/// each line escaped, cut past [`BODY_SHOWN`] characters with a note, and any other
/// members (`reconciled`, `confirmed`, an e-mail's reply codes) as JSON.
fn response(
    r: &serde_json::Value,
    d: &MessageDetail,
    pretty: &dyn Fn(&serde_json::Value) -> String,
) -> Markup {
    let delivered = d.state == "delivered";
    let title = if delivered {
        "Stored response"
    } else {
        "Last response"
    };
    let Some(obj) = r.as_object() else {
        return html! { h2 { (title) } pre id="response" { (pretty(r)) } };
    };
    let status = obj
        .get("status")
        .map(|s| crate::text::escape(&s.to_string()).into_owned());
    let content_type = obj
        .get("content_type")
        .and_then(serde_json::Value::as_str)
        .map(|s| crate::text::escape(s).into_owned());
    let cut_by_worker = obj
        .get("body_truncated")
        .and_then(serde_json::Value::as_bool)
        == Some(true);
    let body = obj.get(BODY).map(|b| match b {
        serde_json::Value::String(text) => text
            .lines()
            .map(crate::text::escape)
            .collect::<Vec<_>>()
            .join("\n"),
        other => pretty(other),
    });
    let (body, body_chars) = match body {
        Some(b) => {
            let n = b.chars().count();
            (Some(b.chars().take(BODY_SHOWN).collect::<String>()), n)
        }
        None => (None, 0),
    };
    let rest: serde_json::Map<String, serde_json::Value> = obj
        .iter()
        .filter(|(k, _)| {
            !matches!(k.as_str(), "status" | "content_type" | "body_truncated")
                && k.as_str() != BODY
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    html! {
        h2 { (title) }
        dl id="response-fields" {
            @if let Some(s) = &status { dt { "status" } dd id="response-status" { (s) } }
            @if let Some(ct) = &content_type { dt { "content type" } dd { (ct) } }
        }
        @if let Some(b) = &body {
            pre id="response-body" { (b) }
            @if body_chars > BODY_SHOWN {
                p.muted id="response-cut" {
                    "Showing the first " (BODY_SHOWN) " of " (body_chars) " characters; "
                    code { "outboxd show --json " (d.id) } " has the whole body."
                }
            }
            @if cut_by_worker {
                p.muted { "The provider's body was longer than the worker keeps (64 KiB), or did not end in time: it was stored cut." }
            }
        } @else if delivered {
            p.muted { "No body kept (the payload did not ask for it)." }
        }
        @if !rest.is_empty() {
            pre id="response" { (pretty(&serde_json::Value::Object(rest))) }
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
