//! Withdrawals against real PostgreSQL and anvil: allocation under concurrency, idempotency,
//! simulation, crash between commit and broadcast, dropped transactions, fee spikes, reorgs,
//! outside use of a hot key, cancels, on-chain failure and approvals.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use alloy_primitives::U256;
use custodian_domain::withdrawal::WithdrawalState;
use custodian_domain::{AccountId, Amount, Asset, Chain, ChainAddress, EthAddress, ExternalId};
use custodian_projections::replay;
use custodian_testkit::db::column;
use custodian_testkit::eventually;
use custodian_testkit::fixtures::{posted_balance, Normal};
use custodian_testkit::proxy::RpcProxy;
use custodian_withdrawals::limits::{self, LimitChange};
use custodian_withdrawals::request::{self, Request, RequestError};
use custodian_withdrawals::{actions, hot_wallet, sql, EthNode, PassReport, Worker, WorkerConfig};
use serde_json::json;

use crate::harness::{config, destination, one_on_each_lane, work_until_state, Harness, ETHER, FUNDER};

#[tokio::test]
async fn two_hundred_requests_from_eight_clients_over_two_lanes_and_two_workers_mine_exactly_once() {
    let h = Arc::new(Harness::start(&[]).await);
    let mut accounts = Vec::new();
    for c in 0..8 {
        accounts.push(h.funded_account(&format!("client-{c}"), 100 * ETHER).await);
    }
    let start_nonces: HashMap<String, i64> = hot_wallet::lanes(&h.db.pool.get().await.unwrap())
        .await
        .unwrap()
        .into_iter()
        .map(|l| (l.lane.to_string(), l.next_nonce.stored()))
        .collect();
    let clients = accounts.iter().enumerate().map(|(c, account)| {
        let (h, account) = (h.clone(), *account);
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in 0..25u64 {
                let n = c as u64 * 25 + i;
                let r = h
                    .request(account, &format!("w-{n}"), &destination(n), 1_000_000_000 + u128::from(n))
                    .await
                    .unwrap();
                ids.push(r.withdrawal.id());
            }
            ids
        })
    });
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let h = h.clone();
            tokio::spawn(async move {
                // No bump is due here, whatever the load: under automine, anvil mines other
                // senders' blocks while a transaction that just became executable waits (up to
                // six blocks seen with three senders), so two blocks unmined would be a fair bump.
                // Any second signed payload is then a defect in allocation or broadcast.
                let worker = h.worker(WorkerConfig { bump_after_blocks: 10_000, ..config(1) });
                // Bounded in time, not in passes: a pass with nothing to do is quick, and under a
                // loaded machine the clients' 200 requests can take longer than 200 such passes.
                let deadline = std::time::Instant::now() + Duration::from_secs(120);
                while std::time::Instant::now() < deadline {
                    worker.pass().await.unwrap();
                    let open = h.count("select count(*) from withdrawal where state <> 'confirmed'").await;
                    let total = h.count("select count(*) from withdrawal").await;
                    if total == 200 && open == 0 {
                        return;
                    }
                }
                panic!("workers did not finish");
            })
        })
        .collect();
    let mut ids = Vec::new();
    for client in clients {
        ids.extend(client.await.unwrap());
    }
    assert_eq!(ids.len(), 200);
    for worker in workers {
        worker.await.unwrap();
    }

    assert_eq!(h.count("select count(*) from withdrawal where state = 'confirmed'").await, 200);
    // Should it fail: the streams of the withdrawals signed more than once say why.
    let resigned: Vec<String> = h
        .db
        .client()
        .await
        .query(
            "select withdrawal_id, string_agg(event_type || coalesce(' at ' || (payload->>'at_block'), ''), ', ' order by seq)
               from withdrawal_event
              where withdrawal_id in (select withdrawal_id from withdrawal_attempt group by 1 having count(*) > 1)
              group by 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| format!("{}: {}", r.get::<_, i64>(0), r.get::<_, String>(1)))
        .collect();
    assert_eq!(
        h.count("select count(*) from withdrawal_attempt").await,
        200,
        "one signed payload each, no bumps needed: {resigned:?}"
    );
    for (lane, start) in &start_nonces {
        let client = h.db.pool.get().await.unwrap();
        let nonces: Vec<i64> = column(&client, "select n.nonce from nonce_allocation n join hot_wallet w on w.address = n.from_address where w.lane = $1 order by 1",
                &[lane]).await;
        assert!(!nonces.is_empty(), "both lanes were used");
        assert_eq!(
            nonces,
            (*start..*start + nonces.len() as i64).collect::<Vec<_>>(),
            "lane {lane}: contiguous, no gap, no duplicate"
        );
    }
    for n in 0..200u64 {
        assert_eq!(
            h.balance(&destination(n)).await,
            U256::from(1_000_000_000u64 + n),
            "destination {n} paid exactly once"
        );
    }
    assert_eq!(h.count("select count(*) from ledger_transfer where kind = 'withdrawal_settle'").await, 200);
    h.verify().await;
}

