//! Endpoints (`outbox.set_endpoint`, `outbox.remove_endpoint`, `outboxd endpoint`), the
//! http payload's rules at enqueue, the provider's key window (`key_expires_at`) and
//! `replay --force`; through real PostgreSQL, the real binary and the least-privilege roles.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::binary::{Output, outboxd, run};
use common::*;
use serde_json::{Value, json};
use tokio_postgres::Client;

/// Runs the binary off the test's runtime, as `alice`, with extra environment.
async fn cli_env(db: &TestDb, args: &[&str], env: &[(&str, &str)]) -> Output {
    let url = db.url();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let mut cmd = outboxd(Some(&url));
        cmd.env("USER", "alice").args(&args);
        for (k, v) in &env {
            cmd.env(k, v);
        }
        run(&mut cmd)
    })
    .await
    .unwrap()
}

async fn cli(db: &TestDb, args: &[&str]) -> Output {
    cli_env(db, args, &[]).await
}

/// Asserts exit `code` with one stderr line containing every `mention`, and no panic.
fn assert_fails(what: &str, out: &Output, code: i32, mentions: &[&str]) {
    assert_eq!(
        out.code,
        Some(code),
        "{what}: exit code (stdout {:?}, stderr {:?})",
        out.stdout,
        out.stderr
    );
    let lines = out.stderr_lines();
    assert_eq!(lines.len(), 1, "{what}: one line, got {:?}", out.stderr);
    assert!(!out.stderr.contains("panicked"), "{what}: {:?}", out.stderr);
    for m in mentions {
        assert!(
            lines[0].contains(m),
            "{what}: {:?} should mention {m:?}",
            lines[0]
        );
    }
}

fn assert_ok(what: &str, out: &Output) {
    assert_eq!(
        out.code,
        Some(0),
        "{what}: stdout {:?}, stderr {:?}",
        out.stdout,
        out.stderr
    );
}

/// The SQLSTATE and the field (`COLUMN`) of a refusal.
fn refusal(e: &tokio_postgres::Error) -> (String, Option<String>, String) {
    let db = e
        .as_db_error()
        .unwrap_or_else(|| panic!("not a database error: {e}"));
    (
        db.code().code().to_owned(),
        db.column().map(str::to_owned),
        db.message().to_owned(),
    )
}

