//! Bitcoin withdrawals (DESIGN §7b): the same event streams, states and ledger movements as ETH;
//! the scarce resource is the unspent output, and the reservation plays the nonce's part.
//!
//! One pass per lane: settle (by which transaction spent the reserved coins on the canonical
//! chain, as the scanner observed it), then, unless the lane is paused, allocate-and-sign a batch,
//! sign cancel replacements, broadcast the stored bytes, and bump by replacement (BIP-125). Node
//! calls happen before or after database transactions, never inside one; what is signed is
//! stored before it is sent, and a timeout is answered by sending the same bytes again.
//!
//! The seams: [`tx`] (weights, fees, coin selection, replacement fees: pure), [`node`] (the calls
//! to Bitcoin Core and how its answers are classified), and this module (the SQL and the steps).

pub mod node;
pub mod tx;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use alloy_primitives::U256;
use bitcoin::consensus::{deserialize, serialize};
use bitcoin::{OutPoint, ScriptBuf, Transaction, Txid};
use custodian_domain::withdrawal::{AttemptKind, Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::{Amount, BlockHash, BtcAddress, BtcNetwork, Chain, ChainAddress, TxHash};
use custodian_store::pipeline::Produced;
use custodian_store::{Pipelined, Pool};
use deadpool_postgres::GenericClient;
use tokio::sync::watch;

use self::node::{BtcNode, Sent};
use self::tx::{Coin, FeeRate, P2WPKH_SCRIPT_LEN};
use crate::btc_key::{BtcHotKey, KeyPath};
use crate::hot_wallet::{self, Lane};
use crate::sql;
use crate::worker::{self, lanes, verified_request, PassReport, Recording, WorkError};

/// How BTC withdrawals are batched, priced and settled (`[btc]` in the configuration).
#[derive(Debug, Clone)]
pub struct BtcConfig {
    /// The network destinations and keys are on.
    pub network: BtcNetwork,
    /// Withdrawals one transaction pays at most.
    pub batch_max: i64,
    /// Batches (signed transactions) one allocation stores in one database transaction at most,
    /// when that many are waiting: a backlog is signed in few commits.
    pub batches_per_commit: i64,
    /// How long the oldest waiting withdrawal may wait for a batch to fill.
    pub batch_wait: Duration,
    /// `estimatesmartfee`'s confirmation target, blocks.
    pub fee_target_blocks: u16,
    /// The fee rate floor (also used when the node has no estimate).
    pub min_fee_rate: FeeRate,
    /// No attempt pays more than this rate.
    pub max_fee_rate: FeeRate,
    /// The node's incremental relay fee (Core's default: 1 sat/vB).
    pub incremental_fee_rate: FeeRate,
    /// Blocks an accepted attempt may stay unmined before a replacement is signed.
    pub bump_after_blocks: u64,
    /// Blocks on top of (and including) the mined block before a withdrawal is confirmed.
    pub confirmations: u64,
}

impl Default for BtcConfig {
    fn default() -> Self {
        BtcConfig {
            network: BtcNetwork::Mainnet,
            batch_max: 50,
            batches_per_commit: 8,
            batch_wait: Duration::from_secs(2),
            fee_target_blocks: 6,
            min_fee_rate: FeeRate::per_vb(1),
            max_fee_rate: FeeRate::per_vb(500),
            incremental_fee_rate: FeeRate::per_vb(1),
            bump_after_blocks: 3,
            confirmations: 3,
        }
    }
}

/// States in which a BTC withdrawal's spend is signed and not yet mined.
const UNMINED: [WithdrawalState; 3] =
    [WithdrawalState::Signed, WithdrawalState::Broadcast, WithdrawalState::CancelRequested];
/// Our change outputs are P2WPKH: Core's dust limit for them.
const CHANGE_DUST: u64 = 294;

/// The worker for every BTC lane it holds a key for.
pub struct BtcWorker {
    pool: Pool,
    node: BtcNode,
    keys: HashMap<String, Arc<BtcHotKey>>,
    config: BtcConfig,
    /// Per lane, the spendable coins read at a canonical tip block, less what this worker
    /// reserved since.
    coins: std::sync::Mutex<HashMap<String, (String, Vec<Coin>)>>,
    /// The node's fee estimate and the chain height it was read at: estimates move with blocks,
    /// so one read serves every allocation until the next block.
    fee: std::sync::Mutex<Option<(u64, FeeRate)>>,
    /// Lanes failing transiently, backed off.
    lane_backoff: lanes::LaneBackoff,
    /// Confirmed spends found without a canonical payout, and the tip they were first found at:
    /// only a second finding at a later tip is an alert.
    reorged: std::sync::Mutex<HashMap<i64, u64>>,
}

/// A lane's confirmed spends whose block is orphaned (within [`DEEP_REORG_WINDOW`] of the tip)
/// and whose reserved coins no payout of theirs spends on the canonical chain: the spend, its
/// withdrawals, the block and its height. ($1 lane, $2 the lowest height looked at.) From the
/// orphaned blocks (`chain_block_orphaned_height`) to the withdrawals confirmed in them
/// (`withdrawal_confirmed_block`, V16): never the lane's whole history.
const REORGED_PAST_DEPTH: &str = "
select p.spend_id, array_agg(w.id order by w.id), min(b.block_hash), min(b.height)
   from chain_block b
   join withdrawal w on w.mined_block_hash = b.block_hash and w.state = 'confirmed'
   join btc_spend_payout p on p.withdrawal_id = w.id
  where b.chain = 'btc' and b.orphaned_at is not null and b.height > $2
    and w.chain = 'btc' and w.lane = $1
    and not exists (
        select from utxo_reservation r
          join output_spend s on s.chain = 'btc' and s.tx_hash = r.tx_hash
                             and s.output_index = r.output_index
          join chain_block c on c.chain = 'btc' and c.block_hash = s.block_hash
                            and c.orphaned_at is null
          join btc_attempt a on a.tx_hash = s.spending_tx and a.spend_id = r.spend_id
         where r.spend_id = p.spend_id and a.kind <> 'cancel')
  group by p.spend_id order by p.spend_id";

/// Spends (of `$1`) one of whose reserved coins can never exist: it is change of one of our
/// transactions, and that transaction, or an unmined one whose change it spends in turn (any
/// number of generations up, stopping at a transaction mined canonically), had its coins spent on
/// the canonical chain by another transaction (a sibling, or one none of ours), so its outputs
/// were never created (a reorg after which a bump, not the original, was mined). Per spend, the
/// first such coin, the transaction that took its ancestor's place, its block and depth.
pub(crate) const VANISHED_INPUTS: &str = "
with recursive ancestry (spend_id, coin_tx, coin_index, parent_tx, parent_spend, hops) as (
    select r.spend_id, r.tx_hash, r.output_index, parent.tx_hash, parent.spend_id, 1
      from utxo_reservation r
      join btc_attempt parent on parent.tx_hash = r.tx_hash
     where r.spend_id = any($1)
  union all
    -- Up through a parent not mined canonically (none of its coins spent canonically): its own
    -- change inputs may be what vanished.
    select a.spend_id, a.coin_tx, a.coin_index, grand.tx_hash, grand.spend_id, a.hops + 1
      from ancestry a
      join utxo_reservation r on r.spend_id = a.parent_spend
      join btc_attempt grand on grand.tx_hash = r.tx_hash
     where a.hops < 16
       and not exists (select from utxo_reservation pr
                         join output_spend s on s.chain = 'btc' and s.tx_hash = pr.tx_hash
                                            and s.output_index = pr.output_index
                         join chain_block b on b.chain = 'btc' and b.block_hash = s.block_hash
                                           and b.orphaned_at is null
                        where pr.spend_id = a.parent_spend)
)
select distinct on (a.spend_id) a.spend_id, a.coin_tx, a.coin_index, s.spending_tx, b.block_hash,
       t.height - b.height + 1
  from ancestry a
  join utxo_reservation pr on pr.spend_id = a.parent_spend
  join output_spend s on s.chain = 'btc' and s.tx_hash = pr.tx_hash and s.output_index = pr.output_index
  join chain_block b on b.chain = 'btc' and b.block_hash = s.block_hash and b.orphaned_at is null
  join chain_tip t on t.chain = 'btc'
 where s.spending_tx <> a.parent_tx
 order by a.spend_id, a.hops, b.height";

/// Whether a spend of ours other than `$2`, with a withdrawal still to be mined, reserves an
/// output of transaction `$1`: a later spend spends its change. A reservation stays live until an
/// operator resolves its spend, so one of a spend that can never be mined (in review) does not
/// count.
pub(crate) const SPENT_ON: &str = "
select exists (select 1 from utxo_reservation r
                where r.chain = 'btc' and r.tx_hash = $1 and r.released_at is null and r.spend_id <> $2
                  and exists (select 1 from btc_spend_payout p join withdrawal w on w.id = p.withdrawal_id
                               where p.spend_id = r.spend_id
                                 and w.state in ('signed', 'broadcast', 'cancel_requested', 'mined')))";

/// The fee and size of each transaction of ours that spend `$1` needs mined first and that is not
/// mined on the canonical chain (none of its inputs is spent there by it): those whose outputs it
/// reserves, and, through each of these in turn, those whose outputs they reserve, any number of
/// generations up (at most 16), stopping at a transaction mined canonically. Each once.
const UNMINED_ANCESTORS: &str = "
with recursive ancestor (tx_hash, spend_id, fee, vsize, hops) as (
    select a.tx_hash, a.spend_id, a.fee, a.vsize, 1
      from utxo_reservation r
      join btc_attempt a on a.tx_hash = r.tx_hash
     where r.spend_id = $1 and r.released_at is null
       and not exists (select 1 from output_spend s
                         join chain_block b on b.chain = 'btc' and b.block_hash = s.block_hash and b.orphaned_at is null
                        where s.chain = 'btc' and s.spending_tx = a.tx_hash)
  union
    select a.tx_hash, a.spend_id, a.fee, a.vsize, d.hops + 1
      from ancestor d
      join utxo_reservation r on r.spend_id = d.spend_id and r.released_at is null
      join btc_attempt a on a.tx_hash = r.tx_hash
     where d.hops < 16
       and not exists (select 1 from output_spend s
                         join chain_block b on b.chain = 'btc' and b.block_hash = s.block_hash and b.orphaned_at is null
                        where s.chain = 'btc' and s.spending_tx = a.tx_hash)
)
select distinct tx_hash, fee, vsize from ancestor";

/// A withdrawal still holding its customer's funds and not yet in review: what an alert about its
/// spend sends to review.
fn open_holding(w: &Withdrawal) -> bool {
    w.state() != WithdrawalState::NeedsReview && w.holds_funds()
}

/// How far below the tip a confirmed payout's orphaned block is still looked at: the scanner's
/// reorg window (its default `retention_blocks`); a fork deeper than that stops the scanner.
const DEEP_REORG_WINDOW: u64 = 1024;

/// A spend with open withdrawals: its id and its withdrawals, the first of which stands for all
/// (every event of a spend is appended to each of its withdrawals alike).
struct OpenSpend {
    id: i64,
    withdrawals: Vec<i64>,
}

/// One lane's turn in a pass, at one height: what allocating, cancelling and bumping work from.
#[derive(Clone, Copy)]
struct LaneTurn<'a> {
    lane: &'a Lane<BtcAddress>,
    key: &'a BtcHotKey,
    /// The chain height the pass works at.
    tip: u64,
    /// The fee rate for that height.
    rate: FeeRate,
}

