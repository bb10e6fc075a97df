//! Hostile callers of the SQL interface (`outbox.validate` and the insert trigger).
//!
//! - A role with only the `outbox_app` rights that puts look-alike functions and an `||`
//!   operator ahead of `pg_catalog` in its `search_path` cannot get past the enqueue rules
//!   or make a message's fingerprint lie; every function of the schema has a pinned path.
//! - An infinite `run_after` is refused at enqueue, naming the field, on every path; a row
//!   that already holds one (stored before the rule) does not break `outboxd status` nor the
//!   counts `/metrics` reads.
//! - Control characters in a message key are refused at enqueue, naming the field, on every
//!   path; ordinary keys (any letters, emoji) still pass.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, SystemTime};

use common::*;
use outboxd::{EnqueueError, NewMessage};
use serde_json::{Value, json};
use tokio_postgres::Client;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// Login and group roles made for one test (role names are cluster-wide, so each test gets
/// its own), dropped at the end even if the test fails.
struct Roles {
    admin: tokio_postgres::Config,
    db: String,
    names: Vec<String>,
}

impl Drop for Roles {
    fn drop(&mut self) {
        let (mut admin, db, names) = (self.admin.clone(), self.db.clone(), self.names.clone());
        admin.dbname(&db);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let c = connect(&admin).await;
                for n in names {
                    let _ = c
                        .batch_execute(&format!("DROP OWNED BY {n}; DROP ROLE IF EXISTS {n}"))
                        .await;
                }
            });
        })
        .join();
    }
}

/// The attacker: a login granted only the application group role, set up by
/// sql/grants.sql (with unique group names), owning a schema `shop`. Returns its connection
/// settings.
async fn attacker(db: &TestDb) -> (Roles, tokio_postgres::Config) {
    let suffix = format!("{}_{}", std::process::id(), rand::random::<u32>());
    let (app, worker, login) = (
        format!("outbox_app_{suffix}"),
        format!("outbox_worker_{suffix}"),
        format!("attacker_{suffix}"),
    );
    let roles = Roles {
        admin: admin_url().parse().unwrap(),
        db: db.name.clone(),
        names: vec![login.clone(), app.clone(), worker.clone()],
    };
    let grants = include_str!("../../sql/grants.sql")
        .replace("outbox_app", &app)
        .replace("outbox_worker", &worker);
    let c = db.client().await;
    c.batch_execute(&grants).await.unwrap();
    // A schema of its own, as an application role often has (one with CREATE on the
    // database could make it itself).
    c.batch_execute(&format!(
        "CREATE ROLE {login} LOGIN IN ROLE {app}; CREATE SCHEMA shop AUTHORIZATION {login};"
    ))
    .await
    .unwrap();
    let mut cfg = db.pg.clone();
    cfg.user(&login);
    (roles, cfg)
}

