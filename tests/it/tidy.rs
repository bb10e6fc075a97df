//! Tidy: the architecture invariants of `ARCHITECTURE.md`, checked by reading the source tree
//! (rust-analyzer's `tidy` is the model). Each failure names the file and line.
//!
//! The scanner is deliberately simple: it strips `//` comments, knows `"…"` and `r#"…"#`
//! literals, and treats everything from a `#[cfg(test)]` line to the end of the file as test
//! code (test modules sit at the end of their file in this crate).

use std::path::PathBuf;

/// `.unwrap()` / `.expect(` kept in non-test code of `src/`: (file, text on the line, why it
/// cannot fail). Empty today: every one outside `#[cfg(test)]` was replaced by handling.
const ALLOWED_UNWRAPS: &[(&str, &str, &str)] = &[];

/// Known exceptions to "the lease module imports nothing from `crate::deliver`": (file, text
/// on the line). None: the insert names where a message goes, the claim returns the names,
/// and the worker reads a claimed payload (`worker::attempt::Job`).
const KNOWN_DELIVER_IMPORTS_IN_LEASE: &[(&str, &str)] = &[];

/// The longest a file under `src/` may be, in lines: past it, a file holds more than one
/// concern and is split into rooms named by noun.
const MAX_LINES: usize = 700;

/// Known exceptions to "delivery does not import `crate::config`": none since each channel
/// owns its settings (`deliver/*/settings.rs`); kept as a list so that a reviewer sees any
/// new one.
const KNOWN_CONFIG_IMPORTS_IN_DELIVER: &[(&str, &str)] = &[];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One source file as lines: the code of each line (comments and literals blanked) and the
/// string literals that start on it, and whether the line is test code.
struct Line {
    number: usize,
    text: String,
    code: String,
    literals: Vec<String>,
    test: bool,
}

struct Source {
    rel: String,
    lines: Vec<Line>,
}

fn sources(under: &str) -> Vec<Source> {
    let mut files = Vec::new();
    files.extend(crate::common::files_under(&root().join(under), "rs"));
    files
        .iter()
        .map(|p| {
            let rel = p
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            Source {
                rel,
                lines: scan(&std::fs::read_to_string(p).unwrap()),
            }
        })
        .collect()
}

