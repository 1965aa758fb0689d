//! Bitcoin withdrawals (#13) against the Bitcoin Core simulator and real PostgreSQL: BTC hot
//! wallets from BIP-84 account keys, funded from outside and credited to treasury.

use std::str::FromStr;

use bitcoin::bip32::{DerivationPath, Xpriv};
use bitcoin::secp256k1::Secp256k1;
use custodian_testkit::fixtures::{posted_balance, Normal};
use custodian_testkit::{BitcoinSim, TestDb};

use crate::lifecycle::{btc_env, run, scan};

/// The regtest account key m/84'/1'/`account`' of the BIP-84 test vector's mnemonic, as `tprv`.
fn account_key(account: u32) -> Xpriv {
    let words = ["abandon"; 11].join(" ") + " about";
    let seed = custodian_testkit::fixtures::bip39_seed(&words);
    let master = Xpriv::new_master(bitcoin::Network::Regtest, &seed).unwrap();
    master.derive_priv(&Secp256k1::new(), &DerivationPath::from_str(&format!("m/84'/1'/{account}'")).unwrap()).unwrap()
}

/// Writes `text` to a fresh file with `mode`; returns its path.
fn key_file(dir: &std::path::Path, name: &str, text: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_btc_hot_wallet_from_a_bip84_account_key_is_funded_from_outside_and_credited_to_treasury() {
    let sim = BitcoinSim::start().await;
    let db = TestDb::new().await;
    let token = crate::harness::operator(&db).await;
    let env = btc_env(&db, &sim, Some(&token));
    let dir = tempdir();
    let key = account_key(0);
    let open = key_file(&dir, "open.key", &key.to_string(), 0o644);
    let refused = run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &open, "--lane", "b1"]).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("chmod 600"), "{}", refused.stderr);
    let public =
        key_file(&dir, "public.key", &bitcoin::bip32::Xpub::from_priv(&Secp256k1::new(), &key).to_string(), 0o600);
    let refused =
        run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &public, "--lane", "b1"]).await;
    assert_eq!(refused.code, 2, "a public key is not a hot wallet: {}", refused.stderr);
    let mainnet = key_file(
        &dir,
        "main.key",
        &{
            let master = Xpriv::new_master(bitcoin::Network::Bitcoin, &[7u8; 64]).unwrap();
            master
                .derive_priv(&Secp256k1::new(), &DerivationPath::from_str("m/84'/0'/0'").unwrap())
                .unwrap()
                .to_string()
        },
        0o600,
    );
    let refused =
        run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &mainnet, "--lane", "b1"]).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("configured for regtest"), "{}", refused.stderr);
    assert_eq!(
        db.client()
            .await
            .query_one("select count(*) from hot_wallet where chain = 'btc'", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        0,
        "nothing written"
    );

    // Money paid to the funding address before registration is not custody.
    // …/0/0 of the account, derived here with the bitcoin crate alone.
    let secp = Secp256k1::new();
    let child = key.derive_priv(&secp, &DerivationPath::from_str("m/0/0").unwrap()).unwrap();
    let funding_address = bitcoin::Address::p2wpkh(
        &bitcoin::CompressedPublicKey(child.private_key.public_key(&secp)),
        bitcoin::Network::Regtest,
    );
    let funding = funding_address.to_string();
    let before = sim.pay(&[(funding_address.clone(), bitcoin::Amount::from_sat(7_000))]);
    sim.mine(&[before]);
    let good = key_file(&dir, "hot.key", &key.to_string(), 0o600);
    let added =
        run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &good, "--lane", "b1", "--json"]).await;
    assert_eq!(added.code, 0, "{}", added.stderr);
    assert_eq!(added.json()["lane"]["funding_address"], funding.as_str(), "…/0/0 of the account");
    assert_eq!(added.json()["created"], true);
    let again =
        run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &good, "--lane", "b1", "--json"]).await;
    assert_eq!(again.json()["created"], false, "{}", again.stderr);
    assert!(!added.stdout.contains(&key.to_string()) && !added.stderr.contains(&key.to_string()), "never printed");

    // A top-up from outside: a deposit of the treasury, spendable once confirmed.
    let top_up = sim.pay(&[(funding_address, bitcoin::Amount::from_sat(50_000_000))]);
    sim.mine(&[top_up]);
    sim.mine_empty(10);
    scan(&db, &sim).await;
    let posted = run(env.clone(), &["post"]).await;
    assert_eq!(posted.code, 0, "{}", posted.stderr);
    let treasury = posted_balance(&db.client().await, "treasury", "BTC", Normal::Credit).await;
    assert_eq!(treasury, "50000000", "the top-up, and only what arrived after registration");
    let listed = run(env.clone(), &["hot-wallet", "list", "--json"]).await;
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let lane = listed.json().as_array().unwrap().iter().find(|l| l["lane"] == "b1").cloned().unwrap();
    assert_eq!(
        (lane["chain"].clone(), lane["spendable"].clone(), lane["coins"].clone()),
        (serde_json::json!("btc"), serde_json::json!("50000000"), serde_json::json!(1))
    );
    let verified = run(env.clone(), &["replay", "--verify"]).await;
    assert_eq!(verified.code, 0, "{}{}", verified.stdout, verified.stderr);
    // The chain holds both coins; the ledger holds the top-up and knows the earlier payment as an
    // observation it never credited (the address was not ours yet): nothing unexplained.
    let reconciled = run(env, &["reconcile", "--json"]).await;
    assert_eq!(reconciled.code, 0, "{}{}", reconciled.stdout, reconciled.stderr);
    let btc = reconciled.json()["assets"].as_array().unwrap().iter().find(|a| a["asset"] == "BTC").cloned().unwrap();
    assert_eq!(
        (btc["chain"].as_str(), btc["custody"].as_str(), btc["uncredited"].as_str(), btc["difference"].as_str()),
        (Some("50007000"), Some("50000000"), Some("7000"), Some("0"))
    );
}