/// The look-alikes: each defeats one rule of the insert trigger, and `||` makes the
/// fingerprint of any payload naming attacker.example that of the victim's payload.
const LOOK_ALIKES: &str = r#"
CREATE FUNCTION shop.octet_length(text) RETURNS integer LANGUAGE sql IMMUTABLE AS $$ SELECT 0 $$;
CREATE FUNCTION shop.char_length(text) RETURNS integer LANGUAGE sql IMMUTABLE AS $$ SELECT 10 $$;
CREATE FUNCTION shop.btrim(text, text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT $1 $$;
CREATE FUNCTION shop.btrim(text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT $1 $$;
CREATE FUNCTION shop.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql IMMUTABLE
    AS $$ SELECT coalesce(pg_catalog.jsonb_typeof($1), 'string') $$;
CREATE FUNCTION shop.cat(a text, b text) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN pg_catalog.strpos(b, 'attacker.example') > 0
                THEN pg_catalog.textcat(a, '{"url": "https://victim.example/hook"}')
                ELSE pg_catalog.textcat(a, b) END
$$;
CREATE OPERATOR shop.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = shop.cat);
SET search_path = shop, pg_catalog;
"#;

/// The SQL ways to enqueue one webhook: (name, statement). `$1` key, `$2` payload, `$3`
/// run_after as text (NULL: now), `$4` another key and `$5` another payload (enqueue_many's
/// batch puts a valid first row ahead of the one under test: all or nothing).
const SQL_PATHS: [(&str, &str); 4] = [
    (
        "INSERT",
        "INSERT INTO outbox.messages (message_key, channel, payload, run_after) \
         SELECT $1::text, 'webhook', $2::jsonb, coalesce($3::text::timestamptz, now()) \
         WHERE $4::text IS NOT NULL AND $5::jsonb IS NOT NULL",
    ),
    (
        "outbox.enqueue",
        "SELECT outbox.enqueue($1::text, 'webhook', $2::jsonb, coalesce($3::text::timestamptz, now())) \
         WHERE $4::text IS NOT NULL AND $5::jsonb IS NOT NULL",
    ),
    (
        "outbox.enqueue_row",
        "SELECT * FROM outbox.enqueue_row($1::text, 'webhook', $2::jsonb, coalesce($3::text::timestamptz, now())) \
         WHERE $4::text IS NOT NULL AND $5::jsonb IS NOT NULL",
    ),
    (
        "outbox.enqueue_many",
        "SELECT * FROM outbox.enqueue_many(ARRAY[$4::text, $1::text], ARRAY['webhook', 'webhook'], \
         ARRAY[$5::jsonb, $2::jsonb], ARRAY[NULL, $3::text::timestamptz])",
    ),
];

static OTHER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Runs one SQL path.
async fn via(
    c: &Client,
    sql: &str,
    key: &str,
    payload: &Value,
    run_after: Option<&str>,
) -> Result<(), tokio_postgres::Error> {
    let other = format!(
        "batch-mate:{}",
        OTHER.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    let mate = json!({"url": "https://example.com/mate"});
    c.execute(sql, &[&key, payload, &run_after, &other, &mate])
        .await
        .map(|_| ())
}

/// Asserts a refusal with SQLSTATE 22023 naming `field` (in COLUMN and in the message).
fn assert_22023(what: &str, got: Result<(), tokio_postgres::Error>, field: &str) -> String {
    let err = got.expect_err(what);
    let db = err.as_db_error().unwrap_or_else(|| panic!("{what}: {err}"));
    assert_eq!(db.code().code(), "22023", "{what}: {db}");
    assert_eq!(db.column(), Some(field), "{what}: {db}");
    assert!(db.message().contains(field), "{what}: {}", db.message());
    db.message().to_owned()
}

/// Asserts an `EnqueueError::Invalid` naming `field`.
fn assert_invalid<T: std::fmt::Debug>(what: &str, got: Result<T, EnqueueError>, field: &str) {
    match got {
        Err(EnqueueError::Invalid { field: f, message }) => {
            assert_eq!(f, field, "{what}: field (message {message:?})");
            assert!(message.contains(field), "{what}: {message:?}");
        }
        other => panic!("{what}: expected Invalid naming {field}, got {other:?}"),
    }
}

async fn count(c: &Client) -> i64 {
    c.query_one("SELECT count(*) FROM outbox.messages", &[])
        .await
        .unwrap()
        .get(0)
}

/// `infinity` as a `SystemTime`: postgres-types sends microseconds since 2000 as an i64, and
/// PostgreSQL reads i64::MAX as `infinity`.
fn system_time_infinity() -> SystemTime {
    SystemTime::UNIX_EPOCH
        + Duration::from_secs(946_684_800)
        + Duration::from_micros(i64::MAX as u64)
}

// ---------------------------------------------------------------------------------------
// 1. A caller's search_path
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn every_function_of_the_schema_has_a_pinned_search_path() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let rows = c
        .query(
            "SELECT p.oid::regprocedure::text, \
                    (SELECT s FROM unnest(p.proconfig) s WHERE s LIKE 'search_path=%') \
             FROM pg_proc p WHERE p.pronamespace = 'outbox'::regnamespace ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    let all: Vec<(String, Option<String>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(all.len() >= 12, "the schema's functions: {all:?}");
    for (f, path) in &all {
        assert_eq!(
            path.as_deref(),
            Some("search_path=pg_catalog, pg_temp"),
            "{f} runs with its caller's search_path"
        );
    }
}

#[tokio::test]
async fn look_alike_functions_on_the_callers_search_path_change_nothing() {
    let db = TestDb::new().await;
    let (_roles, cfg) = attacker(&db).await;
    let owner = db.client().await;
    let a = connect(&cfg).await;
    a.batch_execute(LOOK_ALIKES).await.unwrap();
    // The look-alikes are live in the attacker's session (else this test proves nothing).
    let live = a
        .query_one(
            "SELECT octet_length('abc'::text), char_length(''::text), btrim(' k'::text, ' '), \
                    'webhook'::text || '{\"url\": \"https://attacker.example/x\"}'::text",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(live.get::<_, i32>(0), 0);
    assert_eq!(live.get::<_, i32>(1), 10);
    assert_eq!(live.get::<_, String>(2), " k");
    assert_eq!(
        live.get::<_, String>(3),
        "webhook{\"url\": \"https://victim.example/hook\"}"
    );

    let big = json!({"url": "https://attacker.example/big", "pad": "x".repeat(5 << 20)});
    let genuine = json!({"url": "https://victim.example/hook"});
    let stolen = json!({"url": "https://attacker.example/steal"});
    for (path, sql) in SQL_PATHS {
        let before = count(&owner).await;
        let what = format!("{path}: 5 MiB payload");
        assert_22023(
            &what,
            via(&a, sql, &format!("big:{path}"), &big, None).await,
            "payload",
        );
        let what = format!("{path}: key with a leading space");
        assert_22023(
            &what,
            via(&a, sql, &format!(" lead:{path}"), &genuine, None).await,
            "message_key",
        );
        let what = format!("{path}: webhook without a url");
        assert_22023(
            &what,
            via(
                &a,
                sql,
                &format!("nourl:{path}"),
                &json!({"body": {}}),
                None,
            )
            .await,
            "payload.url",
        );
        assert_eq!(count(&owner).await, before, "{path}: nothing inserted");

        // The attacker may take a key first (it names its own side effect), but its row's
        // fingerprint is its own payload's: the victim's enqueue is a conflict, not a
        // duplicate of the attacker's row.
        let key = format!("order-42:paid:notify:{path}");
        via(&a, sql, &key, &stolen, None).await.unwrap();
        let honest: bool = owner
            .query_one(
                "SELECT request_hash = outbox.request_hash(channel, payload) \
                 FROM outbox.messages WHERE message_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            honest,
            "{path}: the stored fingerprint is the payload's own"
        );
        match outboxd::enqueue(&owner, &NewMessage::webhook(&key, genuine.clone())).await {
            Err(EnqueueError::KeyConflict { key: k, .. }) => assert_eq!(k, key),
            other => panic!("{path}: the victim's enqueue must be OB409, got {other:?}"),
        }
        let err = owner
            .query_one(
                "SELECT outbox.enqueue($1, 'webhook', $2)",
                &[&key, &genuine],
            )
            .await
            .unwrap_err();
        assert_eq!(err.code().map(|c| c.code()), Some("OB409"), "{path}: {err}");
    }
}

// ---------------------------------------------------------------------------------------
// 2. An infinite run_after
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn an_infinite_run_after_is_refused_on_every_path_naming_the_field() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let payload = json!({"url": "https://example.com/h"});
    for at in ["infinity", "-infinity"] {
        for (path, sql) in SQL_PATHS {
            let what = format!("{path}: run_after {at}");
            assert_22023(
                &what,
                via(&c, sql, &format!("k:{path}:{at}"), &payload, Some(at)).await,
                "run_after",
            );
        }
    }
    let inf = system_time_infinity();
    assert_invalid(
        "Rust enqueue",
        outboxd::enqueue(
            &c,
            &NewMessage::webhook("k:rust", payload.clone()).run_after(inf),
        )
        .await,
        "run_after",
    );
    assert_invalid(
        "Rust enqueue_many",
        outboxd::enqueue_many(
            &c,
            &[
                NewMessage::webhook("k:many:1", payload.clone()),
                NewMessage::webhook("k:many:2", payload.clone()).run_after(inf),
            ],
        )
        .await,
        "run_after",
    );
    // A time past PostgreSQL's range (294276 AD) is bad input too, not a database fault.
    let beyond = SystemTime::UNIX_EPOCH
        + Duration::from_secs(946_684_800)
        + Duration::from_micros(i64::MAX as u64 - 1);
    assert_invalid(
        "Rust enqueue past the range",
        outboxd::enqueue(
            &c,
            &NewMessage::webhook("k:beyond", payload.clone()).run_after(beyond),
        )
        .await,
        "run_after",
    );
    assert_eq!(count(&c).await, 0, "nothing inserted");
    // Far, but finite, is fine.
    for (path, sql) in SQL_PATHS {
        via(
            &c,
            sql,
            &format!("far:{path}"),
            &payload,
            Some("9999-12-31 00:00:00+00"),
        )
        .await
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

/// Stores rows the way a hand-made row could be: with the insert trigger off
/// (as the table's owner), so the new rule does not see them.
async fn insert_legacy(c: &Client, key: &str, run_after: &str, created_ago_secs: f64) {
    c.batch_execute("ALTER TABLE outbox.messages DISABLE TRIGGER messages_before_insert")
        .await
        .unwrap();
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload, request_hash, run_after, created_at) \
         VALUES ($1, 'webhook', '{\"url\": \"https://example.com/h\"}', \
                 outbox.request_hash('webhook', '{\"url\": \"https://example.com/h\"}'), \
                 $2::text::timestamptz, now() - make_interval(secs => $3))",
        &[&key, &run_after, &created_ago_secs],
    )
    .await
    .unwrap();
    c.batch_execute("ALTER TABLE outbox.messages ENABLE TRIGGER messages_before_insert")
        .await
        .unwrap();
}

#[tokio::test]
async fn status_and_the_metrics_counts_survive_rows_with_an_infinite_run_after() {
    let db = TestDb::new().await;
    let c = db.client().await;
    insert_legacy(&c, "legacy:-inf", "-infinity", 3600.0).await;
    insert_legacy(&c, "legacy:+inf", "infinity", 7200.0).await;
    c.query_one(
        "SELECT outbox.enqueue('due:10s', 'webhook', '{\"url\": \"https://example.com/h\"}', now() - interval '10 seconds')",
        &[],
    )
    .await
    .unwrap();

    // A `-infinity` row is due since it was enqueued (an hour ago); `infinity` is never due.
    let st = outboxd::status::status(&c).await.unwrap();
    assert_eq!(st.total.pending, 3, "{st:?}");
    assert!((3600.0..3700.0).contains(&st.oldest_due_seconds), "{st:?}");
    let b = outboxd::status::bounded_counts(&c, outboxd::status::COUNT_CAP)
        .await
        .unwrap();
    assert_eq!(b.counts.pending, 3, "{b:?}");
    assert!((3600.0..3700.0).contains(&b.oldest_due_seconds), "{b:?}");

    // Only the `infinity` row: nothing is due.
    c.batch_execute("DELETE FROM outbox.messages WHERE message_key <> 'legacy:+inf'")
        .await
        .unwrap();
    let st = outboxd::status::status(&c).await.unwrap();
    assert_eq!(
        (st.total.pending, st.oldest_due_seconds),
        (1, 0.0),
        "{st:?}"
    );

    // The operator's command, as run from a shell.
    insert_legacy(&c, "legacy:-inf:2", "-infinity", 60.0).await;
    let out = binary::run(binary::outboxd(Some(&db.url())).args(["status", "--json"]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["pending"], json!(2), "{v}");
    let oldest = v["oldest_due_seconds"].as_f64().unwrap();
    assert!((60.0..160.0).contains(&oldest), "{v}");

    // `show` of such a row prints the value (it used to panic reading it).
    for (key, shown) in [("legacy:-inf:2", "-infinity"), ("legacy:+inf", "infinity")] {
        let out = binary::run(binary::outboxd(Some(&db.url())).args(["show", key, "--json"]));
        assert_eq!(out.code, Some(0), "{}", out.stderr);
        let v: Value = serde_json::from_str(&out.stdout).unwrap();
        assert_eq!(v["run_after"], json!(shown), "{v}");
        let text = binary::run(binary::outboxd(Some(&db.url())).args(["show", key]));
        assert_eq!(text.code, Some(0), "{}", text.stderr);
        assert!(text.stdout.contains(shown), "{}", text.stdout);
    }
}

// ---------------------------------------------------------------------------------------
// 3. Control characters in message keys
// ---------------------------------------------------------------------------------------

/// One of each class: C0 (tab, LF, CR, ESC, U+0001, U+001F), DEL, C1 (U+0080, NEL, CSI,
/// U+009F), the line and paragraph separators, and the bidirectional controls.
const REFUSED: [char; 19] = [
    '\u{1}', '\t', '\n', '\r', '\u{1b}', '\u{1f}', '\u{7f}', '\u{80}', '\u{85}', '\u{9b}',
    '\u{9f}', '\u{2028}', '\u{2029}', '\u{202a}', '\u{202e}', '\u{2066}', '\u{2067}', '\u{2068}',
    '\u{2069}',
];

#[tokio::test]
async fn control_characters_in_keys_are_refused_on_every_path() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let payload = json!({"url": "https://example.com/h"});
    for ch in REFUSED {
        let key = format!("run:step{ch}action");
        let code = format!("U+{:04X}", ch as u32);
        for (path, sql) in SQL_PATHS {
            let what = format!("{path}: {code}");
            let message = assert_22023(
                &what,
                via(&c, sql, &key, &payload, None).await,
                "message_key",
            );
            assert!(message.contains(&code), "{what}: {message}");
            assert!(
                !message.contains(ch),
                "{what}: the message echoes the character"
            );
        }
        assert_invalid(
            &format!("Rust enqueue: {code}"),
            outboxd::enqueue(&c, &NewMessage::webhook(&key, payload.clone())).await,
            "message_key",
        );
        assert_invalid(
            &format!("Rust enqueue_many: {code}"),
            outboxd::enqueue_many(
                &c,
                &[
                    NewMessage::webhook("fine:first", payload.clone()),
                    NewMessage::webhook(&key, payload.clone()),
                ],
            )
            .await,
            "message_key",
        );
    }
    assert_eq!(count(&c).await, 0, "nothing inserted");
}

#[tokio::test]
async fn ordinary_keys_are_still_accepted_on_every_path() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let payload = json!({"url": "https://example.com/h"});
    let keys = [
        "run:step:action",
        "order-ü:支付:通知",
        "ключ:🎉:😀",
        "مفتاح:١٢٣",
        "שלום:\u{200f}:rtl-mark",
        "e\u{301}:combining",
        "nbsp\u{a0}inside",
        "👩‍👩‍👧:zwj",
        "'; DROP TABLE outbox.messages; --",
    ];
    let mut n = 0;
    for k in keys {
        for (path, sql) in SQL_PATHS {
            via(&c, sql, &format!("{k}#{path}"), &payload, None)
                .await
                .unwrap_or_else(|e| panic!("{k:?} via {path}: {e}"));
            n += if path == "outbox.enqueue_many" { 2 } else { 1 };
        }
        let e = outboxd::enqueue(
            &c,
            &NewMessage::webhook(format!("{k}#rust"), payload.clone()),
        )
        .await
        .unwrap();
        assert!(e.created, "{k:?}");
        let many = outboxd::enqueue_many(
            &c,
            &[NewMessage::webhook(format!("{k}#many"), payload.clone())],
        )
        .await
        .unwrap();
        assert!(many[0].created, "{k:?}");
        n += 2;
    }
    assert_eq!(count(&c).await, n);
}