#[tokio::test]
async fn the_same_external_id_five_times_concurrently_is_one_withdrawal_and_a_different_payload_conflicts() {
    let h = Arc::new(Harness::start(&[]).await);
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let h = h.clone();
            tokio::spawn(async move { h.request(alice, "pay-1", &destination(1), ETHER).await.unwrap() })
        })
        .collect();
    let mut ids = Vec::new();
    let mut created = 0;
    for t in tasks {
        let r = t.await.unwrap();
        ids.push(r.withdrawal.id());
        created += usize::from(r.created);
    }
    ids.dedup();
    assert_eq!((ids.len(), created), (1, 1), "one withdrawal, created once");
    match h.request(alice, "pay-1", &destination(2), 2 * ETHER).await {
        Err(RequestError::Conflict { fields, existing, .. }) => {
            assert_eq!(fields, ["destination", "amount"]);
            assert_eq!(existing, ids[0].get());
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(h.count("select count(*) from ledger_transfer where kind = 'withdrawal_hold'").await, 1, "one hold");
    assert_eq!(h.available(alice).await, (9 * ETHER).to_string());
    assert_eq!(h.count("select count(*) from nonce_allocation").await, 0, "requests never consume a nonce");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_racing_on_a_tight_balance_gets_the_winners_withdrawal_not_insufficient_funds() {
    // The whole balance, asked for eight times at once with one external id: the requests that
    // waited for the account lock must find the first one's withdrawal, not the spent balance.
    for round in 0..5 {
        let h = Arc::new(Harness::start(&[]).await);
        let alice = h.funded_account("alice", ETHER).await;
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let h = h.clone();
                tokio::spawn(async move { h.request(alice, "all-of-it", &destination(1), ETHER).await })
            })
            .collect();
        let mut ids = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(r) => ids.push(r.withdrawal.id()),
                Err(e) => panic!("round {round}: a duplicate was refused: {e}"),
            }
        }
        ids.dedup();
        assert_eq!(ids.len(), 1, "round {round}: one withdrawal");
        assert_eq!(h.available(alice).await, "0");
    }
}

#[tokio::test]
async fn an_erc20_withdrawal_the_hot_wallet_cannot_cover_waits_without_a_nonce_instead_of_being_rejected() {
    let h = Harness::start(&[]).await;
    let bob = h.funded_account("bob", ETHER).await;
    // A token whose whole supply sits with the funder: the hot wallets hold none of it.
    let bytecode = include_str!("../../../testkit/contracts/TestToken.bin");
    let args = "0000000000000000000000000000000000000000000000000000000000000080\
                00000000000000000000000000000000000000000000000000000000000000c0\
                0000000000000000000000000000000000000000000000000000000000000006\
                000000000000000000000000000000000000000000000000000000e8d4a51000\
                000000000000000000000000000000000000000000000000000000000000000a\
                5465737420546f6b656e00000000000000000000000000000000000000000000\
                0000000000000000000000000000000000000000000000000000000000000002\
                5454000000000000000000000000000000000000000000000000000000000000";
    let hash = h
        .rpc("eth_sendTransaction", json!([{"from": FUNDER, "data": format!("0x{bytecode}{args}"), "gas": "0x1e8480"}]))
        .await;
    let receipt = eventually("token deployment", Duration::from_secs(10), || async {
        let r = h.anvil.rpc("eth_getTransactionReceipt", json!([hash])).await.unwrap();
        (!r.is_null()).then_some(r)
    })
    .await;
    let token = receipt["contractAddress"].as_str().unwrap().to_owned();
    let client = h.db.pool.get().await.unwrap();
    let (asset, _) = custodian_store::ownership::add_token(&client, &token, "TT", 6).await.unwrap();
    // Bob's token balance, credited as a posted deposit of the token.
    client
        .batch_execute(&format!(
            "begin;
             insert into ledger_transfer (idempotency_key, kind, reference) values ('adj:tt', 'adjustment', '{{}}');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', '{asset}', 'debit', 5000000),
                  (currval('ledger_transfer_id_seq'), 'user:{bob}', '{asset}', 'credit', 5000000);
             commit;"
        ))
        .await
        .unwrap();
    let nonces_before = hot_wallet::lanes(&client).await.unwrap();
    let r = request::request(
        &h.db.pool,
        &Request {
            account_id: AccountId::new(bob),
            external_id: ExternalId::parse("tt-1").unwrap(),
            asset: Asset::parse_key(&asset).unwrap(),
            destination: ChainAddress::Eth(EthAddress::parse(&destination(7)).unwrap()),
            amount: Amount::from_u64(1_000_000),
            requested_by: "wallet-app".into(),
        },
    )
    .await
    .unwrap();
    let report = h.worker(config(1)).pass().await.unwrap();
    assert_eq!((report.rejected, report.signed), (0, 0), "our own shortage never rejects a customer");
    assert_eq!(report.short_lanes.len(), 1, "{report:?}");
    assert_eq!(h.state(r.withdrawal.id().get()).await, WithdrawalState::Requested);
    assert_eq!(h.count("select count(*) from nonce_allocation").await, 0);
    let cursors = |lanes: Vec<hot_wallet::Lane>| lanes.into_iter().map(|l| (l.lane, l.next_nonce)).collect::<Vec<_>>();
    assert_eq!(cursors(hot_wallet::lanes(&client).await.unwrap()), cursors(nonces_before), "no nonce consumed");
    let token_balance = posted_balance(&client, &format!("user:{bob}"), &asset, Normal::Credit).await;
    assert_eq!(token_balance, "4000000", "still held: it goes out once the hot wallet is topped up");
}