async fn set_endpoint(c: &Client, args: &str) -> Result<(String, i32), tokio_postgres::Error> {
    let row = c
        .query_one(
            &format!("SELECT destination, moved FROM outbox.set_endpoint({args})"),
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

async fn enqueue_http(c: &Client, key: &str, payload: Value) -> Result<i64, tokio_postgres::Error> {
    Ok(c.query_one(
        "SELECT outbox.enqueue($1::text, 'http', $2::jsonb)",
        &[&key, &payload],
    )
    .await?
    .get(0))
}

/// Every table's rows as text: what a refused command could have stored, and where a
/// secret's value would show if any statement had stored it.
async fn everything(c: &Client) -> String {
    c.query_one(
        "SELECT concat_ws(E'\\n', \
           (SELECT string_agg(e::text, E'\\n') FROM outbox.endpoints e), \
           (SELECT string_agg(m::text, E'\\n') FROM outbox.messages m), \
           (SELECT string_agg(a::text, E'\\n') FROM outbox.attempts a))",
        &[],
    )
    .await
    .unwrap()
    .get::<_, Option<String>>(0)
    .unwrap_or_default()
}

#[tokio::test]
async fn set_endpoint_refuses_each_bad_value_naming_its_field() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let long_name = format!("'a{}'", "b".repeat(63));
    let long_secret = format!("'{}'", "S".repeat(65));
    let long_url = format!("'https://api.example.com/{}'", "a".repeat(2100));
    let cases: Vec<(String, &str)> = vec![
        ("'Stripe', 'https://api.stripe.com'".into(), "name"),
        ("'1st', 'https://api.stripe.com'".into(), "name"),
        ("'', 'https://api.stripe.com'".into(), "name"),
        ("'a b', 'https://api.stripe.com'".into(), "name"),
        ("NULL, 'https://api.stripe.com'".into(), "name"),
        (format!("{long_name}, 'https://api.stripe.com'"), "name"),
        ("'e', NULL".into(), "url"),
        ("'e', 'api.stripe.com'".into(), "url"),
        ("'e', 'ftp://api.stripe.com'".into(), "url"),
        ("'e', 'https://user:pass@api.stripe.com'".into(), "url"),
        ("'e', 'https://token@api.stripe.com'".into(), "url"),
        ("'e', 'https://api.stripe.com?key=1'".into(), "url"),
        ("'e', 'https://api.stripe.com/v1#x'".into(), "url"),
        ("'e', 'https://api.stripe.com/a/../b'".into(), "url"),
        ("'e', 'https://api.stripe.com/%2e%2e/b'".into(), "url"),
        ("'e', 'https://'".into(), "url"),
        ("'e', 'https:///v1'".into(), "url"),
        ("'e', 'https://api stripe.com'".into(), "url"),
        ("'e', E'https://api.stripe.com\\\\@evil.com'".into(), "url"),
        ("'e', E'https://api.stripe.com\\n/v1'".into(), "url"),
        ("'e', 'https://[::1'".into(), "url"),
        (format!("'e', {long_url}"), "url"),
        (
            "'e', 'https://api.stripe.com', auth_header => 'Content-Type'".into(),
            "auth_header",
        ),
        (
            "'e', 'https://api.stripe.com', auth_header => 'host'".into(),
            "auth_header",
        ),
        (
            "'e', 'https://api.stripe.com', auth_header => 'Bad Header'".into(),
            "auth_header",
        ),
        (
            "'e', 'https://api.stripe.com', auth_header => NULL".into(),
            "auth_header",
        ),
        (
            "'e', 'https://api.stripe.com', idempotency_header => 'authorization'".into(),
            "idempotency_header",
        ),
        (
            "'e', 'https://api.stripe.com', idempotency_header => 'Transfer-Encoding'".into(),
            "idempotency_header",
        ),
        (
            "'e', 'https://api.stripe.com', idempotency_header => 'a:b'".into(),
            "idempotency_header",
        ),
        (
            "'e', 'https://api.stripe.com', auth_secret => 'stripe-key'".into(),
            "auth_secret",
        ),
        (
            "'e', 'https://api.stripe.com', auth_secret => ''".into(),
            "auth_secret",
        ),
        (
            format!("'e', 'https://api.stripe.com', auth_secret => {long_secret}"),
            "auth_secret",
        ),
        (
            "'e', 'https://api.stripe.com', key_ttl => '0'".into(),
            "key_ttl",
        ),
        (
            "'e', 'https://api.stripe.com', key_ttl => '-1 hour'".into(),
            "key_ttl",
        ),
        (
            "'e', 'https://api.stripe.com', headers => '[]'".into(),
            "headers",
        ),
        (
            "'e', 'https://api.stripe.com', headers => '\"x\"'".into(),
            "headers",
        ),
        (
            "'e', 'https://api.stripe.com', headers => '{\"X-N\": 1}'".into(),
            "headers",
        ),
        (
            "'e', 'https://api.stripe.com', headers => '{\"X-N\": \"a\\nb\"}'".into(),
            "headers",
        ),
        (
            "'e', 'https://api.stripe.com', headers => '{\"bad name\": \"x\"}'".into(),
            "headers",
        ),
        (
            "'e', 'https://api.stripe.com', headers => '{\"AUTHORIZATION\": \"Bearer x\"}'".into(),
            "headers",
        ),
        (
            "'e', 'https://api.stripe.com', headers => '{\"idempotency-key\": \"k\"}'".into(),
            "headers",
        ),
        (
            "'e', 'https://api.stripe.com', auth_header => 'X-Api-Key', headers => '{\"x-api-key\": \"k\"}'"
                .into(),
            "headers",
        ),
    ];
    let mut headers_cases = Vec::new();
    for h in [
        "Content-Type",
        "content-length",
        "Host",
        "Transfer-Encoding",
        "TE",
        "Trailer",
        "Upgrade",
        "Connection",
    ] {
        headers_cases.push((
            format!("'e', 'https://api.stripe.com', headers => '{{\"{h}\": \"x\"}}'"),
            "headers",
        ));
    }
    for (args, field) in cases
        .iter()
        .map(|(a, f)| (a.as_str(), *f))
        .chain(headers_cases.iter().map(|(a, f)| (a.as_str(), *f)))
    {
        let err = set_endpoint(&c, args).await.expect_err(args);
        let (code, column, message) = refusal(&err);
        assert_eq!(code, "22023", "{args}: {message}");
        assert_eq!(column.as_deref(), Some(field), "{args}: {message}");
        assert!(!message.contains('\n'), "{args}: one line: {message:?}");
    }
    assert_eq!(
        db.scalar::<i64>("SELECT count(*) FROM outbox.endpoints")
            .await,
        0
    );
}

/// The table has a secret's NAME only: a value given where a name goes is refused without
/// being repeated, by SQL and by the CLI, and nothing stores it.
#[tokio::test]
async fn no_secret_value_can_be_stored_or_echoed() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let columns: Vec<String> = c
        .query(
            "SELECT column_name::text FROM information_schema.columns \
             WHERE table_schema = 'outbox' AND table_name = 'endpoints' ORDER BY ordinal_position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        columns,
        [
            "name",
            "url",
            "auth_header",
            "auth_secret",
            "idempotency_header",
            "key_ttl",
            "headers",
            "created_at",
            "updated_at"
        ]
    );
    let value = "sk_live_51Hv3ryS3cr3t";
    for pasted in [
        format!("Bearer {value}"),
        format!("Basic {value}="),
        format!("{value}-x"),
    ] {
        let err = c
            .query(
                "SELECT * FROM outbox.set_endpoint('stripe', 'https://api.stripe.com', auth_secret => $1)",
                &[&pasted],
            )
            .await
            .unwrap_err();
        let (code, column, message) = refusal(&err);
        assert_eq!(
            (code.as_str(), column.as_deref()),
            ("22023", Some("auth_secret"))
        );
        assert!(!message.contains(value), "{message}");
        let db_err = err.as_db_error().unwrap();
        for part in [db_err.detail(), db_err.hint(), db_err.where_()] {
            assert!(!part.unwrap_or_default().contains(value), "{part:?}");
        }

        let out = cli(
            &db,
            &[
                "endpoint",
                "set",
                "stripe",
                "--url",
                "https://api.stripe.com",
                "--auth-secret",
                &pasted,
            ],
        )
        .await;
        assert_fails(
            "a value for --auth-secret",
            &out,
            2,
            &["auth_secret", "NAME"],
        );
        assert!(!out.stderr.contains(value) && !out.stdout.contains(value));
    }
    // A token in the URL's user info is refused, not stored either.
    let out = cli(
        &db,
        &[
            "endpoint",
            "set",
            "stripe",
            "--url",
            &format!("https://{value}@api.stripe.com"),
        ],
    )
    .await;
    assert_fails("user info", &out, 2, &["url", "user info"]);
    assert!(!everything(&c).await.contains(value));
    assert_eq!(
        db.scalar::<i64>("SELECT count(*) FROM outbox.endpoints")
            .await,
        0
    );

    // A name is stored as given, and `list` shows the name only.
    let out = cli(
        &db,
        &[
            "endpoint",
            "set",
            "stripe",
            "--url",
            "https://api.stripe.com",
            "--auth-secret",
            "STRIPE_LIVE",
        ],
    )
    .await;
    assert_ok("set", &out);
    let out = cli_env(
        &db,
        &["endpoint", "list", "--json"],
        &[("OUTBOXD_SECRET_STRIPE_LIVE", value)],
    )
    .await;
    assert_ok("list", &out);
    assert!(!out.stdout.contains(value));
    let listed: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(listed[0]["auth_secret"], "STRIPE_LIVE");
}

