//! The edges of withdrawals a real chain produces (DESIGN §7 items 11–14), against real PostgreSQL
//! and anvil: a cancel raced by a reorg and a bump, ERC-20 payouts settled by their `Transfer`
//! events, hot-wallet shortages, and the bumping rules.

use alloy_primitives::{keccak256, U256};
use custodian_domain::withdrawal::WithdrawalState;
use custodian_domain::{AccountId, Amount, Asset, ChainAddress, EthAddress, ExternalId};
use custodian_testkit::fixtures::{posted_balance, Normal};
use custodian_withdrawals::request::{self, Request};
use custodian_withdrawals::{actions, hot_wallet, sql, WorkerConfig};
use serde_json::json;

use crate::harness::{
    config, edge_destination as destination, mined, on_one_lane, work_until_state, Harness, ETHER, FUNDER,
};

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
        let bytecode = include_str!("../../../testkit/contracts/LyingToken.bin");
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
            account_id: AccountId::new(account),
            external_id: ExternalId::parse(external_id).unwrap(),
            asset: Asset::parse_key(&self.asset).unwrap(),
            destination: ChainAddress::Eth(EthAddress::parse(to).unwrap()),
            amount: Amount::from_u64(amount),
            requested_by: "wallet-app".to_owned(),
        };
        request::request(&h.db.pool, &r).await.unwrap().withdrawal.id().get()
    }

    async fn available(&self, h: &Harness, account: i64) -> String {
        posted_balance(&h.db.pool.get().await.unwrap(), &format!("user:{account}"), &self.asset, Normal::Credit).await
    }
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
    h.lane(w.lane().as_str()).await
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

#[tokio::test]
async fn a_cancel_whose_block_is_reorged_out_and_then_bumped_settles_as_cancelled_with_nothing_paid() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let to = destination(1);
    let w = h.request(alice, "race-1", &to, ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(3));
    worker.pass().await.unwrap();
    assert_eq!(h.state(w.id().get()).await, WithdrawalState::Broadcast);
    actions::cancel(&mut h.db.pool.get().await.unwrap(), w.id().get(), "alice").await.unwrap();
    assert_eq!(worker.pass().await.unwrap().cancel_attempts, 1);
    h.mine(1).await;
    assert_eq!(worker.pass().await.unwrap().mined, 1);
    let cancel = sql::load(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap().unwrap().tx_hash().unwrap();
    let mined = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap();
    assert_eq!(mined.iter().find(|a| a.tx_hash == cancel).unwrap().intent, sql::Intent::Cancel, "the cancel mined");

    // The cancel's block is reorged out, the cancel leaves the mempool, and fees spike so the
    // bytes resent are priced out until they are bumped.
    h.rpc("anvil_reorg", json!([1, []])).await;
    h.rpc("anvil_dropTransaction", json!([cancel])).await;
    let attempts = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap();
    let spike = attempts.iter().map(|a| a.max_fee).max().unwrap() * U256::from(4);
    h.rpc("anvil_setNextBlockBaseFeePerGas", json!([format!("{spike:#x}")])).await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.unmined, 1);
    let after = sql::load(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap().unwrap();
    assert_eq!(after.state(), WithdrawalState::CancelRequested, "the cancel still stands after the reorg");
    // The mined cancel's bytes were resent, refused at the spiked base fee, and replaced by a
    // bump that keeps the cancel's intent (the lowest open nonce, refused as underpriced).
    let live = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap();
    let live = live.iter().find(|a| Some(a.tx_hash) == after.live_attempt()).unwrap();
    assert_eq!(live.intent, sql::Intent::Cancel, "the live attempt is still a cancel");
    assert!(event_types(&h, w.id().get()).await.ends_with(&["unmined".to_owned(), "bumped".to_owned()]));
    assert_ne!(live.tx_hash, cancel);
    h.mine(2).await;
    work_until_state(&h, &worker, true, w.id().get(), WithdrawalState::Cancelled).await;

    let attempts = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap();
    let last = attempts.last().unwrap();
    assert_eq!((last.kind.as_str(), last.intent), ("bump", sql::Intent::Cancel), "the bump kept the cancel's intent");
    let done = sql::load(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap().unwrap();
    assert_eq!(done.tx_hash(), Some(last.tx_hash), "settled on the bumped cancel");
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
        token.give(&h, &lane.address.to_lowercase_hex(), 100_000).await;
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
                json!([sql::load(&h.db.pool.get().await.unwrap(), id).await.unwrap().unwrap().tx_hash()]),
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
        token.give(&h, &lane.address.to_lowercase_hex(), 100).await;
    }
    token.credit(&h, bob, 1_000).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(token.request(&h, bob, &format!("five-{i}"), &destination(20 + i), 50).await);
    }
    let mut per_lane = std::collections::HashMap::<String, u64>::new();
    for id in &ids {
        *per_lane.entry(lane_of(&h, *id).await.lane.to_string()).or_default() += 1;
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
        token.give(&h, &lane.address.to_lowercase_hex(), 100).await;
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
    let lane = lane_of(&h, w.id().get()).await;
    h.rpc("anvil_setBalance", json!([lane.address, format!("{:#x}", U256::from(ETHER))])).await;
    let worker = h.worker(config(1));
    let report = worker.pass().await.unwrap();
    assert_eq!((report.signed, report.rejected), (0, 0));
    assert_eq!(report.short_lanes.len(), 1, "{report:?}");
    assert!(report.short_lanes[0].contains("ETH"), "{:?}", report.short_lanes);
    assert_eq!(h.state(w.id().get()).await, WithdrawalState::Requested, "waits, never rejected");
    let reason: Option<String> =
        h.db.pool
            .get()
            .await
            .unwrap()
            .query_one("select shortage from hot_wallet where lane = $1", &[&lane.lane.as_str()])
            .await
            .unwrap()
            .get(0);
    assert!(reason.unwrap().contains(&format!("withdrawal {}", w.id())));
    h.rpc("anvil_setBalance", json!([lane.address, format!("{:#x}", U256::from(3 * ETHER))])).await;
    work_until_state(&h, &worker, false, w.id().get(), WithdrawalState::Confirmed).await;
    assert_eq!(h.balance(&destination(30)).await, U256::from(2 * ETHER));
    assert_eq!(h.count("select count(*) from hot_wallet where shortage is not null").await, 0);
    h.verify().await;
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
    assert_eq!(worker.allocate_lane(&lane_of(&h, w.id().get()).await).await.unwrap().signed, 1);
    let original = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap();
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
    work_until_state(&h, &worker, true, w.id().get(), WithdrawalState::Confirmed).await;
    let attempts = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap();
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
    let stuck = stuck_at_cap(&h, w.id().get()).await;
    assert!(stuck, "visible on the withdrawal");
    h.mine(1).await;
    assert_eq!(worker.pass().await.unwrap().fee_cap_reached, 0, "alerted once, not every pass");
    assert_eq!(event_types(&h, w.id().get()).await.iter().filter(|t| *t == "fee_cap_reached").count(), 1);
    // Once the cap is raised the bump goes out and the flag clears.
    let raised = h.worker(config(1));
    work_until_state(&h, &raised, true, w.id().get(), WithdrawalState::Confirmed).await;
    let stuck = stuck_at_cap(&h, w.id().get()).await;
    assert!(!stuck);
    h.verify().await;
}