/// A fresh directory for key files, removed with the process's temporary files.
fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("custodian-btc-keys-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

// ------------------------------------------------------------------------------------ payouts

use std::collections::HashMap;
use std::sync::Arc;

use bitcoin::{Address, Amount as Sats, OutPoint, Transaction, Txid};
use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::{
    AccountId, Asset, BtcAddress, BtcNetwork, Chain, ChainAddress, ExternalId, TxHash, WithdrawalId,
};
use custodian_testkit::btcsim::AddrKind;
use custodian_testkit::db::column;
use custodian_withdrawals::btc::node::BtcNode;
use custodian_withdrawals::btc::tx::FeeRate;
use custodian_withdrawals::btc::{BtcConfig, BtcWorker};
use custodian_withdrawals::btc_key::BtcHotKey;
use custodian_withdrawals::request::{self, Request, RequestError, Requested};
use custodian_withdrawals::{actions, hot_wallet, sql};

/// Two BTC lanes funded from outside, alice credited by a real deposit, on the simulator.
pub(crate) struct Payouts {
    pub(crate) sim: BitcoinSim,
    pub(crate) db: TestDb,
    keys: HashMap<String, Arc<BtcHotKey>>,
    funding: Vec<Address>,
    pub(crate) alice: i64,
}

fn quick(config: BtcConfig) -> BtcConfig {
    BtcConfig { network: BtcNetwork::Regtest, batch_wait: std::time::Duration::ZERO, ..config }
}

impl Payouts {
    /// `lanes` lanes, each funded with `coins` coins of `coin` satoshis; alice holds `alice` sats.
    pub(crate) async fn new(lanes: u32, coins: usize, coin: u64, alice: u64) -> Payouts {
        let sim = BitcoinSim::start().await;
        let db = TestDb::new().await;
        let deposit = sim.address(AddrKind::P2wpkh, 900);
        let alice_id = crate::ledger_support::new_account(&db, "alice", &deposit, 0).await;
        let mut keys = HashMap::new();
        let mut funding = Vec::new();
        for lane in 0..lanes {
            let key = BtcHotKey::parse(&account_key(lane).to_string(), BtcNetwork::Regtest).unwrap();
            let name = format!("b{lane}");
            let mut client = db.pool.get().await.unwrap();
            hot_wallet::add_btc(&mut client, &key, &name, sim.height(), "operator").await.unwrap();
            funding.push(key.funding_address());
            keys.insert(name, Arc::new(key));
        }
        let mut txs: Vec<Transaction> =
            funding.iter().map(|address| sim.pay(&vec![(address.clone(), Sats::from_sat(coin)); coins])).collect();
        txs.push(sim.pay(&[(deposit, Sats::from_sat(alice))]));
        sim.mine(&txs);
        sim.mine_empty(6);
        let p = Payouts { sim, db, keys, funding, alice: alice_id };
        p.scan().await;
        p
    }

    async fn scan(&self) {
        scan(&self.db, &self.sim).await;
    }

    pub(crate) fn worker(&self, config: BtcConfig) -> BtcWorker {
        let rpc = custodian_store::btc_rpc::BtcRpc::new(
            &self.sim.url(),
            custodian_store::btc_rpc::BtcAuth::UserPassword {
                user: self.sim.user().to_owned(),
                password: self.sim.password().to_owned(),
            },
        )
        .unwrap();
        BtcWorker::new(self.db.pool.clone(), BtcNode::new(rpc), self.keys.clone(), quick(config))
    }

    pub(crate) async fn request(&self, external_id: &str, to: &Address, sats: u64) -> Result<Requested, RequestError> {
        let r = Request {
            account_id: AccountId::new(self.alice),
            external_id: ExternalId::parse(external_id).unwrap(),
            asset: Asset::Native(Chain::Btc),
            destination: ChainAddress::Btc(BtcAddress::parse(&to.to_string(), BtcNetwork::Regtest).unwrap()),
            amount: custodian_domain::Amount::from_units(alloy_primitives::U256::from(sats)),
            requested_by: "client".into(),
        };
        request::request(&self.db.pool, &r).await
    }

    /// Withdrawal `w{n}` of 100,000 sats: its lane (a hash of its id) and its id.
    async fn request_n(&self, n: u32) -> (String, i64) {
        let to = self.sim.address(AddrKind::P2wpkh, 10 + n);
        let id = self.request(&format!("w{n}"), &to, 100_000).await.unwrap().withdrawal.id().get();
        (self.value(&format!("select lane from withdrawal where id = {id}")).await, id)
    }

    /// Requests until lanes b0 and b1 hold at least two each: their ids, b0's then b1's.
    async fn two_on_each_lane(&self) -> (Vec<i64>, Vec<i64>) {
        let mut on: HashMap<String, Vec<i64>> = HashMap::new();
        for n in 0..40u32 {
            if on.len() == 2 && on.values().all(|ids| ids.len() >= 2) {
                break;
            }
            let (lane, id) = self.request_n(n).await;
            on.entry(lane).or_default().push(id);
        }
        (on["b0"].clone(), on["b1"].clone())
    }

    async fn load(&self, id: i64) -> Withdrawal {
        sql::load(&self.db.pool.get().await.unwrap(), id).await.unwrap().unwrap()
    }

    async fn events(&self, id: i64) -> Vec<WithdrawalEvent> {
        sql::events(&self.db.pool.get().await.unwrap(), id).await.unwrap()
    }

    /// Passes of `workers` (together), mining what the mempool holds and scanning, until every
    /// one of `ids` is in a final state; at most `rounds`.
    /// Resolves withdrawal `id` in review on dana's authority, evidence buried one block deep.
    async fn resolve(
        &self,
        id: i64,
        resolution: actions::Resolution,
    ) -> Result<actions::Resolved, actions::ActionError> {
        actions::resolve_btc(&mut self.db.pool.get().await.unwrap(), id, &resolution, 1, "dana").await
    }

    /// A first payout (200,000 sats) that `worker` signs, bumps after two empty blocks, and sees
    /// mined in its original form by a miner that never saw the bump: its id, original and bump.
    async fn original_mined_over_its_bump(&self, worker: &BtcWorker) -> (i64, Transaction, Transaction) {
        let first =
            self.request("w1", &self.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal.id().get();
        worker.pass().await.unwrap();
        self.sim.mine_empty(2);
        self.scan().await;
        assert_eq!(worker.pass().await.unwrap().bumped, 1, "unmined for two blocks: bumped");
        let (original, bump) = (self.attempt_of(first, "original").await, self.attempt_of(first, "bump").await);
        self.sim.mine(std::slice::from_ref(&original));
        self.scan().await;
        worker.pass().await.unwrap();
        (first, original, bump)
    }

    /// A payout of `amount` sats to simulator address `n`, signed, sent and mined, and the worker
    /// told: its id.
    async fn mined_payout(&self, worker: &BtcWorker, external_id: &str, n: u32, amount: u64) -> i64 {
        let id = self
            .request(external_id, &self.sim.address(AddrKind::P2wpkh, n), amount)
            .await
            .unwrap()
            .withdrawal
            .id()
            .get();
        worker.pass().await.unwrap();
        self.sim.mine_mempool();
        self.scan().await;
        worker.pass().await.unwrap();
        id
    }

    /// A payout of 100,000 sats that the worker signs spending the change of `first`'s mined
    /// original (the lane's only coin): its id, and the original's txid.
    async fn spending_the_change_of(&self, worker: &BtcWorker, first: i64) -> (i64, Txid) {
        let second =
            self.request("w2", &self.sim.address(AddrKind::P2wpkh, 3), 100_000).await.unwrap().withdrawal.id().get();
        worker.pass().await.unwrap();
        let parent = self.attempt_of(first, "original").await.compute_txid();
        assert_eq!(self.reserved_by(second).await, parent.to_string(), "the second spends the first's change");
        (second, parent)
    }

    /// A mined payout (`w1`) and a second (`w2`) spending its change; then a reorg replaces the
    /// block with the first by empty ones, and the pass sends it back (both wait in the mempool):
    /// the two ids and the first's txid.
    async fn parent_sent_back(&self, worker: &BtcWorker) -> (i64, i64, Txid) {
        let first = self.mined_payout(worker, "w1", 2, 200_000).await;
        let (second, parent) = self.spending_the_change_of(worker, first).await;
        self.sim.reorg(1, &[vec![], vec![]]);
        self.scan().await;
        assert_eq!(worker.pass().await.unwrap().unmined, 1);
        (first, second, parent)
    }

    /// The node's fee estimate rises to `sat_per_vb` and a block passes, scanned.
    async fn market_rises_to(&self, sat_per_vb: u64) {
        self.sim.set_fee_rate(Some(sat_per_vb));
        self.sim.mine_empty(1);
        self.scan().await;
    }

    /// The coin withdrawal `id`'s transaction reserved (its txid): one coin.
    async fn reserved_by(&self, id: i64) -> String {
        self.value(&format!(
            "select r.tx_hash from utxo_reservation r join btc_spend_payout p on p.spend_id = r.spend_id
              where p.withdrawal_id = {id}"
        ))
        .await
    }

    /// The transaction of withdrawal `id`'s attempt of `kind` (`original`, `bump`, `cancel`).
    async fn attempt_of(&self, id: i64, kind: &str) -> Transaction {
        let bytes: Vec<u8> = self
            .db
            .client()
            .await
            .query_one(
                "select a.raw_tx from btc_attempt a join btc_spend_payout p on p.spend_id = a.spend_id
                  where p.withdrawal_id = $1 and a.kind = $2",
                &[&id, &kind],
            )
            .await
            .unwrap()
            .get(0);
        bitcoin::consensus::deserialize(&bytes).unwrap()
    }

    /// A worker whose sessions give up on a row lock after 300 ms.
    async fn worker_giving_up_on_locks(&self, config: BtcConfig) -> BtcWorker {
        let url: custodian_store::DatabaseUrl =
            format!("{}?options=-c%20lock_timeout%3D300", self.db.url.expose()).parse().unwrap();
        let pool = custodian_store::pool::connect(&url, 4).await.unwrap();
        BtcWorker::new(pool, self.worker(config.clone()).node().clone(), self.keys.clone(), quick(config))
    }

    /// A transaction spending the one reserved coin (of 1,000,000 sats, lane b0's funding
    /// address) elsewhere, signed with the lane's key: the key used outside the service.
    async fn theft_of_the_reserved_coin(&self) -> Transaction {
        let row =
            self.db.client().await.query_one("select tx_hash, output_index from utxo_reservation", &[]).await.unwrap();
        let outpoint = OutPoint { txid: row.get::<_, String>(0).parse().unwrap(), vout: row.get::<_, i32>(1) as u32 };
        let mut theft = custodian_withdrawals::btc::tx::unsigned(
            &[&custodian_withdrawals::btc::tx::Coin {
                outpoint,
                amount: 1_000_000,
                path: custodian_withdrawals::btc_key::KeyPath::Funding,
            }],
            vec![custodian_withdrawals::btc::tx::pay(self.sim.address(AddrKind::P2wpkh, 66).script_pubkey(), 990_000)],
        );
        self.keys["b0"]
            .sign(&mut theft, &[(custodian_withdrawals::btc_key::KeyPath::Funding, Sats::from_sat(1_000_000))]);
        theft
    }

    pub(crate) async fn settle(&self, workers: &[&BtcWorker], ids: &[i64], rounds: usize) {
        for _ in 0..rounds {
            futures::future::join_all(workers.iter().map(|w| w.pass())).await.into_iter().for_each(|r| {
                r.unwrap();
            });
            self.sim.mine_mempool();
            self.scan().await;
            let mut done = true;
            for id in ids {
                done &=
                    !self.load(*id).await.holds_funds() || self.load(*id).await.state() == WithdrawalState::NeedsReview;
            }
            if done {
                return;
            }
        }
        panic!("not settled after {rounds} rounds");
    }

    async fn value(&self, sql: &str) -> String {
        self.db.client().await.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// Every transaction of the active chain, by txid.
    fn chain_txs(&self) -> HashMap<Txid, Transaction> {
        (0..=self.sim.height())
            .flat_map(|h| self.sim.block(self.sim.block_hash(h).unwrap()).unwrap().txdata)
            .map(|tx| (tx.compute_txid(), tx))
            .collect()
    }

    async fn verify(&self) {
        let env = btc_env(&self.db, &self.sim, None);
        let verified = run(env.clone(), &["replay", "--verify"]).await;
        assert_eq!(verified.code, 0, "{}{}", verified.stdout, verified.stderr);
        let reconciled = run(env, &["reconcile", "--json"]).await;
        assert_eq!(reconciled.code, 0, "custody equals our coins: {}{}", reconciled.stdout, reconciled.stderr);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_btc_withdrawals_from_eight_clients_sent_twice_are_each_paid_once_in_batches() {
    let p = Payouts::new(2, 20, 5_000_000, 100_000_000).await;
    let kinds = [AddrKind::P2pkh, AddrKind::P2shP2wpkh, AddrKind::P2wpkh, AddrKind::P2wsh, AddrKind::P2tr];
    let p = Arc::new(p);
    let mut clients = Vec::new();
    for client in 0..8u32 {
        let p = p.clone();
        clients.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for n in 0..5u32 {
                let i = client * 5 + n;
                let to = p.sim.address(kinds[(i % 5) as usize], 100 + i);
                let first = p.request(&format!("w{i}"), &to, 100_000 + u64::from(i)).await.unwrap();
                let again = p.request(&format!("w{i}"), &to, 100_000 + u64::from(i)).await.unwrap();
                assert!(first.created && !again.created);
                assert_eq!(first.withdrawal.id(), again.withdrawal.id());
                ids.push((first.withdrawal.id(), to, 100_000 + u64::from(i)));
            }
            ids
        }));
    }
    let mut wanted = Vec::new();
    for client in clients {
        wanted.extend(client.await.unwrap());
    }
    let config = BtcConfig { confirmations: 2, bump_after_blocks: 100, batch_max: 15, ..BtcConfig::default() };
    let (one, two) = (p.worker(config.clone()), p.worker(config));
    let ids: Vec<i64> = wanted.iter().map(|(id, ..)| id.get()).collect();
    p.settle(&[&one, &two], &ids, 12).await;

    // On chain: every destination paid exactly once, the exact amount.
    let txs = p.chain_txs();
    for (id, to, sats) in &wanted {
        let paid: Vec<u64> = txs
            .values()
            .flat_map(|tx| tx.output.iter())
            .filter(|o| o.script_pubkey == to.script_pubkey())
            .map(|o| o.value.to_sat())
            .collect();
        assert_eq!(paid, vec![*sats], "withdrawal {id} to {to}");
        assert_eq!(p.load(id.get()).await.state(), WithdrawalState::Confirmed, "withdrawal {id}");
    }
    // Batches: fewer transactions than withdrawals; each mined attempt's fee is inputs minus
    // outputs as the chain has it, and the ledger's fees add up to exactly that.
    let client = p.db.client().await;
    let mined: Vec<String> =
        column(&client, "select distinct tx_hash from withdrawal where chain = 'btc' and state = 'confirmed'", &[])
            .await;
    assert!(mined.len() < wanted.len() / 2, "batched: {} transactions for {}", mined.len(), wanted.len());
    let mut chain_fees = 0u64;
    for txid in &mined {
        let tx = &txs[&txid.parse::<Txid>().unwrap()];
        let inputs: u64 = tx
            .input
            .iter()
            .map(|i| txs[&i.previous_output.txid].output[i.previous_output.vout as usize].value.to_sat())
            .sum();
        let outputs: u64 = tx.output.iter().map(|o| o.value.to_sat()).sum();
        chain_fees += inputs - outputs;
        let stored: String =
            client.query_one("select fee::text from btc_attempt where tx_hash = $1", &[txid]).await.unwrap().get(0);
        assert_eq!(stored, (inputs - outputs).to_string(), "{txid}");
    }
    let posted = p
        .value(
            "select coalesce(sum(amount), 0)::text from ledger_posting
              where ledger_account = 'network_fees' and asset = 'BTC' and direction = 'debit'",
        )
        .await;
    assert_eq!(posted, chain_fees.to_string());
    // No coin reserved twice, none spent twice.
    let twice = p
        .value(
            "select count(*)::text from (select tx_hash, output_index from utxo_reservation
              group by 1, 2 having count(*) > 1) d",
        )
        .await;
    assert_eq!(twice, "0");
    p.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn btc_requests_are_refused_for_other_networks_dust_decimals_and_our_own_addresses() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let token = crate::harness::operator(&p.db).await;
    let env = btc_env(&p.db, &p.sim, Some(&token));
    let withdraw = |to: String, amount: &'static str, ext: &'static str| {
        let env = env.clone();
        async move {
            run(
                env,
                &[
                    "withdraw",
                    "--account",
                    "alice",
                    "--asset",
                    "BTC",
                    "--to",
                    &to,
                    "--amount",
                    amount,
                    "--external-id",
                    ext,
                    "--json",
                ],
            )
            .await
        }
    };
    let count = || p.value("select count(*)::text from withdrawal");
    let mainnet = "bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq".to_owned();
    let deposit = p.sim.address(AddrKind::P2wpkh, 900).to_string();
    let hot = p.funding[0].to_string();
    let p2wpkh = p.sim.address(AddrKind::P2wpkh, 5).to_string();
    let p2pkh = p.sim.address(AddrKind::P2pkh, 5).to_string();
    for (to, amount, why) in [
        (mainnet, "0.01", "not a regtest address"),
        (p2wpkh.clone(), "0.00000293", "dust limit of 294"),
        (p2pkh.clone(), "0.00000545", "dust limit of 546"),
        (p2wpkh.clone(), "0.000000001", "decimals"),
        (deposit, "0.01", "one of our own addresses"),
        (hot, "0.01", "one of our hot wallets"),
    ] {
        let refused = withdraw(to.clone(), amount, "x").await;
        assert_eq!(refused.code, 2, "{to} {amount}: {}{}", refused.stdout, refused.stderr);
        assert!(refused.stderr.contains(why), "{to} {amount}: {}", refused.stderr);
    }
    assert_eq!(count().await, "0", "nothing written");
    let accepted = withdraw(p2pkh, "0.00000546", "ok").await;
    assert_eq!(accepted.code, 0, "{}", accepted.stderr);
    assert_eq!(accepted.json()["withdrawal"]["asset"], "BTC");
    assert_eq!(count().await, "1");
}

/// A BTC config that bumps after one block and caps at `cap` sat/vB.
fn bumping(cap: u64) -> BtcConfig {
    BtcConfig { confirmations: 1, bump_after_blocks: 1, max_fee_rate: FeeRate::per_vb(cap), ..BtcConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_bytes_are_sent_after_a_crash_evictions_are_rebroadcast_and_a_rising_fee_market_replaces() {
    let p = Payouts::new(1, 2, 1_000_000, 50_000_000).await;
    let to = p.sim.address(AddrKind::P2wpkh, 7);
    let w = p.request("one", &to, 300_000).await.unwrap().withdrawal;
    // Killed after commit, before broadcast: the allocation is all there is.
    p.worker(bumping(50)).allocate_lane("b0").await.unwrap();
    let signed = p.load(w.id().get()).await;
    assert_eq!(signed.state(), WithdrawalState::Signed);
    let original = signed.tx_hash().unwrap().to_string();
    assert!(p.sim.mempool().is_empty(), "nothing was sent before the crash");
    let lane = hot_wallet::btc_lanes(&p.db.pool.get().await.unwrap()).await.unwrap().remove(0);
    assert_eq!(
        (lane.spendable.as_str(), lane.reserved.as_str(), lane.coins),
        ("1000000", "1000000", 2),
        "one coin reserved for the signed spend, the other still spendable"
    );
    // A new process sends exactly the stored bytes.
    let worker = p.worker(bumping(50));
    worker.pass().await.unwrap();
    assert_eq!(p.sim.mempool(), vec![original.parse::<Txid>().unwrap()], "the same transaction, not a new one");
    assert_eq!(p.load(w.id().get()).await.state(), WithdrawalState::Broadcast);
    // Evicted (a node restart): the next pass sends it again.
    assert!(p.sim.evict(original.parse().unwrap()));
    worker.pass().await.unwrap();
    assert_eq!(p.sim.mempool(), vec![original.parse::<Txid>().unwrap()]);
    // The fee market rises and blocks pass without it: a replacement, same customer output.
    p.sim.set_fee_rate(Some(20));
    p.sim.mine_empty(1);
    p.scan().await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.bumped, 1, "{report:?}");
    let bumped = p.load(w.id().get()).await;
    let replacement = bumped.live_attempt().unwrap().to_string();
    assert_ne!(replacement, original);
    assert_eq!(p.sim.mempool(), vec![replacement.parse::<Txid>().unwrap()], "the replacement took its place");
    let client = p.db.client().await;
    let attempts: Vec<(String, String)> = client
        .query("select tx_hash, kind from btc_attempt order by created_at", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(attempts, vec![(original.clone(), "original".into()), (replacement.clone(), "bump".into())]);
    // At the cap: recorded once, alerted, the withdrawal shows it.
    p.sim.set_fee_rate(Some(80));
    p.sim.mine_empty(1);
    p.scan().await;
    let capped = worker.pass().await.unwrap();
    assert_eq!((capped.bumped, capped.fee_cap_reached), (1, 0), "20 → 50 sat/vB (the cap) is still a bump");
    p.sim.mine_empty(1);
    p.scan().await;
    let capped = worker.pass().await.unwrap();
    assert_eq!((capped.bumped, capped.fee_cap_reached), (0, 1), "{capped:?}");
    assert!(p.load(w.id().get()).await.stuck_at_cap());
    assert_eq!(worker.pass().await.unwrap().fee_cap_reached, 0, "alerted once");
    // The last replacement mines and settles with its own fee; the others stay recorded.
    let live = p.load(w.id().get()).await.live_attempt().unwrap().to_string();
    p.settle(&[&worker], &[w.id().get()], 4).await;
    let done = p.load(w.id().get()).await;
    assert_eq!((done.state(), done.tx_hash().map(|h| h.to_string())), (WithdrawalState::Confirmed, Some(live.clone())));
    let fee: String =
        client.query_one("select fee::text from btc_attempt where tx_hash = $1", &[&live]).await.unwrap().get(0);
    assert!(
        matches!(p.events(w.id().get()).await.last(), Some(WithdrawalEvent::Confirmed { fee: f, .. }) if f.to_string() == fee)
    );
    assert_eq!(client.query_one("select count(*) from btc_attempt", &[]).await.unwrap().get::<_, i64>(0), 3);
    p.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn btc_cancels_before_signing_after_broadcast_and_refused_inside_a_batch() {
    let p = Payouts::new(1, 3, 1_000_000, 50_000_000).await;
    let before = crate::ledger_support::available(&p.db, p.alice).await;
    let worker = p.worker(BtcConfig { confirmations: 1, ..BtcConfig::default() });
    // Before signing: released at once.
    let early = p.request("early", &p.sim.address(AddrKind::P2wpkh, 1), 200_000).await.unwrap().withdrawal;
    let (cancelled, _) = actions::cancel(&mut p.db.pool.get().await.unwrap(), early.id().get(), "alice").await.unwrap();
    assert_eq!(cancelled.state(), WithdrawalState::Cancelled);
    // After broadcast: a replacement paying the coins back to us mines.
    let late = p.request("late", &p.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal;
    worker.pass().await.unwrap();
    let original = p.load(late.id().get()).await.tx_hash().unwrap().to_string();
    actions::cancel(&mut p.db.pool.get().await.unwrap(), late.id().get(), "alice").await.unwrap();
    let report = worker.pass().await.unwrap();
    assert_eq!(report.cancel_attempts, 1, "{report:?}");
    let cancel = p.load(late.id().get()).await.live_attempt().unwrap().to_string();
    assert_eq!(p.sim.mempool(), vec![cancel.parse::<Txid>().unwrap()], "the cancel replaced the original");
    p.settle(&[&worker], &[late.id().get()], 4).await;
    let done = p.load(late.id().get()).await;
    assert_eq!(
        (done.state(), done.tx_hash().map(|h| h.to_string())),
        (WithdrawalState::Cancelled, Some(cancel.clone()))
    );
    assert_ne!(cancel, original);
    let txs = p.chain_txs();
    let to = p.sim.address(AddrKind::P2wpkh, 2).script_pubkey();
    assert!(txs.values().all(|tx| tx.output.iter().all(|o| o.script_pubkey != to)), "nothing paid");
    let fee: u64 = p.value("select fee::text from btc_attempt where kind = 'cancel'").await.parse().unwrap();
    assert_eq!(crate::ledger_support::available(&p.db, p.alice).await, before, "the whole hold came back");
    let fees = p
        .value(
            "select coalesce(sum(amount), 0)::text from ledger_posting
              where ledger_account = 'network_fees' and asset = 'BTC' and direction = 'debit'",
        )
        .await;
    assert_eq!(fees, fee.to_string(), "the cancel's real fee left custody for the network");
    // A cancel inside a batch is refused; the batch stands.
    let a = p.request("a", &p.sim.address(AddrKind::P2wpkh, 3), 100_000).await.unwrap().withdrawal;
    let b = p.request("b", &p.sim.address(AddrKind::P2tr, 3), 100_000).await.unwrap().withdrawal;
    worker.pass().await.unwrap();
    assert_eq!(p.load(a.id().get()).await.tx_hash(), p.load(b.id().get()).await.tx_hash(), "one transaction pays both");
    let refused = actions::cancel(&mut p.db.pool.get().await.unwrap(), a.id().get(), "alice").await.unwrap_err();
    assert!(refused.to_string().contains("the batch stands"), "{refused}");
    p.settle(&[&worker], &[a.id().get(), b.id().get()], 4).await;
    assert_eq!(p.load(a.id().get()).await.state(), WithdrawalState::Confirmed);
    p.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_loses_to_the_original_mining_first() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 1, ..BtcConfig::default() });
    let w = p.request("w", &p.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal;
    worker.pass().await.unwrap();
    p.sim.mine_mempool();
    actions::cancel(&mut p.db.pool.get().await.unwrap(), w.id().get(), "alice").await.unwrap();
    p.scan().await;
    p.settle(&[&worker], &[w.id().get()], 4).await;
    assert_eq!(p.load(w.id().get()).await.state(), WithdrawalState::Confirmed, "the original paid");
    p.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reorged_payout_is_sent_again_and_settled_once() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, ..BtcConfig::default() });
    let w = p.request("w", &p.sim.address(AddrKind::P2wsh, 2), 200_000).await.unwrap().withdrawal;
    worker.pass().await.unwrap();
    let txid: Txid = p.load(w.id().get()).await.tx_hash().unwrap().to_string().parse().unwrap();
    p.sim.mine_mempool();
    p.scan().await;
    worker.pass().await.unwrap();
    assert_eq!(p.load(w.id().get()).await.state(), WithdrawalState::Mined);
    // The block is replaced by two without it.
    p.sim.reorg(1, &[vec![], vec![]]);
    p.scan().await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.unmined, 1, "{report:?}");
    assert!(p.sim.mempool().contains(&txid), "the mined bytes went out again");
    p.settle(&[&worker], &[w.id().get()], 6).await;
    let events = p.events(w.id().get()).await;
    let confirmed = events.iter().filter(|e| matches!(e, WithdrawalEvent::Confirmed { .. })).count();
    assert_eq!((p.load(w.id().get()).await.state(), confirmed), (WithdrawalState::Confirmed, 1));
    p.verify().await;
}

/// A spend its block was reorged out of is sent again as it was, and its age counts from the
/// block it had been mined in: before, the age still counted from its first broadcast, so a reorg
/// two blocks deep made it "unmined for 3 blocks" at once and it was replaced by a higher fee in
/// the very pass that sent it back (and, had a spend of its change followed it, the replacement
/// would have had to pay for that child too, BIP-125).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reorged_payout_is_not_bumped_in_the_pass_that_sends_it_back() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, bump_after_blocks: 3, ..BtcConfig::default() });
    let w = p.request("w", &p.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal;
    worker.pass().await.unwrap();
    let txid: Txid = p.load(w.id().get()).await.tx_hash().unwrap().to_string().parse().unwrap();
    p.sim.mine_mempool();
    p.sim.mine_empty(1);
    p.scan().await;
    worker.pass().await.unwrap();
    assert_eq!(p.load(w.id().get()).await.state(), WithdrawalState::Mined, "two blocks deep of three");
    // Both blocks are replaced by three without it: the tip is three above its first broadcast.
    p.sim.reorg(2, &[vec![], vec![], vec![]]);
    p.scan().await;
    let report = worker.pass().await.unwrap();
    assert_eq!((report.unmined, report.bumped), (1, 0), "{report:?}");
    assert!(p.sim.mempool().contains(&txid), "the mined bytes went out again, not a replacement");
    assert_eq!(p.load(w.id().get()).await.live_attempt().map(|h| h.to_string()), Some(txid.to_string()));
    p.settle(&[&worker], &[w.id().get()], 6).await;
    let done = p.load(w.id().get()).await;
    assert_eq!(
        (done.state(), done.tx_hash().map(|h| h.to_string())),
        (WithdrawalState::Confirmed, Some(txid.to_string()))
    );
    p.verify().await;
}

/// A confirmed payout whose block a reorg deeper than the confirmation depth took away, and
/// which the new branch does not mine again, is `needs_review` with an alert and the lane pauses,
/// as ETH's is (before, it stayed `confirmed`: the ledger said paid, the chain did not). The way
/// out: its bytes sent again (`rebroadcast_btc`), and once mined and buried, resolved paid by
/// that transaction, settled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_payout_reorged_out_deeper_than_the_depth_is_needs_review_until_paid_again() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 1, bump_after_blocks: 100, ..BtcConfig::default() });
    let w = p.request("w", &p.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal;
    let id = w.id().get();
    worker.pass().await.unwrap();
    p.sim.mine_mempool();
    p.scan().await;
    worker.pass().await.unwrap();
    assert_eq!(p.load(id).await.state(), WithdrawalState::Confirmed);
    let txid = p.load(id).await.tx_hash().unwrap().to_string();
    let settled = crate::ledger_support::available(&p.db, p.alice).await;

    p.sim.reorg(1, &[vec![], vec![]]);
    p.scan().await;
    let first = worker.pass().await.unwrap();
    assert_eq!(first.needs_review, 0, "one finding is not yet an alert: {first:?}");
    p.sim.mine_empty(1);
    p.scan().await;
    let again = worker.pass().await.unwrap();
    assert_eq!((again.needs_review, again.paused_lanes.clone()), (1, vec!["b0".to_owned()]), "{again:?}");
    let review = p.load(id).await;
    assert_eq!(review.state(), WithdrawalState::NeedsReview);
    let events = p.events(id).await;
    assert!(
        matches!(events.last(), Some(WithdrawalEvent::NeedsReview { reason }) if reason.contains("deeper than the confirmation depth")),
        "{events:?}"
    );

    // Nothing spent its coins: not resolvable yet, either way; its bytes go out again by hand.
    let early = p.resolve(id, actions::Resolution::PaidBy(txid.clone())).await.unwrap_err();
    assert!(early.to_string().contains("rebroadcast"), "{early}");
    let sent = actions::rebroadcast_btc(&p.db.pool.get().await.unwrap(), worker.node(), id).await.unwrap();
    assert_eq!(sent.to_string(), txid);
    assert!(p.sim.mempool().iter().any(|t| t.to_string() == txid), "sent again");
    p.sim.mine_mempool();
    p.scan().await;
    let not_paid = p.resolve(id, actions::Resolution::NotPaid).await.unwrap_err();
    assert!(not_paid.to_string().contains(&format!("resolve it --paid-by {txid}")), "{not_paid}");
    // A txid pasted in capitals is the same transaction.
    let resolved = p.resolve(id, actions::Resolution::PaidBy(txid.to_uppercase())).await.unwrap();
    assert_eq!((resolved.withdrawal.state(), resolved.paid), (WithdrawalState::Confirmed, true));
    assert_eq!(crate::ledger_support::available(&p.db, p.alice).await, settled, "settled once, not twice");
    p.verify().await;
}

/// A spend of our own change whose parent a reorg replaced by the parent's bump can never be
/// mined (the coin it spends was never created): it is `needs_review` with an alert and the lane
/// pauses, and it resolves `--not-paid` once the bump is buried. Before, it stayed `broadcast`
/// for good, its bytes refused each pass for missing inputs (a warning), its hold and coins held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spend_of_change_its_parent_lost_to_a_reorg_is_needs_review_and_resolves_not_paid() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 2, bump_after_blocks: 2, ..BtcConfig::default() });
    // A miner that never saw the bump mines the original; the lane's next payout spends its change.
    let (first, original, bump) = p.original_mined_over_its_bump(&worker).await;
    assert_eq!(p.load(first).await.state(), WithdrawalState::Mined);
    let second = p.request("w2", &p.sim.address(AddrKind::P2wpkh, 3), 100_000).await.unwrap().withdrawal.id().get();
    worker.pass().await.unwrap();
    let spent: String = p.reserved_by(second).await;
    assert_eq!(spent, original.compute_txid().to_string(), "the second payout spends the first's change");

    // The block with the original is replaced by one with its bump: the change never existed.
    p.sim.reorg(1, &[vec![bump.clone()], vec![]]);
    p.scan().await;
    let report = worker.pass().await.unwrap();
    assert_eq!((report.needs_review, report.paused_lanes.clone()), (1, vec!["b0".to_owned()]), "{report:?}");
    assert_eq!(p.load(second).await.state(), WithdrawalState::NeedsReview);
    let paid_first = p.load(first).await;
    assert_eq!(
        (paid_first.state(), paid_first.tx_hash().map(|h| h.to_string())),
        (WithdrawalState::Confirmed, Some(bump.compute_txid().to_string())),
        "its bump paid the first"
    );

    let before: u64 = crate::ledger_support::available(&p.db, p.alice).await.parse().unwrap();
    let paid = p.resolve(second, actions::Resolution::PaidBy(bump.compute_txid().to_string())).await.unwrap_err();
    assert!(paid.to_string().contains("can never be mined"), "{paid}");
    let resolved = p.resolve(second, actions::Resolution::NotPaid).await.unwrap();
    assert_eq!((resolved.withdrawal.state(), resolved.paid), (WithdrawalState::Cancelled, false));
    let after: u64 = crate::ledger_support::available(&p.db, p.alice).await.parse().unwrap();
    assert_eq!(after, before + 100_000, "the hold came back");
    assert_eq!(
        p.value(&format!(
            "select count(*)::text from utxo_reservation r join btc_spend_payout p on p.spend_id = r.spend_id
              where p.withdrawal_id = {second} and r.released_at is null"
        ))
        .await,
        "0",
        "its reservation released"
    );
    p.verify().await;
}