fn scan(text: &str) -> Vec<Line> {
    let chars: Vec<char> = text.chars().collect();
    let mut lines = Vec::new();
    let mut code = String::new();
    let mut literals: Vec<String> = Vec::new();
    let mut current_line = 1usize;

    let mut raw_text = String::new();
    let mut in_test = false;
    let mut i = 0;
    let push_line = |lines: &mut Vec<Line>,
                     raw: &mut String,
                     code: &mut String,
                     lits: &mut Vec<String>,
                     n: usize,
                     in_test: &mut bool| {
        if raw.trim_start().starts_with("#[cfg(test)]") {
            *in_test = true;
        }
        lines.push(Line {
            number: n,
            text: std::mem::take(raw),
            code: std::mem::take(code),
            literals: std::mem::take(lits),
            test: *in_test,
        });
    };
    let mut pending_literals: Vec<(usize, String)> = Vec::new();
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            let mut mine: Vec<String> = Vec::new();
            pending_literals.retain(|(n, s)| {
                if *n == current_line {
                    mine.push(s.clone());
                    false
                } else {
                    true
                }
            });
            literals.extend(mine);
            push_line(
                &mut lines,
                &mut raw_text,
                &mut code,
                &mut literals,
                current_line,
                &mut in_test,
            );
            current_line += 1;
            i += 1;
            continue;
        }
        if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                raw_text.push(chars[i]);
                i += 1;
            }
            continue;
        }
        // Character literals such as '"' must not open a string.
        if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            for k in 0..3 {
                raw_text.push(chars[i + k]);
            }
            code.push_str("' '");
            i += 3;
            continue;
        }
        if c == '\'' && chars.get(i + 1) == Some(&'\\') && chars.get(i + 3) == Some(&'\'') {
            for k in 0..4 {
                raw_text.push(chars[i + k]);
            }
            code.push_str("' '");
            i += 4;
            continue;
        }
        let raw_start = c == 'r'
            && (chars.get(i + 1) == Some(&'"') || chars.get(i + 1) == Some(&'#'))
            && (i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_'));
        if c == '"' || raw_start {
            let literal_line = current_line;
            let mut hashes = 0;
            let raw = raw_start;
            if raw {
                raw_text.push('r');
                i += 1;
                while chars.get(i) == Some(&'#') {
                    hashes += 1;
                    raw_text.push('#');
                    i += 1;
                }
                if chars.get(i) != Some(&'"') {
                    code.push('r');
                    continue;
                }
            }
            raw_text.push('"');
            i += 1;
            let mut lit = String::new();
            while i < chars.len() {
                let ch = chars[i];
                if !raw && ch == '\\' {
                    lit.push(ch);
                    raw_text.push(ch);
                    if let Some(&n) = chars.get(i + 1) {
                        lit.push(n);
                        if n == '\n' {
                            push_line(
                                &mut lines,
                                &mut raw_text,
                                &mut code,
                                &mut literals,
                                current_line,
                                &mut in_test,
                            );
                            current_line += 1;
                        } else {
                            raw_text.push(n);
                        }
                    }
                    i += 2;
                    continue;
                }
                if ch == '"' && (0..hashes).all(|k| chars.get(i + 1 + k) == Some(&'#')) {
                    raw_text.push('"');
                    i += 1 + hashes;
                    break;
                }
                lit.push(ch);
                if ch == '\n' {
                    push_line(
                        &mut lines,
                        &mut raw_text,
                        &mut code,
                        &mut literals,
                        current_line,
                        &mut in_test,
                    );
                    current_line += 1;
                } else {
                    raw_text.push(ch);
                }
                i += 1;
            }
            code.push_str("\"\"");
            pending_literals.push((literal_line, lit));
            continue;
        }
        code.push(c);
        raw_text.push(c);
        i += 1;
    }
    for (_, s) in pending_literals.drain(..) {
        literals.push(s);
    }
    push_line(
        &mut lines,
        &mut raw_text,
        &mut code,
        &mut literals,
        current_line,
        &mut in_test,
    );
    // A literal is reported on the line it starts on.
    lines
}

/// Why a string literal looks like SQL, if it does.
fn sql_in(lit: &str) -> Option<&'static str> {
    let words: Vec<&str> = lit
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',')
        .filter(|w| !w.is_empty())
        .collect();
    let upper = |w: &str| w.chars().all(|c| c.is_ascii_uppercase());
    let ident = |w: &str| {
        let w = w.trim_end_matches(';');
        !w.is_empty()
            && w.contains('_')
            && w.chars()
                .all(|c| c.is_ascii_lowercase() || c == '_' || c == '"' || c.is_ascii_digit())
    };
    if lit.contains("pg_advisory") {
        return Some("pg_advisory");
    }
    if lit.contains("outbox.") && words.iter().any(|w| ["FROM", "INTO", "JOIN"].contains(w)) {
        return Some("a statement on the outbox schema");
    }
    for (k, w) in words.iter().enumerate() {
        let next = words.get(k + 1).copied().unwrap_or("");
        let hit = match *w {
            "SELECT" => {
                !next.is_empty()
                    && (next.chars().all(|c| c.is_ascii_digit())
                        || next == "*"
                        || next.contains('(')
                        || next.contains('.')
                        || words.contains(&"FROM"))
            }
            "INSERT" => next == "INTO",
            "DELETE" => next == "FROM",
            "UPDATE" => words[k..].contains(&"SET"),
            "LISTEN" | "UNLISTEN" | "NOTIFY" => ident(next) || next == "*",
            "BEGIN" | "COMMIT" | "ROLLBACK" => {
                words.len() == 1
                    || next.starts_with(';')
                    || ["TRANSACTION", "ISOLATION", "WORK"].contains(&next)
                    || w.ends_with(';')
            }
            "CREATE" | "DROP" | "ALTER" | "TRUNCATE" => {
                [
                    "TABLE",
                    "FUNCTION",
                    "INDEX",
                    "DATABASE",
                    "SCHEMA",
                    "TRIGGER",
                    "ROLE",
                    "EXTENSION",
                ]
                .contains(&next)
                    || *w == "TRUNCATE" && ident(next)
            }
            "SET" => {
                k == 0
                    && (words.get(k + 2) == Some(&"=")
                        || ["LOCAL", "SESSION", "ROLE"].contains(&next))
            }
            _ => false,
        };
        if hit && upper(w) {
            return Some(match *w {
                "SELECT" => "SELECT",
                "INSERT" => "INSERT INTO",
                "DELETE" => "DELETE FROM",
                "UPDATE" => "UPDATE … SET",
                "LISTEN" => "LISTEN",
                "UNLISTEN" => "UNLISTEN",
                "NOTIFY" => "NOTIFY",
                "BEGIN" => "BEGIN",
                "COMMIT" => "COMMIT",
                "ROLLBACK" => "ROLLBACK",
                "SET" => "SET",
                _ => "DDL",
            });
        }
    }
    None
}

