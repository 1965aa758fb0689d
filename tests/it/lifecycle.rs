//! The deposit lifecycle through the binary: reorgs whose money comes back or does not, blocks
//! that come back, discrepancy rounds and their decisions, coinbase outputs, the chain's identity,
//! and the scanner lease across processes.

use bitcoin::Amount as Sats;
use custodian_api::tokens::Scope;
use custodian_testkit::btcsim::{AddrKind, BitcoinSim};
use custodian_testkit::fixtures::{posted_balance, Normal};
use custodian_testkit::TestDb;
use serde_json::Value;

use crate::harness::{custodian, custodian_env_async, Run};
use crate::ledger_support::{available, new_account};

/// The environment of a BTC command against `sim`.
pub(crate) fn btc_env(db: &TestDb, sim: &BitcoinSim, token: Option<&str>) -> Vec<(String, String)> {
    let mut env = vec![
        ("CUSTODIAN_DATABASE_URL".to_owned(), db.url.expose().to_owned()),
        ("CUSTODIAN_BTC_RPC_URL".to_owned(), sim.url()),
        ("CUSTODIAN_BTC_RPC_USER".to_owned(), sim.user().to_owned()),
        ("CUSTODIAN_BTC_RPC_PASSWORD".to_owned(), sim.password().to_owned()),
        ("CUSTODIAN_BTC_NETWORK".to_owned(), "regtest".to_owned()),
    ];
    if let Some(token) = token {
        env.push(("CUSTODIAN_TOKEN".to_owned(), token.to_owned()));
    }
    env
}

/// Runs the binary off the runtime (the simulator answers on it meanwhile).
pub(crate) async fn run(env: Vec<(String, String)>, args: &[&str]) -> Run {
    custodian_env_async(env, args).await
}

/// `custodian scan --chain btc --once`, which posts after every step exactly as `serve` does.
pub(crate) async fn scan(db: &TestDb, sim: &BitcoinSim) {
    let scanned = run(btc_env(db, sim, None), &["scan", "--chain", "btc", "--once", "--json"]).await;
    assert_eq!(scanned.code, 0, "{}", scanned.stderr);
}

async fn discrepancies(db: &TestDb) -> Vec<Value> {
    let listed = custodian(db.url.expose(), &["reversals", "list", "--json"]);
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    listed.json().as_array().unwrap().clone()
}

