//! The edges of withdrawals a real chain produces (DESIGN §7 items 11–14), against real PostgreSQL
//! and anvil: a cancel raced by a reorg and a bump, ERC-20 payouts settled by their `Transfer`
//! events, hot-wallet shortages, and the bumping rules.

use alloy_primitives::U256;
use custodian_domain::withdrawal::WithdrawalState;
use custodian_testkit::fixtures::{posted_balance, Normal};
use custodian_withdrawals::{hot_wallet, sql};
use serde_json::json;

use crate::eth_harness::{
    config, edge_destination as destination, mined, on_one_lane, work_until_state, Harness, ETHER, FUNDER,
};

/// The CLI against this harness's database and node, as the operator.
async fn operator_cli(h: &Harness) -> impl Fn(Vec<String>) -> futures::future::BoxFuture<'static, crate::harness::Run> {
    let env = vec![
        ("CUSTODIAN_DATABASE_URL".to_owned(), h.db.url.expose().to_owned()),
        ("CUSTODIAN_TOKEN".to_owned(), crate::harness::operator(&h.db).await),
        ("CUSTODIAN_ETH_RPC_URL".to_owned(), h.anvil.url.clone()),
        // Resolutions need their evidence buried this deep (the tests' withdrawal depth).
        ("CUSTODIAN_WITHDRAWAL_CONFIRMATIONS".to_owned(), "1".to_owned()),
    ];
    move |args: Vec<String>| {
        let env = env.clone();
        Box::pin(async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            crate::harness::custodian_env_async(env, &args).await
        })
    }
}

