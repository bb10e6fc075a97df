//! TLS to PostgreSQL: libpq's `sslmode`, `sslrootcert`, `sslcert` and `sslkey`, on rustls.
//!
//! tokio-postgres knows `sslmode` only as disable / prefer / require and none of the
//! certificate options, so they are taken out of `DATABASE_URL` here, before it is parsed,
//! and turned into a rustls configuration with the verifier each mode asks for (libpq's
//! table, "SSL Mode Descriptions"):
//!
//! | sslmode | TLS | the server's certificate |
//! |---|---|---|
//! | disable | never | — |
//! | prefer (default) | if the server offers it | not checked |
//! | require | always, or the connection fails | not checked; with `sslrootcert` (or `~/.postgresql/root.crt`), checked as verify-ca (libpq does the same) |
//! | verify-ca | always | signed by a CA of `sslrootcert` |
//! | verify-full | always | that, and issued for the host connected to |
//!
//! `sslrootcert=system` (the platform's roots) means `verify-full`, and a weaker `sslmode`
//! beside it is refused, as libpq refuses it: a public CA vouches for anyone's certificate.
//!
//! Under `require` and stronger the connection is refused when the server does not speak
//! TLS: tokio-postgres never falls back to plain text there. Every file is read at start-up,
//! so a missing or unreadable one is a bad setting (exit 2), not a runtime failure.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres::config::SslMode as WireMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::model::ConfigError;

/// libpq's `sslmode` values that outboxd supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain text only.
    Disable,
    /// TLS when the server offers it, unverified; plain text otherwise (libpq's default).
    #[default]
    Prefer,
    /// TLS or nothing; the certificate is checked only when a CA is given.
    Require,
    /// TLS, with a certificate signed by the given CA.
    VerifyCa,
    /// TLS, with a certificate signed by the given CA and issued for the host name.
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Result<SslMode, ConfigError> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            "allow" => {
                return Err(ConfigError(
                    "DATABASE_URL: sslmode=allow is not supported (use disable, prefer, require, verify-ca or verify-full)".into(),
                ));
            }
            other => {
                return Err(ConfigError(format!(
                    "DATABASE_URL: unknown sslmode `{}` (use disable, prefer, require, verify-ca or verify-full)",
                    crate::text::escape(other)
                )));
            }
        })
    }

    /// What tokio-postgres is told: whether to ask for TLS, and whether to insist.
    fn wire(self) -> WireMode {
        match self {
            SslMode::Disable => WireMode::Disable,
            SslMode::Prefer => WireMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => WireMode::Require,
        }
    }

    /// The text libpq uses.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// The TLS options of a connection string, taken out of it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct TlsOptions {
    pub(super) mode: SslMode,
    pub(super) root_cert: Option<String>,
    pub(super) cert: Option<String>,
    pub(super) key: Option<String>,
}

/// The options this module owns; everything else goes to tokio-postgres unchanged.
const OURS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// Splits `url` into the string tokio-postgres parses and the TLS options.
pub(super) fn split(url: &str) -> Result<(String, TlsOptions), ConfigError> {
    let mut opts = TlsOptions::default();
    let mut mode = None;
    let mut take = |key: &str, value: String| -> Result<(), ConfigError> {
        match key {
            "sslmode" => mode = Some(SslMode::parse(&value)?),
            "sslrootcert" => opts.root_cert = Some(value),
            "sslcert" => opts.cert = Some(value),
            "sslkey" => opts.key = Some(value),
            _ => {}
        }
        Ok(())
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        split_url(url, &mut take)?
    } else {
        split_key_values(url, &mut take)?
    };
    // libpq: "When using sslrootcert=system, the default sslmode is changed to verify-full,
    // and any weaker setting will result in an error." The platform's roots vouch for every
    // public certificate, whoever holds it; only the host name check makes them a check.
    opts.mode = match (mode, opts.root_cert.as_deref()) {
        (None | Some(SslMode::VerifyFull), Some("system")) => SslMode::VerifyFull,
        (Some(weaker), Some("system")) => {
            return Err(ConfigError(format!(
                "DATABASE_URL: sslmode={} with sslrootcert=system: sslrootcert=system needs sslmode=verify-full (any public certificate would pass otherwise)",
                weaker.as_str()
            )));
        }
        (mode, _) => mode.unwrap_or_default(),
    };
    Ok((rest, opts))
}

