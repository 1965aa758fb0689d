//! Ledger projections at scale, each figure beside a ceiling measured in the same run.
//!
//! 1,000,000 deposit events over 100,000 addresses and 20,000 accounts (5 addresses each, 10
//! deposits per address, 100 per block): one account's balance query p50 and p99, a full posting
//! pass, the passes after every scan step with nothing to post (whole, and since the previous one
//! with nothing new and with 6,400 deposits within the tip's reach) beside the sequential read, and
//! `replay --verify` throughput in facts/s beside a plain sequential read of the same
//! tables over the same connection. `LEDGER_DEPOSITS` and `LEDGER_ACCOUNTS` shrink the run (`make
//! test` runs it small, so that the bench cannot stop working unseen).

use std::time::{Duration, Instant};

use custodian_domain::Chain;
use custodian_projections::{balances, posting, replay};
use custodian_testkit::TestDb;
use futures::{pin_mut, TryStreamExt};

const ADDRESSES_PER_ACCOUNT: i64 = 5;
const DEPOSITS_PER_BLOCK: i64 = 100;
const BALANCE_SAMPLES: usize = 2_000;

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// `part / whole` with two decimals, in integers.
fn ratio(part: u128, whole: u128) -> String {
    let hundredths = part * 100 / whole.max(1);
    format!("{}.{:02}", hundredths / 100, hundredths % 100)
}

fn per_second(count: u64, elapsed: Duration) -> u64 {
    (u128::from(count) * 1_000_000 / elapsed.as_micros().max(1)) as u64
}

async fn prepare(db: &TestDb, accounts: i64, deposits: i64) {
    let addresses = accounts * ADDRESSES_PER_ACCOUNT;
    let blocks = deposits / DEPOSITS_PER_BLOCK;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "insert into account (external_ref) select 'acct-' || i from generate_series(1, {accounts}) i;
             insert into wallet_address (chain, address, account_id)
             select 'eth', '0x' || lpad(to_hex(i), 40, '0'), (i - 1) % {accounts} + 1 from generate_series(1, {addresses}) i;
             insert into chain_block (chain, height, block_hash, parent_hash)
             select 'eth', h, '0x' || lpad(to_hex(h), 64, '0'), '0x' || lpad(to_hex(greatest(h - 1, 0)), 64, '0')
               from generate_series(0, {last_block}) h;
             insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
             select 'eth', '0x' || lpad(to_hex(n / {DEPOSITS_PER_BLOCK}), 64, '0'), '0xab' || lpad(to_hex(n), 62, '0'),
                    'native', 0, '0x' || lpad(to_hex(n % {addresses} + 1), 40, '0'), 'ETH', 1000000000000000 + n
               from generate_series(0, {last_deposit}) n;",
            last_block = blocks + 64,
            last_deposit = deposits - 1,
        ))
        .await
        .unwrap();
    // Statistics as autovacuum keeps them in service, gathered by the owner: `analyze` run by
    // `custodian_app` skips every table it does not own (all of them) with only a warning.
    db.owner_client().await.batch_execute("analyze").await.unwrap();
}

/// Runs the next pass of each chain, which must be `whole` or not, post nothing and find nothing
/// amiss; how long both took.
async fn passes_of_both_chains(
    client: &deadpool_postgres::Client,
    passes: &mut [posting::ChainPasses; 2],
    whole: bool,
) -> Duration {
    let started = Instant::now();
    for chain_passes in passes.iter_mut() {
        let (report, was_whole) = chain_passes.run(client).await.unwrap();
        assert_eq!(was_whole, whole);
        assert_eq!((report.posted, report.mismatches.len()), (0, 0), "everything was posted, as observed");
    }
    started.elapsed()
}

/// 63 blocks of 100 deposits of 100 ETH on top of the chain, none confirmed (64 due; the lowest has 63): the tip's
/// reach of a chain taking 100 deposits a block. How many.
async fn within_reach(db: &TestDb, deposits: i64) -> i64 {
    let first = deposits / DEPOSITS_PER_BLOCK + 65;
    db.client()
        .await
        .batch_execute(&format!(
            "insert into chain_block (chain, height, block_hash, parent_hash)
             select 'eth', h, '0x' || lpad(to_hex(h), 64, '0'), '0x' || lpad(to_hex(h - 1), 64, '0')
               from generate_series({first}, {first} + 62) h;
             insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
             select 'eth', '0x' || lpad(to_hex({first} + n / {DEPOSITS_PER_BLOCK}), 64, '0'),
                    '0xcd' || lpad(to_hex(n), 62, '0'), 'native', 0, '0x' || lpad(to_hex(n % 100 + 1), 40, '0'),
                    'ETH', 100000000000000000000 + n
               from generate_series(0, 63 * {DEPOSITS_PER_BLOCK} - 1) n;"
        ))
        .await
        .unwrap();
    63 * DEPOSITS_PER_BLOCK
}