fn report(problems: &[String], what: &str) {
    assert!(problems.is_empty(), "{what}:\n{}", problems.join("\n"));
}

/// (a) No SQL text outside `src/queries/` (and `sql/`).
#[test]
fn sql_lives_in_queries_rs() {
    let mut problems = Vec::new();
    for src in sources("src") {
        if src.rel.starts_with("src/queries/") {
            continue;
        }
        for line in &src.lines {
            for lit in &line.literals {
                if let Some(why) = sql_in(lit) {
                    problems.push(format!(
                        "{}:{}: SQL text ({why}) in a string literal: move the statement into src/queries/ with a doc comment stating its contract\n    {}",
                        src.rel, line.number, line.text.trim()
                    ));
                }
            }
        }
    }
    report(&problems, "SQL outside src/queries/");
}

/// The scanner itself: what it flags and what it lets through.
#[test]
fn sql_detector_knows_statements_from_prose() {
    for sql in [
        "SELECT 1",
        "INSERT INTO outbox.messages (a) VALUES (1)",
        "DELETE FROM x",
        "UPDATE outbox.messages SET state = 'dead'",
        "LISTEN outbox_messages",
        "SELECT pg_advisory_lock(1)",
        "BEGIN",
        "SET jit = off",
        "select count(*) FROM outbox.messages",
    ] {
        assert!(sql_in(sql).is_some(), "{sql} is SQL");
    }
    for prose in [
        "LISTEN connection failed",
        "LISTEN failed",
        "cannot begin",
        "SELECT the channels",
        "update the row",
    ] {
        assert!(sql_in(prose).is_none(), "{prose} is not SQL");
    }
}

fn uses(code: &str, path: &str) -> bool {
    code.match_indices(path).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + path.len()..].chars().next();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
            && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

/// (b) Delivery code never touches the database.
#[test]
fn delivery_has_no_database_import() {
    let mut problems = Vec::new();
    for src in sources("src/deliver") {
        for line in &src.lines {
            for path in [
                "tokio_postgres",
                "deadpool_postgres",
                "deadpool",
                "postgres_types",
                "crate::queries",
                "crate::claim",
                "crate::db",
            ] {
                if uses(&line.code, path) {
                    problems.push(format!("{}:{}: `{path}` in delivery code (it never touches SQL and holds no transaction)\n    {}", src.rel, line.number, line.text.trim()));
                }
            }
        }
    }
    report(&problems, "database imports under src/deliver/");
}