/// A payout a reorg sent back, whose change the lane's next payout already spends, is not
/// replaced when it ages: its replacement would take that change away from the next payout, which
/// could then never be mined (an alert, a paused lane and a customer asked to request again, all
/// of our own making). The next payout's bump, which spends the same change, pays for both (child
/// pays for parent: with the market risen to 20 sat/vB, the two pay about 20 sat/vB together, where
/// a bump priced on its own size left them at 10.5), and both are mined and confirmed; a cancel of
/// the first is refused for the same reason. Before, the first was bumped, the node dropped the
/// second with it, and once the bump was mined the second went to review.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reorged_payout_whose_change_is_spent_is_left_to_the_bump_of_its_spender() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, bump_after_blocks: 2, ..BtcConfig::default() });
    // The block with the first is replaced by empty ones; both wait in the mempool, unmined, until
    // they are old enough to be bumped.
    let (first, second, parent) = p.parent_sent_back(&worker).await;
    // A cancel would take the change away just the same: refused, nothing written.
    let refused = actions::cancel(&mut p.db.pool.get().await.unwrap(), first, "dana").await.unwrap_err();
    assert!(refused.to_string().contains("later payout of ours spends"), "{refused}");
    assert_eq!(p.load(first).await.state(), WithdrawalState::Broadcast);
    // Meanwhile the market rose to 20 sat/vB: the second's bump pays for both at that rate.
    p.market_rises_to(20).await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.bumped, 1, "{report:?}");
    assert_eq!(p.load(first).await.tx_hash().map(|h| h.to_string()), Some(parent.to_string()), "the first as it was");
    assert!(p.sim.mempool().contains(&parent));
    let (fees, vsize) = package(&p, &[parent, p.attempt_of(second, "bump").await.compute_txid()]).await;
    // About 20 sat/vB: a replacement's size is estimated before it is signed.
    assert!(fees >= 19 * vsize, "the two pay {fees} sats for {vsize} vB: below 20 sat/vB");
    p.settle(&[&worker], &[first, second], 8).await;
    assert_eq!(
        (p.load(first).await.state(), p.load(second).await.state()),
        (WithdrawalState::Confirmed, WithdrawalState::Confirmed)
    );
    assert_eq!(
        p.attempt_of(second, "bump").await.compute_txid().to_string(),
        p.load(second).await.tx_hash().unwrap().to_string()
    );
    p.verify().await;
}

