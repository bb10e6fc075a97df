//! The provider recipes of `docs/providers.md`, run as written (the page's own SQL and
//! command lines, the provider's address swapped for a stand-in's) by the real `outboxd run`
//! at trace level, against a real PostgreSQL and stand-ins that play each provider's
//! documented behaviour: Resend (idempotency keys kept 24 hours: the same key and body
//! answer the first result, another body 409), Postmark (no deduplication), Twilio (no key;
//! a message list filtered by recipient and day) and a Slack incoming webhook (plain-text
//! `ok` and errors). Each run ends with the check that the credential reached the stand-in
//! and nothing else: no log line, metric, row or operator output (a Slack webhook's URL,
//! its credential, is in its endpoint's row and nowhere else).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::binary::Daemon;
use common::console::{Console, get, sign_in};
use common::recipes::{assert_nowhere, blocks, cli, h, history, run_endpoint_set, run_sql};
use common::standin::{Answer, Request, StandIn};
use common::*;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

/// The daemon's flags in these runs: a short backoff, so a retry comes within the test.
const FAST: [&str; 2] = ["--retry-base", "200ms"];

/// `outboxd run` at its most verbose, with one endpoint secret.
fn daemon(db: &TestDb, args: &[&str], secret: Option<(&str, &str)>) -> Daemon {
    let mut env = vec![("RUST_LOG", "trace")];
    env.extend(secret);
    Daemon::start(&db.url(), args, &env)
}

