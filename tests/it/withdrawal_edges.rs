//! The edges of withdrawals a real chain produces (DESIGN §7 items 11–14), against real PostgreSQL
//! and anvil: a cancel raced by a reorg and a bump, ERC-20 payouts settled by their `Transfer`
//! events, hot-wallet shortages, and the bumping rules.

use std::time::Duration;

use alloy_primitives::{keccak256, U256};
use custodian_domain::withdrawal::WithdrawalState;
use custodian_domain::{Amount, EthAddress};
use custodian_testkit::eventually;
use custodian_withdrawals::request::{self, Destination, Request};
use custodian_withdrawals::{actions, hot_wallet, sql, Worker, WorkerConfig};
use serde_json::{json, Value};

use crate::withdrawals::{config, Harness, ETHER, FUNDER};

fn destination(i: u64) -> String {
    format!("0x{:040x}", 0x5eed_0000u64 + i)
}

fn word(address: &str) -> String {
    format!("{:0>64}", address.trim_start_matches("0x").to_ascii_lowercase())
}

fn selector(signature: &str) -> String {
    alloy_primitives::hex::encode(&keccak256(signature)[..4])
}

/// A deployed LyingToken (testkit/contracts) registered as an asset, with its key.
struct Token {
    address: String,
    asset: String,
}

impl Token {
    async fn deploy(h: &Harness, supply: u64) -> Token {
        let bytecode = include_str!("../../testkit/contracts/LyingToken.bin");
        let data = format!("0x{bytecode}{:064x}", supply);
        let hash = h.rpc("eth_sendTransaction", json!([{"from": FUNDER, "data": data, "gas": "0x1e8480"}])).await;
        let receipt = mined(h, &hash).await;
        let address = receipt["contractAddress"].as_str().unwrap().to_owned();
        let client = h.db.pool.get().await.unwrap();
        let (asset, _) = custodian_store::ownership::add_token(&client, &address, "LIE", 0).await.unwrap();
        Token { address, asset }
    }

    async fn send(&self, h: &Harness, data: String) {
        let hash = h.rpc("eth_sendTransaction", json!([{"from": FUNDER, "to": self.address, "data": data}])).await;
        mined(h, &hash).await;
    }

    async fn give(&self, h: &Harness, to: &str, amount: u64) {
        self.send(h, format!("0x{}{}{:064x}", selector("transfer(address,uint256)"), word(to), amount)).await;
    }

    async fn set_mode(&self, h: &Harness, mode: u8) {
        self.send(h, format!("0x{}{:064x}", selector("setMode(uint8)"), mode)).await;
    }

