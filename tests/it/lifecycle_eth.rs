//! The Ethereum side of the deposit lifecycle through the binary, against real anvil nodes: a chain
//! that comes back, ETH moved by contracts, a token transfer re-mined at another position, and
//! nodes on another chain.

use alloy::primitives::keccak256;
use custodian_domain::{Amount, Chain, ChainAddress};
use custodian_projections::policy;
use custodian_store::ownership;
use custodian_testkit::db::column;
use custodian_testkit::{Anvil, TestDb};
use serde_json::{json, Value};

use crate::harness::{custodian, custodian_env_async, Run};

const DEV: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";
const DEV1: &str = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8";
const W1: &str = "0x1000000000000000000000000000000000000001";
const W2: &str = "0x2000000000000000000000000000000000000002";

async fn run(db: &TestDb, node: &str, extra: &[(&str, &str)], args: &[&str]) -> Run {
    let mut env: Vec<(String, String)> = vec![
        ("CUSTODIAN_DATABASE_URL".into(), db.url.expose().to_owned()),
        ("CUSTODIAN_ETH_RPC_URL".into(), node.to_owned()),
    ];
    env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    custodian_env_async(env, args).await
}

async fn scan(db: &TestDb, node: &Anvil) {
    let scanned = run(db, &node.url, &[], &["scan", "--chain", "eth", "--once", "--json"]).await;
    assert_eq!(scanned.code, 0, "{}", scanned.stderr);
}

async fn watch(db: &TestDb, name: &str, address: &str) -> i64 {
    let mut client = db.pool.get().await.unwrap();
    let (account, _) = ownership::create_account(&client, name).await.unwrap();
    ownership::assign_address(&mut client, &ChainAddress::parse_stored(address).unwrap(), account.id, Some(0))
        .await
        .unwrap();
    account.id
}

/// The account's available balance of `asset`, in smallest units.
async fn available(db: &TestDb, account: i64, asset: &str) -> String {
    let client = db.pool.get().await.unwrap();
    let row = client
        .query_opt(
            "select available::text from account_balance where account_id = $1 and asset = $2",
            &[&account, &asset],
        )
        .await
        .unwrap();
    row.map_or("0".to_owned(), |r| r.get(0))
}

async fn send(node: &Anvil, tx: Value) -> String {
    let hash = node.rpc("eth_sendTransaction", json!([tx])).await.expect("eth_sendTransaction");
    let hash = hash.as_str().unwrap().to_owned();
    let receipt = receipt(node, &hash).await;
    assert_eq!(receipt["status"], "0x1", "{receipt}");
    hash
}

/// The receipt of `hash`, once mined (automine mines right after answering the send).
async fn receipt(node: &Anvil, hash: &str) -> Value {
    custodian_testkit::eventually(&format!("a receipt for {hash}"), std::time::Duration::from_secs(10), || async {
        let receipt = node.rpc("eth_getTransactionReceipt", json!([hash])).await.unwrap();
        (!receipt.is_null()).then_some(receipt)
    })
    .await
}

async fn mine(node: &Anvil, n: u64) {
    node.rpc("anvil_mine", json!([format!("0x{n:x}")])).await.unwrap();
}

async fn deploy(node: &Anvil, bytecode: &str) -> String {
    let hash = send(node, json!({"from": DEV, "data": format!("0x{bytecode}"), "gas": "0x2dc6c0"})).await;
    let receipt = receipt(node, &hash).await;
    receipt["contractAddress"].as_str().unwrap().to_owned()
}