/// The stored `payload -> 'json'` of a message: what the recipe asked to send.
async fn stored_json(db: &TestDb, key: &str) -> Value {
    db.client()
        .await
        .query_one(
            "SELECT payload -> 'json' FROM outbox.messages WHERE message_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

// --- Resend -------------------------------------------------------------------------------

const RESEND_KEY: &str = "Bearer re_RESENDSECRETMARK_0123";

/// Resend as its documentation describes `POST /emails`: a Bearer key, a JSON body, and
/// `Idempotency-Key` remembered (24 hours): the same key with the same body answers the first
/// result and sends nothing; with another body, `409 invalid_idempotent_request`; while the
/// first request with the key is still being processed, `409 concurrent_idempotent_requests`.
#[derive(Default)]
struct Resend {
    /// The e-mails sent: their request bodies.
    emails: Vec<Value>,
    /// What each idempotency key was first used with: the body and the answer.
    keys: HashMap<String, (Vec<u8>, Value)>,
    /// Keys whose first request sends the e-mail, then loses its answer (dropped).
    lose_answer: HashSet<String>,
    /// Keys whose first request sends the e-mail and is still being processed when the
    /// next request with the key comes (its connection dropped meanwhile).
    processing: HashSet<String>,
}

fn resend(state: &Mutex<Resend>, r: &Request) -> Answer {
    let mut s = state.lock().unwrap();
    let error = |status, name: &str, message: &str| {
        Answer::json(
            status,
            &json!({"statusCode": status, "name": name, "message": message}),
        )
    };
    match r.header("authorization") {
        None => {
            return error(
                401,
                "missing_api_key",
                "Missing API key in the authorization header",
            );
        }
        Some(k) if k != RESEND_KEY => return error(403, "invalid_api_key", "API key is invalid"),
        Some(_) => {}
    }
    if (r.method.as_str(), r.path.as_str()) != ("POST", "/emails") {
        return error(404, "not_found", "The requested endpoint does not exist");
    }
    let Ok(email) = serde_json::from_slice::<Value>(&r.body) else {
        return error(422, "validation_error", "Invalid JSON");
    };
    if email.get("from").is_none() || email.get("to").is_none() {
        return error(422, "validation_error", "Missing `to` or `from` field");
    }
    let key = r.header("idempotency-key");
    if key
        .as_ref()
        .is_some_and(|k| s.processing.contains(k) && s.keys.contains_key(k))
    {
        return error(
            409,
            "concurrent_idempotent_requests",
            "Same idempotency key used while original request is still in progress",
        );
    }
    if let Some((body, answer)) = key.as_ref().and_then(|k| s.keys.get(k)) {
        return if *body == r.body {
            Answer::json(200, answer)
        } else {
            error(
                409,
                "invalid_idempotent_request",
                "Same idempotency key used with a different request payload",
            )
        };
    }
    s.emails.push(email);
    let answer = json!({"id": format!("4ef9a417-02e9-4d39-ad75-9611e0fcc3{:02}", s.emails.len())});
    let Some(k) = key else {
        return Answer::json(200, &answer);
    };
    s.keys.insert(k.clone(), (r.body.clone(), answer.clone()));
    if s.lose_answer.remove(&k) || s.processing.contains(&k) {
        return Answer::Drop;
    }
    Answer::json(200, &answer)
}

/// The Resend recipe as written: its answer lost after the e-mail was sent, the retry
/// carries the same key and bytes, Resend answers the first result, and there is one e-mail
/// and a delivered message that keeps Resend's object. A key Resend already holds with
/// another body is refused (409): dead, permanent, no e-mail. A retry that comes while
/// Resend still processes the first request is refused too (409): after an answer lost,
/// that is dead `ambiguous`, for a person, and nothing more is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resend_one_email_after_a_lost_answer() {
    let db = TestDb::new().await;
    let state = Arc::new(Mutex::new(Resend {
        lose_answer: HashSet::from(["welcome:user-7".to_owned()]),
        processing: HashSet::from(["welcome:user-9".to_owned()]),
        ..Default::default()
    }));
    let st = state.clone();
    let p = StandIn::start(move |r| resend(&st, r)).await;
    for sql in blocks("Resend", "sql", &[("https://api.resend.com", &p.origin())]) {
        run_sql(&db, &sql, false).await;
    }
    // Another sender used this key with other content within Resend's 24 hours.
    state.lock().unwrap().keys.insert(
        "welcome:user-8".into(),
        (b"{\"other\": true}".to_vec(), json!({"id": "other"})),
    );
    let c = db.client().await;
    let payload = json!({"endpoint": "resend", "path": "/emails",
        "json": {"from": "shop@example.com", "to": ["bob@example.com"], "subject": "Hi", "text": "Hi"}});
    for key in ["welcome:user-8", "welcome:user-9"] {
        outboxd::enqueue(&c, &outboxd::NewMessage::http(key, payload.clone()))
            .await
            .unwrap();
    }

    let d = daemon(&db, &FAST, Some(("OUTBOXD_SECRET_RESEND", RESEND_KEY)));
    let row = wait_for_state(&db, "welcome:user-7", "delivered", WAIT).await;
    let conflict = wait_for_state(&db, "welcome:user-8", "dead", WAIT).await;
    let concurrent = wait_for_state(&db, "welcome:user-9", "dead", WAIT).await;
    let metrics = d.metrics().await;
    let out = d.stop().await;

    let (emails, id) = {
        let s = state.lock().unwrap();
        (s.emails.clone(), s.keys["welcome:user-7"].1["id"].clone())
    };
    let to = |who: &str| emails.iter().filter(|e| e["to"][0] == who).count();
    assert_eq!(to("ada@example.com"), 1, "one e-mail: {emails:?}");
    let sent = p.seen();
    let of = |key: &str| -> Vec<&Request> {
        sent.iter()
            .filter(|r| r.header("idempotency-key").as_deref() == Some(key))
            .collect()
    };
    let tries = of("welcome:user-7");
    assert_eq!(tries.len(), 2, "the request and its retry");
    for r in &tries {
        assert_eq!(r.call(), "POST /emails");
        assert_eq!(r.header("authorization").as_deref(), Some(RESEND_KEY));
        assert_eq!(
            r.header("content-type").as_deref(),
            Some("application/json")
        );
        // The recipe's `json`, byte for byte the same on the retry.
        assert_eq!(r.body, tries[0].body);
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body, stored_json(&db, "welcome:user-7").await);
    }
    let response = row.response.unwrap();
    assert_eq!(response["status"], 200, "{response}");
    assert_eq!(
        response["body"]["id"], id,
        "Resend's object is kept: {response}"
    );
    assert_eq!(
        history(&db, "welcome:user-7").await,
        h(&[("retry", Some("ambiguous")), ("delivered", None)])
    );
    assert_eq!(conflict.error_class.as_deref(), Some("permanent"));
    assert_eq!(of("welcome:user-8").len(), 1, "a 409 is not retried");
    assert_eq!(attempts(&db, "welcome:user-8").await[0].3, Some(409));
    // The first request of welcome:user-9 sent its e-mail; the retry met a 409.
    assert_eq!(to("bob@example.com"), 1, "{emails:?}");
    assert_eq!(concurrent.error_class.as_deref(), Some("ambiguous"));
    assert_eq!(of("welcome:user-9").len(), 2);
    assert_eq!(
        history(&db, "welcome:user-9").await,
        h(&[("retry", Some("ambiguous")), ("dead", Some("ambiguous"))])
    );
    assert_nowhere(
        &db,
        &out,
        &metrics,
        &["welcome:user-7", "welcome:user-8", "welcome:user-9"],
        "RESENDSECRETMARK",
        false,
    )
    .await;
}

// --- Postmark -----------------------------------------------------------------------------

const POSTMARK_TOKEN: &str = "POSTMARKSECRETMARK-5e1c-4b6f";

/// Postmark as documented: `X-Postmark-Server-Token`, `POST /email` with a JSON body, no
/// idempotency (every request is an e-mail), and `GET /messages/outbound` (`count` and
/// `offset` required) filtered here by `metadata_<field>`.
#[derive(Default)]
struct Postmark {
    /// The e-mails sent.
    emails: Vec<Value>,
    /// The `Metadata.outbox_key`s whose first answer was dropped.
    lost: HashSet<String>,
}

