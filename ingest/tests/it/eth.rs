//! ETH deposits against a real anvil.

use custodian_domain::Chain;
use custodian_ingest::eth::EthReader;
use custodian_ingest::{ChainReader, FetchedBlock, ReadError};
use custodian_testkit::{Anvil, TestDb};
use serde_json::json;

use crate::support::*;

const WATCHED: &str = "0x1111111111111111111111111111111111111111";
const UNWATCHED: &str = "0x2222222222222222222222222222222222222222";

async fn setup() -> (Anvil, TestDb, EthReader) {
    let anvil = Anvil::spawn().await.expect("anvil");
    let db = TestDb::new().await;
    let reader = EthReader::new(&anvil.url).unwrap();
    (anvil, db, reader)
}

#[tokio::test]
async fn a_native_deposit_to_a_watched_address_is_recorded_once_with_its_exact_amount() {
    let (anvil, db, reader) = setup().await;
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    let amount = "0xde0b6b3a7640001"; // 1 ETH + 1 wei
    let deposit = send(&anvil, json!({"from": DEV, "to": WATCHED, "value": amount})).await;
    send(&anvil, json!({"from": DEV, "to": UNWATCHED, "value": "0x1"})).await;
    mine(&anvil, 3).await;

    let report = scan(&db, reader.clone(), small_batches()).await;
    assert_eq!(report.deposits, 1);
    assert_eq!(observations(&db, Chain::Eth).await, [(deposit.clone(), 0, "1000000000000000001".to_owned(), false)]);
    assert_eq!(canonical_heights(&db, Chain::Eth).await, (0..=5).collect::<Vec<i64>>());

    let again = scan(&db, reader, small_batches()).await;
    assert_eq!((again.blocks, again.deposits), (0, 0), "scanning again adds nothing");
    assert_eq!(observations(&db, Chain::Eth).await.len(), 1);
}

#[tokio::test]
async fn a_reverted_value_transfer_records_nothing() {
    let (anvil, db, reader) = setup().await;
    let reverter = deploy(&anvil, include_str!("../../../testkit/contracts/Reverter.bin"), "").await;
    watch(&db, Chain::Eth, "contract-owner", &reverter).await;
    let hash = send(&anvil, json!({"from": DEV, "to": reverter, "value": "0xde0b6b3a7640000", "gas": "0x186a0"})).await;
    assert_eq!(receipt(&anvil, &hash).await["status"], "0x0", "the transfer must revert on chain");

    let report = scan(&db, reader, small_batches()).await;
    assert!(report.blocks >= 3);
    assert_eq!(observations(&db, Chain::Eth).await, []);
}

#[tokio::test]
async fn an_erc20_transfer_of_a_registered_token_records_its_log_index() {
    let (anvil, db, reader) = setup().await;
    let token = deploy(
        &anvil,
        include_str!("../../../testkit/contracts/TestToken.bin"),
        &token_constructor("Test Token", "TT", 6, 1_000_000_000_000),
    )
    .await;
    let other = deploy(
        &anvil,
        include_str!("../../../testkit/contracts/TestToken.bin"),
        &token_constructor("Other", "OTH", 6, 1_000_000_000_000),
    )
    .await;
    let client = db.pool.get().await.unwrap();
    custodian_store::ownership::add_token(&client, &token, "TT", 6).await.unwrap();
    watch(&db, Chain::Eth, "alice", WATCHED).await;

    let paid = send(&anvil, json!({"from": DEV, "to": token, "data": transfer_call(WATCHED, 1_234_567)})).await;
    send(&anvil, json!({"from": DEV, "to": other, "data": transfer_call(WATCHED, 999)})).await;
    let log_index = receipt(&anvil, &paid).await["logs"][0]["logIndex"].as_str().unwrap().to_owned();

    scan(&db, reader, small_batches()).await;
    let rows = client.query("select tx_hash, output_index, asset, amount::text from deposit_event", &[]).await.unwrap();
    assert_eq!(rows.len(), 1, "the unregistered token's transfer is not a deposit");
    assert_eq!(rows[0].get::<_, String>(0), paid);
    assert_eq!(
        i64::from(rows[0].get::<_, i32>(1)),
        i64::from_str_radix(log_index.trim_start_matches("0x"), 16).unwrap()
    );
    assert_eq!(rows[0].get::<_, String>(2), format!("eth:{token}"));
    assert_eq!(rows[0].get::<_, String>(3), "1234567");
}

