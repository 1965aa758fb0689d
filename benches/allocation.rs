//! Withdrawal allocation throughput: withdrawals allocated, signed and committed per second on
//! one lane at batch sizes 1 and 64, and across 4 lanes, beside a ceiling measured in the same
//! run on the same database with the same connection count: a loop of `select … for update`,
//! `update next_nonce`, `commit` on one row, with both statements prepared once, as the
//! allocator's are. Only the allocation transaction is timed (fees and chain id are fixed inputs;
//! no node is involved); the four lanes run as four tasks, as four workers would.
//!
//! Batch 1 and its ceiling alternate in rounds on the same database, so that a slow spell of the
//! machine weighs on both alike; each figure is the total count over the total time of its
//! rounds. The ceiling on four rows is printed beside the one on one row: how far the machine
//! itself lets four connections scale bounds what four lanes can.
//! `ALLOCATION_SCALE` (default 1) multiplies the counts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use alloy_primitives::U256;
use custodian_domain::withdrawal::WithdrawalState;
use custodian_domain::{AccountId, Amount, Asset, Chain, ChainAddress, EthAddress, ExternalId};
use custodian_store::Pool;
use custodian_testkit::TestDb;
use custodian_withdrawals::hot_wallet::{self, Lane};
use custodian_withdrawals::request::{self, Request};
use custodian_withdrawals::sql;
use custodian_withdrawals::worker::Pricing;
use custodian_withdrawals::{EthNode, LocalSigner, Signer, Worker, WorkerConfig};

/// anvil's dev keys 1–4 (well-known test keys).
const KEYS: [&str; 4] = [
    "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d",
    "0x5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a",
    "0x7c852118294e51e653712a81e05800f419141751be58f605c371e15141b007a6",
    "0x47e179ec197488593b187f80a00eb0da91f1c9b0b05dc5c2a8d7a1a2e1c3c1f6",
];

fn per_second(count: u64, elapsed: Duration) -> u64 {
    (u128::from(count) * 1_000_000 / elapsed.as_micros().max(1)) as u64
}

fn ratio(ours: u64, ceiling: u64) -> String {
    let hundredths = ours * 100 / ceiling.max(1);
    format!("{}.{:02}", hundredths / 100, hundredths % 100)
}

struct Setup {
    db: TestDb,
    worker: Arc<Worker>,
    lanes: Vec<Lane>,
    signers: Vec<Arc<dyn Signer>>,
}

async fn setup(lanes: usize, withdrawals: u64) -> Setup {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut signers: Vec<Arc<dyn Signer>> = Vec::new();
    let mut by_lane: HashMap<String, Arc<dyn Signer>> = HashMap::new();
    for (i, key) in KEYS.iter().take(lanes).enumerate() {
        let signer: Arc<dyn Signer> = Arc::new(LocalSigner::from_hex(key).unwrap());
        client
            .execute(
                "insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', $1, $2, 0)",
                &[&format!("{:#x}", signer.address()), &format!("lane{i}")],
            )
            .await
            .unwrap();
        by_lane.insert(format!("lane{i}"), signer.clone());
        signers.push(signer);
    }
    client
        .batch_execute(
            "insert into account (external_ref) values ('bench');
             begin;
             insert into ledger_transfer (idempotency_key, kind) values ('adj:bench', 'adjustment');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                 (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'debit', 1000000000000000000000000),
                 (currval('ledger_transfer_id_seq'), 'user:1', 'ETH', 'credit', 1000000000000000000000000);
             commit;",
        )
        .await
        .unwrap();
    for n in 0..withdrawals {
        let r = Request {
            account_id: AccountId::new(1),
            external_id: ExternalId::parse(&format!("bench-{n}")).unwrap(),
            asset: Asset::Native(Chain::Eth),
            destination: ChainAddress::Eth(EthAddress::parse(&format!("0x{:040x}", 0xbe00_0000u64 + n)).unwrap()),
            amount: Amount::from_u64(1_000 + n),
            requested_by: "bench".into(),
        };
        request::request(&db.pool, &r).await.unwrap();
    }
    // The statistics autovacuum keeps in service. Only `withdrawal`: the tables allocation
    // inserts into stay unanalysed while empty, as autovacuum leaves them (a foreign-key check
    // planned against an analysed empty table would scan it, ever slower as it fills). Run by the
    // owner: `custodian_app` may not analyse a table it does not own (a warning, nothing done).
    db.owner_client().await.batch_execute("analyze withdrawal").await.unwrap();
    let node = EthNode::new("http://127.0.0.1:9").unwrap(); // never called: pricing is given
    let worker = Arc::new(Worker::new(db.pool.clone(), node, by_lane, WorkerConfig::default()));
    let lanes = hot_wallet::lanes(&db.pool.get().await.unwrap()).await.unwrap();
    Setup { db, worker, lanes, signers }
}