fn postmark(state: &Mutex<Postmark>, r: &Request) -> Answer {
    let mut s = state.lock().unwrap();
    let error = |status, code: u32, message: &str| {
        Answer::json(status, &json!({"ErrorCode": code, "Message": message}))
    };
    if r.header("x-postmark-server-token").as_deref() != Some(POSTMARK_TOKEN) {
        return error(
            401,
            10,
            "No Account or Server API tokens were supplied in the HTTP headers",
        );
    }
    match (r.method.as_str(), r.path.as_str()) {
        ("POST", "/email") => {
            let Ok(email) = serde_json::from_slice::<Value>(&r.body) else {
                return error(422, 402, "Received invalid JSON input");
            };
            if email.get("From").is_none() || email.get("To").is_none() {
                return error(422, 300, "Invalid email request");
            }
            let id = format!(
                "b7bc2f4a-e38e-4336-af7d-e6c392c2f8{:02}",
                s.emails.len() + 1
            );
            let key = email["Metadata"]["outbox_key"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            let mut stored = email.clone();
            stored["MessageID"] = json!(id);
            s.emails.push(stored);
            if s.lost.insert(key) {
                return Answer::Drop;
            }
            Answer::json(
                200,
                &json!({"To": email["To"], "SubmittedAt": "2026-12-07T10:00:00Z",
                        "MessageID": id, "ErrorCode": 0, "Message": "OK"}),
            )
        }
        ("GET", "/messages/outbound") => {
            let count: Option<usize> = r.query_param("count").and_then(|c| c.parse().ok());
            let (Some(count), Some(_)) = (count, r.query_param("offset")) else {
                return error(422, 1101, "count and offset are required");
            };
            let filters: Vec<(String, String)> = r
                .query_pairs()
                .into_iter()
                .filter_map(|(k, v)| k.strip_prefix("metadata_").map(|f| (f.to_owned(), v)))
                .collect();
            let found: Vec<Value> = s
                .emails
                .iter()
                .filter(|e| filters.iter().all(|(f, v)| e["Metadata"][f] == json!(v)))
                .map(|e| json!({"MessageID": e["MessageID"], "To": [{"Email": e["To"]}],
                                "Subject": e["Subject"], "Metadata": e["Metadata"], "Status": "Sent"}))
                .collect();
            let total = found.len();
            let page: Vec<Value> = found.into_iter().rev().take(count).collect();
            Answer::json(200, &json!({"TotalCount": total, "Messages": page}))
        }
        _ => error(404, 0, "Not found"),
    }
}

/// The Postmark recipe as written: the endpoint set from the command line (another auth
/// header, no idempotency header), and each message's first answer lost after the e-mail
/// went. By default the message is sent again: two e-mails, as the page warns. With
/// `retry_ambiguous => false` it is dead `ambiguous`, one e-mail, for a person. With the
/// lookup, the search finds it: one e-mail, reconciled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postmark_resends_or_waits_for_a_person_as_the_message_chose() {
    let db = TestDb::new().await;
    let state = Arc::new(Mutex::new(Postmark::default()));
    let st = state.clone();
    let p = StandIn::start(move |r| postmark(&st, r)).await;
    let sh = blocks(
        "Postmark",
        "sh",
        &[("https://api.postmarkapp.com", &p.origin())],
    );
    run_endpoint_set(&db, &sh[0]).await;
    let listed: Value =
        serde_json::from_str(&cli(&db, &["endpoint", "list", "--json"]).await).unwrap();
    assert_eq!(
        listed[0]["auth_header"], "X-Postmark-Server-Token",
        "{listed}"
    );
    assert_eq!(listed[0]["idempotency_header"], Value::Null, "{listed}");
    assert_eq!(listed[0]["auth_secret"], "postmark", "{listed}");
    for sql in blocks("Postmark", "sql", &[]) {
        run_sql(&db, &sql, true).await;
    }

    let d = daemon(
        &db,
        &FAST,
        Some(("OUTBOXD_SECRET_POSTMARK", POSTMARK_TOKEN)),
    );
    let resent = wait_for_state(&db, "newsletter-12:ada", "delivered", WAIT).await;
    let waiting = wait_for_state(&db, "invoice-9:mail", "dead", WAIT).await;
    let looked_up = wait_for_state(&db, "invoice-10:mail", "delivered", WAIT).await;
    let metrics = d.metrics().await;
    let out = d.stop().await;

    let emails = |key: &str| -> Vec<Value> {
        state
            .lock()
            .unwrap()
            .emails
            .iter()
            .filter(|e| e["Metadata"]["outbox_key"] == key)
            .cloned()
            .collect()
    };
    let requests = p.seen();
    for r in &requests {
        assert_eq!(
            r.header("x-postmark-server-token").as_deref(),
            Some(POSTMARK_TOKEN)
        );
        assert!(r.header("idempotency-key").is_none(), "{r:?}");
    }
    // Default: sent again after the lost answer; Postmark sent it twice.
    assert_eq!(emails("newsletter-12:ada").len(), 2);
    assert_eq!(
        history(&db, "newsletter-12:ada").await,
        h(&[("retry", Some("ambiguous")), ("delivered", None)])
    );
    assert!(resent.response.unwrap()["body"]["MessageID"].is_string());
    // retry_ambiguous => false: one e-mail, and a person decides.
    assert_eq!(emails("invoice-9:mail").len(), 1);
    assert_eq!(waiting.error_class.as_deref(), Some("ambiguous"));
    assert_eq!(
        history(&db, "invoice-9:mail").await,
        h(&[("dead", Some("ambiguous"))])
    );
    // With the lookup: found, one e-mail, Postmark's message kept.
    let sent = emails("invoice-10:mail");
    assert_eq!(sent.len(), 1);
    let response = looked_up.response.unwrap();
    assert_eq!(response["reconciled"], true, "{response}");
    assert_eq!(
        response["body"]["MessageID"], sent[0]["MessageID"],
        "{response}"
    );
    let lookup = requests
        .iter()
        .find(|r| r.method == "GET")
        .expect("a lookup");
    assert_eq!(lookup.path, "/messages/outbound");
    assert_eq!(
        lookup.query_param("metadata_outbox_key").as_deref(),
        Some("invoice-10:mail")
    );
    assert_eq!(
        history(&db, "invoice-10:mail").await,
        h(&[("retry", Some("ambiguous")), ("reconciled", None)])
    );
    assert_nowhere(
        &db,
        &out,
        &metrics,
        &["newsletter-12:ada", "invoice-9:mail", "invoice-10:mail"],
        "POSTMARKSECRETMARK",
        false,
    )
    .await;
}