fn args(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn needs_review_is_resolved_only_with_evidence_that_holds_on_chain() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 100 * ETHER).await;
    let (lane, ids) = on_one_lane(&h, alice, 2).await;
    let worker = h.worker(config(1));
    let lane = h.lane(&lane).await;
    assert_eq!(worker.allocate_lane(&lane).await.unwrap().signed, 2);
    let (w1, w2) = (
        sql::load(&h.db.pool.get().await.unwrap(), ids[0]).await.unwrap().unwrap(),
        sql::load(&h.db.pool.get().await.unwrap(), ids[1]).await.unwrap().unwrap(),
    );
    // Someone with the lane's key consumes both nonces first: the first pays w1's destination
    // what w1 asks, the second pays someone else.
    let key = h.signers[lane.lane.as_str()].clone();
    let outside = |nonce: u64, to: &str, value: U256| {
        let tx = alloy::consensus::TxEip1559 {
            chain_id: 31337,
            nonce,
            gas_limit: 21_000,
            max_fee_per_gas: 1_000_000_000_000,
            max_priority_fee_per_gas: 500_000_000_000,
            to: alloy_primitives::TxKind::Call(to.parse().unwrap()),
            value,
            ..Default::default()
        };
        key.sign(tx).unwrap()
    };
    let paid = outside(w1.nonce().unwrap().get(), &w1.destination().stored(), U256::from(ETHER));
    let other = outside(w2.nonce().unwrap().get(), FUNDER, U256::from(1u8));
    for signed in [&paid, &other] {
        h.rpc("eth_sendRawTransaction", json!([format!("0x{}", alloy_primitives::hex::encode(&signed.raw))])).await;
    }
    let funder_tx = h
        .rpc("eth_sendTransaction", json!([{"from": FUNDER, "to": w1.destination(), "value": format!("{:#x}", ETHER)}]))
        .await;
    h.mine(1).await;
    let first = worker.pass().await.unwrap();
    assert_eq!(first.needs_review, 0, "one answer is not evidence: {first:?}");
    h.mine(1).await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.needs_review, 2, "seen again at a later block: {report:?}");
    let (paid, other) = (format!("{:#x}", paid.hash), format!("{:#x}", other.hash));
    let funder_tx = funder_tx.as_str().unwrap().to_owned();

    let cli = operator_cli(&h).await;
    let refused = cli(args(&format!("withdrawals resolve --id {} --paid-by {funder_tx}", w1.id()))).await;
    assert_eq!(refused.code, 2, "a transaction that is not ours: {}", refused.stderr);
    assert!(refused.stderr.contains("not by the hot wallet"), "{}", refused.stderr);
    let refused = cli(args(&format!("withdrawals resolve --id {} --paid-by {other}", w1.id()))).await;
    assert_eq!(refused.code, 2, "ours, at another nonce: {}", refused.stderr);
    assert!(refused.stderr.contains("used nonce"), "{}", refused.stderr);
    let refused = cli(args(&format!("withdrawals resolve --id {} --paid-by {other}", w2.id()))).await;
    assert_eq!(refused.code, 2, "ours, at its nonce, paying someone else: {}", refused.stderr);
    let refused = cli(args(&format!("withdrawals resolve --id {} --not-paid", w1.id()))).await;
    assert_eq!(refused.code, 2, "the transaction that consumed w1's nonce paid it: {}", refused.stderr);
    assert!(refused.stderr.contains(&format!("--paid-by {paid}")), "{}", refused.stderr);
    assert_eq!(h.state(w1.id().get()).await, WithdrawalState::NeedsReview, "{}", refused.stderr);
    assert_eq!(
        h.count("select count(*) from withdrawal_event where event_type = 'resolved'").await,
        0,
        "nothing written"
    );

    let shallow = cli(args(&format!("withdrawals resolve --id {} --paid-by {paid} --confirmations 50", w1.id()))).await;
    assert_eq!(shallow.code, 2, "evidence not yet buried: {}", shallow.stderr);
    assert!(shallow.stderr.contains("of the 50 confirmations"), "{}", shallow.stderr);
    let resolved = cli(args(&format!("withdrawals resolve --id {} --paid-by {paid} --json", w1.id()))).await;
    assert_eq!(resolved.code, 0, "{}", resolved.stderr);
    assert_eq!(resolved.json()["paid"], true);
    assert_eq!(h.state(w1.id().get()).await, WithdrawalState::Confirmed);
    let resolved = cli(args(&format!("withdrawals resolve --id {} --not-paid --json", w2.id()))).await;
    assert_eq!(resolved.code, 0, "{}", resolved.stderr);
    assert_eq!(h.state(w2.id().get()).await, WithdrawalState::Cancelled);
    let again = cli(args(&format!("withdrawals resolve --id {} --not-paid", w2.id()))).await;
    assert_eq!(again.code, 2, "resolved once: {}", again.stderr);
    assert_eq!(h.available(alice).await, (99 * ETHER).to_string(), "w1 paid, w2's hold released");
    assert_eq!(
        h.count("select count(*) from operator_action where action = 'withdrawal_resolved' and principal = 'operator'")
            .await,
        2
    );
    h.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_lane_takes_no_new_withdrawals_and_finishes_what_it_holds() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 100 * ETHER).await;
    // One withdrawal waiting on lane a when it is retired.
    let mut n = 0;
    let held = loop {
        n += 1;
        let w = h.request(alice, &format!("ret-{n}"), &destination(200 + n), ETHER).await.unwrap().withdrawal;
        if w.lane() == "a" {
            break w.id();
        }
    };
    let cli = operator_cli(&h).await;
    let retired = cli(args("hot-wallet retire --lane a --json")).await;
    assert_eq!(retired.code, 0, "{}", retired.stderr);
    let last = cli(args("hot-wallet retire --lane b")).await;
    assert_eq!(last.code, 2, "the last open lane stays: {}", last.stderr);
    assert!(last.stderr.contains("last lane open"), "{}", last.stderr);
    for i in 0..8 {
        let w = h.request(alice, &format!("after-{i}"), &destination(300 + i), ETHER).await.unwrap().withdrawal;
        assert_eq!(w.lane(), "b", "new withdrawals skip the retired lane");
    }
    let listed = cli(args("hot-wallet list --json")).await;
    assert_eq!(listed.json()[0]["retired"], true);
    let worker = h.worker(config(1));
    work_until_state(&h, &worker, false, held.get(), WithdrawalState::Confirmed).await;
    h.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_payment_reorged_out_deeper_than_the_depth_goes_back_to_review_and_is_resolved_when_mined_again() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    h.mine(5).await;
    let w = h.request(alice, "deep-1", &destination(60), ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(2));
    worker.pass().await.unwrap();
    work_until_state(&h, &worker, true, w.id().get(), WithdrawalState::Confirmed).await;
    let confirmed = sql::load(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap().unwrap();
    let hash = confirmed.tx_hash().unwrap();
    let raw = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get())
        .await
        .unwrap()
        .into_iter()
        .find(|a| a.tx_hash == hash)
        .unwrap()
        .raw;

    // Every block from the payment's up replaced (deeper than the depth of 2), and the payment
    // does not come back on its own.
    h.mine(1).await;
    let head = h.rpc("eth_blockNumber", json!([])).await;
    let head = u64::from_str_radix(head.as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    let depth = head - confirmed.mined_block_number().unwrap() + 1;
    assert!(depth > 2, "confirmed at depth {depth}");
    h.rpc("anvil_reorg", json!([depth, []])).await;
    let _ = h.anvil.rpc("anvil_dropTransaction", json!([hash])).await;
    assert!(h.anvil.rpc("eth_getTransactionReceipt", json!([hash])).await.unwrap().is_null());
    let first = worker.pass().await.unwrap();
    assert_eq!(first.needs_review, 0, "one sighting is not evidence");
    assert_eq!(first.nonce_gaps.len(), 1, "the chain's nonce is below ours with nothing in flight: {first:?}");
    h.mine(1).await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.needs_review, 1, "{report:?}");
    assert_eq!(report.paused_lanes, vec![w.lane().to_string()]);
    assert_eq!(h.state(w.id().get()).await, WithdrawalState::NeedsReview);
    // Its hold was settled: it holds nothing, and the books still verify.
    let held: String =
        h.db.pool
            .get()
            .await
            .unwrap()
            .query_one(
                "select coalesce(sum(held), 0)::text from account_balance where account_id = $1 and asset = 'ETH'",
                &[&alice],
            )
            .await
            .unwrap()
            .get(0);
    assert_eq!(held, "0");
    h.verify().await;

    let cli = operator_cli(&h).await;
    let refused = cli(args(&format!("withdrawals resolve --id {} --not-paid", w.id()))).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    let refused = cli(args(&format!("withdrawals resolve --id {} --paid-by {hash}", w.id()))).await;
    assert_eq!(refused.code, 2, "not on chain: {}", refused.stderr);
    assert!(refused.stderr.contains("does not know transaction"), "{}", refused.stderr);
    // The way out: the operator sends the same bytes again (nothing is signed), they mine.
    let _ = raw;
    let sent = cli(args(&format!("withdrawals rebroadcast --id {} --json", w.id()))).await;
    assert_eq!(sent.code, 0, "{}", sent.stderr);
    assert_eq!(sent.json()["tx_hash"], hash.to_string());
    let again = cli(args(&format!("withdrawals rebroadcast --id {}", w.id()))).await;
    assert_eq!(again.code, 0, "already known is sent: {}", again.stderr);
    assert_eq!(h.count(&format!("select count(*) from withdrawal_attempt where withdrawal_id = {}", w.id())).await, 1);
    h.mine(1).await;
    let resolved = cli(args(&format!("withdrawals resolve --id {} --paid-by {hash} --json", w.id()))).await;
    assert_eq!(resolved.code, 0, "{}", resolved.stderr);
    assert_eq!(h.state(w.id().get()).await, WithdrawalState::Confirmed);
    assert_eq!(
        h.count("select count(*) from ledger_transfer where kind = 'withdrawal_settle'").await,
        1,
        "settled once"
    );
    assert_eq!(h.balance(&destination(60)).await, U256::from(ETHER), "paid once");
    h.verify().await;
}

