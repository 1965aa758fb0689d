//! Ledger and projections: confirmation tiers, posting, reversals, ownership changes, replay.

use bitcoin::Amount as Sats;
use custodian_domain::{Amount, Chain};
use custodian_projections::policy;
use custodian_store::ownership;
use custodian_testkit::btcsim::{AddrKind, BitcoinSim};
use custodian_testkit::TestDb;

use crate::support::{available, new_account, scan_and_post};

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

/// A database where alice's address (the simulator's P2WPKH address `index`) received 5,000 sat,
/// scanned, credited and verified by replay; with the simulator and a pooled connection.
async fn one_deposit_credited_and_verified(index: u32) -> (TestDb, BitcoinSim, deadpool_postgres::Object) {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, index);
    new_account(&db, "alice", &address, 0).await;
    let paid = sim.pay(&[(address.clone(), Sats::from_sat(5_000))]);
    sim.mine(&[paid]);
    sim.mine_empty(1);
    assert_eq!(scan_and_post(&db, &sim).await.posted, 1);
    let mut pooled = db.pool.get().await.unwrap();
    assert!(custodian_projections::replay::verify(&mut pooled).await.unwrap().verified());
    (db, sim, pooled)
}

#[tokio::test]
async fn replay_verify_names_an_unbalanced_transfer_and_one_without_postings() {
    let (db, _sim, mut pooled) = one_deposit_credited_and_verified(3).await;

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

/// A deposit key credited beyond what the chain paid is named twice, by the key and in custody
/// (since 2573623 both come from one statement; this pins what it must still report).
#[tokio::test]
async fn replay_verify_names_a_key_credited_twice_by_its_key_and_in_custody() {
    let (db, _sim, mut pooled) = one_deposit_credited_and_verified(4).await;

    // As the owner: a second credit under the same key, balanced, naming the same observation.
    let owner = db.owner_client().await;
    let key: String =
        owner.query_one("select deposit_key from ledger_transfer where kind = 'deposit'", &[]).await.unwrap().get(0);
    owner
        .batch_execute(&format!(
            "begin;
             insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
                  select '{key}:credit:2', 'deposit', deposit_key, reference from ledger_transfer where kind = 'deposit';
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'BTC', 'debit', 7),
                  (currval('ledger_transfer_id_seq'), 'user:1', 'BTC', 'credit', 7);
             commit;"
        ))
        .await
        .unwrap();

    let report = custodian_projections::replay::verify(&mut pooled).await.unwrap();
    let named = |check: &str| -> Vec<String> {
        report.differences.iter().filter(|d| d.check == check).map(|d| d.detail.clone()).collect()
    };
    assert_eq!(
        named("deposit keys"),
        [format!("{key} (BTC): the ledger holds 5007 under the key, the chain and the decisions say 5000")],
        "{:#?}",
        report.differences
    );
    assert_eq!(
        named("custody"),
        ["BTC: custody booked 5007 but the facts put 5000 there"],
        "{:#?}",
        report.differences
    );
    assert_eq!(report.differences.last().map(|d| d.check), Some("custody"), "custody after the transfers' balance");
}
