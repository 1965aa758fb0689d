//! Withdrawals against real PostgreSQL and anvil: allocation under concurrency, idempotency,
//! simulation, crash between commit and broadcast, dropped transactions, fee spikes, reorgs,
//! outside use of a hot key, cancels, on-chain failure and approvals.

use std::collections::HashMap;
use std::time::Duration;

use alloy_primitives::U256;
use custodian_domain::withdrawal::WithdrawalState;
use custodian_testkit::eventually;
use custodian_withdrawals::{actions, hot_wallet, sql};
use serde_json::{json, Value};

use crate::eth_harness::{config, destination, Harness, ETHER, FUNDER};

/// Someone with lane a's key replaces withdrawal `id`'s pending transaction at the same nonce,
/// and a block mines the replacement. Returns the withdrawal as it was.
async fn replaced_outside(h: &Harness, id: i64) -> custodian_domain::withdrawal::Withdrawal {
    let ours = sql::load(&h.db.pool.get().await.unwrap(), id).await.unwrap().unwrap();
    let outside = alloy::consensus::TxEip1559 {
        chain_id: 31337,
        nonce: ours.nonce().unwrap().get(),
        gas_limit: 21_000,
        max_fee_per_gas: 1_000_000_000_000,
        max_priority_fee_per_gas: 500_000_000_000,
        to: alloy_primitives::TxKind::Call(FUNDER.parse().unwrap()),
        value: U256::from(1u8),
        ..Default::default()
    };
    let signed = h.signers["a"].sign(outside).unwrap();
    h.rpc("eth_sendRawTransaction", json!([format!("0x{}", alloy_primitives::hex::encode(&signed.raw))])).await;
    h.mine(1).await;
    ours
}

#[tokio::test]
async fn a_hot_key_used_outside_the_service_pauses_its_lane_and_the_other_lane_keeps_going() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    // Find one request per lane.
    let mut by_lane: HashMap<String, i64> = HashMap::new();
    let mut n = 0;
    while by_lane.len() < 2 {
        n += 1;
        let w = h.request(alice, &format!("lane-{n}"), &destination(100 + n), ETHER / 100).await.unwrap().withdrawal;
        by_lane.entry(w.lane().to_string()).or_insert(w.id().get());
    }
    let worker = h.worker(config(1));
    worker.pass().await.unwrap();
    let lane_a =
        hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap().into_iter().find(|l| l.lane == "a").unwrap();
    let ours = replaced_outside(&h, by_lane["a"]).await;
    for _ in 0..10 {
        worker.pass().await.unwrap();
        h.mine(1).await;
    }
    assert_eq!(h.state(by_lane["a"]).await, WithdrawalState::NeedsReview);
    let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
    let reason = lanes.iter().find(|l| l.lane == "a").unwrap().pause_reason.clone().unwrap();
    assert!(reason.contains("did not sign"), "{reason}");
    assert_eq!(lane_a.address, lanes[0].address);
    assert!(lanes.iter().find(|l| l.lane == "b").unwrap().pause_reason.is_none());
    assert_eq!(h.state(by_lane["b"]).await, WithdrawalState::Confirmed, "lane b keeps going");

    // The way out: resuming is refused until the lane is re-synced with the chain, which is
    // recorded with both nonces; then it resumes and signs at the chain's next nonce.
    let operator = crate::harness::operator(&h.db).await;
    let env = vec![
        ("CUSTODIAN_DATABASE_URL".to_owned(), h.db.url.expose().to_owned()),
        ("CUSTODIAN_TOKEN".to_owned(), operator),
        ("CUSTODIAN_ETH_RPC_URL".to_owned(), h.anvil.url.clone()),
    ];
    let cli = |args: &'static [&'static str]| crate::harness::custodian_env_async(env.clone(), args);
    let refused = cli(&["hot-wallet", "resume", "--lane", "a"]).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("hot-wallet resync --lane a"), "{}", refused.stderr);
    let chain_nonce = h.rpc("eth_getTransactionCount", json!([lane_a.address, "pending"])).await;
    let chain_nonce = u64::from_str_radix(chain_nonce.as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    let resynced = cli(&["hot-wallet", "resync", "--lane", "a", "--json"]).await;
    assert_eq!(resynced.code, 0, "{}", resynced.stderr);
    assert_eq!(resynced.json()["chain_nonce"], chain_nonce);
    assert_eq!(resynced.json()["next_nonce"], chain_nonce.max(ours.nonce().unwrap().next().get()));
    assert_eq!(
        h.count("select count(*) from operator_action where action = 'lane_resynced' and principal = 'operator'").await,
        1
    );
    let resumed = cli(&["hot-wallet", "resume", "--lane", "a"]).await;
    assert_eq!(resumed.code, 0, "{}", resumed.stderr);
    let mut next = None;
    while next.is_none() {
        n += 1;
        let w = h.request(alice, &format!("lane-{n}"), &destination(100 + n), ETHER / 100).await.unwrap().withdrawal;
        next = (w.lane() == "a").then_some(w.id());
    }
    let next = next.unwrap();
    h.work_until(&worker, true, "the resumed lane to pay", |h| {
        Box::pin(async move { h.state(next.get()).await == WithdrawalState::Confirmed })
    })
    .await;
}

