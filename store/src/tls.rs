//! TLS for PostgreSQL connections, with libpq's `sslmode` meanings (DESIGN §8 "Transport
//! security"), over rustls.
//!
//! - `disable`: plaintext. The default on loopback when no `sslmode` is given.
//! - `prefer` (the default elsewhere), `require`: encrypted; the certificate is not checked unless
//!   `sslrootcert` names a CA file, and then it is checked as for `verify-ca` (libpq does the same).
//! - `verify-ca`: the server's certificate must chain to `sslrootcert`.
//! - `verify-full`: that, and it must name the host connected to.
//!
//! tokio-postgres knows only `disable`, `prefer` and `require`, and no `sslrootcert`, so
//! [`split_tls_params`] takes both out of the connection string before it is parsed.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

/// Makes rustls with ring the process's TLS implementation, once: reqwest (the node clients) is
/// built without a provider of its own so that only ring is compiled in. Every constructor of an
/// HTTP client calls this, and so does `main`; calling it again changes nothing.
pub fn install_crypto_provider() {
    // Err means a provider is installed already, which is all this wants.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// `sslmode`, as libpq spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plaintext.
    Disable,
    /// TLS if the server offers it.
    Prefer,
    /// TLS, or no connection.
    Require,
    /// TLS with a certificate chaining to the root.
    VerifyCa,
    /// TLS with a certificate chaining to the root and naming the host.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Option<SslMode> {
        Some(match value {
            "disable" => SslMode::Disable,
            "prefer" | "allow" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// What tokio-postgres is told: it negotiates, our verifier decides.
    pub(crate) fn negotiation(self) -> tokio_postgres::config::SslMode {
        match self {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => tokio_postgres::config::SslMode::Require,
        }
    }
}

/// How a connection string asked for TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsParams {
    /// `sslmode`, if given.
    pub mode: Option<SslMode>,
    /// `sslrootcert`, if given.
    pub root_cert: Option<PathBuf>,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// An `sslmode` libpq does not know.
    #[error("unknown sslmode {0:?}: expected disable, prefer, require, verify-ca or verify-full")]
    UnknownMode(String),
    /// `verify-ca` / `verify-full` without a CA to verify against.
    #[error("sslmode={0} needs sslrootcert=PATH, the CA certificate(s) the server's certificate must chain to")]
    NoRootCert(&'static str),
    /// The CA file could not be read or holds no certificate.
    #[error("sslrootcert {path}: {reason}")]
    RootCert {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Splits `sslmode` and `sslrootcert` out of a URL's query or a key=value string; returns the
/// string tokio-postgres can parse and what was taken out.
pub fn split_tls_params(raw: &str) -> Result<(String, TlsParams), TlsError> {
    let mut params = TlsParams { mode: None, root_cert: None };
    let mut take = |key: &str, value: &str| -> Result<bool, TlsError> {
        match key {
            "sslmode" => {
                params.mode = Some(SslMode::parse(value).ok_or_else(|| TlsError::UnknownMode(value.to_owned()))?);
                Ok(true)
            }
            "sslrootcert" => {
                params.root_cert = Some(PathBuf::from(value));
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    let rest = if raw.contains("://") {
        match raw.split_once('?') {
            Some((base, query)) => {
                let mut kept = Vec::new();
                for param in query.split('&') {
                    let (key, value) = param.split_once('=').unwrap_or((param, ""));
                    if !take(key, &percent_decode(value))? {
                        kept.push(param);
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
            None => raw.to_owned(),
        }
    } else {
        let mut kept = Vec::new();
        for (key, value, text) in key_values(raw) {
            if !take(&key, &value)? {
                kept.push(text);
            }
        }
        kept.join(" ")
    };
    Ok((rest, params))
}

/// `%XX` escapes decoded (for a path in a URL's query).
pub(crate) fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' {
            if let (Some(h), Some(l)) = (bytes.get(i + 1).and_then(|b| hex(*b)), bytes.get(i + 2).and_then(|b| hex(*b)))
            {
                out.push(u8::try_from(h * 16 + l).expect("BUG: two hex digits are a byte"));
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The `key=value` pairs of a libpq key=value string: key, unquoted value, and the pair's text.
pub(crate) fn key_values(raw: &str) -> Vec<(String, String, String)> {
    let mut pairs = Vec::new();
    let mut chars = raw.char_indices().peekable();
    while let Some(&(start, c)) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut key = String::new();
        while let Some(&(_, c)) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|&(_, c)| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_some_and(|&(_, c)| c == '=') {
            chars.next();
        }
        while chars.peek().is_some_and(|&(_, c)| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek().is_some_and(|&(_, c)| c == '\'') {
            chars.next();
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            value.push(escaped);
                        }
                    }
                    '\'' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(&(_, c)) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        let end = chars.peek().map_or(raw.len(), |&(i, _)| i);
        pairs.push((key, value, raw[start..end].to_owned()));
    }
    pairs
}

/// Whether every host of `config` is this machine (loopback addresses, `localhost`, sockets).
pub(crate) fn all_loopback(config: &tokio_postgres::Config) -> bool {
    config.get_hosts().iter().all(|host| match host {
        tokio_postgres::config::Host::Tcp(name) => {
            name == "localhost" || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
        }
        #[cfg(unix)]
        tokio_postgres::config::Host::Unix(_) => true,
    })
}

/// The connector for `mode`: rustls with the verifier the mode asks for.
pub(crate) fn connector(
    mode: SslMode,
    root_cert: Option<&std::path::Path>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let algorithms = provider.signature_verification_algorithms;
    let builder =
        rustls::ClientConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
    let roots = match root_cert {
        Some(path) => Some(Arc::new(root_store(path)?)),
        None => None,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (mode, roots) {
        (SslMode::VerifyFull, Some(roots)) => WebPkiServerVerifier::builder_with_provider(roots, provider)
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?,
        (SslMode::VerifyCa | SslMode::Require | SslMode::Prefer, Some(roots)) => Arc::new(Lenient {
            chain: Some(
                WebPkiServerVerifier::builder_with_provider(roots, provider)
                    .build()
                    .map_err(|e| rustls::Error::General(e.to_string()))?,
            ),
            algorithms,
        }),
        (SslMode::VerifyFull, None) => return Err(TlsError::NoRootCert("verify-full")),
        (SslMode::VerifyCa, None) => return Err(TlsError::NoRootCert("verify-ca")),
        (SslMode::Disable | SslMode::Prefer | SslMode::Require, None) | (SslMode::Disable, Some(_)) => {
            Arc::new(Lenient { chain: None, algorithms })
        }
    };
    let config = builder.dangerous().with_custom_certificate_verifier(verifier).with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

fn root_store(path: &std::path::Path) -> Result<rustls::RootCertStore, TlsError> {
    let failed = |reason: String| TlsError::RootCert { path: path.to_owned(), reason };
    let mut store = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| failed(e.to_string()))? {
        store.add(cert.map_err(|e| failed(e.to_string()))?).map_err(|e| failed(e.to_string()))?;
    }
    if store.is_empty() {
        return Err(failed("no certificate in the file".into()));
    }
    Ok(store)
}

/// Below `verify-full`. With a CA (`verify-ca`, or `prefer` / `require` with `sslrootcert`) the
/// chain is checked, the name is not; without one (`prefer` / `require`) the connection is
/// encrypted and the certificate not checked (libpq's meaning; use `verify-full` to be sure who
/// answers). The handshake signatures are checked either way.
#[derive(Debug)]
struct Lenient {
    /// The chain check, when there is a CA.
    chain: Option<Arc<WebPkiServerVerifier>>,
    /// The provider's algorithms, for the handshake signatures (the ones `chain` was built with).
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else { return Ok(ServerCertVerified::assertion()) };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
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
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_of_both_forms() {
        let (rest, params) = split_tls_params(
            "postgres://app@db/custodian?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(rest, "postgres://app@db/custodian?application_name=x");
        assert_eq!(params, TlsParams { mode: Some(SslMode::VerifyFull), root_cert: Some("/etc/ca.pem".into()) });
        let (rest, params) =
            split_tls_params("host=db sslmode = require sslrootcert='/etc/my ca.pem' dbname=c").unwrap();
        assert_eq!(rest, "host=db dbname=c");
        assert_eq!(params, TlsParams { mode: Some(SslMode::Require), root_cert: Some("/etc/my ca.pem".into()) });
        let (rest, params) = split_tls_params("postgres://app@db/custodian").unwrap();
        assert_eq!((rest.as_str(), params.mode), ("postgres://app@db/custodian", None));
        assert!(matches!(split_tls_params("postgres://db?sslmode=sometimes"), Err(TlsError::UnknownMode(_))));
        assert!(matches!(connector(SslMode::VerifyFull, None), Err(TlsError::NoRootCert("verify-full"))));
    }
}
