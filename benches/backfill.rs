//! Deposit backfill throughput, each figure beside a ceiling measured in the same run.
//!
//! 1. Synthetic ETH-like blocks (10,000 blocks of 200 transactions, 5% paying watched addresses)
//!    from an in-process reader through the real scanner into PostgreSQL, against the ceiling: a
//!    server-side `insert … select … from generate_series` of the same rows into the same tables
//!    of a database with the same schema.
//! 2. Blocks per second backfilling a prepared chain from anvil over JSON-RPC, with call traces
//!    (`debug_traceBlockByNumber`, internal deposits) on and off.
//!
//! Run with `make bench` (or `cargo bench --bench backfill`); `BACKFILL_BLOCKS` and
//! `ANVIL_BLOCKS` shrink the runs.

use std::time::{Duration, Instant};

use alloy_primitives::U256;
use custodian_domain::{BlockHash, Chain, ChainAddress, TxHash};
use custodian_ingest::eth::EthReader;
use custodian_ingest::{
    ChainReader, FetchedBlock, NoProgress, ReadError, ScanConfig, Scanner, Transfer, TransferAsset,
};
use custodian_testkit::{Anvil, TestDb};
use serde_json::json;

const TXS_PER_BLOCK: u64 = 200;
/// One transaction in twenty pays a watched address: 5%.
const WATCHED_EVERY: u64 = 20;
const WATCHED_ADDRESSES: u64 = 100;
const PAYLOAD_BYTES: usize = 512;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn block_hash(height: u64) -> String {
    format!("0x{height:064x}")
}

fn watched(index: u64) -> String {
    format!("0x{:040x}", index + 1)
}

/// Blocks made up on the spot, shaped like Ethereum's.
struct Synthetic {
    blocks: u64,
}

impl ChainReader for Synthetic {
    fn chain(&self) -> Chain {
        Chain::Eth
    }
    async fn identity(&self) -> Result<custodian_ingest::ChainIdentity, ReadError> {
        Ok(custodian_ingest::ChainIdentity {
            network: "ethereum".to_owned(),
            genesis_hash: block_hash(0),
            chain_id: Some(31337),
        })
    }
    async fn tip_height(&self) -> Result<u64, ReadError> {
        Ok(self.blocks - 1)
    }
    async fn block_hash(&self, height: u64) -> Result<Option<String>, ReadError> {
        Ok((height < self.blocks).then(|| block_hash(height)))
    }
    async fn fetch_block(&self, height: u64) -> Result<Option<FetchedBlock>, ReadError> {
        if height >= self.blocks {
            return Ok(None);
        }
        let transfers = (0..TXS_PER_BLOCK)
            .map(|i| Transfer {
                tx_hash: TxHash::parse(Chain::Eth, &format!("0x{height:056x}{i:08x}")).unwrap(),
                kind: custodian_ingest::DepositKind::Native,
                output_index: 0,
                coinbase: false,
                to: ChainAddress::parse_stored(&if i % WATCHED_EVERY == 0 {
                    watched((height * (TXS_PER_BLOCK / WATCHED_EVERY) + i / WATCHED_EVERY) % WATCHED_ADDRESSES)
                } else {
                    format!("0xff{:038x}", height * TXS_PER_BLOCK + i)
                })
                .unwrap(),
                asset: TransferAsset::Native,
                amount: U256::from(1_000_000_000u64 + i),
            })
            .collect();
        Ok(Some(FetchedBlock {
            height,
            hash: BlockHash::parse(Chain::Eth, &block_hash(height)).unwrap(),
            parent_hash: BlockHash::parse(Chain::Eth, &block_hash(height.saturating_sub(1))).unwrap(),
            payload: vec![0x5a; PAYLOAD_BYTES],
            transfers,
            spends: Vec::new(),
        }))
    }
}

async fn watch_addresses(db: &TestDb) {
    let client = db.client().await;
    client
        .execute(
            "insert into account (external_ref) select 'bench-' || i from generate_series(1, $1::int) i",
            &[&(WATCHED_ADDRESSES as i32)],
        )
        .await
        .unwrap();
    client
        .execute(
            "insert into wallet_address (chain, address, account_id)
             select 'eth', '0x' || lpad(to_hex(i), 40, '0'), i from generate_series(1, $1::int) i",
            &[&(WATCHED_ADDRESSES as i32)],
        )
        .await
        .unwrap();
}

async fn count(db: &TestDb, table: &str) -> i64 {
    db.client().await.query_one(&format!("select count(*) from {table}"), &[]).await.unwrap().get(0)
}

