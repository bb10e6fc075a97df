//! The `outboxd` binary as an operator runs it: exit codes, output, one-line errors.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::binary::{Output, UNREACHABLE_URL, outboxd, run};
use common::*;
use serde_json::Value;

/// Asserts exit 2 with exactly one non-empty stderr line, no panic, containing `mention`.
fn assert_usage_error(what: &str, out: &Output, mention: &str) {
    assert_eq!(
        out.code,
        Some(2),
        "{what}: exit code (stdout {:?}, stderr {:?})",
        out.stdout,
        out.stderr
    );
    let lines = out.stderr_lines();
    assert_eq!(
        lines.len(),
        1,
        "{what}: one stderr line, got {:?}",
        out.stderr
    );
    assert!(!out.stderr.contains("panicked"), "{what}: {:?}", out.stderr);
    assert!(
        !out.stderr.contains("RUST_BACKTRACE"),
        "{what}: {:?}",
        out.stderr
    );
    assert!(
        lines[0].to_lowercase().contains(&mention.to_lowercase()),
        "{what}: {:?} should mention {mention:?}",
        lines[0]
    );
}

async fn count(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox.messages").await
}

#[test]
fn help_exits_0() {
    let out = run(outboxd(None).arg("--help"));
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    for sub in ["migrate", "run", "enqueue", "status"] {
        assert!(
            out.stdout.contains(sub),
            "--help lists {sub}: {}",
            out.stdout
        );
    }
    let out = run(outboxd(None).args(["enqueue", "--help"]));
    assert_eq!(out.code, Some(0));
    assert!(out.stdout.contains("--payload"));
}

/// The variable names `src/` mentions outside its test modules (from the first
/// `#[cfg(test)]` line of a file on, as `tests/it/tidy.rs` reads it): every `OUTBOXD_*`,
/// `OTEL_*`, `DATABASE_URL` and `RUST_LOG`. A prefix written alone (`OUTBOXD_<FLAG>`) is
/// not a variable.
fn variables_in_src() -> std::collections::BTreeSet<String> {
    fn walk(dir: &std::path::Path, out: &mut std::collections::BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let bytes = code.as_bytes();
            let word = |b: u8| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_';
            let mut i = 0;
            while i < bytes.len() {
                let starts_word = i == 0 || !word(bytes[i - 1]);
                let known = ["OUTBOXD_", "OTEL_", "DATABASE_URL", "RUST_LOG"]
                    .iter()
                    .any(|p| bytes[i..].starts_with(p.as_bytes()));
                if !(starts_word && known) {
                    i += 1;
                    continue;
                }
                let end = bytes[i..]
                    .iter()
                    .position(|b| !word(*b))
                    .map_or(bytes.len(), |n| i + n);
                let name = code[i..end].trim_end_matches('_');
                if name.contains('_') {
                    out.insert(name.to_owned());
                }
                i = end;
            }
        }
    }
    let mut found = std::collections::BTreeSet::new();
    walk(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src")),
        &mut found,
    );
    found
}

