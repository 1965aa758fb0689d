//! Several nodes per chain: two anvils carrying one chain, one of which goes away while `serve`
//! pays withdrawals and scans; a node on another chain that is never used; a Bitcoin node that
//! stops answering.

use std::sync::Arc;
use std::time::Duration;

use alloy_primitives::U256;
use custodian_domain::{AccountId, Amount, Asset, Chain, ChainAddress, EthAddress, ExternalId};
use custodian_testkit::btcsim::BitcoinSim;
use custodian_testkit::{eventually, Anvil, TestDb};
use custodian_withdrawals::request::{self, Request};
use custodian_withdrawals::{hot_wallet, EthNode, LocalSigner, Signer};
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::harness::custodian;
use crate::serve::{config_file, http_get, Served, LANE_KEYS};

/// Two anvils as one chain (DESIGN §9: several nodes of one network): `a` mines and `b` takes
/// exactly `a`'s blocks (the same transactions at the same timestamps, so the same hashes) until
/// `a` is gone; then `b` mines alone. What the service broadcast reaches both pools.
struct TwoNodes {
    a: Mutex<Option<Anvil>>,
    b: Anvil,
    timestamp: std::sync::atomic::AtomicU64,
}

async fn call(node: &Anvil, method: &str, params: Value) -> Value {
    node.rpc(method, params).await.unwrap_or_else(|e| panic!("{method}: {e}"))
}

impl TwoNodes {
    async fn start() -> Arc<TwoNodes> {
        let a = Anvil::spawn_shared_genesis(&["--no-mining"]).await.expect("anvil a");
        let b = Anvil::spawn_shared_genesis(&["--no-mining"]).await.expect("anvil b");
        let genesis: u64 = custodian_testkit::anvil::SHARED_GENESIS_TIMESTAMP.parse().unwrap();
        Arc::new(TwoNodes { a: Mutex::new(Some(a)), b, timestamp: genesis.into() })
    }

    fn urls(&self, a_url: &str) -> String {
        format!("{a_url},{}", self.b.url)
    }

    /// One block on the chain.
    async fn mine(&self) {
        let timestamp = self.timestamp.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        let a = self.a.lock().await;
        let Some(a) = a.as_ref() else {
            call(&self.b, "evm_mine", json!([timestamp])).await;
            return;
        };
        call(a, "evm_mine", json!([timestamp])).await;
        let block = call(a, "eth_getBlockByNumber", json!(["latest", false])).await;
        // A broadcast can reach b between emptying its pool and mining, which would put one more
        // transaction in b's block: then b goes back to before the block and tries again.
        for _ in 0..20 {
            let before = call(&self.b, "evm_snapshot", json!([])).await;
            call(&self.b, "anvil_dropAllTransactions", json!([])).await;
            for tx in block["transactions"].as_array().expect("transactions") {
                let raw = call(a, "eth_getRawTransactionByHash", json!([tx])).await;
                // The service's own broadcast may have put it back in b's pool since the drop:
                // then it is there, as wanted.
                if let Err(e) = self.b.rpc("eth_sendRawTransaction", json!([raw])).await {
                    assert!(e.to_string().contains("already imported"), "eth_sendRawTransaction: {e}");
                }
            }
            call(&self.b, "evm_mine", json!([timestamp])).await;
            let theirs = call(&self.b, "eth_getBlockByNumber", json!(["latest", false])).await;
            if theirs["hash"] == block["hash"] {
                return;
            }
            call(&self.b, "evm_revert", json!([before])).await;
        }
        panic!("the two nodes could not be kept on one chain");
    }

    async fn kill_a(&self) -> u64 {
        let a = self.a.lock().await.take().expect("a is running");
        let head = u64::from_str_radix(
            call(&a, "eth_blockNumber", json!([])).await.as_str().unwrap().trim_start_matches("0x"),
            16,
        )
        .unwrap();
        drop(a);
        head
    }

