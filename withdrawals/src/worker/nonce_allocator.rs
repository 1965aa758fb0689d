//! The nonce allocator: one database transaction per lane batch that locks the lane's
//! `hot_wallet` row (its `next_nonce` is the cursor), takes the ready withdrawals still
//! `requested` that no other worker holds, assigns consecutive nonces, signs locally, and stores
//! every nonce, signed payload and `signed` event with the advanced cursor before committing. The
//! database is the only allocator: `nonce_allocation`'s primary key `(chain, from_address,
//! nonce)` is the last word on double allocation, and a nonce is consumed only by the commit that
//! stores what was signed with it. No network call happens inside the transaction; a timeout is
//! never answered by signing again (the stored bytes are what broadcast sends).

use std::collections::HashMap;

use alloy::consensus::TxEip1559;
use alloy_primitives::{TxKind, U256};
use custodian_domain::withdrawal::WithdrawalEvent;
use custodian_domain::{ChainAddress, Nonce, TxHash};
use custodian_store::Pipelined;

use super::allocation::{review_tampered, verified_request};
use super::{WorkError, Worker};
use crate::hot_wallet::Lane;
use crate::payout::{self, hex, payout_call};
use crate::signer::{SignedTx, Signer, SignerError};

/// Batches at least this large are signed on several threads (each thread takes at least
/// half of this many), so that a lane's row lock is held for less time.
const PARALLEL_SIGNING_FROM: usize = 16;

/// At most this many threads sign one batch.
const MAX_SIGNING_THREADS: usize = 4;

/// Signs `txs` in order, on as many threads as there are cores (up to
/// [`MAX_SIGNING_THREADS`]) when the batch is large enough to be worth it. The allocating
/// transaction waits on this with the lane locked, and the database is idle meanwhile.
fn sign_all(signer: &dyn Signer, txs: Vec<TxEip1559>) -> Result<Vec<SignedTx>, SignerError> {
    // Asked once: on Linux the answer reads the cgroup files, tens of microseconds a time.
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let threads = cores.min(MAX_SIGNING_THREADS).min(txs.len() / (PARALLEL_SIGNING_FROM / 2)).max(1);
    if threads == 1 {
        return txs.into_iter().map(|tx| signer.sign(tx)).collect();
    }
    let sign = |chunk: &[TxEip1559]| chunk.iter().map(|tx| signer.sign(tx.clone())).collect::<Result<Vec<_>, _>>();
    let mut chunks = txs.chunks(txs.len().div_ceil(threads));
    let first = chunks.next().expect("BUG: no chunk to sign");
    std::thread::scope(|scope| {
        let others: Vec<_> = chunks.map(|chunk| scope.spawn(move || sign(chunk))).collect();
        let mut signed = sign(first)?;
        for other in others {
            signed.extend(other.join().expect("BUG: a signing thread panicked")?);
        }
        Ok(signed)
    })
}

/// Fees and context of one allocation round, read from the node before the transaction.
#[derive(Debug, Clone, Copy)]
pub struct Pricing {
    /// EIP-155 chain id.
    pub chain_id: u64,
    /// Max fee per gas, wei.
    pub max_fee: U256,
    /// Max priority fee per gas, wei.
    pub priority_fee: U256,
    /// Chain head when signing.
    pub head: u64,
}

/// The columns of one signed batch, as arrays for set-based statements.
#[derive(Default)]
struct SignedBatch {
    ids: Vec<i64>,
    nonces: Vec<i64>,
    seqs: Vec<i32>,
    payloads: Vec<serde_json::Value>,
    hashes: Vec<String>,
    raws: Vec<Vec<u8>>,
    intent_to: Vec<String>,
    intent_value: Vec<U256>,
    intent_data: Vec<Vec<u8>>,
}

/// The lane's cursor (locked) and, in nonce order, the ready withdrawals still requested that no
/// other worker holds (locked, skipping locked ones), each with its whole event stream: what is
/// signed comes from the fold of the stream, which must be `requested` at the row's sequence, and
/// the projection row must agree with it. The lane row comes back even when no withdrawal does
/// (its withdrawal columns null).
///
/// The named withdrawals ($2) are locked by id alone and their state and lane checked after the
/// lock, on the row as locked: with `state = 'requested'` beside the ids, the generic plan could
/// answer from the lane's requested queue (`withdrawal_requested`), walking all of it for every
/// batch whenever the statistics called it short.
const LOCK_LANE_AND_WITHDRAWALS: &str = "
with lane as (
    select next_nonce, paused_at is not null as paused from hot_wallet where chain = 'eth' and lane = $1 for update
), named as (
    select id, account_id, asset, destination, amount, last_seq, state, lane from withdrawal
     where id = any($2)
     order by id for update skip locked
), ready as (
    select * from named where state = 'requested' and lane = $1
)
select lane.next_nonce, lane.paused, ready.id, ready.account_id, ready.asset, ready.destination, ready.amount, ready.last_seq,
       (select array_agg(e.event_type order by e.seq) from withdrawal_event e where e.withdrawal_id = ready.id),
       (select array_agg(e.payload order by e.seq) from withdrawal_event e where e.withdrawal_id = ready.id)
  from lane left join ready on true
 order by ready.id";