/// (c) No `.unwrap()` / `.expect(` in `src/` outside test modules, except the allow-list.
#[test]
fn no_unwrap_outside_tests() {
    let mut problems = Vec::new();
    for src in sources("src") {
        for line in src.lines.iter().filter(|l| !l.test) {
            if !(line.code.contains(".unwrap()") || line.code.contains(".expect(")) {
                continue;
            }
            let allowed = ALLOWED_UNWRAPS
                .iter()
                .any(|(f, text, _)| *f == src.rel && line.text.contains(text));
            if !allowed {
                problems.push(format!("{}:{}: `.unwrap()`/`.expect(` outside a test module: handle the error, or, when it provably cannot fail, add an entry to ALLOWED_UNWRAPS in tests/tidy.rs saying why\n    {}", src.rel, line.number, line.text.trim()));
            }
        }
    }
    report(&problems, "unwrap/expect in src/");
}

/// (d) A released migration never changes: every `sql/NNNN_*.sql` file of the newest release
/// tag (`v*`) is in the tree as it was released, so that the checksum every installed
/// database recorded still matches. Before the first tag nothing is released, and the
/// unreleased files may still be squashed into the baseline. The tags are read from the
/// repository the tree is in; a tree without git (an unpacked archive) checks nothing.
#[test]
fn released_migrations_are_immutable() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(root())
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let Some(tags) = git(&["tag", "--list", "v*", "--sort=-version:refname"]) else {
        eprintln!("tidy: no git repository: released migrations not checked");
        return;
    };
    let Some(tag) = tags.lines().next() else {
        return;
    };
    let listed = git(&["ls-tree", "--name-only", &format!("{tag}:sql")]).unwrap_or_default();
    let mut problems = Vec::new();
    for name in listed
        .lines()
        .filter(|n| n.ends_with(".sql") && n.as_bytes().first().is_some_and(u8::is_ascii_digit))
    {
        let released = git(&["show", &format!("{tag}:sql/{name}")]).unwrap_or_default();
        match std::fs::read_to_string(root().join("sql").join(name)) {
            Ok(now) if now == released => {}
            Ok(_) => problems.push(format!("sql/{name}:1: released in {tag}, and changed since: restore it and put the change in a new numbered file")),
            Err(e) => problems.push(format!("sql/{name}:1: released in {tag}, and gone: {e}")),
        }
    }
    report(&problems, "migrations");
}

/// (e) The import direction: vocabulary (model) → channels (deliver) → worker → cli.
#[test]
fn imports_point_one_way() {
    let mut problems = Vec::new();
    for line in &scan(&std::fs::read_to_string(root().join("src/model.rs")).unwrap()) {
        if uses(&line.code, "crate") || uses(&line.code, "super") {
            problems.push(format!(
                "src/model.rs:{}: the vocabulary imports nothing of the crate\n    {}",
                line.number,
                line.text.trim()
            ));
        }
    }
    let mut tolerated = Vec::new();
    for src in sources("src/deliver") {
        for line in &src.lines {
            for path in [
                "crate::worker",
                "crate::cli",
                "crate::config",
                "crate::main",
            ] {
                if !uses(&line.code, path) {
                    continue;
                }
                let known = path == "crate::config"
                    && KNOWN_CONFIG_IMPORTS_IN_DELIVER
                        .iter()
                        .any(|(f, t)| *f == src.rel && line.text.contains(t));
                let msg = format!(
                    "{}:{}: `{path}` in delivery code (deliver sits below the worker, the cli and the config)\n    {}",
                    src.rel,
                    line.number,
                    line.text.trim()
                );
                if known {
                    tolerated.push(msg);
                } else {
                    problems.push(msg);
                }
            }
        }
    }
    if !tolerated.is_empty() {
        eprintln!(
            "tidy: tolerated (KNOWN_CONFIG_IMPORTS_IN_DELIVER, to be emptied):\n{}",
            tolerated.join("\n")
        );
    }
    if tolerated.len() < KNOWN_CONFIG_IMPORTS_IN_DELIVER.len() {
        eprintln!(
            "tidy: some KNOWN_CONFIG_IMPORTS_IN_DELIVER entries no longer match: remove them from tests/tidy.rs"
        );
    }
    report(&problems, "import direction");
}