    async fn balance(&self, h: &Harness, of: &str) -> U256 {
        let data = format!("0x{}{}", selector("balanceOf(address)"), word(of));
        let out = h.rpc("eth_call", json!([{"to": self.address, "data": data}, "latest"])).await;
        U256::from_str_radix(out.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
    }

    /// Credits `account` with `amount` of the token by a deposit fact, as the posting pass would.
    async fn credit(&self, h: &Harness, account: i64, amount: u64) {
        let client = h.db.client().await;
        custodian_testkit::fixtures::credit_asset(&client, account, 500, &self.asset, u128::from(amount)).await;
    }

    async fn request(&self, h: &Harness, account: i64, external_id: &str, to: &str, amount: u64) -> i64 {
        let r = Request {
            account_id: account,
            external_id: external_id.to_owned(),
            asset: self.asset.clone(),
            destination: Destination::Eth(EthAddress::parse(to).unwrap()),
            amount: Amount::from_u64(amount),
            requested_by: "wallet-app".to_owned(),
        };
        request::request(&h.db.pool, &r).await.unwrap().withdrawal.id
    }

    async fn available(&self, h: &Harness, account: i64) -> String {
        h.db.pool
            .get()
            .await
            .unwrap()
            .query_one(
                "select coalesce(sum(case direction when 'credit' then amount else -amount end), 0)::text
                   from ledger_posting where ledger_account = 'user:' || $1::bigint and asset = $2",
                &[&account, &self.asset],
            )
            .await
            .unwrap()
            .get(0)
    }
}

async fn mined(h: &Harness, hash: &Value) -> Value {
    eventually("a funder transaction to mine", Duration::from_secs(10), || async {
        let r = h.anvil.rpc("eth_getTransactionReceipt", json!([hash])).await.unwrap();
        (!r.is_null()).then_some(r)
    })
    .await
}

/// The projection's `stuck_at_cap` flag of withdrawal `id`.
async fn stuck_at_cap(h: &Harness, id: i64) -> bool {
    h.db.pool
        .get()
        .await
        .unwrap()
        .query_one("select stuck_at_cap from withdrawal where id = $1", &[&id])
        .await
        .unwrap()
        .get(0)
}

async fn lane_of(h: &Harness, id: i64) -> hot_wallet::Lane {
    let w = sql::load(&h.db.pool.get().await.unwrap(), id).await.unwrap().unwrap();
    hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap().into_iter().find(|l| l.lane == w.lane).unwrap()
}

async fn event_types(h: &Harness, id: i64) -> Vec<String> {
    h.db.pool
        .get()
        .await
        .unwrap()
        .query("select event_type from withdrawal_event where withdrawal_id = $1 order by seq", &[&id])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn work_until_state(h: &Harness, worker: &Worker, mine: bool, id: i64, state: WithdrawalState) {
    h.work_until(worker, mine, state.as_str(), move |h| Box::pin(async move { h.state(id).await == state })).await;
}

#[tokio::test]
async fn a_cancel_whose_block_is_reorged_out_and_then_bumped_settles_as_cancelled_with_nothing_paid() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let to = destination(1);
    let w = h.request(alice, "race-1", &to, ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(3));
    worker.pass().await.unwrap();
    assert_eq!(h.state(w.id).await, WithdrawalState::Broadcast);
    actions::cancel(&mut h.db.pool.get().await.unwrap(), w.id, "alice").await.unwrap();
    assert_eq!(worker.pass().await.unwrap().cancel_attempts, 1);
    h.mine(1).await;
    assert_eq!(worker.pass().await.unwrap().mined, 1);
    let cancel = sql::load(&h.db.pool.get().await.unwrap(), w.id).await.unwrap().unwrap().tx_hash.unwrap();
    let mined = sql::attempts(&h.db.pool.get().await.unwrap(), w.id).await.unwrap();
    assert_eq!(mined.iter().find(|a| a.tx_hash == cancel).unwrap().intent, sql::Intent::Cancel, "the cancel mined");

    // The cancel's block is reorged out, the cancel leaves the mempool, and fees spike so the
    // bytes resent are priced out until they are bumped.
    h.rpc("anvil_reorg", json!([1, []])).await;
    h.rpc("anvil_dropTransaction", json!([cancel])).await;
    let attempts = sql::attempts(&h.db.pool.get().await.unwrap(), w.id).await.unwrap();
    let spike = attempts.iter().map(|a| a.max_fee).max().unwrap() * U256::from(4);
    h.rpc("anvil_setNextBlockBaseFeePerGas", json!([format!("{spike:#x}")])).await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.unmined, 1);
    let after = sql::load(&h.db.pool.get().await.unwrap(), w.id).await.unwrap().unwrap();
    assert_eq!(after.state, WithdrawalState::CancelRequested, "the cancel still stands after the reorg");
    // The mined cancel's bytes were resent, refused at the spiked base fee, and replaced by a
    // bump that keeps the cancel's intent (the lowest open nonce, refused as underpriced).
    let live = sql::attempts(&h.db.pool.get().await.unwrap(), w.id).await.unwrap();
    let live = live.iter().find(|a| Some(&a.tx_hash) == after.live_attempt.as_ref()).unwrap();
    assert_eq!(live.intent, sql::Intent::Cancel, "the live attempt is still a cancel");
    assert!(event_types(&h, w.id).await.ends_with(&["unmined".to_owned(), "bumped".to_owned()]));
    assert_ne!(live.tx_hash, cancel);
    h.mine(2).await;
    work_until_state(&h, &worker, true, w.id, WithdrawalState::Cancelled).await;