/// Every write of an allocation in one statement, so the batch costs the server one execution
/// and one reply: the nonces, the signed payloads, the `signed` events, the projection, and the
/// lane's cursor. $1 lane, $2 from_address, $3 ids, $4 nonces, $5 seqs, $6 hashes, $7 raw
/// transactions, $8 payloads, $9 max fee, $10 priority fee, $11 the next nonce, $12..$14 each
/// payout's destination, value and calldata (its intent).
///
/// The sub-statements cannot see each other's rows, but the foreign key from
/// `withdrawal_attempt` to `nonce_allocation` is checked after the whole statement, when they
/// can. The projection is found through `id = any($3)`, which the generic plan always answers from
/// the primary key (joined to the unnest alone, a small table would be scanned whole).
const WRITE_ALLOCATIONS: &str = "
with signed as (
    select * from unnest($3::bigint[], $4::bigint[], $5::int[], $6::text[], $7::bytea[], $8::jsonb[], $12::text[],
                         $13::numeric[], $14::bytea[])
        as s(id, nonce, seq, hash, raw, payload, intent_to, intent_value, intent_data)
), allocated as (
    insert into nonce_allocation (chain, from_address, nonce, withdrawal_id)
    select 'eth', $2, nonce, id from signed
), attempted as (
    insert into withdrawal_attempt (tx_hash, withdrawal_id, chain, from_address, nonce, kind, intent, intent_to,
                                    intent_value, intent_data, raw_tx, max_fee, priority_fee)
    select hash, id, 'eth', $2, nonce, 'original', 'payout', intent_to, intent_value, intent_data, raw, $9, $10
      from signed
), appended as (
    insert into withdrawal_event (withdrawal_id, seq, event_type, payload)
    select id, seq, 'signed', payload from signed
), projected as (
    update withdrawal w set state = 'signed', from_address = $2, nonce = s.nonce, tx_hash = s.hash, last_seq = s.seq,
           updated_at = now()
      from signed s
     where w.id = any($3) and w.id = s.id
)
update hot_wallet set next_nonce = $11 where chain = 'eth' and lane = $1";