// --- Twilio -------------------------------------------------------------------------------

/// `Basic base64("AC0123:TWILIOSECRETMARK")`.
const TWILIO_AUTH: &str = "Basic QUMwMTIzOlRXSUxJT1NFQ1JFVE1BUks=";
const TWILIO_PATH: &str = "/2010-04-01/Accounts/AC0123/Messages.json";

/// How the stand-in loses the first request to a number.
#[derive(Clone, Copy)]
enum Lose {
    /// Makes the SMS, then drops the connection.
    AfterEffect,
    /// Drops the connection before making anything.
    BeforeEffect,
}

/// Twilio's Messages resource as documented: Basic auth, `POST …/Messages.json` with a
/// form (`To`, `From`, `Body`) answered `201` with the message, no idempotency key (every
/// request is an SMS), and `GET …/Messages.json` filtered by `To`, `From` and `DateSent`
/// (a UTC day), newest first, `PageSize` of them, under `messages`.
#[derive(Default)]
struct Twilio {
    /// The SMS made, newest last.
    sms: Vec<Value>,
    /// Today, as `DateSent` takes it (the database's UTC day).
    today: String,
    /// Numbers whose first request is lost, and how.
    lose: HashMap<String, Lose>,
}

fn twilio(state: &Mutex<Twilio>, r: &Request) -> Answer {
    let mut s = state.lock().unwrap();
    let error = |status, code: u32, message: &str| {
        Answer::json(
            status,
            &json!({"code": code, "message": message, "status": status}),
        )
    };
    if r.header("authorization").as_deref() != Some(TWILIO_AUTH) {
        return error(401, 20003, "Authenticate");
    }
    if r.path != TWILIO_PATH {
        return error(404, 20404, "The requested resource was not found");
    }
    match r.method.as_str() {
        "POST" => {
            let (Some(to), Some(from), Some(body)) = (
                r.form_field("To"),
                r.form_field("From"),
                r.form_field("Body"),
            ) else {
                return error(400, 21604, "A 'To' phone number is required.");
            };
            let lose = s.lose.remove(&to);
            if let Some(Lose::BeforeEffect) = lose {
                return Answer::Drop;
            }
            let sms = json!({"sid": format!("SM{:032}", s.sms.len() + 1), "to": to, "from": from,
                "body": body, "status": "sent", "date_sent": s.today});
            s.sms.push(sms.clone());
            match lose {
                Some(_) => Answer::Drop,
                None => Answer::json(201, &sms),
            }
        }
        "GET" => {
            let size: usize = r
                .query_param("PageSize")
                .and_then(|n| n.parse().ok())
                .unwrap_or(50);
            let filter = |field: &str, param: &str, sms: &Value| {
                r.query_param(param)
                    .is_none_or(|v| sms[field].as_str() == Some(v.as_str()))
            };
            let messages: Vec<Value> = s
                .sms
                .iter()
                .rev()
                .filter(|m| {
                    filter("to", "To", m)
                        && filter("from", "From", m)
                        && filter("date_sent", "DateSent", m)
                })
                .take(size)
                .cloned()
                .collect();
            Answer::json(
                200,
                &json!({"messages": messages, "page": 0, "page_size": size}),
            )
        }
        _ => error(405, 20004, "Method not allowed"),
    }
}

