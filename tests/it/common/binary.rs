//! The real `outboxd` binary, run as an operator would: a clean environment and a bounded
//! run whose output is captured.

#![allow(dead_code, clippy::unwrap_used)]

use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A URL nothing listens on: a command that must fail before touching the network gets it,
/// so reaching the network would show up as another exit code or a hang.
pub const UNREACHABLE_URL: &str = "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2";

/// The binary with a clean environment (PATH only: no inherited `OUTBOXD_*`, `RUST_LOG` or
/// `DATABASE_URL`) and, if given, a database URL.
pub fn outboxd(database_url: Option<&str>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outboxd"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    if let Some(url) = database_url {
        cmd.env("DATABASE_URL", url);
    }
    cmd
}

/// What a finished run printed, and its exit code (None when killed by a signal).
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// The non-empty lines of stderr.
    pub fn stderr_lines(&self) -> Vec<&str> {
        self.stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect()
    }
}

/// Runs the command to its end, within 20 s (killed and failed after that).
pub fn run(cmd: &mut Command) -> Output {
    run_within(cmd, Duration::from_secs(20))
}

/// Runs the command to its end within `limit` (killed and failed after that, with the tail
/// of its stderr). Both pipes are read on threads, so a chatty child cannot block on a full
/// pipe.
pub fn run_within(cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn outboxd");
    let mut out_pipe = child.stdout.take().unwrap();
    let mut err_pipe = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out_pipe.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = err_t.join().unwrap();
            let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
            panic!("outboxd {cmd:?} did not exit within {limit:?}; stderr tail: {tail:#?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        code: status.code(),
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}