/// `--help` names every setting read from the environment: the top command all of them,
/// `run` and `console` those they read (besides each flag's own variable, which clap
/// shows beside the flag). A variable `src/` reads that no help names fails here.
#[test]
fn help_lists_the_environment() {
    let help = |args: &[&str]| {
        let out = run(outboxd(None).args(args));
        assert_eq!(out.code, Some(0), "{args:?}: {:?}", out.stderr);
        out.stdout
    };
    let top = help(&["--help"]);
    for name in [
        "DATABASE_URL",
        "OUTBOXD_SMTP_URL",
        "OUTBOXD_WEBHOOK_SECRET ",
        "OUTBOXD_WEBHOOK_SECRET_<NAME>",
        "OUTBOXD_ALLOW_PRIVATE_NETWORKS",
        "OUTBOXD_WEBHOOK_ALLOW_HOSTS",
        "OUTBOXD_WEBHOOK_RATE_LIMITS",
        "OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN",
        "OUTBOXD_CONSOLE_TOKEN",
        "OUTBOXD_LOG_FORMAT",
        "RUST_LOG",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OUTBOXD_<FLAG>",
    ] {
        assert!(top.contains(name), "outboxd --help names {name}:\n{top}");
    }
    // `-h` too: it is what a newcomer types first.
    assert!(help(&["-h"]).contains("OUTBOXD_ALLOW_PRIVATE_NETWORKS"));
    let run_help = help(&["run", "--help"]);
    for name in [
        "DATABASE_URL",
        "OUTBOXD_SMTP_URL",
        "OUTBOXD_WEBHOOK_SECRET_<NAME>",
        "OUTBOXD_ALLOW_PRIVATE_NETWORKS",
        "OUTBOXD_WEBHOOK_ALLOW_HOSTS",
        "OUTBOXD_WEBHOOK_RATE_LIMITS",
        "OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN",
        "OUTBOXD_LOG_FORMAT",
        "RUST_LOG",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ] {
        assert!(
            run_help.contains(name),
            "outboxd run --help names {name}:\n{run_help}"
        );
    }
    let console_help = help(&["console", "--help"]);
    for name in [
        "DATABASE_URL",
        "OUTBOXD_CONSOLE_TOKEN",
        "OUTBOXD_LOG_FORMAT",
    ] {
        assert!(
            console_help.contains(name),
            "outboxd console --help names {name}:\n{console_help}"
        );
    }
    // Every variable the source reads is named by some help: the top command's, or a
    // subcommand's beside its flag.
    use clap::CommandFactory as _;
    let mut all = top.clone();
    for sub in outboxd::cli::Cli::command().get_subcommands() {
        all.push_str(&help(&[sub.get_name(), "--help"]));
    }
    let found = variables_in_src();
    assert!(found.contains("OUTBOXD_CONSOLE_TOKEN"), "{found:?}");
    let missing: Vec<&String> = found.iter().filter(|v| !all.contains(v.as_str())).collect();
    assert!(
        missing.is_empty(),
        "read in src/, named by no --help: {missing:?}"
    );
}

/// A typo gets clap's "did you mean", on the one line of the error.
#[test]
fn a_typo_is_answered_with_a_suggestion_on_one_line() {
    let out = run(outboxd(Some(UNREACHABLE_URL)).arg("stauts"));
    assert_usage_error("subcommand typo", &out, "stauts");
    assert_eq!(
        out.stderr_lines()[0],
        "error: unrecognized subcommand 'stauts' (did you mean 'status'?; see outboxd --help)"
    );
    for (args, want) in [
        (vec!["status", "--jsn"], "did you mean '--json'?"),
        (
            vec!["run", "--concurency", "4"],
            "did you mean '--concurrency'?",
        ),
        (vec!["replay", "--all-ded"], "did you mean '--all-dead'?"),
    ] {
        let out = run(outboxd(Some(UNREACHABLE_URL)).args(&args));
        assert_usage_error(&format!("{args:?}"), &out, want);
    }
    // Nothing close: no suggestion, the line as before.
    let out = run(outboxd(Some(UNREACHABLE_URL)).arg("frobnicate"));
    assert_usage_error("no close subcommand", &out, "frobnicate");
    assert!(!out.stderr.contains("did you mean"), "{}", out.stderr);
    // The suggestion does not undo the escaping of what was typed.
    let out = run(outboxd(Some(UNREACHABLE_URL)).args(["status", "--jso\u{1b}[2J"]));
    assert_usage_error("control characters", &out, "see outboxd --help");
    assert!(!out.stderr.contains('\u{1b}'), "{:?}", out.stderr);
}

#[tokio::test]
async fn migrate_twice_exits_0() {
    let db = TestDb::empty().await;
    let url = db.url();
    let first = run(outboxd(Some(&url)).arg("migrate"));
    assert_eq!(first.code, Some(0), "{:?}", first.stderr);
    assert!(
        first.stdout.contains("0001_baseline.sql"),
        "{}",
        first.stdout
    );
    let second = run(outboxd(Some(&url)).arg("migrate"));
    assert_eq!(second.code, Some(0), "{:?}", second.stderr);
    assert!(!second.stdout.contains("applied 0001"), "{}", second.stdout);
    let n: i64 = db
        .scalar("SELECT count(*) FROM outbox.schema_migrations")
        .await;
    assert_eq!(
        n,
        outboxd::migrate::MIGRATIONS.len() as i64,
        "each file once"
    );
    assert_eq!(count(&db).await, 0, "the schema exists");
}