/// The database's UTC day, as Twilio's `DateSent` takes it.
async fn today(db: &TestDb) -> String {
    db.scalar("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD')")
        .await
}

/// The recipe's SQL for the number `to` and the user `user` (the page's example is
/// `+15550100`, `user-7` and a fixed day, which becomes today).
fn twilio_recipe(origin: &str, day: &str, to: &str, user: &str) -> String {
    let sql = blocks(
        "Twilio",
        "sql",
        &[
            ("https://api.twilio.com", origin),
            ("2026-12-07", day),
            ("+15550100", to),
            ("user-7", user),
        ],
    );
    assert_eq!(sql.len(), 1);
    sql.into_iter().next().unwrap()
}

/// The Twilio recipe as written, three ways in one run. An answer lost after the SMS was
/// made: the lookup (by number and day) finds it, one SMS, reconciled. A connection lost
/// before: the lookup finds nothing and it is sent in the same attempt, one SMS. And the
/// page's warning: another SMS to the same number that day settles a message that was
/// never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twilio_finds_a_lost_sms_by_number_and_day() {
    let db = TestDb::new().await;
    let day = today(&db).await;
    let state = Arc::new(Mutex::new(Twilio {
        today: day.clone(),
        ..Default::default()
    }));
    {
        let mut s = state.lock().unwrap();
        s.lose.insert("+15550100".into(), Lose::AfterEffect);
        s.lose.insert("+15550102".into(), Lose::BeforeEffect);
        s.lose.insert("+15550103".into(), Lose::BeforeEffect);
        s.sms.push(
            json!({"sid": "SM-earlier", "to": "+15550103", "from": "+15550111",
            "body": "Your parcel arrives today", "status": "sent", "date_sent": day}),
        );
    }
    let st = state.clone();
    let p = StandIn::start(move |r| twilio(&st, r)).await;
    let origin = p.origin();
    run_sql(
        &db,
        &twilio_recipe(&origin, &day, "+15550100", "user-7"),
        false,
    )
    .await;
    run_sql(
        &db,
        &twilio_recipe(&origin, &day, "+15550102", "user-8"),
        true,
    )
    .await;
    run_sql(
        &db,
        &twilio_recipe(&origin, &day, "+15550103", "user-9"),
        true,
    )
    .await;
    let key = |user: &str| format!("otp:{user}:{day}");

    let d = daemon(&db, &FAST, Some(("OUTBOXD_SECRET_TWILIO", TWILIO_AUTH)));
    let found = wait_for_state(&db, &key("user-7"), "delivered", WAIT).await;
    let sent = wait_for_state(&db, &key("user-8"), "delivered", WAIT).await;
    let mistaken = wait_for_state(&db, &key("user-9"), "delivered", WAIT).await;
    let metrics = d.metrics().await;
    let out = d.stop().await;

    let sms_to = |to: &str| -> Vec<Value> {
        state
            .lock()
            .unwrap()
            .sms
            .iter()
            .filter(|m| m["to"] == to)
            .cloned()
            .collect()
    };
    let requests = p.seen();
    for r in &requests {
        assert_eq!(r.header("authorization").as_deref(), Some(TWILIO_AUTH));
        assert!(r.header("idempotency-key").is_none(), "{r:?}");
        assert_eq!(r.path, TWILIO_PATH, "the endpoint's own path is kept");
    }
    let calls_to = |to: &str| -> Vec<String> {
        requests
            .iter()
            .filter(|r| r.form_field("To").or(r.query_param("To")).as_deref() == Some(to))
            .map(|r| r.method.clone())
            .collect()
    };
    // Lost after the effect: found by the list, one SMS.
    assert_eq!(sms_to("+15550100").len(), 1);
    assert_eq!(calls_to("+15550100"), ["POST", "GET"]);
    let response = found.response.unwrap();
    assert_eq!(response["reconciled"], true, "{response}");
    assert_eq!(response["body"]["sid"], sms_to("+15550100")[0]["sid"]);
    assert_eq!(
        history(&db, &key("user-7")).await,
        h(&[("retry", Some("ambiguous")), ("reconciled", None)])
    );
    // The recipe's form, its members in the order the stored payload (jsonb) has them.
    let post = requests
        .iter()
        .find(|r| r.method == "POST" && r.form_field("To").as_deref() == Some("+15550100"))
        .unwrap();
    assert_eq!(
        post.form(),
        [
            ("Body".to_owned(), "Your code is 123456".to_owned()),
            ("From".to_owned(), "+15550111".to_owned()),
            ("To".to_owned(), "+15550100".to_owned())
        ]
    );
    assert_eq!(
        post.header("content-type").as_deref(),
        Some("application/x-www-form-urlencoded")
    );
    let lookup = requests
        .iter()
        .find(|r| r.method == "GET" && r.query_param("To").as_deref() == Some("+15550100"))
        .unwrap();
    assert_eq!(lookup.query_param("DateSent"), Some(day.clone()));
    assert_eq!(lookup.query_param("PageSize").as_deref(), Some("1"));
    // Lost before the effect: nothing found, sent in the same attempt, one SMS.
    assert_eq!(sms_to("+15550102").len(), 1);
    assert_eq!(calls_to("+15550102"), ["POST", "GET", "POST"]);
    assert!(sent.response.unwrap().get("reconciled").is_none());
    assert_eq!(
        history(&db, &key("user-8")).await,
        h(&[("retry", Some("ambiguous")), ("delivered", None)])
    );
    // The page's warning: the day's other SMS to the number settles this one, never sent.
    let other = sms_to("+15550103");
    assert_eq!(other.len(), 1, "the code never went: {other:?}");
    assert_eq!(calls_to("+15550103"), ["POST", "GET"]);
    assert_eq!(
        mistaken.response.unwrap()["body"]["body"],
        "Your parcel arrives today"
    );
    assert_nowhere(
        &db,
        &out,
        &metrics,
        &[&key("user-7"), &key("user-8"), &key("user-9")],
        TWILIO_AUTH.trim_start_matches("Basic "),
        false,
    )
    .await;
}

