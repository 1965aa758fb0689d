//! The whole withdrawal request path (#14): `custodian serve` on a fresh database, anvil with
//! 1-second blocks, two lanes, and tonic clients written against `proto/custodian/v1` in this
//! process — 8 and 64 concurrent clients, on one account and on 64 accounts. Printed per run:
//! accepted requests per second with p50/p95/p99 latency, then how many blocks and seconds until
//! every accepted withdrawal is mined; and, in the same run, two ceilings: the same clients calling
//! `Health/Check` (the transport and server), and the one-row PostgreSQL ceiling of the allocation
//! bench (the database). `REQUEST_PATH_SCALE` (default 1) multiplies the request counts.

mod common;

use common::{add_eth_lanes, one_row_ceiling, per_second, ratio, ETH_LANES};
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use custodian_api::pb::health_client::HealthClient;
use custodian_api::pb::withdrawals_client::WithdrawalsClient;
use custodian_api::pb::{request_withdrawal_request, CheckRequest, RequestWithdrawalRequest};
use custodian_testkit::{Anvil, TestDb};
use custodian_withdrawals::EthNode;
use serde_json::json;

fn percentiles(mut samples: Vec<Duration>) -> String {
    samples.sort_unstable();
    let at = |q: usize| {
        let micros = samples[(samples.len() * q / 100).min(samples.len() - 1)].as_micros();
        format!("{}.{}", micros / 1000, micros % 1000 / 100)
    };
    format!("p50 {} / p95 {} / p99 {} ms", at(50), at(95), at(99))
}

fn median(samples: &[Duration]) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    sorted[sorted.len() / 2]
}