#[tokio::test]
async fn a_worker_stopped_after_commit_and_before_broadcast_sends_the_same_bytes_after_restart() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let w = h.request(alice, "crash-1", &destination(11), ETHER).await.unwrap().withdrawal;
    let lane = h.lane(w.lane().as_str()).await;
    {
        // The first process signs and commits, then dies before broadcasting.
        let first = h.worker(config(1));
        first.allocate_lane(&lane).await.unwrap();
    }
    let signed = sql::load(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap().unwrap();
    assert_eq!(signed.state(), WithdrawalState::Signed);
    let stored_hash = signed.tx_hash().unwrap().to_string();
    assert!(h.anvil.rpc("eth_getTransactionByHash", json!([stored_hash])).await.unwrap().is_null(), "never sent");

    let restarted = h.worker(config(1));
    work_until_state(&h, &restarted, false, w.id().get(), WithdrawalState::Confirmed).await;
    let done = sql::load(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap().unwrap();
    assert_eq!(done.tx_hash().map(|h| h.to_string()), Some(stored_hash), "the stored bytes were sent, not re-signed");
    assert_eq!(h.count("select count(*) from withdrawal_attempt").await, 1);
    assert_eq!(h.balance(&destination(11)).await, U256::from(ETHER));
}

#[tokio::test]
async fn a_transaction_dropped_from_the_mempool_is_sent_again_and_mined() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let w = h.request(alice, "drop-1", &destination(12), ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(1));
    let report = worker.pass().await.unwrap();
    assert_eq!((report.signed, report.broadcast), (1, 1));
    let hash =
        sql::load(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap().unwrap().tx_hash().unwrap().to_string();
    h.rpc("anvil_dropTransaction", json!([hash])).await;
    assert!(h.anvil.rpc("eth_getTransactionByHash", json!([hash])).await.unwrap().is_null());
    let report = worker.pass().await.unwrap();
    assert_eq!(report.rebroadcast, 1);
    work_until_state(&h, &worker, true, w.id().get(), WithdrawalState::Confirmed).await;
    assert_eq!(h.balance(&destination(12)).await, U256::from(ETHER));
    assert_eq!(h.count("select count(*) from withdrawal_attempt").await, 1, "same bytes, no new attempt");
}

#[tokio::test]
async fn a_base_fee_spike_is_answered_by_a_bump_that_settlement_finds_by_nonce() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let w = h.request(alice, "spike-1", &destination(13), ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(1));
    worker.pass().await.unwrap();
    let original = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap();
    assert_eq!(original.len(), 1);
    // The next blocks cost far more than the attempt is willing to pay.
    let spike = original[0].max_fee * U256::from(4);
    h.rpc("anvil_setNextBlockBaseFeePerGas", json!([format!("{spike:#x}")])).await;
    h.mine(2).await;
    assert!(
        h.anvil.rpc("eth_getTransactionReceipt", json!([original[0].tx_hash])).await.unwrap().is_null(),
        "priced out"
    );
    let report = worker.pass().await.unwrap();
    assert_eq!(report.bumped, 1);
    work_until_state(&h, &worker, true, w.id().get(), WithdrawalState::Confirmed).await;
    let attempts = sql::attempts(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap();
    assert_eq!(attempts.len(), 2, "the original is still recorded");
    assert_eq!(attempts[1].kind, custodian_domain::withdrawal::AttemptKind::Bump);
    assert!(attempts[1].max_fee * U256::from(8) >= attempts[0].max_fee * U256::from(9), "raised at least 12.5%");
    let done = sql::load(&h.db.pool.get().await.unwrap(), w.id().get()).await.unwrap().unwrap();
    assert_eq!(done.tx_hash(), Some(attempts[1].tx_hash), "settled on the bump");
    assert_eq!(h.balance(&destination(13)).await, U256::from(ETHER));
}

#[tokio::test]
async fn a_mined_withdrawal_reorged_out_is_sent_again_and_settled_once() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let w = h.request(alice, "reorg-1", &destination(14), ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(4));
    work_until_state(&h, &worker, false, w.id().get(), WithdrawalState::Mined).await;
    h.rpc("anvil_reorg", json!([1, []])).await;
    let report = worker.pass().await.unwrap();
    assert_eq!(report.unmined, 1);
    work_until_state(&h, &worker, true, w.id().get(), WithdrawalState::Confirmed).await;
    let client = h.db.pool.get().await.unwrap();
    let types: Vec<String> = column(
        &client,
        "select event_type from withdrawal_event where withdrawal_id = $1 order by seq",
        &[&w.id().get()],
    )
    .await;
    assert!(types.windows(2).any(|p| p == ["mined", "unmined"]), "{types:?}");
    assert_eq!(types.last().map(String::as_str), Some("confirmed"));
    assert_eq!(h.count("select count(*) from ledger_transfer where kind = 'withdrawal_settle'").await, 1);
    assert_eq!(h.balance(&destination(14)).await, U256::from(ETHER));
    h.verify().await;
}

/// Alice's withdrawal on each lane, and a proxy in front of anvil through which the node can
/// misbehave for lane a only: the withdrawal ids by lane, lane a's address and the proxy.
async fn one_on_each_lane_behind_a_proxy(
    h: &Harness,
    key: &str,
    first: u64,
) -> (HashMap<String, i64>, String, RpcProxy) {
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let (by_lane, lane_a) = one_on_each_lane(h, alice, key, first).await;
    let proxy = RpcProxy::start(&[&h.anvil.url]).await.unwrap();
    (by_lane, lane_a, proxy)
}

