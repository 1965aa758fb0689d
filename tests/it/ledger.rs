//! Ledger and projections: confirmation tiers, posting, reversals, ownership changes, replay.

use bitcoin::Amount as Sats;
use custodian_api::tokens::Scope;
use custodian_domain::{Amount, BtcNetwork, Chain};
use custodian_ingest::btc::{BtcAuth, BtcReader};
use custodian_ingest::{NoProgress, ScanConfig, Scanner};
use custodian_projections::{balances, policy, posting};
use custodian_store::ownership;
use custodian_testkit::btcsim::{AddrKind, BitcoinSim};
use custodian_testkit::TestDb;
use serde_json::json;

use crate::harness::{custodian, custodian_as};

pub fn reader(sim: &BitcoinSim) -> BtcReader {
    let auth = BtcAuth::UserPassword { user: sim.user().to_owned(), password: sim.password().to_owned() };
    BtcReader::new(&sim.url(), auth, BtcNetwork::Regtest).unwrap()
}

/// Scans the simulator to its tip and posts, as `custodian scan` does after every step.
pub async fn scan_and_post(db: &TestDb, sim: &BitcoinSim) -> posting::PostingReport {
    let config = ScanConfig { batch_blocks: 5, retention_blocks: 50, ..ScanConfig::default() };
    Scanner::new(reader(sim), db.pool.clone(), config).run_to_tip(&NoProgress).await.expect("scan");
    posting::post_chain(&db.pool.get().await.unwrap(), Chain::Btc).await.expect("post")
}

pub async fn new_account(db: &TestDb, name: &str, address: &bitcoin::Address, from: u64) -> i64 {
    let mut client = db.pool.get().await.unwrap();
    let (account, _) = ownership::create_account(&client, name).await.unwrap();
    ownership::assign_address(&mut client, Chain::Btc, &address.to_string(), account.id, Some(from)).await.unwrap();
    account.id
}

pub async fn available(db: &TestDb, account: i64) -> String {
    let client = db.pool.get().await.unwrap();
    let all = balances::for_account(&client, account, "x").await.unwrap();
    all.iter().find(|b| b.asset == "BTC").map_or("0".to_owned(), |b| b.available.clone())
}