const PRICING: Pricing = Pricing {
    chain_id: 31337,
    max_fee: U256::from_limbs([2_000_000_000, 0, 0, 0]),
    priority_fee: U256::from_limbs([1_000_000_000, 0, 0, 0]),
    head: 1,
};

/// Allocates, in batches of `batch`, up to `limit` of the withdrawals of `lane` still requested;
/// returns how many, and the time it took.
async fn drain(
    worker: Arc<Worker>,
    pool: Pool,
    lane: Lane,
    signer: Arc<dyn Signer>,
    batch: usize,
    limit: usize,
) -> (u64, Duration) {
    let ids = sql::in_state(&pool.get().await.unwrap(), lane.lane.as_str(), WithdrawalState::Requested, Some(limit))
        .await
        .unwrap();
    let started = Instant::now();
    let mut signed = 0;
    for chunk in ids.chunks(batch) {
        let ready: Vec<(i64, u64)> = chunk.iter().map(|id| (*id, 21_000)).collect();
        signed += worker.sign_batch(&lane, signer.as_ref(), &PRICING, &ready).await.unwrap();
    }
    (signed, started.elapsed())
}

/// The ceiling's rows: one `hot_wallet` row per connection.
async fn ceiling_rows(db: &TestDb, connections: usize) {
    let client = db.client().await;
    for i in 0..connections {
        client
            .execute(
                "insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', $1, $2, 0)",
                &[&format!("0x{:040x}", 0xce11_0000u64 + i as u64), &format!("ceiling{i}")],
            )
            .await
            .unwrap();
    }
}

