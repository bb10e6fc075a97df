//! Bad arguments for every subcommand of the real binary: exit 2, exactly one non-empty
//! line on stderr, no panic; and an unreachable database: exit 1 for every command that
//! connects.
//!
//! Arguments that can be judged without a database get a `DATABASE_URL` nothing listens
//! on: a command that tried to connect before refusing its arguments would exit 1 instead
//! of 2. Arguments only the database can judge (the SQL rules of `outbox.enqueue`) get a
//! real, empty database.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::binary::{Output, UNREACHABLE_URL, outboxd, run};
use common::*;

/// Exit `code`, exactly one non-empty stderr line, no panic or backtrace; returns the line.
fn assert_one_line_exit(what: &str, out: &Output, code: i32) -> String {
    assert_eq!(
        out.code,
        Some(code),
        "{what}: exit code (stdout {:?}, stderr {:?})",
        out.stdout,
        out.stderr
    );
    let lines: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "{what}: one stderr line, got {:?}",
        out.stderr
    );
    for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
        assert!(!out.stderr.contains(bad), "{what}: {:?}", out.stderr);
    }
    lines[0].to_owned()
}

type Case = (&'static str, Vec<&'static str>, &'static str);

/// Runs every case against `url` and checks exit 2 with one line mentioning the named text.
fn assert_usage_errors(url: &str, cases: &[Case]) {
    let mut failures = Vec::new();
    for (what, args, mention) in cases {
        let out = run(outboxd(Some(url)).args(args));
        let result = std::panic::catch_unwind(|| {
            let line = assert_one_line_exit(what, &out, 2);
            assert!(
                line.to_lowercase().contains(&mention.to_lowercase()),
                "{what}: {line:?} should mention {mention:?}"
            );
        });
        if let Err(e) = result {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            failures.push(format!("{args:?}: {msg}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn bad_arguments_exit_2_with_one_line_before_any_connection() {
    let cases: Vec<Case> = vec![
        // migrate
        (
            "migrate: unknown flag",
            vec!["migrate", "--force"],
            "--force",
        ),
        ("migrate: stray argument", vec!["migrate", "now"], "now"),
        // run
        (
            "run: unknown flag",
            vec!["run", "--threads", "4"],
            "--threads",
        ),
        ("run: missing value", vec!["run", "--lease"], "--lease"),
        (
            "run: duration without unit",
            vec!["run", "--lease", "60"],
            "lease",
        ),
        ("run: unknown unit", vec!["run", "--lease", "60x"], "lease"),
        (
            "run: negative duration",
            vec!["run", "--poll-interval=-1s"],
            "poll-interval",
        ),
        (
            "run: fractional duration",
            vec!["run", "--retry-base", "1.5s"],
            "retry-base",
        ),
        (
            "run: duration with a space",
            vec!["run", "--retry-max", "5 m"],
            "retry-max",
        ),
        (
            "run: overflowing duration",
            vec!["run", "--retention", "99999999999999999999d"],
            "retention",
        ),
        (
            "run: duration overflowing in ms",
            vec!["run", "--shutdown-grace", "18446744073709551615d"],
            "shutdown-grace",
        ),
        (
            "run: empty duration",
            vec!["run", "--webhook-timeout", ""],
            "webhook-timeout",
        ),
        (
            "run: bad smtp timeout",
            vec!["run", "--smtp-timeout", "soon"],
            "smtp-timeout",
        ),
        (
            "run: zero webhook timeout",
            vec!["run", "--webhook-timeout", "0ms"],
            "webhook-timeout",
        ),
        (
            "run: zero poll interval",
            vec!["run", "--poll-interval", "0s"],
            "poll-interval",
        ),
        (
            "run: zero retry base",
            vec!["run", "--retry-base", "0s"],
            "retry-base",
        ),
        (
            "run: base above max",
            vec!["run", "--retry-base", "1h", "--retry-max", "1m"],
            "retry-base",
        ),
        (
            "run: retention 23h",
            vec!["run", "--retention", "23h"],
            "retention",
        ),
        (
            "run: lease equal to timeout + 1s",
            vec!["run", "--lease", "11s", "--webhook-timeout", "10s"],
            "lease",
        ),
        (
            // An attempt must end inside its lease with a margin: 10 s under a 12 s lease
            // let a second worker send the message while the first request still waited.
            "run: lease under timeout + 3s",
            vec!["run", "--lease", "12s", "--webhook-timeout", "10s"],
            "lease",
        ),
        (
            "run: concurrency negative",
            vec!["run", "--concurrency=-1"],
            "concurrency",
        ),
        (
            "run: concurrency float",
            vec!["run", "--concurrency", "1e3"],
            "concurrency",
        ),
        (
            "run: concurrency too large",
            vec!["run", "--concurrency", "10001"],
            "concurrency",
        ),
        (
            "run: host concurrency negative",
            vec!["run", "--host-concurrency=-1"],
            "host-concurrency",
        ),
        (
            "run: host concurrency too large",
            vec!["run", "--host-concurrency", "10001"],
            "host-concurrency",
        ),
        (
            "run: breaker threshold negative",
            vec!["run", "--breaker-threshold=-1"],
            "breaker-threshold",
        ),
        (
            "run: breaker threshold not a number",
            vec!["run", "--breaker-threshold", "ten"],
            "breaker-threshold",
        ),
        (
            "run: breaker threshold too large",
            vec!["run", "--breaker-threshold", "2000000"],
            "breaker-threshold",
        ),
        (
            "run: breaker cooldown of zero",
            vec!["run", "--breaker-cooldown", "0s"],
            "breaker-cooldown",
        ),
        (
            "run: breaker cooldown without a unit",
            vec!["run", "--breaker-cooldown", "30"],
            "breaker-cooldown",
        ),
        (
            "destinations: --close with a control character",
            vec!["destinations", "--close", "a.example\u{1b}[2J"],
            "--close",
        ),
        (
            "destinations: --close with a space",
            vec![
                "destinations",
                "--close",
                "a.example; DROP TABLE outbox.messages",
            ],
            "--close",
        ),
        (
            "destinations: --close empty",
            vec!["destinations", "--close", ""],
            "--close",
        ),
        (
            "run: rate limit without a unit",
            vec!["run", "--webhook-rate-limits", "hooks.slack.com=1"],
            "hooks.slack.com=1",
        ),
        (
            "run: rate limit of zero",
            vec![
                "run",
                "--webhook-rate-limits",
                "a.example=1/s,b.example=0/m",
            ],
            "b.example=0/m",
        ),
        (
            // Destinations leave out the default port: the entry would never apply.
            "run: rate limit on https's default port",
            vec!["run", "--webhook-rate-limits", "api.example.com:443=10/s"],
            "write api.example.com=10/s",
        ),
        (
            "run: rate limit with a control character",
            vec!["run", "--webhook-rate-limits", "a\u{1b}[2J.example=1/s"],
            "OUTBOXD_WEBHOOK_RATE_LIMITS",
        ),
        (
            "run: concurrency overflow",
            vec!["run", "--concurrency", "99999999999999999999999"],
            "concurrency",
        ),
        (
            "run: batch size 0",
            vec!["run", "--batch-size", "0"],
            "batch-size",
        ),
        (
            "run: batch size too large",
            vec!["run", "--batch-size", "10001"],
            "batch-size",
        ),
        (
            "run: empty channel list",
            vec!["run", "--channels", ","],
            "channels",
        ),
        (
            "run: unknown channel",
            vec!["run", "--channels", "webhook,sms"],
            "sms",
        ),
        (
            "run: empty worker id",
            vec!["run", "--worker-id", ""],
            "worker-id",
        ),
        (
            "run: bad metrics address",
            vec!["run", "--metrics-addr", "localhost"],
            "metrics-addr",
        ),
        (
            "run: metrics address without port",
            vec!["run", "--metrics-addr", "127.0.0.1"],
            "metrics-addr",
        ),
        (
            "run: bad drain value",
            vec!["run", "--drain=maybe"],
            "drain",
        ),
        ("run: stray argument", vec!["run", "now"], "now"),
        // enqueue
        ("enqueue: no arguments", vec!["enqueue"], "--key"),
        (
            "enqueue: missing --channel",
            vec!["enqueue", "--key", "k", "--payload", "{}"],
            "--channel",
        ),
        (
            "enqueue: missing --payload",
            vec!["enqueue", "--key", "k", "--channel", "webhook"],
            "--payload",
        ),
        ("enqueue: missing value", vec!["enqueue", "--key"], "--key"),
        (
            "enqueue: unknown channel",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "sms",
                "--payload",
                "{}",
            ],
            "channel",
        ),
        (
            "enqueue: payload not JSON",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{url:",
            ],
            "payload",
        ),
        (
            "enqueue: payload file missing",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "@/nonexistent/outboxd.json",
            ],
            "payload",
        ),
        (
            "enqueue: max attempts not a number",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{}",
                "--max-attempts",
                "three",
            ],
            "max-attempts",
        ),
        (
            "enqueue: max attempts overflow",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{}",
                "--max-attempts",
                "2147483648",
            ],
            "max-attempts",
        ),
        (
            "enqueue: bad run-after",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{}",
                "--run-after",
                "2026-13-01T00:00:00Z",
            ],
            "run-after",
        ),
        (
            "enqueue: bad boolean",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{}",
                "--no-retry-ambiguous=perhaps",
            ],
            "no-retry-ambiguous",
        ),
        (
            "enqueue: unknown flag",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{}",
                "--priority",
                "1",
            ],
            "--priority",
        ),
        // status
        (
            "status: unknown flag",
            vec!["status", "--verbose"],
            "--verbose",
        ),
        (
            "status: stray argument",
            vec!["status", "webhook"],
            "webhook",
        ),
        (
            "status: not a boolean for --json",
            vec!["status", "--json=maybe"],
            "--json",
        ),
        // dead
        ("dead: limit 0", vec!["dead", "--limit", "0"], "limit"),
        ("dead: limit negative", vec!["dead", "--limit=-5"], "limit"),
        (
            "dead: limit not a number",
            vec!["dead", "--limit", "ten"],
            "limit",
        ),
        ("dead: missing limit", vec!["dead", "--limit"], "limit"),
        (
            "dead: unknown error class",
            vec!["dead", "--error-class", "x"],
            "error class",
        ),
        (
            "dead: error class in capitals",
            vec!["dead", "--error-class", "INVALID"],
            "error class",
        ),
        (
            "dead: unknown channel",
            vec!["dead", "--channel", "sms"],
            "sms",
        ),
        (
            "dead: bad since",
            vec!["dead", "--since", "yesterday"],
            "since",
        ),
        (
            "dead: since without unit",
            vec!["dead", "--since", "60"],
            "since",
        ),
        ("dead: unknown flag", vec!["dead", "--all"], "--all"),
        // show
        ("show: no target", vec!["show"], "ID|KEY"),
        ("show: two targets", vec!["show", "1", "2"], "2"),
        (
            "show: unknown flag",
            vec!["show", "1", "--history"],
            "--history",
        ),
        // replay
        ("replay: no target", vec!["replay"], "ID|KEY"),
        (
            "replay: targets and --all-dead",
            vec!["replay", "1", "--all-dead"],
            "--all-dead",
        ),
        (
            "replay: key and --all-dead",
            vec!["replay", "--all-dead", "order-1:paid"],
            "--all-dead",
        ),
        (
            "replay: filter without --all-dead",
            vec!["replay", "1", "--channel", "webhook"],
            "--all-dead",
        ),
        (
            "replay: bad since",
            vec!["replay", "--all-dead", "--since", "1y"],
            "since",
        ),
        (
            "replay: unknown error class",
            vec!["replay", "--all-dead", "--error-class", "fatal"],
            "error class",
        ),
        (
            "replay: unknown channel",
            vec!["replay", "--all-dead", "--channel", "sms"],
            "sms",
        ),
        (
            "replay: unknown flag",
            vec!["replay", "--all-dead", "--forcibly"],
            "--forcibly",
        ),
        // purge
        ("purge: no --older-than", vec!["purge"], "--older-than"),
        (
            "purge: older-than 1h",
            vec!["purge", "--older-than", "1h"],
            "older-than",
        ),
        (
            "purge: older-than 23h",
            vec!["purge", "--older-than", "23h", "--include-dead"],
            "older-than",
        ),
        (
            "purge: older-than 0s",
            vec!["purge", "--older-than", "0s"],
            "older-than",
        ),
        (
            "purge: older-than without unit",
            vec!["purge", "--older-than", "7"],
            "older-than",
        ),
        (
            "purge: missing value",
            vec!["purge", "--older-than"],
            "older-than",
        ),
        (
            "purge: stray argument",
            vec!["purge", "--older-than", "7d", "all"],
            "all",
        ),
        // Closing one and listing are two commands.
        (
            "destinations: --close with --json",
            vec!["destinations", "--close", "h.example", "--json"],
            "--json",
        ),
        // no or unknown subcommand
        ("no subcommand, a flag", vec!["--json"], "--json"),
        // Every subcommand named, the newest included.
        (
            "no subcommand",
            vec![],
            "held, approve, cancel, confirm, purge, console, destinations",
        ),
        ("unknown subcommand", vec!["drain"], "drain"),
    ];
    assert_usage_errors(UNREACHABLE_URL, &cases);
}