#[tokio::test]
async fn a_reorg_orphans_the_deposit_block_keeps_the_row_and_ingests_the_replacement() {
    let (anvil, db, reader) = setup().await;
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    mine(&anvil, 2).await;
    let deposit = send(&anvil, json!({"from": DEV, "to": WATCHED, "value": "0x2a"})).await;
    let deposit_block = receipt(&anvil, &deposit).await["blockHash"].as_str().unwrap().to_owned();
    mine(&anvil, 2).await;
    scan(&db, reader.clone(), small_batches()).await;
    let tip_before = canonical_heights(&db, Chain::Eth).await;
    assert_eq!(observations(&db, Chain::Eth).await, [(deposit.clone(), 0, "42".to_owned(), false)]);

    // Replace the last 4 blocks (the deposit's and three above) with empty ones, then extend.
    anvil.rpc("anvil_reorg", json!([4, []])).await.expect("anvil_reorg");
    mine(&anvil, 1).await;
    let report = scan(&db, reader.clone(), small_batches()).await;
    assert_eq!(report.reorgs, 1);
    assert_eq!(report.orphaned, 4);

    let client = db.pool.get().await.unwrap();
    let orphaned: bool = client
        .query_one("select orphaned_at is not null from chain_block where block_hash = $1", &[&deposit_block])
        .await
        .unwrap()
        .get(0);
    assert!(orphaned, "the deposit's block is orphan-marked");
    assert_eq!(observations(&db, Chain::Eth).await, [(deposit, 0, "42".to_owned(), true)], "the row stays");
    let heights = canonical_heights(&db, Chain::Eth).await;
    assert_eq!(heights, (0..=*tip_before.last().unwrap() + 1).collect::<Vec<_>>(), "replacements ingested, no gap");
    for height in heights {
        let ours: String = client
            .query_one(
                "select block_hash from chain_block where chain = 'eth' and height = $1 and orphaned_at is null",
                &[&height],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(Some(ours), reader.block_hash(height as u64).await.unwrap(), "height {height} matches the node");
    }
}

#[tokio::test]
async fn the_same_transaction_re_mined_after_a_reorg_is_two_observations_one_canonical() {
    let (anvil, db, reader) = setup().await;
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    let deposit = send(&anvil, json!({"from": DEV, "to": WATCHED, "value": "0x64"})).await;
    let raw = anvil.rpc("eth_getRawTransactionByHash", json!([deposit])).await.unwrap();
    mine(&anvil, 2).await;
    scan(&db, reader.clone(), small_batches()).await;

    // Three new blocks in place of the last three; the same signed bytes go into the second.
    anvil.rpc("anvil_reorg", json!([3, [[raw, 1]]])).await.expect("anvil_reorg");
    let moved = receipt(&anvil, &deposit).await;
    assert_eq!(moved["status"], "0x1", "re-mined: {moved}");
    mine(&anvil, 1).await;
    scan(&db, reader, small_batches()).await;

    let seen = observations(&db, Chain::Eth).await;
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|(tx, index, amount, _)| *tx == deposit && *index == 0 && amount == "100"));
    assert_eq!(seen.iter().filter(|(_, _, _, orphaned)| !orphaned).count(), 1, "exactly one canonical: {seen:?}");
}

