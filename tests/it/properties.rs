//! Property: whatever the order of deposits, reorgs, rewinds, re-scans and posting runs, the
//! ledger ends balanced, no deposit is credited twice, and `replay --verify` passes.

use bitcoin::Amount as Sats;
use custodian_domain::Chain;
use custodian_ingest::sql;
use custodian_projections::{posting, replay};
use custodian_testkit::btcsim::{AddrKind, BitcoinSim};
use custodian_testkit::TestDb;
use proptest::prelude::*;

use crate::ledger::{new_account, scan_and_post};

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
    ]
}

async fn run(ops: Vec<Op>) {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let addresses = [sim.address(AddrKind::P2wpkh, 20), sim.address(AddrKind::P2pkh, 21)];
    new_account(&db, "a", &addresses[0], 0).await;
    new_account(&db, "b", &addresses[1], 0).await;
    sim.mine_empty(1);
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
                sim.reorg(depth, &replacement);
            }
            Op::Reorg { .. } => {}
            Op::Rewind(back) => {
                let mut client = db.pool.get().await.unwrap();
                if let Some(cursor) = sql::cursor(&client, Chain::Btc).await.unwrap() {
                    sql::rewind(&mut client, Chain::Btc, cursor.saturating_sub(back)).await.unwrap();
                }
            }
            Op::ScanAndPost => {
                scan_and_post(&db, &sim).await;
            }
            Op::Post => {
                posting::post_chain(&db.pool.get().await.unwrap(), Chain::Btc).await.unwrap();
            }
        }
    }
    scan_and_post(&db, &sim).await;

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
    // Credited once: each deposit's money is credited by one transfer, for its observed amount.
    let doubled: i64 = client
        .query_one(
            "select count(*) from (
                select t.reference ->> 'tx_hash', t.reference ->> 'output_index', count(*) from ledger_transfer t
                 where t.kind = 'deposit' group by 1, 2 having count(*) > 1) d",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(doubled, 0, "no deposit credited twice");
    let wrong_amount: i64 = client
        .query_one(
            "select count(*) from ledger_transfer t join ledger_posting p on p.transfer_id = t.id and p.direction = 'credit'
              where t.kind = 'deposit' and not exists (
                select 1 from deposit_event d where d.tx_hash = t.reference ->> 'tx_hash'
                   and d.output_index = (t.reference ->> 'output_index')::int and d.amount = p.amount)",
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn any_sequence_of_chain_events_ends_verified_balanced_and_credited_once(ops in proptest::collection::vec(op(), 1..14)) {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(run(ops));
    }
}