#[test]
fn bad_environment_values_exit_2_with_one_line() {
    let cases: Vec<(&str, &str, &str, Vec<&str>, &str)> = vec![
        ("OUTBOXD_LEASE", "forever", "run", vec![], "lease"),
        ("OUTBOXD_BATCH_SIZE", "-1", "run", vec![], "batch"),
        ("OUTBOXD_DRAIN", "sometimes", "run", vec![], "drain"),
        (
            "OUTBOXD_WORKER_ID",
            "",
            "run",
            vec!["--worker-id", ""],
            "worker-id",
        ),
        ("OUTBOXD_METRICS_ADDR", "nowhere", "run", vec![], "metrics"),
        (
            "OUTBOXD_LOG_FORMAT",
            "xml",
            "status",
            vec![],
            "OUTBOXD_LOG_FORMAT",
        ),
        ("RUST_LOG", "outboxd=[", "status", vec![], "RUST_LOG"),
        (
            "OUTBOXD_WEBHOOK_SECRET",
            "whsec_",
            "run",
            vec![],
            "OUTBOXD_WEBHOOK_SECRET",
        ),
        (
            "OUTBOXD_WEBHOOK_SECRET",
            "whsec_not base64!",
            "run",
            vec![],
            "OUTBOXD_WEBHOOK_SECRET",
        ),
    ];
    let mut failures = Vec::new();
    for (var, value, sub, extra, mention) in &cases {
        let out = run(outboxd(Some(UNREACHABLE_URL))
            .env(var, value)
            .arg(sub)
            .args(extra));
        let r = std::panic::catch_unwind(|| {
            let line = assert_one_line_exit(&format!("{var}={value:?}"), &out, 2);
            assert!(
                line.to_lowercase().contains(&mention.to_lowercase()),
                "{var}={value:?}: {line:?} should mention {mention:?}"
            );
        });
        if r.is_err() {
            failures.push(format!(
                "{var}={value:?} {sub}: {:?} {:?}",
                out.code, out.stderr
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_malformed_database_url_exits_2_for_every_command_that_connects() {
    for url in [
        "postgres://postgres@127.0.0.1:notaport/db",
        "mysql://root@127.0.0.1/db",
        "postgres://[::1/db",
        // Lists whose counts do not match: a bad setting, not a failed connection.
        "host=a,b hostaddr=10.0.0.1 user=postgres",
        "host=h1,h2,h3 port=1,2 user=postgres",
    ] {
        for args in connecting_commands() {
            let out = run(outboxd(Some(url)).args(&args));
            let line = assert_one_line_exit(&format!("{url} {args:?}"), &out, 2);
            assert!(line.contains("DATABASE_URL"), "{url} {args:?}: {line}");
        }
    }
}

/// One valid invocation of every subcommand that connects to the database.
fn connecting_commands() -> Vec<Vec<&'static str>> {
    vec![
        vec!["migrate"],
        vec![
            "enqueue",
            "--key",
            "k",
            "--channel",
            "webhook",
            "--payload",
            r#"{"url": "https://x.example"}"#,
        ],
        vec!["status"],
        vec!["status", "--json"],
        vec!["dead"],
        vec!["dead", "--json", "--limit", "1"],
        vec!["show", "1"],
        vec!["show", "some-key", "--json"],
        vec!["replay", "1"],
        vec!["replay", "--all-dead", "--dry-run"],
        vec!["purge", "--older-than", "7d"],
    ]
}

#[test]
fn an_unreachable_database_exits_1_for_every_command_that_connects() {
    for args in connecting_commands() {
        let out = run(outboxd(Some(UNREACHABLE_URL)).args(&args));
        let line = assert_one_line_exit(&format!("{args:?}"), &out, 1);
        assert!(
            line.contains("database") || line.contains("connect"),
            "{args:?}: {line}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: stdout {:?}", out.stdout);
    }
}

/// The rules only the database knows (those of `outbox.enqueue`) are bad usage too:
/// exit 2, one line naming the field, and nothing inserted.
#[tokio::test]
async fn enqueue_input_refused_by_the_database_exits_2_and_inserts_nothing() {
    let db = TestDb::new().await;
    let url = db.url();
    let cases: Vec<Case> = vec![
        (
            "max attempts 0",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                r#"{"url": "https://x.example"}"#,
                "--max-attempts",
                "0",
            ],
            "max_attempts",
        ),
        (
            "max attempts negative",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                r#"{"url": "https://x.example"}"#,
                "--max-attempts=-3",
            ],
            "max_attempts",
        ),
        (
            "empty key",
            vec![
                "enqueue",
                "--key",
                "",
                "--channel",
                "webhook",
                "--payload",
                r#"{"url": "https://x.example"}"#,
            ],
            "message_key",
        ),
        (
            "payload an array",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "[]",
            ],
            "payload",
        ),
        (
            "payload a string",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                r#""https://x.example""#,
            ],
            "payload",
        ),
        (
            "url a number",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                r#"{"url": 1}"#,
            ],
            "payload.url",
        ),
        (
            "no url",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "webhook",
                "--payload",
                "{}",
            ],
            "payload.url",
        ),
        (
            "email without to",
            vec![
                "enqueue",
                "--key",
                "k",
                "--channel",
                "email",
                "--payload",
                r#"{"text": "hi"}"#,
            ],
            "payload.to",
        ),
    ];
    let long_key = "k".repeat(256);
    let mut cases = cases;
    let long: &'static str = Box::leak(long_key.into_boxed_str());
    cases.push((
        "256-char key",
        vec![
            "enqueue",
            "--key",
            long,
            "--channel",
            "webhook",
            "--payload",
            r#"{"url": "https://x.example"}"#,
        ],
        "message_key",
    ));
    assert_usage_errors(&url, &cases);
    let n: i64 = db.scalar("SELECT count(*) FROM outbox.messages").await;
    assert_eq!(n, 0, "nothing inserted");
}

