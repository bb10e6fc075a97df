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
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