/// The ledger's custody of ETH, in wei.
async fn custody(h: &Harness) -> String {
    posted_balance(&h.db.pool.get().await.unwrap(), "custody", "ETH", Normal::Debit).await
}

async fn ledger_balance(h: &Harness, account: &str) -> String {
    posted_balance(&h.db.pool.get().await.unwrap(), account, "ETH", Normal::Credit).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_top_up_and_a_rebalance_keep_custody_equal_to_what_our_addresses_hold() {
    let h = Harness::start(&[]).await;
    let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
    // The hot wallets start empty (what they held before registration is not custody), and
    // alice's deposit address is watched from the start.
    for lane in &lanes {
        h.rpc("anvil_setBalance", json!([lane.address, "0x0"])).await;
    }
    let deposit_address = "0x00000000000000000000000000000000000d3b05";
    let alice = {
        let mut client = h.db.pool.get().await.unwrap();
        let (account, _) = custodian_store::ownership::create_account(&client, "alice").await.unwrap();
        custodian_store::ownership::assign_address(
            &mut client,
            &custodian_domain::ChainAddress::parse_stored(deposit_address).unwrap(),
            account.id,
            Some(0),
        )
        .await
        .unwrap();
        account.id
    };
    let env = vec![
        ("CUSTODIAN_DATABASE_URL".to_owned(), h.db.url.expose().to_owned()),
        ("CUSTODIAN_ETH_RPC_URL".to_owned(), h.anvil.url.clone()),
    ];
    let scan_and_post = || {
        let env = env.clone();
        let h = &h;
        async move {
            h.mine(80).await;
            let scanned = crate::harness::custodian_env_async(env, &["scan", "--chain", "eth", "--once"]).await;
            assert_eq!(scanned.code, 0, "{}", scanned.stderr);
            custodian_projections::posting::post_all(&h.db.pool.get().await.unwrap()).await.unwrap();
        }
    };
    // A top-up of lane a from outside, and a customer deposit.
    for (to, ether) in [(&*lanes[0].address.to_lowercase_hex(), 5u128), (deposit_address, 3)] {
        let hash = h
            .rpc("eth_sendTransaction", json!([{"from": FUNDER, "to": to, "value": format!("{:#x}", ether * ETHER)}]))
            .await;
        mined(&h, &hash).await;
    }
    scan_and_post().await;
    assert_eq!(ledger_balance(&h, "treasury").await, (5 * ETHER).to_string(), "the top-up is treasury's");
    assert_eq!(h.available(alice).await, (3 * ETHER).to_string());

    // Lane a pays lane b 2 ETH through the allocator; alice withdraws 1 ETH.
    let cli = operator_cli(&h).await;
    let rebalanced =
        cli(args("hot-wallet rebalance --chain eth --from a --to b --amount 2 --external-id r-1 --json")).await;
    assert_eq!(rebalanced.code, 0, "{}", rebalanced.stderr);
    let rebalance = rebalanced.json()["withdrawal"]["id"].as_i64().unwrap();
    let again = cli(args("hot-wallet rebalance --chain eth --from a --to b --amount 2 --external-id r-1 --json")).await;
    assert_eq!(
        (again.json()["created"].clone(), again.json()["withdrawal"]["id"].as_i64()),
        (json!(false), Some(rebalance))
    );
    assert_eq!(ledger_balance(&h, "treasury").await, (3 * ETHER).to_string(), "held from treasury");
    assert_eq!(
        h.count("select count(*) from account_balance a join account t on t.id = a.account_id where t.treasury").await,
        0,
        "a rebalance in flight is no customer's held balance"
    );
    let worker = h.worker(config(1));
    work_until_state(&h, &worker, false, rebalance, WithdrawalState::Confirmed).await;
    let payout = h.request(alice, "out-1", &destination(70), ETHER).await.unwrap().withdrawal;
    work_until_state(&h, &worker, false, payout.id().get(), WithdrawalState::Confirmed).await;
    scan_and_post().await;

    let mut chain = U256::ZERO;
    for address in [&*lanes[0].address.to_lowercase_hex(), &*lanes[1].address.to_lowercase_hex(), deposit_address] {
        chain += h.balance(address).await;
    }
    assert_eq!(custody(&h).await, chain.to_string(), "custody equals what our addresses hold");
    assert_eq!(ledger_balance(&h, "treasury").await, (5 * ETHER).to_string(), "the rebalance came back to treasury");
    assert_eq!(h.available(alice).await, (2 * ETHER).to_string());
    h.verify().await;

    // custodian reconcile says the same, independently of replay: equal, exit 0.
    let reconciled = crate::harness::custodian_env_async(env.clone(), &["reconcile", "--json"]).await;
    assert_eq!(reconciled.code, 0, "{}{}", reconciled.stdout, reconciled.stderr);
    let eth = reconciled.json()["assets"].as_array().unwrap().iter().find(|a| a["asset"] == "ETH").cloned().unwrap();
    assert_eq!((eth["chain"].as_str(), eth["difference"].as_str()), (Some(chain.to_string().as_str()), Some("0")));
    // Money the ledger cannot explain at one of our addresses (set on the chain, no transaction
    // the scanner could see) is a difference, named, exit 3.
    let extra = h.balance(&lanes[1].address.to_lowercase_hex()).await + U256::from(ETHER);
    h.rpc("anvil_setBalance", json!([lanes[1].address, format!("{extra:#x}")])).await;
    h.mine(1).await;
    let scanned = crate::harness::custodian_env_async(env.clone(), &["scan", "--chain", "eth", "--once"]).await;
    assert_eq!(scanned.code, 0, "{}", scanned.stderr);
    let unexplained = crate::harness::custodian_env_async(env, &["reconcile", "--json"]).await;
    assert_eq!(unexplained.code, 3, "{}", unexplained.stdout);
    let named = unexplained.json()["differences"].to_string();
    assert!(named.contains("ETH") && named.contains(&format!("{ETHER} unexplained")), "{named}");

    // Balances beyond i128 (a token's supply may be anything up to 2^256 - 1) are figures like any
    // other: the exact sum and difference, exit 3, no crash.
    let huge = U256::from(1u8) << 200;
    h.rpc("anvil_setBalance", json!([lanes[1].address, format!("{huge:#x}")])).await;
    h.mine(1).await;
    let mut chain = U256::ZERO;
    for address in [&*lanes[0].address.to_lowercase_hex(), &*lanes[1].address.to_lowercase_hex(), deposit_address] {
        chain += h.balance(address).await;
    }
    let ledger: U256 = custody(&h).await.parse().unwrap();
    let env_huge = vec![
        ("CUSTODIAN_DATABASE_URL".to_owned(), h.db.url.expose().to_owned()),
        ("CUSTODIAN_ETH_RPC_URL".to_owned(), h.anvil.url.clone()),
    ];
    let scanned = crate::harness::custodian_env_async(env_huge.clone(), &["scan", "--chain", "eth", "--once"]).await;
    assert_eq!(scanned.code, 0, "{}", scanned.stderr);
    let beyond = crate::harness::custodian_env_async(env_huge, &["reconcile", "--json"]).await;
    assert_eq!(beyond.code, 3, "{}{}", beyond.stdout, beyond.stderr);
    let eth = beyond.json()["assets"].as_array().unwrap().iter().find(|a| a["asset"] == "ETH").cloned().unwrap();
    assert_eq!(eth["chain"].as_str(), Some(chain.to_string().as_str()));
    assert_eq!(eth["difference"].as_str(), Some((chain - ledger).to_string().as_str()), "{eth}");
}

/// A token whose `balanceOf` answer is no amount (its registered contract has no code, so the call
/// answers nothing) is a difference that says so, not a chain holding zero of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_balance_the_chain_answers_with_no_amount_is_named_unreadable_not_read_as_zero() {
    let h = Harness::start(&[]).await;
    let cli = operator_cli(&h).await;
    let contract = "0x00000000000000000000000000000000000c0de0";
    let added = cli(args(&format!("asset add --chain eth --contract {contract} --symbol NC --decimals 6"))).await;
    assert_eq!(added.code, 0, "{}{}", added.stdout, added.stderr);
    let client = h.db.client().await;
    let asset: String =
        client.query_one("select asset from asset where contract = $1", &[&contract]).await.unwrap().get(0);
    let alice = h.funded_account("alice", ETHER).await;
    custodian_testkit::fixtures::credit_asset(&client, alice, 1, &asset, 5_000_000).await;

    let found = cli(args("reconcile --json")).await;
    assert_eq!(found.code, 3, "{}{}", found.stdout, found.stderr);
    let json = found.json();
    let named = json["differences"].to_string();
    assert!(named.contains(&format!("{asset}: cannot read what the chain holds")), "{named}");
    assert!(named.contains("with 0 bytes, not an amount"), "{named}");
    assert!(!named.contains(&format!("{asset}: the chain holds 0")), "read as zero: {named}");
    let lines = json["assets"].as_array().unwrap();
    assert!(lines.iter().all(|l| l["asset"] != asset.as_str()), "a figure for what could not be read: {lines:?}");
}