/// A `\u0000` in the payload is bad input as well; today the binary reports it as a
/// runtime failure (exit 1): "error: enqueue failed: ERROR 22P05: unsupported Unicode
/// escape sequence".
#[tokio::test]
async fn a_nul_escape_in_the_payload_exits_2_naming_the_payload() {
    let db = TestDb::new().await;
    let out = run(outboxd(Some(&db.url())).args([
        "enqueue",
        "--key",
        "k",
        "--channel",
        "webhook",
        "--payload",
        r#"{"url": "https://x.example", "body": "\u0000"}"#,
    ]));
    let line = assert_one_line_exit("NUL escape", &out, 2);
    assert!(line.contains("payload"), "{line}");
    let n: i64 = db.scalar("SELECT count(*) FROM outbox.messages").await;
    assert_eq!(n, 0);
}

/// `?tls=none` with a user name would send AUTH PLAIN (the password, base64) in clear text:
/// refused at start-up with one line that names the problem and never the password, unless
/// the relay is this machine. `--drain` on an empty database makes a worker that starts
/// exit 0 at once, so a missing refusal shows as exit 0 rather than as a hang.
#[tokio::test]
async fn smtp_credentials_in_clear_text_are_refused_unless_the_relay_is_loopback() {
    let db = TestDb::new().await;
    let url = db.url();
    for smtp in [
        "smtp://user:s3cret@mail.example.com:25?tls=none",
        "smtp://user:s3cret@192.0.2.7?tls=none",
        "smtp://user:s3cret@[2001:db8::25]:25?tls=none",
        "smtp://user@mail.example.com?tls=none",
    ] {
        let out = run(outboxd(Some(&url))
            .env("OUTBOXD_SMTP_URL", smtp)
            .args(["run", "--drain"]));
        let line = assert_one_line_exit(smtp, &out, 2);
        assert!(
            line.contains("OUTBOXD_SMTP_URL")
                && line.contains("tls=none")
                && line.contains("clear text"),
            "{smtp}: {line:?}"
        );
        assert!(
            !out.stdout.contains("s3cret") && !out.stderr.contains("s3cret"),
            "{smtp}: the password leaked: {:?} {:?}",
            out.stdout,
            out.stderr
        );
    }
    // The same credentials to a relay on this machine (Mailpit, a local Postfix): the
    // worker starts, drains the empty queue and exits 0, without printing the password.
    for smtp in [
        "smtp://user:s3cret@127.0.0.1:2525?tls=none",
        "smtp://user:s3cret@localhost:2525?tls=none",
        "smtp://user:s3cret@[::1]:2525?tls=none",
    ] {
        let out = run(outboxd(Some(&url))
            .env("OUTBOXD_SMTP_URL", smtp)
            .args(["run", "--drain"]));
        assert_eq!(
            out.code,
            Some(0),
            "{smtp}: stdout {:?}, stderr {:?}",
            out.stdout,
            out.stderr
        );
        assert!(
            out.stderr.contains("e-mail delivery through an SMTP relay"),
            "{smtp}: the e-mail channel did not start: {:?}",
            out.stderr
        );
        assert!(
            !out.stdout.contains("s3cret") && !out.stderr.contains("s3cret"),
            "{smtp}: the password leaked: {:?} {:?}",
            out.stdout,
            out.stderr
        );
    }
}