#[tokio::test]
async fn rewinding_fifty_blocks_and_scanning_again_changes_nothing() {
    let (anvil, db, reader) = setup().await;
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    for i in 0..5u64 {
        send(&anvil, json!({"from": DEV, "to": WATCHED, "value": format!("0x{:x}", 1000 + i)})).await;
        mine(&anvil, 12).await;
    }
    scan(&db, reader.clone(), small_batches()).await;
    let tables = ["chain_block", "deposit_event", "raw_block"];
    let mut before = Vec::new();
    for table in tables {
        before.push(snapshot(&db, table).await);
    }
    let tip = *canonical_heights(&db, Chain::Eth).await.last().unwrap() as u64;
    let mut client = db.pool.get().await.unwrap();
    custodian_ingest::sql::rewind(&mut client, Chain::Eth, tip + 1 - 50).await.unwrap();
    let report = scan(&db, reader, small_batches()).await;
    assert_eq!((report.blocks, report.deposits, report.reorgs), (0, 0, 0));
    for (table, before) in tables.iter().zip(before) {
        assert_eq!(snapshot(&db, table).await, before, "{table} changed");
    }
    assert_eq!(custodian_ingest::sql::cursor(&client, Chain::Eth).await.unwrap(), Some(tip + 1));
}

/// A reader that fails from `fail_from` on, as a crashed or killed scanner would stop.
#[derive(Clone)]
struct StopsAt {
    inner: EthReader,
    fail_from: u64,
}

impl ChainReader for StopsAt {
    fn chain(&self) -> Chain {
        Chain::Eth
    }
    async fn identity(&self) -> Result<custodian_ingest::ChainIdentity, ReadError> {
        self.inner.identity().await
    }
    async fn tip_height(&self) -> Result<u64, ReadError> {
        self.inner.tip_height().await
    }
    async fn block_hash(&self, height: u64) -> Result<Option<String>, ReadError> {
        self.inner.block_hash(height).await
    }
    async fn fetch_block(&self, height: u64) -> Result<Option<FetchedBlock>, ReadError> {
        if height >= self.fail_from {
            return Err(ReadError::Unavailable { chain: Chain::Eth, message: "process stopped".into() });
        }
        self.inner.fetch_block(height).await
    }
}