/// A `postgres://` URL: the options are query parameters, percent-encoded.
fn split_url(
    url: &str,
    take: &mut impl FnMut(&str, String) -> Result<(), ConfigError>,
) -> Result<String, ConfigError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok(url.to_owned());
    };
    let mut kept = Vec::new();
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let key = decode(k)?;
        if OURS.contains(&key.as_str()) {
            take(&key, decode(v)?)?;
        } else {
            kept.push(pair);
        }
    }
    Ok(if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    })
}

fn decode(s: &str) -> Result<String, ConfigError> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .map(|c| c.into_owned())
        .map_err(|_| ConfigError("DATABASE_URL: a query parameter is not UTF-8".into()))
}

/// A libpq `key=value` string: values bare or in single quotes, with backslash escapes.
/// The kept pairs are written back quoted, which tokio-postgres reads the same way.
fn split_key_values(
    s: &str,
    take: &mut impl FnMut(&str, String) -> Result<(), ConfigError>,
) -> Result<String, ConfigError> {
    let bad = || ConfigError("DATABASE_URL is not a valid PostgreSQL connection string".into());
    let mut kept = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') || key.is_empty() {
            return Err(bad());
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\'') => break,
                    Some('\\') => value.push(chars.next().ok_or_else(bad)?),
                    Some(c) => value.push(c),
                    None => return Err(bad()),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.push(chars.next().ok_or_else(bad)?);
                } else {
                    value.push(c);
                }
            }
        }
        if OURS.contains(&key.as_str()) {
            take(&key, value)?;
        } else {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            kept.push(format!("{key}='{quoted}'"));
        }
    }
    Ok(kept.join(" "))
}

/// The connector for `opts`, with every file read now, and the mode tokio-postgres needs.
pub(super) fn connector(opts: &TlsOptions) -> Result<(MakeRustlsConnect, WireMode), ConfigError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError(format!("TLS to PostgreSQL: {e}")))?;
    let roots = match (&opts.root_cert, opts.mode) {
        (Some(path), _) => Some(root_store(path)?),
        (None, SslMode::VerifyCa | SslMode::VerifyFull) => {
            // libpq's default place for the CA, when it exists.
            let default = home_file("root.crt").filter(|p| p.is_file());
            match default {
                Some(p) => Some(root_store(&p.to_string_lossy())?),
                None => {
                    return Err(ConfigError(format!(
                        "DATABASE_URL: sslmode={} needs the server's CA: add sslrootcert=/path/to/ca.pem (or, with verify-full, sslrootcert=system for the platform's roots)",
                        opts.mode.as_str()
                    )));
                }
            }
        }
        // libpq: "if a root CA file exists, the behavior of sslmode=require will be the
        // same as that of verify-ca".
        (None, SslMode::Require) => match home_file("root.crt").filter(|p| p.is_file()) {
            Some(p) => Some(root_store(&p.to_string_lossy())?),
            None => None,
        },
        (None, _) => None,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (opts.mode, roots) {
        (SslMode::Disable | SslMode::Prefer, _) | (SslMode::Require, None) => {
            Arc::new(Unverified(provider.signature_verification_algorithms))
        }
        (SslMode::VerifyFull, Some(roots)) => webpki(roots, &provider)?,
        (SslMode::Require | SslMode::VerifyCa, Some(roots)) => {
            Arc::new(ChainOnly(webpki(roots, &provider)?))
        }
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => unreachable_ca(opts.mode)?,
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match (&opts.cert, &opts.key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(certificates("sslcert", cert)?, private_key(key)?)
            .map_err(|e| ConfigError(format!("DATABASE_URL: sslcert and sslkey: {e}")))?,
        (None, None) => builder.with_no_client_auth(),
        (Some(_), None) => {
            return Err(ConfigError(
                "DATABASE_URL: sslcert is set without sslkey".into(),
            ));
        }
        (None, Some(_)) => {
            return Err(ConfigError(
                "DATABASE_URL: sslkey is set without sslcert".into(),
            ));
        }
    };
    Ok((MakeRustlsConnect::new(config), opts.mode.wire()))
}

/// The verifying modes always have a CA store by now (or returned an error above); this
/// keeps the match total without a panic.
fn unreachable_ca(mode: SslMode) -> Result<Arc<dyn ServerCertVerifier>, ConfigError> {
    Err(ConfigError(format!(
        "DATABASE_URL: sslmode={} needs sslrootcert",
        mode.as_str()
    )))
}

fn home_file(name: &str) -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    Some(Path::new(&home).join(".postgresql").join(name))
}