/// A connection refused before anything was sent is transient: the next attempt sends
/// again without a lookup (nothing to look for), and there is one SMS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twilio_refused_connection_sends_again_without_a_lookup() {
    let db = TestDb::new().await;
    let day = today(&db).await;
    // A port nothing listens on yet: the first attempt is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let origin = format!("http://127.0.0.1:{port}");
    run_sql(
        &db,
        &twilio_recipe(&origin, &day, "+15550100", "user-7"),
        false,
    )
    .await;
    let key = format!("otp:user-7:{day}");
    let d = daemon(
        &db,
        &["--retry-base", "1s"],
        Some(("OUTBOXD_SECRET_TWILIO", TWILIO_AUTH)),
    );
    let k = key.clone();
    let dbr = &db;
    wait_until(WAIT, "the refused attempt", || {
        let k = k.clone();
        async move { !attempts(dbr, &k).await.is_empty() }
    })
    .await;
    let state = Arc::new(Mutex::new(Twilio {
        today: day.clone(),
        ..Default::default()
    }));
    let st = state.clone();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let p = StandIn::serve(listener, move |r| twilio(&st, r));
    wait_for_state(&db, &key, "delivered", WAIT).await;
    let metrics = d.metrics().await;
    let out = d.stop().await;
    assert_eq!(state.lock().unwrap().sms.len(), 1);
    assert_eq!(p.calls(), [format!("POST {TWILIO_PATH}")]);
    assert_eq!(
        history(&db, &key).await,
        h(&[("retry", Some("transient")), ("delivered", None)])
    );
    assert_nowhere(
        &db,
        &out,
        &metrics,
        &[&key],
        TWILIO_AUTH.trim_start_matches("Basic "),
        false,
    )
    .await;
}

// --- Slack --------------------------------------------------------------------------------

/// The secret part of the recipe's webhook URL (`…/T00000000/B00000000/<this>`).
const SLACK_SECRET: &str = "SLACKSECRETMARKaaaaaaaaa";

/// Slack's incoming webhooks as documented: `POST` JSON to the webhook's URL, `200 ok` as
/// plain text; errors as plain text with a status: `400 invalid_payload`, `404
/// channel_not_found`, `404 no_service` (a revoked or unknown webhook), `410
/// channel_is_archived`, `429` with `Retry-After`, `500 rollup_error`. The stand-in holds
/// three webhooks: the recipe's, one whose channel was deleted, one whose channel was
/// archived; a text with `[429]` or `[500]` meets that error on its first post.
#[derive(Default)]
struct Slack {
    /// The texts posted.
    posts: Vec<String>,
    /// Texts that met their error already.
    failed: HashSet<String>,
}

fn slack(state: &Mutex<Slack>, r: &Request) -> Answer {
    let mut s = state.lock().unwrap();
    let channel = if r.path == slack_hook("B00000000", 'a') {
        "live"
    } else if r.path == slack_hook("B00000001", 'b') {
        "deleted"
    } else if r.path == slack_hook("B00000002", 'c') {
        "archived"
    } else {
        return Answer::text(404, "no_service");
    };
    if r.method != "POST" {
        return Answer::text(405, "invalid_method");
    }
    let text = serde_json::from_slice::<Value>(&r.body)
        .ok()
        .and_then(|b| b["text"].as_str().map(str::to_owned));
    let Some(text) = text else {
        return Answer::text(400, "invalid_payload");
    };
    match channel {
        "deleted" => return Answer::text(404, "channel_not_found"),
        "archived" => return Answer::text(410, "channel_is_archived"),
        _ => {}
    }
    if text.contains("[429]") && s.failed.insert(text.clone()) {
        return Answer::text(429, "rate_limited").with_header("retry-after", "2");
    }
    if text.contains("[500]") && s.failed.insert(text.clone()) {
        return Answer::text(500, "rollup_error");
    }
    s.posts.push(text);
    Answer::text(200, "ok")
}