    let attempts = sql::attempts(&h.db.pool.get().await.unwrap(), w.id).await.unwrap();
    let last = attempts.last().unwrap();
    assert_eq!((last.kind.as_str(), last.intent), ("bump", sql::Intent::Cancel), "the bump kept the cancel's intent");
    let done = sql::load(&h.db.pool.get().await.unwrap(), w.id).await.unwrap().unwrap();
    assert_eq!(done.tx_hash.as_deref(), Some(last.tx_hash.as_str()), "settled on the bumped cancel");
    assert_eq!(h.balance(&to).await, U256::ZERO, "the destination was never paid");
    assert_eq!(h.available(alice).await, (10 * ETHER).to_string(), "nothing paid, nothing debited");
    assert_eq!(h.count("select count(*) from ledger_transfer where kind = 'withdrawal_settle'").await, 0);
    h.verify().await;
}

#[tokio::test]
async fn erc20_payouts_are_settled_by_their_transfer_events_not_their_status() {
    let h = Harness::start(&[]).await;
    let bob = h.funded_account("bob", ETHER).await;
    let token = Token::deploy(&h, 1_000_000).await;
    for lane in hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap() {
        token.give(&h, &lane.address, 100_000).await;
    }
    token.credit(&h, bob, 10_000).await;
    let worker = h.worker(config(1));

    // Honest: paid, settled, the destination holds the tokens.
    let paid = token.request(&h, bob, "tok-ok", &destination(10), 1_000).await;
    work_until_state(&h, &worker, false, paid, WithdrawalState::Confirmed).await;
    assert_eq!(token.balance(&h, &destination(10)).await, U256::from(1_000u64));
    assert_eq!(token.available(&h, bob).await, "9000");

    // A token whose transfer answers false is refused by the simulation: no nonce.
    token.set_mode(&h, 1).await;
    let refused = token.request(&h, bob, "tok-false-sim", &destination(11), 1_000).await;
    let report = worker.pass().await.unwrap();
    assert_eq!((report.rejected, report.signed), (1, 0));
    assert_eq!(h.state(refused).await, WithdrawalState::Rejected);

    // A token that reverts is refused the same way.
    token.set_mode(&h, 3).await;
    let reverted = token.request(&h, bob, "tok-revert", &destination(14), 1_000).await;
    assert_eq!(worker.pass().await.unwrap().rejected, 1);
    assert_eq!(h.state(reverted).await, WithdrawalState::Rejected);
    assert_eq!(token.available(&h, bob).await, "9000", "both refusals released their holds");

    // Signed while honest, mined while lying: status 1 but nothing moved, or a tenth kept.
    for (mode, external_id, to) in [(1u8, "tok-false", destination(12)), (2, "tok-fee", destination(13))] {
        token.set_mode(&h, 0).await;
        let id = token.request(&h, bob, external_id, &to, 1_000).await;
        assert_eq!(worker.allocate_lane(&lane_of(&h, id).await).await.unwrap().signed, 1);
        token.set_mode(&h, mode).await;
        let before = token.available(&h, bob).await;
        work_until_state(&h, &worker, false, id, WithdrawalState::FailedOnchain).await;
        assert_eq!(
            token.available(&h, bob).await,
            (before.parse::<u64>().unwrap() + 1_000).to_string(),
            "hold released"
        );
        let fee: i64 = h
            .count(&format!("select count(*) from ledger_transfer where idempotency_key = 'withdrawal:{id}:fee'"))
            .await;
        assert_eq!(fee, 1, "the fee is charged");
        let receipt = h
            .rpc(
                "eth_getTransactionReceipt",
                json!([sql::load(&h.db.pool.get().await.unwrap(), id).await.unwrap().unwrap().tx_hash]),
            )
            .await;
        assert_eq!(receipt["status"], "0x1", "the chain says success; the Transfer events say otherwise");
    }
    assert_eq!(token.balance(&h, &destination(13)).await, U256::from(900u64), "the fee-taking token paid 900");
    h.verify().await;
}

