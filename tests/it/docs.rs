//! The documentation stays true: every relative link of README.md, ARCHITECTURE.md and
//! `docs/` names a file that exists (and a heading, where it names one), and every ```sql
//! block of README.md and `docs/` runs against a fresh database, page by page in order, as a
//! newcomer would paste them. The Rust blocks are compiled by `cargo test --doc`, through the
//! doctest includes in `src/lib.rs`; this module checks that every page with one is included.
//!
//! A block fenced as ```sql no-run is shown, not run: keep those few, and say why beside them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::common::TestDb;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page under `docs/` (the pages whose snippets must work).
fn user_pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    pages.extend(crate::common::files_under(&root().join("docs"), "md"));
    pages
}

fn rel(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A fenced block: its info string, its first line's number, its text.
struct Block {
    info: String,
    line: usize,
    text: String,
}

/// The fenced blocks of a page, and its prose lines (outside blocks) with their numbers.
fn split(markdown: &str) -> (Vec<Block>, Vec<(usize, String)>) {
    let mut blocks = Vec::new();
    let mut prose = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in markdown.lines().enumerate() {
        let number = i + 1;
        let trimmed = line.trim_start();
        match open.as_mut() {
            Some(block) => {
                if trimmed.starts_with("```") && trimmed.trim_end() == "```" {
                    blocks.push(open.take().unwrap());
                } else {
                    block.text.push_str(line);
                    block.text.push('\n');
                }
            }
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    open = Some(Block {
                        info: info.trim().to_string(),
                        line: number + 1,
                        text: String::new(),
                    });
                } else {
                    prose.push((number, line.to_string()));
                }
            }
        }
    }
    assert!(open.is_none(), "a fenced block is never closed");
    (blocks, prose)
}

/// The line without its inline code spans (`…`), which may hold text that looks like a link.
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// The targets of the inline links and images of one line: `[text](target)`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut targets = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        let target = after[..end].split_whitespace().next().unwrap_or("");
        targets.push(target.to_string());
        rest = &after[end..];
    }
    targets
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a page's headings (a repeated heading's later ones with `-1`, `-2`, …).
fn anchors(markdown: &str) -> BTreeSet<String> {
    let (_, prose) = split(markdown);
    let mut seen = BTreeSet::new();
    for (_, line) in prose {
        let Some(text) = line.strip_prefix('#') else {
            continue;
        };
        let text = text.trim_start_matches('#');
        if !text.starts_with(' ') {
            continue;
        }
        let base = slug(text);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The path with its `.` and `..` resolved, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn is_external(target: &str) -> bool {
    target.contains("://") || target.starts_with("mailto:")
}

#[test]
fn every_relative_link_resolves() {
    let mut pages = user_pages();
    pages.push(root().join("ARCHITECTURE.md"));
    let mut problems = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let (_, prose) = split(&text);
        for (number, line) in prose {
            for target in link_targets(&line) {
                if target.is_empty() || is_external(&target) {
                    continue;
                }
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target.as_str(), None),
                };
                let file = if path.is_empty() {
                    page.clone()
                } else {
                    normalize(&page.parent().unwrap().join(path))
                };
                let where_ = format!("{}:{number}: ({target})", rel(page));
                if !file.exists() {
                    problems.push(format!("{where_}: no such file"));
                    continue;
                }
                if let Some(anchor) = anchor {
                    if file.extension().is_some_and(|e| e == "md") {
                        let headings = anchors(&std::fs::read_to_string(&file).unwrap());
                        if !headings.contains(anchor) {
                            problems.push(format!(
                                "{where_}: no heading for #{anchor} (there are: {})",
                                headings.into_iter().collect::<Vec<_>>().join(", ")
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the parser blind?"
    );
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_link_parser_reads_what_markdown_means() {
    assert_eq!(
        link_targets("see [a](docs/a.md#x) and ![b](b.png), not `[c](c.md)`"),
        ["docs/a.md#x", "b.png"]
    );
    assert_eq!(slug("`outboxd run` flags"), "outboxd-run-flags");
    assert_eq!(
        slug("Reconciliation: look before sending again"),
        "reconciliation-look-before-sending-again"
    );
    let (blocks, prose) = split("a\n```sql no-run\nSELECT 1;\n```\nb\n");
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].info, "sql no-run");
    assert_eq!(blocks[0].line, 3);
    assert_eq!(prose.len(), 2);
    let headings = anchors("# T\n## A b\n```sh\n# not a heading\n```\n## A b\n");
    assert_eq!(
        headings.into_iter().collect::<Vec<_>>(),
        ["a-b", "a-b-1", "t"]
    );
}

/// Whether a block is SQL to run: fenced `sql`, without `no-run`.
fn runnable_sql(info: &str) -> bool {
    let mut words = info.split([' ', ',']).filter(|w| !w.is_empty());
    words.next() == Some("sql") && !words.any(|w| w == "no-run")
}

#[tokio::test]
async fn every_sql_block_runs_on_a_fresh_database() {
    let mut problems = Vec::new();
    let mut ran = 0;
    for page in user_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let (blocks, _) = split(&text);
        let sql: Vec<_> = blocks.iter().filter(|b| runnable_sql(&b.info)).collect();
        if sql.is_empty() {
            continue;
        }
        // One database per page: a page's blocks build on each other, in order.
        let db = TestDb::new().await;
        let client = db.client().await;
        for block in sql {
            ran += 1;
            if let Err(e) = client.batch_execute(&block.text).await {
                let detail = e
                    .as_db_error()
                    .map(|d| format!("{}: {}", d.code().code(), d.message()))
                    .unwrap_or_else(|| e.to_string());
                problems.push(format!("{}:{}: {detail}", rel(&page), block.line));
                break;
            }
        }
        drop(client);
    }
    assert!(ran >= 10, "only {ran} SQL blocks ran: is the parser blind?");
    assert!(
        problems.is_empty(),
        "SQL blocks that fail (a page stops at its first failure):\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_page_with_rust_is_compiled_by_the_doctests() {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let mut missing = Vec::new();
    for page in user_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let (blocks, _) = split(&text);
        let untagged = blocks.iter().find(|b| b.info.is_empty());
        if let Some(block) = untagged {
            // rustdoc compiles an untagged block as Rust: say what it is.
            missing.push(format!(
                "{}:{}: a fenced block without a language",
                rel(&page),
                block.line
            ));
        }
        let has_rust = blocks.iter().any(|b| b.info.starts_with("rust"));
        let include = format!("include_str!(\"../{}\")", rel(&page));
        if has_rust && !lib.contains(&include) {
            missing.push(format!(
                "{}: has Rust blocks, but src/lib.rs has no #[doc = {include}]",
                rel(&page)
            ));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