/// The alert for a nonce used outside the service and the lane's pause are one transaction. A
/// pass stopped between them (here lane a's row held by another transaction until the worker's
/// session gives up on it) writes neither; a later pass writes both. Before, the withdrawal went
/// to review in a transaction of its own and the pause came after: stopped in between, the lane
/// whose key is known outside stayed open, and no later pass paused it (the withdrawal was in
/// review already, so its alert was never raised again).
#[tokio::test]
async fn a_pass_stopped_between_an_outside_nonce_alert_and_its_pause_writes_neither() {
    let h = Harness::start(&["--no-mining"]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let mut n = 0;
    let id = loop {
        n += 1;
        let w = h.request(alice, &format!("lane-{n}"), &destination(100 + n), ETHER / 100).await.unwrap().withdrawal;
        if w.lane() == "a" {
            break w.id().get();
        }
    };
    let url: custodian_store::DatabaseUrl =
        format!("{}?options=-c%20lock_timeout%3D300", h.db.url.expose()).parse().unwrap();
    let pool = custodian_store::pool::connect(&url, 4).await.unwrap();
    let worker = custodian_withdrawals::Worker::new(pool, h.node.clone(), h.signers.clone(), config(1));
    worker.pass().await.unwrap();
    replaced_outside(&h, id).await;
    // The first sighting; the alert needs a second one at a later block.
    worker.pass().await.unwrap();
    assert_eq!(h.state(id).await, WithdrawalState::Broadcast);
    h.mine(1).await;
    let paused = || async {
        let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
        lanes.iter().find(|l| l.lane == "a").unwrap().pause_reason.is_some()
    };

    let mut holder = h.db.client().await;
    let held = holder.transaction().await.unwrap();
    held.execute("select 1 from hot_wallet where chain = 'eth' and lane = 'a' for update", &[]).await.unwrap();
    let failed = worker.pass().await.unwrap();
    assert_eq!(failed.lane_errors.len(), 1, "{failed:?}");
    assert_eq!(
        (h.state(id).await, paused().await),
        (WithdrawalState::Broadcast, false),
        "a stopped alert writes neither the review nor the pause"
    );
    held.rollback().await.unwrap();

    // Seen again at two later blocks (the lane backed off meanwhile), then both written.
    for _ in 0..20 {
        if h.state(id).await == WithdrawalState::NeedsReview {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        worker.pass().await.unwrap();
        h.mine(1).await;
    }
    assert_eq!((h.state(id).await, paused().await), (WithdrawalState::NeedsReview, true));
    let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
    let lane_a = lanes.iter().find(|l| l.lane == "a").unwrap();
    assert!(lane_a.pause_reason.as_deref().unwrap().contains("did not sign"), "{lane_a:?}");
    assert_eq!(h.count("select count(*) from hot_wallet where chain = 'eth' and lane = 'a' and needs_resync").await, 1);
}

#[tokio::test]
async fn refused_withdrawals_exit_2_and_write_nothing() {
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", ETHER).await;
    let url = h.db.url.expose().to_owned();
    let count_all = || async {
        let mut counts = Vec::new();
        for table in ["withdrawal", "withdrawal_event", "ledger_transfer", "nonce_allocation"] {
            counts.push(h.count(&format!("select count(*) from {table}")).await);
        }
        counts
    };
    let before = count_all().await;
    let client = crate::harness::token(&h.db, "wallet-app", &[custodian_api::tokens::Scope::Withdraw]).await;
    let to = "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed";
    let cases: &[(&[&str], &str)] = &[
        (&["--asset", "ETH", "--to", to, "--amount", "2"], "insufficient funds"),
        (&["--asset", "ETH", "--to", "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAeD", "--amount", "0.1"], "checksum"),
        (&["--asset", "ETH", "--to", to, "--amount", "0"], "greater than zero"),
        (&["--asset", "ETH", "--to", to, "--amount", "0.0000000000000000001"], "decimals"),
        (&["--asset", "DOGE", "--to", to, "--amount", "0.1"], "unknown asset"),
        (&["--asset", "ETH", "--to", "0x70997970C51812dc3A010C7d01b50e0d17dc79C8", "--amount", "0.1"], "hot wallets"),
    ];
    for (args, message) in cases {
        let mut full = vec!["withdraw", "--account", "alice", "--external-id", "x-1"];
        full.extend_from_slice(args);
        let run = crate::harness::custodian_as(&url, &client, &full);
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains(message), "{args:?}: expected {message:?} in {}", run.stderr);
        assert_eq!(count_all().await, before, "{args:?} wrote something");
    }
    // `withdraw` for alice to `to`, the arguments that vary given.
    let withdraw = |external_id: &str, asset: &str, amount: &str, json: bool| {
        let mut args = vec![
            "withdraw",
            "--account",
            "alice",
            "--external-id",
            external_id,
            "--asset",
            asset,
            "--to",
            to,
            "--amount",
            amount,
        ];
        if json {
            args.push("--json");
        }
        crate::harness::custodian_as(&url, &client, &args)
    };
    let long = "x".repeat(129);
    for (external_id, message) in [(long.as_str(), "at most 128"), ("a\nb", "control character"), ("   ", "empty")] {
        let run = withdraw(external_id, "ETH", "0.1", false);
        assert_eq!(run.code, 2, "{external_id:?}: {}", run.stderr);
        assert!(run.stderr.contains(message), "{external_id:?}: expected {message:?} in {}", run.stderr);
        assert_eq!(count_all().await, before, "{external_id:?} wrote something");
    }
    let ok = withdraw("x-1", "eth", "0.25", true);
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    assert_eq!(ok.json()["withdrawal"]["amount"], "250000000000000000");
    let padded = withdraw(" x-1 ", "ETH", "0.25", true);
    assert_eq!(padded.code, 0, "{}", padded.stderr);
    assert_eq!(padded.json()["created"], false, "the key is trimmed: the same request");
    assert_eq!(padded.json()["withdrawal"]["id"], ok.json()["withdrawal"]["id"]);
    let conflict = withdraw("x-1", "ETH", "0.5", false);
    assert_eq!(conflict.code, 2);
    assert!(conflict.stderr.contains("different amount"), "{}", conflict.stderr);
    assert_eq!(h.available(alice).await, (ETHER * 3 / 4).to_string());
}

/// The principal whose token the CLI ran with, per decision, from `custodian events`.
fn principals_in(events: &Value, kind: &str) -> Vec<String> {
    events
        .as_array()
        .expect("events print a JSON array")
        .iter()
        .filter(|e| e["kind"] == kind)
        .map(|e| {
            let payload = &e["payload"];
            payload
                .get("by")
                .or_else(|| payload.get("principal"))
                .or_else(|| payload.get("requested_by"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

#[tokio::test]
async fn four_eyes_through_the_cli_two_distinct_approvers_never_the_requester() {
    use crate::harness::{custodian_as, token};
    use custodian_api::tokens::Scope;
    let h = Harness::start(&[]).await;
    h.funded_account("alice", 10 * ETHER).await;
    let url = h.db.url.expose().to_owned();
    let ops = token(&h.db, "ops", &[Scope::Admin]).await;
    // the client may also approve: its own request is what it must never approve
    let app = token(&h.db, "wallet-app", &[Scope::Withdraw, Scope::Approve]).await;
    let dana = token(&h.db, "dana", &[Scope::Approve]).await;
    let erin = token(&h.db, "erin", &[Scope::Approve]).await;

    let no_scope =
        custodian_as(&url, &app, &["withdrawals", "limit", "--asset", "ETH", "--amount", "1", "--approvals", "2"]);
    assert_eq!(no_scope.code, 2, "limits need admin: {}", no_scope.stderr);
    let set = custodian_as(
        &url,
        &ops,
        &["withdrawals", "limit", "--asset", "ETH", "--amount", "1", "--approvals", "2", "--json"],
    );
    assert_eq!(set.code, 0, "{}", set.stderr);
    assert_eq!(set.json()["approvals_required"], 2);
    assert_eq!(set.json()["approval_limit"], "1");

    let requested = custodian_as(
        &url,
        &app,
        &[
            "withdraw",
            "--account",
            "alice",
            "--external-id",
            "big-1",
            "--asset",
            "ETH",
            "--to",
            &destination(51),
            "--amount",
            "2",
            "--json",
        ],
    );
    assert_eq!(requested.code, 0, "{}", requested.stderr);
    assert_eq!(requested.json()["withdrawal"]["state"], "awaiting_approval");
    assert_eq!(requested.json()["withdrawal"]["requested_by"], "wallet-app");
    let id = requested.json()["withdrawal"]["id"].as_i64().unwrap().to_string();

    let own = custodian_as(&url, &app, &["withdrawals", "approve", "--id", &id]);
    assert_eq!(own.code, 2, "self-approval is refused: {}", own.stderr);
    assert!(own.stderr.contains("may not approve"), "{}", own.stderr);
    let anonymous = crate::harness::custodian(&url, &["withdrawals", "approve", "--id", &id]);
    assert_eq!(anonymous.code, 2, "{}", anonymous.stderr);

    let first = custodian_as(&url, &dana, &["withdrawals", "approve", "--id", &id, "--json"]);
    assert_eq!(first.code, 0, "{}", first.stderr);
    assert_eq!(first.json()["withdrawal"]["state"], "awaiting_approval", "one of two");
    let twice = custodian_as(&url, &dana, &["withdrawals", "approve", "--id", &id, "--json"]);
    assert_eq!((twice.code, twice.json()["recorded_now"].clone()), (0, json!(false)), "the same token counts once");
    assert_eq!(twice.json()["withdrawal"]["state"], "awaiting_approval");
    let worker = h.worker(config(1));
    assert_eq!(worker.pass().await.unwrap().signed, 0, "nothing is signed before the second approval");
    let second = custodian_as(&url, &erin, &["withdrawals", "approve", "--id", &id, "--json"]);
    assert_eq!(second.code, 0, "{}", second.stderr);
    assert_eq!(second.json()["withdrawal"]["state"], "requested");
    assert_eq!(second.json()["withdrawal"]["approvers"], json!(["dana", "erin"]));
    h.work_until(&worker, false, "confirmation", |h| {
        let id: i64 = id.parse().unwrap();
        Box::pin(async move { h.state(id).await == WithdrawalState::Confirmed })
    })
    .await;

    // Through the API too: the requester's token is refused with PERMISSION_DENIED (api tests).
    // A fact settles once every older transaction on the server has ended (parallel tests hold
    // some open), so wait until the history holds the last decision.
    let events = eventually("the history to settle", Duration::from_secs(30), || async {
        let run = crate::harness::custodian(&url, &["events", "--json"]);
        assert_eq!(run.code, 0, "{}", run.stderr);
        let events = run.json();
        (principals_in(&events, "withdrawal_approved").len() == 2).then_some(events)
    })
    .await;
    assert_eq!(principals_in(&events, "withdrawal_requested"), ["wallet-app"]);
    assert_eq!(principals_in(&events, "withdrawal_approved"), ["dana", "erin"]);
    assert_eq!(principals_in(&events, "operator_limit_set"), ["ops"]);
    assert_eq!(principals_in(&events, "operator_lane_added"), ["ops", "ops"]);
    h.verify().await;
}

#[tokio::test]
async fn a_request_past_the_daily_total_waits_for_approval_instead_of_being_refused() {
    use crate::harness::{custodian_as, token};
    use custodian_api::tokens::Scope;
    let h = Harness::start(&[]).await;
    let alice = h.funded_account("alice", 10 * ETHER).await;
    let url = h.db.url.expose().to_owned();
    let ops = token(&h.db, "ops", &[Scope::Admin]).await;
    let set = custodian_as(&url, &ops, &["withdrawals", "limit", "--asset", "ETH", "--daily", "1", "--approvals", "1"]);
    assert_eq!(set.code, 0, "{}", set.stderr);
    let first = h.request(alice, "d-1", &destination(52), 6 * ETHER / 10).await.unwrap().withdrawal;
    assert_eq!(first.state(), WithdrawalState::Requested, "0.6 of a 1 ETH day");
    let second = h.request(alice, "d-2", &destination(52), 3 * ETHER / 10).await.unwrap().withdrawal;
    assert_eq!(second.state(), WithdrawalState::Requested, "0.9 of a 1 ETH day");
    let third = h.request(alice, "d-3", &destination(52), 2 * ETHER / 10).await.unwrap().withdrawal;
    assert_eq!(third.state(), WithdrawalState::AwaitingApproval, "1.1 would pass the daily total");
    let events = sql::events(&h.db.pool.get().await.unwrap(), third.id().get()).await.unwrap();
    assert!(
        events.iter().any(|e| matches!(e, custodian_domain::withdrawal::WithdrawalEvent::AwaitingApproval { reason, .. } if reason == "daily_limit")),
        "{events:?}"
    );
    // another account has a day of its own
    let bob = h.funded_account("bob", ETHER).await;
    assert_eq!(
        h.request(bob, "b-1", &destination(53), ETHER / 2).await.unwrap().withdrawal.state(),
        WithdrawalState::Requested
    );
    // cancelled withdrawals do not count towards the day
    actions::cancel(&mut h.db.pool.get().await.unwrap(), first.id().get(), "wallet-app").await.unwrap();
    let cancelled = h.event_payload(first.id().get(), "cancelled").await.expect("a cancelled event");
    assert_eq!(cancelled["by"], "wallet-app", "a cancel before signing records who cancelled");
    let fourth = h.request(alice, "d-4", &destination(52), 5 * ETHER / 10).await.unwrap().withdrawal;
    assert_eq!(fourth.state(), WithdrawalState::Requested, "0.3 + 0.2 (waiting) + 0.5 is within the day");
}