/// After a `first` pass that failed lane a: lane b settles (waited for as `what`) while lane a
/// stays requested.
async fn only_lane_b_settles(
    h: &Harness,
    worker: &Worker,
    by_lane: &HashMap<String, i64>,
    first: &PassReport,
    what: &str,
) {
    assert!(first.lane_errors.iter().any(|e| e.starts_with("a:")), "{:?}", first.lane_errors);
    let b = by_lane["b"];
    h.work_until(worker, true, what, |h| Box::pin(async move { h.state(b).await == WithdrawalState::Confirmed })).await;
    assert_eq!(h.state(by_lane["a"]).await, WithdrawalState::Requested, "lane a made no progress, and lost nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_whose_node_calls_fail_is_backed_off_and_the_other_lane_still_settles() {
    let h = Harness::start(&[]).await;
    let (by_lane, lane_a, proxy) = one_on_each_lane_behind_a_proxy(&h, "iso", 200).await;
    // The node fails every nonce question about lane a's address (lanes are worked a, then b).
    proxy.fail_mentioning("eth_getTransactionCount", &lane_a);
    let worker = Worker::new(h.db.pool.clone(), EthNode::new(&proxy.url).unwrap(), h.signers.clone(), config(1));
    let first = worker.pass().await.expect("a lane's failure does not fail the pass");
    only_lane_b_settles(&h, &worker, &by_lane, &first, "lane b to settle while lane a fails").await;
    proxy.heal();
    let a = by_lane["a"];
    eventually("lane a to settle once the node answers again", Duration::from_secs(60), || async {
        worker.pass().await.unwrap();
        h.mine(1).await;
        (h.state(a).await == WithdrawalState::Confirmed).then_some(())
    })
    .await;
    h.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_silent_for_one_lane_times_out_and_the_other_lane_still_settles() {
    let h = Harness::start(&[]).await;
    let (by_lane, lane_a, proxy) = one_on_each_lane_behind_a_proxy(&h, "silent", 300).await;
    proxy.hang_mentioning("eth_getTransactionCount", &lane_a);
    let node = EthNode::with_timeout(&proxy.url, Duration::from_millis(300)).unwrap();
    let worker = Worker::new(h.db.pool.clone(), node, h.signers.clone(), config(1));
    let started = std::time::Instant::now();
    let first = tokio::time::timeout(Duration::from_secs(10), worker.pass())
        .await
        .expect("a silent node never freezes the pass")
        .expect("a lane's timeout does not fail the pass");
    assert!(started.elapsed() < Duration::from_secs(5), "bounded by the call timeout: {:?}", started.elapsed());
    only_lane_b_settles(&h, &worker, &by_lane, &first, "lane b to settle while the node is silent for lane a").await;
    h.verify().await;
}

#[tokio::test]
async fn cancels_before_signing_after_broadcast_and_losing_to_the_original() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let worker = h.worker(config(1));

    // Before signing: cancelled at once, the hold released.
    let early = h.request(alice, "c-early", &destination(21), ETHER).await.unwrap().withdrawal;
    assert_eq!(h.available(alice).await, (9 * ETHER).to_string());
    let (cancelled, _) = actions::cancel(&mut h.db.pool.get().await.unwrap(), early.id().get(), "alice").await.unwrap();
    assert_eq!(cancelled.state(), WithdrawalState::Cancelled);
    assert_eq!(h.available(alice).await, (10 * ETHER).to_string());

    // After broadcast, and the cancel mines.
    let racing = h.request(alice, "c-race", &destination(22), ETHER).await.unwrap().withdrawal;
    worker.pass().await.unwrap();
    assert_eq!(h.state(racing.id().get()).await, WithdrawalState::Broadcast);
    actions::cancel(&mut h.db.pool.get().await.unwrap(), racing.id().get(), "alice").await.unwrap();
    let report = worker.pass().await.unwrap();
    assert_eq!(report.cancel_attempts, 1);
    work_until_state(&h, &worker, true, racing.id().get(), WithdrawalState::Cancelled).await;
    assert_eq!(h.balance(&destination(22)).await, U256::ZERO, "the original never paid");
    let fee: String = h.db.pool.get().await.unwrap()
        .query_one("select amount::text from ledger_posting p join ledger_transfer t on t.id = p.transfer_id where t.idempotency_key = $1 and p.direction = 'debit'", &[&format!("withdrawal:{}:fee", racing.id())])
        .await
        .unwrap()
        .get(0);
    assert_ne!(fee, "0", "the cancel's fee is booked");
    assert_eq!(h.available(alice).await, (10 * ETHER).to_string(), "hold released");

    // After broadcast, but the original mines first: the cancel loses and the payout stands.
    let late = h.request(alice, "c-late", &destination(23), ETHER).await.unwrap().withdrawal;
    worker.pass().await.unwrap();
    h.mine(1).await;
    actions::cancel(&mut h.db.pool.get().await.unwrap(), late.id().get(), "alice").await.unwrap();
    work_until_state(&h, &worker, true, late.id().get(), WithdrawalState::Confirmed).await;
    assert_eq!(h.balance(&destination(23)).await, U256::from(ETHER));
    assert_eq!(h.available(alice).await, (9 * ETHER).to_string());
    h.verify().await;
}

/// Deploys testkit's Vault (a contract whose receive() writes storage) and returns its address.
async fn vault(h: &Harness) -> String {
    let hash = h.rpc("eth_sendTransaction", json!([{"from": FUNDER, "data": format!("0x{}", include_str!("../../../testkit/contracts/Vault.bin")), "gas": "0x1e8480"}])).await;
    let receipt = eventually("deployment", Duration::from_secs(10), || async {
        let r = h.anvil.rpc("eth_getTransactionReceipt", json!([hash])).await.unwrap();
        (!r.is_null()).then_some(r)
    })
    .await;
    EthAddress::parse(receipt["contractAddress"].as_str().unwrap()).unwrap().to_checksummed()
}

/// A harness with alice holding 10 ETH and a [`vault`] deployed: the harness, alice and the vault.
async fn alice_and_a_vault() -> (Harness, i64, String) {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let vault = vault(&h).await;
    (h, alice, vault)
}

/// Closes the vault: from then on its receive() reverts.
async fn close_vault(h: &Harness, vault: &str) {
    h.rpc("eth_sendTransaction", json!([{"from": FUNDER, "to": vault, "data": "0x43d726d6"}])).await;
    // close()
}

#[tokio::test]
async fn a_transaction_mined_with_status_zero_is_failed_onchain_with_the_fee_charged_and_the_hold_released() {
    let (h, alice, vault) = alice_and_a_vault().await;
    let w = h.request(alice, "fail-1", &vault, ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(1));
    // Simulated and signed while the vault takes payments; it closes before the payment mines.
    let lane = h.lane(w.lane().as_str()).await;
    assert_eq!(worker.allocate_lane(&lane).await.unwrap().signed, 1);
    close_vault(&h, &vault).await;
    work_until_state(&h, &worker, false, w.id().get(), WithdrawalState::FailedOnchain).await;
    assert_eq!(h.available(alice).await, (10 * ETHER).to_string(), "hold released");
    assert_eq!(h.count("select count(*) from ledger_transfer where kind = 'network_fee'").await, 1, "fee charged");
    h.verify().await;
}

#[tokio::test]
async fn native_eth_to_a_contract_is_simulated_paid_with_enough_gas_and_refused_when_it_reverts() {
    let (h, alice, vault) = alice_and_a_vault().await;
    let paid = h.request(alice, "to-vault", &vault, ETHER).await.unwrap().withdrawal;
    let worker = h.worker(config(1));
    work_until_state(&h, &worker, true, paid.id().get(), WithdrawalState::Confirmed).await;
    assert_eq!(h.balance(&vault).await, U256::from(ETHER), "the contract was paid");
    let tx_hash = sql::load(&h.db.pool.get().await.unwrap(), paid.id().get())
        .await
        .unwrap()
        .unwrap()
        .tx_hash()
        .unwrap()
        .to_owned();
    let tx = h.rpc("eth_getTransactionByHash", json!([tx_hash])).await;
    let gas = u64::from_str_radix(tx["gas"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    assert!(gas > 21_000, "the gas limit comes from the simulation: {gas}");
    // A contract that refuses ETH: the simulation reverts, the request is rejected, no nonce is used.
    close_vault(&h, &vault).await;
    let nonces_before = h.count("select count(*) from nonce_allocation").await;
    let refused = h.request(alice, "to-closed-vault", &vault, ETHER).await.unwrap().withdrawal;
    work_until_state(&h, &worker, false, refused.id().get(), WithdrawalState::Rejected).await;
    assert_eq!(h.count("select count(*) from nonce_allocation").await, nonces_before, "no nonce used");
    assert_eq!(h.available(alice).await, (9 * ETHER).to_string(), "only the paid withdrawal left the account");
    h.verify().await;
}

#[tokio::test]
async fn a_withdrawal_above_the_approval_limit_waits_for_a_named_approval() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let one_approver = LimitChange {
        approval_limit: Some(Some(U256::from(2 * ETHER))),
        approvals_required: Some(1),
        daily_limit: None,
    };
    limits::set(&mut h.db.pool.get().await.unwrap(), "ETH", &one_approver, "ops").await.unwrap();
    let big = h.request(alice, "big-1", &destination(31), 3 * ETHER).await.unwrap().withdrawal;
    assert_eq!(big.state(), WithdrawalState::AwaitingApproval);
    let worker = h.worker(config(1));
    for _ in 0..3 {
        assert_eq!(worker.pass().await.unwrap().signed, 0);
    }
    assert_eq!(h.state(big.id().get()).await, WithdrawalState::AwaitingApproval);
    assert!(
        actions::approve(&mut h.db.pool.get().await.unwrap(), big.id().get(), " ").await.is_err(),
        "a name is required"
    );
    let (approved, recorded) =
        actions::approve(&mut h.db.pool.get().await.unwrap(), big.id().get(), "carol").await.unwrap();
    assert!(recorded);
    assert_eq!(approved.state(), WithdrawalState::Requested);
    work_until_state(&h, &worker, false, big.id().get(), WithdrawalState::Confirmed).await;
    let payload = h.event_payload(big.id().get(), "approved").await.expect("an approved event");
    assert_eq!(payload["by"], "carol");
}

#[tokio::test]
async fn a_projection_row_changed_behind_the_events_is_never_signed_and_pauses_its_lane() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let w = h.request(alice, "pay-1", &destination(41), ETHER / 10).await.unwrap().withdrawal;
    let mallory = destination(66).to_lowercase();
    // Written as the schema owner, who first has to switch the table's guard off: the service
    // role cannot do even that.
    h.db.owner_client()
        .await
        .batch_execute(&format!(
            "alter table withdrawal disable trigger withdrawal_request_immutable;
             update withdrawal set destination = '{mallory}' where id = {id};
             alter table withdrawal enable trigger withdrawal_request_immutable;",
            id = w.id()
        ))
        .await
        .unwrap();
    let report = h.worker(config(1)).pass().await.unwrap();
    assert_eq!(report.signed, 0, "nothing is signed");
    assert_eq!(h.count("select count(*) from withdrawal_attempt").await, 0);
    assert_eq!(h.state(w.id().get()).await, WithdrawalState::NeedsReview);
    let payload = h.event_payload(w.id().get(), "needs_review").await.expect("a needs_review event");
    let reason = payload["reason"].as_str().expect("a reason");
    assert!(
        reason.contains(&mallory) && reason.contains(&w.destination().stored()),
        "both values are recorded: {reason}"
    );
    let lane = w.lane();
    let paused = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
    assert!(paused.iter().any(|l| l.lane == lane.as_str() && l.pause_reason.is_some()), "the lane paused: {paused:?}");
    assert_eq!(h.balance(&mallory).await, U256::ZERO, "mallory was never paid");

    // The way out: never signed, so only "not paid" applies, and it releases the hold.
    let mut client = h.db.pool.get().await.unwrap();
    let paid_by = actions::Resolution::PaidBy(format!("0x{}", "ab".repeat(32)));
    assert!(
        actions::resolve(&mut client, &h.node, w.id().get(), &paid_by, 1, "ops").await.is_err(),
        "nothing can have paid it"
    );
    let before = h.available(w.account_id().get()).await;
    let resolved =
        actions::resolve(&mut client, &h.node, w.id().get(), &actions::Resolution::NotPaid, 1, "ops").await.unwrap();
    assert!(!resolved.paid);
    assert_eq!(h.state(w.id().get()).await, WithdrawalState::Cancelled);
    let released = before.parse::<u128>().unwrap() + w.amount().units().to::<u128>();
    assert_eq!(h.available(w.account_id().get()).await, released.to_string(), "the hold is released");
    // The ledger agrees with the events; the tampered column stays evidence (the service may not
    // rewrite what a withdrawal pays), and replay names only it.
    let report = replay::verify(&mut h.db.pool.get().await.unwrap()).await.unwrap();
    assert!(!report.differences.is_empty());
    assert!(
        report.differences.iter().all(|d| d.check == "withdrawal projection" && d.detail.contains("destination=")),
        "{:#?}",
        report.differences
    );
}

/// The review of a tampered row and its lane's pause are one transaction: when the pause cannot
/// be written (here a trigger the owner adds refuses it, as a stop between the two would), the
/// review is not written either, and the next pass finds the row again and writes both. Before,
/// the review committed first: the row left the requested queue in review, the lane stayed open,
/// and no later pass looked at that row again.
#[tokio::test]
async fn a_tampered_row_goes_to_review_only_with_its_lane_paused() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let w = h.request(alice, "pay-1", &destination(41), ETHER / 10).await.unwrap().withdrawal;
    let owner = h.db.owner_client().await;
    owner
        .batch_execute(&format!(
            "alter table withdrawal disable trigger withdrawal_request_immutable;
             update withdrawal set destination = '{mallory}' where id = {id};
             alter table withdrawal enable trigger withdrawal_request_immutable;
             create function refuse_pause() returns trigger language plpgsql as
                 $$ begin raise exception 'pausing refused by the test'; end; $$;
             create trigger refuse_pause before update of paused_at on hot_wallet
                 for each row when (new.paused_at is not null) execute function refuse_pause();",
            mallory = destination(66).to_lowercase(),
            id = w.id()
        ))
        .await
        .unwrap();
    let refused = h.worker(config(1)).pass().await.unwrap();
    assert_eq!(refused.lane_errors.len(), 1, "{refused:?}");
    assert!(refused.lane_errors[0].contains("pausing refused by the test"), "{refused:?}");
    let paused = || async {
        let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
        lanes.iter().any(|l| l.lane == w.lane().as_str() && l.pause_reason.is_some())
    };
    assert_eq!((h.state(w.id().get()).await, paused().await), (WithdrawalState::Requested, false), "neither written");

    owner.batch_execute("drop trigger refuse_pause on hot_wallet").await.unwrap();
    let report = h.worker(config(1)).pass().await.unwrap();
    assert_eq!(report.signed, 0, "{report:?}");
    assert_eq!((h.state(w.id().get()).await, paused().await), (WithdrawalState::NeedsReview, true), "both written");
    assert_eq!(h.count("select count(*) from withdrawal_attempt").await, 0, "nothing signed");
}

