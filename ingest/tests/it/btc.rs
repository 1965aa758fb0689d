//! BTC deposits against the Bitcoin Core simulator.

use bitcoin::Amount;
use custodian_domain::{BtcNetwork, Chain};
use custodian_ingest::btc::{BtcAuth, BtcReader};
use custodian_testkit::btcsim::{AddrKind, BitcoinSim};
use custodian_testkit::db::column;
use custodian_testkit::TestDb;

use crate::support::*;

async fn setup() -> (BitcoinSim, TestDb, BtcReader) {
    let sim = BitcoinSim::start().await;
    let db = TestDb::new().await;
    let auth = BtcAuth::UserPassword { user: sim.user().to_owned(), password: sim.password().to_owned() };
    let reader = BtcReader::new(&sim.url(), auth, BtcNetwork::Regtest).unwrap();
    (sim, db, reader)
}

#[tokio::test]
async fn outputs_to_watched_p2wpkh_p2pkh_and_p2tr_addresses_are_recorded_with_exact_satoshis() {
    let (sim, db, reader) = setup().await;
    let wpkh = sim.address(AddrKind::P2wpkh, 0);
    let pkh = sim.address(AddrKind::P2pkh, 0);
    let tr = sim.address(AddrKind::P2tr, 0);
    let sh = sim.address(AddrKind::P2shP2wpkh, 0);
    let unwatched = sim.address(AddrKind::P2wpkh, 99);
    for (i, address) in [&wpkh, &pkh, &tr, &sh].into_iter().enumerate() {
        watch(&db, Chain::Btc, &format!("acct-{i}"), &address.to_string()).await;
    }
    sim.mine_empty(1);
    // Several outputs to us in one transaction are separate events.
    let multi = sim.pay(&[
        (wpkh.clone(), Amount::from_sat(123_456_789)),
        (unwatched.clone(), Amount::from_sat(5_000)),
        (pkh.clone(), Amount::from_sat(1)),
        (tr.clone(), Amount::from_sat(2_000_000_000_000_000)),
    ]);
    let single = sim.pay(&[(sh.clone(), Amount::from_sat(42))]);
    sim.mine(&[multi.clone(), single.clone()]);
    sim.mine_empty(2);

    let report = scan(&db, reader, small_batches()).await;
    assert_eq!(report.deposits, 4);
    let multi_id = multi.compute_txid().to_string();
    let single_id = single.compute_txid().to_string();
    let mut expected = vec![
        (multi_id.clone(), 0, "123456789".to_owned(), false),
        (multi_id.clone(), 2, "1".to_owned(), false),
        (multi_id, 3, "2000000000000000".to_owned(), false),
        (single_id, 0, "42".to_owned(), false),
    ];
    expected.sort();
    let mut seen = observations(&db, Chain::Btc).await;
    seen.sort();
    assert_eq!(seen, expected);
    let client = db.pool.get().await.unwrap();
    let addresses: Vec<String> = column(&client, "select address from deposit_event order by address", &[]).await;
    let mut want = vec![wpkh.to_string(), pkh.to_string(), tr.to_string(), sh.to_string()];
    want.sort();
    assert_eq!(addresses, want);
    assert_eq!(canonical_heights(&db, Chain::Btc).await, (0..=4).collect::<Vec<i64>>());
}

#[tokio::test]
async fn a_two_block_reorg_orphans_and_a_transaction_in_both_branches_is_observed_twice() {
    let (sim, db, reader) = setup().await;
    let ours = sim.address(AddrKind::P2wpkh, 1);
    watch(&db, Chain::Btc, "alice", &ours.to_string()).await;
    sim.mine_empty(3);
    let kept = sim.pay(&[(ours.clone(), Amount::from_sat(70_000))]);
    let lost = sim.pay(&[(ours.clone(), Amount::from_sat(30_000))]);
    sim.mine(std::slice::from_ref(&kept));
    sim.mine(std::slice::from_ref(&lost));
    scan(&db, reader.clone(), small_batches()).await;
    assert_eq!(observations(&db, Chain::Btc).await.len(), 2);

    // Replace the last two blocks with three; `kept` is mined again in the second, `lost` is not.
    let old_tip = sim.block_hash(sim.height()).unwrap().to_string();
    sim.reorg(2, &[vec![], vec![kept.clone()], vec![]]);
    let report = scan(&db, reader.clone(), small_batches()).await;
    assert_eq!((report.reorgs, report.orphaned), (1, 2));

    let kept_id = kept.compute_txid().to_string();
    let lost_id = lost.compute_txid().to_string();
    let seen = observations(&db, Chain::Btc).await;
    let of =
        |id: &str| seen.iter().filter(|(tx, ..)| tx == id).map(|(_, _, _, orphaned)| *orphaned).collect::<Vec<_>>();
    let mut kept_states = of(&kept_id);
    kept_states.sort();
    assert_eq!(kept_states, [false, true], "kept: one canonical and one orphaned observation");
    assert_eq!(of(&lost_id), [true], "lost: only its orphaned observation");
    let client = db.pool.get().await.unwrap();
    let orphaned: bool = client
        .query_one("select orphaned_at is not null from chain_block where block_hash = $1", &[&old_tip])
        .await
        .unwrap()
        .get(0);
    assert!(orphaned);
    assert_eq!(canonical_heights(&db, Chain::Btc).await, (0..=6).collect::<Vec<i64>>());
}

