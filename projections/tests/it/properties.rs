//! Property: whatever the order of deposits, reorgs (whose money comes back or not), blocks that
//! come back, rewinds, re-scans, posting runs, approvals and rejections, after every step each
//! deposit key's `custody` legs equal what our canonical chain holds confirmed for it (except while
//! a discrepancy is open or the loss is within its grace), nothing is credited more often than its
//! rounds allow, and `replay --verify` passes.

use bitcoin::Amount as Sats;
use custodian_domain::Chain;
use custodian_ingest::sql;
use custodian_projections::{posting, replay, reversals};
use custodian_testkit::btcsim::{AddrKind, BitcoinSim};
use custodian_testkit::db::column;
use custodian_testkit::TestDb;
use proptest::prelude::*;

use crate::support::{new_account, scan};
use std::time::Duration;

#[derive(Debug, Clone)]
enum Op {
    /// Pay watched address `to` in a new block; the amount picks a confirmation tier.
    Deposit {
        to: usize,
        sats: u64,
    },
    MineEmpty(usize),
    /// Replace the top `depth` blocks with `depth + 1`, re-mining the lost payments if `remine`.
    Reorg {
        depth: usize,
        remine: bool,
    },
    Rewind(u64),
    ScanAndPost,
    Post,
    /// Mine a longer branch on the `n`-th chain abandoned by a reorg: its blocks come back.
    FlipBack(usize),
    /// Decide the oldest open discrepancy: approve (debit the customer) or reject (treasury).
    Decide(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, prop_oneof![Just(60_000u64), Just(20_000_000), Just(150_000_000)])
            .prop_map(|(to, sats)| Op::Deposit { to, sats }),
        2 => (1..4usize).prop_map(Op::MineEmpty),
        2 => (1..5usize, any::<bool>()).prop_map(|(depth, remine)| Op::Reorg { depth, remine }),
        1 => (1..6u64).prop_map(Op::Rewind),
        3 => Just(Op::ScanAndPost),
        1 => Just(Op::Post),
        1 => (0..3usize).prop_map(Op::FlipBack),
        2 => any::<bool>().prop_map(Op::Decide),
    ]
}