async fn sequential_read(db: &TestDb) -> (u64, Duration) {
    let client = db.pool.get().await.unwrap();
    let started = Instant::now();
    let mut rows = 0u64;
    for table in
        ["withdrawal_event", "ledger_posting", "chain_block", "deposit_event", "ledger_transfer", "reversal_decision"]
    {
        let stream = client.query_raw(&format!("select * from {table}"), &[] as &[&str; 0]).await.unwrap();
        pin_mut!(stream);
        while stream.try_next().await.unwrap().is_some() {
            rows += 1;
        }
    }
    (rows, started.elapsed())
}

#[tokio::main]
async fn main() {
    let size = |name: &str, default: i64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (deposits, accounts) = (size("LEDGER_DEPOSITS", 1_000_000), size("LEDGER_ACCOUNTS", 20_000));
    println!("ledger: {deposits} deposit events, {} addresses, {accounts} accounts", accounts * ADDRESSES_PER_ACCOUNT);
    let db = TestDb::new().await;
    let started = Instant::now();
    prepare(&db, accounts, deposits).await;
    println!("  prepared in {:.1?}", started.elapsed());

    let client = db.pool.get().await.unwrap();
    let started = Instant::now();
    let report = posting::post_chain(&client, Chain::Eth).await.unwrap();
    let post_time = started.elapsed();
    println!(
        "  full posting pass: {} transfers ({} postings) in {post_time:.2?} = {} deposits/s",
        report.posted,
        report.posted * 2,
        per_second(report.posted, post_time)
    );
    assert_eq!(report.posted as i64, deposits, "every deposit is confirmed and attributed");
    db.owner_client().await.batch_execute("vacuum analyze").await.unwrap();

    // What a scan step of each chain costs from now on, as the service posts: a whole pass with
    // nothing to post (the first, then at least every ten minutes) ...
    let mut passes = Chain::ALL.map(|chain| posting::ChainPasses::new(chain, posting::WHOLE_PASS_EVERY));
    let steady_time = passes_of_both_chains(&client, &mut passes, true).await;
    // ... and in between, a pass since the previous one began: with nothing new (no deposit within
    // the tip's reach: the top 64 blocks are empty) ...
    let since_idle = passes_of_both_chains(&client, &mut passes, false).await;
    // ... and with a reach full of deposits still short of their count: 63 more blocks of 100
    // deposits of 100 ETH (64 confirmations due), read once as new, then as within reach.
    let reach = within_reach(&db, deposits).await;
    passes_of_both_chains(&client, &mut passes, false).await;
    let since_busy = passes_of_both_chains(&client, &mut passes, false).await;

    let mut samples = Vec::with_capacity(BALANCE_SAMPLES);
    for i in 0..BALANCE_SAMPLES {
        let account = (i as i64 * 7919) % accounts + 1;
        let started = Instant::now();
        let rows = balances::for_account(&client, account, "bench").await.unwrap();
        samples.push(started.elapsed());
        assert_eq!(rows.len(), 1);
    }
    samples.sort();
    println!(
        "  one account's balance: p50 {:.2?}, p99 {:.2?} over {BALANCE_SAMPLES} queries (target p99 < 5ms)",
        percentile(&samples, 50),
        percentile(&samples, 99)
    );

    let (scan_rows, scan_time) = sequential_read(&db).await;
    let scan_rate = per_second(scan_rows, scan_time);
    let mut client = db.pool.get().await.unwrap();
    let started = Instant::now();
    let verified = replay::verify(&mut client).await.unwrap();
    let replay_time = started.elapsed();
    assert!(verified.verified(), "{:?}", verified.differences.first());
    let replay_rate = per_second(verified.facts_read, replay_time);
    println!("  sequential read (ceiling): {scan_rows} rows in {scan_time:.2?} = {scan_rate} rows/s");
    println!(
        "  a posting pass with nothing to post, both chains (after every scan step): {steady_time:.2?} = {}x \
         the sequential read's time",
        ratio(steady_time.as_millis(), scan_time.as_millis())
    );
    println!(
        "  between whole passes, a pass since the previous one, both chains: {since_idle:.2?} with nothing new = {}x \
         the sequential read's time; {since_busy:.2?} with {reach} deposits within the tip's reach = {}x",
        ratio(since_idle.as_millis(), scan_time.as_millis()),
        ratio(since_busy.as_millis(), scan_time.as_millis())
    );
    println!("  replay --verify:           {} facts in {replay_time:.2?} = {replay_rate} facts/s", verified.facts_read);
    println!(
        "  ratio: {} of the sequential read (target >= 0.25)",
        ratio(u128::from(replay_rate), u128::from(scan_rate))
    );
}