#[tokio::test]
async fn a_scanner_stopped_between_blocks_resumes_without_gap_or_duplicate() {
    let (anvil, db, reader) = setup().await;
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    let mut deposits = Vec::new();
    for _ in 0..6 {
        deposits.push(send(&anvil, json!({"from": DEV, "to": WATCHED, "value": "0x7"})).await);
        mine(&anvil, 3).await;
    }
    let stopping = StopsAt { inner: reader.clone(), fail_from: 10 };
    let stopped = custodian_ingest::Scanner::new(stopping, db.pool.clone(), small_batches())
        .run_to_tip(&custodian_ingest::NoProgress)
        .await;
    assert!(matches!(stopped, Err(custodian_ingest::ScanError::NodeUnavailable { .. })), "{stopped:?}");
    assert_eq!(canonical_heights(&db, Chain::Eth).await, (0..=6).collect::<Vec<i64>>(), "whole batches only");

    scan(&db, reader, small_batches()).await;
    let tip = anvil.rpc("eth_blockNumber", json!([])).await.unwrap();
    let tip = i64::from_str_radix(tip.as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    assert_eq!(canonical_heights(&db, Chain::Eth).await, (0..=tip).collect::<Vec<i64>>());
    let seen: Vec<String> = observations(&db, Chain::Eth).await.into_iter().map(|(tx, ..)| tx).collect();
    assert_eq!(seen, deposits, "each deposit once, in order");
}

#[tokio::test]
async fn a_node_reporting_a_lower_tip_does_not_move_our_tip() {
    let anvil = Anvil::spawn_shared_genesis(&[]).await.unwrap();
    let db = TestDb::new().await;
    let reader = EthReader::new(&anvil.url).unwrap();
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    send(&anvil, json!({"from": DEV, "to": WATCHED, "value": "0x5"})).await;
    mine(&anvil, 20).await;
    scan(&db, reader, small_batches()).await;
    let heights = canonical_heights(&db, Chain::Eth).await;
    let blocks = snapshot(&db, "chain_block").await;

    // A node that resynced from scratch: it is at height 3 of a different chain.
    let lagging = Anvil::spawn_shared_genesis(&[]).await.unwrap();
    mine(&lagging, 3).await;
    let report = scan(&db, EthReader::new(&lagging.url).unwrap(), small_batches()).await;
    assert_eq!(report.our_tip, Some(*heights.last().unwrap() as u64));
    assert_eq!(report.node_tip, 3);
    assert_eq!((report.blocks, report.reorgs), (0, 0));
    assert_eq!(canonical_heights(&db, Chain::Eth).await, heights);
    assert_eq!(snapshot(&db, "chain_block").await, blocks, "nothing orphaned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inconsistent_provider_is_backed_off_from_and_the_chain_it_then_serves_is_followed() {
    use custodian_ingest::{ScanConfig, ScannerState};
    use custodian_testkit::proxy::RpcProxy;
    let first = Anvil::spawn_shared_genesis(&[]).await.unwrap();
    let second = Anvil::spawn_shared_genesis(&[]).await.unwrap();
    let db = TestDb::new().await;
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    // Two chains from one genesis that differ from block 1 on.
    send(&first, json!({"from": DEV, "to": WATCHED, "value": "0x5"})).await;
    mine(&first, 9).await;
    send(&second, json!({"from": DEV, "to": WATCHED, "value": "0x6"})).await;
    mine(&second, 13).await;
    let proxy = RpcProxy::start(&[&first.url, &second.url]).await.unwrap();
    let config = ScanConfig {
        initial_backoff: std::time::Duration::from_millis(50),
        max_backoff: std::time::Duration::from_millis(400),
        poll_interval: std::time::Duration::from_millis(50),
        ..small_batches()
    };
    let scanner = std::sync::Arc::new(custodian_ingest::Scanner::new(
        EthReader::new(&proxy.url).unwrap(),
        db.pool.clone(),
        config,
    ));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = {
        let scanner = scanner.clone();
        tokio::spawn(async move { scanner.run(&custodian_ingest::NoProgress, stopped).await })
    };
    async fn tip_hash(node: &Anvil) -> String {
        let block = node.rpc("eth_getBlockByNumber", json!(["latest", false])).await.unwrap();
        block["hash"].as_str().unwrap().to_owned()
    }
    let ours = || async {
        let client = db.pool.get().await.unwrap();
        custodian_ingest::sql::our_tip(&client, Chain::Eth).await.unwrap().map(|(_, hash)| hash)
    };
    let expected = tip_hash(&first).await;
    custodian_testkit::eventually("the first chain scanned", std::time::Duration::from_secs(30), || async {
        (ours().await.as_deref() == Some(expected.as_str())).then_some(())
    })
    .await;

    // The provider now answers from both nodes in turn: the scanner backs off instead of spinning.
    proxy.alternate();
    let before = proxy.requests();
    let started = std::time::Instant::now();
    let mut retrying = Vec::new();
    while started.elapsed() < std::time::Duration::from_secs(3) {
        if let ScannerState::Retrying { reason, .. } = scanner.state().lock().unwrap().clone() {
            retrying.push(reason);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let per_second = (proxy.requests() - before) as f64 / started.elapsed().as_secs_f64();
    assert!(!retrying.is_empty(), "the state says the scanner is retrying");
    assert!(per_second < 150.0, "backed off, not spinning: {per_second:.0} requests/s");

    // Served consistently again, by the other node: the scanner follows it.
    proxy.serve_only(1);
    let expected = tip_hash(&second).await;
    custodian_testkit::eventually("the second chain followed", std::time::Duration::from_secs(30), || async {
        (ours().await.as_deref() == Some(expected.as_str())).then_some(())
    })
    .await;
    custodian_testkit::eventually("scanning again", std::time::Duration::from_secs(10), || async {
        matches!(*scanner.state().lock().unwrap(), ScannerState::Scanning).then_some(())
    })
    .await;
    stop.send(true).unwrap();
    running.await.unwrap().expect("the scanner never stopped for good");
    assert_eq!(canonical_heights(&db, Chain::Eth).await, (0..=14).collect::<Vec<i64>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_node_is_retried_after_its_timeout_and_never_freezes_the_scanner() {
    use custodian_ingest::{ScanConfig, ScannerState};
    use custodian_testkit::proxy::RpcProxy;
    let (anvil, db, _) = setup().await;
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    send(&anvil, json!({"from": DEV, "to": WATCHED, "value": "0x5"})).await;
    mine(&anvil, 3).await;
    let proxy = RpcProxy::start(&[&anvil.url]).await.unwrap();
    // Silent for every receipts call (its parameters are a block number: "0x" is in all of them).
    proxy.hang_mentioning("eth_getBlockReceipts", "0x");
    let reader = EthReader::with_timeout(&proxy.url, std::time::Duration::from_millis(200)).unwrap();
    let config = ScanConfig {
        initial_backoff: std::time::Duration::from_millis(50),
        max_backoff: std::time::Duration::from_millis(200),
        poll_interval: std::time::Duration::from_millis(50),
        ..small_batches()
    };
    let scanner = std::sync::Arc::new(custodian_ingest::Scanner::new(reader, db.pool.clone(), config));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = {
        let scanner = scanner.clone();
        tokio::spawn(async move { scanner.run(&custodian_ingest::NoProgress, stopped).await })
    };
    let reason = custodian_testkit::eventually(
        "the scanner to say it is retrying",
        std::time::Duration::from_secs(20),
        || async {
            match scanner.state().lock().unwrap().clone() {
                ScannerState::Retrying { reason, .. } => Some(reason),
                _ => None,
            }
        },
    )
    .await;
    assert!(reason.contains("unreachable"), "{reason}");
    proxy.heal();
    custodian_testkit::eventually(
        "the scanner to catch up once the node answers",
        std::time::Duration::from_secs(30),
        || async { (canonical_heights(&db, Chain::Eth).await.len() == 5).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    running.await.unwrap().expect("never stopped for good");
    assert_eq!(observations(&db, Chain::Eth).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_while_a_batch_is_being_stored_lets_that_batch_commit() {
    let (anvil, db, reader) = setup().await;
    watch(&db, Chain::Eth, "alice", WATCHED).await;
    mine(&anvil, 2).await;
    scan(&db, reader.clone(), small_batches()).await;
    assert_eq!(canonical_heights(&db, Chain::Eth).await, (0..=2).collect::<Vec<i64>>());
    send(&anvil, json!({"from": DEV, "to": WATCHED, "value": "0x7"})).await;
    mine(&anvil, 2).await;

    // The next batch's transaction waits on the cursor row, held here.
    let mut holder = db.client().await;
    let held = holder.transaction().await.unwrap();
    held.execute("select 1 from scan_cursor where chain = 'eth' for update", &[]).await.unwrap();
    let scanner = std::sync::Arc::new(custodian_ingest::Scanner::new(reader, db.pool.clone(), small_batches()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = {
        let scanner = scanner.clone();
        tokio::spawn(async move { scanner.run(&custodian_ingest::NoProgress, stopped).await })
    };
    let observer = db.client().await;
    custodian_testkit::eventually(
        "the batch to wait on the cursor lock",
        std::time::Duration::from_secs(20),
        || async {
            let waiting: i64 = observer
            .query_one(
                "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and query like '%scan_cursor%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
            (waiting > 0).then_some(())
        },
    )
    .await;
    stop.send(true).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!running.is_finished(), "the scanner stopped inside the batch's transaction");
    held.commit().await.unwrap();
    running.await.unwrap().expect("stopped cleanly");
    assert_eq!(
        canonical_heights(&db, Chain::Eth).await,
        (0..=5).collect::<Vec<i64>>(),
        "the batch under way when shutdown came was stored whole"
    );
    assert_eq!(observations(&db, Chain::Eth).await.len(), 1);
}