#[tokio::test]
async fn set_endpoint_creates_then_replaces_with_the_tables_defaults() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (dest, moved) = set_endpoint(&c, "'stripe', 'https://API.Stripe.com/'")
        .await
        .unwrap();
    assert_eq!((dest.as_str(), moved), ("api.stripe.com", 0));
    let row = c
        .query_one(
            "SELECT url, auth_header, auth_secret, idempotency_header, key_ttl IS NULL, headers \
             FROM outbox.endpoints WHERE name = 'stripe'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, String>(0),
        "https://API.Stripe.com",
        "a trailing / is trimmed"
    );
    assert_eq!(row.get::<_, String>(1), "Authorization");
    assert_eq!(row.get::<_, Option<String>>(2), None);
    assert_eq!(
        row.get::<_, Option<String>>(3).as_deref(),
        Some("Idempotency-Key")
    );
    assert!(row.get::<_, bool>(4));
    assert_eq!(row.get::<_, Value>(5), json!({}));

    let (dest, _) = set_endpoint(
        &c,
        "'stripe', 'https://api.stripe.com:443/v1', auth_header => 'X-Api-Key', \
         auth_secret => 'STRIPE', idempotency_header => NULL, key_ttl => '24 hours', \
         headers => '{\"Stripe-Version\": \"2024-06-20\"}'",
    )
    .await
    .unwrap();
    assert_eq!(dest, "api.stripe.com");
    let eps = outboxd::ops::endpoints(&c).await.unwrap();
    assert_eq!(eps.len(), 1);
    let e = &eps[0];
    assert_eq!(e.url, "https://api.stripe.com:443/v1");
    assert_eq!(e.auth_header, "X-Api-Key");
    assert_eq!(e.auth_secret.as_deref(), Some("STRIPE"));
    assert_eq!(e.idempotency_header, None);
    assert_eq!(e.key_ttl.as_deref(), Some("1d"));
    assert_eq!(e.headers, json!({"Stripe-Version": "2024-06-20"}));
    assert!(e.updated_at >= e.created_at);
    // An IP literal and a port name the destination as the worker does.
    let (dest, _) = set_endpoint(&c, "'local', 'http://127.0.0.1:8080/api'")
        .await
        .unwrap();
    assert_eq!(dest, "127.0.0.1:8080");
    let (dest, _) = set_endpoint(&c, "'six', 'https://[::1]:8443'")
        .await
        .unwrap();
    assert_eq!(dest, "[::1]:8443");
}