async fn deposit_transfers(db: &TestDb) -> Vec<String> {
    let client = db.pool.get().await.unwrap();
    let rows = client
        .query("select idempotency_key from ledger_transfer where kind = 'deposit' order by id", &[])
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

#[tokio::test]
async fn confirmation_tiers_apply_exactly_at_and_around_each_boundary() {
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let eth = |s: &str| Amount::parse_decimal(s, 18).unwrap();
    let btc = |s: &str| Amount::parse_decimal(s, 8).unwrap();
    let cases = [
        (Chain::Eth, "ETH", eth("0.000000000000000001"), 12),
        (Chain::Eth, "ETH", eth("0.999999999999999999"), 12),
        (Chain::Eth, "ETH", eth("1"), 32),
        (Chain::Eth, "ETH", eth("1.000000000000000001"), 32),
        (Chain::Eth, "ETH", eth("99.999999999999999999"), 32),
        (Chain::Eth, "ETH", eth("100"), 64),
        (Chain::Eth, "ETH", eth("1000000"), 64),
        (Chain::Btc, "BTC", btc("0.00000001"), 1),
        (Chain::Btc, "BTC", btc("0.09999999"), 1),
        (Chain::Btc, "BTC", btc("0.1"), 3),
        (Chain::Btc, "BTC", btc("0.99999999"), 3),
        (Chain::Btc, "BTC", btc("1"), 6),
        (Chain::Btc, "BTC", btc("21000000"), 6),
    ];
    for (chain, asset, amount, expected) in cases {
        let required = policy::required_confirmations(&client, chain, asset, amount).await.unwrap();
        assert_eq!(required, Some(expected), "{chain} {asset} {amount}");
    }
    // A token without tiers uses its chain's deepest tier, never a native tier read in token units
    // (10^18 units of a 6-decimal token are not 1 ETH); once it has tiers, only its own.
    let token = "0x5aaeb6053f3e94c9b9a09f33669435e7ef1beaed";
    ownership::add_token(&client, token, "TT", 6).await.unwrap();
    let key = format!("eth:{token}");
    for units in [1u64, 1_000_000_000, u64::MAX] {
        let required =
            policy::required_confirmations(&client, Chain::Eth, &key, Amount::from_u64(units)).await.unwrap();
        assert_eq!(required, Some(64), "{units} units of a token without tiers");
    }
    policy::set_tier(&client, Chain::Eth, &key, Amount::ZERO, 5, "operator").await.unwrap();
    policy::set_tier(&client, Chain::Eth, &key, Amount::from_u64(1_000_000_000), 20, "operator").await.unwrap();
    for (units, expected) in [(1u64, 5), (999_999_999, 5), (1_000_000_000, 20), (u64::MAX, 20)] {
        let required =
            policy::required_confirmations(&client, Chain::Eth, &key, Amount::from_u64(units)).await.unwrap();
        assert_eq!(required, Some(expected), "{units} token units");
    }
}

#[tokio::test]
async fn a_shallow_reorg_never_posts_and_the_same_money_re_mined_posts_once() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 7);
    let alice = new_account(&db, "alice", &address, 0).await;
    sim.mine_empty(2);
    let half = sim.pay(&[(address.clone(), Sats::from_sat(50_000_000))]); // 0.5 BTC: 3 confirmations
    sim.mine(std::slice::from_ref(&half));
    sim.mine_empty(1);
    let report = scan_and_post(&db, &sim).await;
    assert_eq!(report.posted, 0, "2 of 3 confirmations");

    // Retracted before it was confirmed: never posted, nothing proposed.
    sim.reorg(2, &[vec![], vec![], vec![]]);
    sim.mine_empty(4);
    let report = scan_and_post(&db, &sim).await;
    assert_eq!((report.posted, report.reversals_proposed), (0, 0));
    assert_eq!(available(&db, alice).await, "0");

    // The same signed transaction mined again later: credited once, however often we post.
    sim.mine(std::slice::from_ref(&half));
    sim.mine_empty(3);
    assert_eq!(scan_and_post(&db, &sim).await.posted, 1);
    assert_eq!(scan_and_post(&db, &sim).await.posted, 0);
    assert_eq!(deposit_transfers(&db).await, [format!("deposit:btc:{}:output:0:credit:1", half.compute_txid())]);
    assert_eq!(available(&db, alice).await, "50000000");
    let client = db.pool.get().await.unwrap();
    let observations: i64 = client.query_one("select count(*) from deposit_event", &[]).await.unwrap().get(0);
    assert_eq!(observations, 2, "both observations are kept");
}

#[tokio::test]
async fn a_deep_reorg_after_posting_is_proposed_and_reversed_only_on_approval() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 8);
    let alice = new_account(&db, "alice", &address, 0).await;
    sim.mine_empty(2);
    let small = sim.pay(&[(address.clone(), Sats::from_sat(5_000_000))]); // 0.05 BTC: 1 confirmation
    sim.mine(&[small]);
    sim.mine_empty(1);
    assert_eq!(scan_and_post(&db, &sim).await.posted, 1);
    assert_eq!(available(&db, alice).await, "5000000");

    sim.reorg(3, &[vec![], vec![], vec![], vec![]]);
    let report = scan_and_post(&db, &sim).await;
    assert_eq!(report.reversals_proposed, 1);
    assert_eq!(available(&db, alice).await, "5000000", "nothing is debited automatically");
    assert_eq!(scan_and_post(&db, &sim).await.reversals_proposed, 0, "proposed once");

    let url = db.url.expose();
    let carol = crate::harness::token(&db, "carol", &[Scope::Approve]).await;
    let dave = crate::harness::token(&db, "dave", &[Scope::Approve, Scope::Admin]).await;
    let erin = crate::harness::token(&db, "erin", &[Scope::Approve]).await;
    let reader = crate::harness::token(&db, "reporting", &[Scope::Read, Scope::Admin]).await;
    let listed = custodian(url, &["reversals", "list", "--json"]);
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let id = listed.json()[0]["id"].as_i64().unwrap();
    assert_eq!(listed.json()[0]["decision"], serde_json::Value::Null);
    let anonymous = custodian(url, &["reversals", "approve", "--id", &id.to_string()]);
    assert_eq!(anonymous.code, 2, "{}", anonymous.stderr);
    assert!(anonymous.stderr.contains("CUSTODIAN_TOKEN"), "{}", anonymous.stderr);
    let unscoped = custodian_as(url, &reader, &["reversals", "approve", "--id", &id.to_string()]);
    assert_eq!(unscoped.code, 2, "admin alone does not decide: {}", unscoped.stderr);
    assert!(unscoped.stderr.contains("needs the approve scope"), "{}", unscoped.stderr);
    let forged =
        custodian_as(url, &format!("cust_{}", "0".repeat(64)), &["reversals", "approve", "--id", &id.to_string()]);
    assert_eq!(forged.code, 2, "{}", forged.stderr);
    assert!(forged.stderr.contains("not a known API token"), "{}", forged.stderr);

    let approved = custodian_as(url, &carol, &["reversals", "approve", "--id", &id.to_string(), "--json"]);
    assert_eq!(approved.code, 0, "{}", approved.stderr);
    assert_eq!(approved.json()["recorded_now"], true);
    assert_eq!(approved.json()["proposal"]["decided_by"], "carol");
    assert_eq!(available(&db, alice).await, "0");
    let again = custodian_as(url, &dave, &["reversals", "approve", "--id", &id.to_string(), "--json"]);
    assert_eq!((again.code, again.json()["recorded_now"].clone()), (0, json!(false)));
    assert_eq!(again.json()["proposal"]["decided_by"], "carol", "the first decision stands");
    let rejected = custodian_as(url, &erin, &["reversals", "reject", "--id", &id.to_string(), "--reason", "late"]);
    assert_eq!(rejected.code, 2, "{}", rejected.stderr);
    let client = db.pool.get().await.unwrap();
    let reversals: i64 =
        client.query_one("select count(*) from ledger_transfer where kind = 'reversal'", &[]).await.unwrap().get(0);
    assert_eq!(reversals, 1, "exactly one compensating transfer");
    let verified = custodian(url, &["replay", "--verify", "--json"]);
    assert_eq!(verified.code, 0, "{}", verified.stdout);
}