/// The CAs of `sslrootcert`: a PEM file, or `system` for the platform's roots.
fn root_store(path: &str) -> Result<RootCertStore, ConfigError> {
    let mut store = RootCertStore::empty();
    if path == "system" {
        let found = system_roots()?;
        store.add_parsable_certificates(found);
    } else {
        let (added, _ignored) = store.add_parsable_certificates(certificates("sslrootcert", path)?);
        if added == 0 {
            return Err(ConfigError(format!(
                "DATABASE_URL: sslrootcert {} holds no usable CA certificate",
                shown(path)
            )));
        }
    }
    Ok(store)
}

/// The platform's CA bundle, read from the places Debian, Red Hat and Alpine keep it.
/// (libpq's `sslrootcert=system` asks OpenSSL for its default store, which is this file.)
fn system_roots() -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    const BUNDLES: [&str; 3] = [
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/ssl/cert.pem",
    ];
    for bundle in BUNDLES {
        if Path::new(bundle).is_file() {
            return certificates("sslrootcert", bundle);
        }
    }
    Err(ConfigError(
        "DATABASE_URL: sslrootcert=system, but no CA bundle was found on this system".into(),
    ))
}

/// A file name as an error shows it: control characters escaped.
fn shown(path: &str) -> String {
    crate::text::escape(path).into_owned()
}

fn read(option: &str, path: &str) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| {
        ConfigError(format!(
            "DATABASE_URL: {option} {}: {}",
            shown(path),
            crate::text::escape(&e.to_string())
        ))
    })
}

fn certificates(option: &str, path: &str) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let pem = read(option, path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| {
            ConfigError(format!(
                "DATABASE_URL: {option} {} is not a PEM certificate file: {e}",
                shown(path)
            ))
        })?;
    if certs.is_empty() {
        return Err(ConfigError(format!(
            "DATABASE_URL: {option} {} holds no PEM certificate",
            shown(path)
        )));
    }
    Ok(certs)
}

fn private_key(path: &str) -> Result<PrivateKeyDer<'static>, ConfigError> {
    let pem = read("sslkey", path)?;
    // The error says which file, never what is in it.
    PrivateKeyDer::from_pem_slice(&pem).map_err(|_| {
        ConfigError(format!(
            "DATABASE_URL: sslkey {} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)",
            shown(path)
        ))
    })
}

fn webpki(
    roots: RootCertStore,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>, ConfigError> {
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| ConfigError(format!("DATABASE_URL: sslrootcert: {e}")))
}

