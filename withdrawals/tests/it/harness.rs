//! The ETH withdrawal harness: anvil with two hot-wallet lanes, a fresh database, the worker and
//! the helpers the withdrawal tests share. The withdrawal library's tests use it, and so do the
//! root's end-to-end tests of the binary (`tests/it/main.rs` includes this file by path): one
//! harness for both.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use alloy_primitives::U256;
use custodian_domain::withdrawal::WithdrawalState;
use custodian_domain::{AccountId, Amount, Asset, Chain, ChainAddress, EthAddress, ExternalId};
use custodian_projections::replay;
use custodian_testkit::{eventually, Anvil, TestDb};
use custodian_withdrawals::request::{self, Request, RequestError};
use custodian_withdrawals::{actions, hot_wallet, sql, EthNode, LocalSigner, Signer, Worker, WorkerConfig};
use serde_json::{json, Value};

/// anvil's dev keys 1 and 2 are the two hot wallets (lanes a and b); key 0 funds everything.
pub const LANE_KEYS: [(&str, &str); 2] = [
    ("a", "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d"),
    ("b", "0x5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a"),
];
pub const FUNDER: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";
pub const ETHER: u128 = 1_000_000_000_000_000_000;

pub struct Harness {
    pub anvil: Anvil,
    pub db: TestDb,
    pub node: EthNode,
    pub signers: HashMap<String, Arc<dyn Signer>>,
}

impl Harness {
    pub async fn start(anvil_args: &[&str]) -> Harness {
        let anvil = Anvil::spawn_with(anvil_args).await.unwrap();
        let db = TestDb::new().await;
        let node = EthNode::new(&anvil.url).unwrap();
        let mut signers: HashMap<String, Arc<dyn Signer>> = HashMap::new();
        for (lane, key) in LANE_KEYS {
            let signer = LocalSigner::from_hex(key).unwrap();
            let mut client = db.pool.get().await.unwrap();
            hot_wallet::add(&mut client, &node, lane, EthAddress::from_alloy(signer.address()), "ops").await.unwrap();
            signers.insert(lane.to_owned(), Arc::new(signer));
        }
        Harness { anvil, db, node, signers }
    }

    pub fn worker(&self, config: WorkerConfig) -> Worker {
        Worker::new(self.db.pool.clone(), self.node.clone(), self.signers.clone(), config)
    }