#[tokio::test]
async fn deposits_credit_whoever_owned_the_address_at_the_deposit_height() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2tr, 9);
    let old = new_account(&db, "old-owner", &address, 0).await;
    sim.mine_empty(3);
    let before = sim.pay(&[(address.clone(), Sats::from_sat(1_000))]);
    sim.mine(&[before]); // height 4
    let handover = sim.height() + 1; // 5
    let new = new_account(&db, "new-owner", &address, handover).await;
    let at = sim.pay(&[(address.clone(), Sats::from_sat(2_000))]);
    sim.mine(&[at]); // height 5
    let after = sim.pay(&[(address.clone(), Sats::from_sat(4_000))]);
    sim.mine(&[after]);
    sim.mine_empty(1);
    assert_eq!(scan_and_post(&db, &sim).await.posted, 3);
    assert_eq!(available(&db, old).await, "1000");
    assert_eq!(available(&db, new).await, "6000");
}

#[tokio::test]
async fn a_row_without_its_source_fact_makes_replay_verify_exit_3_and_name_it() {
    let db = TestDb::new().await;
    let url = db.url.expose();
    let clean = custodian(url, &["replay", "--verify"]);
    assert_eq!(clean.code, 0, "{}{}", clean.stdout, clean.stderr);

    let client = db.superuser_client().await;
    client
        .batch_execute(
            "insert into withdrawal (id, external_id, chain, asset, destination, amount, state, last_seq)
             values (4242, 'slipped', 'eth', 'ETH', '0x5aaeb6053f3e94c9b9a09f33669435e7ef1beaed', 5, 'requested', 1)",
        )
        .await
        .unwrap();
    let run = custodian(url, &["replay", "--verify"]);
    assert_eq!(run.code, 3, "{}", run.stdout);
    assert!(
        run.stdout.contains("live withdrawal row not rebuilt from its events") && run.stdout.contains("id=4242"),
        "{}",
        run.stdout
    );

    client
        .batch_execute(
            "set session_replication_role = replica; delete from withdrawal; set session_replication_role = origin",
        )
        .await
        .unwrap();
    client
        .batch_execute(&format!(
            "insert into account (external_ref) values ('mallory');
             begin;
             insert into ledger_transfer (idempotency_key, kind, reference)
                  values ('deposit:eth:0x{tx}:native:0:credit:1', 'deposit', '{{\"chain\":\"eth\",\"tx_hash\":\"0x{tx}\",\"kind\":\"native\",\"output_index\":0,\"block_hash\":\"0x{tx}\"}}');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'debit', 77),
                  (currval('ledger_transfer_id_seq'), 'user:1', 'ETH', 'credit', 77);
             commit;",
            tx = "ab".repeat(32)
        ))
        .await
        .unwrap();
    let run = custodian(url, &["replay", "--verify", "--json"]);
    assert_eq!(run.code, 3, "{}", run.stdout);
    let report = run.json();
    assert_eq!(report["verified"], false);
    let details: Vec<String> =
        report["differences"].as_array().unwrap().iter().map(|d| d["detail"].to_string()).collect();
    let key = format!("deposit:eth:0x{}:native:0:credit:1", "ab".repeat(32));
    assert!(
        details.iter().any(|d| d.contains("credit names no observation of its key") && d.contains(&key)),
        "{details:?}"
    );
    assert!(report["differences"].as_array().unwrap().iter().any(|d| d["check"] == "custody"), "{details:?}");
}