#[tokio::test]
async fn reparse_reproduces_deleted_events_from_raw_blocks_without_the_node() {
    let (sim, db, reader) = setup().await;
    let ours = sim.address(AddrKind::P2wpkh, 2);
    watch(&db, Chain::Btc, "alice", &ours.to_string()).await;
    for sats in [1_000u64, 2_000, 3_000] {
        let tx = sim.pay(&[(ours.clone(), Amount::from_sat(sats))]);
        sim.mine(&[tx]);
    }
    scan(&db, reader, small_batches()).await;
    let before = snapshot(&db, "deposit_event").await;
    assert_eq!(before.len(), 3);
    drop(sim); // the node is gone: reparse must not need it

    // A scratch copy where the events were lost (as a superuser, bypassing the append-only guard).
    let scratch = format!("{}_scratch", db.name);
    db.pool.close();
    let root_url = custodian_testkit::db::superuser_url();
    let (root, connection) = root_url.config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    root.batch_execute(&format!("create database \"{scratch}\" template \"{}\" owner custodian_owner", db.name))
        .await
        .unwrap();
    // reparse runs as the service's login; the loss is forged as a superuser
    let pool = custodian_store::connect(&custodian_testkit::db::server_url().with_dbname(&scratch), 2).await.unwrap();
    let (client, connection) = root_url.with_dbname(&scratch).config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    client
        .batch_execute(
            "set session_replication_role = replica; delete from deposit_event; set session_replication_role = origin;",
        )
        .await
        .unwrap();
    assert_eq!(client.query_one("select count(*) from deposit_event", &[]).await.unwrap().get::<_, i64>(0), 0);
    drop(client);

    let report = custodian_ingest::reparse::reparse(&pool, Chain::Btc, BtcNetwork::Regtest, 0).await.unwrap();
    assert_eq!((report.blocks, report.deposits_added, report.pruned), (4, 3, 0));
    let client = pool.get().await.unwrap();
    let rows = client.query("select t::text from deposit_event t order by 1", &[]).await.unwrap();
    let after: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    // Ids, observation times and audit positions are new; everything the chain said is identical:
    // (chain, block_hash, tx_hash, output_index, address, asset, amount).
    let what_the_chain_said = |rows: Vec<String>| -> Vec<String> {
        let mut said: Vec<String> =
            rows.iter().map(|r| r.split(',').skip(1).take(7).collect::<Vec<_>>().join(",")).collect();
        said.sort();
        said
    };
    assert_eq!(what_the_chain_said(after), what_the_chain_said(before));
    drop(client);
    pool.close();
    root.batch_execute(&format!("drop database \"{scratch}\" with (force)")).await.unwrap();
}

#[tokio::test]
async fn a_node_outage_is_retried_with_backoff() {
    let (sim, db, reader) = setup().await;
    let ours = sim.address(AddrKind::P2wpkh, 3);
    watch(&db, Chain::Btc, "alice", &ours.to_string()).await;
    let tx = sim.pay(&[(ours.clone(), Amount::from_sat(9_999))]);
    sim.mine(&[tx]);
    sim.set_unavailable(true);
    let config = custodian_ingest::ScanConfig { max_retries: 3, ..small_batches() };
    let failed = custodian_ingest::Scanner::new(reader.clone(), db.pool.clone(), config.clone())
        .run_to_tip(&custodian_ingest::NoProgress)
        .await;
    assert!(matches!(failed, Err(custodian_ingest::ScanError::NodeUnavailable { attempts: 3, .. })), "{failed:?}");

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let scanner = custodian_ingest::Scanner::new(reader, db.pool.clone(), config);
    let running = tokio::spawn(async move { scanner.run(&custodian_ingest::NoProgress, stopped).await });
    // The node comes back once the running scanner has been refused at least twice (a retry).
    let refused = sim.refused_count();
    custodian_testkit::eventually(
        "the scanner retries through the outage",
        std::time::Duration::from_secs(20),
        || async { (sim.refused_count() >= refused + 2).then_some(()) },
    )
    .await;
    sim.set_unavailable(false);
    custodian_testkit::eventually("the deposit after the outage", std::time::Duration::from_secs(20), || async {
        (observations(&db, Chain::Btc).await.len() == 1).then_some(())
    })
    .await;
    stop.send(true).unwrap();
    running.await.unwrap().expect("the continuous scanner stops cleanly");
}