/// A signed attempt as stored.
struct StoredAttempt {
    raw: Vec<u8>,
    fee: u64,
    vsize: u64,
    kind: AttemptKind,
    change_output: Option<usize>,
    change_index: Option<i32>,
}

fn sat(amount: &U256) -> u64 {
    u64::try_from(*amount).expect("BUG: a BTC amount beyond 21 million coins")
}

fn units(sat: u64) -> Amount {
    Amount::from_units(U256::from(sat))
}

fn path_of(change_index: Option<i32>) -> KeyPath {
    change_index.map_or(KeyPath::Funding, |i| KeyPath::Change(u32::try_from(i).expect("BUG: negative change index")))
}

/// Splits `fee` across outputs by weight, the remainder to the first: integers that sum to `fee`.
pub fn fee_shares(fee: u64, weights: &[u64]) -> Vec<u64> {
    let total: u128 = weights.iter().map(|w| u128::from(*w)).sum::<u128>().max(1);
    let mut shares: Vec<u64> = weights
        .iter()
        .map(|w| u64::try_from(u128::from(fee) * u128::from(*w) / total).expect("BUG: a share exceeds the fee"))
        .collect();
    let rest = fee - shares.iter().sum::<u64>();
    if let Some(first) = shares.first_mut() {
        *first += rest;
    }
    shares
}

/// The lane's row, its BTC wallet's change cursor, the canonical tip block, and the oldest
/// requested withdrawals of the lane no other worker holds (in the order of the queue's index,
/// `withdrawal_requested`, `migrations/V10__requested_queue.sql`), each with its whole event stream and
/// whether it has waited `$3` milliseconds ($1 lane, $2 at most).
const LOCK_LANE_AND_WITHDRAWALS: &str = "
with lane as (
    select h.address, h.paused_at is not null as paused, b.next_change_index, h.shortage
      from hot_wallet h join btc_hot_wallet b on b.chain = h.chain and b.lane = h.lane
     where h.chain = 'btc' and h.lane = $1
       for update of h, b
), ready as (
    select id, account_id, asset, destination, amount, last_seq, requested_at from withdrawal
     where chain = 'btc' and lane = $1 and state = 'requested'
     order by requested_at, id limit $2 for update skip locked
)
select lane.address, lane.paused, lane.next_change_index, lane.shortage,
       ready.id, ready.account_id, ready.asset, ready.destination, ready.amount, ready.last_seq,
       stream.types, stream.payloads,
       (select b.block_hash from chain_block b where b.chain = 'btc' and b.orphaned_at is null
         order by b.height desc limit 1) as tip_hash,
       ready.requested_at <= now() - $3::bigint * interval '1 millisecond' as due
  from lane left join ready on true
 left join lateral (
        select array_agg(e.event_type order by e.seq) as types, array_agg(e.payload order by e.seq) as payloads
          from withdrawal_event e where e.withdrawal_id = ready.id
      ) stream on true
 order by ready.requested_at, ready.id";

/// The lane's spendable coins ($1 lane), largest first (among equals, the first observed), at most
/// $2 of them. Spendable means what the view `btc_lane_coin` (`migrations/V5__withdrawals.sql`)
/// calls `spendable`: an unspent output on the canonical chain at one of the lane's addresses, not
/// reserved by a live spend, and either our own change (a `btc_attempt` made it) or, at the funding
/// address, a deposit the ledger credited. The test
/// `the_worker_spends_what_the_lane_view_calls_spendable_largest_first` holds the two to the same
/// answer.
///
/// The rule is restated here rather than read from the view so that it is applied after the sort
/// and only until the limit is reached: filtering the view by its `state` decides the state (an
/// index probe or two per coin) of every coin of the lane before any is sorted, 60–90 ms for
/// 10,000 coins under the lane lock in the BTC allocation bench. Here the outputs are joined and
/// sorted first (the `offset 0` keeps the filter out of the sorted subquery, whose order the outer
/// `order by` reuses), and the probes stop at the limit. The tie-break is the observation's id,
/// an integer, where the tx hash's text compared by collation cost as much as the join.
const SPENDABLE: &str = "
select tx_hash, output_index, amount, change_index
  from (select d.id, d.tx_hash, d.output_index, d.amount, a.change_index
          from (select address, null::integer as change_index from btc_hot_wallet where lane = $1
                union all
                select address, derivation_index from btc_change_address where lane = $1) a
          join unspent_output d on d.chain = 'btc' and d.address = a.address
         order by d.amount desc, d.id
        offset 0) c
 where not exists (select 1 from utxo_reservation r
                    where r.chain = 'btc' and r.tx_hash = c.tx_hash and r.output_index = c.output_index
                      and r.released_at is null)
   and case when c.change_index is not null then exists (select 1 from btc_attempt t where t.tx_hash = c.tx_hash)
            else exists (select 1 from ledger_transfer t
                          where t.deposit_key = deposit_key('btc', c.tx_hash, 'output', c.output_index)
                            and t.kind = 'deposit') end
 order by amount desc, id
 limit $2";

/// Coins read at once, at most. The read joins and sorts all of the lane's unspent outputs, but
/// decides the state of only those it returns and those it skips on the way: in the BTC
/// allocation bench's pool of 10,000 coins, 24–26 ms for 500–2,000 (pgbench, prepared, one
/// backend), where reading 5,000 through the view took 57–81 ms. Two thousand serve about ninety
/// batches of 50 of the bench's coins before the cache runs short and is read again.
const CACHED: i64 = 2_000;

/// Coins selection looks at, at most.
const CANDIDATES: usize = 500;

/// Every write of an allocation in one statement: the spend, its change address, the attempt, the
/// reservations, the payouts, the `signed` events, the projection and the change cursor. $1 lane,
/// $2 change index (null: no change), $3 change address, $4 txid, $5 raw, $6 fee, $7 vsize,
/// $8 change output, $9..$12 reserved coins (txid, vout, amount, change index), $13..$15 payouts
/// (withdrawal, output, weight), $16 seqs, $17 the `signed` event's payload (one for the whole batch:
/// every withdrawal of a batch is signed into the same transaction), $18 funding address, $19 next
/// change index.
const WRITE_ALLOCATION: &str = "
with spend as (
    insert into btc_spend (lane) values ($1) returning id
), change as (
    insert into btc_change_address (lane, derivation_index, address)
    select $1, $2, $3 where $2::int is not null
), attempt as (
    insert into btc_attempt (tx_hash, spend_id, kind, raw_tx, fee, vsize, change_output, change_index)
    select $4, spend.id, 'original', $5, $6, $7, $8, $2 from spend
), reserved as (
    insert into utxo_reservation (tx_hash, output_index, spend_id, amount, change_index)
    select c.tx_hash, c.vout, spend.id, c.amount, c.change_index
      from unnest($9::text[], $10::int[], $11::numeric[], $12::int[]) as c(tx_hash, vout, amount, change_index), spend
), payouts as (
    insert into btc_spend_payout (spend_id, withdrawal_id, output_index, weight)
    select spend.id, p.id, p.vout, p.weight from unnest($13::bigint[], $14::int[], $15::int[]) as p(id, vout, weight), spend
), appended as (
    insert into withdrawal_event (withdrawal_id, seq, event_type, payload)
    select e.id, e.seq, 'signed', $17::jsonb from unnest($13::bigint[], $16::int[]) as e(id, seq)
), projected as (
    update withdrawal w set state = 'signed', from_address = $18, tx_hash = $4, last_seq = e.seq, updated_at = now()
      from unnest($13::bigint[], $16::int[]) as e(id, seq)
     where w.id = any($13) and w.id = e.id
), cursor as (
    update btc_hot_wallet set next_change_index = $19 where chain = 'btc' and lane = $1
)
select id from spend";

/// The lane's spendable candidates, largest first.
async fn read_coins(
    tx: &Pipelined,
    spendable: &tokio_postgres::Statement,
    lane: &str,
) -> Result<Vec<Coin>, tokio_postgres::Error> {
    Ok(tx
        .query(spendable, &[&lane, &CACHED])
        .await?
        .iter()
        .map(|r| Coin {
            outpoint: OutPoint {
                txid: r.get::<_, &str>(0).parse().expect("BUG: a stored txid is hex"),
                vout: u32::try_from(r.get::<_, i32>(1)).expect("BUG: negative output index"),
            },
            amount: sat(&r.get::<_, U256>(2)),
            path: path_of(r.get(3)),
        })
        .collect())
}

/// The longest oldest-first prefix of `ready` the coins cover, with its selection: never a
/// partial payment.
fn choose(coins: &[Coin], ready: &[(Withdrawal, ScriptBuf)], rate: FeeRate) -> Option<(usize, tx::Selection)> {
    let coins = &coins[..coins.len().min(CANDIDATES)];
    (1..=ready.len()).rev().find_map(|take| {
        let payouts: Vec<(usize, u64)> =
            ready[..take].iter().map(|(w, script)| (script.len(), sat(&w.amount().units()))).collect();
        tx::select(coins, &payouts, rate, CHANGE_DUST).map(|selection| (take, selection))
    })
}

/// Why the lane cannot pay `oldest_first` (the batch's amounts, oldest first) from `coins` (the
/// spendable coins read, largest first): what the coins selection looks at hold, and what the
/// oldest withdrawal needs. Selection looks at the largest [`CANDIDATES`] only, and a read stops at
/// [`CACHED`]: past those, the text names the largest coins and not the lane's whole balance.
fn shortage_text(coins: &[Coin], oldest_first: &[u64]) -> String {
    let needed = oldest_first.first().copied().unwrap_or(0);
    let looked_at = &coins[..coins.len().min(CANDIDATES)];
    let held: u64 = looked_at.iter().map(|c| c.amount).sum();
    if looked_at.len() == coins.len() && i64::try_from(coins.len()).unwrap_or(i64::MAX) < CACHED {
        format!(
            "{held} spendable satoshis in {} coins do not pay even the oldest withdrawal ({needed} satoshis plus fee)",
            coins.len()
        )
    } else {
        format!(
            "the largest {} spendable coins, {held} satoshis (a batch spends from these only), do not pay even the \
             oldest withdrawal ({needed} satoshis plus fee)",
            looked_at.len()
        )
    }
}

/// A verified withdrawal and the script its output pays.
type Payable = (Withdrawal, ScriptBuf);