#[tokio::test]
async fn five_token_payouts_against_a_balance_for_two_per_lane_wait_instead_of_reverting() {
    let h = Harness::start(&[]).await;
    let bob = h.funded_account("bob", ETHER).await;
    let token = Token::deploy(&h, 1_000_000).await;
    let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
    for lane in &lanes {
        token.give(&h, &lane.address, 100).await;
    }
    token.credit(&h, bob, 1_000).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(token.request(&h, bob, &format!("five-{i}"), &destination(20 + i), 50).await);
    }
    let mut per_lane = std::collections::HashMap::<String, u64>::new();
    for id in &ids {
        *per_lane.entry(lane_of(&h, *id).await.lane).or_default() += 1;
    }
    let worker = h.worker(config(1));
    let report = worker.pass().await.unwrap();
    let coverable: u64 = per_lane.values().map(|n| (*n).min(2)).sum();
    assert_eq!(report.signed, coverable, "each lane signs what its 100 tokens cover: {per_lane:?}");
    assert_eq!(report.rejected, 0, "our own shortage never rejects a customer");
    assert_eq!(report.short_lanes.len(), per_lane.values().filter(|n| **n > 2).count(), "{:?}", report.short_lanes);
    let short: i64 = h.count("select count(*) from hot_wallet where shortage is not null").await;
    assert_eq!(short as usize, report.short_lanes.len());
    h.work_until(&worker, false, "the covered payouts to settle", |h| {
        Box::pin(async move {
            h.count("select count(*) from withdrawal where state = 'confirmed'").await as u64 == coverable
        })
    })
    .await;
    assert_eq!(h.count("select count(*) from withdrawal where state = 'requested'").await as u64, 5 - coverable);
    assert_eq!(h.count("select count(*) from withdrawal where state = 'failed_onchain'").await, 0, "nothing reverted");

    // Topped up, the rest go out and the shortage clears.
    for lane in &lanes {
        token.give(&h, &lane.address, 100).await;
    }
    h.work_until(&worker, false, "every payout to settle", |h| {
        Box::pin(async move { h.count("select count(*) from withdrawal where state = 'confirmed'").await == 5 })
    })
    .await;
    assert_eq!(h.count("select count(*) from hot_wallet where shortage is not null").await, 0);
    for i in 0..5 {
        assert_eq!(token.balance(&h, &destination(20 + i)).await, U256::from(50u64));
    }
    h.verify().await;
}

#[tokio::test]
async fn a_hot_wallet_short_of_ether_holds_its_withdrawals_until_it_is_topped_up() {
    let h = Harness::start(&[]).await;
    let rich = h.funded_account("rich", 10 * ETHER).await;
    let w = h.request(rich, "big-1", &destination(30), 2 * ETHER).await.unwrap().withdrawal;
    let lane = lane_of(&h, w.id).await;
    h.rpc("anvil_setBalance", json!([lane.address, format!("{:#x}", U256::from(ETHER))])).await;
    let worker = h.worker(config(1));
    let report = worker.pass().await.unwrap();
    assert_eq!((report.signed, report.rejected), (0, 0));
    assert_eq!(report.short_lanes.len(), 1, "{report:?}");
    assert!(report.short_lanes[0].contains("ETH"), "{:?}", report.short_lanes);
    assert_eq!(h.state(w.id).await, WithdrawalState::Requested, "waits, never rejected");
    let reason: Option<String> =
        h.db.pool
            .get()
            .await
            .unwrap()
            .query_one("select shortage from hot_wallet where lane = $1", &[&lane.lane])
            .await
            .unwrap()
            .get(0);
    assert!(reason.unwrap().contains(&format!("withdrawal {}", w.id)));
    h.rpc("anvil_setBalance", json!([lane.address, format!("{:#x}", U256::from(3 * ETHER))])).await;
    work_until_state(&h, &worker, false, w.id, WithdrawalState::Confirmed).await;
    assert_eq!(h.balance(&destination(30)).await, U256::from(2 * ETHER));
    assert_eq!(h.count("select count(*) from hot_wallet where shortage is not null").await, 0);
    h.verify().await;
}

