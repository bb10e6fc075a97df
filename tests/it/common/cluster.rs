//! A PostgreSQL cluster owned by one test (for restarts and outages), started with
//! scripts/throwaway-pg and removed on drop.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

/// A throwaway cluster.
pub struct Cluster {
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub url: String,
    dir: PathBuf,
    bin: PathBuf,
    as_postgres: bool,
}

impl Cluster {
    /// initdb and start (blocking: a few seconds).
    pub fn start() -> Cluster {
        let root = env!("CARGO_MANIFEST_DIR");
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "set -e; source {root}/scripts/throwaway-pg; throwaway_pg_start; \
                 echo \"$THROWAWAY_PG_URL\"; echo \"$THROWAWAY_PG_DIR\"; echo \"$THROWAWAY_PG_BIN\""
            ))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "throwaway cluster: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines = text.lines();
        let url = lines.next().unwrap().to_owned();
        let dir = PathBuf::from(lines.next().unwrap());
        let bin = PathBuf::from(lines.next().unwrap());
        // As root, the cluster runs as the postgres user (initdb refuses root).
        let as_postgres = std::fs::read_to_string("/proc/self/status")
            .map(|s| {
                s.lines()
                    .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
            })
            .unwrap_or(false);
        Cluster {
            url,
            dir,
            bin,
            as_postgres,
        }
    }

    fn pg_ctl(&self, args: &[&str]) -> bool {
        let data = self.dir.join("data");
        let log = self.dir.join("server.log");
        let pg_ctl = self.bin.join("pg_ctl");
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&pg_ctl);
            c
        } else {
            Command::new(&pg_ctl)
        };
        cmd.arg("-D").arg(&data).arg("-l").arg(&log).args(args);
        cmd.output().map(|o| o.status.success()).unwrap_or(false)
    }

    /// Stops the server (fast: connections are terminated).
    pub fn stop(&self) {
        assert!(self.pg_ctl(&["-m", "fast", "-w", "stop"]), "pg_ctl stop");
    }

    /// Starts it again with the same settings.
    pub fn start_again(&self) {
        assert!(self.pg_ctl(&["-w", "start"]), "pg_ctl start");
    }

    /// The cluster's own directory (the data directory is `data/` inside it).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Hands a file the test wrote in the cluster's directory to the server's user, with
    /// `mode` (a private key must be 0600 and the server's own).
    pub fn give(&self, path: &std::path::Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        if self.as_postgres {
            let ok = Command::new("chown")
                .arg("postgres")
                .arg(path)
                .status()
                .unwrap()
                .success();
            assert!(ok, "chown {}", path.display());
        }
    }

    /// Appends `conf` to postgresql.conf, replaces pg_hba.conf with `hba`, and restarts.
    pub fn reconfigure(&self, conf: &str, hba: &str) {
        use std::io::Write;
        let data = self.dir.join("data");
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .unwrap();
        writeln!(f, "{conf}").unwrap();
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        self.stop();
        if !self.pg_ctl(&["-w", "start"]) {
            let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            panic!("pg_ctl start after reconfigure:\n{log}");
        }
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|tail| tail.split('/').next())
            .and_then(|p| p.parse().ok())
            .unwrap()
    }
}

impl Cluster {
    /// A streaming standby of `primary` on a port of its own: `pg_basebackup -R` (which
    /// writes `primary_conninfo` and `standby.signal`), then started (blocking).
    pub fn standby_of(primary: &Cluster) -> Cluster {
        let mut port = free_port();
        let dir =
            std::env::temp_dir().join(format!("outboxd-standby.{}.{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut standby = Cluster {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir: dir.clone(),
            bin: primary.bin.clone(),
            as_postgres: primary.as_postgres,
        };
        if standby.as_postgres {
            standby.give(&dir, 0o755);
        }
        let data = dir.join("data");
        let mut cmd = standby.as_server_user(&standby.bin.join("pg_basebackup"));
        cmd.arg("-D")
            .arg(&data)
            .args([
                "-R",
                "-X",
                "stream",
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-p",
            ])
            .arg(primary.port().to_string());
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "pg_basebackup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The copied configuration names the primary's port and socket directory; later
        // lines win. The port was free when picked, but another test's cluster may take it
        // before this one binds it (as scripts/throwaway-pg, a new port is tried then).
        for attempt in 1..=3 {
            // What the log held before this attempt: only what this one adds is read below.
            let seen = std::fs::metadata(dir.join("server.log")).map_or(0, |m| m.len() as usize);
            {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(data.join("postgresql.conf"))
                    .unwrap();
                writeln!(
                    f,
                    "port = {port}\nunix_socket_directories = '{}'",
                    dir.display()
                )
                .unwrap();
            }
            if standby.pg_ctl(&["-w", "start"]) {
                return standby;
            }
            let log = std::fs::read(dir.join("server.log")).unwrap_or_default();
            let log = String::from_utf8_lossy(log.get(seen..).unwrap_or_default());
            assert!(
                attempt < 3 && log.contains("Address already in use"),
                "standby start:\n{log}"
            );
            port = free_port();
            standby.url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        }
        unreachable!("the loop returns or panics")
    }

    /// Promotes a standby to primary and waits until it accepts writes.
    pub fn promote(&self) {
        assert!(self.pg_ctl(&["-w", "promote"]), "pg_ctl promote");
    }

    fn as_server_user(&self, program: &std::path::Path) -> Command {
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }
}

/// A port below the ephemeral range that nothing listens on (as scripts/throwaway-pg picks).
fn free_port() -> u16 {
    for _ in 0..200 {
        let p = 15432 + (std::process::id() as u16 % 2000) + rand_offset();
        if std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
            return p;
        }
    }
    panic!("no free port");
}

fn rand_offset() -> u16 {
    use std::time::{SystemTime, UNIX_EPOCH};
    (SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
        % 2000) as u16
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