fn selector(signature: &str) -> String {
    hex(&keccak256(signature.as_bytes())[..4])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn word_address(address: &str) -> String {
    format!("{:0>64}", address.trim_start_matches("0x"))
}

fn word(value: u128) -> String {
    format!("{value:064x}")
}

fn verified(db: &TestDb) {
    let replay = custodian(db.url.expose(), &["replay", "--verify", "--json"]);
    assert_eq!(replay.code, 0, "{}", replay.stdout);
}

async fn observations(db: &TestDb) -> Vec<(String, String, i32, String, String)> {
    let client = db.pool.get().await.unwrap();
    client
        .query(
            "select tx_hash, kind, output_index, address, amount::text from deposit_event order by tx_hash, kind, output_index",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_that_comes_back_is_reinstated_and_its_deposit_credited_once() {
    let db = TestDb::new().await;
    let first = Anvil::spawn_shared_genesis(&[]).await.unwrap();
    let second = Anvil::spawn_shared_genesis(&[]).await.unwrap();
    let alice = watch(&db, "alice", W1).await;
    send(&first, json!({"from": DEV, "to": W1, "value": "0x3e8"})).await; // block 1
    mine(&first, 13).await; // tip 14: 14 confirmations
    mine(&second, 20).await; // the same genesis, a longer chain without the payment
    scan(&db, &first).await;
    assert_eq!(available(&db, alice, "ETH").await, "1000");
    scan(&db, &second).await; // the first chain's blocks are orphaned
    scan(&db, &second).await;
    assert_eq!(available(&db, alice, "ETH").await, "1000", "nothing is taken back automatically");
    mine(&first, 16).await; // tip 30: longer again
    scan(&db, &first).await; // its blocks come back
    scan(&db, &first).await;

    let client = db.pool.get().await.unwrap();
    let reinstated: i64 = client
        .query_one("select count(*) from block_verdict where chain = 'eth' and verdict = 'reinstated'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(reinstated, 14, "blocks 1..=14 of the first chain came back");
    let tip: i64 = client
        .query_one("select max(height) from chain_block where chain = 'eth' and orphaned_at is null", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(tip, 30, "the scanner continued past the blocks that came back");
    assert_eq!(available(&db, alice, "ETH").await, "1000");
    let credits: i64 =
        client.query_one("select count(*) from ledger_transfer where kind = 'deposit'", &[]).await.unwrap().get(0);
    assert_eq!(credits, 1, "credited once");
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eth_sent_by_contracts_is_credited_and_a_reverted_inner_call_is_not() {
    let db = TestDb::new().await;
    let node = Anvil::spawn().await.unwrap();
    let forwarder = deploy(&node, include_str!("../../testkit/contracts/Forwarder.bin")).await;
    let gift = deploy(&node, include_str!("../../testkit/contracts/GiftToken.bin")).await;
    let alice = watch(&db, "alice", W1).await;
    let bob = watch(&db, "bob", W2).await;
    // The gift token's own address is watched too: paying it ETH is a native deposit of carol's.
    let carol = watch(&db, "carol", &gift).await;
    {
        let client = db.pool.get().await.unwrap();
        ownership::add_token(&client, &gift, "GIFT", 0).await.unwrap();
        policy::set_tier(&client, Chain::Eth, &format!("eth:{gift}"), Amount::ZERO, 12, "test").await.unwrap();
    }
    // A contract wallet paying alice.
    let forward = send(
        &node,
        json!({"from": DEV, "to": forwarder, "value": "0x5", "data": format!("0x{}{}", selector("forward(address)"), word_address(W1))}),
    )
    .await;
    // A batch payout to alice and bob.
    let batch_data = [
        selector("batch(address[],uint256[])"),
        word(0x40),
        word(0xa0),
        word(2),
        word_address(W1),
        word_address(W2),
        word(2),
        word(7),
        word(9),
    ]
    .concat();
    let batch_data = format!("0x{batch_data}");
    let batch = send(&node, json!({"from": DEV, "to": forwarder, "value": "0x10", "data": batch_data})).await;
    // A payment to bob inside an inner call that reverts: the transaction succeeds, bob gets nothing.
    send(
        &node,
        json!({"from": DEV, "to": forwarder, "value": "0xb", "gas": "0x30d40",
               "data": format!("0x{}{}", selector("payThenRevert(address)"), word_address(W2))}),
    )
    .await;
    // ETH paid to carol's watched address and a token Transfer at log 0 to alice, in one transaction.
    let both = send(
        &node,
        json!({"from": DEV, "to": gift, "value": "0xd",
               "data": format!("0x{}{}{}", selector("gift(address,uint256)"), word_address(W1), word(100))}),
    )
    .await;
    mine(&node, 12).await;
    scan(&db, &node).await;

    let found = observations(&db).await;
    let expect = |tx: &str, kind: &str, index: i32, to: &str, amount: &str| {
        (tx.to_owned(), kind.to_owned(), index, to.to_owned(), amount.to_owned())
    };
    assert!(found.contains(&expect(&forward, "internal", 1, W1, "5")), "{found:?}");
    assert!(found.contains(&expect(&batch, "internal", 1, W1, "7")), "{found:?}");
    assert!(found.contains(&expect(&batch, "internal", 2, W2, "9")), "{found:?}");
    assert!(found.contains(&expect(&both, "native", 0, &gift, "13")), "{found:?}");
    assert!(found.contains(&expect(&both, "log", 0, W1, "100")), "{found:?}");
    assert_eq!(found.len(), 5, "the reverted inner payment is not a deposit: {found:?}");
    assert_eq!(available(&db, alice, "ETH").await, "12");
    assert_eq!(available(&db, alice, &format!("eth:{gift}")).await, "100");
    assert_eq!(available(&db, bob, "ETH").await, "9");
    assert_eq!(available(&db, carol, "ETH").await, "13");
    // The traces are kept with the raw block: re-parsing finds the same deposits.
    let reparsed = run(&db, &node.url, &[], &["reparse", "--chain", "eth", "--from-height", "0", "--json"]).await;
    assert_eq!(reparsed.code, 0, "{}", reparsed.stderr);
    assert_eq!(reparsed.json()["report"]["deposits_added"], 0, "{}", reparsed.stdout);
    verified(&db);

    // With traces off, knowingly, internal deposits are not seen.
    let blind = TestDb::new().await;
    watch(&blind, "alice", W1).await;
    let scanned =
        run(&blind, &node.url, &[("CUSTODIAN_ETH_TRACES", "false")], &["scan", "--chain", "eth", "--once"]).await;
    assert_eq!(scanned.code, 0, "{}", scanned.stderr);
    assert!(observations(&blind).await.iter().all(|o| o.1 != "internal"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_transfer_re_mined_at_another_position_after_a_deep_reorg_is_credited_once() {
    let db = TestDb::new().await;
    let node = Anvil::spawn().await.unwrap();
    let args = [
        word(0x80),
        word(0xc0),
        word(6),
        word(1_000_000),
        word(4),
        format!("{:0<64}", hex(b"Test")),
        word(2),
        format!("{:0<64}", hex(b"TT")),
    ]
    .concat();
    let token = deploy(&node, &format!("{}{args}", include_str!("../../testkit/contracts/TestToken.bin"))).await;
    let transfer = |to: &str, amount: u128| {
        format!("0x{}{}{}", selector("transfer(address,uint256)"), word_address(to), word(amount))
    };
    send(&node, json!({"from": DEV, "to": token, "data": transfer(DEV1, 1000)})).await;
    let alice = watch(&db, "alice", W1).await;
    let asset = format!("eth:{token}");
    {
        let client = db.pool.get().await.unwrap();
        ownership::add_token(&client, &token, "TT", 6).await.unwrap();
        policy::set_tier(&client, Chain::Eth, &asset, Amount::ZERO, 2, "test").await.unwrap();
    }
    let nonce = node.rpc("eth_getTransactionCount", json!([DEV, "pending"])).await.unwrap();
    let raw = node
        .rpc(
            "eth_signTransaction",
            json!([{"from": DEV, "to": token, "data": transfer(W1, 500), "gas": "0x186a0", "nonce": nonce,
                    "maxFeePerGas": "0x77359400", "maxPriorityFeePerGas": "0x1", "chainId": "0x7a69"}]),
        )
        .await
        .unwrap();
    let hash = node.rpc("eth_sendRawTransaction", json!([raw])).await.unwrap();
    let first = receipt(&node, hash.as_str().unwrap()).await;
    assert_eq!(first["logs"][0]["logIndex"], "0x0", "alone in its block");
    let mined_at = u64::from_str_radix(first["blockNumber"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    mine(&node, 5).await;
    scan(&db, &node).await;
    assert_eq!(available(&db, alice, &asset).await, "500");

    // A reorg deeper than the tier re-mines it behind another token transfer: its block-wide log
    // index becomes 1, its position in its own receipt stays 0.
    let depth = 6;
    node.rpc(
        "anvil_reorg",
        json!([depth, [[{"from": DEV1, "to": token, "data": transfer(W2, 1), "gas": "0x186a0"}, 0], [raw, 0]]]),
    )
    .await
    .unwrap();
    mine(&node, 4).await;
    let again = receipt(&node, hash.as_str().unwrap()).await;
    assert_eq!(again["logs"][0]["logIndex"], "0x1", "re-mined behind another transfer: {again}");
    assert_ne!(again["blockHash"], first["blockHash"]);
    assert!(mined_at >= 1);
    scan(&db, &node).await;
    scan(&db, &node).await;
    assert_eq!(available(&db, alice, &asset).await, "500", "credited once");
    let client = db.pool.get().await.unwrap();
    let keys: Vec<String> =
        column(&client, "select idempotency_key from ledger_transfer where kind = 'deposit'", &[]).await;
    assert_eq!(keys, [format!("deposit:eth:{hash}:log:0:credit:1", hash = hash.as_str().unwrap())]);
    verified(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_another_chain_id_or_genesis_is_refused_with_nothing_written() {
    let db = TestDb::new().await;
    let node = Anvil::spawn().await.unwrap();
    watch(&db, "alice", W1).await;
    mine(&node, 3).await;
    scan(&db, &node).await;
    let client = db.pool.get().await.unwrap();
    let count = || async {
        let client = db.pool.get().await.unwrap();
        client.query_one("select count(*) from chain_block", &[]).await.unwrap().get::<_, i64>(0)
    };
    let before = count().await;
    let identity: (String, i64) = client
        .query_one("select genesis_hash, chain_id from chain_identity where chain = 'eth'", &[])
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(identity.1, 31337);

    let other_id = Anvil::spawn_with(&["--chain-id", "99"]).await.unwrap();
    mine(&other_id, 6).await;
    let refused = run(&db, &other_id.url, &[], &["scan", "--chain", "eth", "--once"]).await;
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert!(refused.stderr.contains("chain id 99"), "{}", refused.stderr);
    let other_genesis = Anvil::spawn_with(&["--timestamp", "1600000000"]).await.unwrap();
    mine(&other_genesis, 6).await;
    let refused = run(&db, &other_genesis.url, &[], &["scan", "--chain", "eth", "--once"]).await;
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert!(refused.stderr.contains(&identity.0), "names the recorded genesis: {}", refused.stderr);
    // The withdrawal worker refuses it too, before anything is signed.
    let worker = run(&db, &other_genesis.url, &[], &["work", "--once"]).await;
    assert_eq!(worker.code, 1, "{}", worker.stderr);
    assert!(worker.stderr.contains("this database records"), "{}", worker.stderr);
    assert_eq!(count().await, before, "nothing was written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_trace_api_is_a_start_up_error_unless_traces_are_off() {
    let db = TestDb::new().await;
    let node = Anvil::spawn().await.unwrap();
    watch(&db, "alice", W1).await;
    send(&node, json!({"from": DEV, "to": W1, "value": "0x7"})).await;
    let proxy = custodian_testkit::proxy::RpcProxy::start(&[&node.url]).await.unwrap();
    proxy.refuse("debug_traceBlockByNumber");
    let refused = run(&db, &proxy.url, &[], &["scan", "--chain", "eth", "--once"]).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("CUSTODIAN_ETH_TRACES=false"), "names the way out: {}", refused.stderr);
    assert!(observations(&db).await.is_empty(), "nothing was scanned");
    let knowingly =
        run(&db, &proxy.url, &[("CUSTODIAN_ETH_TRACES", "false")], &["scan", "--chain", "eth", "--once"]).await;
    assert_eq!(knowingly.code, 0, "{}", knowingly.stderr);
    assert_eq!(observations(&db).await.len(), 1, "the native deposit is still seen");
}