/// What the transactions `txids` pay together and their size: fees in sats, vsize in vB.
async fn package(p: &Payouts, txids: &[Txid]) -> (u64, u64) {
    let listed: Vec<String> = txids.iter().map(|t| format!("'{t}'")).collect();
    let both: Vec<u64> = p
        .value(&format!(
            "select sum(fee)::text || ' ' || sum(vsize)::text from btc_attempt where tx_hash in ({})",
            listed.join(", ")
        ))
        .await
        .split(' ')
        .map(|n| n.parse().unwrap())
        .collect();
    (both[0], both[1])
}

/// Child pays for every unmined ancestor, not its parent alone: three payouts in a chain of
/// change (each spends the one before's), a reorg sends the first two back, and the market rises
/// to 20 sat/vB. Neither of the two is replaced (a later payout spends each one's change); the
/// third's bump pays for all three, about 20 sat/vB together, and all three are mined and
/// confirmed. Before, the bump paid for its parent alone and left the grandparent's shortfall:
/// the three paid 5,776 sats for 423 vB (13.7 sat/vB); now 8,455.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bump_pays_for_every_unmined_ancestor_whose_change_it_spends() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, bump_after_blocks: 2, ..BtcConfig::default() });
    let first = p.mined_payout(&worker, "w1", 2, 200_000).await;
    let second = p.mined_payout(&worker, "w2", 3, 100_000).await;
    let third = p.request("w3", &p.sim.address(AddrKind::P2wpkh, 4), 50_000).await.unwrap().withdrawal.id().get();
    worker.pass().await.unwrap();
    let (grandparent, parent) =
        (p.attempt_of(first, "original").await.compute_txid(), p.attempt_of(second, "original").await.compute_txid());
    assert_eq!(p.reserved_by(second).await, grandparent.to_string(), "the second spends the first's change");
    assert_eq!(p.reserved_by(third).await, parent.to_string(), "the third spends the second's change");

    // The blocks of the first two are replaced by empty ones: all three wait in the mempool.
    p.sim.reorg(2, &[vec![], vec![], vec![]]);
    p.scan().await;
    assert_eq!(worker.pass().await.unwrap().unmined, 2);
    p.market_rises_to(20).await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.bumped, 1, "the third alone: {report:?}");
    assert_eq!(
        (p.load(first).await.tx_hash(), p.load(second).await.tx_hash()),
        (Some(TxHash::Btc(grandparent)), Some(TxHash::Btc(parent))),
        "the first two as they were"
    );
    let bump = p.attempt_of(third, "bump").await.compute_txid();
    let (fees, vsize) = package(&p, &[grandparent, parent, bump]).await;
    // About 20 sat/vB: a replacement's size is estimated before it is signed.
    assert!(fees >= 19 * vsize, "the three pay {fees} sats for {vsize} vB: below 20 sat/vB");
    p.settle(&[&worker], &[first, second, third], 8).await;
    for id in [first, second, third] {
        assert_eq!(p.load(id).await.state(), WithdrawalState::Confirmed, "withdrawal {id}");
    }
    assert_eq!(p.load(third).await.tx_hash(), Some(TxHash::Btc(bump)));
    p.verify().await;
}

