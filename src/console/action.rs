//! `POST /action`: replay, approve, cancel or confirm, in two steps.
//!
//! The first POST (from a listing's or a message's buttons) changes nothing: it resolves
//! the rows (the selected ids, or what the filter matches now, at most
//! [`MAX_ACTION_ROWS`]) and shows a confirmation page saying how many rows the action
//! touches and which. That page posts the same ids, by id, with the state and version
//! each was in (`seen=ID:STATE:VERSION`) and `confirmed=yes`; only then does the action
//! run, through [`crate::ops::replay_as_seen`] or [`crate::ops::checkpoint_as_seen`], which
//! hold each row to the state and version it was shown in — the CLI's
//! functions, so the SQL functions, their all-or-nothing rule and their history rows are
//! the same, with `console:<name>` as the actor. A row that changed state between the
//! two steps makes the whole action refused, naming it. Both steps check the CSRF token.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::html;

use super::auth::Signed;
use super::{Failure, MAX_ACTION_ROWS, Shared, bad, client, field, layout, pairs, quoted};
use crate::ops::{Checkpoint, CheckpointError, ReplayError, ReplaySelection, Target};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verb {
    Replay,
    Approve,
    Cancel,
    Confirm,
}

impl Verb {
    fn parse(s: &str) -> Option<Verb> {
        Some(match s {
            "replay" => Verb::Replay,
            "approve" => Verb::Approve,
            "cancel" => Verb::Cancel,
            "confirm" => Verb::Confirm,
            _ => return None,
        })
    }
    fn as_str(self) -> &'static str {
        match self {
            Verb::Replay => "replay",
            Verb::Approve => "approve",
            Verb::Cancel => "cancel",
            Verb::Confirm => "confirm",
        }
    }
    fn title(self) -> &'static str {
        match self {
            Verb::Replay => "Replay",
            Verb::Approve => "Approve",
            Verb::Cancel => "Cancel",
            Verb::Confirm => "Confirm delivered",
        }
    }
    fn done(self) -> &'static str {
        match self {
            Verb::Replay => "replayed",
            Verb::Approve => "approved",
            Verb::Cancel => "cancelled",
            Verb::Confirm => "confirmed",
        }
    }
}

/// Where the action was asked from: what "everything the filter matches" means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum From {
    Dead,
    Held,
    Message,
    /// `/messages`: ticked rows only (its filter spans every state).
    Messages,
}

/// A bad filter or id in an action's form: the page's message, and that nothing changed.
fn unchanged(f: Failure) -> Failure {
    match f {
        Failure::BadRequest(m) => bad(&m),
        other => other,
    }
}

