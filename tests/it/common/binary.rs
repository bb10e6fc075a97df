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

/// `outboxd run` in the background, as an operator starts it: a clean environment (see
/// [`outboxd`]), private networks allowed (the test's listeners are on loopback), the
/// metrics server on a port of its own, and both pipes read on threads. Stop it with
/// [`Daemon::stop`], which returns everything it printed.
pub struct Daemon {
    /// None once stopped; a daemon dropped without [`Daemon::stop`] (a failed test) is
    /// killed, so it does not outlive the test.
    child: Option<std::process::Child>,
    out: Option<std::thread::JoinHandle<String>>,
    err: Option<std::thread::JoinHandle<String>>,
    /// `127.0.0.1:PORT` of its `/metrics` and `/healthz`.
    pub metrics_addr: String,
}

impl Daemon {
    /// Starts `outboxd run ARGS…` on `database_url` with `env` added.
    pub fn start(database_url: &str, args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let metrics_addr = format!("127.0.0.1:{port}");
        let mut cmd = outboxd(Some(database_url));
        cmd.args(["run", "--metrics-addr", &metrics_addr])
            .args(args)
            .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn outboxd run");
        let mut out_pipe = child.stdout.take().unwrap();
        let mut err_pipe = child.stderr.take().unwrap();
        let out = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out_pipe.read_to_string(&mut s);
            s
        });
        let err = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err_pipe.read_to_string(&mut s);
            s
        });
        Daemon {
            child: Some(child),
            out: Some(out),
            err: Some(err),
            metrics_addr,
        }
    }

    /// The body of `GET /metrics`, once the server answers (within 15 s).
    pub async fn metrics(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(text) = get_text(&self.metrics_addr, "/metrics").await {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "/metrics did not answer within 15 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM, then waits (20 s at most) for the exit: the exit code and all it printed.
    pub async fn stop(mut self) -> Output {
        let mut child = self.child.take().unwrap();
        let (out, err) = (self.out.take().unwrap(), self.err.take().unwrap());
        let pid = child.id().to_string();
        let _ = Command::new("kill").args(["-s", "TERM", &pid]).status();
        tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                if Instant::now() >= deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("outboxd run did not exit within 20 s of SIGTERM");
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            Output {
                code: status.code(),
                stdout: out.join().unwrap(),
                stderr: err.join().unwrap(),
            }
        })
        .await
        .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The body of a 200 answer to `GET path` from `addr`, or None.
async fn get_text(addr: &str, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut buf))
        .await
        .ok()?
        .ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    (head.split_whitespace().nth(1)? == "200").then(|| body.to_owned())
}