/// The deposit key's credited, reversed and re-credited amounts, as finance reads them.
async fn key_history(db: &TestDb, txid: &str) -> (String, String, String) {
    let client = db.pool.get().await.unwrap();
    let row = client
        .query_one(
            "select credited::text, reversed::text, recredited::text from deposit_status
              where tx_hash = $1 order by orphaned, height desc limit 1",
            &[&txid],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// custody per asset and treasury's net, from the ledger.
async fn ledger_net(db: &TestDb, account: &str) -> String {
    posted_balance(&db.pool.get().await.unwrap(), account, "BTC", Normal::Debit).await
}

/// What the canonical chain holds confirmed to watched addresses, from the simulator's own blocks.
fn canonical_to(sim: &BitcoinSim, address: &bitcoin::Address) -> u64 {
    (0..=sim.height())
        .filter_map(|h| sim.block_hash(h))
        .filter_map(|hash| sim.block(hash))
        .flat_map(|block| block.txdata.into_iter().flat_map(|tx| tx.output))
        .filter(|out| out.script_pubkey == address.script_pubkey())
        .map(|out| out.value.to_sat())
        .sum()
}

fn verified(db: &TestDb) {
    let replay = custodian(db.url.expose(), &["replay", "--verify", "--json"]);
    assert_eq!(replay.code, 0, "{}", replay.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn money_re_mined_soon_after_a_deep_reorg_never_opens_a_discrepancy() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 21);
    let alice = new_account(&db, "alice", &address, 0).await;
    sim.mine_empty(2);
    let half = sim.pay(&[(address.clone(), Sats::from_sat(50_000_000))]); // 0.5 BTC: 3 confirmations
    sim.mine(std::slice::from_ref(&half)); // height 3
    sim.mine_empty(3); // tip 6
    scan(&db, &sim).await;
    assert_eq!(available(&db, alice).await, "50000000");

    // A reorg from height 3 drops it; the network re-mines it two blocks later.
    sim.reorg(4, &[vec![], vec![], vec![], vec![], vec![]]); // heights 3..=7, without it
    scan(&db, &sim).await;
    sim.mine_empty(1);
    sim.mine(std::slice::from_ref(&half)); // height 9: the grace (3 blocks beyond the old tip 6) ends there
    sim.mine_empty(3);
    scan(&db, &sim).await;
    assert!(discrepancies(&db).await.is_empty(), "no discrepancy for money that came back within its grace");
    assert_eq!(available(&db, alice).await, "50000000", "credited once");
    assert_eq!(key_history(&db, &half.compute_txid().to_string()).await, ("50000000".into(), "0".into(), "0".into()));
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_deposit_waits_its_grace_then_approval_debits_and_re_mined_money_is_credited_again_once() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 22);
    let alice = new_account(&db, "alice", &address, 0).await;
    let carol = crate::harness::token(&db, "carol", &[Scope::Approve]).await;
    sim.mine_empty(2);
    let half = sim.pay(&[(address.clone(), Sats::from_sat(50_000_000))]); // 3 confirmations
    sim.mine(std::slice::from_ref(&half)); // height 3
    sim.mine_empty(2); // tip 5
    scan(&db, &sim).await;
    assert_eq!(available(&db, alice).await, "50000000");

    let old_tip = sim.height();
    sim.reorg(3, &[vec![], vec![], vec![], vec![]]); // 3..=6 without it: one block beyond the old tip
    scan(&db, &sim).await;
    assert!(discrepancies(&db).await.is_empty(), "1 block beyond the old tip {old_tip} of a 3-block grace");
    sim.mine_empty(2); // 3 beyond
    scan(&db, &sim).await;
    let open = discrepancies(&db).await;
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(open[0]["round"], 1);
    assert_eq!(open[0]["amount"], "50000000");
    assert_eq!(open[0]["ledger_account"], format!("user:{alice}"));
    assert_eq!(available(&db, alice).await, "50000000", "nothing is debited without a decision");
    scan(&db, &sim).await;
    assert_eq!(discrepancies(&db).await.len(), 1, "one round, however often the pass runs");
    verified(&db);

    let id = open[0]["id"].to_string();
    let approved = run(btc_env(&db, &sim, Some(&carol)), &["reversals", "approve", "--id", &id, "--json"]).await;
    assert_eq!(approved.code, 0, "{}", approved.stderr);
    assert_eq!(approved.json()["proposal"]["decided_by"], "carol");
    assert_eq!(available(&db, alice).await, "0");
    assert_eq!(ledger_net(&db, "custody").await, canonical_to(&sim, &address).to_string(), "custody matches the chain");
    verified(&db);

    // The money comes back: credited again, automatically, once.
    sim.mine(std::slice::from_ref(&half));
    sim.mine_empty(2);
    scan(&db, &sim).await;
    scan(&db, &sim).await;
    assert_eq!(available(&db, alice).await, "50000000");
    let txid = half.compute_txid().to_string();
    assert_eq!(key_history(&db, &txid).await, ("50000000".into(), "50000000".into(), "50000000".into()));
    assert_eq!(ledger_net(&db, "custody").await, canonical_to(&sim, &address).to_string());
    let deposits = custodian(db.url.expose(), &["deposits", "--json"]).json();
    let canonical = deposits.as_array().unwrap().iter().find(|d| d["orphaned"] == false).unwrap().clone();
    assert_eq!(canonical["deposit_key"], format!("deposit:btc:{txid}:output:0"));
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_discrepancy_books_the_loss_to_treasury_and_custody_matches_the_chain() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 23);
    let alice = new_account(&db, "alice", &address, 0).await;
    let erin = crate::harness::token(&db, "erin", &[Scope::Approve]).await;
    sim.mine_empty(2);
    let small = sim.pay(&[(address.clone(), Sats::from_sat(5_000_000))]); // 0.05 BTC: 1 confirmation
    sim.mine(std::slice::from_ref(&small));
    scan(&db, &sim).await;
    sim.reorg(2, &[vec![], vec![], vec![], vec![]]);
    scan(&db, &sim).await;
    let open = discrepancies(&db).await;
    assert_eq!(open.len(), 1, "{open:?}");
    let id = open[0]["id"].to_string();
    let rejected =
        run(btc_env(&db, &sim, Some(&erin)), &["reversals", "reject", "--id", &id, "--reason", "our loss"]).await;
    assert_eq!(rejected.code, 0, "{}", rejected.stderr);
    assert_eq!(available(&db, alice).await, "5000000", "the customer keeps the credit");
    assert_eq!(ledger_net(&db, "treasury").await, "5000000", "treasury absorbed it (a debit)");
    assert_eq!(ledger_net(&db, "custody").await, "0");
    assert_eq!(canonical_to(&sim, &address), 0);
    verified(&db);

    // The money comes back later: treasury is paid back first, the customer is not credited twice.
    sim.mine(std::slice::from_ref(&small));
    scan(&db, &sim).await;
    assert_eq!(available(&db, alice).await, "5000000");
    assert_eq!(ledger_net(&db, "treasury").await, "0");
    assert_eq!(ledger_net(&db, "custody").await, "5000000");
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_that_come_back_are_reinstated_and_their_deposits_credited_once() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 24);
    let alice = new_account(&db, "alice", &address, 0).await;
    sim.mine_empty(2);
    let fork = sim.block_hash(2).unwrap();
    let small = sim.pay(&[(address.clone(), Sats::from_sat(7_000_000))]);
    let first = sim.mine_branch(fork, &[vec![small.clone()], vec![]]); // A: 3, 4 with the payment
    scan(&db, &sim).await;
    assert_eq!(available(&db, alice).await, "7000000");

    // B overtakes A: A's blocks are orphaned.
    let rival = sim.mine_branch(fork, &[vec![], vec![], vec![]]);
    scan(&db, &sim).await;
    // A comes back, longer than B: its blocks are reinstated, the scanner goes on.
    sim.mine_branch(first[1], &[vec![], vec![]]);
    assert_eq!(sim.block_hash(3), Some(first[0]), "the simulator switched back to A");
    scan(&db, &sim).await;
    scan(&db, &sim).await;

    let client = db.pool.get().await.unwrap();
    let verdicts: Vec<(String, i32, String)> = client
        .query(
            "select v.block_hash, v.seq, v.verdict from block_verdict v where v.block_hash = any($1) order by 1, 2",
            &[&vec![first[0].to_string(), rival[0].to_string()]],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert!(verdicts.contains(&(first[0].to_string(), 1, "orphaned".to_owned())), "{verdicts:?}");
    assert!(verdicts.contains(&(first[0].to_string(), 2, "reinstated".to_owned())), "{verdicts:?}");
    assert!(verdicts.contains(&(rival[0].to_string(), 1, "orphaned".to_owned())), "{verdicts:?}");
    let canonical: String = client
        .query_one("select block_hash from chain_block where chain = 'btc' and height = 3 and orphaned_at is null", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(canonical, first[0].to_string());
    assert_eq!(available(&db, alice).await, "7000000", "credited once across the flip-flop");
    let transfers: i64 =
        client.query_one("select count(*) from ledger_transfer where kind = 'deposit'", &[]).await.unwrap().get(0);
    assert_eq!(transfers, 1);
    assert_eq!(ledger_net(&db, "custody").await, canonical_to(&sim, &address).to_string());
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coinbase_output_to_a_watched_address_is_credited_only_after_100_blocks() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 25);
    let miner = new_account(&db, "pool-payout", &address, 0).await;
    sim.mine_coinbase_to(&address, &[]); // height 1: 50 BTC, the 6-confirmation tier
    sim.mine_empty(98); // 99 confirmations
    scan(&db, &sim).await;
    assert_eq!(available(&db, miner).await, "0", "99 confirmations: not spendable yet");
    let deposits = custodian(db.url.expose(), &["deposits", "--json"]).json();
    assert_eq!(deposits[0]["required_confirmations"], 100, "{deposits}");
    sim.mine_empty(1);
    scan(&db, &sim).await;
    assert_eq!(available(&db, miner).await, "5000000000");
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_payment_split_into_outputs_waits_for_the_tier_of_its_total() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 26);
    let alice = new_account(&db, "alice", &address, 0).await;
    // 20 × 0.0999 BTC in one transaction: 1.998 BTC, the 6-confirmation tier, not 1 each.
    let outputs: Vec<(bitcoin::Address, Sats)> =
        (0..20).map(|_| (address.clone(), Sats::from_sat(9_990_000))).collect();
    sim.mine(&[sim.pay(&outputs)]);
    sim.mine_empty(4); // 5 confirmations
    scan(&db, &sim).await;
    assert_eq!(available(&db, alice).await, "0");
    sim.mine_empty(1);
    scan(&db, &sim).await;
    assert_eq!(available(&db, alice).await, "199800000");
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_another_network_or_genesis_is_refused_and_nothing_is_written() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    sim.mine_empty(3);
    scan(&db, &sim).await;
    let client = db.pool.get().await.unwrap();
    let recorded: (String, String) = client
        .query_one("select network, genesis_hash from chain_identity where chain = 'btc'", &[])
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(recorded, ("regtest".to_owned(), sim.block_hash(0).unwrap().to_string()));

    // Another network configured than the node serves.
    let mut env = btc_env(&db, &sim, None);
    env.retain(|(k, _)| k != "CUSTODIAN_BTC_NETWORK");
    env.push(("CUSTODIAN_BTC_NETWORK".to_owned(), "signet".to_owned()));
    let refused = run(env, &["scan", "--chain", "btc", "--once"]).await;
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert!(refused.stderr.contains("serves Bitcoin regtest"), "{}", refused.stderr);

    // A node on another chain (its own genesis is recorded nowhere here) is refused.
    // The simulator always serves regtest's genesis, so the record is made to name another one,
    // as a database that scanned another chain would.
    let before: i64 = client.query_one("select count(*) from chain_block", &[]).await.unwrap().get(0);
    let owner = db.owner_client().await;
    owner.batch_execute("alter table chain_identity disable trigger chain_identity_append_only").await.unwrap();
    owner.execute("update chain_identity set genesis_hash = repeat('ab', 32) where chain = 'btc'", &[]).await.unwrap();
    owner.batch_execute("alter table chain_identity enable trigger chain_identity_append_only").await.unwrap();
    sim.mine_empty(2);
    let refused = run(btc_env(&db, &sim, None), &["scan", "--chain", "btc", "--once"]).await;
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert!(refused.stderr.contains("this database scans"), "{}", refused.stderr);
    let after: i64 = client.query_one("select count(*) from chain_block", &[]).await.unwrap().get(0);
    assert_eq!(after, before, "nothing was written");
}