    pub async fn rpc(&self, method: &str, params: Value) -> Value {
        self.anvil.rpc(method, params).await.unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    pub async fn mine(&self, blocks: u64) {
        self.rpc("anvil_mine", json!([format!("0x{blocks:x}")])).await;
    }

    pub async fn balance(&self, address: &str) -> U256 {
        let hex = self.rpc("eth_getBalance", json!([address, "latest"])).await;
        U256::from_str_radix(hex.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
    }

    /// An account credited with `wei` by a confirmed deposit fact, as the posting pass would.
    pub async fn funded_account(&self, name: &str, wei: u128) -> i64 {
        let client = self.db.client().await;
        let id: i64 = client
            .query_one("insert into account (external_ref) values ($1) returning id", &[&name])
            .await
            .unwrap()
            .get(0);
        custodian_testkit::fixtures::credit_eth(&client, id, 0, wei).await;
        id
    }

    pub async fn request(
        &self,
        account: i64,
        external_id: &str,
        to: &str,
        wei: u128,
    ) -> Result<request::Requested, RequestError> {
        let r = Request {
            account_id: AccountId::new(account),
            external_id: ExternalId::parse(external_id).unwrap(),
            asset: Asset::Native(Chain::Eth),
            destination: ChainAddress::Eth(EthAddress::parse(to).unwrap()),
            amount: Amount::from_units(U256::from(wei)),
            requested_by: "wallet-app".to_owned(),
        };
        request::request(&self.db.pool, &r).await
    }

    pub async fn state(&self, id: i64) -> WithdrawalState {
        sql::load(&self.db.pool.get().await.unwrap(), id).await.unwrap().unwrap().state()
    }

    pub async fn available(&self, account: i64) -> String {
        let client = self.db.pool.get().await.unwrap();
        client
            .query_one(
                "select coalesce(sum(case direction when 'credit' then amount else -amount end), 0)::text
                   from ledger_posting where ledger_account = 'user:' || $1::bigint",
                &[&account],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// The ETH hot-wallet lane `name`.
    pub async fn lane(&self, name: &str) -> hot_wallet::Lane {
        let lanes = hot_wallet::lanes(&self.db.pool.get().await.unwrap()).await.unwrap();
        lanes.into_iter().find(|l| l.lane == name).unwrap()
    }

    /// The payload of withdrawal `id`'s `event_type` event, if it has one.
    pub async fn event_payload(&self, id: i64, event_type: &str) -> Option<Value> {
        let sql = "select payload from withdrawal_event where withdrawal_id = $1 and event_type = $2";
        self.db.pool.get().await.unwrap().query_opt(sql, &[&id, &event_type]).await.unwrap().map(|r| r.get(0))
    }

    pub async fn count(&self, sql: &str) -> i64 {
        self.db.pool.get().await.unwrap().query_one(sql, &[]).await.unwrap().get(0)
    }

    /// Runs passes (mining a block between them when automine is off) until `done` holds.
    pub async fn work_until(
        &self,
        worker: &Worker,
        mine_between: bool,
        what: &str,
        done: impl Fn(&Harness) -> futures::future::BoxFuture<'_, bool>,
    ) {
        for _ in 0..60 {
            worker.pass().await.unwrap();
            if done(self).await {
                return;
            }
            if mine_between {
                self.mine(1).await;
            }
        }
        panic!("gave up waiting for {what}");
    }

    pub async fn verify(&self) {
        let report = replay::verify(&mut self.db.pool.get().await.unwrap()).await.unwrap();
        assert!(report.verified(), "{:#?}", report.differences);
    }
}

pub fn config(confirmations: u64) -> WorkerConfig {
    WorkerConfig { confirmations, bump_after_blocks: 2, ..WorkerConfig::default() }
}

pub fn destination(i: u64) -> String {
    format!("0x{:040x}", 0x5151_0000u64 + i)
}

pub fn edge_destination(i: u64) -> String {
    format!("0x{:040x}", 0x5eed_0000u64 + i)
}

pub async fn mined(h: &Harness, hash: &Value) -> Value {
    eventually("a funder transaction to mine", Duration::from_secs(10), || async {
        let r = h.anvil.rpc("eth_getTransactionReceipt", json!([hash])).await.unwrap();
        (!r.is_null()).then_some(r)
    })
    .await
}

pub async fn work_until_state(h: &Harness, worker: &Worker, mine: bool, id: i64, state: WithdrawalState) {
    h.work_until(worker, mine, state.as_str(), move |h| Box::pin(async move { h.state(id).await == state })).await;
}

/// Requests 0.01 ETH withdrawals (keys `{key}-1`, `{key}-2`, …, to `destination(first + n)`) until
/// both lanes hold one, returning the first withdrawal's id by lane name and lane a's address.
pub async fn one_on_each_lane(h: &Harness, account: i64, key: &str, first: u64) -> (HashMap<String, i64>, String) {
    let mut by_lane: HashMap<String, i64> = HashMap::new();
    let mut n = 0;
    while by_lane.len() < 2 {
        n += 1;
        let w =
            h.request(account, &format!("{key}-{n}"), &destination(first + n), ETHER / 100).await.unwrap().withdrawal;
        by_lane.entry(w.lane().to_string()).or_insert(w.id().get());
    }
    let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
    let lane_a = lanes.iter().find(|l| l.lane == "a").unwrap().address.to_lowercase_hex();
    (by_lane, lane_a)
}

/// Requests until `lane` holds `n` withdrawals of 1 ETH, returning their ids in nonce order to be.
pub async fn on_one_lane(h: &Harness, account: i64, n: usize) -> (String, Vec<i64>) {
    let mut by_lane = std::collections::HashMap::<String, Vec<i64>>::new();
    for i in 0..64u64 {
        let w = h.request(account, &format!("lane-{i}"), &edge_destination(100 + i), ETHER).await.unwrap().withdrawal;
        let ids = by_lane.entry(w.lane().to_string()).or_default();
        ids.push(w.id().get());
        if ids.len() == n {
            let lane = w.lane();
            // The others are cancelled before signing: only this lane has anything in flight.
            for (other, ids) in &by_lane {
                if other.as_str() != lane.as_str() {
                    for id in ids {
                        actions::cancel(&mut h.db.pool.get().await.unwrap(), *id, "test").await.unwrap();
                    }
                }
            }
            let ids = by_lane.remove(lane.as_str()).unwrap();
            return (lane.to_owned().to_string(), ids);
        }
    }
    panic!("no lane got {n} withdrawals");
}