#[tokio::test]
async fn events_print_the_history_in_order_and_resume_after_a_position() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 10);
    new_account(&db, "alice", &address, 0).await;
    let tx = sim.pay(&[(address.clone(), Sats::from_sat(1_000))]);
    sim.mine(&[tx]);
    sim.mine_empty(1);
    scan_and_post(&db, &sim).await;
    let url = db.url.expose();
    // The history shows only facts older than every transaction still running on the server
    // (other tests' included), so wait until ours have settled.
    let all = custodian_testkit::eventually(
        "our facts to settle into the history",
        std::time::Duration::from_secs(30),
        || async {
            let all = custodian(url, &["events", "--json"]).json();
            let settled = all.as_array().unwrap().iter().any(|f| f["kind"] == "ledger_transfer");
            settled.then_some(all)
        },
    )
    .await;
    let kinds: Vec<&str> = all.as_array().unwrap().iter().map(|f| f["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "block").count(), 3);
    assert!(kinds.contains(&"deposit_observed") && kinds.contains(&"ledger_transfer"), "{kinds:?}");
    let first_three: Vec<i64> =
        all.as_array().unwrap().iter().take(3).map(|f| f["position"].as_i64().unwrap()).collect();
    let resumed = custodian(url, &["events", "--json", "--from", &first_three[2].to_string()]).json();
    assert_eq!(
        resumed.as_array().unwrap().as_slice(),
        &all.as_array().unwrap()[3..],
        "resumes exactly after the position"
    );
    let bad = custodian(url, &["events", "--from", "999999"]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);
}

#[tokio::test]
async fn replay_verify_names_an_unbalanced_transfer_and_one_without_postings() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 3);
    new_account(&db, "alice", &address, 0).await;
    let paid = sim.pay(&[(address.clone(), Sats::from_sat(5_000))]);
    sim.mine(&[paid]);
    sim.mine_empty(1);
    assert_eq!(scan_and_post(&db, &sim).await.posted, 1);
    let mut pooled = db.pool.get().await.unwrap();
    assert!(custodian_projections::replay::verify(&mut pooled).await.unwrap().verified());

    // As a superuser, past the triggers that refuse both: a third leg on the deposit's transfer,
    // and a transfer with no postings at all.
    let client = db.superuser_client().await;
    let deposit: i64 =
        client.query_one("select id from ledger_transfer where kind = 'deposit'", &[]).await.unwrap().get(0);
    client
        .batch_execute(&format!(
            "set session_replication_role = replica;
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount)
                  values ({deposit}, 'user:1', 'BTC', 'credit', 1);
             insert into ledger_transfer (idempotency_key, kind) values ('adj:empty', 'adjustment');
             set session_replication_role = origin;"
        ))
        .await
        .unwrap();
    let empty: i64 =
        client.query_one("select id from ledger_transfer where kind = 'adjustment'", &[]).await.unwrap().get(0);

    let report = custodian_projections::replay::verify(&mut pooled).await.unwrap();
    let balance: Vec<&str> =
        report.differences.iter().filter(|d| d.check == "transfers balance").map(|d| d.detail.as_str()).collect();
    let key: String = client
        .query_one("select idempotency_key from ledger_transfer where id = $1", &[&deposit])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        balance,
        [
            format!("transfer {deposit} ({key}): debits differ from credits in BTC"),
            format!("transfer {empty} (adj:empty): it has no postings"),
        ],
        "{:#?}",
        report.differences
    );
}