/// A process that ends with its value, also when a test panics (SIGKILL and reap).
struct Scanner(std::process::Child);

impl std::ops::Deref for Scanner {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Scanner {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for Scanner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `custodian scan --chain btc` running until killed.
fn spawn_scanner(db: &TestDb, sim: &BitcoinSim, capture: bool) -> Scanner {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_custodian"));
    for (key, _) in std::env::vars() {
        if key.starts_with("CUSTODIAN_") {
            command.env_remove(key);
        }
    }
    Scanner(
        command
            .envs(btc_env(db, sim, None))
            .env("CUSTODIAN_LOG", "info")
            .args(["scan", "--chain", "btc"])
            .stdout(std::process::Stdio::null())
            .stderr(if capture { std::process::Stdio::piped() } else { std::process::Stdio::null() })
            .spawn()
            .expect("starting a scanner"),
    )
}

async fn lease_holder(db: &TestDb) -> Option<i32> {
    let client = db.pool.get().await.unwrap();
    custodian_ingest::sql::lease_holder(&client, custodian_domain::Chain::Btc).await.unwrap()
}

/// Our canonical chain equals the simulator's active chain, height by height.
async fn canonical_matches(db: &TestDb, sim: &BitcoinSim) -> bool {
    let client = db.pool.get().await.unwrap();
    let ours: Vec<(i64, String)> = client
        .query(
            "select height, block_hash from chain_block where chain = 'btc' and orphaned_at is null order by height",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let theirs: Vec<(i64, String)> =
        (0..=sim.height()).map(|h| (h as i64, sim.block_hash(h).unwrap().to_string())).collect();
    ours == theirs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_scanners_share_one_lease_and_the_standby_takes_over_when_the_holder_is_killed() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 27);
    let alice = new_account(&db, "alice", &address, 0).await;
    sim.mine_empty(5);
    let mut first = spawn_scanner(&db, &sim, false);
    let holder = custodian_testkit::eventually(
        "the first scanner to take the lease",
        std::time::Duration::from_secs(30),
        || async { lease_holder(&db).await },
    )
    .await;
    let mut second = spawn_scanner(&db, &sim, true);

    // A reorg and a deposit while both run: one of them (the holder) follows it.
    let small = sim.pay(&[(address.clone(), Sats::from_sat(3_000_000))]);
    sim.reorg(3, &[vec![], vec![small.clone()], vec![], vec![]]);
    custodian_testkit::eventually("the reorg followed", std::time::Duration::from_secs(30), || async {
        (canonical_matches(&db, &sim).await && available(&db, alice).await == "3000000").then_some(())
    })
    .await;
    assert_eq!(lease_holder(&db).await, Some(holder), "the standby never took the lease while the holder lived");

    // SIGKILL the holder: its session ends, the standby takes over within seconds.
    first.kill().expect("SIGKILL");
    first.wait().expect("reaped");
    let taken =
        custodian_testkit::eventually("the standby to take the lease", std::time::Duration::from_secs(30), || async {
            lease_holder(&db).await.filter(|pid| *pid != holder)
        })
        .await;
    assert_ne!(taken, holder);
    let more = sim.pay(&[(address.clone(), Sats::from_sat(4_000_000))]);
    sim.reorg(2, &[vec![], vec![more], vec![]]);
    custodian_testkit::eventually("the standby to follow the chain", std::time::Duration::from_secs(30), || async {
        (canonical_matches(&db, &sim).await && available(&db, alice).await == "7000000").then_some(())
    })
    .await;
    second.kill().expect("SIGKILL");
    let mut log = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().expect("captured"), &mut log).expect("stderr");
    second.wait().expect("reaped");
    assert!(log.contains("took the scanner lease"), "{log}");
    let client = db.pool.get().await.unwrap();
    let transfers: i64 =
        client.query_one("select count(*) from ledger_transfer where kind = 'deposit'", &[]).await.unwrap().get(0);
    assert_eq!(transfers, 2, "each deposit credited once");
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reassignment_takes_effect_above_the_nodes_tip_and_never_moves_an_observed_deposit() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 28);
    let alice = new_account(&db, "alice", &address, 0).await;
    let bob = new_account(&db, "bob", &sim.address(AddrKind::P2wpkh, 29), 0).await;
    sim.mine_empty(2);
    sim.mine(&[sim.pay(&[(address.clone(), Sats::from_sat(1_000_000))])]); // height 3, scanned
    scan(&db, &sim).await;
    // Paid again while our scanner lags: height 5, not read yet.
    sim.mine_empty(1);
    sim.mine(&[sim.pay(&[(address.clone(), Sats::from_sat(2_000_000))])]);
    sim.mine_empty(2); // node tip 7, our tip 3
    let address = address.to_string();
    let assign = |from: Option<&'static str>| {
        let mut args = vec!["address", "assign", "--account", "bob", "--chain", "btc", "--address", &address, "--json"];
        if let Some(from) = from {
            args.extend(["--from-height", from]);
        }
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let args = assign(Some("2"));
    let refused = run(btc_env(&db, &sim, None), &args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("observed at height 3"), "{}", refused.stderr);
    let args = assign(None);
    let moved = run(btc_env(&db, &sim, None), &args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(moved.code, 0, "{}", moved.stderr);
    assert_eq!(moved.json()["valid_from_height"], 8, "the node's tip + 1, not our tip + 1");
    sim.mine(&[sim.pay(&[(sim.address(AddrKind::P2wpkh, 28), Sats::from_sat(4_000_000))])]); // height 8: bob's
    scan(&db, &sim).await;
    assert_eq!(available(&db, alice).await, "3000000", "the payment made before the handover stays alice's");
    assert_eq!(available(&db, bob).await, "4000000");
    verified(&db);
}