struct Served {
    child: Child,
    grpc: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(db: &TestDb, anvil: &Anvil, config: &std::path::Path) -> Served {
    let mut command = Command::new(env!("CARGO_BIN_EXE_custodian"));
    for (key, _) in std::env::vars() {
        if key.starts_with("CUSTODIAN_") && key != "CUSTODIAN_ANVIL" {
            command.env_remove(key);
        }
    }
    let mut child = command
        .env("CUSTODIAN_DATABASE_URL", db.url.expose())
        .env("CUSTODIAN_LOG", "warn")
        .args(["serve", "--config"])
        .arg(config)
        .args(["--eth-rpc", &anvil.url, "--grpc-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--confirmations", "1"])
        // anvil answers debug_traceBlockByNumber by replaying the block once per transaction, each
        // replay recovering every signature before it: at a few hundred transactions a block the
        // scanner's traces alone keep both cores of this machine busy inside anvil (a node that
        // traces a block in one pass, as geth does, costs nothing like it). The bench measures the
        // request path, so its scanner reads blocks without traces.
        .args(["--eth-traces", "false"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(std::env::temp_dir().join("custodian-request-path-serve.log")).unwrap())
        .spawn()
        .expect("starting custodian serve");
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let grpc = loop {
        let line = lines.next().expect("serve printed its addresses").unwrap();
        if let Some(address) = line.strip_prefix("grpc listening on ") {
            break address.to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Served { child, grpc }
}

/// `clients` concurrent clients, each on its own connection, each sending `each` requests built
/// by `call(client, n)` one after another; returns every latency and the wall time.
async fn clients<F, Fut>(clients: usize, each: usize, call: F) -> (Vec<Duration>, Duration)
where
    F: Fn(usize, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let ready = std::sync::Arc::new(tokio::sync::Barrier::new(clients + 1));
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (call, ready) = (call.clone(), ready.clone());
            tokio::spawn(async move {
                ready.wait().await;
                let mut latencies = Vec::with_capacity(each);
                for n in 0..each {
                    let started = Instant::now();
                    call(c, n).await;
                    latencies.push(started.elapsed());
                }
                latencies
            })
        })
        .collect();
    ready.wait().await;
    let started = Instant::now();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    (all, started.elapsed())
}

async fn channel(grpc: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap()
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client().await.query_one(sql, &[]).await.unwrap().get(0)
}

async fn block_number(anvil: &Anvil) -> u64 {
    let hex = anvil.rpc("eth_blockNumber", json!([])).await.unwrap();
    u64::from_str_radix(hex.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
}

/// Waits until every withdrawal is mined or confirmed; returns blocks and seconds it took.
async fn mined(db: &TestDb, anvil: &Anvil, total: i64) -> (u64, Duration) {
    let (first, started) = (block_number(anvil).await, Instant::now());
    while count(db, "select count(*) from withdrawal where state in ('mined', 'confirmed')").await < total {
        assert!(started.elapsed() < Duration::from_secs(300), "not all mined after 5 minutes");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (block_number(anvil).await - first, started.elapsed())
}

#[tokio::main]
async fn main() {
    let scale: usize = std::env::var("REQUEST_PATH_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let anvil = Anvil::spawn_with(&["--block-time", "1"]).await.unwrap();
    let db = TestDb::new().await;
    let node = EthNode::new(&anvil.url).unwrap();
    add_eth_lanes(&db, &node).await;
    let client = db.client().await;
    let mut accounts = Vec::new();
    for n in 0..64 {
        let id: i64 = client
            .query_one("insert into account (external_ref) values ($1) returning id", &[&format!("acct-{n}")])
            .await
            .unwrap()
            .get(0);
        custodian_testkit::fixtures::credit_eth(&client, id, 0, 1_000_000_000_000_000_000_000).await;
        accounts.push(id);
    }
    let token = custodian_api::tokens::create(
        &db.pool.get().await.unwrap(),
        "bench",
        &custodian_api::tokens::Scope::ALL,
        custodian_api::tokens::BOOTSTRAP_PRINCIPAL,
    )
    .await
    .unwrap();
    let config = std::env::temp_dir().join(format!("custodian-request-path-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        format!(
            "[eth]\nchain_id = 31337\n[hot_keys.a]\nkey = \"{}\"\n[hot_keys.b]\nkey = \"{}\"\n[api]\nrequests_per_second = 1000000\nburst = 1000000\npeer_requests_per_second = 1000000\npeer_burst = 1000000\n",
            ETH_LANES[0].1, ETH_LANES[1].1
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        // It holds keys: the service refuses a configuration others can read.
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let served = serve(&db, &anvil, &config);
    // On a database of its own: its row must not become a lane of the service under test.
    let (n, t) = one_row_ceiling(&TestDb::new().await, 2_000).await;
    let db_ceiling = per_second(n, t);
    println!("request path through custodian serve (anvil, 1-second blocks, two lanes):");
    println!("  ceiling, database (select for update + update + commit on one row): {db_ceiling} txn/s");
    let mut total = 0i64;
    for (clients_n, accounts_n, each) in
        [(8usize, 1usize, 100 * scale), (64, 1, 20 * scale), (8, 64, 100 * scale), (64, 64, 20 * scale)]
    {
        let mut channels = Vec::new();
        for _ in 0..clients_n {
            channels.push(channel(&served.grpc).await);
        }
        let health = channels.clone();
        let (latencies, wall) = clients(clients_n, each, move |c, _| {
            let mut h = HealthClient::new(health[c].clone());
            async move {
                h.check(CheckRequest {}).await.unwrap();
            }
        })
        .await;
        let transport = per_second(latencies.len() as u64, wall);
        let (accounts, token) = (accounts.clone(), token.clone());
        let run = format!("{clients_n}-{accounts_n}");
        // The same requests twice: first new, then every one an idempotent hit.
        let send = |created: bool| {
            let (channels, accounts, token, run) = (channels.clone(), accounts.clone(), token.clone(), run.clone());
            move |c: usize, n: usize| {
                let mut w = WithdrawalsClient::new(channels[c].clone());
                let account = accounts[c % accounts_n];
                let mut request = tonic::Request::new(RequestWithdrawalRequest {
                    account_id: account,
                    external_id: format!("{run}-{c}-{n}"),
                    asset: "ETH".into(),
                    destination: format!("0x{:040x}", 0xde57_0000u64 + (c * 1000 + n) as u64),
                    amount: Some(request_withdrawal_request::Amount::AmountUnits("1000".into())),
                });
                request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
                async move {
                    assert_eq!(w.request_withdrawal(request).await.unwrap().into_inner().created, created);
                }
            }
        };
        let (latencies, wall) = clients(clients_n, each, send(true)).await;
        let accepted = per_second(latencies.len() as u64, wall);
        let new_p50 = median(&latencies);
        total += latencies.len() as i64;
        let (blocks, seconds) = mined(&db, &anvil, total).await;
        println!(
            "  {clients_n} clients, {accounts_n} account(s): {} accepted at {accepted}/s ({}), = {}x the database ceiling, {}x Health/Check ({transport}/s); all mined {blocks} blocks / {:.1} s after the last accept",
            latencies.len(),
            percentiles(latencies),
            ratio(accepted, db_ceiling),
            ratio(accepted, transport),
            seconds.as_secs_f64()
        );
        let (hits, wall) = clients(clients_n, each, send(false)).await;
        let hit_p50 = median(&hits);
        println!(
            "    the same requests resent, every one an idempotent hit: {}/s ({}), p50 {}x faster than a new request's",
            per_second(hits.len() as u64, wall),
            percentiles(hits),
            ratio(new_p50.as_micros() as u64, hit_p50.as_micros() as u64)
        );
    }
    drop(served);
    let _ = std::fs::remove_file(config);
}