#[tokio::test]
async fn enqueue_prints_id_and_created_or_existing() {
    let db = TestDb::new().await;
    let url = db.url();
    let key = "order-42:paid:notify";
    let args = [
        "enqueue",
        "--key",
        key,
        "--channel",
        "webhook",
        "--payload",
        r#"{"url":"https://example.com/h"}"#,
    ];

    let out = run(outboxd(Some(&url)).args(args));
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    let id = row(&db, key).await.id;
    assert_eq!(out.stdout.trim(), format!("{id} created"));

    let out = run(outboxd(Some(&url)).args(args));
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    assert_eq!(out.stdout.trim(), format!("{id} existing"));

    // The same key with another payload: a refusal, exit 1, one line naming the key.
    let before: Value = db
        .scalar("SELECT payload FROM outbox.messages WHERE message_key = 'order-42:paid:notify'")
        .await;
    let out = run(outboxd(Some(&url)).args([
        "enqueue",
        "--key",
        key,
        "--channel",
        "webhook",
        "--payload",
        r#"{"url":"https://example.com/other"}"#,
    ]));
    assert_eq!(out.code, Some(1), "{:?}", out.stderr);
    let lines = out.stderr_lines();
    assert_eq!(lines.len(), 1, "{:?}", out.stderr);
    assert!(lines[0].contains(key), "{:?}", lines[0]);
    assert!(out.stdout.is_empty(), "{:?}", out.stdout);
    let after: Value = db
        .scalar("SELECT payload FROM outbox.messages WHERE message_key = 'order-42:paid:notify'")
        .await;
    assert_eq!(before, after);
    assert_eq!(count(&db).await, 1);
}

