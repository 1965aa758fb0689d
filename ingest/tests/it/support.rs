//! Shared set-up: anvil transactions, watched addresses, and table snapshots.

use custodian_domain::Chain;
use custodian_ingest::{ChainReader, NoProgress, ScanConfig, ScanReport, Scanner};
use custodian_store::ownership;
use custodian_testkit::{Anvil, TestDb};
use serde_json::{json, Value};

/// anvil's first dev account (unlocked, funded).
pub const DEV: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";

/// A scan configuration with small batches so tests cross batch boundaries.
pub fn small_batches() -> ScanConfig {
    ScanConfig {
        batch_blocks: 7,
        fetch_concurrency: 4,
        retention_blocks: 64,
        max_retries: 2,
        initial_backoff: std::time::Duration::from_millis(10),
        ..ScanConfig::default()
    }
}

/// Scans to the node's tip once.
pub async fn scan<R: ChainReader>(db: &TestDb, reader: R, config: ScanConfig) -> ScanReport {
    Scanner::new(reader, db.pool.clone(), config).run_to_tip(&NoProgress).await.expect("scan to tip")
}

/// Creates an account and assigns `address` to it from height 0; returns the account id.
pub async fn watch(db: &TestDb, chain: Chain, account_ref: &str, address: &str) -> i64 {
    let mut client = db.pool.get().await.unwrap();
    let (account, _) = ownership::create_account(&client, account_ref).await.unwrap();
    let address = custodian_domain::ChainAddress::parse_stored(address).unwrap();
    assert_eq!(address.chain(), chain, "{address} is not a {chain} address");
    ownership::assign_address(&mut client, &address, account.id, Some(0)).await.unwrap();
    account.id
}

/// Sends a transaction from an unlocked dev account and returns its hash (mined at once when
/// automine is on).
pub async fn send(anvil: &Anvil, tx: Value) -> String {
    let hash = anvil.rpc("eth_sendTransaction", json!([tx])).await.expect("eth_sendTransaction");
    hash.as_str().expect("a hash").to_owned()
}

/// The receipt of `hash`, once mined (automine mines right after answering the send).
pub async fn receipt(anvil: &Anvil, hash: &str) -> Value {
    custodian_testkit::eventually(&format!("a receipt for {hash}"), std::time::Duration::from_secs(10), || async {
        let receipt = anvil.rpc("eth_getTransactionReceipt", json!([hash])).await.unwrap();
        (!receipt.is_null()).then_some(receipt)
    })
    .await
}

/// Mines `n` empty blocks.
pub async fn mine(anvil: &Anvil, n: u64) {
    anvil.rpc("anvil_mine", json!([format!("0x{n:x}")])).await.unwrap();
}

/// Deploys `contract` (a file in testkit/contracts) with ABI-encoded constructor `args` (hex).
pub async fn deploy(anvil: &Anvil, bytecode: &str, args: &str) -> String {
    let hash = send(anvil, json!({"from": DEV, "data": format!("0x{bytecode}{args}"), "gas": "0x1e8480"})).await;
    let receipt = receipt(anvil, &hash).await;
    assert_eq!(receipt["status"], "0x1", "deployment failed: {receipt}");
    receipt["contractAddress"].as_str().unwrap().to_owned()
}

/// A 32-byte ABI word holding `value`.
pub fn word(value: u128) -> String {
    format!("{value:064x}")
}

/// A 32-byte ABI word holding an address.
pub fn address_word(address: &str) -> String {
    format!("{:0>64}", address.trim_start_matches("0x"))
}

/// ABI-encoded constructor arguments of `TestToken(string,string,uint8,uint256)`.
pub fn token_constructor(name: &str, symbol: &str, decimals: u8, supply: u128) -> String {
    let padded = |s: &str| {
        let hex: String = s.bytes().map(|b| format!("{b:02x}")).collect();
        let words = s.len().div_ceil(32).max(1);
        format!("{}{hex:0<width$}", word(s.len() as u128), width = words * 64)
    };
    let name_words = name.len().div_ceil(32).max(1);
    let symbol_offset = 0x80 + 32 + 32 * name_words;
    format!(
        "{}{}{}{}{}{}",
        word(0x80),
        word(symbol_offset as u128),
        word(u128::from(decimals)),
        word(supply),
        padded(name),
        padded(symbol)
    )
}

/// Calldata of ERC-20 `transfer(to, amount)`.
pub fn transfer_call(to: &str, amount: u128) -> String {
    format!("0xa9059cbb{}{}", address_word(to), word(amount))
}

/// Every row of `table`, as text, in a stable order: for "nothing changed" comparisons.
pub async fn snapshot(db: &TestDb, table: &str) -> Vec<String> {
    let client = db.pool.get().await.unwrap();
    let rows = client.query(&format!("select t::text from {table} t order by 1"), &[]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// Deposit observations as (tx_hash, output_index, amount, block orphaned).
pub async fn observations(db: &TestDb, chain: Chain) -> Vec<(String, i32, String, bool)> {
    let client = db.pool.get().await.unwrap();
    let rows = client
        .query(
            "select d.tx_hash, d.output_index, d.amount::text, b.orphaned_at is not null
               from deposit_event d join chain_block b using (chain, block_hash)
              where d.chain = $1 order by b.height, d.tx_hash, d.output_index",
            &[&chain.as_str()],
        )
        .await
        .unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect()
}

/// Our canonical heights, in order.
pub async fn canonical_heights(db: &TestDb, chain: Chain) -> Vec<i64> {
    let client = db.pool.get().await.unwrap();
    let rows = client
        .query(
            "select height from chain_block where chain = $1 and orphaned_at is null order by height",
            &[&chain.as_str()],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}
