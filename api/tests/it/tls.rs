//! gRPC over TLS with certificates made at run time: a client trusting the test CA is served,
//! one that does not trust it, or speaks plaintext, is not; with client certificates required,
//! only a client presenting one signed by the client CA gets through.

use std::time::Duration;

use custodian_api::{pb, serve, ServerTls};
use custodian_testkit::TestDb;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use tokio::sync::oneshot;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::support::config;

/// A CA and a certificate it signed for `name`, as PEM: (ca, cert, key).
fn issue(name: &str) -> (String, String, String) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![name.to_owned()]).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

/// Serves the API over TLS on a free port; returns its port and the stop switch.
async fn start(tls: ServerTls) -> (u16, TestDb, oneshot::Sender<()>) {
    let db = TestDb::new().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = oneshot::channel::<()>();
    let config = custodian_api::ApiConfig { tls: Some(tls), ..config() };
    tokio::spawn(serve(listener, db.pool.clone(), config, async move {
        let _ = stopped.await;
    }));
    (port, db, stop)
}

async fn check(endpoint: Endpoint) -> Result<bool, String> {
    let channel: Channel =
        endpoint.connect_timeout(Duration::from_secs(5)).connect().await.map_err(|e| format!("connect: {e:?}"))?;
    let mut health = pb::health_client::HealthClient::new(channel);
    health.check(pb::CheckRequest {}).await.map(|r| r.into_inner().serving).map_err(|e| format!("call: {e:?}"))
}

#[tokio::test]
async fn a_call_over_tls_succeeds_with_the_test_ca_and_fails_without_it() {
    let (ca, cert, key) = issue("localhost");
    let (port, _db, _stop) = start(ServerTls { cert_pem: cert.into(), key_pem: key.into(), client_ca_pem: None }).await;
    let https = || Endpoint::from_shared(format!("https://localhost:{port}")).unwrap();

    let trusted = https().tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&ca))).unwrap();
    assert_eq!(check(trusted).await, Ok(true), "the test CA is trusted");

    let (other_ca, _, _) = issue("localhost");
    let untrusted =
        https().tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&other_ca))).unwrap();
    assert!(check(untrusted).await.is_err(), "a client trusting another CA is refused");
    let no_roots = https().tls_config(ClientTlsConfig::new()).unwrap();
    assert!(check(no_roots).await.is_err(), "a client trusting nothing is refused");
    let plaintext = Endpoint::from_shared(format!("http://localhost:{port}")).unwrap();
    assert!(check(plaintext).await.is_err(), "plaintext is not served on a TLS listener");
}

#[tokio::test]
async fn with_a_client_ca_only_clients_presenting_its_certificates_get_through() {
    let (ca, cert, key) = issue("localhost");
    let (client_ca, client_cert, client_key) = issue("wallet-app");
    let tls = ServerTls { cert_pem: cert.into(), key_pem: key.into(), client_ca_pem: Some(client_ca.into()) };
    let (port, _db, _stop) = start(tls).await;
    let https = |tls: ClientTlsConfig| {
        Endpoint::from_shared(format!("https://localhost:{port}")).unwrap().tls_config(tls).unwrap()
    };
    let trusting = || ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&ca));
    assert!(check(https(trusting())).await.is_err(), "no client certificate, no call");
    let (_, stranger_cert, stranger_key) = issue("stranger");
    let stranger = trusting().identity(Identity::from_pem(&stranger_cert, &stranger_key));
    assert!(check(https(stranger)).await.is_err(), "a certificate from another CA is refused");
    let known = trusting().identity(Identity::from_pem(&client_cert, &client_key));
    assert_eq!(check(https(known)).await, Ok(true));
}