/// verify-ca: the chain must lead to a given CA; the name on the certificate is not
/// checked. webpki checks the chain before the name, so a name mismatch is the only error
/// let through.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// prefer, and require without a CA: encrypted, but any certificate is accepted (libpq's
/// behaviour for these modes). The handshake signatures are still checked, so the
/// connection is with whoever holds the certificate's key.
#[derive(Debug)]
struct Unverified(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn opts(url: &str) -> (String, TlsOptions) {
        split(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    #[test]
    fn url_options_are_taken_out_and_the_rest_kept() {
        let (rest, o) = opts(
            "postgres://u:p@db.example.com:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        );
        assert_eq!(
            rest,
            "postgres://u:p@db.example.com:5432/app?application_name=x"
        );
        assert_eq!(o.mode, SslMode::VerifyFull);
        assert_eq!(o.root_cert.as_deref(), Some("/etc/ca.pem"));
        let (rest, o) = opts("postgres://h/app?sslmode=disable");
        assert_eq!(rest, "postgres://h/app");
        assert_eq!(o.mode, SslMode::Disable);
        let (rest, o) = opts("postgresql://h1,h2/app");
        assert_eq!(rest, "postgresql://h1,h2/app");
        assert_eq!(o, TlsOptions::default());
    }

    #[test]
    fn key_value_options_are_taken_out_and_the_rest_requoted() {
        let (rest, o) = opts(
            r"host=db password='it\'s \\ ok' sslmode=require sslcert='/a b/c.pem' sslkey=/k.pem",
        );
        assert_eq!(rest, r"host='db' password='it\'s \\ ok'");
        assert_eq!(o.mode, SslMode::Require);
        assert_eq!(o.cert.as_deref(), Some("/a b/c.pem"));
        assert_eq!(o.key.as_deref(), Some("/k.pem"));
        let parsed: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(parsed.get_password(), Some(&b"it's \\ ok"[..]));
    }

    #[test]
    fn bad_values_name_the_problem_not_the_password() {
        for (url, want) in [
            (
                "postgres://u:secret@h/app?sslmode=bogus",
                "unknown sslmode `bogus`",
            ),
            (
                "postgres://u:secret@h/app?sslmode=allow",
                "sslmode=allow is not supported",
            ),
            (
                "host=h password=secret sslmode=verify-all",
                "unknown sslmode `verify-all`",
            ),
            (
                "postgres://u:secret@h/app?sslmode=%1b%5b31m",
                "unknown sslmode `\\u{1b}[31m`",
            ),
            (
                "host=h password='secret",
                "not a valid PostgreSQL connection string",
            ),
        ] {
            let err = split(url).err().map(|e| e.0).unwrap_or_default();
            assert!(err.contains(want), "{url}: {err}");
            assert!(!err.contains("secret"), "{url}: {err}");
            assert!(!err.contains('\u{1b}'), "{url}: {err}");
        }
    }

    #[test]
    fn files_are_read_at_start_up() {
        let o = TlsOptions {
            mode: SslMode::VerifyFull,
            root_cert: Some("/nonexistent/ca.pem".into()),
            ..TlsOptions::default()
        };
        let err = connector(&o).err().map(|e| e.0).unwrap_or_default();
        assert!(err.contains("sslrootcert /nonexistent/ca.pem"), "{err}");
        let o = TlsOptions {
            mode: SslMode::Require,
            cert: Some("/nonexistent/c.pem".into()),
            ..TlsOptions::default()
        };
        let err = connector(&o).err().map(|e| e.0).unwrap_or_default();
        assert!(err.contains("sslcert is set without sslkey"), "{err}");
        // A file that is not PEM.
        let o = TlsOptions {
            mode: SslMode::VerifyCa,
            root_cert: Some("/etc/hostname".into()),
            ..TlsOptions::default()
        };
        let err = connector(&o).err().map(|e| e.0).unwrap_or_default();
        assert!(err.contains("sslrootcert /etc/hostname"), "{err}");
    }

    /// libpq: "When using sslrootcert=system, the default sslmode is changed to
    /// verify-full, and any weaker setting will result in an error": the platform's roots
    /// vouch for any public certificate, so only the host name makes them a check at all.
    #[test]
    fn the_platforms_roots_mean_verify_full() {
        let (_, o) = opts("postgres://h/app?sslrootcert=system");
        assert_eq!(o.mode, SslMode::VerifyFull);
        let (_, o) = opts("host=h sslrootcert=system");
        assert_eq!(o.mode, SslMode::VerifyFull);
        let (_, o) = opts("postgres://h/app?sslrootcert=system&sslmode=verify-full");
        assert_eq!(o.mode, SslMode::VerifyFull);
        for mode in ["disable", "prefer", "require", "verify-ca"] {
            for url in [
                format!("postgres://u:secret@h/app?sslmode={mode}&sslrootcert=system"),
                format!("postgres://u:secret@h/app?sslrootcert=system&sslmode={mode}"),
                format!("host=h password=secret sslmode={mode} sslrootcert=system"),
            ] {
                let err = split(&url).err().map(|e| e.0).unwrap_or_default();
                assert!(
                    err.contains(&format!("sslmode={mode}"))
                        && err.contains("sslrootcert=system needs sslmode=verify-full"),
                    "{url}: {err}"
                );
                assert!(!err.contains("secret"), "{url}: {err}");
            }
        }
    }

    #[test]
    fn modes_without_a_ca_build() {
        for mode in [SslMode::Disable, SslMode::Prefer, SslMode::Require] {
            let o = TlsOptions {
                mode,
                ..TlsOptions::default()
            };
            assert!(connector(&o).is_ok(), "{mode:?}");
        }
    }
}
