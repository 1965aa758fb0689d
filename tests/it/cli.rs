//! `migrate`, `status`, exit codes, and the test harness's own anvil launcher.

use custodian_testkit::{Anvil, TestDb};

use crate::harness::{custodian, custodian_env};

#[tokio::test]
async fn migrate_then_status_reports_an_up_to_date_schema() {
    let db = TestDb::new().await;
    let empty = format!("{}_fresh", db.name);
    db.owner_client().await.batch_execute(&format!("create database \"{empty}\"")).await.unwrap();
    let url = db.url.with_dbname(&empty);
    let owner = db.owner_url.with_dbname(&empty);
    let both = [("CUSTODIAN_DATABASE_URL", url.expose()), ("CUSTODIAN_MIGRATE_DATABASE_URL", owner.expose())];

    let before = custodian(url.expose(), &["status", "--json"]);
    assert_eq!(before.code, 0, "{}", before.stderr);
    assert_eq!(before.json()["database"]["schema_version"], serde_json::Value::Null);
    assert_eq!(before.json()["database"]["up_to_date"], false);

    let first = custodian_env(&both, &["migrate", "--json"]);
    assert_eq!(first.code, 0, "{}", first.stderr);
    let latest = custodian_store::migrate::latest_version();
    assert_eq!(first.json()["applied"].as_array().map(Vec::len), Some(usize::try_from(latest).unwrap()));
    let second = custodian_env(&both, &["migrate", "--json"]);
    assert_eq!(second.code, 0, "{}", second.stderr);
    assert_eq!(second.json()["applied"], serde_json::json!([]), "re-running is a no-op");
    assert_eq!(second.json()["schema_version"], latest);

    let status = custodian(url.expose(), &["status", "--json", "--eth-rpc", "http://user:secret@node:8545"]);
    assert_eq!(status.code, 0, "{}", status.stderr);
    let report = status.json();
    assert_eq!(report["database"]["reachable"], true);
    assert_eq!(report["database"]["schema_version"], latest);
    assert_eq!(report["database"]["up_to_date"], true);
    assert_eq!(report["chains"][0]["chain"], "eth");
    assert_eq!(report["chains"][0]["configured"], true);
    assert_eq!(report["chains"][1]["configured"], false);
    assert!(!status.stdout.contains("secret"), "credentials in RPC URLs are masked");

    let text = custodian(url.expose(), &["status"]);
    assert!(text.stdout.contains("up to date"), "{}", text.stdout);
    db.superuser_client().await.batch_execute(&format!("drop database \"{empty}\" with (force)")).await.unwrap();
}

#[test]
fn an_unreachable_database_is_an_operational_error() {
    let run = custodian("postgres://postgres@127.0.0.1:1/custodian", &["status", "--json"]);
    assert_eq!(run.code, 1);
    assert_eq!(run.json()["database"]["reachable"], false);
    let run = custodian_env(
        &[("CUSTODIAN_MIGRATE_DATABASE_URL", "postgres://custodian_owner@127.0.0.1:1/custodian")],
        &["migrate"],
    );
    assert_eq!(run.code, 1);
    assert!(run.stderr.contains("could not connect to PostgreSQL"), "{}", run.stderr);
}