/// The coins `address` holds according to `unspent_output`: (txid, vout, satoshis).
async fn unspent(db: &TestDb, address: &str) -> Vec<(String, i32, String)> {
    db.pool
        .get()
        .await
        .unwrap()
        .query(
            "select tx_hash, output_index, amount::text from unspent_output where address = $1 order by tx_hash, output_index",
            &[&address],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

#[tokio::test]
async fn a_spend_of_our_output_is_recorded_per_block_and_a_reorg_makes_the_coin_unspent_again() {
    let (sim, db, reader) = setup().await;
    let ours = sim.address(AddrKind::P2wpkh, 3);
    let elsewhere = sim.address(AddrKind::P2wpkh, 98);
    watch(&db, Chain::Btc, "treasury-like", &ours.to_string()).await;
    let funding = sim.pay(&[(ours.clone(), Amount::from_sat(100_000)), (elsewhere.clone(), Amount::from_sat(7_000))]);
    let funding_block = sim.mine(std::slice::from_ref(&funding));
    // A spend of an output we do not hold is not recorded.
    let theirs = bitcoin::OutPoint { txid: funding.compute_txid(), vout: 1 };
    let coin = bitcoin::OutPoint { txid: funding.compute_txid(), vout: 0 };
    let spend =
        sim.spend_p2wpkh(3, &[(coin, Amount::from_sat(100_000))], &[(elsewhere.clone(), Amount::from_sat(90_000))]);
    let unrelated =
        sim.spend_p2wpkh(98, &[(theirs, Amount::from_sat(7_000))], &[(elsewhere.clone(), Amount::from_sat(6_000))]);
    scan(&db, reader.clone(), small_batches()).await;
    assert_eq!(
        unspent(&db, &ours.to_string()).await,
        vec![(funding.compute_txid().to_string(), 0, "100000".to_owned())]
    );

    let spent_in = sim.mine(&[spend.clone(), unrelated]);
    scan(&db, reader.clone(), small_batches()).await;
    let client = db.pool.get().await.unwrap();
    let rows: Vec<(String, i32, String, i32, String)> = client
        .query(
            "select tx_hash, output_index, spending_tx, input_index, block_hash from output_spend order by block_hash",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    assert_eq!(
        rows,
        vec![(funding.compute_txid().to_string(), 0, spend.compute_txid().to_string(), 0, spent_in.to_string())],
        "only the spend of our output"
    );
    assert!(unspent(&db, &ours.to_string()).await.is_empty(), "spent");

    // The spending block is replaced by one without it: the coin is ours to spend again; then
    // the spend is mined once more (Core offered it back to its mempool) and is recorded there.
    sim.reorg(1, &[vec![], vec![]]);
    scan(&db, reader.clone(), small_batches()).await;
    assert_eq!(unspent(&db, &ours.to_string()).await.len(), 1, "unspent on the canonical chain again");
    assert!(sim.mempool().contains(&spend.compute_txid()), "back in the node's mempool");
    let again = sim.mine_mempool();
    scan(&db, reader, small_batches()).await;
    assert!(unspent(&db, &ours.to_string()).await.is_empty());
    let blocks: Vec<String> = column(&client, "select block_hash from output_spend order by recorded_at", &[]).await;
    assert_eq!(blocks, vec![spent_in.to_string(), again.to_string()], "one observation per block, both kept");

    // Every recorded spend is an input of its own block's retained bytes; a forged one is named.
    let check =
        custodian_ingest::reparse::verify_observations(&db.pool, Chain::Btc, BtcNetwork::Regtest).await.unwrap();
    assert!(check.differences.is_empty(), "{:?}", check.differences);
    client
        .execute(
            "insert into output_spend (chain, tx_hash, output_index, spending_tx, input_index, block_hash)
             values ('btc', $1, 0, $2, 0, $3)",
            &[&funding.compute_txid().to_string(), &funding.compute_txid().to_string(), &funding_block.to_string()],
        )
        .await
        .unwrap();
    let check =
        custodian_ingest::reparse::verify_observations(&db.pool, Chain::Btc, BtcNetwork::Regtest).await.unwrap();
    assert_eq!(check.differences.len(), 1, "{:?}", check.differences);
    assert!(check.differences[0].contains("is not in that block's retained payload"), "{:?}", check.differences);
}