/// `rows` (the lock's, withdrawal columns from 4) checked against their event streams and their
/// destinations read again against `network` (a row written by hand may name another's): those
/// that may be signed, in order, and those that may not, with why.
fn verify_rows(rows: &[&tokio_postgres::Row], network: BtcNetwork) -> (Vec<Payable>, Vec<(i64, String)>) {
    let mut ready = Vec::with_capacity(rows.len());
    let mut tampered = Vec::new();
    for row in rows {
        match verified_request(row, 4) {
            Ok(w) => match BtcAddress::parse(&w.destination().stored(), network) {
                Ok(destination) => ready.push((w, destination.as_bitcoin().script_pubkey())),
                Err(e) => {
                    tampered.push((w.id().get(), format!("its destination cannot be paid: {e}; nothing was signed")))
                }
            },
            Err((id, reason)) => tampered.push((id, reason)),
        }
    }
    (ready, tampered)
}

/// One batch's share of an allocation: the first `take` withdrawals of its batch, paid by `spent`
/// with `change` back to us and `fee` to the network.
struct Plan {
    take: usize,
    spent: Vec<Coin>,
    change: Option<u64>,
    fee: u64,
}

impl Plan {
    /// The plan `selection` (of `coins`) makes, with its coins taken out of `coins`.
    fn take(coins: &mut Vec<Coin>, take: usize, selection: &tx::Selection) -> Plan {
        let spent: Vec<Coin> = selection.coins.iter().map(|i| coins[*i].clone()).collect();
        let reserved: HashSet<OutPoint> = spent.iter().map(|c| c.outpoint).collect();
        coins.retain(|c| !reserved.contains(&c.outpoint));
        Plan { take, spent, change: selection.change, fee: selection.fee }
    }
}

/// A signed batch and every value its row of [`WRITE_ALLOCATION`] stores.
struct SignedBatch {
    change_index: Option<i32>,
    change_address: Option<String>,
    txid: String,
    raw: Vec<u8>,
    fee: U256,
    vsize: i32,
    change_output: Option<i32>,
    coin_txids: Vec<String>,
    coin_vouts: Vec<i32>,
    coin_amounts: Vec<U256>,
    coin_paths: Vec<Option<i32>>,
    ids: Vec<i64>,
    vouts: Vec<i32>,
    weights: Vec<i32>,
    seqs: Vec<i32>,
    payload: serde_json::Value,
    next_change: i32,
}

impl SignedBatch {
    /// Pays `ready` from `plan`'s coins, change (if any) to change address `change_index`, signed
    /// with `key`, leaving the lane's change cursor at `next_change`; each withdrawal's `signed`
    /// event says `from` and the height `tip`.
    fn sign(
        key: &BtcHotKey,
        ready: &[(Withdrawal, ScriptBuf)],
        plan: &Plan,
        (change_index, next_change): (Option<i32>, i32),
        from: &BtcAddress,
        tip: u64,
    ) -> SignedBatch {
        let mut outputs: Vec<bitcoin::TxOut> =
            ready.iter().map(|(w, script)| tx::pay(script.clone(), sat(&w.amount().units()))).collect();
        let change_address = change_index.map(|i| key.change_address(u32::try_from(i).expect("BUG: negative index")));
        if let (Some(change), Some(address)) = (plan.change, &change_address) {
            outputs.push(tx::pay(address.script_pubkey(), change));
        }
        let spent_refs: Vec<&Coin> = plan.spent.iter().collect();
        let mut signed = tx::unsigned(&spent_refs, outputs);
        let prevouts: Vec<(KeyPath, bitcoin::Amount)> =
            plan.spent.iter().map(|c| (c.path, bitcoin::Amount::from_sat(c.amount))).collect();
        key.sign(&mut signed, &prevouts);
        let tx_hash = TxHash::Btc(signed.compute_txid());
        let payload = WithdrawalEvent::Signed {
            from_address: ChainAddress::Btc(from.clone()),
            nonce: None,
            tx_hash,
            at_block: tip,
        }
        .payload();
        let vouts: Vec<i32> = (0..ready.len()).map(|i| i32::try_from(i).expect("BUG: batch beyond i32")).collect();
        SignedBatch {
            change_index,
            change_address: change_address.as_ref().map(ToString::to_string),
            txid: tx_hash.to_string(),
            raw: serialize(&signed),
            fee: U256::from(plan.fee),
            vsize: i32::try_from(signed.vsize()).expect("BUG: a transaction beyond 2^31 vbytes"),
            change_output: plan.change.map(|_| i32::try_from(ready.len()).expect("BUG: batch beyond i32")),
            coin_txids: plan.spent.iter().map(|c| c.outpoint.txid.to_string()).collect(),
            coin_vouts: plan
                .spent
                .iter()
                .map(|c| i32::try_from(c.outpoint.vout).expect("BUG: vout beyond i32"))
                .collect(),
            coin_amounts: plan.spent.iter().map(|c| U256::from(c.amount)).collect(),
            coin_paths: plan
                .spent
                .iter()
                .map(|c| match c.path {
                    KeyPath::Funding => None,
                    KeyPath::Change(i) => Some(i32::try_from(i).expect("BUG: change index beyond i32")),
                })
                .collect(),
            ids: ready.iter().map(|(w, _)| w.id().get()).collect(),
            vouts,
            weights: ready
                .iter()
                .map(|(_, script)| i32::try_from(tx::output_weight(script.len())).expect("BUG: output weight"))
                .collect(),
            seqs: ready.iter().map(|(w, _)| w.last_seq() + 1).collect(),
            payload,
            next_change,
        }
    }

    /// [`WRITE_ALLOCATION`]'s parameters for this batch on `lane`, whose funding address is `from`.
    fn into_params(self, lane: &str, from: &str) -> custodian_store::pipeline::OwnedParams {
        vec![
            Box::new(lane.to_owned()),
            Box::new(self.change_index),
            Box::new(self.change_address),
            Box::new(self.txid),
            Box::new(self.raw),
            Box::new(self.fee),
            Box::new(self.vsize),
            Box::new(self.change_output),
            Box::new(self.coin_txids),
            Box::new(self.coin_vouts),
            Box::new(self.coin_amounts),
            Box::new(self.coin_paths),
            Box::new(self.ids),
            Box::new(self.vouts),
            Box::new(self.weights),
            Box::new(self.seqs),
            Box::new(self.payload),
            Box::new(from.to_owned()),
            Box::new(self.next_change),
        ]
    }
}

impl BtcWorker {
    /// A worker signing for `keys` (lane name → key).
    pub fn new(pool: Pool, node: BtcNode, keys: HashMap<String, Arc<BtcHotKey>>, config: BtcConfig) -> BtcWorker {
        BtcWorker {
            pool,
            node,
            keys,
            config,
            coins: std::sync::Mutex::default(),
            fee: std::sync::Mutex::default(),
            lane_backoff: lanes::LaneBackoff::default(),
            reorged: std::sync::Mutex::default(),
        }
    }

    /// The node this worker asks.
    pub fn node(&self) -> &BtcNode {
        &self.node
    }

    /// Passes every `interval` until `stopped` turns true; a pass is never cut short. Transient
    /// failures are logged and retried; returns the error retrying cannot help (a wrong key).
    pub async fn run(&self, interval: Duration, mut stopped: watch::Receiver<bool>) -> Result<(), WorkError> {
        while !*stopped.borrow() {
            match self.pass().await {
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => tracing::warn!("BTC withdrawal pass failed, retried after the interval: {e}"),
                Ok(_) => {}
            }
            tokio::select! {
                _ = stopped.changed() => {}
                _ = tokio::time::sleep(interval) => {}
            }
        }
        Ok(())
    }

    /// The height of the canonical chain as the scanner recorded it (settlement and bump ages
    /// follow what was observed; `None` before the first scan) and the BTC lanes, read in one
    /// round trip.
    async fn tip_and_lanes(&self) -> Result<(Option<u64>, Vec<Lane<BtcAddress>>), WorkError> {
        let client = self.pool.get().await?;
        let tip = async {
            let statement = client.prepare_cached("select height from chain_tip where chain = 'btc'").await?;
            client.query_opt(&statement, &[]).await
        };
        let (row, lanes) = futures::try_join!(tip, hot_wallet::lanes_on::<BtcAddress, _>(&client))?;
        Ok((row.map(|r| u64::try_from(r.get::<_, i64>(0)).expect("BUG: negative height")), lanes))
    }

    /// One pass over every BTC lane this worker holds a key for, the lanes at once and a lane
    /// failing transiently backed off, as the Ethereum worker's ([`lanes::run_at_once`]): one lane's
    /// slow node calls or database work (a coin read after a block, a lock another transaction
    /// holds) never holds up another's payouts.
    pub async fn pass(&self) -> Result<PassReport, WorkError> {
        let (Some(tip), lanes) = self.tip_and_lanes().await? else { return Ok(PassReport::default()) };
        let mut parts = Vec::new();
        for lane in lanes {
            let Some(key) = self.keys.get(lane.lane.as_str()) else { continue };
            if key.funding_address() != *lane.address.as_bitcoin() {
                return Err(WorkError::WrongKey {
                    lane: lane.lane.to_string(),
                    key_address: key.funding_address().to_string(),
                    lane_address: lane.address.to_string(),
                });
            }
            if self.lane_backoff.waiting(lane.lane.as_str()) {
                continue;
            }
            let name = lane.lane.to_string();
            parts.push((name, async move {
                let mut part = PassReport::default();
                let result = self.lane_pass(&lane, key, tip, &mut part).await;
                (part, result)
            }));
        }
        lanes::run_at_once(&self.lane_backoff, "btc", parts).await
    }

    async fn lane_pass(
        &self,
        lane: &Lane<BtcAddress>,
        key: &BtcHotKey,
        tip: u64,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        self.settle(lane, tip, report).await?;
        self.reorged_past_depth(lane, tip, report).await?;
        let paused = self
            .pool
            .get()
            .await?
            .query_one(
                "select paused_at is not null from hot_wallet where chain = 'btc' and lane = $1",
                &[&lane.lane.as_str()],
            )
            .await?
            .get::<_, bool>(0);
        if paused {
            return Ok(());
        }
        let turn = LaneTurn { lane, key, tip, rate: self.fee_rate(tip).await? };
        self.allocate_with(turn, report).await?;
        self.cancel_attempts(turn, report).await?;
        let refused = self.broadcast(lane, tip, report).await?;
        self.bump(turn, &refused, report).await?;
        Ok(())
    }

