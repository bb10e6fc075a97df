//! The sign-in page: the form, and the sign-in it posts (token, rate limit, name), which
//! starts a session ([`super::auth`]).
//!
//! Every value is interpolated by maud, which escapes it; nothing here uses `PreEscaped`.

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, State};
use axum::http::header;
use axum::response::{Html, IntoResponse, Redirect, Response};
use maud::html;

use super::{Failure, Shared, field, layout, pairs};

/// The sign-in form; `token` says whether a token is asked for.
fn signin_form(token: bool, problem: Option<&str>) -> Html<String> {
    layout::page(
        "Sign in",
        None,
        html! {
            section.signin {
                @if let Some(p) = problem {
                    p.error id="problem" { (p) }
                }
                form method="post" action="/signin" {
                    label { "Your name (shown in the history as console:NAME)"
                        input type="text" name="name" id="name" required maxlength="40"
                            pattern="[A-Za-z0-9._@-]{1,40}" autocomplete="username";
                    }
                    @if token {
                        label { "Token (OUTBOXD_CONSOLE_TOKEN)"
                            input type="password" name="token" id="token" required autocomplete="current-password";
                        }
                    }
                    button type="submit" id="signin" { "Sign in" }
                }
            }
        },
    )
}

pub(crate) async fn signin_page(State(app): State<Shared>) -> Response {
    signin_form(app.auth.token.is_some(), None).into_response()
}

/// A name as history shows it: `console:<name>`. Letters, digits and `._@-`, 1 to 40.
fn check_name(name: &str) -> Result<(), Failure> {
    let ok = (1..=40).contains(&name.chars().count())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '@' | '-'));
    if ok {
        Ok(())
    } else {
        Err(Failure::BadRequest(
            "a name is 1 to 40 letters, digits, '.', '_', '@' or '-'".into(),
        ))
    }
}

pub(crate) async fn signin(
    State(app): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: axum::body::Bytes,
) -> Response {
    let form = pairs(&body);
    let ip = peer.ip();
    if let Err(f) = app.auth.check_rate(ip) {
        return f.into_response();
    }
    let token = field(&form, "token").unwrap_or_default();
    if !app.auth.token_ok(token) {
        app.auth.record_failure(ip);
        tracing::warn!(peer = %ip, "console: sign-in with a wrong token");
        let page = signin_form(true, Some("wrong token"));
        return (axum::http::StatusCode::UNAUTHORIZED, page).into_response();
    }
    let name = field(&form, "name").unwrap_or_default();
    if let Err(f) = check_name(name) {
        return f.into_response();
    }
    let (id, session) = app.auth.create(name.to_owned());
    tracing::info!(operator = %session.name, "console: signed in");
    let cookie = app.auth.cookie(&id, app.auth.ttl.as_secs());
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}