#[tokio::test]
async fn a_state_flipped_back_to_requested_behind_the_events_is_never_signed() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let one_approver =
        LimitChange { approval_limit: Some(Some(U256::from(ETHER))), approvals_required: Some(2), daily_limit: None };
    limits::set(&mut h.db.pool.get().await.unwrap(), "ETH", &one_approver, "ops").await.unwrap();
    let waiting = h.request(alice, "big", &destination(61), 2 * ETHER).await.unwrap().withdrawal;
    assert_eq!(waiting.state(), WithdrawalState::AwaitingApproval);
    let cancelled = h.request(alice, "small", &destination(62), ETHER / 10).await.unwrap().withdrawal;
    actions::cancel(&mut h.db.pool.get().await.unwrap(), cancelled.id().get(), "wallet-app").await.unwrap();
    assert_eq!(h.state(cancelled.id().get()).await, WithdrawalState::Cancelled);
    // The service's own login may move the projection's state column; it must not get money out.
    h.db.client()
        .await
        .batch_execute(&format!(
            "update withdrawal set state = 'requested' where id in ({}, {})",
            waiting.id(),
            cancelled.id()
        ))
        .await
        .unwrap();
    let report = h.worker(config(1)).pass().await.unwrap();
    assert_eq!(report.signed, 0, "nothing is signed");
    assert_eq!(h.count("select count(*) from withdrawal_attempt").await, 0);
    assert_eq!(h.state(cancelled.id().get()).await, WithdrawalState::Cancelled, "the stream still says cancelled");
    let row: String =
        h.db.pool
            .get()
            .await
            .unwrap()
            .query_one("select state from withdrawal where id = $1", &[&cancelled.id().get()])
            .await
            .unwrap()
            .get(0);
    assert_eq!(row, "cancelled", "a settled stream's row is put back as its events say");
    for id in [waiting.id()] {
        let payload = h.event_payload(id.get(), "needs_review").await;
        let reason = payload.as_ref().and_then(|p| p["reason"].as_str());
        assert!(reason.is_some_and(|r| r.contains("awaiting_approval")), "{id}: {reason:?}");
    }
    assert_eq!(h.balance(&destination(61)).await, U256::ZERO);
    assert_eq!(h.balance(&destination(62)).await, U256::ZERO);
    let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
    assert!(lanes.iter().any(|l| l.pause_reason.is_some()), "a lane paused: {lanes:?}");
}