/// (f) The console: every value reaches a page through maud's escaping (no `PreEscaped`,
/// the one way around it), it holds no database handle of its own beyond a pooled client
/// handed to `ops` and `status` (no `crate::queries`, no `query`/`execute` calls), and it
/// sits below the cli.
#[test]
fn the_console_escapes_everything_and_holds_no_sql() {
    let mut problems = Vec::new();
    for src in sources("src/console") {
        for line in &src.lines {
            for (needle, why) in [
                ("PreEscaped", "unescaped HTML in the console"),
                (
                    "crate::queries",
                    "the console calls ops and status, not statements",
                ),
                (
                    ".query(",
                    "the console calls ops and status, not statements",
                ),
                (
                    ".query_typed(",
                    "the console calls ops and status, not statements",
                ),
                (
                    ".execute(",
                    "the console calls ops and status, not statements",
                ),
                ("crate::cli", "the console sits below the cli"),
                ("crate::worker", "the console does not run the worker"),
            ] {
                if line.code.contains(needle) {
                    problems.push(format!(
                        "{}:{}: `{needle}`: {why}\n    {}",
                        src.rel,
                        line.number,
                        line.text.trim()
                    ));
                }
            }
        }
    }
    report(&problems, "the console's invariants");
}

/// (g) No file under `src/` is longer than [`MAX_LINES`].
#[test]
fn no_file_is_over_the_line_limit() {
    let mut files = Vec::new();
    files.extend(crate::common::files_under(&root().join("src"), "rs"));
    let mut problems = Vec::new();
    for p in files {
        let n = std::fs::read_to_string(&p).unwrap().lines().count();
        if n > MAX_LINES {
            let rel = p
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            problems.push(format!(
                "{rel}:{n}: {n} lines, over {MAX_LINES}: split it along its concerns, one room each"
            ));
        }
    }
    report(&problems, "files over the line limit");
}

/// (h) The lease (`src/claim.rs`, or `src/claim/`) imports nothing from `crate::deliver`:
/// claiming and fencing rows is below the channels, which read their own payloads.
#[test]
fn the_lease_imports_no_channel() {
    let mut problems = Vec::new();
    let mut tolerated = 0;
    for src in sources("src") {
        if !(src.rel == "src/claim.rs" || src.rel.starts_with("src/claim/")) {
            continue;
        }
        for line in &src.lines {
            if !uses(&line.code, "crate::deliver") {
                continue;
            }
            let known = KNOWN_DELIVER_IMPORTS_IN_LEASE
                .iter()
                .any(|(f, t)| *f == src.rel && line.text.contains(t));
            if known {
                tolerated += 1;
            } else {
                problems.push(format!(
                    "{}:{}: `crate::deliver` in the lease (the lease knows rows and tokens, not channels)\n    {}",
                    src.rel,
                    line.number,
                    line.text.trim()
                ));
            }
        }
    }
    if tolerated < KNOWN_DELIVER_IMPORTS_IN_LEASE.len() {
        problems.push(
            "tests/it/tidy.rs:1: some KNOWN_DELIVER_IMPORTS_IN_LEASE entries no longer match: remove them"
                .to_owned(),
        );
    }
    report(&problems, "channel imports in the lease");
}

/// The module a file under `src/` is: `src/lib.rs` the crate root, `src/a.rs` and
/// `src/a/mod.rs` the module `a`, `src/a/b.rs` the module `a::b`. `None` for the binary
/// (`src/main.rs`), which reaches the library by its name, not by `crate::`.
fn module_of(rel: &str) -> Option<Vec<String>> {
    let path = rel.strip_prefix("src/")?.strip_suffix(".rs")?;
    let mut segs: Vec<String> = path.split('/').map(str::to_owned).collect();
    match segs.last().map(String::as_str) {
        Some("main") if segs.len() == 1 => return None,
        Some("lib") if segs.len() == 1 => segs.clear(),
        Some("mod") => {
            segs.pop();
        }
        _ => {}
    }
    Some(segs)
}