/// A variable outboxd reads whose value is not UTF-8 is refused, exit 2, with one line that
/// names the variable and not its value. Read as unset instead, a signing secret or the
/// console's token that an operator did set would be silently absent: unsigned webhooks,
/// an open console. The runs that would start a daemon get a real database and `--drain`
/// (or, for the console, a bounded run), so a variable taken as unset shows as exit 0 or a
/// run that does not end, not as a hang of the suite.
#[tokio::test]
async fn a_non_utf8_environment_value_exits_2_naming_the_variable() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt as _;
    let db = TestDb::new().await;
    let url = db.url();
    // The value's readable part, which must not be printed.
    let value = OsStr::from_bytes(b"s3cr3t-whsec_\xff\xfe");
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("OUTBOXD_WEBHOOK_SECRET", vec!["run", "--drain"]),
        ("OUTBOXD_WEBHOOK_SECRET_BILLING", vec!["run", "--drain"]),
        ("OUTBOXD_SMTP_URL", vec!["run", "--drain"]),
        ("OUTBOXD_ALLOW_PRIVATE_NETWORKS", vec!["run", "--drain"]),
        ("OUTBOXD_WEBHOOK_ALLOW_HOSTS", vec!["run", "--drain"]),
        ("OUTBOXD_EMAIL_MESSAGE_ID_DOMAIN", vec!["run", "--drain"]),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", vec!["run", "--drain"]),
        ("OTEL_EXPORTER_OTLP_HEADERS", vec!["run", "--drain"]),
        // A flag's variable, read by clap.
        ("OUTBOXD_CONCURRENCY", vec!["run", "--drain"]),
        ("RUST_LOG", vec!["status"]),
        ("OUTBOXD_LOG_FORMAT", vec!["status"]),
        // Who an operator action is recorded as.
        ("USER", vec!["replay", "1"]),
        (
            "OUTBOXD_CONSOLE_TOKEN",
            vec!["console", "--addr", "127.0.0.1:0"],
        ),
    ];
    let mut failures = Vec::new();
    for (var, args) in &cases {
        let r = std::panic::catch_unwind(|| {
            let out = common::binary::run_within(
                outboxd(Some(&url)).env(var, value).args(args),
                std::time::Duration::from_secs(10),
            );
            let line = assert_one_line_exit(var, &out, 2);
            assert!(
                line.contains(var) && line.contains("UTF-8"),
                "{var}: {line:?} should name the variable and say it is not UTF-8"
            );
            assert!(
                !out.stderr.contains("s3cr3t") && !out.stdout.contains("s3cr3t"),
                "{var}: the value was printed: {:?}",
                out.stderr
            );
        });
        if let Err(e) = r {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            failures.push(format!("{var} {args:?}: {msg}"));
        }
    }
    // DATABASE_URL itself: not "is not set".
    let out = run(outboxd(None).env("DATABASE_URL", value).arg("status"));
    let line = assert_one_line_exit("DATABASE_URL", &out, 2);
    if !(line.contains("DATABASE_URL") && line.contains("UTF-8")) || line.contains("s3cr3t") {
        failures.push(format!("DATABASE_URL: {line:?}"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let n: i64 = db.scalar("SELECT count(*) FROM outbox.messages").await;
    assert_eq!(n, 0);
}
