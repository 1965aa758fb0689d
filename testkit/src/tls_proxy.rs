//! A TLS front for a plaintext test server (anvil, the Bitcoin Core simulator): it accepts TLS on
//! a free loopback port with the certificate it is given and relays every connection's bytes to
//! the upstream address, so clients can be tested against `https` node URLs.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A running TLS front; stops when dropped.
pub struct TlsProxy {
    /// The port it accepts TLS on (127.0.0.1).
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl TlsProxy {
    /// Relays TLS connections on a free port to `upstream`, presenting `cert_pem` / `key_pem`.
    pub async fn start(upstream: SocketAddr, cert_pem: &str, key_pem: &str) -> Result<TlsProxy> {
        let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .context("certificate")?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).context("key")?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A client that refuses our certificate ends here; that is what tests look for.
                    let Ok(mut tls) = acceptor.accept(socket).await else { return };
                    let Ok(mut plain) = tokio::net::TcpStream::connect(upstream).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        Ok(TlsProxy { port, task })
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
