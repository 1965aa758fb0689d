//! Posting confirmed deposits to the double-entry ledger, idempotently.
//!
//! One statement per chain inserts a transfer (debit `custody`, credit `user:{account}`) for every
//! confirmed, attributed deposit not yet posted, keyed `deposit:{chain}:{tx_hash}:{output_index}`.
//! The key omits the block: the same money re-mined in another block is credited once. The
//! unique key is what makes a concurrent or repeated pass harmless; the deferred balance trigger
//! checks every transfer at commit.
//!
//! A confirmed observation whose key is already posted with a different amount, asset or account
//! (the same transaction re-mined across an ownership change, say) is not silently skipped: it is
//! returned as a mismatch, logged as an alert and counted.

use custodian_domain::Chain;
use deadpool_postgres::GenericClient;
use serde::Serialize;

/// What a posting pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PostingReport {
    /// Transfers created by this pass.
    pub posted: u64,
    /// Reversal proposals created by this pass.
    pub reversals_proposed: u64,
    /// Confirmed observations that disagree with the transfer already posted for their key.
    pub mismatches: Vec<Mismatch>,
}

/// A confirmed observation that disagrees with what was posted for its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// The deposit key.
    pub key: String,
    /// The block of the disagreeing observation.
    pub block_hash: String,
    /// What the observation says: amount, asset, ledger account.
    pub observed: String,
    /// What the posted transfer says.
    pub posted: String,
}

const POST_CONFIRMED: &str = "
with candidates as (
    select distinct on (s.tx_hash, s.output_index)
           'deposit:' || s.chain || ':' || s.tx_hash || ':' || s.output_index as key,
           s.chain, s.tx_hash, s.output_index, s.block_hash, s.height, s.address, s.asset, s.amount, s.account_id
      from deposit_status s
     where s.chain = $1 and s.confirmed and s.account_id is not null and not s.posted
     order by s.tx_hash, s.output_index, s.height
), transfers as (
    insert into ledger_transfer (idempotency_key, kind, reference)
    select c.key, 'deposit',
           jsonb_build_object('chain', c.chain, 'tx_hash', c.tx_hash, 'output_index', c.output_index,
                              'block_hash', c.block_hash, 'height', c.height, 'address', c.address,
                              'account_id', c.account_id)
      from candidates c
    on conflict (idempotency_key) do nothing
    returning id, idempotency_key
), postings as (
    insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount)
    select t.id, side.ledger_account, c.asset, side.direction, c.amount
      from transfers t
      join candidates c on c.key = t.idempotency_key
     cross join lateral (values ('custody', 'debit'), ('user:' || c.account_id, 'credit'))
           as side (ledger_account, direction)
    returning transfer_id
)
select count(distinct transfer_id) from postings";

const MISMATCHES: &str = "
select 'deposit:' || s.chain || ':' || s.tx_hash || ':' || s.output_index, s.block_hash,
       s.amount::text || ' ' || s.asset || ' to ' || coalesce('user:' || s.account_id, 'no account'),
       p.amount::text || ' ' || p.asset || ' to ' || p.ledger_account
  from deposit_status s
  join ledger_transfer t on t.idempotency_key = 'deposit:' || s.chain || ':' || s.tx_hash || ':' || s.output_index
  join ledger_posting p on p.transfer_id = t.id and p.direction = 'credit'
 where s.chain = $1 and s.confirmed and s.block_hash <> t.reference ->> 'block_hash'
   and (p.amount <> s.amount or p.asset <> s.asset or s.account_id is null
        or p.ledger_account <> 'user:' || s.account_id)";

/// Posted deposits whose every observation is now on an orphaned block become proposals for a
/// person to review. Only deposits seen in an orphaned block are considered, so the pass stays
/// cheap however many deposits were ever posted.
const PROPOSE_REVERSALS: &str = "
insert into reversal_proposal (deposit_key, transfer_id, reason)
select distinct t.idempotency_key, t.id,
       'every observation of the deposit is on an orphaned block (deepest reorg past the confirmation threshold)'
  from chain_block ob
  join deposit_event d on d.chain = ob.chain and d.block_hash = ob.block_hash
  join ledger_transfer t on t.idempotency_key = 'deposit:' || d.chain || ':' || d.tx_hash || ':' || d.output_index
 where ob.chain = $1 and ob.orphaned_at is not null
   and not exists (select 1 from deposit_event d2
                     join chain_block b2 on b2.chain = d2.chain and b2.block_hash = d2.block_hash
                    where d2.chain = d.chain and d2.tx_hash = d.tx_hash and d2.output_index = d.output_index
                      and b2.orphaned_at is null)
on conflict (deposit_key) do nothing";

/// Posts every confirmed deposit of `chain` not yet posted, and proposes reversals for posted
/// deposits that lost every observation.
///
/// # Cancel safety
/// Each statement is atomic; a cancelled pass leaves whatever it committed, all of it valid.
pub async fn post_chain<C: GenericClient>(client: &C, chain: Chain) -> Result<PostingReport, tokio_postgres::Error> {
    let posted: i64 = client.query_one(POST_CONFIRMED, &[&chain.as_str()]).await?.get(0);
    let reversals_proposed = client.execute(PROPOSE_REVERSALS, &[&chain.as_str()]).await?;
    let mismatches: Vec<Mismatch> = client
        .query(MISMATCHES, &[&chain.as_str()])
        .await?
        .iter()
        .map(|r| Mismatch { key: r.get(0), block_hash: r.get(1), observed: r.get(2), posted: r.get(3) })
        .collect();
    for m in &mismatches {
        tracing::error!(key = %m.key, block = %m.block_hash, observed = %m.observed, posted = %m.posted,
            "ALERT: a confirmed deposit disagrees with what was posted for its key; not posted again");
        metrics::counter!("custodian_deposit_posting_mismatches_total", "chain" => chain.as_str()).increment(1);
    }
    metrics::counter!("custodian_deposits_posted_total", "chain" => chain.as_str())
        .increment(u64::try_from(posted).expect("BUG: negative count"));
    if reversals_proposed > 0 {
        tracing::warn!(%chain, reversals_proposed, "ALERT: posted deposits lost every observation; reversal proposals await review");
    }
    Ok(PostingReport { posted: u64::try_from(posted).expect("BUG: negative count"), reversals_proposed, mismatches })
}

/// Runs [`post_chain`] for every chain.
pub async fn post_all<C: GenericClient>(client: &C) -> Result<PostingReport, tokio_postgres::Error> {
    let mut total = PostingReport::default();
    for chain in Chain::ALL {
        let report = post_chain(client, chain).await?;
        total.posted += report.posted;
        total.reversals_proposed += report.reversals_proposed;
        total.mismatches.extend(report.mismatches);
    }
    Ok(total)
}