/// The ceiling: the same rows, generated and inserted by the server in one transaction.
async fn ceiling(blocks: u64) -> (Duration, i64) {
    let db = TestDb::new().await;
    watch_addresses(&db).await;
    let client = db.client().await;
    let sql = format!(
        "begin;
         insert into chain_block (chain, height, block_hash, parent_hash)
         select 'eth', h, '0x' || lpad(to_hex(h), 64, '0'), '0x' || lpad(to_hex(greatest(h - 1, 0)), 64, '0')
           from generate_series(0, {last}) h;
         insert into raw_block (chain, block_hash, payload)
         select 'eth', '0x' || lpad(to_hex(h), 64, '0'), decode(repeat('5a', {PAYLOAD_BYTES}), 'hex')
           from generate_series(0, {last}) h;
         insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
         select 'eth', '0x' || lpad(to_hex(h), 64, '0'),
                '0x' || lpad(to_hex(h), 56, '0') || lpad(to_hex(i * {WATCHED_EVERY}), 8, '0'), 'native', 0,
                '0x' || lpad(to_hex((h * {per_block} + i) % {WATCHED_ADDRESSES} + 1), 40, '0'), 'ETH',
                1000000000 + i * {WATCHED_EVERY}
           from generate_series(0, {last}) h cross join generate_series(0, {per_block_last}) i;
         insert into scan_cursor (chain, next_height) values ('eth', {blocks});
         commit;",
        last = blocks - 1,
        per_block = TXS_PER_BLOCK / WATCHED_EVERY,
        per_block_last = TXS_PER_BLOCK / WATCHED_EVERY - 1,
    );
    let started = Instant::now();
    client.batch_execute(&sql).await.unwrap();
    let elapsed = started.elapsed();
    let rows = count(&db, "chain_block").await + count(&db, "raw_block").await + count(&db, "deposit_event").await;
    (elapsed, rows)
}

async fn synthetic_backfill(blocks: u64) -> (Duration, i64, i64) {
    let db = TestDb::new().await;
    watch_addresses(&db).await;
    let scanner = Scanner::new(
        Synthetic { blocks },
        db.pool.clone(),
        ScanConfig { retention_blocks: blocks, ..ScanConfig::default() },
    );
    let started = Instant::now();
    let report = scanner.run_to_tip(&NoProgress).await.unwrap();
    let elapsed = started.elapsed();
    assert_eq!(report.blocks, blocks);
    let deposits = count(&db, "deposit_event").await;
    assert_eq!(deposits as u64, blocks * TXS_PER_BLOCK / WATCHED_EVERY, "every watched transfer stored once");
    let rows = count(&db, "chain_block").await + count(&db, "raw_block").await + deposits;
    (elapsed, rows, deposits)
}

/// A prepared anvil chain: one value transfer every ten blocks, to a watched address.
async fn anvil_chain(blocks: u64) -> (Anvil, u64) {
    let anvil = Anvil::spawn().await.unwrap();
    let dev = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";
    for _ in 0..blocks / 10 {
        anvil.rpc("eth_sendTransaction", json!([{"from": dev, "to": watched(0), "value": "0x1"}])).await.unwrap();
        anvil.rpc("anvil_mine", json!(["0x9"])).await.unwrap();
    }
    let tip = anvil.rpc("eth_blockNumber", json!([])).await.unwrap();
    let tip = u64::from_str_radix(tip.as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    (anvil, tip)
}

async fn anvil_backfill(anvil: &Anvil, tip: u64, traces: bool) -> (Duration, u64) {
    let db = TestDb::new().await;
    watch_addresses(&db).await;
    let reader = EthReader::new(&anvil.url).unwrap().with_traces(traces);
    let scanner = Scanner::new(reader, db.pool.clone(), ScanConfig::default());
    let started = Instant::now();
    let report = scanner.run_to_tip(&NoProgress).await.unwrap();
    let elapsed = started.elapsed();
    assert_eq!(report.blocks, tip + 1);
    (elapsed, report.blocks)
}

fn per_second(count: u64, elapsed: Duration) -> u64 {
    (u128::from(count) * 1_000_000 / elapsed.as_micros().max(1)) as u64
}

#[tokio::main]
async fn main() {
    let blocks = env_u64("BACKFILL_BLOCKS", 10_000);
    let anvil_blocks = env_u64("ANVIL_BLOCKS", 3_000);
    println!(
        "backfill: {blocks} synthetic blocks x {TXS_PER_BLOCK} transactions, 1 in {WATCHED_EVERY} to a watched address"
    );

    let (ceiling_time, ceiling_rows) = ceiling(blocks).await;
    let (ours_time, ours_rows, deposits) = synthetic_backfill(blocks).await;
    assert_eq!(ours_rows, ceiling_rows, "both paths store the same rows");
    let ceiling_rate = per_second(ceiling_rows as u64, ceiling_time);
    let ours_rate = per_second(ours_rows as u64, ours_time);
    println!(
        "  ceiling (server-side generate_series): {ceiling_rows} rows in {ceiling_time:.2?} = {ceiling_rate} rows/s"
    );
    println!(
        "  scanner (in-process reader):          {ours_rows} rows in {ours_time:.2?} = {ours_rate} rows/s, {} blocks/s, {} deposit rows/s",
        per_second(blocks, ours_time),
        per_second(deposits as u64, ours_time)
    );
    println!(
        "  ratio: {}.{:02} of the ceiling (target >= 0.50)",
        ours_rate * 100 / ceiling_rate / 100,
        ours_rate * 100 / ceiling_rate % 100
    );

    let (anvil, tip) = anvil_chain(anvil_blocks).await;
    for traces in [false, true] {
        let (anvil_time, anvil_scanned) = anvil_backfill(&anvil, tip, traces).await;
        println!(
            "anvil over JSON-RPC, traces {}: {anvil_scanned} blocks in {anvil_time:.2?} = {} blocks/s",
            if traces { "on " } else { "off" },
            per_second(anvil_scanned, anvil_time)
        );
    }
}