/// The ceiling: lock one row, bump it, commit, `per_connection` times on each of `connections`
/// connections (one row each); returns the transactions and the time the slowest took.
async fn ceiling(db: &TestDb, connections: usize, per_connection: u64) -> (u64, Duration) {
    let ready = Arc::new(tokio::sync::Barrier::new(connections));
    let tasks: Vec<_> = (0..connections)
        .map(|i| {
            let url = db.url.clone();
            let ready = ready.clone();
            tokio::spawn(async move {
                let (mut client, connection) = url.config().connect(tokio_postgres::NoTls).await.unwrap();
                tokio::spawn(connection);
                let lane = format!("ceiling{i}");
                // Prepared once, as the allocator's statements are.
                let lock = client
                    .prepare("select next_nonce from hot_wallet where chain = 'eth' and lane = $1 for update")
                    .await
                    .unwrap();
                let bump = client
                    .prepare("update hot_wallet set next_nonce = next_nonce + 1 where chain = 'eth' and lane = $1")
                    .await
                    .unwrap();
                ready.wait().await;
                let started = Instant::now();
                for _ in 0..per_connection {
                    let tx = client.transaction().await.unwrap();
                    tx.query_one(&lock, &[&lane]).await.unwrap();
                    tx.execute(&bump, &[&lane]).await.unwrap();
                    tx.commit().await.unwrap();
                }
                started.elapsed()
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for t in tasks {
        slowest = slowest.max(t.await.unwrap());
    }
    (per_connection * connections as u64, slowest)
}

#[tokio::main]
async fn main() {
    let scale: u64 = std::env::var("ALLOCATION_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);

    let signer = LocalSigner::from_hex(KEYS[0]).unwrap();
    let started = Instant::now();
    for nonce in 0..1_000u64 {
        let tx = alloy::consensus::TxEip1559 {
            chain_id: 31337,
            nonce,
            gas_limit: 21_000,
            max_fee_per_gas: 2,
            ..Default::default()
        };
        std::hint::black_box(signer.sign(tx).unwrap());
    }
    println!("local EIP-1559 signing alone: {}/s", per_second(1_000, started.elapsed()));

    const ROUNDS: u64 = 5;
    let one = setup(1, ROUNDS * 200 * scale).await;
    ceiling_rows(&one.db, 1).await;
    let (mut ceiling_n, mut ceiling_t, mut ours_n, mut ours_t) = (0, Duration::ZERO, 0, Duration::ZERO);
    for _ in 0..ROUNDS {
        let (n, t) = ceiling(&one.db, 1, 400 * scale).await;
        (ceiling_n, ceiling_t) = (ceiling_n + n, ceiling_t + t);
        // Spawned, as the ceiling's loops are: both run on the runtime's worker threads.
        let (worker, pool, lane, signer) =
            (one.worker.clone(), one.db.pool.clone(), one.lanes[0].clone(), one.signers[0].clone());
        let limit = usize::try_from(200 * scale).unwrap();
        let (n, t) = tokio::spawn(drain(worker, pool, lane, signer, 1, limit)).await.unwrap();
        (ours_n, ours_t) = (ours_n + n, ours_t + t);
    }
    let ceiling_1 = per_second(ceiling_n, ceiling_t);
    let batch_1 = per_second(ours_n, ours_t);
    println!("allocation, one lane, one connection ({ROUNDS} alternating rounds):");
    println!("  ceiling (select for update + update + commit on one row): {ceiling_1} txn/s");
    println!(
        "  batch 1:  {ours_n} withdrawals at {batch_1}/s = {}x the ceiling (target >= 0.8)",
        ratio(batch_1, ceiling_1)
    );
    drop(one);

    let big = setup(1, 6_400 * scale).await;
    let (worker, pool, lane, signer) =
        (big.worker.clone(), big.db.pool.clone(), big.lanes[0].clone(), big.signers[0].clone());
    let (n, t) = tokio::spawn(drain(worker, pool, lane, signer, 64, usize::MAX)).await.unwrap();
    let batch_64 = per_second(n, t);
    println!("  batch 64: {n} withdrawals at {batch_64}/s = {}x the ceiling (target >= 5)", ratio(batch_64, ceiling_1));
    drop(big);

    let four = setup(4, 4_000 * scale).await;
    ceiling_rows(&four.db, 4).await;
    let (n, t) = ceiling(&four.db, 4, 1_000 * scale).await;
    let ceiling_4 = per_second(n, t);
    let started = Instant::now();
    // One task per lane, as independent workers would run them.
    let lanes: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(drain(
                four.worker.clone(),
                four.db.pool.clone(),
                four.lanes[i].clone(),
                four.signers[i].clone(),
                1,
                usize::MAX,
            ))
        })
        .collect();
    let mut total = 0;
    for lane in lanes {
        total += lane.await.unwrap().0;
    }
    let lanes_4 = per_second(total, started.elapsed());
    println!("allocation, four lanes, four connections, batch 1:");
    println!(
        "  ceiling on four rows: {ceiling_4} txn/s = {}x the ceiling on one row (the machine's own scaling)",
        ratio(ceiling_4, ceiling_1)
    );
    println!(
        "  {total} withdrawals at {lanes_4}/s = {}x the ceiling on four rows (target >= 0.8), {}x one lane at batch 1",
        ratio(lanes_4, ceiling_4),
        ratio(lanes_4, batch_1)
    );
}