#[test]
fn under_json_an_error_is_json_too() {
    let run = custodian("not a url at all", &["balances", "--json"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert_eq!((run.json()["kind"].as_str(), run.json()["exit_code"].as_u64()), (Some("usage"), Some(2)));
    assert!(run.json()["error"].as_str().unwrap().contains("CUSTODIAN_DATABASE_URL"), "{}", run.stdout);
    let run = custodian("postgres://custodian_app@127.0.0.1:1/custodian", &["balances", "--json"]);
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!((run.json()["kind"].as_str(), run.json()["exit_code"].as_u64()), (Some("operational"), Some(1)));
    assert!(run.stderr.contains("could not connect"), "the person reading stderr sees it as before");
    // Value enums are listed and checked by the parser.
    let run = custodian("postgres://custodian_app@127.0.0.1:1/custodian", &["withdrawals", "--state", "lost"]);
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("possible values: requested"), "{}", run.stderr);
}

/// A database error is said once, in the server's words with its SQLSTATE: before, a refused
/// connection named its cause three times behind deadpool's "Error occurred while creating a new
/// object", and a refused read said "db error: ERROR: permission denied …" with no code.
#[tokio::test]
async fn a_database_error_is_said_once_in_the_servers_words() {
    let refused = custodian("postgres://custodian_app@127.0.0.1:1/custodian", &["balances", "--json"]);
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert_eq!(refused.stderr.matches("Connection refused").count(), 1, "{}", refused.stderr);
    assert!(!refused.stderr.contains("creating a new object"), "{}", refused.stderr);
    assert_eq!(refused.json()["error"].as_str(), refused.stderr.trim().strip_prefix("error: "), "one message");
    let status = custodian("postgres://custodian_app@127.0.0.1:1/custodian", &["status", "--json"]);
    let said = status.json()["database"]["error"].as_str().map(|e| e.matches("Connection refused").count());
    assert_eq!(said, Some(1), "{}", status.stdout);

    let db = TestDb::new().await;
    let reader = db.url.expose().replacen("custodian_app@", "custodian_reader@", 1);
    let denied = custodian(&reader, &["deposits"]);
    assert_eq!(denied.code, 1, "{}", denied.stderr);
    assert!(denied.stderr.contains("(SQLSTATE 42501)"), "{}", denied.stderr);
    assert_eq!(denied.stderr.matches("permission denied for table").count(), 1, "{}", denied.stderr);
    assert!(!denied.stderr.contains("db error"), "{}", denied.stderr);
}

#[test]
fn usage_errors_exit_with_2() {
    let run = custodian("postgres://postgres@127.0.0.1:5432/custodian", &["no-such-command"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    let run = custodian("not a url at all", &["status"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("CUSTODIAN_DATABASE_URL"), "{}", run.stderr);
}

#[tokio::test]
async fn the_anvil_launcher_answers_eth_chain_id() {
    let anvil = Anvil::spawn().await.expect("anvil starts (run `make setup` first)");
    let chain_id = anvil.rpc("eth_chainId", serde_json::json!([])).await.unwrap();
    assert_eq!(chain_id, "0x7a69", "anvil's default chain id is 31337");
    let second = Anvil::spawn().await.expect("a second anvil on another port");
    assert_ne!(anvil.port, second.port);
}

#[tokio::test]
async fn service_commands_refuse_a_superuser_or_the_schema_owner_with_exit_2() {
    let db = TestDb::new().await;
    let superuser = custodian_testkit::db::superuser_url().with_dbname(&db.name);
    for url in [superuser.expose(), db.owner_url.expose()] {
        for args in [&["balances"][..], &["status", "--json"], &["replay", "--verify"]] {
            let run = custodian(url, args);
            assert_eq!(run.code, 2, "{args:?} as {url}: {}{}", run.stdout, run.stderr);
            assert!(
                run.stderr.contains("refusing to run as the database role") && run.stderr.contains("custodian_app"),
                "the refusal names the role to use: {}",
                run.stderr
            );
        }
    }
    let run = custodian(db.url.expose(), &["balances"]);
    assert_eq!(run.code, 0, "custodian_app runs: {}", run.stderr);
}

#[tokio::test]
async fn passwords_never_appear_in_status_logs_or_errors_in_any_url_form() {
    let db = TestDb::new().await;
    // Local development trusts custodian_app on loopback, so the (ignored) passwords still
    // connect, and an unreachable port produces the error path.
    let secret = "pa@ss:w/rd";
    let encoded = "pa%40ss%3Aw%2Frd";
    let name = &db.name;
    let forms = [
        format!("postgres://custodian_app:{encoded}@127.0.0.1:5432/{name}"),
        format!("host=127.0.0.1 port=5432 user=custodian_app password='{secret}' dbname={name}"),
        format!("postgres://custodian_app@127.0.0.1:5432/{name}?password={encoded}"),
        format!("postgres://custodian_app:{encoded}@127.0.0.1:1/{name}"),
        format!("host=127.0.0.1 port=1 user=custodian_app password='{secret}' dbname={name}"),
    ];
    for url in &forms {
        for args in [&["status"][..], &["status", "--json"], &["balances"]] {
            let run = custodian_env(&[("CUSTODIAN_DATABASE_URL", url), ("CUSTODIAN_LOG", "debug")], args);
            let printed = format!("{}{}", run.stdout, run.stderr);
            for leaked in [secret, encoded, "pa@ss", "pa%40ss"] {
                assert!(!printed.contains(leaked), "{args:?} with {url} printed {leaked:?}:\n{printed}");
            }
        }
        let reachable = !url.contains(":1/") && !url.contains("port=1 ");
        let status = custodian_env(&[("CUSTODIAN_DATABASE_URL", url)], &["status", "--json"]);
        assert_eq!(status.json()["database"]["reachable"], reachable, "{url}: {}", status.stdout);
        assert!(status.json()["database"]["url"].as_str().unwrap().contains("***"), "{}", status.stdout);
    }
}

/// A CA and a certificate it signed for localhost, as PEM: (ca, cert, key).
fn localhost_certificate() -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

// Two threads: the binary runs as a blocking child while the TLS fronts relay on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_node_urls_work_for_both_chains_when_their_ca_is_trusted() {
    use custodian_testkit::tls_proxy::TlsProxy;
    let db = TestDb::new().await;
    let anvil = Anvil::spawn().await.unwrap();
    let sim = custodian_testkit::BitcoinSim::start().await;
    sim.mine_empty(2);
    let (ca, cert, key) = localhost_certificate();
    let eth = TlsProxy::start(([127, 0, 0, 1], anvil.port).into(), &cert, &key).await.unwrap();
    let btc = TlsProxy::start(([127, 0, 0, 1], sim.port()).into(), &cert, &key).await.unwrap();
    let dir = std::env::temp_dir();
    let trusted = dir.join(format!("custodian-test-ca-{}.pem", std::process::id()));
    let (other_ca, _, _) = localhost_certificate();
    let untrusted = dir.join(format!("custodian-other-ca-{}.pem", std::process::id()));
    std::fs::write(&trusted, ca).unwrap();
    std::fs::write(&untrusted, other_ca).unwrap();
    let eth_url = format!("https://localhost:{}", eth.port);
    let btc_url = format!("https://localhost:{}", btc.port);
    let scans: [(&str, Vec<&str>); 2] = [
        ("eth", vec!["scan", "--chain", "eth", "--once", "--json", "--eth-rpc", &eth_url]),
        (
            "btc",
            vec![
                "scan",
                "--chain",
                "btc",
                "--once",
                "--json",
                "--btc-rpc",
                &btc_url,
                "--btc-network",
                "regtest",
                "--btc-rpc-user",
                sim.user(),
                "--btc-rpc-password",
                sim.password(),
            ],
        ),
    ];
    for (chain, args) in &scans {
        let env = |ca: &std::path::Path| {
            [("CUSTODIAN_DATABASE_URL", db.url.expose().to_owned()), ("SSL_CERT_FILE", ca.display().to_string())]
        };
        let refused = custodian_env(&env(&untrusted).each_ref().map(|(k, v)| (*k, v.as_str())), args);
        assert_eq!(refused.code, 1, "{chain} over https with an untrusted certificate: {}", refused.stderr);
        let scanned = custodian_env(&env(&trusted).each_ref().map(|(k, v)| (*k, v.as_str())), args);
        assert_eq!(scanned.code, 0, "{chain} over https: {}", scanned.stderr);
    }
    let blocks: i64 =
        db.pool.get().await.unwrap().query_one("select count(*) from chain_block", &[]).await.unwrap().get(0);
    assert!(blocks >= 2, "both chains were read over TLS: {blocks} blocks");
    let _ = (std::fs::remove_file(trusted), std::fs::remove_file(untrusted));
}

/// Every `CUSTODIAN_*` variable the example configuration and the README promise is one the
/// binary reads: a flag's variable (shown by `--help` of the command that takes it), or one of the
/// few read by name in code (the log filter, per-lane key variables, the crash test's seed).
#[test]
fn every_variable_the_documentation_promises_exists() {
    let mut help = String::new();
    let top = crate::harness::custodian_env(&[], &["--help"]);
    help.push_str(&top.stdout);
    let commands: Vec<String> = top
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() > 10, "{}", top.stdout);
    for command in &commands {
        help.push_str(&crate::harness::custodian_env(&[], &[command, "--help"]).stdout);
    }
    let read_by_name: [(&str, &str); 5] = [
        ("CUSTODIAN_LOG", include_str!("../../src/main.rs")),
        ("CUSTODIAN_HOT_KEY_", include_str!("../../src/secrets.rs")),
        ("CUSTODIAN_HOT_KEY_FILE_", include_str!("../../src/secrets.rs")),
        ("CUSTODIAN_BTC_HOT_KEY_FILE_", include_str!("../../service/src/keys.rs")),
        ("CUSTODIAN_CRASH_SEED", include_str!("crash.rs")),
    ];
    let documents = [include_str!("../../custodian.example.toml"), include_str!("../../README.md")];
    let mut promised: Vec<&str> = documents
        .iter()
        .flat_map(|d| d.match_indices("CUSTODIAN_").map(move |(i, _)| &d[i..]))
        .map(|rest| {
            let end =
                rest.find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).unwrap_or(rest.len());
            &rest[..end]
        })
        .filter(|name| name.len() > "CUSTODIAN_".len())
        .collect();
    promised.sort_unstable();
    promised.dedup();
    assert!(promised.len() > 15, "{promised:?}");
    for name in promised {
        let flagged = help.contains(&format!("[env: {name}")) || help.contains(&format!("[env: {name}="));
        let by_name =
            read_by_name.iter().any(|(known, source)| *known == name && source.contains(&format!("\"{known}")));
        assert!(flagged || by_name, "{name} is documented but nothing reads it");
    }
}
