//! PostgreSQL over TLS against the local server's own certificate: `verify-full` connects when
//! the CA is the server's and the name matches, and refuses a wrong CA or a wrong name.

use custodian_store::DatabaseUrl;
use custodian_testkit::TestDb;

/// The server's certificate file and a DNS name it carries (its first subjectAltName, read with
/// the openssl tool; `localhost` when it cannot say).
async fn server_certificate(db: &TestDb) -> (String, String) {
    let client = db.superuser_client().await;
    let ssl: String = client.query_one("show ssl", &[]).await.unwrap().get(0);
    assert_eq!(ssl, "on", "the local PostgreSQL serves TLS (scripts/setup.sh turns it on)");
    let file: String = client.query_one("show ssl_cert_file", &[]).await.unwrap().get(0);
    let file = if file.starts_with('/') {
        file
    } else {
        let data: String = client.query_one("show data_directory", &[]).await.unwrap().get(0);
        format!("{data}/{file}")
    };
    let name = std::process::Command::new("openssl")
        .args(["x509", "-noout", "-ext", "subjectAltName", "-in", &file])
        .output()
        .ok()
        .and_then(|out| {
            String::from_utf8_lossy(&out.stdout)
                .split([',', '\n'])
                .find_map(|part| part.trim().strip_prefix("DNS:").map(str::to_owned))
        })
        .unwrap_or_else(|| "localhost".to_owned());
    (file, name)
}

async fn encrypted(url: &DatabaseUrl) -> Result<bool, String> {
    let client = url.connect_one().await.map_err(|e| format!("{e}: {:?}", std::error::Error::source(&e)))?;
    let row = client.query_one("select ssl from pg_stat_ssl where pid = pg_backend_pid()", &[]).await.unwrap();
    Ok(row.get(0))
}

#[tokio::test]
async fn verify_full_works_against_the_servers_certificate_and_fails_against_a_wrong_ca() {
    let db = TestDb::new().await;
    let (cert, name) = server_certificate(&db).await;
    let url = |host: &str, rest: &str| -> DatabaseUrl {
        format!("postgres://custodian_app@{host}:5432/{}?hostaddr=127.0.0.1&{rest}", db.name).parse().unwrap()
    };

    let verified = url(&name, &format!("sslmode=verify-full&sslrootcert={cert}"));
    assert_eq!(encrypted(&verified).await, Ok(true), "verify-full with the server's CA and name");

    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_owned(), name.clone()]).unwrap();
    let wrong_ca = std::env::temp_dir().join(format!("custodian-wrong-ca-{}.pem", std::process::id()));
    std::fs::write(&wrong_ca, other.cert.pem()).unwrap();
    let refused = encrypted(&url(&name, &format!("sslmode=verify-full&sslrootcert={}", wrong_ca.display()))).await;
    assert!(refused.as_ref().is_err_and(|e| e.contains("UnknownIssuer")), "a wrong CA is refused: {refused:?}");

    let wrong_name =
        encrypted(&url("custodian-not-this-host.invalid", &format!("sslmode=verify-full&sslrootcert={cert}"))).await;
    assert!(wrong_name.is_err(), "a certificate for another name is refused: {wrong_name:?}");
    let chain_only = url("custodian-not-this-host.invalid", &format!("sslmode=verify-ca&sslrootcert={cert}"));
    assert_eq!(encrypted(&chain_only).await, Ok(true), "verify-ca checks the chain, not the name");

    assert_eq!(encrypted(&url(&name, "sslmode=require")).await, Ok(true), "require encrypts");
    let loopback: DatabaseUrl = db.url.expose().parse().unwrap();
    assert_eq!(encrypted(&loopback).await, Ok(false), "plaintext stays the default on loopback");
    assert!(
        "postgres://app@db/x?sslmode=verify-full".parse::<DatabaseUrl>().is_err(),
        "verify-full without a CA is refused when the URL is read"
    );
    let _ = std::fs::remove_file(wrong_ca);
}