/// A cancel spends what its payout spent, so it needs the payout's unmined parent mined as much:
/// it pays for the parent too. With the market risen to 20 sat/vB after a reorg sent the parent
/// back, the cancel of the payout spending its change brings the two to about 20 sat/vB, and the
/// parent's withdrawal is confirmed and the cancelled one's hold released. Before, the cancel was
/// priced on its own size: the two paid 2,336 sats for 251 vB (9.3 sat/vB); now 5,015.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_of_a_payout_spending_an_unmined_parents_change_pays_for_the_parent() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, bump_after_blocks: 100, ..BtcConfig::default() });
    let (first, second, parent) = p.parent_sent_back(&worker).await;
    p.market_rises_to(20).await;
    let (_, requested) = actions::cancel(&mut p.db.pool.get().await.unwrap(), second, "dana").await.unwrap();
    assert!(requested);
    let report = worker.pass().await.unwrap();
    assert_eq!(report.cancel_attempts, 1, "{report:?}");
    let cancel = p.attempt_of(second, "cancel").await.compute_txid();
    let (fees, vsize) = package(&p, &[parent, cancel]).await;
    assert!(fees >= 19 * vsize, "the two pay {fees} sats for {vsize} vB: below 20 sat/vB");
    p.settle(&[&worker], &[first, second], 8).await;
    assert_eq!(
        (p.load(first).await.state(), p.load(second).await.state()),
        (WithdrawalState::Confirmed, WithdrawalState::Cancelled)
    );
    p.verify().await;
}

/// A second replacement raises what the package pays, not what the first paid on top of its own
/// size: the payout spending an unmined parent's change is bumped (the two at 20 sat/vB), then
/// cancelled; the cancel brings the two to 12.5% above that, about 22.5 sat/vB. Before, it was
/// priced on the bump's own rate, which held the parent's shortfall already, with the shortfall
/// added again at that rate: the two paid 11,785 sats for 251 vB (47 sat/vB), and each further
/// replacement compounded it until the fee cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_a_bump_pays_for_the_unmined_parent_once() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, bump_after_blocks: 2, ..BtcConfig::default() });
    let (first, second, parent) = p.parent_sent_back(&worker).await;
    p.market_rises_to(20).await;
    assert_eq!(worker.pass().await.unwrap().bumped, 1);
    let bump = p.attempt_of(second, "bump").await.compute_txid();
    let (fees, vsize) = package(&p, &[parent, bump]).await;
    assert!(fees >= 19 * vsize, "the two pay {fees} sats for {vsize} vB: below 20 sat/vB");
    let (_, requested) = actions::cancel(&mut p.db.pool.get().await.unwrap(), second, "dana").await.unwrap();
    assert!(requested);
    assert_eq!(worker.pass().await.unwrap().cancel_attempts, 1);
    let cancel = p.attempt_of(second, "cancel").await.compute_txid();
    let (fees, vsize) = package(&p, &[parent, cancel]).await;
    assert!((22 * vsize..=24 * vsize).contains(&fees), "the two pay {fees} sats for {vsize} vB: not about 22.5 sat/vB");
    p.settle(&[&worker], &[first, second], 8).await;
    assert_eq!(
        (p.load(first).await.state(), p.load(second).await.state()),
        (WithdrawalState::Confirmed, WithdrawalState::Cancelled)
    );
    p.verify().await;
}

/// The same for a cancel requested before the reorg: the original mined first, a later payout
/// spent its change, and the reorg sent the first back to `cancel_requested`. Its cancel waits
/// while the later payout spends the change (signed, it would take that change away); both are
/// mined, the original pays the first. Before, the pass signed the cancel at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_requested_before_a_reorg_waits_while_a_later_payout_spends_the_change() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, ..BtcConfig::default() });
    let first = p.request("w1", &p.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal.id().get();
    worker.pass().await.unwrap();
    let (_, requested) = actions::cancel(&mut p.db.pool.get().await.unwrap(), first, "dana").await.unwrap();
    assert!(requested);
    // The original is mined before the worker signs the cancel.
    p.sim.mine_mempool();
    p.scan().await;
    worker.pass().await.unwrap();
    assert_eq!(p.load(first).await.state(), WithdrawalState::Mined);
    let (second, parent) = p.spending_the_change_of(&worker, first).await;

    p.sim.reorg(1, &[vec![], vec![]]);
    p.scan().await;
    let report = worker.pass().await.unwrap();
    assert_eq!((report.unmined, report.cancel_attempts), (1, 0), "{report:?}");
    assert_eq!(p.load(first).await.state(), WithdrawalState::CancelRequested);
    p.settle(&[&worker], &[first, second], 8).await;
    assert_eq!(
        (p.load(first).await.state(), p.load(second).await.state()),
        (WithdrawalState::Confirmed, WithdrawalState::Confirmed)
    );
    assert_eq!(p.load(first).await.tx_hash().map(|h| h.to_string()), Some(parent.to_string()), "the original paid");
    p.verify().await;
}

/// Two generations: a payout spending the change of a payout that spent the change of a replaced
/// transaction can never be mined either; both are `needs_review` and resolve `--not-paid`.
/// Before, only the first generation was found and the second stayed `broadcast`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spend_two_generations_from_a_replaced_parent_is_needs_review_too() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, bump_after_blocks: 2, ..BtcConfig::default() });
    let (first, _, bump) = p.original_mined_over_its_bump(&worker).await;
    // The second spends the original's change and is mined; the third spends the second's change.
    let second = p.mined_payout(&worker, "w2", 3, 100_000).await;
    let third = p.request("w3", &p.sim.address(AddrKind::P2wpkh, 4), 50_000).await.unwrap().withdrawal.id().get();
    worker.pass().await.unwrap();
    let spent: String = p.reserved_by(third).await;
    assert_eq!(spent, p.load(second).await.tx_hash().unwrap().to_string(), "the third spends the second's change");

    p.sim.reorg(2, &[vec![bump.clone()], vec![], vec![]]);
    let z: Txid = p.load(third).await.tx_hash().unwrap().to_string().parse().unwrap();
    assert!(!p.sim.mempool().contains(&z), "the node dropped the third: its parent's input is gone for good");
    p.scan().await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.needs_review, 2, "{report:?}");
    assert_eq!(p.load(third).await.state(), WithdrawalState::NeedsReview);
    for id in [second, third] {
        let resolved = p.resolve(id, actions::Resolution::NotPaid).await.unwrap();
        assert_eq!(resolved.withdrawal.state(), WithdrawalState::Cancelled);
    }
    p.settle(&[&worker], &[first], 6).await;
    assert_eq!(p.load(first).await.tx_hash().map(|h| h.to_string()), Some(bump.compute_txid().to_string()));
    p.verify().await;
}

