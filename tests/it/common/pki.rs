//! Certificates made with `openssl` for the TLS tests: a CA, a server certificate for
//! `localhost` signed by it, a client certificate for the user `certuser`, and an unrelated
//! second CA (PostgreSQL's TLS in `pg_tls.rs`, webhooks over https in `webhook_tls.rs`).

#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The files `openssl` made for one test.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for `localhost` signed by it, a client certificate for the
/// user `certuser`, and an unrelated second CA.
pub fn make_pki(dir: &Path) -> Pki {
    std::fs::create_dir_all(dir).unwrap();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    for ca in ["ca", "other-ca"] {
        let mut args = vec!["req", "-x509", "-days", "2", "-subj"];
        let subj = format!("/CN=outboxd test {ca}");
        args.push(&subj);
        args.extend(ec);
        let (key, crt) = (format!("{ca}.key"), format!("{ca}.crt"));
        args.extend(["-keyout", &key, "-out", &crt]);
        openssl(dir, &args);
    }
    std::fs::write(dir.join("server.ext"), "subjectAltName=DNS:localhost\n").unwrap();
    // Any extension makes a version 3 certificate, which rustls requires.
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (name, subj, ext) in [
        ("server", "/CN=localhost", Some("server.ext")),
        ("client", "/CN=certuser", Some("client.ext")),
    ] {
        let (key, csr, crt) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
        );
        let mut args = vec!["req", "-new", "-subj", subj];
        args.extend(ec);
        args.extend(["-keyout", &key, "-out", &csr]);
        openssl(dir, &args);
        let mut args = vec![
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &crt,
        ];
        if let Some(ext) = ext {
            args.extend(["-extfile", ext]);
        }
        openssl(dir, &args);
    }
    Pki {
        dir: dir.to_owned(),
    }
}
