//! What the projection tests share with the root's end-to-end tests (which include this file by
//! path): a Bitcoin reader of the simulator, a scan-and-post step, an account with a deposit
//! address, and an account's available BTC.

use custodian_domain::{BtcNetwork, Chain};
use custodian_ingest::btc::{BtcAuth, BtcReader};
use custodian_ingest::{NoProgress, ScanConfig, Scanner};
use custodian_projections::{balances, posting};
use custodian_store::ownership;
use custodian_testkit::btcsim::BitcoinSim;
use custodian_testkit::TestDb;

pub fn reader(sim: &BitcoinSim) -> BtcReader {
    let auth = BtcAuth::UserPassword { user: sim.user().to_owned(), password: sim.password().to_owned() };
    BtcReader::new(&sim.url(), auth, BtcNetwork::Regtest).unwrap()
}

/// Scans the simulator to its tip, five blocks a step.
pub async fn scan(db: &TestDb, sim: &BitcoinSim) {
    let config = ScanConfig { batch_blocks: 5, retention_blocks: 50, ..ScanConfig::default() };
    Scanner::new(reader(sim), db.pool.clone(), config).run_to_tip(&NoProgress).await.expect("scan");
}

/// Scans the simulator to its tip and posts, as `custodian scan` does after every step.
pub async fn scan_and_post(db: &TestDb, sim: &BitcoinSim) -> posting::PostingReport {
    scan(db, sim).await;
    posting::post_chain(&db.pool.get().await.unwrap(), Chain::Btc).await.expect("post")
}

pub async fn new_account(db: &TestDb, name: &str, address: &bitcoin::Address, from: u64) -> i64 {
    let mut client = db.pool.get().await.unwrap();
    let (account, _) = ownership::create_account(&client, name).await.unwrap();
    ownership::assign_address(
        &mut client,
        &custodian_domain::ChainAddress::parse_stored(&address.to_string()).unwrap(),
        account.id,
        Some(from),
    )
    .await
    .unwrap();
    account.id
}

pub async fn available(db: &TestDb, account: i64) -> String {
    let client = db.pool.get().await.unwrap();
    let all = balances::for_account(&client, account, "x").await.unwrap();
    all.iter().find(|b| b.asset == "BTC").map_or("0".to_owned(), |b| b.available.clone())
}