/// The withdrawals one transaction pays move together: a pass stopped while it records a spend's
/// `unmined` (here cancelled while another transaction holds one of the two rows, as a crash
/// would stop it) leaves both as they were, and the next pass moves both. Before, each was
/// recorded in a transaction of its own: the first became `broadcast`, the second stayed `mined`
/// on a block no longer canonical, and the next pass, reading the first, never unmined it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_stopped_while_recording_a_spend_leaves_its_withdrawals_together() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 3, bump_after_blocks: 100, ..BtcConfig::default() });
    let (_, first) = p.request_n(0).await;
    let (_, second) = p.request_n(1).await;
    worker.pass().await.unwrap();
    let p = &p;
    let state = |id| async move { p.load(id).await.state() };
    assert_eq!(p.load(first).await.tx_hash(), p.load(second).await.tx_hash(), "one transaction pays both");
    p.sim.mine_mempool();
    p.scan().await;
    worker.pass().await.unwrap();
    assert_eq!((state(first).await, state(second).await), (WithdrawalState::Mined, WithdrawalState::Mined));
    p.sim.reorg(1, &[vec![], vec![]]);
    p.scan().await;

    let mut holder = p.db.client().await;
    let held = holder.transaction().await.unwrap();
    held.execute("select 1 from withdrawal where id = $1 for update", &[&second]).await.unwrap();
    // A worker that gives up on the lock fails the spend's recording: none of it is written (not
    // the first alone, then the second failing again, as recording one by one would).
    let config = BtcConfig { confirmations: 3, bump_after_blocks: 100, ..BtcConfig::default() };
    let failed = p.worker_giving_up_on_locks(config).await.pass().await.unwrap();
    assert_eq!(failed.lane_errors.len(), 1, "{failed:?}");
    assert_eq!(
        (state(first).await, state(second).await),
        (WithdrawalState::Mined, WithdrawalState::Mined),
        "a failed recording writes none of a spend's"
    );
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(2), worker.pass()).await;
    assert!(stopped.is_err(), "the pass waits for the held row");
    assert_eq!(
        (state(first).await, state(second).await),
        (WithdrawalState::Mined, WithdrawalState::Mined),
        "a spend's withdrawals are recorded together or not at all"
    );
    held.rollback().await.unwrap();

    let report = worker.pass().await.unwrap();
    assert_eq!(report.unmined, 2, "{report:?}");
    p.settle(&[&worker], &[first, second], 6).await;
    assert_eq!((state(first).await, state(second).await), (WithdrawalState::Confirmed, WithdrawalState::Confirmed));
    p.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_coin_spent_outside_the_service_is_needs_review_and_pauses_the_lane() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 1, ..BtcConfig::default() });
    let w = p.request("w", &p.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal;
    p.worker(BtcConfig::default()).allocate_lane("b0").await.unwrap();
    // Someone with the key spends the reserved coin elsewhere first.
    let theft = p.theft_of_the_reserved_coin().await;
    let theft_txid = theft.compute_txid();
    p.sim.mine(&[theft]);
    p.scan().await;
    let report = worker.pass().await.unwrap();
    assert_eq!((report.needs_review, report.paused_lanes.clone()), (1, vec!["b0".to_owned()]), "{report:?}");
    assert_eq!(p.load(w.id().get()).await.state(), WithdrawalState::NeedsReview);
    let lane = hot_wallet::lanes_on::<BtcAddress, _>(&p.db.pool.get().await.unwrap()).await.unwrap();
    assert!(lane[0].pause_reason.as_deref().unwrap().contains("spent outside the service"));

    // The way out: resolved as not paid once the outside spend is buried; the hold comes back and
    // the spend's reservations are released. The stolen coin is a loss reconcile keeps naming.
    let pool = p.db.pool.clone();
    let id = w.id();
    let resolve = |depth| {
        let pool = pool.clone();
        async move {
            actions::resolve_btc(&mut pool.get().await.unwrap(), id.get(), &actions::Resolution::NotPaid, depth, "dana")
                .await
        }
    };
    let shallow = resolve(2).await.unwrap_err();
    assert!(shallow.to_string().contains("fewer than 2"), "{shallow}");
    let paid_by = actions::resolve_btc(
        &mut p.db.pool.get().await.unwrap(),
        w.id().get(),
        &actions::Resolution::PaidBy("ab".repeat(32)),
        1,
        "dana",
    )
    .await
    .unwrap_err();
    assert!(paid_by.to_string().contains("did not spend its reserved coins"), "{paid_by}");
    let by_theft = actions::resolve_btc(
        &mut p.db.pool.get().await.unwrap(),
        w.id().get(),
        &actions::Resolution::PaidBy(theft_txid.to_string()),
        1,
        "dana",
    )
    .await
    .unwrap_err();
    assert!(by_theft.to_string().contains("cannot be resolved --paid-by"), "{by_theft}");
    p.sim.mine_empty(1);
    p.scan().await;
    let before = crate::ledger_support::available(&p.db, p.alice).await;
    let resolved = resolve(2).await.unwrap();
    assert_eq!((resolved.withdrawal.state(), resolved.paid), (WithdrawalState::Cancelled, false));
    let after: u64 = crate::ledger_support::available(&p.db, p.alice).await.parse().unwrap();
    assert_eq!(after, before.parse::<u64>().unwrap() + 200_000, "the hold came back");
    assert_eq!(p.value("select count(*)::text from utxo_reservation where released_at is null").await, "0");
    let env = btc_env(&p.db, &p.sim, None);
    let verified = run(env.clone(), &["replay", "--verify"]).await;
    assert_eq!(verified.code, 0, "{}{}", verified.stdout, verified.stderr);
    let reconciled = run(env, &["reconcile", "--json"]).await;
    assert_eq!(reconciled.code, 3, "the stolen coin is still custody in the ledger: {}", reconciled.stdout);
}

/// An alert's review and its lane's pause are one transaction. A pass stopped between them (here
/// the lane's row held by another transaction until the worker gives up on it) writes neither,
/// and the next pass writes both. Before, the withdrawal went to review in a transaction of its
/// own and the pause came after it: stopped in between, the lane stayed open with its key known
/// outside, and no later pass paused it (the withdrawal was in review already).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_stopped_between_an_alert_and_its_pause_writes_neither() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let config = BtcConfig { confirmations: 1, ..BtcConfig::default() };
    let id = p.request("w", &p.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal.id().get();
    p.worker(BtcConfig::default()).allocate_lane("b0").await.unwrap();
    let theft = p.theft_of_the_reserved_coin().await;
    p.sim.mine(&[theft]);
    p.scan().await;
    let paused = || async {
        let lanes = hot_wallet::lanes_on::<BtcAddress, _>(&p.db.pool.get().await.unwrap()).await.unwrap();
        lanes[0].pause_reason.is_some()
    };

    let mut holder = p.db.client().await;
    let held = holder.transaction().await.unwrap();
    held.execute("select 1 from hot_wallet where chain = 'btc' and lane = 'b0' for update", &[]).await.unwrap();
    let failed = p.worker_giving_up_on_locks(config.clone()).await.pass().await.unwrap();
    assert_eq!(failed.lane_errors.len(), 1, "{failed:?}");
    assert_eq!(
        (p.load(id).await.state(), paused().await),
        (WithdrawalState::Signed, false),
        "a stopped alert writes neither the review nor the pause"
    );
    held.rollback().await.unwrap();

    let report = p.worker(config).pass().await.unwrap();
    assert_eq!((report.needs_review, report.paused_lanes.clone()), (1, vec!["b0".to_owned()]), "{report:?}");
    assert_eq!((p.load(id).await.state(), paused().await), (WithdrawalState::NeedsReview, true));
}

/// A withdrawal in review for an outside spend that a reorg then took away, with nothing else
/// spending its coin, has a way out: its own bytes sent again (`rebroadcast_btc`), then, once
/// mined and buried, resolved paid by them. Before, --not-paid said "rebroadcast it instead",
/// which BTC could not do, and --paid-by of its own transaction was refused ("the worker settles
/// it", which it never does for a withdrawal in review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outside_spend_reorged_away_leaves_a_way_out_through_our_own_bytes() {
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 1, ..BtcConfig::default() });
    let id = p.request("w", &p.sim.address(AddrKind::P2wpkh, 2), 200_000).await.unwrap().withdrawal.id().get();
    p.worker(BtcConfig::default()).allocate_lane("b0").await.unwrap();
    let theft = p.theft_of_the_reserved_coin().await;
    let theft_txid = theft.compute_txid();
    p.sim.mine(&[theft]);
    p.scan().await;
    assert_eq!(worker.pass().await.unwrap().needs_review, 1);
    // The block with the outside spend is replaced; the spend leaves the node's mempool too.
    p.sim.reorg(1, &[vec![], vec![]]);
    p.sim.evict(theft_txid);
    p.scan().await;
    let early = p.resolve(id, actions::Resolution::NotPaid).await.unwrap_err();
    assert!(early.to_string().contains("withdrawals rebroadcast"), "{early}");
    let ours = actions::rebroadcast_btc(&p.db.pool.get().await.unwrap(), worker.node(), id).await.unwrap();
    p.sim.mine_mempool();
    p.scan().await;
    let not_paid = p.resolve(id, actions::Resolution::NotPaid).await.unwrap_err();
    assert!(not_paid.to_string().contains(&format!("resolve it --paid-by {ours}")), "{not_paid}");
    let before: u64 = crate::ledger_support::available(&p.db, p.alice).await.parse().unwrap();
    let resolved = p.resolve(id, actions::Resolution::PaidBy(ours.to_string())).await.unwrap();
    assert_eq!((resolved.withdrawal.state(), resolved.paid), (WithdrawalState::Confirmed, true));
    assert!(resolved.fee.units() > alloy_primitives::U256::ZERO, "its fee charged");
    let after: u64 = crate::ledger_support::available(&p.db, p.alice).await.parse().unwrap();
    assert_eq!(after, before, "paid from its hold");
    p.verify().await;
}