#[tokio::test]
async fn a_new_host_moves_the_unfinished_messages_and_only_them() {
    let db = TestDb::new().await;
    let c = db.client().await;
    set_endpoint(&c, "'pay', 'https://api.one.example'")
        .await
        .unwrap();
    set_endpoint(&c, "'other', 'https://api.other.example'")
        .await
        .unwrap();
    let plain = json!({"endpoint": "pay", "path": "/v1/charges"});
    let looked = json!({"endpoint": "pay", "path": "/v1/charges",
                        "reconcile": {"path": "/v1/charges/search"}});
    for (key, payload) in [
        ("pending", &plain),
        ("held", &plain),
        ("running", &looked),
        ("dead", &looked),
        ("delivered", &plain),
        ("cancelled", &plain),
    ] {
        enqueue_http(&c, key, payload.clone()).await.unwrap();
    }
    enqueue_http(&c, "other", json!({"endpoint": "other"}))
        .await
        .unwrap();
    enqueue_webhook(&db, "hook", "https://api.one.example/h", 3, true).await;
    c.batch_execute(
        "UPDATE outbox.messages SET state = 'held' WHERE message_key = 'held';
         UPDATE outbox.messages SET state = 'running', attempts = 1, lease_owner = 'w',
             lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute'
             WHERE message_key = 'running';
         UPDATE outbox.messages SET state = 'dead', attempts = 3, dead_at = now(),
             error_class = 'exhausted' WHERE message_key = 'dead';
         UPDATE outbox.messages SET state = 'delivered', attempts = 1, delivered_at = now()
             WHERE message_key = 'delivered';
         UPDATE outbox.messages SET state = 'cancelled', cancelled_at = now()
             WHERE message_key = 'cancelled';",
    )
    .await
    .unwrap();

    // Another base path on the same host moves nothing.
    let (_, moved) = set_endpoint(&c, "'pay', 'https://api.one.example/v2'")
        .await
        .unwrap();
    assert_eq!(moved, 0);
    let (dest, moved) = set_endpoint(&c, "'pay', 'https://api.two.example:8443'")
        .await
        .unwrap();
    assert_eq!((dest.as_str(), moved), ("api.two.example:8443", 4));
    let rows = c
        .query(
            "SELECT message_key, destination, lookup_destination FROM outbox.messages ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<(String, Option<String>, Option<String>)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let two = Some("api.two.example:8443".to_string());
    let one = Some("api.one.example".to_string());
    let want = vec![
        ("pending".to_string(), two.clone(), None),
        ("held".into(), two.clone(), None),
        ("running".into(), two.clone(), two.clone()),
        ("dead".into(), two.clone(), two.clone()),
        ("delivered".into(), one.clone(), None),
        ("cancelled".into(), one.clone(), None),
        ("other".into(), Some("api.other.example".into()), None),
        ("hook".into(), one.clone(), None),
    ];
    assert_eq!(got, want);

    // By hand, an http message's destination may only become its endpoint's current one.
    for (sql, column) in [
        (
            "UPDATE outbox.messages SET destination = 'evil.example' WHERE message_key = 'pending'",
            "destination",
        ),
        (
            "UPDATE outbox.messages SET destination = 'api.other.example' WHERE message_key = 'pending'",
            "destination",
        ),
        (
            "UPDATE outbox.messages SET destination = NULL WHERE message_key = 'pending'",
            "destination",
        ),
        (
            "UPDATE outbox.messages SET lookup_destination = 'evil.example' WHERE message_key = 'dead'",
            "lookup_destination",
        ),
        (
            "UPDATE outbox.messages SET lookup_destination = 'api.two.example:8443' WHERE message_key = 'pending'",
            "lookup_destination",
        ),
        (
            "UPDATE outbox.messages SET destination = 'api.two.example:8443' WHERE message_key = 'hook'",
            "destination",
        ),
    ] {
        let err = c.batch_execute(sql).await.expect_err(sql);
        let (code, col, _) = refusal(&err);
        assert_eq!(
            (code.as_str(), col.as_deref()),
            ("23514", Some(column)),
            "{sql}"
        );
    }
    c.batch_execute(
        "UPDATE outbox.messages SET destination = 'api.two.example:8443' WHERE message_key = 'delivered'",
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn remove_is_refused_while_messages_wait_and_a_dead_ones_replay_after_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    set_endpoint(&c, "'pay', 'https://api.pay.example'")
        .await
        .unwrap();
    enqueue_http(&c, "p1", json!({"endpoint": "pay"}))
        .await
        .unwrap();
    enqueue_http(&c, "p2", json!({"endpoint": "pay"}))
        .await
        .unwrap();
    enqueue_http(&c, "h1", json!({"endpoint": "pay"}))
        .await
        .unwrap();
    enqueue_http(&c, "d1", json!({"endpoint": "pay"}))
        .await
        .unwrap();
    c.batch_execute(
        "UPDATE outbox.messages SET state = 'held' WHERE message_key = 'h1';
         UPDATE outbox.messages SET state = 'dead', attempts = 3, dead_at = now(),
             error_class = 'exhausted' WHERE message_key = 'd1';",
    )
    .await
    .unwrap();

    let err = c
        .batch_execute("SELECT outbox.remove_endpoint('pay')")
        .await
        .unwrap_err();
    let (code, _, message) = refusal(&err);
    assert_eq!(code, "55000");
    assert!(
        message.contains("3 unfinished message(s) (2 pending, 0 running, 1 held)"),
        "{message}"
    );
    let out = cli(&db, &["endpoint", "remove", "pay"]).await;
    assert_fails("remove in use", &out, 1, &["'pay'", "3 unfinished"]);
    let out = cli(&db, &["endpoint", "remove", "ghost"]).await;
    assert_fails("remove unknown", &out, 1, &["no endpoint 'ghost'"]);

    // Once only finished and dead messages name it, it goes.
    c.batch_execute("SELECT * FROM outbox.cancel(ARRAY(SELECT id FROM outbox.messages WHERE message_key IN ('p1', 'p2', 'h1')))")
        .await
        .unwrap();
    let out = cli(&db, &["endpoint", "remove", "pay"]).await;
    assert_ok("remove", &out);
    assert!(
        out.stdout.contains("endpoint pay removed"),
        "{}",
        out.stdout
    );

    // A new message cannot name it, and the dead one cannot be replayed, by name.
    let err = enqueue_http(&c, "p3", json!({"endpoint": "pay"}))
        .await
        .unwrap_err();
    assert_eq!(refusal(&err).1.as_deref(), Some("payload.endpoint"));
    let before = everything(&c).await;
    let out = cli(&db, &["replay", "d1"]).await;
    assert_fails(
        "replay, endpoint gone",
        &out,
        1,
        &["endpoint gone", "endpoint 'pay'", "'d1'"],
    );
    let out = cli(&db, &["replay", "d1", "--force"]).await;
    assert_fails(
        "replay --force, endpoint gone",
        &out,
        1,
        &["endpoint 'pay'"],
    );
    assert_eq!(everything(&c).await, before);

    // Set again (on another host), the dead message follows it and may be replayed.
    let (_, moved) = set_endpoint(&c, "'pay', 'https://api.pay2.example'")
        .await
        .unwrap();
    assert_eq!(moved, 1);
    let out = cli(&db, &["replay", "d1"]).await;
    assert_ok("replay after set", &out);
    assert_eq!(row(&db, "d1").await.state, "pending");
}

/// The http payload's rules at enqueue: each refusal names its field, by `outbox.enqueue`
/// and a plain INSERT alike (the trigger's fast path is true only when every rule holds),
/// and nothing is stored.
#[tokio::test]
async fn http_payloads_are_checked_at_enqueue() {
    let db = TestDb::new().await;
    let c = db.client().await;
    set_endpoint(&c, "'pay', 'https://api.pay.example/v1'")
        .await
        .unwrap();
    set_endpoint(
        &c,
        "'keyed', 'https://api.keyed.example', auth_header => 'X-Api-Key', idempotency_header => 'PayPal-Request-Id'",
    )
    .await
    .unwrap();
    let huge = format!("/{}", "a".repeat(3000));
    let bad: Vec<(Value, &str)> = vec![
        (json!({"path": "/x"}), "payload.endpoint"),
        (json!({"endpoint": 5}), "payload.endpoint"),
        (json!({"endpoint": "ghost"}), "payload.endpoint"),
        (
            json!({"endpoint": "pay", "url": "https://evil.example/"}),
            "payload",
        ),
        (json!({"endpoint": "pay", "body": {"a": 1}}), "payload"),
        (
            json!({"endpoint": "pay", "method": "GET"}),
            "payload.method",
        ),
        (
            json!({"endpoint": "pay", "method": "post"}),
            "payload.method",
        ),
        (json!({"endpoint": "pay", "method": 1}), "payload.method"),
        (json!({"endpoint": "pay", "method": null}), "payload.method"),
        // Paths that would leave the host or the base path, however written.
        (
            json!({"endpoint": "pay", "path": "//evil.example/x"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/\\evil.example"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "\\\\evil.example"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "https://evil.example/x"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "evil.example/x"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "@evil.example"}),
            "payload.path",
        ),
        (json!({"endpoint": "pay", "path": ""}), "payload.path"),
        (
            json!({"endpoint": "pay", "path": "/a/../b"}),
            "payload.path",
        ),
        (json!({"endpoint": "pay", "path": "/.."}), "payload.path"),
        (json!({"endpoint": "pay", "path": "/./x"}), "payload.path"),
        (
            json!({"endpoint": "pay", "path": "/%2e%2e/admin"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/%2E./admin"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/a/.%2E"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/a/..%2fadmin"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/a/..%5Cadmin"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/x?admin=1"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/x#frag"}),
            "payload.path",
        ),
        (json!({"endpoint": "pay", "path": "/x%zz"}), "payload.path"),
        (json!({"endpoint": "pay", "path": "/x%4"}), "payload.path"),
        (json!({"endpoint": "pay", "path": "/a b"}), "payload.path"),
        (json!({"endpoint": "pay", "path": "/a\tb"}), "payload.path"),
        (
            json!({"endpoint": "pay", "path": "/a\r\nHost: evil.example"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/a\u{7f}"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/a\u{85}"}),
            "payload.path",
        ),
        (
            json!({"endpoint": "pay", "path": "/\u{202e}lave"}),
            "payload.path",
        ),
        (json!({"endpoint": "pay", "path": huge}), "payload.path"),
        (json!({"endpoint": "pay", "path": 5}), "payload.path"),
        (json!({"endpoint": "pay", "path": ["/a"]}), "payload.path"),
        (json!({"endpoint": "pay", "path": null}), "payload.path"),
        (json!({"endpoint": "pay", "query": "a=1"}), "payload.query"),
        (json!({"endpoint": "pay", "query": [1]}), "payload.query"),
        (
            json!({"endpoint": "pay", "form": {"a": 1}, "json": {"a": 1}}),
            "payload.form",
        ),
        (json!({"endpoint": "pay", "form": "a=1"}), "payload.form"),
        (json!({"endpoint": "pay", "form": [1]}), "payload.form"),
        (json!({"endpoint": "pay", "headers": []}), "payload.headers"),
        (
            json!({"endpoint": "pay", "headers": {"X-N": 1}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "headers": {"X-N": "a\nb"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "headers": {"X-N": "a".repeat(9000)}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "headers": {"X N": "a"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "headers": {"": "a"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "headers": {"authorization": "Bearer x"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "headers": {"IDEMPOTENCY-KEY": "k"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "headers": {"Idempotency_Key": "k"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "headers": {"Content_Type": "text/plain"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "keyed", "headers": {"x-api-key": "k"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "keyed", "headers": {"PayPal-Request-Id": "k"}}),
            "payload.headers",
        ),
        (
            json!({"endpoint": "pay", "store_response": "yes"}),
            "payload.store_response",
        ),
        (
            json!({"endpoint": "pay", "reconcile": "GET /x"}),
            "payload.reconcile",
        ),
        (
            json!({"endpoint": "pay", "reconcile": {"url": "https://evil.example/"}}),
            "payload.reconcile",
        ),
        (
            json!({"endpoint": "pay", "reconcile": {"method": "POST"}}),
            "payload.reconcile.method",
        ),
        (
            json!({"endpoint": "pay", "reconcile": {"path": "//evil.example"}}),
            "payload.reconcile.path",
        ),
        (
            json!({"endpoint": "pay", "reconcile": {"path": "/%2e%2e"}}),
            "payload.reconcile.path",
        ),
        (
            json!({"endpoint": "pay", "reconcile": {"query": ["q", 1]}}),
            "payload.reconcile.query",
        ),
        (
            json!({"endpoint": "pay", "reconcile": {"found": "data/0"}}),
            "payload.reconcile.found",
        ),
        (
            json!({"endpoint": "pay", "reconcile": {"found": "/a~2"}}),
            "payload.reconcile.found",
        ),
        (
            json!({"endpoint": "pay", "reconcile": {"found": 0}}),
            "payload.reconcile.found",
        ),
    ];
    let mut framing = Vec::new();
    for h in [
        "Content-Type",
        "content-length",
        "HOST",
        "Transfer-Encoding",
        "te",
        "Trailer",
        "Upgrade",
    ] {
        framing.push((
            json!({"endpoint": "pay", "headers": {h: "x"}}),
            "payload.headers",
        ));
    }
    for (payload, field) in bad.iter().chain(&framing) {
        let err = enqueue_http(&c, "bad", payload.clone())
            .await
            .expect_err(&payload.to_string());
        let (code, column, message) = refusal(&err);
        assert_eq!(code, "22023", "{payload}: {message}");
        assert_eq!(column.as_deref(), Some(*field), "{payload}: {message}");
        let err = c
            .execute(
                "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('bad', 'http', $1)",
                &[payload],
            )
            .await
            .expect_err(&payload.to_string());
        assert_eq!(
            refusal(&err).1.as_deref(),
            Some(*field),
            "{payload} by INSERT"
        );
    }
    assert_eq!(
        db.scalar::<i64>("SELECT count(*) FROM outbox.messages")
            .await,
        0
    );

    // What the rules allow; each message goes to its endpoint's host, whatever its path.
    let good = [
        json!({"endpoint": "pay"}),
        json!({"endpoint": "pay", "method": "DELETE", "path": "/v1/customers/{key}"}),
        json!({"endpoint": "pay", "path": "/@evil.example"}),
        json!({"endpoint": "pay", "path": "/a/.well-known/x..y/%2Fz"}),
        json!({"endpoint": "pay", "path": "/caf\u{e9}", "query": {"a": "x", "n": 1, "b": true}}),
        json!({"endpoint": "pay", "method": "PUT", "form": {"metadata": {"order": 42}, "items": [{"price": "p_1"}]}}),
        json!({"endpoint": "pay", "method": "PATCH", "json": [1, 2]}),
        json!({"endpoint": "pay", "json": null, "store_response": false}),
        json!({"endpoint": "pay", "headers": {"Stripe-Account": "acct_1", "X-Idem": "k"}}),
        json!({"endpoint": "keyed", "headers": {"Authorization": "Bearer per-message", "Idempotency-Key": "x"}}),
        json!({"endpoint": "pay", "path": "/v1/charges", "reconcile": {"method": "GET",
               "path": "/v1/charges/search", "query": {"query": "metadata['k']:'{key}'"},
               "found": "/data/0"}}),
        json!({"endpoint": "pay", "reconcile": {"found": ""}}),
        json!({"endpoint": "pay", "reconcile": {"found": "/a~0b/~1c"}}),
    ];
    for (i, payload) in good.iter().enumerate() {
        let key = format!("good-{i}");
        enqueue_http(&c, &key, payload.clone())
            .await
            .unwrap_or_else(|e| panic!("{payload}: {e}"));
        let dest: Option<String> = c
            .query_one(
                "SELECT destination FROM outbox.messages WHERE message_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        let want = if payload["endpoint"] == "pay" {
            "api.pay.example"
        } else {
            "api.keyed.example"
        };
        assert_eq!(dest.as_deref(), Some(want), "{payload}");
    }
    // outbox.validate, the slow path's first step, agrees on the shape.
    let err = c
        .batch_execute(
            "SELECT outbox.validate('k', 'http', '{\"endpoint\": \"pay\", \"path\": \"//x\"}', 3)",
        )
        .await
        .unwrap_err();
    assert_eq!(refusal(&err).1.as_deref(), Some("payload.path"));
}

#[tokio::test]
async fn enqueue_through_the_cli_takes_the_http_channel() {
    let db = TestDb::new().await;
    let out = cli(
        &db,
        &[
            "endpoint",
            "set",
            "pay",
            "--url",
            "https://api.pay.example",
            "--key-ttl",
            "24h",
        ],
    )
    .await;
    assert_ok("set", &out);
    let payload = r#"{"endpoint": "pay", "path": "/v1/refunds", "form": {"charge": "ch_1"}}"#;
    let out = cli(
        &db,
        &[
            "enqueue",
            "--key",
            "r:1",
            "--channel",
            "http",
            "--payload",
            payload,
        ],
    )
    .await;
    assert_ok("enqueue http", &out);
    assert!(out.stdout.trim().ends_with("created"), "{}", out.stdout);
    let out = cli(
        &db,
        &[
            "enqueue",
            "--key",
            "r:2",
            "--channel",
            "http",
            "--payload",
            r#"{"endpoint": "pay", "path": "//evil"}"#,
        ],
    )
    .await;
    assert_fails("bad path", &out, 2, &["payload.path"]);
    let out = cli(
        &db,
        &[
            "enqueue",
            "--key",
            "r:3",
            "--channel",
            "carrier-pigeon",
            "--payload",
            "{}",
        ],
    )
    .await;
    assert_fails("unknown channel", &out, 2, &["webhook, http or email"]);
    let out = cli(&db, &["dead", "--channel", "http"]).await;
    assert_ok("dead --channel http", &out);
}

#[tokio::test]
async fn the_endpoint_commands() {
    let db = TestDb::new().await;
    let out = cli(&db, &["endpoint", "list"]).await;
    assert_ok("empty list", &out);
    assert!(out.stdout.contains("no endpoints"), "{}", out.stdout);
    let out = cli(&db, &["endpoint", "list", "--json"]).await;
    assert_ok("empty json", &out);
    assert_eq!(
        serde_json::from_str::<Value>(&out.stdout).unwrap(),
        json!([])
    );

    let out = cli(
        &db,
        &[
            "endpoint",
            "set",
            "stripe",
            "--url",
            "https://api.stripe.com",
            "--auth-secret",
            "STRIPE",
            "--key-ttl",
            "24h",
            "--header",
            "Stripe-Version: 2024-06-20",
            "--header",
            "X-Team:payments",
        ],
    )
    .await;
    assert_ok("set stripe", &out);
    assert!(
        out.stdout.contains("endpoint stripe set: api.stripe.com"),
        "{}",
        out.stdout
    );
    let out = cli(
        &db,
        &[
            "endpoint",
            "set",
            "twilio",
            "--url",
            "https://api.twilio.com/2010-04-01",
            "--auth-secret",
            "TWILIO",
            "--no-idempotency-header",
        ],
    )
    .await;
    assert_ok("set twilio", &out);
    let out = cli(
        &db,
        &[
            "endpoint",
            "set",
            "paypal",
            "--url",
            "https://api-m.paypal.com",
            "--idempotency-header",
            "PayPal-Request-Id",
            "--auth-header",
            "X-Auth",
        ],
    )
    .await;
    assert_ok("set paypal", &out);

    let out = cli(&db, &["endpoint", "list", "--json"]).await;
    assert_ok("list --json", &out);
    let listed: Value = serde_json::from_str(&out.stdout).unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["paypal", "stripe", "twilio"]);
    let stripe = &listed[1];
    for column in [
        "name",
        "url",
        "auth_header",
        "auth_secret",
        "idempotency_header",
        "key_ttl",
        "headers",
        "created_at",
        "updated_at",
    ] {
        assert!(stripe.get(column).is_some(), "{column} in {stripe}");
    }
    assert_eq!(stripe["url"], "https://api.stripe.com");
    assert_eq!(stripe["auth_header"], "Authorization");
    assert_eq!(stripe["auth_secret"], "STRIPE");
    assert_eq!(stripe["idempotency_header"], "Idempotency-Key");
    assert_eq!(stripe["key_ttl"], "1d");
    assert_eq!(
        stripe["headers"],
        json!({"Stripe-Version": "2024-06-20", "X-Team": "payments"})
    );
    assert_eq!(listed[2]["idempotency_header"], Value::Null);
    assert_eq!(listed[2]["key_ttl"], Value::Null);
    assert_eq!(listed[0]["idempotency_header"], "PayPal-Request-Id");
    assert_eq!(listed[0]["auth_header"], "X-Auth");
    let out = cli(&db, &["endpoint", "list"]).await;
    assert_ok("list", &out);
    assert!(
        out.stdout.lines().next().unwrap().starts_with("name"),
        "{}",
        out.stdout
    );
    assert_eq!(out.stdout.lines().count(), 4, "{}", out.stdout);

    // Usage errors: exit 2, one line.
    for (args, mention) in [
        (&["endpoint", "set", "x"][..], "--url"),
        (
            &[
                "endpoint",
                "set",
                "x",
                "--url",
                "https://a.example",
                "--header",
                "NoColon",
            ],
            "Name: value",
        ),
        (
            &[
                "endpoint",
                "set",
                "x",
                "--url",
                "https://a.example",
                "--header",
                ": v",
            ],
            "name is missing",
        ),
        (
            &[
                "endpoint",
                "set",
                "x",
                "--url",
                "https://a.example",
                "--key-ttl",
                "soon",
            ],
            "--key-ttl",
        ),
        (
            &[
                "endpoint",
                "set",
                "x",
                "--url",
                "https://a.example",
                "--idempotency-header",
                "K",
                "--no-idempotency-header",
            ],
            "cannot be used with",
        ),
        (
            &[
                "endpoint",
                "set",
                "x",
                "--url",
                "https://a.example",
                "--key-ttl",
                "0s",
            ],
            "key_ttl",
        ),
        (&["endpoint", "set", "x", "--url", "ftp://a.example"], "url"),
        (
            &["endpoint", "set", "X", "--url", "https://a.example"],
            "name",
        ),
        (
            &[
                "endpoint",
                "set",
                "x",
                "--url",
                "https://a.example",
                "--header",
                "Content-Type: text/plain",
            ],
            "headers must not set Content-Type",
        ),
        (
            &[
                "endpoint",
                "set",
                "x",
                "--url",
                "https://a.example",
                "--header",
                "A: 1",
                "--header",
                "A: 2",
            ],
            "twice",
        ),
        (&["endpoint", "list", "extra"], "extra"),
        (&["endpoint", "remove"], "NAME"),
        (
            &["endpoint"],
            "(set, list, remove; see outboxd endpoint --help)",
        ),
    ] {
        let out = cli(&db, args).await;
        assert_eq!(out.code, Some(2), "{args:?}: {:?}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{args:?}");
        assert!(
            out.stderr.contains(mention),
            "{args:?}: {:?} should mention {mention:?}",
            out.stderr
        );
    }
    // Flags are read from the command line only.
    let out = cli_env(
        &db,
        &["endpoint", "set", "x"],
        &[("OUTBOXD_URL", "https://a.example")],
    )
    .await;
    assert_eq!(out.code, Some(2), "{:?}", out.stderr);
    let c = db.client().await;
    assert_eq!(
        db.scalar::<i64>("SELECT count(*) FROM outbox.endpoints WHERE name = 'x'")
            .await,
        0
    );

    let out = cli(&db, &["endpoint", "remove", "twilio"]).await;
    assert_ok("remove", &out);
    assert_eq!(outboxd::ops::endpoints(&c).await.unwrap().len(), 2);
}

/// Makes `key` a dead letter of `class` whose first attempt started `ago`.
async fn dead_since(c: &Client, key: &str, class: &str, ago: &str) {
    c.execute(
        &format!(
            "UPDATE outbox.messages SET state = 'dead', attempts = 3, dead_at = now(), \
             error_class = $2, last_error = 'timed out after the request was sent', \
             first_attempt_at = now() - interval '{ago}' WHERE message_key = $1"
        ),
        &[&key, &class],
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn the_key_window_in_lookup_and_show() {
    let db = TestDb::new().await;
    let c = db.client().await;
    set_endpoint(&c, "'pay', 'https://api.pay.example', key_ttl => '1 hour'")
        .await
        .unwrap();
    set_endpoint(&c, "'forgetful', 'https://api.other.example'")
        .await
        .unwrap();
    enqueue_http(&c, "w:1", json!({"endpoint": "pay"}))
        .await
        .unwrap();
    enqueue_http(&c, "w:2", json!({"endpoint": "forgetful"}))
        .await
        .unwrap();
    enqueue_webhook(&db, "w:3", "https://api.pay.example/h", 3, true).await;

    // Before a first attempt: no window.
    let s = outboxd::lookup(&c, "w:1").await.unwrap().unwrap();
    assert_eq!(s.key_expires_at, None);
    let last: Option<std::time::SystemTime> = c
        .query_one("SELECT key_expires_at FROM outbox.lookup('w:1')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(last, None);

    for k in ["w:1", "w:2", "w:3"] {
        dead_since(&c, k, "ambiguous", "90 minutes").await;
    }
    let expected: std::time::SystemTime = c
        .query_one(
            "SELECT first_attempt_at + interval '1 hour' FROM outbox.messages WHERE message_key = 'w:1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let s = outboxd::lookup(&c, "w:1").await.unwrap().unwrap();
    assert_eq!(s.key_expires_at, Some(expected));
    // Without a key_ttl, and for another channel: none.
    assert_eq!(
        outboxd::lookup(&c, "w:2")
            .await
            .unwrap()
            .unwrap()
            .key_expires_at,
        None
    );
    assert_eq!(
        outboxd::lookup(&c, "w:3")
            .await
            .unwrap()
            .unwrap()
            .key_expires_at,
        None
    );
    // It is outbox.lookup's last column.
    let cols: Vec<String> = c
        .query("SELECT * FROM outbox.lookup('w:1')", &[])
        .await
        .unwrap()[0]
        .columns()
        .iter()
        .map(|c| c.name().to_owned())
        .collect();
    assert_eq!(cols.last().map(String::as_str), Some("key_expires_at"));

    let out = cli(&db, &["show", "w:1", "--json"]).await;
    assert_ok("show --json", &out);
    let shown: Value = serde_json::from_str(&out.stdout).unwrap();
    let at = shown["key_expires_at"].as_str().unwrap();
    let parsed =
        time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).unwrap();
    assert_eq!(std::time::SystemTime::from(parsed), expected);
    let out = cli(&db, &["show", "w:2", "--json"]).await;
    let shown: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(shown["key_expires_at"], Value::Null);
    let out = cli(&db, &["show", "w:1"]).await;
    assert_ok("show", &out);
    assert!(
        out.stdout.contains(&format!(
            "key window   the provider remembers its key until {at}"
        )),
        "{}",
        out.stdout
    );
    // Its window closed: the replay it offers is forced, and says why.
    assert!(
        out.stdout.contains(&format!(
            "`outboxd replay {} --force` if it did not",
            row(&db, "w:1").await.id
        )),
        "{}",
        out.stdout
    );
    let out = cli(&db, &["show", "w:2"]).await;
    assert!(!out.stdout.contains("key window"), "{}", out.stdout);
    assert!(!out.stdout.contains("--force"), "{}", out.stdout);
}

#[tokio::test]
async fn replay_refuses_a_lapsed_ambiguous_dead_letter_unless_forced() {
    let db = TestDb::new().await;
    let c = db.client().await;
    set_endpoint(
        &c,
        "'pay', 'https://api.pay.example', key_ttl => '24 hours'",
    )
    .await
    .unwrap();
    set_endpoint(&c, "'unknown-ttl', 'https://api.other.example'")
        .await
        .unwrap();
    for k in ["lapsed", "open", "exhausted", "no-ttl", "lapsed-too"] {
        let ep = if k == "no-ttl" { "unknown-ttl" } else { "pay" };
        enqueue_http(&c, k, json!({"endpoint": ep, "path": "/v1/charges"}))
            .await
            .unwrap();
    }
    dead_since(&c, "lapsed", "ambiguous", "25 hours").await;
    dead_since(&c, "lapsed-too", "ambiguous", "3 days").await;
    dead_since(&c, "open", "ambiguous", "1 hour").await;
    dead_since(&c, "exhausted", "exhausted", "3 days").await;
    dead_since(&c, "no-ttl", "ambiguous", "3 days").await;

    // Refused by name, with its window, and nothing replayed (all or nothing).
    let before = everything(&c).await;
    let out = cli(&db, &["replay", "open", "lapsed"]).await;
    let id = row(&db, "lapsed").await.id.to_string();
    assert_fails(
        "lapsed",
        &out,
        1,
        &[
            &format!("{id} ('lapsed', endpoint 'pay': key window closed at "),
            "--force",
        ],
    );
    let out = cli(&db, &["replay", "--all-dead"]).await;
    assert_fails("--all-dead", &out, 1, &["'lapsed'", "'lapsed-too'"]);
    // OUTBOXD_FORCE is not read; nor does SQL force without being asked.
    let out = cli_env(&db, &["replay", "lapsed"], &[("OUTBOXD_FORCE", "true")]).await;
    assert_fails("OUTBOXD_FORCE", &out, 1, &["key window closed"]);
    let err = c
        .batch_execute("SELECT * FROM outbox.replay(ARRAY(SELECT id FROM outbox.messages WHERE message_key = 'lapsed'))")
        .await
        .unwrap_err();
    assert_eq!(refusal(&err).0, "55000");
    let out = cli(&db, &["replay", "lapsed", "--dry-run"]).await;
    assert_eq!(out.code, Some(1));
    assert_eq!(everything(&c).await, before);

    // An open window, another class, an endpoint without key_ttl: replayed as ever.
    let out = cli(&db, &["replay", "open", "exhausted", "no-ttl"]).await;
    assert_ok("replay allowed", &out);
    assert!(
        out.stdout.contains("replayed 3 message(s)"),
        "{}",
        out.stdout
    );

    // --force: a person's decision, recorded in the history row.
    let out = cli(&db, &["replay", "lapsed", "--force"]).await;
    assert_ok("replay --force", &out);
    let r = row(&db, "lapsed").await;
    assert_eq!((r.state.as_str(), r.attempts), ("pending", 0));
    let (outcome, worker, error): (String, Option<String>, Option<String>) = {
        let a = c
            .query_one(
                "SELECT outcome, worker, error FROM outbox.attempts \
                 WHERE message_id = (SELECT id FROM outbox.messages WHERE message_key = 'lapsed') \
                 ORDER BY id DESC LIMIT 1",
                &[],
            )
            .await
            .unwrap();
        (a.get(0), a.get(1), a.get(2))
    };
    assert_eq!(outcome, "replayed");
    assert_eq!(worker.as_deref(), Some("cli:alice"));
    let error = error.unwrap();
    assert!(
        error.starts_with("forced: replayed after the key window closed at "),
        "{error}"
    );
    // After the replay, the window waits for the next first attempt.
    assert_eq!(
        outboxd::lookup(&c, "lapsed")
            .await
            .unwrap()
            .unwrap()
            .key_expires_at,
        None
    );
    // A forced replay of rows whose windows are open says nothing of force.
    let open_error: Option<String> = c
        .query_one(
            "SELECT error FROM outbox.attempts WHERE outcome = 'replayed' AND message_id = \
             (SELECT id FROM outbox.messages WHERE message_key = 'open')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(open_error, None);
    // From SQL, by name.
    c.batch_execute(
        "SELECT * FROM outbox.replay(ARRAY(SELECT id FROM outbox.messages WHERE message_key = 'lapsed-too'), force => true)",
    )
    .await
    .unwrap();
    assert_eq!(row(&db, "lapsed-too").await.state, "pending");
}

/// The application role names endpoints without reading them, and sets none; the worker
/// role sets and removes them through the functions only.
#[tokio::test]
async fn the_app_role_enqueues_http_without_reading_endpoints() {
    let db = TestDb::new().await;
    let (_roles, app, worker) = crate::privileges::setup(&db).await;
    let w = connect(&worker).await;
    set_endpoint(
        &w,
        "'pay', 'https://api.pay.example', auth_secret => 'PAY', key_ttl => '1 day'",
    )
    .await
    .unwrap();
    assert_eq!(outboxd::ops::endpoints(&w).await.unwrap().len(), 1);
    for sql in [
        "INSERT INTO outbox.endpoints (name, url) VALUES ('x', 'https://x.example')",
        "UPDATE outbox.endpoints SET url = 'https://evil.example'",
        "DELETE FROM outbox.endpoints",
    ] {
        let err = w.batch_execute(sql).await.expect_err(sql);
        assert_eq!(refusal(&err).0, "42501", "{sql}");
    }

    let mut a = connect(&app).await;
    let tx = a.transaction().await.unwrap();
    let msg = outboxd::NewMessage::new(
        "app:1",
        outboxd::Channel::Http,
        json!({"endpoint": "pay", "path": "/v1/charges", "form": {"amount": 100}}),
    );
    let done = outboxd::enqueue(&tx, &msg).await.unwrap();
    assert!(done.created);
    let bad = outboxd::NewMessage::new(
        "app:2",
        outboxd::Channel::Http,
        json!({"endpoint": "pay", "headers": {"Authorization": "Bearer stolen"}}),
    );
    match outboxd::enqueue(&tx, &bad).await {
        Err(outboxd::EnqueueError::Invalid { .. }) => {}
        other => panic!("{other:?}"),
    }
    tx.rollback().await.unwrap();
    outboxd::enqueue(&a, &msg).await.unwrap();
    a.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload) VALUES ('app:3', 'http', '{\"endpoint\": \"pay\"}')",
        &[],
    )
    .await
    .unwrap();
    assert!(outboxd::lookup(&a, "app:1").await.unwrap().is_some());
    for sql in [
        "SELECT * FROM outbox.endpoints",
        "SELECT * FROM outbox.set_endpoint('evil', 'https://evil.example')",
        "SELECT outbox.remove_endpoint('pay')",
        "SELECT * FROM outbox.replay(ARRAY[1::bigint], 'x', true)",
    ] {
        let err = a.batch_execute(sql).await.expect_err(sql);
        assert_eq!(refusal(&err).0, "42501", "{sql}");
    }
    // The worker is refused while the messages wait, like anyone.
    let err = w
        .batch_execute("SELECT outbox.remove_endpoint('pay')")
        .await
        .unwrap_err();
    assert_eq!(refusal(&err).0, "55000");
}

/// A lease that expires after the provider's key window closed is settled as the next
/// attempt would have ended: without a lookup, `dead` ambiguous at once, its error naming
/// the window (no round through `pending` and a claim that could only refuse to send);
/// with a lookup, or inside the window, `pending` for the next attempt as before.
#[tokio::test]
async fn the_lease_sweep_applies_the_key_window() {
    use outboxd::claim;
    use outboxd::model::Channel;
    use std::time::Duration;

    let db = TestDb::new().await;
    let c = db.client().await;
    set_endpoint(&c, "'pay', 'https://api.pay.example', key_ttl => '1 hour'")
        .await
        .unwrap();
    let plain = json!({"endpoint": "pay", "path": "/v1/charges"});
    let looked = json!({"endpoint": "pay", "path": "/v1/charges",
                        "reconcile": {"path": "/v1/charges/search"}});
    for (key, payload) in [("lapsed", &plain), ("looked", &looked), ("fresh", &plain)] {
        enqueue_http(&c, key, payload.clone()).await.unwrap();
    }
    let claimed = claim::claim(&c, &[Channel::Http], 10, "w", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);
    // The worker stalls past its lease; for two of them the first attempt began two hours
    // ago, past the endpoint's one-hour key window.
    c.execute(
        "UPDATE outbox.messages SET lease_expires_at = now() - interval '1 second',
             first_attempt_at = CASE WHEN message_key = 'fresh' THEN first_attempt_at
                                     ELSE now() - interval '2 hours' END",
        &[],
    )
    .await
    .unwrap();
    let policy = outboxd::retry::RetryPolicy {
        base: Duration::ZERO,
        max: Duration::ZERO,
    };
    let settled = claim::settle_expired(&c, &[Channel::Http], 10, &policy)
        .await
        .unwrap();
    assert_eq!((settled.gave_up.len(), settled.deferred.len()), (1, 2));

    let rows = c
        .query(
            "SELECT m.message_key, m.state, m.error_class, m.last_error, a.outcome, a.error
             FROM outbox.messages m JOIN outbox.attempts a ON a.message_id = m.id
             ORDER BY m.message_key",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<(String, String, String, String, String, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect();
    let expired = "lease expired while running: the attempt may have taken effect";
    let lapsed = format!("{expired}; {}", outboxd::state::KEY_WINDOW_CLOSED);
    let want = |key: &str, state: &str, outcome: &str, error: &str| {
        (
            key.to_owned(),
            state.to_owned(),
            "ambiguous".to_owned(),
            error.to_owned(),
            outcome.to_owned(),
            error.to_owned(),
        )
    };
    assert_eq!(
        got,
        vec![
            want("fresh", "pending", "lease_lost", expired),
            want("lapsed", "dead", "dead", &lapsed),
            want("looked", "pending", "lease_lost", expired),
        ]
    );
}