#[tokio::test]
async fn a_burst_is_signed_broadcast_and_settled_in_a_few_passes_with_batched_node_calls() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 100 * ETHER).await;
    let total = 300u64;
    for n in 0..total {
        h.request(alice, &format!("burst-{n}"), &format!("0x{:040x}", 0xbb00_0000u64 + n), 1_000 + u128::from(n))
            .await
            .unwrap();
    }
    let proxy = RpcProxy::start(&[&h.anvil.url]).await.unwrap();
    let worker = Worker::new(
        h.db.pool.clone(),
        EthNode::new(&proxy.url).unwrap(),
        h.signers.clone(),
        WorkerConfig { confirmations: 1, ..WorkerConfig::default() },
    );
    let first = worker.pass().await.unwrap();
    assert_eq!((first.signed, first.broadcast), (total, total), "the whole burst in one pass: {first:?}");
    let calls = proxy.requests();
    assert!(calls < 40, "{calls} node requests for {total} withdrawals: batched, not one per withdrawal");
    h.mine(2).await;
    let second = worker.pass().await.unwrap();
    assert_eq!((second.mined, second.confirmed), (total, total), "{second:?}");
    assert!(proxy.requests() - calls < 40, "settling {total} took {} node requests", proxy.requests() - calls);
    for n in [0, total / 2, total - 1] {
        assert_eq!(h.balance(&format!("0x{:040x}", 0xbb00_0000u64 + n)).await, U256::from(1_000 + u128::from(n)));
    }
    h.verify().await;
}