/// Requests until `lane` holds `n` withdrawals of 1 ETH, returning their ids in nonce order to be.
async fn on_one_lane(h: &Harness, account: i64, n: usize) -> (String, Vec<i64>) {
    let mut by_lane = std::collections::HashMap::<String, Vec<i64>>::new();
    for i in 0..64u64 {
        let w = h.request(account, &format!("lane-{i}"), &destination(100 + i), ETHER).await.unwrap().withdrawal;
        let ids = by_lane.entry(w.lane.clone()).or_default();
        ids.push(w.id);
        if ids.len() == n {
            let lane = w.lane.clone();
            // The others are cancelled before signing: only this lane has anything in flight.
            for (other, ids) in &by_lane {
                if *other != lane {
                    for id in ids {
                        actions::cancel(&mut h.db.pool.get().await.unwrap(), *id, "test").await.unwrap();
                    }
                }
            }
            let ids = by_lane.remove(&lane).unwrap();
            return (lane, ids);
        }
    }
    panic!("no lane got {n} withdrawals");
}

#[tokio::test]
async fn only_the_lowest_open_nonce_is_bumped_and_two_workers_in_lockstep_bump_it_once() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 100 * ETHER).await;
    let (_lane, ids) = on_one_lane(&h, alice, 3).await;
    let first = h.worker(config(1));
    let second = h.worker(config(1));
    let report = first.pass().await.unwrap();
    assert_eq!((report.signed, report.broadcast), (3, 3));
    let max_fee = sql::attempts(&h.db.pool.get().await.unwrap(), ids[0]).await.unwrap()[0].max_fee;
    h.rpc("anvil_setNextBlockBaseFeePerGas", json!([format!("{:#x}", max_fee * U256::from(4))])).await;
    h.mine(2).await;
    let (a, b) = tokio::join!(first.pass(), second.pass());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.bumped + b.bumped, 1, "one bump between two workers: {a:?} {b:?}");
    let client = h.db.pool.get().await.unwrap();
    let mut counts = Vec::new();
    for id in &ids {
        counts.push(sql::attempts(&client, *id).await.unwrap().len());
    }
    assert_eq!(counts, [2, 1, 1], "the lowest open nonce was bumped, the nonces queued behind it were not");
    drop(client);
    for id in &ids {
        work_until_state(&h, &first, true, *id, WithdrawalState::Confirmed).await;
    }
    h.verify().await;
}

#[tokio::test]
async fn an_original_the_node_refused_as_underpriced_is_bumped() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let w = h.request(alice, "under-1", &destination(40), ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(1));
    assert_eq!(worker.allocate_lane(&lane_of(&h, w.id).await).await.unwrap().signed, 1);
    let original = sql::attempts(&h.db.pool.get().await.unwrap(), w.id).await.unwrap();
    // The base fee passes the signed fee cap before the bytes are first sent.
    h.rpc("anvil_setNextBlockBaseFeePerGas", json!([format!("{:#x}", original[0].max_fee * U256::from(4))])).await;
    h.mine(1).await;
    let sent = h
        .anvil
        .rpc("eth_sendRawTransaction", json!([format!("0x{}", alloy_primitives::hex::encode(&original[0].raw))]))
        .await;
    assert!(sent.is_err(), "the node refuses the original: {sent:?}");
    let report = worker.pass().await.unwrap();
    assert_eq!((report.broadcast, report.bumped), (0, 1), "{report:?}");
    work_until_state(&h, &worker, true, w.id, WithdrawalState::Confirmed).await;
    let attempts = sql::attempts(&h.db.pool.get().await.unwrap(), w.id).await.unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(h.balance(&destination(40)).await, U256::from(ETHER));
    h.verify().await;
}