/// The path of the stand-in's webhook `b`, whose secret part is [`SLACK_SECRET`]'s marker
/// and `c` nine times.
fn slack_hook(b: &str, c: char) -> String {
    format!(
        "/services/T00000000/{b}/SLACKSECRETMARK{}",
        String::from(c).repeat(9)
    )
}

/// The Slack recipe as written: the webhook's whole URL set as an endpoint from the
/// command line, the message naming it with no path. The request goes to the webhook's URL
/// exactly, with no idempotency or auth header. Slack's answers, each webhook through an
/// endpoint of its own: `200 ok` delivers; `400 invalid_payload`, `404 no_service`, `404
/// channel_not_found` and `410 channel_is_archived` are dead at once, permanent, never
/// retried; `429` is retried after its `Retry-After`, `500` after the backoff. The URL's
/// secret path is in `outbox.endpoints` and `outboxd endpoint list`, where the operator put
/// it, and in no message row, log line, metric, history row, `show` or console page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_webhook_answers_and_the_secret_path() {
    let db = TestDb::new().await;
    let state = Arc::new(Mutex::new(Slack::default()));
    let st = state.clone();
    let p = StandIn::start(move |r| slack(&st, r)).await;
    let origin = p.origin();
    let swaps = [
        ("https://hooks.slack.com", origin.as_str()),
        ("XXXXXXXXXXXXXXXXXXXXXXXX", SLACK_SECRET),
    ];
    let sh = blocks("Slack", "sh", &swaps);
    let set = run_endpoint_set(&db, &sh[0]).await;
    assert!(
        !set.stdout.contains("SLACKSECRETMARK") && set.stdout.contains("127.0.0.1"),
        "`endpoint set` names the host only: {}",
        set.stdout
    );
    for sql in blocks("Slack", "sql", &swaps) {
        run_sql(&db, &sql, true).await;
    }
    // The application's enqueue names the endpoint only.
    let stored: Value = db
        .client()
        .await
        .query_one(
            "SELECT payload FROM outbox.messages WHERE message_key = 'deploy-42:announce'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        stored,
        json!({"endpoint": "slack-deploys", "json": {"text": "Deploy 42 finished"}})
    );
    // One endpoint for each of the stand-in's other webhooks, as an operator would set them.
    for (name, b, c) in [
        ("slack-revoked", "B00000009", 'z'),
        ("slack-deleted", "B00000001", 'b'),
        ("slack-archived", "B00000002", 'c'),
    ] {
        let url = format!("{origin}{}", slack_hook(b, c));
        let out = cli(
            &db,
            &[
                "endpoint",
                "set",
                name,
                "--url",
                &url,
                "--no-idempotency-header",
            ],
        )
        .await;
        assert!(!out.contains("SLACKSECRETMARK"), "{out}");
    }
    // And one whose host refuses the connection (nothing listens on the port): the error
    // names the host, not the path.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let gone = format!("http://127.0.0.1:{closed}{}", slack_hook("B00000003", 'd'));
    cli(
        &db,
        &[
            "endpoint",
            "set",
            "slack-gone",
            "--url",
            &gone,
            "--no-idempotency-header",
        ],
    )
    .await;
    let c = db.client().await;
    let cases = [
        ("slack:invalid", "slack-deploys", json!({"txt": "typo"})),
        ("slack:revoked", "slack-revoked", json!({"text": "hello"})),
        ("slack:deleted", "slack-deleted", json!({"text": "hello"})),
        ("slack:archived", "slack-archived", json!({"text": "hello"})),
        ("slack:rate", "slack-deploys", json!({"text": "busy [429]"})),
        (
            "slack:hiccup",
            "slack-deploys",
            json!({"text": "flaky [500]"}),
        ),
    ];
    for (key, endpoint, body) in &cases {
        let msg = outboxd::NewMessage::http(*key, json!({"endpoint": endpoint, "json": body}));
        outboxd::enqueue(&c, &msg).await.unwrap();
    }
    let msg = outboxd::NewMessage::http(
        "slack:gone",
        json!({"endpoint": "slack-gone", "json": {"text": "hello"}}),
    )
    .max_attempts(1);
    outboxd::enqueue(&c, &msg).await.unwrap();

    let d = daemon(&db, &FAST, None);
    let ok = wait_for_state(&db, "deploy-42:announce", "delivered", WAIT).await;
    for (key, status) in [
        ("slack:invalid", 400),
        ("slack:revoked", 404),
        ("slack:deleted", 404),
        ("slack:archived", 410),
    ] {
        let row = wait_for_state(&db, key, "dead", WAIT).await;
        assert_eq!(row.error_class.as_deref(), Some("permanent"), "{key}");
        let tries = attempts(&db, key).await;
        assert_eq!(tries.len(), 1, "{key}: never retried");
        assert_eq!(tries[0].3, Some(status), "{key}");
    }
    let refused = wait_for_state(&db, "slack:gone", "dead", WAIT).await;
    assert_eq!(refused.error_class.as_deref(), Some("exhausted"));
    let error = refused.last_error.unwrap_or_default();
    assert!(error.starts_with("cannot connect to 127.0.0.1"), "{error}");
    for (key, status) in [("slack:invalid", 400), ("slack:archived", 410)] {
        let row = wait_for_state(&db, key, "dead", WAIT).await;
        assert_eq!(
            row.last_error.as_deref(),
            Some(format!("HTTP {status} from 127.0.0.1").as_str())
        );
    }
    for key in ["slack:rate", "slack:hiccup"] {
        wait_for_state(&db, key, "delivered", WAIT).await;
        assert_eq!(
            history(&db, key).await,
            h(&[("retry", Some("transient")), ("delivered", None)]),
            "{key}"
        );
    }
    let metrics = d.metrics().await;
    let out = d.stop().await;

    assert_eq!(ok.attempts, 1);
    // Three posts, each once: the failures posted nothing.
    let mut posts = state.lock().unwrap().posts.clone();
    posts.sort();
    assert_eq!(posts, ["Deploy 42 finished", "busy [429]", "flaky [500]"]);
    let seen = p.seen();
    let first = seen
        .iter()
        .find(|r| r.body.windows(7).any(|w| w == b"Deploy "))
        .unwrap();
    // The endpoint's URL exactly: its whole path, nothing added, no query.
    assert_eq!(first.method, "POST");
    assert_eq!(first.path, slack_hook("B00000000", 'a'));
    assert_eq!(first.query, None);
    assert_eq!(
        first.header("content-type").as_deref(),
        Some("application/json")
    );
    let body: Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(body, json!({"text": "Deploy 42 finished"}));
    // No secret, no key: Slack takes neither.
    for r in &seen {
        assert_eq!(r.header("authorization"), None);
        assert_eq!(r.header("idempotency-key"), None);
    }
    // Every other request went to its endpoint's webhook, exactly.
    let paths: HashSet<String> = seen.iter().map(|r| r.path.clone()).collect();
    let expected: HashSet<String> = [
        ("B00000000", 'a'),
        ("B00000009", 'z'),
        ("B00000001", 'b'),
        ("B00000002", 'c'),
    ]
    .iter()
    .map(|(b, c)| slack_hook(b, *c))
    .collect();
    assert_eq!(paths, expected);
    assert!(seen.iter().all(|r| r.query.is_none()));
    // Retry-After: 2 was honoured (the backoff alone is 200 ms).
    let rate: Vec<_> = seen
        .iter()
        .filter(|r| r.body.windows(5).any(|w| w == b"[429]"))
        .collect();
    assert_eq!(rate.len(), 2);
    assert!(
        rate[1].at - rate[0].at >= Duration::from_millis(1900),
        "retried after {:?}",
        rate[1].at - rate[0].at
    );
    let keys: Vec<&str> = ["deploy-42:announce", "slack:gone"]
        .into_iter()
        .chain(cases.iter().map(|c| c.0))
        .collect();
    assert_nowhere(&db, &out, &metrics, &keys, "SLACKSECRETMARK", true).await;

    // The console: the endpoints' origins, never their paths, on every page that could
    // show one.
    let id: i64 = c
        .query_one(
            "SELECT id FROM outbox.messages WHERE message_key = 'slack:revoked'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let console = Console::start(&db);
    let session = sign_in(&console, "ops").await;
    for path in [
        "/endpoints".to_owned(),
        "/messages?channel=http".to_owned(),
        "/messages?channel=http&endpoint=slack-deploys".to_owned(),
        format!("/message/{id}"),
        "/dead".to_owned(),
        "/destinations".to_owned(),
        "/".to_owned(),
    ] {
        let res = get(&console.url(&path), &session.cookie).await;
        assert_eq!(res.status().as_u16(), 200, "{path}");
        let page = res.text().await.unwrap();
        assert!(!page.contains("SLACKSECRETMARK"), "{path}:\n{page}");
        assert!(!page.contains("/services/"), "{path}:\n{page}");
        if path == "/endpoints" {
            assert!(page.contains(&format!("{origin}/…")), "{page}");
        }
    }
    assert!(!console.log().contains("SLACKSECRETMARK"));
}
