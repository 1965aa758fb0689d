//! The withdrawal worker at a burst (#14 item 3): 2,000 withdrawals already accepted when the
//! worker starts, anvil with 1-second blocks, two lanes. Printed: blocks and seconds until every
//! one is mined (and until every one is confirmed at depth 1), the worker's passes and node calls,
//! and, for comparison, the chain's own ceiling: how many blocks anvil's gas limit needs to carry
//! that many transfers. `WORKER_BURST` (default 2000) sets the count.

#[allow(dead_code)] // only the lanes are shared
mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use alloy_primitives::U256;
use custodian_domain::{AccountId, Amount, Asset, Chain, ChainAddress, EthAddress, ExternalId};
use custodian_testkit::{Anvil, TestDb};
use custodian_withdrawals::payout::TRANSFER_GAS;
use custodian_withdrawals::request::{self, Request};
use custodian_withdrawals::{EthNode, Signer, Worker, WorkerConfig};
use serde_json::json;

async fn block_number(anvil: &Anvil) -> u64 {
    let hex = anvil.rpc("eth_blockNumber", json!([])).await.unwrap();
    u64::from_str_radix(hex.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client().await.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::main]
async fn main() {
    let total: i64 = std::env::var("WORKER_BURST").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
    let anvil = Anvil::spawn_with(&["--block-time", "1"]).await.unwrap();
    let db = TestDb::new().await;
    let node = EthNode::new(&anvil.url).unwrap();
    let mut signers: HashMap<String, Arc<dyn Signer>> = HashMap::new();
    for (lane, signer) in common::add_eth_lanes(&db, &node).await {
        signers.insert(lane.to_owned(), Arc::new(signer));
    }
    let client = db.client().await;
    let account: i64 =
        client.query_one("insert into account (external_ref) values ('burst') returning id", &[]).await.unwrap().get(0);
    custodian_testkit::fixtures::credit_eth(&client, account, 0, 1_000_000_000_000_000_000).await;
    for n in 0..total {
        let r = Request {
            account_id: AccountId::new(account),
            external_id: ExternalId::parse(&format!("burst-{n}")).unwrap(),
            asset: Asset::Native(Chain::Eth),
            destination: ChainAddress::Eth(
                EthAddress::parse(&format!("0x{:040x}", 0xb0b0_0000u64 + n as u64)).unwrap(),
            ),
            amount: Amount::from_units(U256::from(1_000 + n)),
            requested_by: "bench".to_owned(),
        };
        request::request(&db.pool, &r).await.unwrap();
    }
    let gas_limit = {
        let block = anvil.rpc("eth_getBlockByNumber", json!(["latest", false])).await.unwrap();
        u64::from_str_radix(block["gasLimit"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
    };
    let per_block = gas_limit / TRANSFER_GAS;
    let ceiling = (u64::try_from(total).unwrap()).div_ceil(per_block);

    let config = WorkerConfig { confirmations: 1, ..WorkerConfig::default() };
    // The worker talks to anvil through a proxy that counts its HTTP requests.
    let proxy = custodian_testkit::proxy::RpcProxy::start(&[&anvil.url]).await.unwrap();
    let worker = Worker::new(db.pool.clone(), EthNode::new(&proxy.url).unwrap(), signers, config);
    let (first, started) = (block_number(&anvil).await, Instant::now());
    let (mut passes, mut mined_at) = (0u64, None);
    let mut timeline = Vec::new();
    loop {
        let pass_started = Instant::now();
        let report = worker.pass().await.unwrap();
        timeline.push(format!(
            "pass {passes}: {:.1} s, signed {}, broadcast {}, mined {}, confirmed {}",
            pass_started.elapsed().as_secs_f64(),
            report.signed,
            report.broadcast,
            report.mined,
            report.confirmed
        ));
        passes += 1;
        let mined = count(&db, "select count(*) from withdrawal where state in ('mined', 'confirmed')").await;
        if mined == total && mined_at.is_none() {
            mined_at = Some((block_number(&anvil).await - first, started.elapsed()));
        }
        if count(&db, "select count(*) from withdrawal where state = 'confirmed'").await == total {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(600), "not all confirmed after 10 minutes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (mined_blocks, mined_seconds) = mined_at.unwrap();
    let confirmed_blocks = block_number(&anvil).await - first;
    println!("worker_burst: {total} withdrawals accepted before the worker starts, two lanes, anvil 1-second blocks");
    println!(
        "  all mined {mined_blocks} blocks / {:.1} s after the start; all confirmed {confirmed_blocks} blocks / {:.1} s",
        mined_seconds.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    println!("  {passes} worker passes, {} node requests (a JSON-RPC batch counts once)", proxy.requests());
    for line in timeline.iter().filter(|l| !l.contains("signed 0, broadcast 0, mined 0, confirmed 0")) {
        println!("    {line}");
    }
    println!("  ceiling: the chain carries {per_block} transfers a block (gas limit {gas_limit}): {ceiling} blocks for {total}");
}
