//! The withdrawal pipeline under injected faults (#12's proof): two `custodian work` processes
//! talk to anvil through [`FaultyRpc`] and are SIGKILLed at seeded random moments, at least fifty
//! times, while requests arrive (each sent twice), some are cancelled, and anvil mines, reorgs
//! and drops mempool transactions. At the end the chain is walked directly (not through the
//! project's code): every request paid exactly once or cancelled with nothing paid, every lane's
//! nonces contiguous and all used, every hold settled or released, and `replay --verify` passes.
//!
//! A failure prints its seed; `CUSTODIAN_CRASH_SEED=<seed>` replays the schedule (the faults per
//! method and the chaos, kills and requests are drawn from it; process timing is the machine's).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use alloy_primitives::U256;
use custodian_domain::withdrawal::WithdrawalState;
use custodian_testkit::db::column;
use custodian_testkit::faulty::{splitmix, Fault, FaultyRpc, Schedule};
use custodian_withdrawals::{hot_wallet, sql, WorkerConfig};
use serde_json::{json, Value};

use crate::eth_harness::{Harness, ETHER, LANE_KEYS};

const REQUESTS: u64 = 40;
const KILLS: u64 = 50;

/// The test's own seeded decisions (SplitMix64, as the proxy's).
struct Rng(Mutex<u64>);

impl Rng {
    fn below(&self, n: u64) -> u64 {
        splitmix(&mut self.0.lock().unwrap()) % n.max(1)
    }
}

fn destination(i: u64) -> String {
    format!("0x{:040x}", 0xc4a5_0000u64 + i)
}