/// The paths a path at `i` of `code` names, groups expanded: `super::{a, b::{c, d}}` names
/// `super::a`, `super::b::c` and `super::b::d`. Reads identifiers, `::` and braces, and
/// stops at anything else (`*`, ` as `, `(`).
fn path_tree(code: &[char], i: &mut usize) -> Vec<Vec<String>> {
    let skip_ws = |i: &mut usize| {
        while code.get(*i).is_some_and(|c| c.is_whitespace()) {
            *i += 1;
        }
    };
    let mut segs: Vec<String> = Vec::new();
    loop {
        skip_ws(i);
        if code.get(*i) == Some(&'{') {
            *i += 1;
            let mut out = Vec::new();
            loop {
                skip_ws(i);
                if code.get(*i) == Some(&'}') {
                    *i += 1;
                    break;
                }
                for sub in path_tree(code, i) {
                    out.push([segs.clone(), sub].concat());
                }
                skip_ws(i);
                match code.get(*i) {
                    Some(',') => *i += 1,
                    Some('}') => {
                        *i += 1;
                        break;
                    }
                    _ => break,
                }
            }
            return out;
        }
        let start = *i;
        while code
            .get(*i)
            .is_some_and(|c| c.is_alphanumeric() || *c == '_')
        {
            *i += 1;
        }
        if *i == start {
            break;
        }
        segs.push(code[start..*i].iter().collect());
        if code.get(*i) == Some(&':') && code.get(*i + 1) == Some(&':') {
            *i += 2;
        } else {
            break;
        }
    }
    vec![segs]
}

/// Which modules of the crate each module imports, with the first place it does: every
/// `crate::…` and `super::…` path (groups expanded) in code outside test modules, taken to
/// the longest module it names. Paths between a module and its ancestors are left out (a
/// parent declares and re-exports its rooms, a room uses its parent's shared items), and
/// so are relative paths (`self::…`, a child's name), which can only reach descendants.
/// An inline module other than the tests is read as part of its file.
fn module_imports() -> std::collections::BTreeMap<Vec<String>, Vec<(Vec<String>, String)>> {
    let all: Vec<(Vec<String>, Source)> = sources("src")
        .into_iter()
        .filter_map(|s| Some((module_of(&s.rel)?, s)))
        .collect();
    let known: std::collections::BTreeSet<Vec<String>> =
        all.iter().map(|(m, _)| m.clone()).collect();
    let mut edges = std::collections::BTreeMap::new();
    for (module, src) in &all {
        let mut code: Vec<char> = Vec::new();
        let mut line_of: Vec<usize> = Vec::new();
        for line in src.lines.iter().filter(|l| !l.test) {
            for c in line.code.chars().chain(std::iter::once('\n')) {
                code.push(c);
                line_of.push(line.number);
            }
        }
        let mut targets: Vec<(Vec<String>, String)> = Vec::new();
        for start in 0..code.len() {
            let head: String = code[start..code.len().min(start + 7)].iter().collect();
            let after_path_char = start > 0
                && (code[start - 1].is_alphanumeric()
                    || code[start - 1] == '_'
                    || code[start - 1] == ':');
            if after_path_char || !(head == "crate::" || head.starts_with("super::")) {
                continue;
            }
            let mut i = start;
            for path in path_tree(&code, &mut i) {
                let mut full: Vec<String> = Vec::new();
                let mut rest = path.as_slice();
                if rest.first().is_some_and(|s| s == "crate") {
                    rest = &rest[1..];
                } else {
                    full = module.clone();
                    while rest.first().is_some_and(|s| s == "super") {
                        full.pop();
                        rest = &rest[1..];
                    }
                }
                full.extend(rest.iter().cloned());
                let Some(target) = (0..=full.len())
                    .rev()
                    .map(|n| full[..n].to_vec())
                    .find(|m| known.contains(m))
                else {
                    continue;
                };
                let related = target.starts_with(module) || module.starts_with(&target);
                if related || targets.iter().any(|(t, _)| *t == target) {
                    continue;
                }
                targets.push((target, format!("{}:{}", src.rel, line_of[start])));
            }
        }
        edges.insert(module.clone(), targets);
    }
    edges
}