/// How many transactions wrote the `requested` events of `ids`.
async fn transactions(h: &Harness, ids: &[i64]) -> i64 {
    let client = h.db.client().await;
    client
        .query_one(
            "select count(distinct fact_xid) from withdrawal_event where withdrawal_id = any($1) and seq = 1",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn a_warmed_connection_has_planned_every_statement_a_request_runs_and_wrote_nothing() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    // A pool of one new connection, so what is prepared on it is what warming and the request did.
    let pool = custodian_store::pool::connect_with(&h.db.url, 1, Duration::from_secs(5)).await.unwrap();
    let mut client = pool.get().await.unwrap();
    // How many statements the connection has prepared, and how many of them have a generic plan
    // (tokio-postgres prepares every query it sends by name, this one too: it is left out).
    async fn planned(client: &tokio_postgres::Client) -> (i64, i64) {
        let row = client
            .query_one(
                "select count(*), count(*) filter (where generic_plans > 0) from pg_prepared_statements
                  where statement not like '%pg_prepared_statements%'",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    }
    assert_eq!(planned(&client).await, (0, 0), "a new connection has nothing prepared");
    // The sequence's state is the owner's to read.
    let owner = h.db.owner_client().await;
    let written = || async {
        let row = owner
            .query_one(
                "select (select last_value from withdrawal_id_seq), (select is_called from withdrawal_id_seq),
                        (select count(*) from withdrawal_event), (select count(*) from ledger_posting)",
                &[],
            )
            .await
            .unwrap();
        (row.get::<_, i64>(0), row.get::<_, bool>(1), row.get::<_, i64>(2), row.get::<_, i64>(3))
    };
    let before = written().await;

    request::warm(&mut client).await.unwrap();
    let (prepared, generic) = planned(&client).await;
    assert!(prepared >= 15, "every statement of a request is prepared: {prepared}");
    assert_eq!(generic, prepared, "and each has its generic plan");
    assert_eq!(written().await, before, "warming writes nothing and draws no id");

    // A request on the warmed connection prepares nothing more: warming covered all it runs.
    drop(client);
    let requested = request::request(&pool, &eth_request(alice, "w-1", 1, ETHER)).await.unwrap();
    assert!(requested.created);
    let client = pool.get().await.unwrap();
    assert_eq!(planned(&client).await.0, prepared, "the request found every statement prepared");
    assert_ne!(written().await, before, "the request itself is written");
    h.verify().await;
}

fn eth_request(account: i64, external_id: &str, to: u64, wei: u128) -> Request {
    Request {
        account_id: AccountId::new(account),
        external_id: ExternalId::parse(external_id).unwrap(),
        asset: Asset::Native(Chain::Eth),
        destination: ChainAddress::Eth(EthAddress::parse(&destination(to)).unwrap()),
        amount: Amount::from_units(U256::from(wei)),
        requested_by: "wallet-app".to_owned(),
    }
}

#[tokio::test]
async fn requests_recorded_together_are_each_answered_as_alone_and_a_short_one_writes_none_of_the_batch() {
    let h = Harness::start(&[]).await;
    let (alice, bob) = (h.funded_account("alice", 5 * ETHER).await, h.funded_account("bob", ETHER).await);
    // Together: one transaction for all three.
    let first = [
        eth_request(alice, "b-1", 1, 2 * ETHER),
        eth_request(bob, "b-2", 2, ETHER),
        eth_request(alice, "b-3", 3, ETHER),
    ];
    let answers = request::request_batch(&h.db.pool, &first).await;
    let ids: Vec<i64> = answers.iter().map(|a| a.as_ref().expect("recorded").withdrawal.id().get()).collect();
    assert!(answers.iter().all(|a| a.as_ref().unwrap().created));
    assert_eq!(transactions(&h, &ids).await, 1, "the three were written by one transaction");
    assert_eq!((h.available(alice).await, h.available(bob).await), ((2 * ETHER).to_string(), "0".to_owned()));
    // Alice has 2 ETH left: of the next batch the third would overdraw her. Its refusal under the
    // lock leaves nothing of the batch written; each is then recorded alone, in order.
    let second = [
        eth_request(alice, "b-4", 4, ETHER),
        eth_request(alice, "b-1", 1, 2 * ETHER), // resent: the earlier withdrawal
        eth_request(alice, "b-5", 5, ETHER),
        eth_request(alice, "b-6", 6, ETHER),
        eth_request(bob, "b-7", 7, 1),
        eth_request(alice, "b-8", 1, 0), // zero: refused before anything is read
    ];
    let answers = request::request_batch(&h.db.pool, &second).await;
    assert!(answers[0].as_ref().unwrap().created);
    let resent = answers[1].as_ref().unwrap();
    assert_eq!((resent.withdrawal.id().get(), resent.created), (ids[0], false));
    assert!(answers[2].as_ref().unwrap().created);
    match &answers[3] {
        Err(RequestError::InsufficientFunds { available, .. }) => assert_eq!(available.to_string(), "0"),
        other => panic!("the third ether is not there: {other:?}"),
    }
    assert!(matches!(answers[4], Err(RequestError::InsufficientFunds { .. })), "bob has nothing left");
    assert!(matches!(answers[5], Err(RequestError::Invalid(_))), "{:?}", answers[5]);
    let alone =
        [answers[0].as_ref().unwrap().withdrawal.id().get(), answers[2].as_ref().unwrap().withdrawal.id().get()];
    assert_eq!(transactions(&h, &alone).await, 2, "after the refusal each was recorded alone");
    assert_eq!(h.available(alice).await, "0");
    assert_eq!(h.count("select count(*) from withdrawal").await, 5);
    assert_eq!(h.count("select count(*) from withdrawal_event").await, 5);
    // A batch holding one external id twice: the second copy is the first's withdrawal.
    let carol = h.funded_account("carol", 3 * ETHER).await;
    let twice =
        [eth_request(carol, "c-1", 8, ETHER), eth_request(carol, "c-1", 8, ETHER), eth_request(carol, "c-1", 9, ETHER)];
    let answers = request::request_batch(&h.db.pool, &twice).await;
    let (one, two) = (answers[0].as_ref().unwrap(), answers[1].as_ref().unwrap());
    assert_eq!((one.created, two.created, one.withdrawal.id()), (true, false, two.withdrawal.id()));
    assert!(matches!(&answers[2], Err(RequestError::Conflict { fields, .. }) if fields == &["destination"]));
    assert_eq!(h.available(carol).await, (2 * ETHER).to_string());
    h.verify().await;
}

#[tokio::test]
async fn concurrent_callers_through_the_coalescer_never_overdraw_an_account_and_each_get_their_own_answer() {
    let h = Arc::new(Harness::start(&[]).await);
    // Room for exactly 120 of the 200 requests of one account.
    let alice = h.funded_account("alice", 120 * ETHER).await;
    let coalescer = custodian_withdrawals::coalesce::Coalescer::start(h.db.pool.clone(), 2, 64);
    let callers: Vec<_> = (0..8u64)
        .map(|c| {
            let coalescer = coalescer.clone();
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for i in 0..25u64 {
                    let n = c * 25 + i;
                    let r = eth_request(alice, &format!("k-{n}"), n, ETHER);
                    // Every request twice, the copy at once: one withdrawal per external id.
                    let (a, b) = tokio::join!(coalescer.request(r.clone()), coalescer.request(r));
                    answers.push((n, a, b));
                }
                answers
            })
        })
        .collect();
    let (mut created, mut short) = (0, 0);
    for caller in callers {
        for (n, a, b) in caller.await.unwrap() {
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(
                        a.listed.withdrawal.id(),
                        b.listed.withdrawal.id(),
                        "request {n}: one withdrawal per key"
                    );
                    assert!(a.created != b.created, "request {n}: exactly one copy created it");
                    assert_eq!(a.listed.withdrawal.external_id().as_str(), format!("k-{n}"));
                    assert_eq!((a.listed.symbol.as_str(), a.listed.decimals), ("ETH", 18), "answered as listed");
                    created += 1;
                }
                (Err(RequestError::InsufficientFunds { .. }), Err(RequestError::InsufficientFunds { .. })) => {
                    short += 1
                }
                other => panic!("request {n}: {other:?}"),
            }
        }
    }
    assert_eq!((created, short), (120, 80));
    assert_eq!(h.available(alice).await, "0");
    assert_eq!(h.count("select count(*) from withdrawal").await, 120);
    h.verify().await;
}

