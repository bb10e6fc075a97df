//! The provider recipes of `docs/providers.md`, as the provider tests run them: the page's
//! own blocks (its SQL and its `outboxd endpoint set` lines, with the provider's address
//! swapped for a stand-in's), so the page and the tests cannot drift apart; and the check
//! that a credential reached the provider and nothing else.

#![allow(dead_code, clippy::unwrap_used)]

use super::TestDb;
use super::binary::{Output, outboxd, run_within};
use std::time::Duration;

/// The fenced blocks `(info, text)` of the section of `docs/providers.md` whose heading
/// starts with `## {heading}`, up to the next `## `.
pub fn recipe(heading: &str) -> Vec<(String, String)> {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/providers.md"),
    )
    .unwrap();
    let start = format!("## {heading}");
    let mut inside = false;
    let mut blocks = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in page.lines() {
        if let Some((_, text)) = open.as_mut() {
            if line.trim_end() == "```" {
                blocks.push(open.take().unwrap());
            } else {
                text.push_str(line);
                text.push('\n');
            }
            continue;
        }
        if line.starts_with("## ") {
            inside = line.starts_with(&start);
            continue;
        }
        if inside {
            if let Some(info) = line.strip_prefix("```") {
                open = Some((info.trim().to_owned(), String::new()));
            }
        }
    }
    assert!(!blocks.is_empty(), "no blocks under ## {heading}");
    blocks
}

/// The text of the recipe's blocks fenced `info` (`sql`, `sh`), each with `swaps` applied.
pub fn blocks(heading: &str, info: &str, swaps: &[(&str, &str)]) -> Vec<String> {
    recipe(heading)
        .into_iter()
        .filter(|(i, _)| i == info)
        .map(|(_, text)| swap(&text, swaps))
        .collect()
}

/// `text` with each `(from, to)` replaced; each `from` must be there (a recipe that changed
/// under the test fails here, not later in a puzzling way).
pub fn swap(text: &str, swaps: &[(&str, &str)]) -> String {
    let mut out = text.to_owned();
    for (from, to) in swaps {
        assert!(out.contains(from), "{from:?} is not in the recipe:\n{text}");
        out = out.replace(from, to);
    }
    out
}

/// Runs the SQL of a recipe's block, statement group by statement group (groups are
/// separated by a blank line), skipping the groups that set the endpoint when `skip_endpoint`
/// (it was set from the command line instead).
pub async fn run_sql(db: &TestDb, sql: &str, skip_endpoint: bool) {
    let c = db.client().await;
    for group in sql.split("\n\n").filter(|g| !g.trim().is_empty()) {
        if skip_endpoint
            && (group.contains("outbox.set_endpoint") || group.contains("outbox.endpoints"))
        {
            continue;
        }
        c.batch_execute(group)
            .await
            .unwrap_or_else(|e| panic!("the recipe's SQL fails: {e:?}\n{group}"));
    }
}

/// Runs the `outboxd endpoint set …` command of a recipe's `sh` block with the real binary
/// (a line ending in `\` goes on on the next).
pub async fn run_endpoint_set(db: &TestDb, sh: &str) -> Output {
    let joined = sh.replace("\\\n", " ");
    let line = joined
        .lines()
        .find(|l| l.trim_start().starts_with("outboxd endpoint set"))
        .unwrap_or_else(|| panic!("no `outboxd endpoint set` in:\n{sh}"));
    let args: Vec<String> = line.split_whitespace().skip(1).map(str::to_owned).collect();
    let mut cmd = outboxd(Some(&db.url()));
    cmd.args(&args);
    let out = tokio::task::spawn_blocking(move || run_within(&mut cmd, Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(out.code, Some(0), "{line}: {}", out.stderr);
    out
}

/// Runs a one-shot `outboxd ARGS…` on `db`; its stdout (it must exit 0).
pub async fn cli(db: &TestDb, args: &[&str]) -> String {
    let mut cmd = outboxd(Some(&db.url()));
    cmd.args(args);
    let what = args.join(" ");
    let out = tokio::task::spawn_blocking(move || run_within(&mut cmd, Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(out.code, Some(0), "outboxd {what}: {}", out.stderr);
    out.stdout
}

/// Where a secret must not be: everything the daemon printed (`daemon`, run at trace
/// level), its `/metrics`, every column of `outbox.messages` and `outbox.attempts`, and
/// `outboxd show --json` of each of `keys`. When `endpoint_holds_it` (a Slack webhook's
/// URL, named as an endpoint's), it must be in `outbox.endpoints` and in `outboxd endpoint
/// list --json`, where the operator put it; otherwise in neither.
pub async fn assert_nowhere(
    db: &TestDb,
    daemon: &Output,
    metrics: &str,
    keys: &[&str],
    secret: &str,
    endpoint_holds_it: bool,
) {
    let check = |what: &str, text: &str| {
        assert!(
            !text.contains(secret),
            "the secret {secret:?} is in {what}:\n{text}"
        );
    };
    // At trace level a run logs plenty; an empty log would make the check below hollow.
    assert!(
        daemon.stderr.contains("TRACE") || daemon.stderr.contains("DEBUG"),
        "the daemon was not run at its most verbose: {}",
        daemon.stderr
    );
    check("the daemon's stderr", &daemon.stderr);
    check("the daemon's stdout", &daemon.stdout);
    assert!(metrics.contains("outboxd_deliveries_total"), "{metrics}");
    check("/metrics", metrics);
    let c = db.client().await;
    for (what, sql) in [
        (
            "an outbox.messages row",
            "SELECT to_jsonb(m)::text FROM outbox.messages m",
        ),
        (
            "an outbox.attempts row",
            "SELECT to_jsonb(a)::text FROM outbox.attempts a",
        ),
    ] {
        for row in c.query(sql, &[]).await.unwrap() {
            check(what, row.get(0));
        }
    }
    for key in keys {
        let shown = cli(db, &["show", *key, "--json"]).await;
        assert!(shown.contains("\"state\""), "{shown}");
        check(&format!("outboxd show {key} --json"), &shown);
    }
    let endpoints: Vec<String> = c
        .query("SELECT to_jsonb(e)::text FROM outbox.endpoints e", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let listed = cli(db, &["endpoint", "list", "--json"]).await;
    if endpoint_holds_it {
        assert!(
            endpoints.iter().any(|e| e.contains(secret)),
            "the secret {secret:?} is in no outbox.endpoints row: {endpoints:?}"
        );
        assert!(
            listed.contains(secret),
            "outboxd endpoint list --json hides {secret:?} from the operator: {listed}"
        );
    } else {
        for e in &endpoints {
            check("an outbox.endpoints row", e);
        }
        check("outboxd endpoint list --json", &listed);
    }
}

/// The attempt rows of a message as `(outcome, error_class)`.
pub async fn history(db: &TestDb, key: &str) -> Vec<(String, Option<String>)> {
    super::attempts(db, key)
        .await
        .into_iter()
        .map(|a| (a.1, a.2))
        .collect()
}

/// `(outcome, class)` pairs for comparing with [`history`].
pub fn h(rows: &[(&str, Option<&str>)]) -> Vec<(String, Option<String>)> {
    rows.iter()
        .map(|(o, c)| ((*o).to_owned(), c.map(str::to_owned)))
        .collect()
}