/// Runs `ops`, posting as the service does after every scan step: a whole pass, then passes
/// since the previous one began until `whole_every` has passed (zero: every pass whole).
async fn run(ops: Vec<Op>, whole_every: Duration) {
    let mut passes = posting::ChainPasses::new(Chain::Btc, whole_every);
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let addresses = [sim.address(AddrKind::P2wpkh, 20), sim.address(AddrKind::P2pkh, 21)];
    new_account(&db, "a", &addresses[0], 0).await;
    new_account(&db, "b", &addresses[1], 0).await;
    sim.mine_empty(1);
    let mut abandoned: Vec<(bitcoin::BlockHash, u64)> = Vec::new();
    for op in ops {
        match op {
            Op::Deposit { to, sats } => {
                let tx = sim.pay(&[(addresses[to].clone(), Sats::from_sat(sats))]);
                sim.mine(&[tx]);
            }
            Op::MineEmpty(n) => {
                sim.mine_empty(n);
            }
            Op::Reorg { depth, remine } if (depth as u64) < sim.height() => {
                let lost: Vec<bitcoin::Transaction> = if remine {
                    (sim.height() + 1 - depth as u64..=sim.height())
                        .flat_map(|h| sim.block(sim.block_hash(h).unwrap()).unwrap().txdata.into_iter().skip(1))
                        .collect()
                } else {
                    Vec::new()
                };
                let mut replacement = vec![Vec::new(); depth + 1];
                replacement[0] = lost;
                abandoned.push((sim.block_hash(sim.height()).unwrap(), sim.height()));
                sim.reorg(depth, &replacement);
            }
            Op::FlipBack(n) if !abandoned.is_empty() => {
                let (tip, height) = abandoned[n % abandoned.len()];
                let blocks = usize::try_from(sim.height().saturating_sub(height)).unwrap() + 1;
                sim.mine_branch(tip, &vec![Vec::new(); blocks]);
            }
            Op::FlipBack(_) => {}
            Op::Decide(approve) => {
                let open = reversals::list(&db.pool.get().await.unwrap())
                    .await
                    .unwrap()
                    .into_iter()
                    .find(|p| p.decision.is_none() && !p.reappeared);
                if let Some(round) = open {
                    reversals::decide(&mut db.pool.get().await.unwrap(), round.id, approve, "prop", None)
                        .await
                        .unwrap();
                }
            }
            Op::Reorg { .. } => {}
            Op::Rewind(back) => {
                let mut client = db.pool.get().await.unwrap();
                if let Some(cursor) = sql::cursor(&client, Chain::Btc).await.unwrap() {
                    sql::rewind(&mut client, Chain::Btc, cursor.saturating_sub(back)).await.unwrap();
                }
            }
            Op::ScanAndPost => {
                scan(&db, &sim).await;
                passes.run(&db.pool.get().await.unwrap()).await.unwrap();
            }
            Op::Post => {
                passes.run(&db.pool.get().await.unwrap()).await.unwrap();
            }
        }
        holds_after_every_step(&db).await;
    }
    scan(&db, &sim).await;
    passes.run(&db.pool.get().await.unwrap()).await.unwrap();
    holds_after_every_step(&db).await;

    let mut client = db.pool.get().await.unwrap();
    let report = replay::verify(&mut client).await.unwrap();
    assert!(report.verified(), "replay --verify found differences: {:#?}", report.differences);
    let unbalanced: i64 = client
        .query_one(
            "select count(*) from (select transfer_id, asset from ledger_posting group by 1, 2
              having sum(case direction when 'debit' then amount else -amount end) <> 0) u",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unbalanced, 0, "every transfer balances per asset");
    // Credited once per round: a key is credited again only after a decided round took it back.
    let doubled: i64 = client
        .query_one(
            "select count(*) from (
                select t.deposit_key from ledger_transfer t where t.kind = 'deposit' group by 1
                having count(*) > 1 + (select count(*) from reversal_proposal r join reversal_decision d
                                         on d.proposal_id = r.id and d.decision in ('approved', 'rejected')
                                        where r.deposit_key = t.deposit_key)) d",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(doubled, 0, "no deposit credited more often than its rounds allow");
    let wrong_amount: i64 = client
        .query_one(
            "select count(*) from ledger_transfer t join ledger_posting p on p.transfer_id = t.id and p.direction = 'credit'
              where t.kind = 'deposit' and not exists (
                select 1 from deposit_event d where d.tx_hash = t.reference ->> 'tx_hash'
                   and d.output_index = (t.reference ->> 'output_index')::int and d.amount >= p.amount)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(wrong_amount, 0, "every credit is the observed amount");
    // Confirmed, canonical, attributed deposits are all posted once the last pass ran.
    let unposted: i64 = client
        .query_one("select count(*) from deposit_status where confirmed and account_id is not null and not posted", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(unposted, 0);
}

/// After every step: each key's custody legs are what our canonical chain holds confirmed for it,
/// unless a discrepancy is open (then the round's amount) or the loss is within its grace; never
/// more than the deposit's amount; and `replay --verify` passes.
async fn holds_after_every_step(db: &TestDb) {
    let mut client = db.pool.get().await.unwrap();
    let off: Vec<String> = column(
        &client,
        "with keys as (
                 select distinct on (s.deposit_key) s.deposit_key, s.amount, s.custody_posted,
                        bool_or(not s.orphaned and s.confirmed and s.account_id is not null)
                            over (partition by s.deposit_key) as credit_due,
                        bool_or(not s.orphaned) over (partition by s.deposit_key) as canonical
                   from deposit_status s order by s.deposit_key, s.height desc)
             select k.deposit_key || ': custody ' || k.custody_posted || ' of ' || k.amount
               from keys k
               left join deposit_lost l using (deposit_key)
              where k.custody_posted > k.amount
                 or (k.credit_due and k.custody_posted <> k.amount)
                 or (not k.canonical and k.custody_posted <> 0 and l.grace_passed
                     and not exists (select 1 from deposit_discrepancy d where d.deposit_key = k.deposit_key and d.open)
                     and not exists (select 1 from deposit_discrepancy d where d.deposit_key = k.deposit_key
                                       and d.decision = 'rejected' and d.compensating_transfer_id is null))",
        &[],
    )
    .await;
    assert!(off.is_empty(), "keys whose custody legs disagree with the chain: {off:?}");
    let report = replay::verify(&mut client).await.unwrap();
    assert!(report.verified(), "replay --verify found differences: {:#?}", report.differences);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn any_sequence_of_chain_events_ends_verified_balanced_and_credited_once(ops in proptest::collection::vec(op(), 1..14)) {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
            .block_on(run(ops, Duration::ZERO));
    }

}

proptest! {
    // More cases than above: a deposit confirmed by the tip alone, the case the pass since can
    // miss, needs a deep tier, a scan before and after, and blocks enough between; at 16 cases a
    // pass since that ignored the tip went unnoticed, at 64 it failed.
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The same, posting as the service does between whole passes: only the first pass is whole,
    /// every later one derives what changed since the previous one began, and must miss nothing.
    #[test]
    fn any_sequence_of_chain_events_ends_the_same_with_passes_since_the_previous_one(ops in proptest::collection::vec(op(), 1..14)) {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
            .block_on(run(ops, Duration::MAX));
    }
}
