//! What the withdrawal benches share: the one-row PostgreSQL ceiling their figures are quoted
//! beside, and how rates and ratios are printed.

use std::time::{Duration, Instant};

use custodian_domain::EthAddress;
use custodian_testkit::TestDb;
use custodian_withdrawals::{hot_wallet, EthNode, LocalSigner, Signer};

/// The ETH benches' two lanes and their keys: anvil's dev keys 1 and 2 (well-known test keys).
#[allow(dead_code)] // the BTC bench has no ETH lane
pub const ETH_LANES: [(&str, &str); 2] = [
    ("a", "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d"),
    ("b", "0x5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a"),
];

/// Registers [`ETH_LANES`] on `node` and returns each lane's signer.
#[allow(dead_code)] // the BTC bench has no ETH lane
pub async fn add_eth_lanes(db: &TestDb, node: &EthNode) -> Vec<(&'static str, LocalSigner)> {
    let mut signers = Vec::new();
    for (lane, key) in ETH_LANES {
        let signer = LocalSigner::from_hex(key).unwrap();
        let address = EthAddress::from_alloy(signer.address());
        hot_wallet::add(&mut db.pool.get().await.unwrap(), node, lane, address, "bench").await.unwrap();
        signers.push((lane, signer));
    }
    signers
}

/// `count` in `elapsed`, per second.
pub fn per_second(count: u64, elapsed: Duration) -> u64 {
    (u128::from(count) * 1_000_000 / elapsed.as_micros().max(1)) as u64
}

/// `ours / ceiling` with two decimals.
pub fn ratio(ours: u64, ceiling: u64) -> String {
    let hundredths = ours * 100 / ceiling.max(1);
    format!("{}.{:02}", hundredths / 100, hundredths % 100)
}

/// The one-row ceiling (the allocation bench's): lock one row, bump it, commit, `n` times on one
/// connection, both statements prepared once. Its row is a `hot_wallet` row named `ceiling`, made
/// here if missing. Returns the transactions and the time they took.
pub async fn one_row_ceiling(db: &TestDb, n: u64) -> (u64, Duration) {
    let (mut client, connection) = db.url.config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    client
        .execute(
            "insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', $1, 'ceiling', 0)
             on conflict do nothing",
            &[&format!("0x{:040x}", 0xce11_0000u64)],
        )
        .await
        .unwrap();
    let lock = client
        .prepare("select next_nonce from hot_wallet where chain = 'eth' and lane = 'ceiling' for update")
        .await
        .unwrap();
    let bump = client
        .prepare("update hot_wallet set next_nonce = next_nonce + 1 where chain = 'eth' and lane = 'ceiling'")
        .await
        .unwrap();
    let started = Instant::now();
    for _ in 0..n {
        let tx = client.transaction().await.unwrap();
        tx.query_one(&lock, &[]).await.unwrap();
        tx.execute(&bump, &[]).await.unwrap();
        tx.commit().await.unwrap();
    }
    (n, started.elapsed())
}