/// A pass works its lanes at once, as the Ethereum worker's does: a lane held up (here its row
/// locked by another transaction, as a slow allocation or a stuck statement would hold it) holds up
/// no other lane's payouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_btc_lane_held_up_holds_up_no_other_lane() {
    let p = Arc::new(Payouts::new(2, 4, 1_000_000, 50_000_000).await);
    let (held, free) = p.two_on_each_lane().await;

    let mut holder = p.db.client().await;
    let holding = holder.transaction().await.unwrap();
    holding.execute("select 1 from hot_wallet where chain = 'btc' and lane = 'b0' for update", &[]).await.unwrap();
    let worker = Arc::new(p.worker(BtcConfig::default()));
    let pass = tokio::spawn({
        let worker = worker.clone();
        async move { worker.pass().await }
    });
    let waited = std::time::Instant::now();
    let signed = |ids: Vec<i64>| {
        let p = p.clone();
        async move {
            let mut signed = 0;
            for id in ids {
                signed += usize::from(p.load(id).await.state() != WithdrawalState::Requested);
            }
            signed
        }
    };
    while signed(free.clone()).await < free.len() {
        assert!(
            waited.elapsed() < std::time::Duration::from_secs(20),
            "lane b1 still unsigned after 20 s while lane b0's row is held: the pass waits for b0 first"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(signed(held.clone()).await, 0, "lane b0 waits for its row");
    assert!(!pass.is_finished(), "the pass waits on lane b0");

    holding.rollback().await.unwrap();
    let report = tokio::time::timeout(std::time::Duration::from_secs(20), pass).await.unwrap().unwrap().unwrap();
    assert_eq!(report.signed, (held.len() + free.len()) as u64, "{report:?}");
    assert!(report.lane_errors.is_empty(), "{report:?}");
    let all: Vec<i64> = held.iter().chain(&free).copied().collect();
    p.settle(&[&worker], &all, 6).await;
    p.verify().await;
}

/// A BTC lane whose part of a pass fails (here its row lock times out) is listed, backed off for
/// the next passes while the other lane goes on, and tried again once its backoff runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_btc_lane_is_backed_off_while_the_other_lane_goes_on() {
    let p = Payouts::new(2, 4, 1_000_000, 50_000_000).await;
    let (failing, mut going) = p.two_on_each_lane().await;
    let worker = p.worker_giving_up_on_locks(BtcConfig::default()).await;
    let state = |id: i64| {
        let p = &p;
        async move { p.load(id).await.state() }
    };

    let mut holder = p.db.client().await;
    let holding = holder.transaction().await.unwrap();
    holding.execute("select 1 from hot_wallet where chain = 'btc' and lane = 'b0' for update", &[]).await.unwrap();
    let first = worker.pass().await.expect("a lane's failure does not fail the pass");
    assert_eq!(first.lane_errors.len(), 1, "{first:?}");
    // The server's words and SQLSTATE, not tokio-postgres's bare "db error".
    assert!(
        first.lane_errors[0]
            .starts_with("b0: database error: canceling statement due to lock timeout (SQLSTATE 55P03)"),
        "{first:?}"
    );
    assert_eq!(first.signed, going.len() as u64, "lane b1 signed: {first:?}");
    for id in &failing {
        assert_eq!(state(*id).await, WithdrawalState::Requested);
    }
    // At once again, its row still held: lane b0 is not tried (it would fail again), and b1 goes
    // on with a withdrawal requested since.
    let first_done = std::time::Instant::now();
    let mut failing = failing;
    let mut n = 100;
    loop {
        let (lane, id) = p.request_n(n).await;
        n += 1;
        if lane == "b1" {
            going.push(id);
            break;
        }
        failing.push(id);
    }
    let gap = first_done.elapsed();
    let second = worker.pass().await.unwrap();
    // b0's shortest backoff is 500 ms from its failure, which came before the first pass ended.
    if gap < std::time::Duration::from_millis(400) {
        assert!(second.lane_errors.is_empty(), "lane b0 tried while backing off: {second:?}");
    } else {
        eprintln!("the second pass began {gap:?} after the first: past b0's shortest backoff, not checked");
    }
    assert_eq!(second.signed, 1, "lane b1 goes on: {second:?}");

    holding.rollback().await.unwrap();
    let waited = std::time::Instant::now();
    loop {
        let report = worker.pass().await.unwrap();
        assert!(report.lane_errors.is_empty(), "{report:?}");
        if state(failing[0]).await != WithdrawalState::Requested {
            break;
        }
        assert!(waited.elapsed() < std::time::Duration::from_secs(10), "lane b0 never tried again");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let all: Vec<i64> = failing.iter().chain(&going).copied().collect();
    p.settle(&[&worker], &all, 6).await;
    p.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_enough_coins_btc_withdrawals_wait_whole_until_a_top_up() {
    let p = Payouts::new(1, 1, 300_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 1, ..BtcConfig::default() });
    let w = p.request("big", &p.sim.address(AddrKind::P2wpkh, 2), 1_000_000).await.unwrap().withdrawal;
    let report = worker.pass().await.unwrap();
    assert_eq!((report.signed, report.short_lanes.len()), (0, 1), "{report:?}");
    assert_eq!(p.load(w.id().get()).await.state(), WithdrawalState::Requested, "no partial payment");
    assert!(p.sim.mempool().is_empty());
    let short = p.value("select coalesce(shortage, '') from hot_wallet where chain = 'btc'").await;
    assert!(short.contains("300000 spendable satoshis"), "{short}");
    // A top-up arrives and is confirmed: the withdrawal proceeds.
    let top_up = p.sim.pay(&[(p.funding[0].clone(), Sats::from_sat(2_000_000))]);
    p.sim.mine(&[top_up]);
    p.sim.mine_empty(6);
    p.scan().await;
    p.settle(&[&worker], &[w.id().get()], 4).await;
    assert_eq!(p.load(w.id().get()).await.state(), WithdrawalState::Confirmed);
    assert_eq!(p.value("select coalesce(shortage, 'none') from hot_wallet where chain = 'btc'").await, "none");
    p.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_rebuilds_btc_attempts_from_their_bytes_and_names_what_was_edited() {
    let p = Payouts::new(1, 2, 1_000_000, 50_000_000).await;
    let worker = p.worker(BtcConfig { confirmations: 1, ..BtcConfig::default() });
    let a = p.request("a", &p.sim.address(AddrKind::P2wpkh, 3), 100_000).await.unwrap().withdrawal;
    let b = p.request("b", &p.sim.address(AddrKind::P2pkh, 3), 150_000).await.unwrap().withdrawal;
    p.settle(&[&worker], &[a.id().get(), b.id().get()], 4).await;
    p.verify().await;
    let replay = || async {
        let verified = run(btc_env(&p.db, &p.sim, None), &["replay", "--verify", "--json"]).await;
        assert_eq!(verified.code, 3, "{}{}", verified.stdout, verified.stderr);
        verified.stdout
    };
    let owner = p.db.owner_client().await;
    // A recorded fee that is not inputs minus outputs (its events and postings left alone).
    owner
        .batch_execute(
            "alter table btc_attempt disable trigger user; update btc_attempt set fee = fee + 1;
             alter table btc_attempt enable trigger user;",
        )
        .await
        .unwrap();
    let found = replay().await;
    assert!(found.contains("btc spends") && found.contains("minus outputs"), "{found}");
    owner
        .batch_execute(
            "alter table btc_attempt disable trigger user; update btc_attempt set fee = fee - 1;
             alter table btc_attempt enable trigger user;",
        )
        .await
        .unwrap();
    p.verify().await;
    // A withdrawal's destination changed behind its payout: the bytes pay someone else.
    owner
        .batch_execute(&format!(
            "alter table withdrawal disable trigger user;
             update withdrawal set destination = '{}' where id = {};
             alter table withdrawal enable trigger user;",
            p.sim.address(AddrKind::P2wpkh, 77),
            a.id()
        ))
        .await
        .unwrap();
    let found = replay().await;
    assert!(found.contains(&format!("does not pay withdrawal {}", a.id())), "{found}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_stale_coin_set_is_stopped_by_the_reservation_index() {
    let p = Payouts::new(1, 2, 1_000_000, 50_000_000).await;
    let config = BtcConfig { confirmations: 1, ..BtcConfig::default() };
    let (a, b) = (p.worker(config.clone()), p.worker(config));
    let to = |n| p.sim.address(AddrKind::P2wpkh, n);
    // b reads both coins and reserves one; a then reserves the other.
    let w1 = p.request("w1", &to(1), 300_000).await.unwrap().withdrawal;
    assert_eq!(b.allocate_lane("b0").await.unwrap().signed, 1);
    let w2 = p.request("w2", &to(2), 300_000).await.unwrap().withdrawal;
    assert_eq!(a.allocate_lane("b0").await.unwrap().signed, 1);
    // b still believes the second coin is free: the database refuses the second reservation.
    let w3 = p.request("w3", &to(3), 300_000).await.unwrap().withdrawal;
    let stale = b.allocate_lane("b0").await.unwrap();
    assert_eq!((stale.signed, stale.short_lanes.len()), (0, 0), "refused by the index, not short: {stale:?}");
    assert_eq!(p.load(w3.id().get()).await.state(), WithdrawalState::Requested);
    // Read again, b finds nothing left: the lane is short, nothing paid twice.
    let short = b.allocate_lane("b0").await.unwrap();
    assert_eq!((short.signed, short.short_lanes.len()), (0, 1), "{short:?}");
    let reserved: Vec<(String, i32, i64)> =
        p.db.client()
            .await
            .query("select tx_hash, output_index, count(*) from utxo_reservation group by 1, 2", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
    assert_eq!(reserved.len(), 2);
    assert!(reserved.iter().all(|(.., n)| *n == 1), "{reserved:?}");
    assert_ne!(p.load(w1.id().get()).await.tx_hash(), p.load(w2.id().get()).await.tx_hash());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_waits_to_fill_until_batch_wait_then_goes_as_it_is() {
    let p = Payouts::new(1, 2, 1_000_000, 50_000_000).await;
    let waiting =
        BtcConfig { batch_max: 3, batch_wait: std::time::Duration::from_secs(3600), ..quick(BtcConfig::default()) };
    let worker =
        BtcWorker::new(p.db.pool.clone(), p.worker(BtcConfig::default()).node().clone(), p.keys.clone(), waiting);
    let first = p.request("w1", &p.sim.address(AddrKind::P2wpkh, 1), 100_000).await.unwrap().withdrawal;
    assert_eq!(worker.allocate_lane("b0").await.unwrap().signed, 0, "one of three, and it has not waited an hour");
    p.request("w2", &p.sim.address(AddrKind::P2wpkh, 2), 100_000).await.unwrap();
    p.request("w3", &p.sim.address(AddrKind::P2wpkh, 3), 100_000).await.unwrap();
    assert_eq!(worker.allocate_lane("b0").await.unwrap().signed, 3, "full: one transaction pays all three");
    // A lone withdrawal goes once it has waited batch_wait (here: none).
    let lone = p.request("w4", &p.sim.address(AddrKind::P2wpkh, 4), 100_000).await.unwrap().withdrawal;
    assert_eq!(p.worker(BtcConfig::default()).allocate_lane("b0").await.unwrap().signed, 1);
    assert_ne!(p.load(lone.id().get()).await.tx_hash(), p.load(first.id().get()).await.tx_hash());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_is_signed_several_full_batches_to_a_commit_and_a_partial_last_batch_waits() {
    let p = Payouts::new(1, 2, 1_000_000, 50_000_000).await;
    let config = BtcConfig {
        batch_max: 3,
        batches_per_commit: 2,
        batch_wait: std::time::Duration::from_secs(3600),
        ..quick(BtcConfig::default())
    };
    let worker =
        BtcWorker::new(p.db.pool.clone(), p.worker(BtcConfig::default()).node().clone(), p.keys.clone(), config);
    let mut ids = Vec::new();
    for n in 1..=7u32 {
        let to = p.sim.address(AddrKind::P2wpkh, n);
        ids.push(p.request(&format!("w{n}"), &to, 100_000).await.unwrap().withdrawal.id().get());
    }
    assert_eq!(worker.allocate_lane("b0").await.unwrap().signed, 6, "two full batches of three in one allocation");
    let mut hashes = Vec::new();
    for id in &ids {
        hashes.push(p.load(*id).await.tx_hash());
    }
    assert!(hashes[..3].iter().all(|h| h.is_some() && *h == hashes[0]), "{hashes:?}");
    assert!(hashes[3..6].iter().all(|h| h.is_some() && *h == hashes[3]), "{hashes:?}");
    assert_ne!(hashes[0], hashes[3], "each batch is its own transaction");
    assert_eq!(hashes[6], None, "the seventh is a partial batch that has not waited an hour");
    let spends: i64 =
        p.db.pool.get().await.unwrap().query_one("select count(*) from btc_spend", &[]).await.unwrap().get(0);
    assert_eq!(spends, 2);
    assert_eq!(worker.allocate_lane("b0").await.unwrap().signed, 0);
    // Once due it goes: the two coins are reserved and the change is unconfirmed, so the lane is short.
    let due = p.worker(BtcConfig::default()).allocate_lane("b0").await.unwrap();
    assert_eq!((due.signed, due.short_lanes.len()), (0, 1), "{due:?}");
}

/// Later batches of an allocation are checked against their event streams while the earlier ones
/// are being written: a row changed behind its events in the second or third batch still leaves
/// nothing signed, stored or reserved, every such row in review and the lane paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_changed_behind_its_events_in_a_later_batch_leaves_the_whole_allocation_unsigned() {
    let p = Payouts::new(1, 4, 1_000_000, 50_000_000).await;
    let config = BtcConfig { batch_max: 3, batches_per_commit: 3, ..quick(BtcConfig::default()) };
    let worker =
        BtcWorker::new(p.db.pool.clone(), p.worker(BtcConfig::default()).node().clone(), p.keys.clone(), config);
    let mut ids = Vec::new();
    for n in 1..=9u32 {
        let to = p.sim.address(AddrKind::P2wpkh, n);
        ids.push(p.request(&format!("w{n}"), &to, 100_000).await.unwrap().withdrawal.id().get());
    }
    let mallory = p.sim.address(AddrKind::P2wpkh, 666).to_string();
    // The fifth (second batch) and the eighth (third batch), written as the schema owner with the
    // table's guard switched off.
    p.db.owner_client()
        .await
        .batch_execute(&format!(
            "alter table withdrawal disable trigger withdrawal_request_immutable;
             update withdrawal set destination = '{mallory}' where id in ({}, {});
             alter table withdrawal enable trigger withdrawal_request_immutable;",
            ids[4], ids[7]
        ))
        .await
        .unwrap();
    let report = worker.allocate_lane("b0").await.unwrap();
    assert_eq!(report.signed, 0, "nothing is signed: {report:?}");
    let client = p.db.client().await;
    for table in ["btc_spend", "btc_attempt", "utxo_reservation", "btc_spend_payout", "btc_change_address"] {
        let rows: i64 = client.query_one(&format!("select count(*) from {table}"), &[]).await.unwrap().get(0);
        assert_eq!(rows, 0, "{table} holds nothing");
    }
    for (n, id) in ids.iter().enumerate() {
        let want = if n == 4 || n == 7 { WithdrawalState::NeedsReview } else { WithdrawalState::Requested };
        assert_eq!(p.load(*id).await.state(), want, "withdrawal {}", n + 1);
    }
    let lanes = hot_wallet::lanes_on::<BtcAddress, _>(&p.db.pool.get().await.unwrap()).await.unwrap();
    assert!(lanes.iter().any(|l| l.lane == "b0" && l.pause_reason.is_some()), "the lane paused: {lanes:?}");
    assert_eq!(worker.allocate_lane("b0").await.unwrap().signed, 0, "a paused lane signs nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custodian_work_pays_btc_with_a_key_file_from_the_configuration() {
    let p = Payouts::new(1, 2, 1_000_000, 50_000_000).await;
    let dir = tempdir();
    let key = key_file(&dir, "b0.key", &account_key(0).to_string(), 0o600);
    let config = dir.join("custodian.toml");
    std::fs::write(
        &config,
        format!("[btc]\nbatch_wait_ms = 0\nconfirmations = 1\n[btc.hot_key_files]\nb0 = \"{key}\"\n"),
    )
    .unwrap();
    let w = p.request("w", &p.sim.address(AddrKind::P2tr, 9), 250_000).await.unwrap().withdrawal;
    let env = btc_env(&p.db, &p.sim, None);
    let config = config.display().to_string();
    let pass = run(env.clone(), &["work", "--once", "--config", &config]).await;
    assert_eq!(pass.code, 0, "{}{}", pass.stdout, pass.stderr);
    assert_eq!(pass.stdout.trim(), "btc: 1 signed, 1 broadcast", "a report for people, not a debug dump");
    assert_eq!(
        p.sim.mempool(),
        vec![p.load(w.id().get()).await.tx_hash().unwrap().to_string().parse::<Txid>().unwrap()]
    );
    p.sim.mine_mempool();
    p.scan().await;
    let pass = run(env, &["work", "--once", "--config", &config, "--json"]).await;
    assert_eq!(pass.code, 0, "{}{}", pass.stdout, pass.stderr);
    assert_eq!((pass.json()["btc"]["mined"].as_u64(), pass.json()["btc"]["confirmed"].as_u64()), (Some(1), Some(1)));
    assert_eq!(p.load(w.id().get()).await.state(), WithdrawalState::Confirmed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_request_withdrawal_takes_btc_and_refuses_what_the_cli_refuses() {
    use custodian_api::pb::request_withdrawal_request::Amount as WireAmount;
    use custodian_api::pb::withdrawals_client::WithdrawalsClient;
    use custodian_api::pb::RequestWithdrawalRequest;
    let p = Payouts::new(1, 1, 1_000_000, 50_000_000).await;
    let token = crate::harness::token(&p.db, "wallet-app", &custodian_api::tokens::Scope::ALL).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let config = custodian_api::ApiConfig::with_defaults(HashMap::new(), BtcNetwork::Regtest);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(custodian_api::serve(listener, p.db.pool.clone(), config, async move {
        let _ = stopped.await;
    }));
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{address}")).unwrap().connect().await.unwrap();
    let mut client = WithdrawalsClient::new(channel);
    let ask = |external_id: &str, destination: String, amount: WireAmount| {
        let mut request = tonic::Request::new(RequestWithdrawalRequest {
            account_id: p.alice,
            external_id: external_id.to_owned(),
            asset: "BTC".into(),
            destination,
            amount: Some(amount),
        });
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        request
    };
    let to = p.sim.address(AddrKind::P2tr, 4).to_string();
    let made =
        client.request_withdrawal(ask("g1", to.clone(), WireAmount::AmountDecimal("0.005".into()))).await.unwrap();
    let w = made.into_inner().withdrawal.unwrap();
    assert_eq!((w.asset.as_str(), w.destination.as_str(), w.amount.as_str()), ("BTC", to.as_str(), "500000"));
    for (destination, amount, why) in [
        ("bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq".to_owned(), WireAmount::AmountDecimal("0.01".into()), "regtest"),
        (p.sim.address(AddrKind::P2wpkh, 4).to_string(), WireAmount::AmountUnits("293".into()), "dust limit"),
        (p.sim.address(AddrKind::P2wpkh, 4).to_string(), WireAmount::AmountDecimal("0.000000001".into()), "decimals"),
        (p.funding[0].to_string(), WireAmount::AmountDecimal("0.01".into()), "hot wallets"),
    ] {
        let refused = client.request_withdrawal(ask("g2", destination, amount)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains(why), "{}", refused.message());
    }
    assert_eq!(p.value("select count(*)::text from withdrawal").await, "1", "nothing written by the refusals");
    // Once signed, the withdrawal shows its BTC transaction as an attempt, with its fee.
    p.worker(BtcConfig::default()).allocate_lane("b0").await.unwrap();
    let mut get = tonic::Request::new(custodian_api::pb::GetWithdrawalRequest { id: w.id });
    get.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    let signed = client.get_withdrawal(get).await.unwrap().into_inner();
    assert_eq!(signed.attempts.len(), 1, "{signed:?}");
    assert_eq!((signed.attempts[0].kind.as_str(), signed.attempts[0].intent.as_str()), ("original", "payout"));
    assert_eq!(Some(signed.attempts[0].tx_hash.clone()), signed.tx_hash);
    assert!(signed.attempts[0].fee_sat.parse::<u64>().unwrap() > 0);
    assert!(signed.attempts[0].max_fee_per_gas_wei.is_empty());
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_withdrawal_listing_pages_and_shows_btc_attempts() {
    let p = Payouts::new(1, 2, 1_000_000, 50_000_000).await;
    let mut ids = Vec::new();
    for n in 0..3 {
        ids.push(
            p.request(&format!("l{n}"), &p.sim.address(AddrKind::P2wpkh, 40 + n), 100_000)
                .await
                .unwrap()
                .withdrawal
                .id(),
        );
    }
    p.worker(BtcConfig::default()).allocate_lane("b0").await.unwrap();
    let env = btc_env(&p.db, &p.sim, None);
    let first = run(env.clone(), &["withdrawals", "--json", "--limit", "2"]).await;
    assert_eq!(first.code, 0, "{}", first.stderr);
    let page: Vec<WithdrawalId> = first
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| WithdrawalId::new(e["withdrawal"]["id"].as_i64().unwrap()))
        .collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(page, sorted[..2]);
    assert!(first.stderr.contains(&format!("--after {}", sorted[1])), "{}", first.stderr);
    let rest = run(env, &["withdrawals", "--json", "--after", &sorted[1].to_string()]).await;
    let entries = rest.json();
    let entries = entries.as_array().unwrap();
    assert_eq!(entries.len(), 1);
    assert!(!rest.stderr.contains("--after"), "the last page says nothing more: {}", rest.stderr);
    let attempt = &entries[0]["attempts"][0];
    assert_eq!((attempt["kind"].as_str(), attempt["intent"].as_str()), (Some("original"), Some("payout")));
    assert_eq!(attempt["tx_hash"], entries[0]["withdrawal"]["tx_hash"]);
    assert!(attempt["fee_sat"].as_str().unwrap().parse::<u64>().unwrap() > 0);
}
