//! The library as an application that only enqueues and looks up depends on it
//! (`default-features = false`): none of the daemon's stacks in its tree.

use std::process::Command;

/// The crates an application builds with `default-features = false`: what enqueue, lookup
/// and the vocabulary need (tokio-postgres, serde_json, thiserror and theirs), no HTTP,
/// SMTP, TLS, console, CLI or telemetry crate. Read from `cargo tree` over the lock file.
#[test]
fn the_client_build_leaves_the_daemon_out() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tree = |args: &[&str]| -> Vec<String> {
        let out = Command::new(&cargo)
            .args([
                "tree",
                "--locked",
                "--offline",
                "-e",
                "normal",
                "--prefix",
                "none",
            ])
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("cargo tree runs");
        assert!(
            out.status.success(),
            "cargo tree: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut crates: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect();
        crates.sort();
        crates.dedup();
        crates
    };
    let client = tree(&["--no-default-features"]);
    let daemon = tree(&[]);
    for heavy in [
        "hyper",
        "lettre",
        "axum",
        "maud",
        "clap",
        "rustls",
        "aws-lc-sys",
        "deadpool-postgres",
        "opentelemetry",
        "reqwest",
        "tracing-subscriber",
        "metrics",
    ] {
        assert!(
            !client.iter().any(|c| c == heavy),
            "{heavy} is in the client's tree"
        );
        assert!(
            daemon.iter().any(|c| c == heavy),
            "{heavy} is not in the daemon's tree: the list is stale"
        );
    }
    assert!(
        client.len() * 3 < daemon.len(),
        "{} crates for the client, {} for the daemon",
        client.len(),
        daemon.len()
    );
}