#[tokio::test]
async fn reaching_the_fee_cap_is_alerted_once_and_shown_as_stuck_at_cap() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let w = h.request(alice, "cap-1", &destination(50), ETHER).await.unwrap().withdrawal;
    // The cap is what the original pays: no replacement can raise it by 12.5%.
    let (base, tip) = h.node.fees().await.unwrap();
    let cap = base * U256::from(2) + tip;
    let capped = WorkerConfig { max_fee_per_gas_wei: cap, ..config(1) };
    let worker = h.worker(capped);
    worker.pass().await.unwrap();
    h.rpc("anvil_setNextBlockBaseFeePerGas", json!([format!("{:#x}", cap * U256::from(4))])).await;
    h.mine(2).await;
    let report = worker.pass().await.unwrap();
    assert_eq!((report.bumped, report.fee_cap_reached), (0, 1), "{report:?}");
    let stuck = stuck_at_cap(&h, w.id).await;
    assert!(stuck, "visible on the withdrawal");
    h.mine(1).await;
    assert_eq!(worker.pass().await.unwrap().fee_cap_reached, 0, "alerted once, not every pass");
    assert_eq!(event_types(&h, w.id).await.iter().filter(|t| *t == "fee_cap_reached").count(), 1);
    // Once the cap is raised the bump goes out and the flag clears.
    let raised = h.worker(config(1));
    work_until_state(&h, &raised, true, w.id, WithdrawalState::Confirmed).await;
    let stuck = stuck_at_cap(&h, w.id).await;
    assert!(!stuck);
    h.verify().await;
}

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
    let lane =
        hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap().into_iter().find(|l| l.lane == lane).unwrap();
    assert_eq!(worker.allocate_lane(&lane).await.unwrap().signed, 2);
    let (w1, w2) = (
        sql::load(&h.db.pool.get().await.unwrap(), ids[0]).await.unwrap().unwrap(),
        sql::load(&h.db.pool.get().await.unwrap(), ids[1]).await.unwrap().unwrap(),
    );
    // Someone with the lane's key consumes both nonces first: the first pays w1's destination
    // what w1 asks, the second pays someone else.
    let key = h.signers[&lane.lane].clone();
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
    let paid = outside(w1.nonce.unwrap().get(), &w1.destination, U256::from(ETHER));
    let other = outside(w2.nonce.unwrap().get(), FUNDER, U256::from(1u8));
    for signed in [&paid, &other] {
        h.rpc("eth_sendRawTransaction", json!([format!("0x{}", alloy_primitives::hex::encode(&signed.raw))])).await;
    }
    let funder_tx = h
        .rpc("eth_sendTransaction", json!([{"from": FUNDER, "to": w1.destination, "value": format!("{:#x}", ETHER)}]))
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
    let refused = cli(args(&format!("withdrawals resolve --id {} --paid-by {funder_tx}", w1.id))).await;
    assert_eq!(refused.code, 2, "a transaction that is not ours: {}", refused.stderr);
    assert!(refused.stderr.contains("not by the hot wallet"), "{}", refused.stderr);
    let refused = cli(args(&format!("withdrawals resolve --id {} --paid-by {other}", w1.id))).await;
    assert_eq!(refused.code, 2, "ours, at another nonce: {}", refused.stderr);
    assert!(refused.stderr.contains("used nonce"), "{}", refused.stderr);
    let refused = cli(args(&format!("withdrawals resolve --id {} --paid-by {other}", w2.id))).await;
    assert_eq!(refused.code, 2, "ours, at its nonce, paying someone else: {}", refused.stderr);
    let refused = cli(args(&format!("withdrawals resolve --id {} --not-paid", w1.id))).await;
    assert_eq!(refused.code, 2, "the transaction that consumed w1's nonce paid it: {}", refused.stderr);
    assert!(refused.stderr.contains(&format!("--paid-by {paid}")), "{}", refused.stderr);
    assert_eq!(h.state(w1.id).await, WithdrawalState::NeedsReview, "{}", refused.stderr);
    assert_eq!(
        h.count("select count(*) from withdrawal_event where event_type = 'resolved'").await,
        0,
        "nothing written"
    );

    let shallow = cli(args(&format!("withdrawals resolve --id {} --paid-by {paid} --confirmations 50", w1.id))).await;
    assert_eq!(shallow.code, 2, "evidence not yet buried: {}", shallow.stderr);
    assert!(shallow.stderr.contains("of the 50 confirmations"), "{}", shallow.stderr);
    let resolved = cli(args(&format!("withdrawals resolve --id {} --paid-by {paid} --json", w1.id))).await;
    assert_eq!(resolved.code, 0, "{}", resolved.stderr);
    assert_eq!(resolved.json()["paid"], true);
    assert_eq!(h.state(w1.id).await, WithdrawalState::Confirmed);
    let resolved = cli(args(&format!("withdrawals resolve --id {} --not-paid --json", w2.id))).await;
    assert_eq!(resolved.code, 0, "{}", resolved.stderr);
    assert_eq!(h.state(w2.id).await, WithdrawalState::Cancelled);
    let again = cli(args(&format!("withdrawals resolve --id {} --not-paid", w2.id))).await;
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
        if w.lane == "a" {
            break w.id;
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
        assert_eq!(w.lane, "b", "new withdrawals skip the retired lane");
    }
    let listed = cli(args("hot-wallet list --json")).await;
    assert_eq!(listed.json()[0]["retired"], true);
    let worker = h.worker(config(1));
    work_until_state(&h, &worker, false, held, WithdrawalState::Confirmed).await;
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
    work_until_state(&h, &worker, true, w.id, WithdrawalState::Confirmed).await;
    let confirmed = sql::load(&h.db.pool.get().await.unwrap(), w.id).await.unwrap().unwrap();
    let hash = confirmed.tx_hash.clone().unwrap();
    let raw = sql::attempts(&h.db.pool.get().await.unwrap(), w.id)
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
    let depth = head - confirmed.mined_block_number.unwrap() + 1;
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
    assert_eq!(report.paused_lanes, vec![w.lane.clone()]);
    assert_eq!(h.state(w.id).await, WithdrawalState::NeedsReview);
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
    let refused = cli(args(&format!("withdrawals resolve --id {} --not-paid", w.id))).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    let refused = cli(args(&format!("withdrawals resolve --id {} --paid-by {hash}", w.id))).await;
    assert_eq!(refused.code, 2, "not on chain: {}", refused.stderr);
    assert!(refused.stderr.contains("does not know transaction"), "{}", refused.stderr);
    // The way out: the operator sends the same bytes again (nothing is signed), they mine.
    let _ = raw;
    let sent = cli(args(&format!("withdrawals rebroadcast --id {} --json", w.id))).await;
    assert_eq!(sent.code, 0, "{}", sent.stderr);
    assert_eq!(sent.json()["tx_hash"], hash.as_str());
    let again = cli(args(&format!("withdrawals rebroadcast --id {}", w.id))).await;
    assert_eq!(again.code, 0, "already known is sent: {}", again.stderr);
    assert_eq!(h.count(&format!("select count(*) from withdrawal_attempt where withdrawal_id = {}", w.id)).await, 1);
    h.mine(1).await;
    let resolved = cli(args(&format!("withdrawals resolve --id {} --paid-by {hash} --json", w.id))).await;
    assert_eq!(resolved.code, 0, "{}", resolved.stderr);
    assert_eq!(h.state(w.id).await, WithdrawalState::Confirmed);
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
    h.db.pool
        .get()
        .await
        .unwrap()
        .query_one(
            "select coalesce(sum(case direction when 'debit' then amount else -amount end), 0)::text
               from ledger_posting where ledger_account = 'custody' and asset = 'ETH'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

async fn ledger_balance(h: &Harness, account: &str) -> String {
    h.db.pool
        .get()
        .await
        .unwrap()
        .query_one(
            "select coalesce(sum(case direction when 'credit' then amount else -amount end), 0)::text
               from ledger_posting where ledger_account = $1 and asset = 'ETH'",
            &[&account],
        )
        .await
        .unwrap()
        .get(0)
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
            custodian_domain::Chain::Eth,
            deposit_address,
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
    for (to, ether) in [(lanes[0].address.as_str(), 5u128), (deposit_address, 3)] {
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
    work_until_state(&h, &worker, false, payout.id, WithdrawalState::Confirmed).await;
    scan_and_post().await;

    let mut chain = U256::ZERO;
    for address in [lanes[0].address.as_str(), lanes[1].address.as_str(), deposit_address] {
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
    let extra = h.balance(&lanes[1].address).await + U256::from(ETHER);
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
    for address in [lanes[0].address.as_str(), lanes[1].address.as_str(), deposit_address] {
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