fn quantity(v: &Value) -> u64 {
    u64::from_str_radix(v.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
}

fn schedule() -> Schedule {
    let reads = [
        "eth_chainId",
        "eth_blockNumber",
        "eth_getBlockByNumber",
        "eth_getTransactionCount",
        "eth_getTransactionReceipt",
        "eth_getTransactionByHash",
        "eth_getBalance",
        "eth_getCode",
        "eth_maxPriorityFeePerGas",
        "eth_estimateGas",
    ];
    let late = Fault::Delay(Duration::from_millis(1_500));
    Schedule::new()
        .with("eth_sendRawTransaction", Fault::LoseAnswer, 80)
        .with("eth_sendRawTransaction", Fault::Drop, 30)
        .with("eth_sendRawTransaction", Fault::Error("already known"), 40)
        .with("eth_sendRawTransaction", Fault::Error("nonce too low"), 20)
        .with("eth_sendRawTransaction", Fault::Error("replacement transaction underpriced"), 30)
        .with("eth_sendRawTransaction", Fault::Error("insufficient funds for gas * price + value"), 5)
        .with("eth_sendRawTransaction", late.clone(), 20)
        .with("eth_sendRawTransaction", Fault::Http(429), 20)
        .with("eth_sendRawTransaction", Fault::Http(502), 20)
        .with_all(&reads, Fault::Drop, 15)
        .with_all(&reads, Fault::LoseAnswer, 10)
        .with_all(&reads, Fault::Http(429), 15)
        .with_all(&reads, Fault::Http(502), 15)
        .with_all(&reads, Fault::Stale(2), 40)
        .with_all(&["eth_getTransactionReceipt", "eth_getTransactionCount"], late, 10)
}

/// Resumes lanes paused because the node (falsely, by injection) said the hot wallet cannot
/// pay, as an operator would after checking its balance. Any other pause is left alone: the test
/// then fails on what it left unfinished.
async fn resume_funds_pauses(h: &Harness) {
    let mut client = h.db.pool.get().await.unwrap();
    for lane in hot_wallet::lanes(&client).await.unwrap() {
        if lane.pause_reason.as_deref().is_some_and(|r| r.starts_with("hot wallet cannot pay")) {
            hot_wallet::set_paused(&mut client, lane.lane.as_str(), None, "operator").await.unwrap();
        }
    }
}

/// Request `i`, as a client does: a lane paused by the injected "insufficient funds" refuses it
/// (nothing written) until the operator resumes the lane, so the client sends it again.
async fn request(h: &Harness, alice: i64, i: u64, amount: u128) -> custodian_withdrawals::Requested {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match h.request(alice, &format!("crash-{i}"), &destination(i), amount).await {
            Ok(requested) => return requested,
            Err(custodian_withdrawals::RequestError::LanePaused { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("request {i}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_killed_fifty_times_through_a_faulty_node_pay_every_request_exactly_once() {
    let seed = std::env::var("CUSTODIAN_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("crash test seed {seed}: replay with CUSTODIAN_CRASH_SEED={seed}");
    let started = Instant::now();
    let h = Arc::new(Harness::start(&["--no-mining"]).await);
    let alice = h.funded_account("alice", 1_000 * ETHER).await;
    let rng = Arc::new(Rng(Mutex::new(seed)));
    let proxy = FaultyRpc::start(&h.anvil.url, schedule(), seed).await.unwrap();
    let mut env: Vec<(String, String)> = vec![
        ("CUSTODIAN_DATABASE_URL".into(), h.db.url.expose().to_owned()),
        ("CUSTODIAN_ETH_RPC_URL".into(), proxy.url.clone()),
        ("CUSTODIAN_ETH_CHAIN_ID".into(), "31337".into()),
        ("CUSTODIAN_ETH_RPC_TIMEOUT_MS".into(), "1000".into()),
        ("CUSTODIAN_LOG".into(), "warn".into()),
    ];
    for (lane, key) in LANE_KEYS {
        env.push((format!("CUSTODIAN_HOT_KEY_{}", lane.to_ascii_uppercase()), key.into()));
    }
    let done = Arc::new(AtomicBool::new(false));
    let chaos_on = Arc::new(AtomicBool::new(true));

    // The chain: a block every 250 ms; now and then a reorg of one or two blocks (shallower than
    // the confirmation depth) or one of our pending transactions dropped from the mempool.
    let chain = {
        let (h, rng, done, chaos_on) = (h.clone(), rng.clone(), done.clone(), chaos_on.clone());
        tokio::spawn(async move {
            let (mut reorgs, mut drops) = (0u64, 0u64);
            while !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let _ = h.anvil.rpc("anvil_mine", json!(["0x1"])).await;
                if !chaos_on.load(Ordering::SeqCst) {
                    continue;
                }
                match rng.below(20) {
                    0 => {
                        let depth = 1 + rng.below(2);
                        if h.anvil.rpc("anvil_reorg", json!([depth, []])).await.is_ok() {
                            reorgs += 1;
                        }
                    }
                    1 | 2 => {
                        let client = h.db.pool.get().await.unwrap();
                        let hashes: Vec<String> = column(
                            &client,
                            "select a.tx_hash from withdrawal_attempt a join withdrawal w on w.id = a.withdrawal_id
                                  where w.state in ('signed', 'broadcast', 'cancel_requested') order by a.tx_hash",
                            &[],
                        )
                        .await;
                        if !hashes.is_empty() {
                            let hash = &hashes[rng.below(hashes.len() as u64) as usize];
                            if h.anvil.rpc("anvil_dropTransaction", json!([hash])).await.is_ok() {
                                drops += 1;
                            }
                        }
                    }
                    _ => {}
                }
            }
            (reorgs, drops)
        })
    };

    // Requests, each sent twice; one in seven cancelled a little later.
    let requests = {
        let (h, rng) = (h.clone(), rng.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in 0..REQUESTS {
                let amount = (1 + rng.below(50)) as u128 * ETHER / 100;
                let first = request(&h, alice, i, amount).await;
                let again = request(&h, alice, i, amount).await;
                assert!(first.created && !again.created, "the second send is the same request");
                assert_eq!(first.withdrawal.id(), again.withdrawal.id());
                ids.push((first.withdrawal.id(), destination(i), amount));
                tokio::time::sleep(Duration::from_millis(100 + rng.below(300))).await;
                if i % 7 == 3 {
                    let (id, _, _) = ids[ids.len() - 1 - rng.below(ids.len().min(3) as u64) as usize];
                    let mut client = h.db.pool.get().await.unwrap();
                    // Too late is an answer too: the payout stands.
                    let _ = custodian_withdrawals::actions::cancel(&mut client, id.get(), "alice").await;
                }
            }
            ids
        })
    };

    // Two worker slots, each a `custodian work` process killed at a random moment and restarted.
    let kills = Arc::new(AtomicU64::new(0));
    let mut slots = Vec::new();
    for _ in 0..2 {
        let (env, rng, done, kills) = (env.clone(), rng.clone(), done.clone(), kills.clone());
        slots.push(tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_custodian"));
                for (key, _) in std::env::vars() {
                    if key.starts_with("CUSTODIAN_") {
                        command.env_remove(key);
                    }
                }
                let mut child = command
                    .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                    .args(["work", "--interval-ms", "50", "--confirmations", "3", "--bump-after-blocks", "3"])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .kill_on_drop(true)
                    .spawn()
                    .expect("starting custodian work");
                tokio::time::sleep(Duration::from_millis(150 + rng.below(1_200))).await;
                child.start_kill().expect("SIGKILL");
                let _ = child.wait().await;
                kills.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    let operator = {
        let (h, done) = (h.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                resume_funds_pauses(&h).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };

    let ids = requests.await.unwrap();
    while kills.load(Ordering::SeqCst) < KILLS {
        assert!(started.elapsed() < Duration::from_secs(240), "seed {seed}: fewer than {KILLS} kills in 4 minutes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done.store(true, Ordering::SeqCst);
    for slot in slots {
        slot.await.unwrap();
    }
    operator.await.unwrap();
    let (reorgs, drops) = chain.await.unwrap();
    let killed = kills.load(Ordering::SeqCst);
    let settled_in_chaos = h.count("select count(*) from withdrawal where state in ('confirmed', 'cancelled')").await;
    let attempts = h.count("select count(*) from withdrawal_attempt").await;
    eprintln!(
        "seed {seed}: {killed} kills, {reorgs} reorgs, {drops} mempool drops, {} node calls, {settled_in_chaos} of \
         {REQUESTS} settled and {attempts} attempts signed before healing; faults {:?}",
        proxy.calls(),
        proxy.injected()
    );

    // Healed: the node answers truthfully, nothing is killed, blocks keep coming; one worker
    // finishes what the chaos left.
    proxy.set_enabled(false);
    chaos_on.store(false, Ordering::SeqCst);
    let worker = h.worker(WorkerConfig {
        confirmations: 3,
        bump_after_blocks: 3,
        chain_id: Some(31337),
        ..WorkerConfig::default()
    });
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        resume_funds_pauses(&h).await;
        worker.pass().await.unwrap();
        let open = h
            .count("select count(*) from withdrawal where state not in ('confirmed', 'cancelled', 'rejected', 'failed_onchain')")
            .await;
        if open == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "seed {seed}: {open} withdrawals unfinished after healing");
        h.mine(1).await;
    }

    // The chain, walked directly.
    let lanes = hot_wallet::lanes(&h.db.pool.get().await.unwrap()).await.unwrap();
    let ours: HashSet<String> = lanes.iter().map(|l| l.address.to_lowercase_hex()).collect();
    let head = quantity(&h.rpc("eth_blockNumber", json!([])).await);
    let mut nonces: HashMap<String, Vec<u64>> = HashMap::new();
    let mut paid: HashMap<String, Vec<U256>> = HashMap::new();
    for n in 0..=head {
        let block = h.rpc("eth_getBlockByNumber", json!([format!("0x{n:x}"), true])).await;
        for tx in block["transactions"].as_array().unwrap() {
            let from = tx["from"].as_str().unwrap().to_ascii_lowercase();
            if !ours.contains(&from) {
                continue;
            }
            nonces.entry(from.clone()).or_default().push(quantity(&tx["nonce"]));
            let to = tx["to"].as_str().unwrap_or_default().to_ascii_lowercase();
            let value = U256::from_str_radix(tx["value"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
            if to != from {
                paid.entry(to).or_default().push(value);
            } else {
                assert_eq!(value, U256::ZERO, "seed {seed}: a cancel is a zero-value transfer to ourselves");
            }
        }
    }
    for lane in &lanes {
        let mut used = nonces.remove(&lane.address.to_lowercase_hex()).unwrap_or_default();
        used.sort_unstable();
        let expected: Vec<u64> = (0..lane.next_nonce.get()).collect();
        assert_eq!(
            used, expected,
            "seed {seed}: lane {}'s nonces are contiguous and every allocated one used",
            lane.lane
        );
    }
    let client = h.db.pool.get().await.unwrap();
    let (mut confirmed, mut cancelled) = (0, 0);
    for (id, to, amount) in &ids {
        let w = sql::load(&client, id.get()).await.unwrap().unwrap();
        let payments = paid.remove(to).unwrap_or_default();
        match w.state() {
            WithdrawalState::Confirmed => {
                confirmed += 1;
                assert_eq!(payments, vec![U256::from(*amount)], "seed {seed}: withdrawal {id} paid exactly once");
            }
            WithdrawalState::Cancelled => {
                cancelled += 1;
                assert!(payments.is_empty(), "seed {seed}: cancelled withdrawal {id} paid {payments:?}");
            }
            other => panic!("seed {seed}: withdrawal {id} ended {}", other.as_str()),
        }
    }
    assert!(paid.is_empty(), "seed {seed}: payments to no request's destination: {paid:?}");
    let held: String = client
        .query_one(
            "select coalesce(sum(case direction when 'credit' then amount else -amount end), 0)::text
               from ledger_posting where ledger_account = 'withdrawal_holds'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, "0", "seed {seed}: every hold settled or released");
    h.verify().await;
    eprintln!(
        "seed {seed}: {confirmed} paid once, {cancelled} cancelled with nothing paid, in {:?}",
        started.elapsed()
    );
}