impl Worker {
    /// The allocation transaction itself: lock the lane's `hot_wallet` row, take the `ready`
    /// withdrawals still `requested` (skipping any another worker holds), assign consecutive
    /// nonces, sign locally, store every payload, advance the cursor, commit. No network call.
    /// Returns how many were signed.
    ///
    /// # Cancel safety
    /// One transaction, pipelined in two round trips ([`Pipelined`]): cancelled or crashed before
    /// commit, no nonce is consumed, and the connection is closed rather than pooled.
    pub async fn sign_batch(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        pricing: &Pricing,
        ready: &[(i64, u64)],
    ) -> Result<u64, WorkError> {
        let Pricing { chain_id, max_fee, priority_fee, head } = *pricing;
        let gas: HashMap<i64, u64> = ready.iter().copied().collect();
        let ids: Vec<i64> = ready.iter().map(|(id, _)| *id).collect();
        let client = self.pool.get().await?;
        // Prepared once per connection, so none of these costs a round trip after the first batch.
        let (lock, write) = futures::try_join!(
            client.prepare_cached(LOCK_LANE_AND_WITHDRAWALS),
            client.prepare_cached(WRITE_ALLOCATIONS),
        )?;
        // First round trip: BEGIN, then lock the lane's row (every allocation on the lane
        // serialises here) and the withdrawals still requested that no other worker holds.
        let (tx, rows) = Pipelined::begin_with(client, &lock, &[&lane.lane.as_str(), &ids]).await?;
        let Some(first) = rows.first() else {
            tx.rollback().await?;
            return Ok(0);
        };
        let (next_nonce, paused): (i64, bool) = (first.get(0), first.get(1));
        if paused {
            tx.rollback().await?;
            return Ok(0);
        }
        let mut batch = SignedBatch::default();
        let mut unsigned = Vec::new();
        let mut tampered = Vec::new();
        let mut nonce = Nonce::from_stored(next_nonce);
        for row in rows.iter().filter(|r| r.get::<_, Option<i64>>(2).is_some()) {
            let fact = match verified_request(row, 2) {
                Ok(fact) => fact,
                Err(found) => {
                    tampered.push(found);
                    continue;
                }
            };
            // Signed from the fact, which the projection matched.
            let w = fact;
            let payout::Call { to, value, data: input } = payout_call(&w);
            batch.intent_to.push(hex(to));
            batch.intent_value.push(value);
            batch.intent_data.push(input.to_vec());
            unsigned.push(TxEip1559 {
                chain_id,
                nonce: nonce.get(),
                gas_limit: gas[&w.id().get()],
                max_fee_per_gas: max_fee.to::<u128>(),
                max_priority_fee_per_gas: priority_fee.to::<u128>(),
                to: TxKind::Call(to),
                value,
                input,
                ..Default::default()
            });
            batch.ids.push(w.id().get());
            batch.nonces.push(nonce.stored());
            batch.seqs.push(w.last_seq() + 1);
            nonce = nonce.next();
        }
        if !tampered.is_empty() {
            // Sign nothing: someone changed what a withdrawal pays behind the event stream.
            tx.rollback().await?;
            review_tampered(&self.pool, "eth", lane.lane.as_str(), tampered).await?;
            return Ok(0);
        }
        for (signed_tx, nonce) in sign_all(signer, unsigned)?.into_iter().zip(&batch.nonces) {
            let hash = TxHash::Eth(signed_tx.hash);
            let event = WithdrawalEvent::Signed {
                from_address: ChainAddress::Eth(lane.address),
                nonce: Some(Nonce::from_stored(*nonce)),
                tx_hash: hash,
                at_block: head,
            };
            batch.payloads.push(event.payload());
            batch.hashes.push(hash.to_string());
            batch.raws.push(signed_tx.raw);
        }
        let signed = batch.ids.len() as u64;
        if signed == 0 {
            tx.rollback().await?;
            return Ok(0);
        }
        // Second round trip: every write and COMMIT. The primary key (chain, from_address, nonce)
        // is the last word on double allocation; (withdrawal_id, seq) on the streams, whose rows
        // we hold locked.
        tx.commit_with(&[(
            &write,
            &[
                &lane.lane.as_str(),
                &lane.address.to_lowercase_hex(),
                &batch.ids,
                &batch.nonces,
                &batch.seqs,
                &batch.hashes,
                &batch.raws,
                &batch.payloads,
                &max_fee,
                &priority_fee,
                &nonce.stored(),
                &batch.intent_to,
                &batch.intent_value,
                &batch.intent_data,
            ],
        )])
        .await?;
        metrics::counter!("custodian_withdrawals_total", "state" => "signed").increment(signed);
        Ok(signed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use custodian_testkit::db::generic_plan;
    use custodian_testkit::TestDb;

    /// The worker names the withdrawals it wants (read from the queue before pricing), so the
    /// lock finds each by its primary key whatever the statistics say. On statistics taken while
    /// few were requested, the generic plan walked the lane's whole requested queue
    /// (`withdrawal_requested`) for each batch, filtering by id: 0.4 of the lock's 0.5 ms behind
    /// a backlog of 1,000 in the allocation bench, and growing with the backlog.
    #[tokio::test]
    async fn the_lock_finds_the_named_withdrawals_by_primary_key_behind_a_queue_the_statistics_call_short() {
        let db = TestDb::new().await;
        let wallet = "0x00000000000000000000000000000000000000e0";
        db.owner_client()
            .await
            .batch_execute(&format!(
                "insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', '{wallet}', 'e0', 7);
                 insert into hot_wallet (chain, address, lane, next_nonce)
                      values ('eth', '0x00000000000000000000000000000000000000e1', 'e1', 0);
                 insert into withdrawal (id, external_id, chain, asset, destination, amount, state, lane, last_seq)
                 select n, 'q' || n, 'eth', 'ETH', '0x00000000000000000000000000000000000000d0', 1000, 'signed',
                        case when n = 2200 then 'e1' else 'e0' end, 1
                   from generate_series(1, 2200) n;
                 analyze withdrawal;
                 update withdrawal set state = 'requested' where id > 1200;"
            ))
            .await
            .unwrap();
        let client = db.client().await;
        let plan = generic_plan(&client, LOCK_LANE_AND_WITHDRAWALS, "'e0', '{1201, 1202, 5, 2200}'").await;
        assert!(!plan.contains("withdrawal_requested"), "the named withdrawals looked for in the queue:\n{plan}");
        assert!(plan.contains("withdrawal_pkey on withdrawal"), "the named withdrawals not found by key:\n{plan}");

        // Only those still requested on this lane come back, in id order; the lane row always does.
        let lock = client.prepare(LOCK_LANE_AND_WITHDRAWALS).await.unwrap();
        let rows = client.query(&lock, &[&"e0", &vec![1202i64, 5, 1201, 2200]]).await.unwrap();
        let ids: Vec<Option<i64>> = rows.iter().map(|r| r.get(2)).collect();
        assert_eq!(ids, [Some(1201), Some(1202)]);
        assert_eq!(rows[0].get::<_, i64>(0), 7, "the lane's cursor");
        let rows = client.query(&lock, &[&"e0", &vec![5i64, 2200]]).await.unwrap();
        assert_eq!(rows.len(), 1, "the lane row alone when none is ready");
        assert_eq!((rows[0].get::<_, i64>(0), rows[0].get::<_, Option<i64>>(2)), (7, None));
    }
}