#[tokio::test]
async fn enqueue_reads_the_payload_from_a_file_and_takes_the_options() {
    let db = TestDb::new().await;
    let url = db.url();
    let path = std::env::temp_dir().join(format!("{}-payload.json", db.name));
    let payload = serde_json::json!({"to": ["a@example.com"], "subject": "Hi", "text": "hello"});
    std::fs::write(&path, serde_json::to_string_pretty(&payload).unwrap()).unwrap();
    let out = run(outboxd(Some(&url)).args([
        "enqueue",
        "--key",
        "mail-1",
        "--channel",
        "email",
        "--payload",
        &format!("@{}", path.display()),
        "--max-attempts",
        "5",
        "--no-retry-ambiguous",
        "--run-after",
        "2099-12-24T18:00:00Z",
    ]));
    let _ = std::fs::remove_file(&path);
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    let c = db.client().await;
    let r = c
        .query_one(
            "SELECT id, channel, payload, max_attempts, retry_ambiguous, \
                    run_after = '2099-12-24T18:00:00Z'::timestamptz \
             FROM outbox.messages WHERE message_key = 'mail-1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(out.stdout.trim(), format!("{} created", r.get::<_, i64>(0)));
    assert_eq!(r.get::<_, String>(1), "email");
    assert_eq!(r.get::<_, Value>(2), payload);
    assert_eq!(r.get::<_, i32>(3), 5);
    assert!(!r.get::<_, bool>(4));
    assert!(r.get::<_, bool>(5));

    // A missing file is bad usage.
    let out = run(outboxd(Some(&url)).args([
        "enqueue",
        "--key",
        "mail-2",
        "--channel",
        "email",
        "--payload",
        "@/nonexistent/outboxd-payload.json",
    ]));
    assert_usage_error("missing payload file", &out, "payload");
    assert_eq!(count(&db).await, 1);
}

#[tokio::test]
async fn enqueue_refuses_bad_input_with_exit_2() {
    let db = TestDb::new().await;
    let url = db.url();
    let cases: [(&str, &[&str], &str); 6] = [
        (
            "webhook without url",
            &["--channel", "webhook", "--payload", r#"{"body":{}}"#],
            "payload.url",
        ),
        (
            "email without to",
            &["--channel", "email", "--payload", r#"{"text":"hi"}"#],
            "payload.to",
        ),
        (
            "payload not an object",
            &["--channel", "webhook", "--payload", r#"["https://x"]"#],
            "payload",
        ),
        (
            "bad JSON",
            &["--channel", "webhook", "--payload", r#"{"url":"#],
            "json",
        ),
        (
            "max-attempts 0",
            &[
                "--channel",
                "webhook",
                "--payload",
                r#"{"url":"https://example.com/h"}"#,
                "--max-attempts",
                "0",
            ],
            "max_attempts",
        ),
        (
            "unknown channel",
            &[
                "--channel",
                "sms",
                "--payload",
                r#"{"url":"https://example.com/h"}"#,
            ],
            "channel",
        ),
    ];
    for (what, args, mention) in cases {
        let out = run(outboxd(Some(&url))
            .args(["enqueue", "--key", "k1"])
            .args(args));
        assert_usage_error(what, &out, mention);
        assert!(out.stdout.is_empty(), "{what}: {:?}", out.stdout);
    }
    assert_eq!(count(&db).await, 0, "nothing was inserted");
}

#[tokio::test]
async fn status_json_has_the_contract_shape_and_counts() {
    let db = TestDb::new().await;
    let url = db.url();

    let empty = run(outboxd(Some(&url)).args(["status", "--json"]));
    assert_eq!(empty.code, Some(0), "{:?}", empty.stderr);
    let v: Value = serde_json::from_str(empty.stdout.trim()).expect("status --json is JSON");
    assert_eq!(v["pending"], 0);
    assert_eq!(v["oldest_due_seconds"].as_f64(), Some(0.0));

    for (key, channel, payload) in [
        ("w1", "webhook", r#"{"url":"https://example.com/1"}"#),
        ("w2", "webhook", r#"{"url":"https://example.com/2"}"#),
        ("w3", "webhook", r#"{"url":"https://example.com/3"}"#),
        ("e1", "email", r#"{"to":["a@example.com"],"text":"hi"}"#),
        ("e2", "email", r#"{"to":["b@example.com"],"text":"hi"}"#),
    ] {
        enqueue_from_the_cli(&url, key, channel, payload);
    }
    // A message not yet due does not count towards the oldest due age.
    let out = run(outboxd(Some(&url)).args([
        "enqueue",
        "--key",
        "later",
        "--channel",
        "webhook",
        "--payload",
        r#"{"url":"https://example.com/later"}"#,
        "--run-after",
        "2099-01-01T00:00:00Z",
    ]));
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    let c = db.client().await;
    c.batch_execute(
        "UPDATE outbox.messages SET state = 'delivered', delivered_at = now() WHERE message_key = 'w2'; \
         UPDATE outbox.messages SET state = 'dead', dead_at = now(), error_class = 'permanent' \
           WHERE message_key = 'e2'; \
         UPDATE outbox.messages SET state = 'running', lease_owner = 'w', \
           lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute' \
           WHERE message_key = 'w3'; \
         UPDATE outbox.messages SET run_after = now() - interval '1 hour' WHERE message_key = 'w1';",
    )
    .await
    .unwrap();

    let out = run(outboxd(Some(&url)).args(["status", "--json"]));
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    let v: Value = serde_json::from_str(out.stdout.trim()).expect("status --json is JSON");
    assert_eq!(v["pending"], 3, "{v}"); // w1, e1, later
    assert_eq!(v["running"], 1, "{v}");
    assert_eq!(v["delivered"], 1, "{v}");
    assert_eq!(v["dead"], 1, "{v}");
    let oldest = v["oldest_due_seconds"].as_f64().expect("a number");
    assert!(
        (3590.0..3700.0).contains(&oldest),
        "oldest_due_seconds {oldest}"
    );
    let by = v["by_channel"]
        .as_object()
        .expect("by_channel is an object");
    let expect = [("webhook", [2, 1, 1, 0]), ("email", [1, 0, 0, 1])];
    for (ch, [pending, running, delivered, dead]) in expect {
        let c = &by[ch];
        assert_eq!(c["pending"], pending, "{ch}: {v}");
        assert_eq!(c["running"], running, "{ch}: {v}");
        assert_eq!(c["delivered"], delivered, "{ch}: {v}");
        assert_eq!(c["dead"], dead, "{ch}: {v}");
    }

    let plain = run(outboxd(Some(&url)).arg("status"));
    assert_eq!(plain.code, Some(0), "{:?}", plain.stderr);
    assert!(plain.stdout.contains("pending"), "{}", plain.stdout);
    assert!(plain.stdout.contains("webhook"), "{}", plain.stdout);
}

/// (label, environment, arguments, what the stderr line should mention).
type UsageCase = (
    &'static str,
    Vec<(&'static str, &'static str)>,
    Vec<&'static str>,
    &'static str,
);

#[test]
fn bad_usage_exits_2_with_one_line() {
    // `run` cases get a database URL nothing listens on: each must be refused before any
    // connection is attempted (a connection attempt would exit 1, or never exit).
    let cases: Vec<UsageCase> = vec![
        (
            "unknown subcommand",
            vec![],
            vec!["frobnicate"],
            "frobnicate",
        ),
        ("unknown flag", vec![], vec!["status", "--bogus"], "--bogus"),
        (
            "concurrency not a number",
            vec![],
            vec!["run", "--concurrency", "x"],
            "concurrency",
        ),
        (
            "concurrency 0",
            vec![],
            vec!["run", "--concurrency", "0"],
            "concurrency",
        ),
        (
            "duration without unit",
            vec![],
            vec!["run", "--poll-interval", "5"],
            "poll-interval",
        ),
        (
            "retention below 24h",
            vec![],
            vec!["run", "--retention", "1h"],
            "retention",
        ),
        (
            "unknown channel",
            vec![],
            vec!["run", "--channels", "sms"],
            "sms",
        ),
        (
            "email without SMTP URL",
            vec![],
            vec!["run", "--channels", "email"],
            "OUTBOXD_SMTP_URL",
        ),
        (
            "email through the environment without SMTP URL",
            vec![("OUTBOXD_CHANNELS", "webhook,email")],
            vec!["run"],
            "OUTBOXD_SMTP_URL",
        ),
        (
            "OUTBOXD_CONCURRENCY not a number",
            vec![("OUTBOXD_CONCURRENCY", "abc")],
            vec!["run"],
            "concurrency",
        ),
        (
            "OUTBOXD_RETENTION below 24h",
            vec![("OUTBOXD_RETENTION", "12h")],
            vec!["run"],
            "retention",
        ),
        (
            "bad webhook secret",
            vec![("OUTBOXD_WEBHOOK_SECRET", "nope")],
            vec!["run"],
            "OUTBOXD_WEBHOOK_SECRET",
        ),
        (
            "bad boolean",
            vec![("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "maybe")],
            vec!["run"],
            "OUTBOXD_ALLOW_PRIVATE_NETWORKS",
        ),
        (
            "bad allow-hosts entry",
            vec![("OUTBOXD_WEBHOOK_ALLOW_HOSTS", "https://x.example/")],
            vec!["run"],
            "OUTBOXD_WEBHOOK_ALLOW_HOSTS",
        ),
        (
            "lease shorter than the webhook timeout",
            vec![],
            vec!["run", "--lease", "5s", "--webhook-timeout", "10s"],
            "lease",
        ),
        (
            "bad --run-after",
            vec![],
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{}",
                "--run-after",
                "tomorrow",
            ],
            "run-after",
        ),
    ];
    for (what, env, args, mention) in cases {
        let mut cmd = outboxd(Some(UNREACHABLE_URL));
        cmd.envs(env).args(&args);
        let out = run(&mut cmd);
        assert_usage_error(what, &out, mention);
    }
}

#[test]
fn a_flag_beats_its_environment_variable() {
    // The variable alone is refused; the flag overrides it, and the next refusal is a
    // different one (the retention), which shows the flag's value was taken.
    let out = run(outboxd(Some(UNREACHABLE_URL))
        .env("OUTBOXD_CONCURRENCY", "0")
        .args(["run", "--concurrency", "8", "--retention", "1h"]));
    assert_usage_error("flag beats variable", &out, "retention");
}

#[test]
fn a_missing_database_url_is_a_usage_error() {
    for args in [&["status"][..], &["migrate"], &["status", "--json"]] {
        let out = run(outboxd(None).args(args));
        assert_usage_error(&format!("{args:?}"), &out, "DATABASE_URL");
    }
    // `run` too, once its flags are valid.
    let out = run(outboxd(None).arg("run"));
    assert_usage_error("run", &out, "DATABASE_URL");
}

#[test]
fn an_unreachable_database_is_a_runtime_failure() {
    let out = run(outboxd(Some(UNREACHABLE_URL)).arg("status"));
    assert_eq!(out.code, Some(1), "{:?}", out.stderr);
    assert_eq!(out.stderr_lines().len(), 1, "{:?}", out.stderr);
    assert!(!out.stderr.contains("panicked"));
}

#[test]

fn no_subcommand_names_the_problem() {
    let out = run(&mut outboxd(Some(UNREACHABLE_URL)));
    assert_usage_error("no subcommand", &out, "subcommand");
}

#[test]

fn a_missing_required_flag_is_named() {
    let out = run(outboxd(Some(UNREACHABLE_URL)).args([
        "enqueue",
        "--channel",
        "webhook",
        "--payload",
        "{}",
    ]));
    assert_usage_error("enqueue without --key", &out, "--key");
}

/// `outboxd enqueue` sends the payload's text to PostgreSQL as it is: parsed into a
/// `serde_json::Value` first, `12345678901234567890123` became `1.2345678901234568e22` and
/// `1.10` became `1.1`, so the same key and payload text enqueued from SQL and then from
/// the CLI was refused as a conflict (OB409, exit 1) instead of answering `existing`.
#[tokio::test]
async fn enqueue_sends_the_payload_text_unchanged() {
    let db = TestDb::new().await;
    let url = db.url();
    let payload = r#"{"url": "https://example.com/h", "body": {"big": 12345678901234567890123, "price": 1.10, "tiny": 1e-400}}"#;
    let c = db.client().await;
    let id: i64 = c
        .query_one(
            "SELECT outbox.enqueue('order-7:paid', 'webhook', $1::text::jsonb)",
            &[&payload],
        )
        .await
        .unwrap()
        .get(0);
    let out = run(outboxd(Some(&url)).args([
        "enqueue",
        "--key",
        "order-7:paid",
        "--channel",
        "webhook",
        "--payload",
        payload,
    ]));
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    assert_eq!(out.stdout.trim(), format!("{id} existing"));

    // First from the CLI: the numbers are stored as written.
    let out = run(outboxd(Some(&url)).args([
        "enqueue",
        "--key",
        "order-8:paid",
        "--channel",
        "webhook",
        "--payload",
        payload,
    ]));
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    for key in ["order-7:paid", "order-8:paid"] {
        let r = c
            .query_one(
                "SELECT payload #>> '{body,big}', payload #>> '{body,price}', \
                        payload = $2::text::jsonb \
                 FROM outbox.messages WHERE message_key = $1",
                &[&key, &payload],
            )
            .await
            .unwrap();
        assert_eq!(r.get::<_, String>(0), "12345678901234567890123", "{key}");
        assert_eq!(r.get::<_, String>(1), "1.10", "{key}");
        assert!(r.get::<_, bool>(2), "{key}");
    }
    // Text serde_json lets through and jsonb refuses is bad input, as it was when
    // serde_json parsed the payload: exit 2, naming the payload, not quoting it.
    for (what, payload) in [
        (
            "lone surrogate",
            r#"{"url": "https://example.com/h", "body": "s3cret\ud800"}"#,
        ),
        (
            "number beyond numeric",
            r#"{"url": "https://example.com/h", "body": 1e999999}"#,
        ),
    ] {
        let out = run(outboxd(Some(&url)).args([
            "enqueue",
            "--key",
            "order-9:paid",
            "--channel",
            "webhook",
            "--payload",
            payload,
        ]));
        assert_usage_error(what, &out, "payload");
        assert!(!out.stderr.contains("s3cret"), "{what}: {:?}", out.stderr);
    }
    assert_eq!(count(&db).await, 2);
}

/// `--payload @FILE` reads at most 16 MiB and one byte: `@/dev/zero` is refused at once,
/// not read until memory runs out. (Run under a 2 GiB address-space limit, so that a
/// regression fails here instead of exhausting the machine.)
#[test]
fn a_payload_file_over_16_mib_is_refused_without_reading_it_all() {
    let big =
        Scratch(std::env::temp_dir().join(format!("outboxd-{}-big.json", std::process::id())));
    // Valid JSON of 16 MiB + 1 byte: refused for its size, not its content.
    let (head, tail) = (r#"{"url": "https://example.com/h", "pad": ""#, r#""}"#);
    let pad = "x".repeat(16 * 1024 * 1024 + 1 - head.len() - tail.len());
    let text = format!("{head}{pad}{tail}");
    assert_eq!(text.len(), 16 * 1024 * 1024 + 1);
    std::fs::write(&big.0, &text).unwrap();
    for file in ["/dev/zero".to_owned(), big.0.display().to_string()] {
        let mut cmd = std::process::Command::new("sh");
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("DATABASE_URL", UNREACHABLE_URL)
            .args(["-c", "ulimit -v 2097152 && exec \"$@\"", "sh"])
            .arg(env!("CARGO_BIN_EXE_outboxd"))
            .args(["enqueue", "--key", "k", "--channel", "webhook", "--payload"])
            .arg(format!("@{file}"));
        let out = common::binary::run_within(&mut cmd, std::time::Duration::from_secs(10));
        assert_usage_error(&file, &out, "larger than 16 MiB");
    }
}

/// A file of a test's own in the temporary directory, removed when the test ends, passed
/// or failed.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The 1 MiB limit is the database's, on the payload as stored: a pretty-printed file over
/// 1 MiB whose JSON is under it goes in. And a number beyond a double's range, which
/// PostgreSQL's numeric would take and render digit by digit, is refused (exit 2).
#[tokio::test]
async fn a_payload_file_is_held_to_the_stored_size_not_its_own() {
    let db = TestDb::new().await;
    let url = db.url();
    let file =
        Scratch(std::env::temp_dir().join(format!("outboxd-{}-indented.json", std::process::id())));
    let items: Vec<String> = (0..30_000)
        .map(|i| format!("        {{\n            \"n\": {i}\n        }}"))
        .collect();
    let text = format!(
        "{{\n    \"url\": \"https://example.com/h\",\n    \"body\": [\n{}\n    ]\n}}\n",
        items.join(",\n")
    );
    assert!(text.len() > 1024 * 1024, "{}", text.len());
    std::fs::write(&file.0, &text).unwrap();
    let out = run(outboxd(Some(&url)).args([
        "enqueue",
        "--key",
        "indented",
        "--channel",
        "webhook",
        "--payload",
        &format!("@{}", file.0.display()),
    ]));
    drop(file);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.ends_with("created\n"), "{}", out.stdout);
    let stored: i32 = db
        .scalar("SELECT octet_length(payload::text) FROM outbox.messages WHERE message_key = 'indented'")
        .await;
    assert!(stored < 1024 * 1024, "{stored}");

    let out = run(outboxd(Some(&url)).args([
        "enqueue",
        "--key",
        "huge-number",
        "--channel",
        "webhook",
        "--payload",
        r#"{"url": "https://example.com/h", "n": 1e131071}"#,
    ]));
    assert_usage_error("1e131071", &out, "number out of range");
}

/// A database that was never migrated: every command that works on messages, the daemon
/// and the console included, stops at once (exit 2) with one line that says so and names
/// `outboxd migrate`, instead of failing on `relation "outbox.messages" does not exist`
/// (the daemon logged that forever). After `migrate`, the same commands work.
#[tokio::test]
async fn a_database_never_migrated_is_refused_with_the_remedy_by_every_command() {
    let db = TestDb::empty().await;
    let url = db.url();
    let commands: &[&[&str]] = &[
        &["run"],
        &["run", "--drain"],
        &["console", "--addr", "127.0.0.1:0"],
        &["status"],
        &["status", "--json"],
        &["dead"],
        &["held"],
        &["show", "1"],
        &["replay", "1"],
        &["replay", "--all-dead"],
        &["approve", "k"],
        &["cancel", "k"],
        &["confirm", "k"],
        &["purge", "--older-than", "7d"],
        &["destinations"],
        &[
            "enqueue",
            "--key",
            "k",
            "--channel",
            "webhook",
            "--payload",
            r#"{"url":"https://example.com/h"}"#,
        ],
    ];
    for args in commands {
        let what = args.join(" ");
        let out = common::binary::run_within(
            outboxd(Some(&url)).args(*args),
            std::time::Duration::from_secs(15),
        );
        assert_usage_error(&what, &out, "no outbox schema");
        assert!(
            out.stderr.contains("run `outboxd migrate`"),
            "{what}: {}",
            out.stderr
        );
    }
    let out = run(outboxd(Some(&url)).arg("migrate"));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let out = run(outboxd(Some(&url)).arg("status"));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

/// `status` shows each channel's due messages and how long the oldest has waited, in text
/// and JSON: a channel that no worker serves (e-mail without an SMTP URL) shows as messages
/// that stay due, growing older.
#[tokio::test]
async fn status_shows_each_channels_due_messages_and_the_oldest_age() {
    let db = TestDb::new().await;
    let url = db.url();
    for (key, channel, payload) in [
        ("w1", "webhook", r#"{"url":"https://example.com/1"}"#),
        ("e1", "email", r#"{"to":["a@example.com"],"text":"hi"}"#),
        ("e2", "email", r#"{"to":["b@example.com"],"text":"hi"}"#),
    ] {
        enqueue_from_the_cli(&url, key, channel, payload);
    }
    db.client()
        .await
        .batch_execute(
            "UPDATE outbox.messages SET run_after = now() - interval '5 minutes 30 seconds' \
             WHERE message_key = 'e1'; \
             UPDATE outbox.messages SET run_after = now() - interval '1 minute' \
             WHERE message_key = 'e2'",
        )
        .await
        .unwrap();

    let plain = run(outboxd(Some(&url)).arg("status"));
    assert_eq!(plain.code, Some(0), "{:?}", plain.stderr);
    assert!(
        plain.stdout.lines().any(|l| l == "email: 2 due, oldest 5m"),
        "{}",
        plain.stdout
    );
    assert!(
        plain
            .stdout
            .lines()
            .any(|l| l.starts_with("webhook: 1 due, oldest ")),
        "{}",
        plain.stdout
    );

    let out = run(outboxd(Some(&url)).args(["status", "--json"]));
    assert_eq!(out.code, Some(0), "{:?}", out.stderr);
    let v: Value = serde_json::from_str(out.stdout.trim()).expect("status --json is JSON");
    let email = &v["due_by_channel"]["email"];
    assert_eq!(email["due"], 2, "{v}");
    let oldest = email["oldest_due_seconds"].as_f64().expect("a number");
    assert!((330.0..400.0).contains(&oldest), "{v}");
    assert_eq!(v["due_by_channel"]["webhook"]["due"], 1, "{v}");
}

/// Deeply nested JSON gets the same answer from `outboxd enqueue` as from
/// `SELECT outbox.enqueue(...)`: PostgreSQL's parser decides how deep a payload may be, not
/// a limit of the command line's own (serde_json's 128 levels refused 200). Depths PostgreSQL
/// takes are stored by both, and the same text enqueued from SQL under the CLI's key answers
/// with the CLI's row; a depth past PostgreSQL's stack is refused by both, for that reason.
#[tokio::test]
async fn deeply_nested_payloads_get_the_same_answer_from_the_cli_and_from_sql() {
    let db = TestDb::new().await;
    let url = db.url();
    let c = db.client().await;
    let arrays = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let objects = |n: usize| format!("{}1{}", r#"{"a": "#.repeat(n), "}".repeat(n));
    let cases = [
        ("arrays-200", arrays(200)),
        ("objects-200", objects(200)),
        ("arrays-5000", arrays(5000)),
        ("objects-5000", objects(5000)),
        ("arrays-200000", arrays(200_000)),
        ("objects-200000", objects(200_000)),
    ];
    for (name, body) in cases {
        let payload = format!(r#"{{"url": "https://example.com/h", "body": {body}}}"#);
        let sql = c
            .query_one(
                "SELECT outbox.enqueue($1, 'webhook', $2::text::jsonb)",
                &[&format!("sql-{name}"), &payload],
            )
            .await;
        // A file, not an argument: Linux caps one argument at 128 KiB.
        let file = Scratch(
            std::env::temp_dir().join(format!("outboxd-{}-{name}.json", std::process::id())),
        );
        std::fs::write(&file.0, &payload).unwrap();
        let key = format!("cli-{name}");
        let out = run(outboxd(Some(&url)).args([
            "enqueue",
            "--key",
            &key,
            "--channel",
            "webhook",
            "--payload",
            &format!("@{}", file.0.display()),
        ]));
        match sql {
            Ok(_) => {
                assert_eq!(out.code, Some(0), "{name}: SQL took it: {}", out.stderr);
                assert!(out.stdout.ends_with("created\n"), "{name}: {}", out.stdout);
                let id: i64 = out
                    .stdout
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                let again: i64 = c
                    .query_one(
                        "SELECT outbox.enqueue($1, 'webhook', $2::text::jsonb)",
                        &[&key, &payload],
                    )
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(
                    again, id,
                    "{name}: the same text from SQL is the same message"
                );
            }
            Err(e) => {
                let db_err = e.as_db_error().expect("a database error");
                assert_eq!(
                    db_err.message(),
                    "stack depth limit exceeded",
                    "{name}: {db_err:?}"
                );
                assert!(
                    !name.ends_with("-200"),
                    "{name}: SQL refused it: {db_err:?}"
                );
                assert_usage_error(name, &out, "stack depth limit exceeded");
            }
        }
    }
    let n: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE message_key LIKE 'cli-%'")
        .await;
    assert_eq!(
        n, 4,
        "the 200- and 5000-deep payloads are stored from the CLI"
    );
}

/// `outboxd enqueue --key KEY --channel CHANNEL --payload PAYLOAD`, which must succeed.
fn enqueue_from_the_cli(url: &str, key: &str, channel: &str, payload: &str) {
    let out = run(outboxd(Some(url)).args([
        "enqueue",
        "--key",
        key,
        "--channel",
        channel,
        "--payload",
        payload,
    ]));
    assert_eq!(out.code, Some(0), "{key}: {:?}", out.stderr);
}