/// (i) No import circle between the modules of `src/` (two modules that import each other
/// included), at module granularity as [`module_imports`] reads them: the imports run one
/// way, so each room can be read knowing only what is below it.
#[test]
fn no_import_circle() {
    let edges = module_imports();
    let name = |m: &Vec<String>| {
        if m.is_empty() {
            "crate".to_owned()
        } else {
            m.join("::")
        }
    };
    // Depth-first search; a module met again while on the current path closes a circle.
    fn visit(
        m: &Vec<String>,
        edges: &std::collections::BTreeMap<Vec<String>, Vec<(Vec<String>, String)>>,
        done: &mut std::collections::BTreeSet<Vec<String>>,
        path: &mut Vec<(Vec<String>, String)>,
        circles: &mut Vec<Vec<(Vec<String>, String)>>,
    ) {
        if done.contains(m) {
            return;
        }
        for (target, at) in edges.get(m).into_iter().flatten() {
            if let Some(k) = path.iter().position(|(p, _)| p == target) {
                let mut circle = path[k..].to_vec();
                circle.push((m.clone(), at.clone()));
                circles.push(circle);
                continue;
            }
            path.push((m.clone(), at.clone()));
            visit(target, edges, done, path, circles);
            path.pop();
        }
        done.insert(m.clone());
    }
    let mut done = std::collections::BTreeSet::new();
    let mut circles = Vec::new();
    for m in edges.keys() {
        let mut path = Vec::new();
        visit(m, &edges, &mut done, &mut path, &mut circles);
    }
    let problems: Vec<String> = circles
        .iter()
        .map(|c| {
            let steps: Vec<String> = c
                .iter()
                .map(|(m, at)| format!("{} ({at})", name(m)))
                .collect();
            format!(
                "{}: an import circle: {} -> back to the first: move what they share below both",
                c[0].1,
                steps.join(" -> ")
            )
        })
        .collect();
    report(&problems, "import circles");
}

/// (j) A payload's shape belongs to its channel: outside `src/deliver/` no non-test code
/// names a payload member (`"url"`, `"reconcile"`, …) as a string, so reading, checking,
/// routing and redacting a payload each stay with the channel that owns it. (SQL in
/// `src/queries/` reads members with `->>'…'`, single quotes, and is SQL's to own.)
#[test]
fn payload_members_are_named_only_by_their_channel() {
    const MEMBERS: &[&str] = &[
        "url",
        "reconcile",
        "store_response",
        "headers",
        "body",
        "method",
        "secret",
        "reply_to",
        "bcc",
        "subject",
        "html",
    ];
    // (file, literal): a name that is not a payload member there.
    const ELSEWHERE: &[(&str, &str)] = &[
        // The name of a pre-release migration file, not a payload member.
        ("src/migrate.rs", "reconcile"),
        // The fact "names a lookup": a field of a claimed row and a column the sweep reads.
        ("src/claim.rs", "reconcile"),
        // The log's name for the lookup step of an attempt.
        ("src/worker/attempt.rs", "reconcile"),
        // Columns of outbox.endpoints, as `outboxd endpoint list` heads its table.
        ("src/cli/endpoint.rs", "url"),
        ("src/cli/endpoint.rs", "headers"),
        // The stored response's member holding the provider's body, which the message
        // page shows (`outbox.messages.response`, not the payload).
        ("src/console/message.rs", "body"),
    ];
    let mut problems = Vec::new();
    for src in sources("src") {
        if src.rel.starts_with("src/deliver/") {
            continue;
        }
        for line in src.lines.iter().filter(|l| !l.test) {
            for lit in &line.literals {
                if MEMBERS.contains(&lit.as_str())
                    && !ELSEWHERE.contains(&(src.rel.as_str(), lit.as_str()))
                {
                    problems.push(format!(
                        "{}:{}: the payload member \"{lit}\" named outside src/deliver/ (the channel owns its payload's shape)\n    {}",
                        src.rel,
                        line.number,
                        line.text.trim()
                    ));
                }
            }
        }
    }
    report(&problems, "payload members outside their channel");
}
