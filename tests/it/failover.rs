//! A PostgreSQL failover while `serve` takes withdrawal requests and credits deposits: a private
//! primary with a synchronous standby (`scripts/pg_standby.sh`), the service on a multi-host URL
//! with `target_session_attrs=read-write`, the primary stopped with `pg_ctl stop -m immediate`
//! and the standby promoted. The service must resume by itself, lose no acknowledged request,
//! pay nothing twice, and leave a ledger `replay --verify` accepts on the promoted server.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use alloy_primitives::U256;
use custodian_api::pb;
use custodian_testkit::{eventually, Anvil};
use serde_json::json;

use crate::harness::{custodian_as, custodian_env};
use crate::serve::{config_file, http_get, Served, LANE_KEYS};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/pg_standby.sh");
const ROLES_SQL: &str = include_str!("../../scripts/roles.sql");
const ETHER: u128 = 1_000_000_000_000_000_000;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn script(args: &[&str]) {
    let output = Command::new("bash").arg(SCRIPT).args(args).output().expect("running pg_standby.sh");
    assert!(
        output.status.success(),
        "pg_standby.sh {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The two servers; stopped and removed when dropped.
struct Pair {
    dir: PathBuf,
    primary: u16,
    standby: u16,
}

impl Pair {
    fn data(&self, which: &str) -> String {
        self.dir.join(which).to_str().unwrap().to_owned()
    }

    fn url(&self, user: &str, port: u16) -> String {
        format!("postgres://{user}@127.0.0.1:{port}/custodian")
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for which in ["primary", "standby"] {
            let _ = Command::new("bash").arg(SCRIPT).args(["stop", &self.data(which)]).output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private primary with the roles and a migrated ledger database, and its synchronous standby.
async fn pair() -> Pair {
    let dir = std::env::temp_dir().join(format!("custodian-failover-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pair = Pair { dir, primary: free_port(), standby: free_port() };
    script(&["primary", &pair.data("primary"), &pair.primary.to_string()]);
    let (admin, connection) = tokio_postgres::connect(
        &format!("host=127.0.0.1 port={} user=postgres dbname=postgres", pair.primary),
        tokio_postgres::NoTls,
    )
    .await
    .expect("the private primary answers");
    tokio::spawn(connection);
    admin.batch_execute(ROLES_SQL).await.expect("roles");
    admin.batch_execute("create database custodian owner custodian_owner").await.expect("database");
    let migrated = custodian_env(
        &[
            ("CUSTODIAN_DATABASE_URL", &pair.url("custodian_app", pair.primary)),
            ("CUSTODIAN_MIGRATE_DATABASE_URL", &pair.url("custodian_owner", pair.primary)),
        ],
        &["migrate"],
    );
    assert_eq!(migrated.code, 0, "{}", migrated.stderr);
    script(&["standby", &pair.data("standby"), &pair.standby.to_string(), &pair.primary.to_string(), "custodian"]);
    pair
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

fn bearer<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

/// Asks until the service acknowledges (the same external id each time: a retry is idempotent).
async fn acknowledged(grpc: &str, token: &str, account: i64, n: u64, to: &str) -> (i64, Duration) {
    let started = Instant::now();
    loop {
        let channel = tonic::transport::Channel::from_shared(format!("http://{grpc}")).unwrap().connect().await;
        if let Ok(channel) = channel {
            let mut client = pb::withdrawals_client::WithdrawalsClient::new(channel);
            let request = pb::RequestWithdrawalRequest {
                account_id: account,
                external_id: format!("failover-{n}"),
                asset: "ETH".to_owned(),
                destination: to.to_owned(),
                amount: Some(pb::request_withdrawal_request::Amount::AmountUnits((1_000_000 + n).to_string())),
            };
            match client.request_withdrawal(bearer(token, request)).await {
                Ok(answer) => return (answer.into_inner().withdrawal.expect("a withdrawal").id, started.elapsed()),
                Err(status) if matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown) => {}
                Err(status) => panic!("request {n} refused: {status}"),
            }
        }
        assert!(started.elapsed() < Duration::from_secs(60), "request {n} not acknowledged within a minute");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn destination(n: u64) -> String {
    format!("0x{:040x}", 0xfa11_0000u64 + n)
}

async fn balance(anvil: &Anvil, address: &str) -> U256 {
    let hex = anvil.rpc("eth_getBalance", json!([address, "latest"])).await.unwrap();
    U256::from_str_radix(hex.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn a_primary_failover_loses_no_acknowledged_request_and_pays_nothing_twice() {
    let pair = pair().await;
    assert!(pair.dir.join("standby/standby.signal").exists(), "the standby is a standby");
    let anvil = Anvil::spawn_with(&["--block-time", "1"]).await.unwrap();
    let multi_host = format!(
        "postgres://custodian_app@127.0.0.1:{},127.0.0.1:{}/custodian?target_session_attrs=read-write&connect_timeout=2",
        pair.primary, pair.standby
    );
    // Set-up through the primary: lanes, an operator, an account funded by a deposit fact, one
    // confirmation for deposits, and a deposit address anvil will pay.
    let primary = connect(&pair.url("custodian_app", pair.primary)).await;
    let setup = custodian_store::connect(&pair.url("custodian_app", pair.primary).parse().unwrap(), 2).await.unwrap();
    let operator = custodian_api::tokens::create(
        &setup.get().await.unwrap(),
        "operator",
        &custodian_api::tokens::Scope::ALL,
        custodian_api::tokens::BOOTSTRAP_PRINCIPAL,
    )
    .await
    .unwrap();
    let node = custodian_withdrawals::EthNode::new(&anvil.url).unwrap();
    {
        let pool = custodian_store::connect(&multi_host.parse().unwrap(), 2).await.unwrap();
        for (lane, key) in [("a", LANE_KEYS[0]), ("b", LANE_KEYS[1])] {
            let signer = custodian_withdrawals::LocalSigner::from_hex(key).unwrap();
            let mut client = pool.get().await.unwrap();
            custodian_withdrawals::hot_wallet::add(
                &mut client,
                &node,
                lane,
                custodian_domain::EthAddress::from_alloy(custodian_withdrawals::Signer::address(&signer)),
                "operator",
            )
            .await
            .unwrap();
        }
        let client = pool.get().await.unwrap();
        custodian_projections::policy::set_tier(
            &client,
            custodian_domain::Chain::Eth,
            "ETH",
            custodian_domain::Amount::ZERO,
            1,
            "operator",
        )
        .await
        .unwrap();
    }
    let alice: i64 = primary
        .query_one("insert into account (external_ref) values ('alice') returning id", &[])
        .await
        .unwrap()
        .get(0);
    custodian_testkit::fixtures::credit_eth(&primary, alice, 0, 10 * ETHER).await;
    let deposit_address = "0x00000000000000000000000000000000000d0d0d";
    let assigned = custodian_as(
        &multi_host,
        &operator,
        &["address", "assign", "--account", "alice", "--chain", "eth", "--address", deposit_address],
    );
    assert_eq!(assigned.code, 0, "{}", assigned.stderr);
    drop(primary);

    let config = config_file(
        "db-failover",
        &format!(
            "[eth]\nchain_id = 31337\n[hot_keys.a]\nkey = \"{}\"\n[hot_keys.b]\nkey = \"{}\"\n",
            LANE_KEYS[0], LANE_KEYS[1]
        ),
    );
    let served = Served::start_at(&multi_host, &anvil.url, &config, "db-failover");
    let pay = |wei: u128| {
        let anvil = &anvil;
        async move {
            let value = format!("0x{wei:x}");
            anvil
                .rpc(
                    "eth_sendTransaction",
                    json!([{"from": crate::eth_harness::FUNDER, "to": deposit_address, "value": value}]),
                )
                .await
                .unwrap();
        }
    };
    pay(ETHER).await;

    let mut acks: BTreeMap<u64, i64> = BTreeMap::new();
    let mut slowest = Duration::ZERO;
    for n in 0..30u64 {
        if n == 12 {
            // The primary dies with requests in flight; the standby is promoted.
            script(&["crash", &pair.data("primary")]);
            script(&["promote", &pair.data("standby")]);
            pay(2 * ETHER).await;
        }
        let (id, took) = acknowledged(&served.grpc, &operator, alice, n, &destination(n)).await;
        slowest = slowest.max(took);
        acks.insert(n, id);
    }

    // Everything from here is read from the promoted server.
    let promoted = connect(&pair.url("custodian_app", pair.standby)).await;
    let recovery: bool = promoted.query_one("select pg_is_in_recovery()", &[]).await.unwrap().get(0);
    assert!(!recovery, "the standby was promoted");
    for (n, id) in &acks {
        let row = promoted
            .query_opt("select external_id from withdrawal where id = $1", &[id])
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("acknowledged withdrawal {id} (request {n}) is not on the promoted server"));
        assert_eq!(row.get::<_, String>(0), format!("failover-{n}"));
    }
    eventually("every acknowledged withdrawal confirmed after the failover", Duration::from_secs(120), || async {
        (count(&promoted, "select count(*) from withdrawal where state = 'confirmed'").await == 30).then_some(())
    })
    .await;
    eventually("both deposits credited once", Duration::from_secs(60), || async {
        let credited = count(
            &promoted,
            "select count(*) from ledger_transfer t join deposit_event d on t.deposit_key = 'deposit:eth:' || d.tx_hash || ':native:0'
              where t.kind = 'deposit' and d.address = '0x00000000000000000000000000000000000d0d0d'",
        )
        .await;
        (credited >= 2).then_some(())
    })
    .await;
    let health = http_get(&served.metrics, "/healthz").await;
    assert!(health.starts_with("HTTP/1.1 200"), "the service resumed by itself:\n{health}");
    let (code, log) = served.terminate();
    assert_eq!(code, 0, "{log}");

    for n in 0..30u64 {
        assert_eq!(balance(&anvil, &destination(n)).await, U256::from(1_000_000 + n), "request {n} paid exactly once");
    }
    assert_eq!(
        count(&promoted, "select count(*) from (select from_address, nonce from nonce_allocation group by 1, 2 having count(*) > 1) d")
            .await,
        0
    );
    assert_eq!(
        count(
            &promoted,
            "select count(*) from (select withdrawal_id from withdrawal_attempt group by 1 having count(*) > 1) d"
        )
        .await,
        0,
        "nothing signed twice"
    );
    assert_eq!(
        count(&promoted, "select count(distinct tx_hash) from deposit_event where address = '0x00000000000000000000000000000000000d0d0d'")
            .await,
        2
    );
    let verified =
        custodian_env(&[("CUSTODIAN_DATABASE_URL", &pair.url("custodian_app", pair.standby))], &["replay", "--verify"]);
    assert_eq!(verified.code, 0, "{}{}", verified.stdout, verified.stderr);
    eprintln!("failover: the slowest acknowledgement took {slowest:?}");
    let _ = std::fs::remove_file(config);
}