/// A withdrawal as `listing` reads it, to compare with an answer built from what a request knew.
async fn as_listed(h: &Harness, id: i64) -> String {
    let client = h.db.pool.get().await.unwrap();
    format!("{:?}", custodian_withdrawals::listing::one(&client, id).await.unwrap().unwrap())
}

#[tokio::test]
async fn answers_built_from_what_requests_wrote_or_read_are_the_withdrawals_as_listed_and_hits_take_no_id() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let coalescer = custodian_withdrawals::coalesce::Coalescer::start(h.db.pool.clone(), 2, 64);
    let requests: Vec<Request> = (1..=3).map(|n| eth_request(alice, &format!("l-{n}"), n, ETHER)).collect();
    // New: two in one batch, one alone, and one through the coalescer.
    let batch = request::request_batch(&h.db.pool, &requests[..2]).await;
    let alone = request::request(&h.db.pool, &requests[2]).await.unwrap();
    let mut ids = Vec::new();
    for requested in batch.into_iter().map(Result::unwrap).chain([alone]) {
        assert!(requested.created);
        let id = requested.withdrawal.id().get();
        let extras = requested.extras.expect("a new request knows its listing");
        assert_eq!(format!("{:?}", extras.listed(requested.withdrawal)), as_listed(&h, id).await, "withdrawal {id}");
        ids.push(id);
    }
    let fourth = eth_request(alice, "l-4", 4, ETHER);
    let answer = coalescer.request(fourth.clone()).await.unwrap();
    assert!(answer.created);
    assert_eq!(format!("{:?}", answer.listed), as_listed(&h, answer.listed.withdrawal.id().get()).await);
    // Signed and sent: a hit's answer carries the attempt, read with its stream.
    let worker = h.worker(config(1));
    work_until_state(&h, &worker, false, ids[0], WithdrawalState::Broadcast).await;
    // The sequence's state is the owner's to read.
    let owner = h.db.owner_client().await;
    let next_id =
        || async { owner.query_one("select last_value from withdrawal_id_seq", &[]).await.unwrap().get::<_, i64>(0) };
    let ids_before = next_id().await;
    let hits = request::request_batch(&h.db.pool, &requests).await;
    for (requested, id) in hits.into_iter().map(Result::unwrap).zip(&ids) {
        assert!(!requested.created);
        let extras = requested.extras.expect("a hit knows its listing");
        let listed = extras.listed(requested.withdrawal);
        if *id == ids[0] {
            assert_eq!(listed.attempts.len(), 1, "the signed payload is in the answer");
        }
        assert_eq!(format!("{listed:?}"), as_listed(&h, *id).await, "withdrawal {id}");
    }
    let (a, b) = tokio::join!(coalescer.request(requests[0].clone()), coalescer.request(fourth));
    for answer in [a.unwrap(), b.unwrap()] {
        assert!(!answer.created);
        assert_eq!(format!("{:?}", answer.listed), as_listed(&h, answer.listed.withdrawal.id().get()).await);
    }
    assert_eq!(next_id().await, ids_before, "an idempotent hit draws no withdrawal id");
    h.verify().await;
}