    async fn balance(&self, address: &str) -> U256 {
        let hex = call(&self.b, "eth_getBalance", json!([address, "latest"])).await;
        U256::from_str_radix(hex.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
    }
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.pool.get().await.unwrap().query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn serve_pays_and_scans_on_when_one_of_two_nodes_goes_away() {
    let nodes = TwoNodes::start().await;
    let a_url = nodes.a.lock().await.as_ref().unwrap().url.clone();
    let urls = nodes.urls(&a_url);
    let db = TestDb::new().await;
    let node = EthNode::new(&urls).unwrap();
    for (lane, key) in [("a", LANE_KEYS[0]), ("b", LANE_KEYS[1])] {
        let signer = LocalSigner::from_hex(key).unwrap();
        let mut client = db.pool.get().await.unwrap();
        hot_wallet::add(&mut client, &node, lane, EthAddress::from_alloy(signer.address()), "ops").await.unwrap();
    }
    let alice: i64 = {
        let client = db.client().await;
        let id: i64 = client
            .query_one("insert into account (external_ref) values ('alice') returning id", &[])
            .await
            .unwrap()
            .get(0);
        custodian_testkit::fixtures::credit_eth(&client, id, 0, 100 * 1_000_000_000_000_000_000).await;
        id
    };
    let miner = tokio::spawn({
        let nodes = nodes.clone();
        async move {
            loop {
                nodes.mine().await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    });
    let config = config_file(
        "failover",
        &format!(
            "[eth]\nchain_id = 31337\n[hot_keys.a]\nkey = \"{}\"\n[hot_keys.b]\nkey = \"{}\"\n",
            LANE_KEYS[0], LANE_KEYS[1]
        ),
    );
    let served = Served::start_at(db.url.expose(), &urls, &config, "failover");
    let destination = |n: u64| format!("0x{:040x}", 0x5151_0000u64 + n);
    let ask = |from: u64, to: u64| {
        let db = &db;
        async move {
            for n in from..to {
                let r = Request {
                    account_id: AccountId::new(alice),
                    external_id: ExternalId::parse(&format!("failover-{n}")).unwrap(),
                    asset: Asset::Native(Chain::Eth),
                    destination: ChainAddress::Eth(EthAddress::parse(&destination(n)).unwrap()),
                    amount: Amount::from_units(U256::from(1_000_000 + n)),
                    requested_by: "wallet-app".to_owned(),
                };
                request::request(&db.pool, &r).await.expect("requested");
            }
        }
    };
    ask(0, 10).await;
    eventually("some withdrawals paid while both nodes run", Duration::from_secs(90), || async {
        (nodes.balance(&destination(0)).await > U256::ZERO).then_some(())
    })
    .await;
    let killed_at = nodes.kill_a().await;
    ask(10, 20).await;
    eventually("every withdrawal confirmed through the node that is left", Duration::from_secs(120), || async {
        (count(&db, "select count(*) from withdrawal where state = 'confirmed'").await == 20).then_some(())
    })
    .await;
    eventually("the scanner reads on past the node that went away", Duration::from_secs(60), || async {
        // (The scan cursor: the fixture's credit sits in a made-up block far above the chain.)
        let tip = count(&db, "select coalesce(max(next_height), 0) - 1 from scan_cursor where chain = 'eth'").await;
        (u64::try_from(tip).unwrap() >= killed_at + 5).then_some(())
    })
    .await;
    let metrics = http_get(&served.metrics, "/metrics").await;
    assert!(
        metrics.lines().any(|l| l.starts_with("custodian_node_failovers_total{chain=\"eth\"}")),
        "the failover is counted:\n{metrics}"
    );
    miner.abort();
    let (code, log) = served.terminate();
    assert_eq!(code, 0, "{log}");

    for n in 0..20u64 {
        assert_eq!(
            nodes.balance(&destination(n)).await,
            U256::from(1_000_000 + n),
            "paid exactly once on the chain left"
        );
    }
    assert_eq!(
        count(&db, "select count(*) from chain_block where orphaned_at is not null").await,
        0,
        "one chain, no reorg"
    );
    assert_eq!(
        count(&db, "select count(*) from (select from_address, nonce from nonce_allocation group by 1, 2 having count(*) > 1) d").await,
        0
    );
    assert_eq!(
        count(
            &db,
            "select count(*) from (select withdrawal_id from withdrawal_attempt group by 1 having count(*) > 1) d"
        )
        .await,
        0,
        "nothing re-signed"
    );
    let verified = custodian(db.url.expose(), &["replay", "--verify"]);
    assert_eq!(verified.code, 0, "{}", verified.stdout);
    let _ = std::fs::remove_file(config);
}

#[tokio::test]
async fn a_node_on_another_chain_is_never_used() {
    let a = Anvil::spawn().await.unwrap();
    let other = Anvil::spawn_with(&["--chain-id", "999"]).await.unwrap();
    let node = EthNode::new(&format!("{},{}", a.url, other.url)).unwrap();
    assert_eq!(node.chain_id().await.unwrap(), 31337);
    // Both read before anything is sent: a broadcast checks every node.
    let refused = node.send_raw(&[0xde, 0xad]).await.unwrap_err().to_string();
    assert!(!refused.contains("999"), "the refusal is the good node's answer: {refused}");
    drop(a);
    let error = node.block_number().await.unwrap_err().to_string();
    assert!(error.contains("refused") && error.contains("chain id 999"), "{error}");
    // The CLI refuses the same list at the scanner's identity check only if the first node is
    // wrong; here the reference is the first node, so the other is simply never asked again.
    assert!(node.chain_id().await.is_err(), "never an answer from the other chain");
}

#[tokio::test]
async fn a_bitcoin_node_that_stops_answering_is_failed_over() {
    use custodian_store::btc_rpc::{BtcAuth, BtcRpc};
    let sim = BitcoinSim::start().await;
    sim.mine_empty(3);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let auth = BtcAuth::UserPassword { user: sim.user().to_owned(), password: sim.password().to_owned() };
    let rpc = BtcRpc::new(&format!("{gone},{}", sim.url()), auth).unwrap();
    let height = rpc.call("getblockcount", json!([])).await.unwrap().unwrap();
    assert_eq!(height, json!(sim.height()));
    // A broadcast goes to every node: the one that is gone cannot stop it.
    let refused = rpc.call("sendrawtransaction", json!(["00"])).await.expect("a node answered");
    assert_eq!(refused.unwrap_err().code, -22, "Core's decode error, from the node that answered");
    sim.set_unavailable(true);
    assert!(rpc.call("getblockcount", json!([])).await.is_err(), "no node answers: an error, not a guess");
    sim.set_unavailable(false);
    assert_eq!(rpc.call("getblockcount", json!([])).await.unwrap().unwrap(), json!(sim.height()));
}