    /// [`tx::replacement_fee`] for a replacement of `attempt` (of `spend`) weighing `weight`, at
    /// least at `rate`, with the configured increment and cap, paying for `spend`'s unmined
    /// ancestors too ([`UNMINED_ANCESTORS`]: child pays for parent). A bump and a cancel alike:
    /// both spend what `spend` spends.
    async fn replacement_fee(
        &self,
        client: &deadpool_postgres::Object,
        spend: i64,
        attempt: &StoredAttempt,
        weight: u64,
        rate: FeeRate,
    ) -> Result<Option<(u64, FeeRate)>, WorkError> {
        let ancestors: Vec<tx::Ancestor> = client
            .query(UNMINED_ANCESTORS, &[&spend])
            .await?
            .iter()
            .map(|r| tx::Ancestor {
                fee: sat(&r.get::<_, U256>(1)),
                vsize: u64::try_from(r.get::<_, i32>(2)).expect("BUG: a negative vsize"),
            })
            .collect();
        let config = &self.config;
        Ok(tx::replacement_fee(
            (attempt.fee, attempt.vsize),
            &ancestors,
            weight,
            rate,
            config.incremental_fee_rate,
            config.max_fee_rate,
        ))
    }

    /// `estimatesmartfee` for the configured target, clamped to the configured floor and cap; the
    /// floor when the node has no estimate yet. Read once per chain height.
    async fn fee_rate(&self, tip: u64) -> Result<FeeRate, WorkError> {
        let known = *self.fee.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, rate)) = known.filter(|(at, _)| *at == tip) {
            return Ok(rate);
        }
        let estimate = self.node.estimate_fee_rate(self.config.fee_target_blocks).await?;
        let rate =
            estimate.unwrap_or(self.config.min_fee_rate).max(self.config.min_fee_rate).min(self.config.max_fee_rate);
        *self.fee.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((tip, rate));
        Ok(rate)
    }

    /// Only the allocate-and-sign step for one lane: what a process that dies right after
    /// committing would have done. Operators use `pass`.
    pub async fn allocate_lane(&self, lane: &str) -> Result<PassReport, WorkError> {
        let mut report = PassReport::default();
        let (Some(tip), lanes) = self.tip_and_lanes().await? else { return Ok(report) };
        if let (Some(lane), Some(key)) = (lanes.iter().find(|l| l.lane == lane), self.keys.get(lane)) {
            let turn = LaneTurn { lane, key, tip, rate: self.fee_rate(tip).await? };
            self.allocate_with(turn, &mut report).await?;
        }
        Ok(report)
    }

    /// Takes the lane's oldest requested withdrawals in batches of up to `batch_max` (a batch
    /// goes once it is full or its oldest has waited `batch_wait`), up to `batches_per_commit` of
    /// them; selects coins for each in turn, adds change, signs, and stores every batch's bytes,
    /// reservations and `signed` events in one transaction under the lane lock. What the coins
    /// cannot cover waits (oldest first) and, when that is even the oldest, the lane reports the
    /// shortage.
    async fn allocate_with(&self, turn: LaneTurn<'_>, report: &mut PassReport) -> Result<(), WorkError> {
        let LaneTurn { lane, key, tip, rate } = turn;
        let client = self.pool.get().await?;
        let wait_ms = i64::try_from(self.config.batch_wait.as_millis()).unwrap_or(i64::MAX);
        // Prepared once per connection, so none of these costs a round trip after the first batch.
        let (lock, spendable, write, set_short, clear_short) = futures::try_join!(
            client.prepare_cached(LOCK_LANE_AND_WITHDRAWALS),
            client.prepare_cached(SPENDABLE),
            client.prepare_cached(WRITE_ALLOCATION),
            client.prepare_cached(
                "update hot_wallet set shortage = $2, shortage_since = coalesce(shortage_since, now())
                  where chain = 'btc' and lane = $1 and shortage is distinct from $2"
            ),
            client.prepare_cached(
                "update hot_wallet set shortage = null, shortage_since = null where chain = 'btc' and lane = $1"
            ),
        )?;
        let batch_max = usize::try_from(self.config.batch_max.max(1)).unwrap_or(usize::MAX);
        let taken = self.config.batch_max.max(1).saturating_mul(self.config.batches_per_commit.max(1));
        // First round trip: BEGIN and the lane and withdrawal locks.
        let (tx, rows) = Pipelined::begin_with(client, &lock, &[&lane.lane.as_str(), &taken, &wait_ms]).await?;
        let Some(first) = rows.first() else {
            tx.rollback().await?;
            return Ok(());
        };
        let (address, paused, next_change, shortage, tip_hash): (String, bool, i32, Option<String>, Option<String>) =
            (first.get(0), first.get(1), first.get(2), first.get(3), first.get(12));
        let waiting: Vec<&tokio_postgres::Row> = rows.iter().filter(|r| r.get::<_, Option<i64>>(4).is_some()).collect();
        // Full batches go; a last, partial one only once its oldest has waited `batch_wait`.
        let going = waiting.len() - waiting.len() % batch_max;
        let going = match waiting.get(going) {
            Some(row) if row.get::<_, Option<bool>>(13).unwrap_or(false) => waiting.len(),
            _ => going,
        };
        if going == 0 || paused {
            tx.rollback().await?;
            return Ok(());
        }
        // The cache is keyed by the canonical tip block: a reorg, even to the same height, reads again.
        let at = tip_hash.unwrap_or_default();
        let going = &waiting[..going];
        // The first batch is checked against its event streams before anything is signed; each
        // later one while the server stores the batches before it. A row changed behind its
        // events anywhere in the allocation leaves all of it unsigned and uncommitted.
        let (oldest, tampered) = verify_rows(&going[..batch_max.min(going.len())], self.config.network);
        if !tampered.is_empty() {
            tx.rollback().await?;
            return self.review_tampered_rows(lane.lane.as_str(), going).await;
        }
        // The spendable set changes only with new blocks (and our own reservations, taken out of
        // the cache as they are made): one read serves every allocation at a tip. A cached set
        // that cannot pay is read again before the lane is called short.
        let cached = self.cached_coins(lane.lane.as_str(), &at);
        let fresh = cached.is_none();
        let mut coins = match cached {
            Some(coins) => coins,
            None => read_coins(&tx, &spendable, lane.lane.as_str()).await?,
        };
        let mut chosen = choose(&coins, &oldest, rate);
        if !fresh && chosen.as_ref().is_none_or(|(take, _)| *take < oldest.len()) {
            coins = read_coins(&tx, &spendable, lane.lane.as_str()).await?;
            chosen = choose(&coins, &oldest, rate);
        }
        let Some((take, selection)) = chosen else {
            let amounts: Vec<u64> = oldest.iter().map(|(w, _)| sat(&w.amount().units())).collect();
            let short = shortage_text(&coins, &amounts);
            tx.commit_with(&[(&set_short, &[&lane.lane.as_str(), &short])]).await?;
            if shortage.is_none() {
                tracing::error!(lane = %lane.lane, %short, "ALERT: BTC hot wallet short; its withdrawals wait");
                metrics::counter!("custodian_hot_wallet_shortages_total", "lane" => lane.lane.to_string()).increment(1);
            }
            metrics::gauge!("custodian_hot_wallet_short", "lane" => lane.lane.to_string()).set(1.0);
            report.short_lanes.push(format!("{}: {short}", lane.lane));
            return Ok(());
        };
        // Each further batch chooses from what the ones before it left, and goes only if wholly
        // paid (and only after a whole first batch): the rest waits for the next allocation, which
        // reads the coins again if it must.
        let mut left = coins;
        let more = take == oldest.len();
        let mut next_row = oldest.len();
        let mut first = Some((oldest, Plan::take(&mut left, take, &selection)));
        let was_short = shortage.is_some();
        // Second round trip: each batch's writes, sent as soon as it is signed (the server stores
        // one while the next is checked, chosen and signed), the shortage cleared if there was one,
        // and COMMIT.
        let mut change_cursor = next_change;
        let mut sizes: Vec<usize> = Vec::new();
        let network = self.config.network;
        let sign_next = || {
            let (batch, plan) = match first.take() {
                Some(first) => first,
                None if !more || next_row >= going.len() => return Produced::Done,
                None => {
                    let (batch, tampered) =
                        verify_rows(&going[next_row..(next_row + batch_max).min(going.len())], network);
                    if !tampered.is_empty() {
                        return Produced::Abandon;
                    }
                    match choose(&left, &batch, rate) {
                        Some((take, selection)) if take == batch.len() => {
                            next_row += take;
                            let plan = Plan::take(&mut left, take, &selection);
                            (batch, plan)
                        }
                        _ => return Produced::Done,
                    }
                }
            };
            let change_index = plan.change.map(|_| change_cursor);
            change_cursor += i32::from(change_index.is_some());
            let batch = &batch[..plan.take];
            sizes.push(batch.len());
            Produced::Write(
                SignedBatch::sign(key, batch, &plan, (change_index, change_cursor), &lane.address, tip)
                    .into_params(lane.lane.as_str(), &address),
            )
        };
        let lane_name: &(dyn tokio_postgres::types::ToSql + Sync) = &lane.lane.as_str();
        let clear: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [lane_name];
        let tail: &[(&tokio_postgres::Statement, custodian_store::pipeline::Params<'_>)] =
            if was_short { &[(&clear_short, &clear)] } else { &[] };
        let committed = tx.commit_produced(&write, sign_next, tail).await;
        match committed {
            Err(e) if custodian_store::is_unique_violation(&e, Some("utxo_reservation_live")) => {
                // Another worker reserved one of these coins first: the database refused the second
                // reservation. Read the coins again next time.
                self.forget_coins(lane.lane.as_str());
                tracing::info!(lane = %lane.lane, "a coin was reserved by another worker first; allocated again next pass");
                return Ok(());
            }
            Err(e) => {
                self.forget_coins(lane.lane.as_str());
                return Err(e.into());
            }
            Ok(None) => {
                // A later batch held a row changed behind its events: nothing was committed, and
                // the coins its batches took are not reserved.
                self.forget_coins(lane.lane.as_str());
                return self.review_tampered_rows(lane.lane.as_str(), going).await;
            }
            Ok(Some(_)) => {}
        }
        if was_short {
            metrics::gauge!("custodian_hot_wallet_short", "lane" => lane.lane.to_string()).set(0.0);
        }
        self.keep_coins(lane.lane.as_str(), at, left);
        for size in sizes {
            metrics::counter!("custodian_withdrawals_total", "state" => "signed").increment(size as u64);
            metrics::histogram!("custodian_btc_batch_size").record(size as f64);
            report.signed += size as u64;
        }
        Ok(())
    }

    /// Every row of an allocation that was not committed and that disagrees with its event stream
    /// goes to review, and `lane` pauses.
    async fn review_tampered_rows(&self, lane: &str, rows: &[&tokio_postgres::Row]) -> Result<(), WorkError> {
        let (_, tampered) = verify_rows(rows, self.config.network);
        crate::worker::review_tampered(&self.pool, "btc", lane, tampered).await
    }

    /// Takes the lane's cached coins if they were read at `tip` (called under the lane lock; an
    /// allocation that does not put them back leaves the next one to read them again).
    fn cached_coins(&self, lane: &str, tip: &str) -> Option<Vec<Coin>> {
        let mut cache = self.coins.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        cache.remove(lane).filter(|(at, _)| at == tip).map(|(_, coins)| coins)
    }

    fn keep_coins(&self, lane: &str, tip: String, coins: Vec<Coin>) {
        self.coins.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(lane.to_owned(), (tip, coins));
    }

    fn forget_coins(&self, lane: &str) {
        self.coins.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(lane);
    }

    /// The lane's spends with withdrawals in one of `states`, oldest first.
    async fn open_spends<C: GenericClient>(
        client: &C,
        lane: &str,
        states: &[WithdrawalState],
    ) -> Result<Vec<OpenSpend>, WorkError> {
        let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
        let rows = client
            .query(
                "select p.spend_id, array_agg(w.id order by w.id)
                   from withdrawal w join btc_spend_payout p on p.withdrawal_id = w.id
                  where w.chain = 'btc' and w.lane = $1 and w.state = any($2)
                  group by p.spend_id order by p.spend_id",
                &[&lane, &states],
            )
            .await?;
        Ok(rows.iter().map(|r| OpenSpend { id: r.get(0), withdrawals: r.get(1) }).collect())
    }

    async fn attempt<C: GenericClient>(client: &C, tx_hash: TxHash) -> Result<StoredAttempt, WorkError> {
        let tx_hash = tx_hash.to_string();
        let row = client
            .query_one(
                "select raw_tx, fee, vsize, kind, change_output, change_index from btc_attempt where tx_hash = $1",
                &[&tx_hash],
            )
            .await?;
        Ok(StoredAttempt {
            raw: row.get(0),
            fee: sat(&row.get::<_, U256>(1)),
            vsize: u64::try_from(row.get::<_, i32>(2)).expect("BUG: negative vsize"),
            kind: sql::stored_kind(row.get(3)),
            change_output: row.get::<_, Option<i32>>(4).map(|o| usize::try_from(o).expect("BUG: negative output")),
            change_index: row.get(5),
        })
    }

    /// Appends `event` to every withdrawal of `spend` that still passes `still`, in one
    /// transaction ([`worker::record_together`]): the withdrawals one transaction pays move
    /// together, so a pass that fails or stops midway never leaves some of them behind (reading
    /// the first of a spend stands for all of it). How many took it.
    async fn record_all(
        &self,
        spend: &OpenSpend,
        still: impl Fn(&Withdrawal) -> bool + Copy + Send + Sync + 'static,
        event: &WithdrawalEvent,
    ) -> Result<u64, WorkError> {
        let items = spend
            .withdrawals
            .iter()
            .map(|id| Recording { id: *id, still: Box::new(still), event: event.clone() })
            .collect();
        Ok(worker::record_together(&self.pool, items).await?.into_iter().filter(|took| *took).count() as u64)
    }

    /// Every withdrawal of `spend` that passes `still` goes to `needs_review` for `reason` (all
    /// together), and the lane pauses for `pause` (an alert stops the lane's automation) in the
    /// same transaction ([`worker::Pause`]).
    async fn review_spend(
        &self,
        lane: &Lane<BtcAddress>,
        spend: &OpenSpend,
        still: impl Fn(&Withdrawal) -> bool + Copy + Send + Sync + 'static,
        reason: &str,
        pause: &str,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        let event = WithdrawalEvent::NeedsReview { reason: reason.to_owned() };
        let items = spend
            .withdrawals
            .iter()
            .map(|id| Recording { id: *id, still: Box::new(still), event: event.clone() })
            .collect();
        let pause =
            worker::Pause { chain: "btc", lane: lane.lane.as_str(), reason: pause.to_owned(), needs_resync: false };
        let (recorded, paused) = worker::record_together_pausing(&self.pool, items, Some(&pause)).await?;
        report.needs_review += recorded.into_iter().filter(|took| *took).count() as u64;
        if paused {
            report.paused_lanes.push(lane.lane.to_string());
        }
        Ok(())
    }

    /// Confirmed payouts whose block a reorg deeper than the confirmation depth took away and
    /// whose reserved coins no payout of their spend (the original or a bump) spends on the
    /// canonical chain any more: not mined again, or a cancel or an outside transaction mined
    /// instead. The ledger says paid and the chain does not: each of the spend's withdrawals goes
    /// to `needs_review` with an alert, and the lane pauses (as ETH's `reorged_past_depth`). Only
    /// a finding made again at a later tip counts, so a payout the new branch mines again is left
    /// alone. The way out: `withdrawals rebroadcast` (the same bytes) and, once mined and buried,
    /// `withdrawals resolve --paid-by`.
    async fn reorged_past_depth(
        &self,
        lane: &Lane<BtcAddress>,
        tip: u64,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        let client = self.pool.get().await?;
        let floor = i64::try_from(tip.saturating_sub(DEEP_REORG_WINDOW)).unwrap_or(i64::MAX);
        let rows = client.query(REORGED_PAST_DEPTH, &[&lane.lane.as_str(), &floor]).await?;
        let found: Vec<(OpenSpend, String, i64)> =
            rows.iter().map(|r| (OpenSpend { id: r.get(0), withdrawals: r.get(1) }, r.get(2), r.get(3))).collect();
        // A first finding counts from the block above the one it was mined in at the least: the
        // scanner orphans a branch before it reads the new one, and a pass in between sees the
        // tip at the fork; the new branch gets a block beyond the old height to mine it again.
        let first_at = |height: i64| tip.max(u64::try_from(height).unwrap_or(0) + 1);
        let again: Vec<&(OpenSpend, String, i64)> = {
            let mut reorged = self.reorged.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // A spend no longer found is no longer suspect: a later finding starts afresh.
            reorged.retain(|spend, _| found.iter().any(|(f, _, _)| f.id == *spend));
            found
                .iter()
                .filter(|(spend, _, height)| match reorged.get(&spend.id) {
                    Some(first) => *first < tip,
                    None => {
                        reorged.insert(spend.id, first_at(*height));
                        false
                    }
                })
                .collect()
        };
        for (spend, block, height) in again {
            let reason = format!(
                "confirmed in block {block} (height {height}), but no payout of its transaction spends its reserved \
                 coins on the canonical chain at height {tip} (a reorg deeper than the confirmation depth of {})",
                self.config.confirmations
            );
            metrics::counter!("custodian_deep_reorg_alerts_total", "lane" => lane.lane.to_string()).increment(1);
            tracing::error!(lane = %lane.lane, spend = spend.id, "ALERT: {reason}");
            let confirmed = |w: &Withdrawal| w.state() == WithdrawalState::Confirmed;
            self.review_spend(lane, spend, confirmed, &reason, &format!("needs review: {reason}"), report).await?;
            self.reorged.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&spend.id);
        }
        Ok(())
    }

    /// Settles by the reserved coins: the sibling that spent them in a canonical block paid
    /// (`mined`, then after the depth `confirmed` with its share of the real fee, or `cancelled`
    /// if it was the cancel); a coin spent by a transaction of no sibling is `needs_review` and
    /// the lane pauses; a mined spend whose block left the canonical chain is `unmined`.
    async fn settle(&self, lane: &Lane<BtcAddress>, tip: u64, report: &mut PassReport) -> Result<(), WorkError> {
        let client = self.pool.get().await?;
        let open = Self::open_spends(
            &client,
            lane.lane.as_str(),
            &[
                WithdrawalState::Signed,
                WithdrawalState::Broadcast,
                WithdrawalState::CancelRequested,
                WithdrawalState::Mined,
            ],
        )
        .await?;
        if open.is_empty() {
            return Ok(());
        }
        let ids: Vec<i64> = open.iter().map(|s| s.id).collect();
        let rows = client
            .query(
                "select r.spend_id, r.tx_hash, r.output_index, s.spending_tx, b.block_hash, b.height, a.kind
                   from utxo_reservation r
                   join output_spend s on s.chain = 'btc' and s.tx_hash = r.tx_hash and s.output_index = r.output_index
                   join chain_block b on b.chain = 'btc' and b.block_hash = s.block_hash and b.orphaned_at is null
                   left join btc_attempt a on a.tx_hash = s.spending_tx and a.spend_id = r.spend_id
                  where r.spend_id = any($1) and r.released_at is null",
                &[&ids],
            )
            .await?;
        let vanished = client.query(VANISHED_INPUTS, &[&ids]).await?;
        for spend in &open {
            let mine: Vec<_> = rows.iter().filter(|r| r.get::<_, i64>(0) == spend.id).collect();
            if let Some(lost) = vanished.iter().find(|r| r.get::<_, i64>(0) == spend.id) {
                let reason = format!(
                    "coin {}:{} this withdrawal's transaction spends can never exist: the transaction that would \
                     create it was replaced by {}, mined in block {}; nothing of this transaction can be mined",
                    lost.get::<_, String>(1),
                    lost.get::<_, i32>(2),
                    lost.get::<_, String>(3),
                    lost.get::<_, String>(4),
                );
                tracing::error!(lane = %lane.lane, spend = spend.id, %reason, "ALERT: a spend lost its input");
                metrics::counter!("custodian_btc_input_lost_total", "lane" => lane.lane.to_string()).increment(1);
                let pause = format!("needs review: {reason}");
                self.review_spend(lane, spend, open_holding, &reason, &pause, report).await?;
                continue;
            }
            if let Some(outside) = mine.iter().find(|r| r.get::<_, Option<String>>(6).is_none()) {
                let reason = format!(
                    "coin {}:{} reserved for this withdrawal's transaction was spent by {}, none of ours, in block {}",
                    outside.get::<_, String>(1),
                    outside.get::<_, i32>(2),
                    outside.get::<_, String>(3),
                    outside.get::<_, String>(4),
                );
                tracing::error!(lane = %lane.lane, spend = spend.id, %reason, "ALERT: a reserved coin was spent outside the service");
                metrics::counter!("custodian_unknown_spend_total", "lane" => lane.lane.to_string()).increment(1);
                let pause = format!("a reserved coin was spent outside the service: {reason}");
                self.review_spend(lane, spend, open_holding, &reason, &pause, report).await?;
                continue;
            }
            let w = sql::load(&client, spend.withdrawals[0]).await?.expect("BUG: a listed withdrawal has no events");
            let Some(found) = mine.first() else {
                if w.state() == WithdrawalState::Mined {
                    let event = WithdrawalEvent::Unmined {
                        tx_hash: w.tx_hash().expect("BUG: mined without a hash"),
                        block_hash: w.mined_block_hash().expect("BUG: mined without a block"),
                    };
                    tracing::warn!(lane = %lane.lane, spend = spend.id, "a mined BTC spend left the canonical chain; its bytes go out again");
                    report.unmined += self.record_all(spend, |w| w.state() == WithdrawalState::Mined, &event).await?;
                }
                continue;
            };
            let tx_hash =
                TxHash::parse(Chain::Btc, found.get(3)).expect("BUG: output_spend.spending_tx is checked by the table");
            let block_hash = BlockHash::parse(Chain::Btc, found.get(4))
                .expect("BUG: chain_block.block_hash is checked by the table");
            let height: i64 = found.get(5);
            let kind: Option<AttemptKind> = found.get::<_, Option<&str>>(6).map(sql::stored_kind);
            let height = u64::try_from(height).expect("BUG: negative height");
            let same = w.state() == WithdrawalState::Mined
                && w.tx_hash() == Some(tx_hash)
                && w.mined_block_hash() == Some(block_hash);
            if !same {
                if w.state() == WithdrawalState::Mined {
                    let event = WithdrawalEvent::Unmined {
                        tx_hash: w.tx_hash().expect("BUG: mined without a hash"),
                        block_hash: w.mined_block_hash().expect("BUG: mined without a block"),
                    };
                    report.unmined += self.record_all(spend, |w| w.state() == WithdrawalState::Mined, &event).await?;
                }
                let event = WithdrawalEvent::Mined { tx_hash, block_hash, block_number: height };
                report.mined += self.record_all(spend, |w| UNMINED.contains(&w.state()), &event).await?;
            }
            if tip + 1 < height + self.config.confirmations {
                continue;
            }
            let attempt = Self::attempt(&client, tx_hash).await?;
            let mined = |w: &Withdrawal| w.state() == WithdrawalState::Mined;
            if kind == Some(AttemptKind::Cancel) {
                let event = WithdrawalEvent::Cancelled { tx_hash: Some(tx_hash), fee: units(attempt.fee), by: None };
                report.cancelled += self.record_all(spend, mined, &event).await?;
                continue;
            }
            let payouts = client
                .query(
                    "select withdrawal_id, weight from btc_spend_payout where spend_id = $1 order by output_index",
                    &[&spend.id],
                )
                .await?;
            let weights: Vec<u64> =
                payouts.iter().map(|r| u64::try_from(r.get::<_, i32>(1)).expect("BUG: weight")).collect();
            let shares: HashMap<i64, u64> =
                payouts.iter().map(|r| r.get::<_, i64>(0)).zip(fee_shares(attempt.fee, &weights)).collect();
            // Together, each with its share of the fee.
            let items = spend
                .withdrawals
                .iter()
                .map(|id| Recording {
                    id: *id,
                    still: Box::new(mined),
                    event: WithdrawalEvent::Confirmed { tx_hash, block_hash, fee: units(shares[id]) },
                })
                .collect();
            report.confirmed +=
                worker::record_together(&self.pool, items).await?.into_iter().filter(|took| *took).count() as u64;
        }
        Ok(())
    }

    /// Sends the live attempt of every signed, unmined spend (again, each pass: a transaction
    /// evicted from the mempool is simply accepted again). Returns the spends the node refused for
    /// their fee: they are bumped now.
    async fn broadcast(
        &self,
        lane: &Lane<BtcAddress>,
        tip: u64,
        report: &mut PassReport,
    ) -> Result<HashSet<i64>, WorkError> {
        let client = self.pool.get().await?;
        let mut refused = HashSet::new();
        for spend in Self::open_spends(&client, lane.lane.as_str(), &UNMINED).await? {
            let w = sql::load(&client, spend.withdrawals[0]).await?.expect("BUG: a listed withdrawal has no events");
            let Some(live) = w.live_attempt() else { continue };
            let attempt = Self::attempt(&client, live).await?;
            match self.node.send(&attempt.raw).await? {
                Sent::Accepted | Sent::AlreadyKnown => {
                    if w.state() == WithdrawalState::Signed {
                        let event = WithdrawalEvent::Broadcast { tx_hash: live, at_block: Some(tip) };
                        let still = |w: &Withdrawal| w.state() == WithdrawalState::Signed;
                        report.broadcast += self.record_all(&spend, still, &event).await?;
                    } else {
                        report.rebroadcast += 1;
                    }
                }
                Sent::Underpriced(message) => {
                    tracing::info!(lane = %lane.lane, tx = %live, %message, "the node wants a higher fee: replacing");
                    refused.insert(spend.id);
                }
                Sent::InputsMissing(message) => {
                    // Spent in a block: by one of our siblings (settled once the scanner sees the
                    // block) or by someone else (needs_review, from the same observation).
                    tracing::warn!(lane = %lane.lane, tx = %live, %message, "inputs already spent; settlement decides from the chain");
                    metrics::counter!("custodian_btc_inputs_spent_total", "lane" => lane.lane.to_string()).increment(1);
                }
                Sent::Refused(message) => {
                    tracing::error!(lane = %lane.lane, tx = %live, %message, "ALERT: the node refused a signed BTC transaction");
                    metrics::counter!("custodian_btc_broadcast_refused_total", "lane" => lane.lane.to_string())
                        .increment(1);
                }
            }
        }
        Ok(refused)
    }

    /// The coins a spend reserved, in the order of its inputs, with the key of each.
    async fn reserved<C: GenericClient>(
        client: &C,
        spend: i64,
        tx: &Transaction,
    ) -> Result<Vec<(KeyPath, bitcoin::Amount)>, WorkError> {
        let rows = client
            .query(
                "select tx_hash, output_index, amount, change_index from utxo_reservation where spend_id = $1",
                &[&spend],
            )
            .await?;
        let by_outpoint: HashMap<OutPoint, (KeyPath, bitcoin::Amount)> = rows
            .iter()
            .map(|r| {
                let outpoint = OutPoint {
                    txid: r.get::<_, &str>(0).parse::<Txid>().expect("BUG: a stored txid is hex"),
                    vout: u32::try_from(r.get::<_, i32>(1)).expect("BUG: negative vout"),
                };
                (outpoint, (path_of(r.get(3)), bitcoin::Amount::from_sat(sat(&r.get::<_, U256>(2)))))
            })
            .collect();
        Ok(tx.input.iter().map(|i| by_outpoint[&i.previous_output]).collect())
    }

    /// Replaces the live attempt of spends the node refused for their fee, or accepted
    /// `bump_after_blocks` ago and still unmined: the same inputs, the customers' outputs
    /// unchanged, the fee raised (BIP-125) and taken from change. At the cap (or with no change
    /// left to pay from) `fee_cap_reached` is recorded once and alerted.
    async fn bump(&self, turn: LaneTurn<'_>, refused: &HashSet<i64>, report: &mut PassReport) -> Result<(), WorkError> {
        let LaneTurn { lane, key, tip, rate } = turn;
        let client = self.pool.get().await?;
        for spend in Self::open_spends(&client, lane.lane.as_str(), &UNMINED).await? {
            let w = sql::load(&client, spend.withdrawals[0]).await?.expect("BUG: a listed withdrawal has no events");
            let accepted = w.state() != WithdrawalState::Signed && w.attempt_at_block().is_some();
            let aged = accepted && w.attempt_at_block().is_some_and(|at| tip >= at + self.config.bump_after_blocks);
            if w.stuck_at_cap() || !(refused.contains(&spend.id) || aged) {
                continue;
            }
            let live = w.live_attempt().expect("BUG: a signed withdrawal without a live attempt");
            // A parent the node refused for its fee is not in its mempool, nor then its child:
            // bumped all the same.
            if !refused.contains(&spend.id) && Self::spent_on(&client, lane, live, spend.id, "a bump").await? {
                continue;
            }
            let attempt = Self::attempt(&client, live).await?;
            let mut replacement: Transaction = deserialize(&attempt.raw).expect("BUG: stored bytes do not decode");
            let prevouts = Self::reserved(&client, spend.id, &replacement).await?;
            let inputs: u64 = prevouts.iter().map(|(_, a)| a.to_sat()).sum();
            let weight =
                tx::tx_weight(replacement.input.len(), replacement.output.iter().map(|o| o.script_pubkey.len()));
            let priced = self.replacement_fee(&client, spend.id, &attempt, weight, rate).await?;
            let raised = priced.and_then(|(fee, _)| {
                let change = attempt.change_output?;
                let left = replacement.output[change].value.to_sat().checked_sub(fee - attempt.fee)?;
                if left >= CHANGE_DUST {
                    replacement.output[change].value = bitcoin::Amount::from_sat(left);
                    Some((fee, Some(change)))
                } else if replacement.output.len() > 1 {
                    // What is left is dust: the change goes to the miners.
                    replacement.output.remove(change);
                    let paid: u64 = replacement.output.iter().map(|o| o.value.to_sat()).sum();
                    Some((inputs - paid, None))
                } else {
                    None
                }
            });
            let Some((fee, change_output)) = raised else {
                let event = WithdrawalEvent::FeeCapReached {
                    tx_hash: live,
                    cap: units(self.config.max_fee_rate.0),
                    at_block: tip,
                };
                let n = self.record_all(&spend, |w| !w.stuck_at_cap() && UNMINED.contains(&w.state()), &event).await?;
                if n > 0 {
                    tracing::error!(lane = %lane.lane, tx = %live, cap_sat_per_kvb = self.config.max_fee_rate.0,
                        "ALERT: a BTC spend cannot be replaced within the fee cap (or has no change to pay more from, or would pay more for its own size than the node relays)");
                    metrics::counter!("custodian_fee_cap_reached_total", "lane" => lane.lane.to_string()).increment(1);
                    report.fee_cap_reached += 1;
                }
                continue;
            };
            key.sign(&mut replacement, &prevouts);
            let change_index = change_output.and(attempt.change_index);
            let kind = attempt.kind.replaced();
            if self
                .store_replacement(lane, &spend, live, kind, &replacement, fee, change_output, change_index, None, tip)
                .await?
            {
                report.bumped += 1;
                // Sent now; if this answer is lost, the next pass sends the same bytes.
                let _ = self.node.send(&serialize(&replacement)).await;
            }
        }
        Ok(())
    }

    /// Skips replacing `spend`'s live attempt `live` (a bump or a cancel) while a later spend of
    /// ours spends its change ([`SPENT_ON`]): replaced, that change would never exist and the later spend could
    /// never be mined. A reorg sends a payout back with its change already spent; the later
    /// spend's own bump pays for both (child pays for parent).
    async fn spent_on<C: GenericClient>(
        client: &C,
        lane: &Lane<BtcAddress>,
        live: TxHash,
        spend: i64,
        what: &str,
    ) -> Result<bool, WorkError> {
        let spent: bool = client.query_one(SPENT_ON, &[&live.to_string(), &spend]).await?.get(0);
        if spent {
            tracing::info!(lane = %lane.lane, tx = %live, "{what} waits: a later spend of ours spends its change");
        }
        Ok(spent)
    }

    /// Records a replacement of `live` under the lane lock, if every withdrawal of the spend still
    /// has `live` as its live attempt (another worker may have replaced it first: then nothing is
    /// written and `false` is returned). `new_change` is a change address allocated for it.
    #[allow(clippy::too_many_arguments)]
    async fn store_replacement(
        &self,
        lane: &Lane<BtcAddress>,
        spend: &OpenSpend,
        live: TxHash,
        kind: AttemptKind,
        replacement: &Transaction,
        fee: u64,
        change_output: Option<usize>,
        change_index: Option<i32>,
        new_change: Option<(i32, String)>,
        tip: u64,
    ) -> Result<bool, WorkError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let next: i32 = tx
            .query_one(
                "select b.next_change_index from hot_wallet h join btc_hot_wallet b on b.chain = h.chain and b.lane = h.lane
                  where h.chain = 'btc' and h.lane = $1 for update of h, b",
                &[&lane.lane.as_str()],
            )
            .await?
            .get(0);
        let mut locked = Vec::new();
        for id in &spend.withdrawals {
            let w = sql::lock(&tx, *id).await?.expect("BUG: a listed withdrawal has no events");
            if w.live_attempt() != Some(live) || !UNMINED.contains(&w.state()) {
                return Ok(false);
            }
            locked.push(w);
        }
        // Again under the lane's lock, which every allocation reserving coins holds.
        if Self::spent_on(&tx, lane, live, spend.id, "a replacement").await? {
            return Ok(false);
        }
        if let Some((index, address)) = &new_change {
            if *index != next {
                return Ok(false);
            }
            tx.execute(
                "insert into btc_change_address (lane, derivation_index, address) values ($1, $2, $3)",
                &[&lane.lane.as_str(), index, address],
            )
            .await?;
            tx.execute(
                "update btc_hot_wallet set next_change_index = $2 where chain = 'btc' and lane = $1",
                &[&lane.lane.as_str(), &(index + 1)],
            )
            .await?;
        }
        let tx_hash = TxHash::Btc(replacement.compute_txid());
        let txid = tx_hash.to_string();
        tx.execute(
            "insert into btc_attempt (tx_hash, spend_id, kind, raw_tx, fee, vsize, change_output, change_index)
             values ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[
                &txid,
                &spend.id,
                &kind.as_str(),
                &serialize(replacement),
                &U256::from(fee),
                &i32::try_from(replacement.vsize()).expect("BUG: vsize beyond i32"),
                &change_output.map(|o| i32::try_from(o).expect("BUG: output beyond i32")),
                &change_index,
            ],
        )
        .await?;
        for mut w in locked {
            sql::append(&tx, &mut w, WithdrawalEvent::Bumped { tx_hash, at_block: tip }).await?;
        }
        tx.commit().await?;
        metrics::counter!("custodian_bumps_total", "lane" => lane.lane.to_string()).increment(1);
        Ok(true)
    }

    /// Signs a cancel for every spend whose withdrawal asked for one: a replacement of the same
    /// inputs paying everything, less a higher fee, to a fresh change address of ours.
    async fn cancel_attempts(&self, turn: LaneTurn<'_>, report: &mut PassReport) -> Result<(), WorkError> {
        let LaneTurn { lane, key, tip, rate } = turn;
        let client = self.pool.get().await?;
        for spend in Self::open_spends(&client, lane.lane.as_str(), &[WithdrawalState::CancelRequested]).await? {
            let w = sql::load(&client, spend.withdrawals[0]).await?.expect("BUG: a listed withdrawal has no events");
            let Some(live) = w.live_attempt() else { continue };
            let attempt = Self::attempt(&client, live).await?;
            if attempt.kind == AttemptKind::Cancel || Self::spent_on(&client, lane, live, spend.id, "a cancel").await? {
                continue;
            }
            let original: Transaction = deserialize(&attempt.raw).expect("BUG: stored bytes do not decode");
            let prevouts = Self::reserved(&client, spend.id, &original).await?;
            let inputs: u64 = prevouts.iter().map(|(_, a)| a.to_sat()).sum();
            let weight = tx::tx_weight(original.input.len(), [P2WPKH_SCRIPT_LEN]);
            let priced = self.replacement_fee(&client, spend.id, &attempt, weight, rate).await?;
            let Some((fee, _)) = priced.filter(|(fee, _)| inputs.saturating_sub(*fee) >= CHANGE_DUST) else {
                tracing::error!(lane = %lane.lane, tx = %live, "ALERT: a cancel cannot be priced within the fee cap, or its inputs cannot pay that fee (its unmined parents' share included); the original stands");
                metrics::counter!("custodian_fee_cap_reached_total", "lane" => lane.lane.to_string()).increment(1);
                continue;
            };
            let index: i32 = client
                .query_one(
                    "select next_change_index from btc_hot_wallet where chain = 'btc' and lane = $1",
                    &[&lane.lane.as_str()],
                )
                .await?
                .get(0);
            let address = key.change_address(u32::try_from(index).expect("BUG: negative index"));
            let mut cancel = original.clone();
            cancel.output = vec![tx::pay(address.script_pubkey(), inputs - fee)];
            key.sign(&mut cancel, &prevouts);
            if self
                .store_replacement(
                    lane,
                    &spend,
                    live,
                    AttemptKind::Cancel,
                    &cancel,
                    fee,
                    Some(0),
                    Some(index),
                    Some((index, address.to_string())),
                    tip,
                )
                .await?
            {
                report.cancel_attempts += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bitcoin::bip32::{DerivationPath, Xpriv};
    use custodian_testkit::db::generic_plan;
    use custodian_testkit::fixtures::stale_requested_queue;
    use custodian_testkit::TestDb;
    use std::str::FromStr;

    /// A database with one BTC lane, `b0`, its account key derived from `seed`.
    async fn lane_b0(seed: u8) -> (TestDb, BtcHotKey) {
        let db = TestDb::new().await;
        let key = add_lane(&db, "b0", seed).await;
        (db, key)
    }

    /// Registers lane `lane` with the BIP-84 regtest account key of the master seed `[seed; 32]`.
    async fn add_lane(db: &TestDb, lane: &str, seed: u8) -> BtcHotKey {
        let account = Xpriv::new_master(bitcoin::Network::Regtest, &[seed; 32])
            .unwrap()
            .derive_priv(&bitcoin::secp256k1::Secp256k1::new(), &DerivationPath::from_str("m/84'/1'/0'").unwrap())
            .unwrap();
        let key = BtcHotKey::parse(&account.to_string(), BtcNetwork::Regtest).unwrap();
        hot_wallet::add_btc(&mut db.pool.get().await.unwrap(), &key, lane, 0, "test").await.unwrap();
        key
    }

    /// The lane's batch is read from the requested queue's index whatever the statistics say: on
    /// statistics taken while most of a long history was still requested, the generic plan walked
    /// withdrawal_pkey past every signed withdrawal under the lane lock (1.0 of the lock's 1.6 ms
    /// in the BTC allocation bench, and growing with the history).
    #[tokio::test]
    async fn the_lane_lock_reads_the_oldest_requested_by_the_queue_index_after_stale_statistics() {
        let (db, key) = lane_b0(3).await;
        let destination = key.change_address(7).to_string();
        stale_requested_queue(&db.owner_client().await, ("btc", "BTC"), "b0", &destination, 20_000).await;
        let client = db.client().await;
        let plan = generic_plan(&client, LOCK_LANE_AND_WITHDRAWALS, "'b0', 50, 0").await;
        let lock = client.prepare(LOCK_LANE_AND_WITHDRAWALS).await.unwrap();
        assert!(plan.contains("using withdrawal_requested"), "the batch not read from the queue index:\n{plan}");
        assert!(!plan.contains("using withdrawal_pkey on withdrawal"), "the batch read in id order, filtered:\n{plan}");
        let ids: Vec<i64> =
            client.query(&lock, &[&"b0", &50i64, &0i64]).await.unwrap().iter().map(|r| r.get::<_, i64>(4)).collect();
        assert_eq!(ids, (2151..=2200).collect::<Vec<i64>>(), "the 50 oldest requested, in order");
    }

    /// The deep-reorg check reads the withdrawals confirmed in orphaned blocks by V16's index, not
    /// the lane's confirmed history, which only grows.
    #[tokio::test]
    async fn the_deep_reorg_check_finds_confirmed_payouts_by_their_block_not_by_the_lanes_history() {
        let (db, key) = lane_b0(4).await;
        let destination = key.change_address(7).to_string();
        db.owner_client()
            .await
            .batch_execute(&format!(
                "insert into withdrawal (id, external_id, chain, asset, destination, amount, state, lane, last_seq,
                                         mined_block_hash)
                 select n, 'c' || n, 'btc', 'BTC', '{destination}', 10000, 'confirmed', 'b0', 5,
                        lpad(to_hex(n), 64, '0')
                   from generate_series(1, 20000) n;
                 analyze withdrawal;"
            ))
            .await
            .unwrap();
        let plan = generic_plan(&db.client().await, REORGED_PAST_DEPTH, "'b0', 0").await;
        assert!(plan.contains("withdrawal_confirmed_block"), "confirmed payouts not found by their block:\n{plan}");
        assert!(!plan.contains("Seq Scan on withdrawal"), "the lane's history read whole:\n{plan}");
        assert!(!plan.contains("withdrawal_state_lane"), "the lane's confirmed history walked:\n{plan}");
    }

    /// A lane's coins are read by its addresses (`deposit_event_address_covering`), so the coin
    /// read, made with the lane locked, grows with the lane's outputs and not with every BTC
    /// output the scanner stored: here 20,000 of customers' deposits beside the lane's five.
    #[tokio::test]
    async fn the_coin_read_probes_the_lanes_addresses_instead_of_every_btc_output() {
        let (db, key) = lane_b0(4).await;
        let funding = key.funding_address().to_string();
        let block = format!("{:064x}", 0xb10c_u64);
        db.owner_client()
            .await
            .batch_execute(&format!(
                "insert into chain_block (chain, height, block_hash, parent_hash) values ('btc', 1, '{block}', '{:064x}');
                 insert into deposit_event (chain, block_hash, tx_hash, output_index, address, asset, amount, kind)
                 select 'btc', '{block}', lpad(to_hex(n), 64, '0'), 0,
                        case when n <= 5 then '{funding}' else 'bcrt1qcustomer' || n end, 'BTC', 10000, 'output'
                   from generate_series(1, 20005) n;
                 analyze deposit_event;",
                0
            ))
            .await
            .unwrap();
        let client = db.client().await;
        let plan = generic_plan(&client, SPENDABLE, "'b0', 2000").await;
        assert!(!plan.contains("Seq Scan on deposit_event"), "every BTC output walked:\n{plan}");
        assert!(plan.contains("deposit_event_address_covering"), "the lane's addresses not probed:\n{plan}");
        let lane: i64 =
            client.query_one("select count(*) from btc_lane_coin where lane = 'b0'", &[]).await.unwrap().get(0);
        assert_eq!(lane, 5, "the lane's own outputs, and only those");
    }

    /// The worker's coin read ([`SPENDABLE`]) restates the rule of the view `btc_lane_coin` so as
    /// to apply it after the sort; the two must agree on every kind of coin a lane can hold.
    /// Spendable: credited deposits at the funding address (one whose reservation was released,
    /// one whose spend was mined in a block since orphaned), and change a spend of ours made. Not:
    /// a deposit not credited yet, one reserved by a live spend, one spent on the canonical chain,
    /// one in an orphaned block, our change reserved by a live spend, an output to a change
    /// address that no spend of ours made (even with a ledger credit for it), and another lane's
    /// coin. Largest first, equal amounts in the order they were observed (not by hash), and the
    /// limit taken from the top.
    #[tokio::test]
    async fn the_worker_spends_what_the_lane_view_calls_spendable_largest_first() {
        let (db, key) = lane_b0(5).await;
        let other = add_lane(&db, "b1", 6).await;
        let funding = key.funding_address().to_string();
        let other_funding = other.funding_address().to_string();
        let (change_0, change_1) = (key.change_address(0).to_string(), key.change_address(1).to_string());
        let hash = |n: u64| format!("{n:064x}");
        let (block_1, block_2, orphan) = (hash(0xb1), hash(0xb2), hash(0xb0b));
        // (coin, address, amount, block, credited), in the order observed: each coin is output 0
        // of the transaction `hash(coin)`.
        let coins: [(u64, &str, u64, &str, bool); 14] = [
            (0xa, &funding, 50_000, &block_1, true),        // spendable
            (0xc, &funding, 70_000, &block_1, true),        // spendable, observed before 0xb
            (0xb, &funding, 70_000, &block_1, true),        // spendable
            (0xd, &funding, 90_000, &block_1, false),       // unconfirmed: not credited yet
            (0xe, &funding, 80_000, &block_1, true),        // reserved by a live spend
            (0xf, &funding, 60_000, &block_1, true),        // its reservation released: spendable
            (0x10, &change_0, 40_000, &block_2, false),     // our change (an attempt made it): spendable
            (0x11, &change_1, 45_000, &block_2, true),      // no attempt of ours made it: not custody
            (0x12, &funding, 85_000, &block_1, true),       // spent in canonical block 2
            (0x13, &funding, 30_000, &block_1, true),       // spent only in the orphaned block: spendable
            (0x14, &funding, 95_000, &orphan, true),        // in the orphaned block
            (0x15, &other_funding, 99_000, &block_1, true), // lane b1's
            (0x16, &change_0, 48_000, &block_2, false),     // our change, reserved by a live spend
            (0x17, &change_0, 35_000, &block_2, false),     // our change: spendable
        ];
        let mut sql = format!(
            "insert into chain_block (chain, height, block_hash, parent_hash, orphaned_at) values
                 ('btc', 1, '{block_1}', '{}', null), ('btc', 2, '{block_2}', '{block_1}', null),
                 ('btc', 2, '{orphan}', '{block_1}', now());
             insert into btc_change_address (lane, derivation_index, address) values ('b0', 0, '{change_0}'), ('b0', 1, '{change_1}');
             insert into btc_spend (id, lane) values (1, 'b0'), (2, 'b0'), (3, 'b0'), (4, 'b0');
             insert into btc_attempt (tx_hash, spend_id, kind, raw_tx, fee, vsize, change_output, change_index)
                  values ('{}', 2, 'original', '\\x00', 1000, 141, 0, 0), ('{}', 3, 'original', '\\x00', 1000, 141, 0, 0),
                         ('{}', 4, 'original', '\\x00', 1000, 141, 0, 0);
             insert into utxo_reservation (tx_hash, output_index, spend_id, amount, change_index, released_at)
                  values ('{}', 0, 1, 80000, null, null), ('{}', 0, 2, 60000, null, now()), ('{}', 0, 1, 48000, 0, null);
             insert into output_spend (chain, tx_hash, output_index, spending_tx, input_index, block_hash)
                  values ('btc', '{}', 0, '{}', 0, '{block_2}'), ('btc', '{}', 0, '{}', 0, '{orphan}');",
            hash(0),
            hash(0x10),
            hash(0x16),
            hash(0x17),
            hash(0xe),
            hash(0xf),
            hash(0x16),
            hash(0x12),
            hash(0x5e),
            hash(0x13),
            hash(0x5f),
        );
        for (coin, address, amount, block, credited) in coins {
            let tx = hash(coin);
            sql.push_str(&format!(
                "insert into deposit_event (chain, block_hash, tx_hash, output_index, address, asset, amount, kind)
                      values ('btc', '{block}', '{tx}', 0, '{address}', 'BTC', {amount}, 'output');"
            ));
            if credited {
                sql.push_str(&format!(
                    "begin;
                     insert into ledger_transfer (idempotency_key, kind, deposit_key)
                          values ('deposit:btc:{tx}:output:0:credit:1', 'deposit', 'deposit:btc:{tx}:output:0');
                     insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                          (currval('ledger_transfer_id_seq'), 'custody', 'BTC', 'debit', {amount}),
                          (currval('ledger_transfer_id_seq'), 'treasury', 'BTC', 'credit', {amount});
                     commit;"
                ));
            }
        }
        db.owner_client().await.batch_execute(&sql).await.unwrap();
        let client = db.client().await;
        let spendable = client.prepare(SPENDABLE).await.unwrap();
        let read = |lane: &'static str, limit: i64| {
            let (client, spendable) = (&client, &spendable);
            async move {
                client
                    .query(spendable, &[&lane, &limit])
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| (r.get::<_, String>(0), r.get::<_, i32>(1), sat(&r.get::<_, U256>(2)), r.get(3)))
                    .collect::<Vec<(String, i32, u64, Option<i32>)>>()
            }
        };
        let expected: Vec<(String, i32, u64, Option<i32>)> = [
            (0xc, 70_000, None),
            (0xb, 70_000, None),
            (0xf, 60_000, None),
            (0xa, 50_000, None),
            (0x10, 40_000, Some(0)),
            (0x17, 35_000, Some(0)),
            (0x13, 30_000, None),
        ]
        .into_iter()
        .map(|(coin, amount, change)| (hash(coin), 0, amount, change))
        .collect();
        assert_eq!(read("b0", 100).await, expected);
        assert_eq!(read("b0", 3).await, expected[..3], "the limit takes the largest");
        assert_eq!(read("b1", 100).await, [(hash(0x15), 0, 99_000, None)], "each lane its own");
        for lane in ["b0", "b1"] {
            let view: Vec<(String, u64)> = client
                .query(
                    "select tx_hash, amount from btc_lane_coin where lane = $1 and state = 'spendable' order by tx_hash",
                    &[&lane],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), sat(&r.get::<_, U256>(1))))
                .collect();
            let mut ours: Vec<(String, u64)> =
                read(lane, 100).await.into_iter().map(|(tx, _, amount, _)| (tx, amount)).collect();
            ours.sort();
            assert_eq!(view, ours, "the view and the worker disagree on what lane {lane} may spend");
        }
    }

    /// A later spend holds its parent's replacement back only while it can still be mined: one in
    /// review (it lost an input, or a coin of it was spent outside) keeps its reservation until an
    /// operator resolves it, and must not keep the parent from a bump or a cancel meanwhile.
    #[tokio::test]
    async fn a_parents_change_counts_as_spent_only_by_a_spend_still_to_be_mined() {
        let (db, key) = lane_b0(4).await;
        let destination = key.change_address(7).to_string();
        let parent = format!("{:064x}", 0xaa_u64);
        let owner = db.owner_client().await;
        owner
            .batch_execute(&format!(
                "insert into withdrawal (id, external_id, chain, asset, destination, amount, state, lane, last_seq)
                 values (1, 'parent', 'btc', 'BTC', '{destination}', 10000, 'broadcast', 'b0', 3),
                        (2, 'child', 'btc', 'BTC', '{destination}', 10000, 'broadcast', 'b0', 3);
                 insert into btc_spend (id, lane) values (1, 'b0'), (2, 'b0');
                 insert into btc_spend_payout (spend_id, withdrawal_id, output_index, weight) values (1, 1, 0, 124), (2, 2, 0, 124);
                 insert into utxo_reservation (tx_hash, output_index, spend_id, amount, change_index)
                 values ('{:064x}', 0, 1, 50000, null), ('{parent}', 1, 2, 20000, 0);",
                0xbb_u64
            ))
            .await
            .unwrap();
        let client = db.client().await;
        let spent = |spend: i64| {
            let (client, parent) = (&client, parent.clone());
            async move { client.query_one(SPENT_ON, &[&parent, &spend]).await.unwrap().get::<_, bool>(0) }
        };
        assert!(spent(1).await, "the child, broadcast, spends the parent's change");
        assert!(!spent(2).await, "a spend's own reservations do not count");
        owner.batch_execute("update withdrawal set state = 'needs_review' where id = 2").await.unwrap();
        assert!(!spent(1).await, "a child in review can never be mined");
        owner.batch_execute("update withdrawal set state = 'mined' where id = 2").await.unwrap();
        assert!(spent(1).await);
        owner.batch_execute("update utxo_reservation set released_at = now() where spend_id = 2").await.unwrap();
        assert!(!spent(1).await, "a released reservation holds nothing");
    }

    /// The shortage names what the oldest withdrawal needs (it named the smallest of the batch's)
    /// and, when the lane holds more coins than selection looks at, the largest coins and not a
    /// sum of every coin read.
    #[test]
    fn a_shortage_names_the_oldest_withdrawal_and_the_coins_selection_looked_at() {
        let coin = |n: u32, amount: u64| Coin {
            outpoint: OutPoint { txid: format!("{:064x}", 1).parse().unwrap(), vout: n },
            amount,
            path: path_of(None),
        };
        let few: Vec<Coin> = (0..3).map(|n| coin(n, 100_000)).collect();
        assert_eq!(
            shortage_text(&few, &[600_000, 10_000]),
            "300000 spendable satoshis in 3 coins do not pay even the oldest withdrawal (600000 satoshis plus fee)"
        );
        let many: Vec<Coin> =
            (0..(CANDIDATES as u32 + 100)).map(|n| coin(n, if n < 10 { 5_000 } else { 1_000 })).collect();
        assert_eq!(
            shortage_text(&many, &[900_000]),
            "the largest 500 spendable coins, 540000 satoshis (a batch spends from these only), do not pay even the \
             oldest withdrawal (900000 satoshis plus fee)"
        );
    }

    #[test]
    fn fee_shares_sum_to_the_fee() {
        assert_eq!(fee_shares(1000, &[124, 124]), vec![500, 500]);
        assert_eq!(fee_shares(1001, &[124, 124, 124]), vec![335, 333, 333]);
        assert_eq!(fee_shares(999, &[100, 300]), vec![250, 749]);
        for (fee, weights) in [(7u64, vec![1u64, 1, 1]), (12_345, vec![124, 172, 136, 124])] {
            assert_eq!(fee_shares(fee, &weights).iter().sum::<u64>(), fee);
        }
    }
}