pub(crate) async fn post(
    State(app): State<Shared>,
    signed: Signed,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let form = pairs(&body);
    // Before anything else, so a forged request learns nothing and changes nothing.
    signed.check_csrf(&form)?;
    let (verb, by_filter) = match field(&form, "do").and_then(|d| d.split_once(':')) {
        Some((v, scope @ ("selected" | "filter"))) => match Verb::parse(v) {
            Some(v) => (v, scope == "filter"),
            None => return Err(bad(&format!("unknown action {}", quoted(v)))),
        },
        _ => {
            return Err(bad(
                "no action given (do=replay|approve|cancel|confirm:selected|filter)",
            ));
        }
    };
    let from = match field(&form, "from") {
        Some("dead") => From::Dead,
        Some("held") => From::Held,
        Some("message") | None => From::Message,
        Some("messages") => From::Messages,
        Some(other) => return Err(bad(&format!("unknown page {}", quoted(other)))),
    };
    let mut c = client(&app).await?;
    let (chosen, matching) = if by_filter {
        // The first MAX_ACTION_ROWS, and how many match in all (which may be millions).
        let limit = MAX_ACTION_ROWS as i64;
        let (first, total) = match (from, verb) {
            (From::Dead, Verb::Replay | Verb::Cancel | Verb::Confirm) => {
                let q = super::dead::parse_filter(&form).map_err(unchanged)?;
                crate::ops::dead_ids(&**c, &q.filter, limit)
                    .await
                    .map_err(|e| Failure::db(&e))?
            }
            (From::Held, Verb::Approve | Verb::Cancel) => {
                let f = super::held::parse_filter(&form).map_err(unchanged)?;
                let (rows, total) = crate::ops::held_page(&**c, &f, limit, 0)
                    .await
                    .map_err(|e| Failure::db(&e))?;
                (
                    rows.into_iter().map(|h| (h.id, h.message_key)).collect(),
                    total,
                )
            }
            _ => {
                return Err(bad(&format!(
                    "{} does not apply to this page's rows",
                    verb.as_str()
                )));
            }
        };
        let matching = usize::try_from(total)
            .unwrap_or(usize::MAX)
            .max(first.len());
        (first, matching)
    } else {
        let ids = form
            .iter()
            .filter(|(k, _)| k == "id")
            .map(|(_, v)| super::message::parse_id(v))
            .collect::<Result<Vec<i64>, Failure>>()
            .map_err(unchanged)?;
        if ids.is_empty() {
            return Err(bad("no message selected"));
        }
        if ids.len() > MAX_ACTION_ROWS {
            return Err(bad(&format!("at most {MAX_ACTION_ROWS} messages at once")));
        }
        let targets: Vec<Target> = ids.into_iter().map(Target::Id).collect();
        let (found, unknown) = crate::ops::resolve(&**c, &targets)
            .await
            .map_err(|e| Failure::db(&e))?;
        if !unknown.is_empty() {
            return Err(Failure::NotFound(format!(
                "no such message: {}; nothing changed",
                unknown
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let n = found.len();
        (found, n)
    };
    if chosen.is_empty() {
        return Err(Failure::Refused(
            "no message matches the filter; nothing changed".into(),
        ));
    }
    if field(&form, "confirmed") != Some("yes") {
        // Before anything is confirmed, the SQL function is asked, and rolled back: a row
        // in a state the action does not take (ticked on `/messages`, say) is named now,
        // in the function's own words, not after the operator confirmed.
        if let Some(why) = refusal(&mut c, verb, &chosen).await? {
            return Err(Failure::Refused(why));
        }
        let ids: Vec<i64> = chosen.iter().map(|(id, _)| *id).collect();
        let states = crate::ops::states_of(&**c, &ids)
            .await
            .map_err(|e| Failure::db(&e))?;
        return Ok(confirmation(&signed, verb, &chosen, &states, matching).into_response());
    }
    // The states the confirmation page showed: the action holds to them (a row replayed
    // or approved by someone else meanwhile is not cancelled).
    let seen = form
        .iter()
        .filter(|(k, _)| k == "seen")
        .map(|(_, v)| {
            let mut parts = v.splitn(3, ':');
            let (Some(id), Some(state), Some(version)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(bad("a seen state must be ID:STATE:VERSION"));
            };
            let id = super::message::parse_id(id).map_err(unchanged)?;
            let version = version
                .parse::<i64>()
                .map_err(|_| bad("a seen state must be ID:STATE:VERSION"))?;
            let state = state.to_owned();
            Ok((id, crate::ops::Seen { state, version }))
        })
        .collect::<Result<Vec<_>, Failure>>()?;

    let targets: Vec<Target> = chosen.iter().map(|(id, _)| Target::Id(*id)).collect();
    let actor = signed.actor();
    let result = match verb {
        Verb::Replay => crate::ops::replay_as_seen(
            &mut c,
            &ReplaySelection::Named(targets),
            &actor,
            false,
            &seen,
        )
        .await
        .map_err(|e| match e {
            ReplayError::Database(e) => Failure::db(&e),
            ReplayError::Unknown(_) => Failure::NotFound(e.to_string()),
            ReplayError::NotDead(m) => Failure::Refused(m),
        }),
        other => {
            let action = match other {
                Verb::Approve => Checkpoint::Approve,
                Verb::Confirm => Checkpoint::Confirm,
                _ => Checkpoint::Cancel {
                    reason: field(&form, "reason").map(str::to_owned),
                },
            };
            crate::ops::checkpoint_as_seen(&mut c, &action, &targets, &actor, &seen)
                .await
                .map_err(|e| match e {
                    CheckpointError::Database(e) => Failure::db(&e),
                    e @ CheckpointError::Unknown { .. } => Failure::NotFound(e.to_string()),
                    CheckpointError::Refused(m) => Failure::Refused(m),
                    CheckpointError::Invalid(m) => Failure::BadRequest(m),
                    e @ CheckpointError::Empty(_) => Failure::BadRequest(e.to_string()),
                })
        }
    };
    let changed = result?;
    tracing::info!(
        operator = %signed.name,
        action = verb.as_str(),
        count = changed.len(),
        "console: action"
    );
    let title = format!("{} {} message(s)", capitalized(verb.done()), changed.len());
    let body = html! {
        section.notice id="result" {
            p { b { (verb.done()) " " (changed.len()) " message(s)" } ", recorded in their history as " code { (actor) } "." }
            ul {
                @for (id, key) in &changed {
                    li { a href={ "/message/" (id) } { (id) } " " (crate::text::escape(key)) }
                }
            }
            p {
                a href="/dead" { "Dead letters" } " · " a href="/held" { "Held" } " · "
                a href="/messages" { "Messages" } " · " a href="/" { "Overview" }
            }
        }
    };
    Ok(layout::page(&title, Some(&signed), body).into_response())
}

/// What the action's SQL function would refuse about `chosen`, asked in a transaction that
/// is rolled back (`outbox.replay`, `approve`, `cancel`, `confirm`: their rules, their
/// words), or None when it would go through.
async fn refusal(
    c: &mut deadpool_postgres::Object,
    verb: Verb,
    chosen: &[(i64, String)],
) -> Result<Option<String>, Failure> {
    let targets: Vec<Target> = chosen.iter().map(|(id, _)| Target::Id(*id)).collect();
    let refused = match verb {
        Verb::Replay => {
            match crate::ops::replay(c, &ReplaySelection::Named(targets), "console", true).await {
                Ok(_) => None,
                Err(ReplayError::Database(e)) => return Err(Failure::db(&e)),
                Err(e) => Some(e.to_string()),
            }
        }
        other => {
            let action = match other {
                Verb::Approve => Checkpoint::Approve,
                Verb::Confirm => Checkpoint::Confirm,
                _ => Checkpoint::Cancel { reason: None },
            };
            match crate::ops::checkpoint_dry_run(c, &action, &targets, "console").await {
                Ok(_) => None,
                Err(CheckpointError::Database(e)) => return Err(Failure::db(&e)),
                Err(e) => Some(e.to_string()),
            }
        }
    };
    Ok(refused)
}

fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().chain(c).collect())
        .unwrap_or_default()
}

/// The confirmation step: how many rows, which, and the button that does it.
fn confirmation(
    signed: &Signed,
    verb: Verb,
    chosen: &[(i64, String)],
    states: &std::collections::HashMap<i64, crate::ops::Seen>,
    matching: usize,
) -> axum::response::Html<String> {
    let n = chosen.len();
    let title = format!(
        "{} {n} message{}?",
        verb.title(),
        if n == 1 { "" } else { "s" }
    );
    let body = html! {
        section id="confirmation" {
            p id="touches" {
                "This " (verb.as_str()) "s " b { (n) " message" @if n != 1 { "s" } } "."
                @if matching > n {
                    " The filter matches " (matching) "; an action takes at most " (MAX_ACTION_ROWS)
                    " (the oldest), so repeat it for the rest."
                }
                " All or nothing: if one of them changed state meanwhile, none is touched."
            }
            form method="post" action="/action" {
                input type="hidden" name="csrf" value=(signed.csrf);
                input type="hidden" name="do" value={ (verb.as_str()) ":selected" };
                input type="hidden" name="confirmed" value="yes";
                @for (id, _) in chosen {
                    input type="hidden" name="id" value=(id);
                    @if let Some(seen) = states.get(id) {
                        input type="hidden" name="seen" value={ (id) ":" (seen.state) ":" (seen.version) };
                    }
                }
                @if verb == Verb::Cancel {
                    label { "Reason (optional, one line, kept in the history)"
                        input type="text" name="reason" id="reason" maxlength="500";
                    }
                }
                div.actions {
                    button type="submit" id="do-it" { (verb.title()) " " (n) " message" @if n != 1 { "s" } }
                    a href="/" { "Back, change nothing" }
                }
            }
            div.scroll {
                table.rows id="chosen" {
                    thead { tr { th.num { "id" } th { "key" } th { "state" } } }
                    tbody {
                        @for (id, key) in chosen {
                            tr {
                                td.num data-label="id" { (id) }
                                td.key data-label="key" { (crate::text::escape(key)) }
                                td data-label="state" { (states.get(id).map_or("-", |s| s.state.as_str())) }
                            }
                        }
                    }
                }
            }
        }
    };
    layout::page(&title, Some(signed), body)
}
