//! Deposit reconciliation, per deposit key (DESIGN §6).
//!
//! After every scan step the pass compares, for each key `deposit:{chain}:{tx}:{kind}:{index}`,
//! what the canonical chain holds confirmed with what the ledger has posted under the key (the net
//! of its `custody` legs) and closes the difference:
//! - chain more than ledger (a first confirmation, or money re-mined after a reversal): credit it,
//!   automatically, under `{key}:credit:{n}`: first back to `treasury` whatever it absorbed for the
//!   key, the rest to the owner. Crediting money confirmed on chain needs no review.
//! - ledger more than chain, with no canonical observation once the chain has built the key's own
//!   confirmation count in blocks beyond the orphaned chain's tip: open a discrepancy round for
//!   review. A round closes by itself, recording why, when
//!   the money is re-mined before anyone decides.
//!
//! Each statement is idempotent on its unique key (`{key}:credit:{n}`, `(key, round)`, one
//! decision per round), so a concurrent or repeated pass is harmless; the deferred balance
//! trigger checks every transfer at commit. A confirmed observation whose key is posted to
//! another account (the same transaction re-mined across an ownership change, say) is returned as
//! a mismatch, logged as an alert and counted, never credited twice.

use alloy_primitives::U256;
use custodian_domain::{Amount, Chain, LedgerAccount};
use custodian_store::ledger::{self, Direction, Posting, Transfer};
use deadpool_postgres::GenericClient;
use serde::Serialize;
use std::time::{Duration, Instant};

/// What a posting pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PostingReport {
    /// Credit transfers created by this pass (first credits and re-credits).
    pub posted: u64,
    /// Discrepancy rounds opened by this pass.
    pub reversals_proposed: u64,
    /// Open rounds closed because the money was re-mined.
    pub discrepancies_closed: u64,
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

/// Open rounds whose key has a canonical observation again: closed, recording the block.
const CLOSE_REMINED: &str = "
insert into reversal_decision (proposal_id, decision, decided_by, reason)
select r.id, 'closed', 'custodian',
       'the money is on the canonical chain again: block ' || o.block_hash || ' at height ' || o.height
  from reversal_proposal r
  cross join lateral (
        select d.block_hash, b.height
          from deposit_event d join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash
         where d.chain = r.chain and d.tx_hash = r.tx_hash and d.kind = r.kind and d.output_index = r.output_index
           and b.orphaned_at is null
         order by b.height limit 1) o
 where r.chain = $1 and not exists (select 1 from reversal_decision x where x.proposal_id = r.id)
on conflict (proposal_id) do nothing";

/// Per deposit key of chain $1 with postings, from every posting at once (one join, not a probe
/// per key): what custody holds (null if nothing: `deposit_status.custody_posted` before its
/// `coalesce`, which the view sums key by key) and every ledger account a credit of the key
/// credited (`credited_account` is one of them).
const KEYS_BOOKED: &str = "
select t.deposit_key,
       sum(case when p.ledger_account = 'custody' then
               case p.direction when 'debit' then p.amount else -p.amount end end) as custody,
       array_agg(p.ledger_account) filter (where t.kind = 'deposit' and p.direction = 'credit') as credited
  from ledger_transfer t join ledger_posting p on p.transfer_id = t.id
 where t.deposit_key like 'deposit:' || $1 || ':%'
 group by t.deposit_key";

/// The observations of chain $1 a whole pass derives the status of: those `filter` keeps, a
/// filter on `d` (the chain's `deposit_event`), `b` (its block), `k` ([`KEYS_BOOKED`], if the key
/// has postings) and `w` (the address's owner at the block's height, if any), which must keep
/// every observation whose row satisfies the statement's condition.
fn every_candidate(filter: &str) -> String {
    format!(
        "
    select d.id, d.chain, d.block_hash, d.tx_hash
      from deposit_event d
      join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash
      left join ({KEYS_BOOKED}) k on k.deposit_key = deposit_key(d.chain, d.tx_hash, d.kind, d.output_index)
      left join wallet_address w
             on w.chain = d.chain and w.address = d.address and w.valid_from_height <= b.height
            and (w.valid_to_height is null or b.height < w.valid_to_height)
     where d.chain = $1 and ({filter})"
    )
}

/// The observations of chain $1 whose `deposit_status` row may differ from what an earlier pass
/// saw, with every other observation of their keys: the pass that began when $2 was the oldest
/// running transaction (`pg_snapshot_xmin`, as text), the tip $3 and the deepest tier $4.
///
/// That pass saw every fact written by a transaction older than $2 and acted on what it saw. A row
/// changes since only through
/// - a new fact about it, written by a transaction no older than $2: its observation
///   (`deposit_event`) or a transfer under its key (`ledger_transfer`: a credit, a reversal);
/// - the tip, which adds confirmations: the canonical observations that pass may have found short
///   of their count, above its tip less the deepest tier (then or now, whichever is deeper) and,
///   for coinbase outputs (100), less 100;
/// - a verdict on its block (`block_verdict`): a block back on the chain, or orphaned, which may
///   also have lowered the tip that pass read before its statements saw it. So the reach starts
///   below the lowest block a verdict since moved, taking in the observations on the blocks back
///   (an orphaned observation is never due; `deposit_lost` finds what it lost);
/// - the owner, whose assignments write no fact: `store::ownership` never moves an observed
///   deposit to another owner, and the whole pass [`ChainPasses`] runs at least every
///   [`WHOLE_PASS_EVERY`] finds whatever a race did.
const CHANGED: &str = "
    with reach as (
        select least($3::bigint, (select min(b.height) - 1
                                    from block_verdict v
                                    join chain_block b on b.chain = v.chain and b.block_hash = v.block_hash
                                   where v.chain = $1 and v.fact_xid >= $2::text::xid8)) as tip,
               greatest($4::bigint, (select max(p.confirmations) from confirmation_policy p where p.chain = $1))
                   as deepest
    ), changed as (
        select d.tx_hash, d.kind, d.output_index
          from deposit_event d
         where d.fact_xid >= $2::text::xid8 and d.chain = $1
        union
        select d.tx_hash, d.kind, d.output_index
          from reach r
          join chain_block b on b.chain = $1 and b.orphaned_at is null
                            and b.height > r.tip - greatest(r.deepest, 100) - 1
          join deposit_event d on d.chain = b.chain and d.block_hash = b.block_hash
         where b.height > r.tip - r.deepest - 1 or d.coinbase
        union
        select split_part(t.deposit_key, ':', 3), split_part(t.deposit_key, ':', 4),
               split_part(t.deposit_key, ':', 5)::int
          from ledger_transfer t
         where t.fact_xid >= $2::text::xid8 and t.deposit_key like 'deposit:' || $1 || ':%'
    )
    select d.id, d.chain, d.block_hash, d.tx_hash
      from changed c
      join deposit_event d on d.chain = $1 and d.tx_hash = c.tx_hash and d.kind = c.kind
                          and d.output_index = c.output_index";

/// Which observations a pass derives the status of.
#[derive(Debug, Clone, Copy)]
enum Scope {
    /// Every observation of the chain that could satisfy the statement's condition ($1: the chain).
    Whole,
    /// The observations that may have changed since an earlier pass began ([`CHANGED`]).
    Since,
}

/// The `deposit_status` rows of chain $1 that satisfy `condition`, a filter on the view's row
/// `s`, derived only for the observations `candidates` returns (`id, chain, block_hash, tx_hash`
/// of `deposit_event`).
///
/// The candidates are found first (`materialized`: otherwise the planner filters them above the
/// lateral subquery), then each one's row is derived alone, by its chain, block and transaction:
/// columns the view's window is partitioned by, so they reach deposit_event's unique index
/// (`offset 0` keeps the lateral subquery parameterised). Filtered on the view instead, every pass
/// derived the owner, tier, confirmations and postings of every deposit ever observed: at 200,000
/// deposits 3.5 s a statement, after every scan step, with nothing to post.
fn status_where(candidates: &str, condition: &str) -> String {
    format!(
        "
with c as materialized ({candidates}
)
select s.* from c cross join lateral (
    select * from deposit_status s
     where s.chain = c.chain and s.block_hash = c.block_hash and s.tx_hash = c.tx_hash and s.id = c.id
    offset 0
) s
 where {condition}"
    )
}

/// Confirmed, attributed keys the ledger holds less for than the chain, with what is owed for
/// each: first to `treasury` up to what it absorbed for the key, the rest to the owner
/// ([`credit`] makes the transfer). Candidates of a whole pass: the observations paying more than
/// custody holds under their key, exactly those whose `custody_posted < amount`.
pub fn due() -> String {
    due_in(Scope::Whole)
}

/// [`due`] for a pass between whole passes: derived for the observations that may have changed
/// since a [`Horizon`] ($1 the chain, $2–$4 the horizon's `xmin`, `tip` and `deepest`).
pub fn due_since() -> String {
    due_in(Scope::Since)
}

fn due_in(scope: Scope) -> String {
    let candidates = match scope {
        Scope::Whole => every_candidate("coalesce(k.custody, 0) < d.amount"),
        Scope::Since => CHANGED.to_owned(),
    };
    let owed = status_where(&candidates, "s.confirmed and s.account_id is not null and s.custody_posted < s.amount");
    format!(
        "
with chain_side as (
    select distinct on (s.deposit_key)
           s.deposit_key, s.chain, s.tx_hash, s.kind, s.output_index, s.block_hash, s.height, s.address,
           s.asset, s.amount, s.account_id, s.custody_posted, s.treasury_posted, s.credits
      from ({owed}) s
     order by s.deposit_key, s.height
)
select c.deposit_key, c.chain, c.tx_hash, c.kind, c.output_index::int, c.block_hash, c.height::bigint, c.address,
       c.asset, c.account_id, ledger_account_of(c.account_id), (c.credits + 1)::int,
       c.amount - c.custody_posted as owed,
       least(greatest(-c.treasury_posted, 0), c.amount - c.custody_posted) as to_treasury
  from chain_side c"
    )
}

/// The credit a [`due`] row asks for, keyed `{deposit key}:credit:{n}`: custody takes in what is
/// owed, `treasury` gets back what it absorbed for the key, the owner the rest.
fn credit(r: &tokio_postgres::Row) -> Transfer {
    let deposit_key: String = r.get(0);
    let (asset, owner, n): (String, &str, i32) = (r.get(8), r.get(10), r.get(11));
    let (owed, to_treasury): (U256, U256) = (r.get(12), r.get(13));
    let owner: LedgerAccount = owner.parse().expect("BUG: ledger_account_of returned no ledger account");
    let leg = |account, direction, units: U256| Posting {
        account,
        asset: asset.clone(),
        direction,
        amount: Amount::from_units(units),
    };
    let postings: Vec<Posting> = [
        leg(LedgerAccount::Custody, Direction::Debit, owed),
        leg(LedgerAccount::Treasury, Direction::Credit, to_treasury),
        leg(owner, Direction::Credit, owed - to_treasury),
    ]
    .into_iter()
    .filter(|p| !p.amount.is_zero())
    .collect();
    let reference = serde_json::json!({
        "chain": r.get::<_, &str>(1), "tx_hash": r.get::<_, &str>(2), "kind": r.get::<_, &str>(3),
        "output_index": r.get::<_, i32>(4), "block_hash": r.get::<_, &str>(5), "height": r.get::<_, i64>(6),
        "address": r.get::<_, &str>(7), "account_id": r.get::<_, i64>(9), "credit": n,
    });
    Transfer::new(format!("{deposit_key}:credit:{n}"), "deposit", reference, postings)
        .expect("BUG: a deposit credit balances: custody takes what treasury and the owner get")
        .for_deposit(deposit_key)
}

/// Keys the ledger holds money for whose every observation is orphaned, once the grace period
/// passed (`deposit_lost`: the key's own confirmation count in blocks beyond the old chain's tip),
/// with no round open: a new discrepancy round.
const OPEN_DISCREPANCIES: &str = "
insert into reversal_proposal (deposit_key, round, chain, tx_hash, kind, output_index, transfer_id,
                               ledger_account, asset, amount, reason)
select l.deposit_key,
       coalesce((select max(r.round) from reversal_proposal r where r.deposit_key = l.deposit_key), 0) + 1,
       l.chain, l.tx_hash, l.kind, l.output_index, l.last_credit_id, l.credited_account, l.asset, l.custody_posted,
       'every observation of the deposit is on an orphaned block; the canonical chain reached ' || l.tip
           || ', ' || (l.tip - l.old_tip) || ' blocks beyond the orphaned chain''s tip ' || l.old_tip
           || ', without it (grace: ' || l.required_confirmations || ' blocks)'
  from deposit_lost l
 where l.chain = $1 and l.grace_passed and l.custody_posted > 0
   and not exists (select 1 from reversal_proposal r
                    where r.deposit_key = l.deposit_key
                      and not exists (select 1 from reversal_decision x where x.proposal_id = r.id))
on conflict (deposit_key, round) do nothing";

/// Confirmed observations whose key holds something other than they say: another amount, or
/// credited to someone other than their owner or `treasury`. Candidates of a whole pass: the
/// observations whose key holds something and either another amount, or no owner, or a credit to
/// someone other than the owner or `treasury` (`credited_account` is one of the accounts a credit
/// credited).
pub fn mismatches() -> String {
    mismatches_in(Scope::Whole)
}

/// [`mismatches`] for a pass between whole passes, with [`due_since`]'s parameters.
pub fn mismatches_since() -> String {
    mismatches_in(Scope::Since)
}

fn mismatches_in(scope: Scope) -> String {
    let candidates = match scope {
        Scope::Whole => every_candidate(
            "k.custody > 0 and (k.custody <> d.amount or w.account_id is null
                                or not (k.credited <@ array['user:' || w.account_id, 'treasury']))",
        ),
        Scope::Since => CHANGED.to_owned(),
    };
    let mismatched = status_where(
        &candidates,
        "s.confirmed and s.custody_posted > 0
         and (s.custody_posted <> s.amount or s.account_id is null
              or s.credited_account not in ('user:' || s.account_id, 'treasury'))",
    );
    format!(
        "
select s.deposit_key, s.block_hash,
       s.amount::text || ' ' || s.asset || ' to ' || coalesce('user:' || s.account_id, 'no account'),
       s.custody_posted::text || ' ' || s.asset || ' to ' || s.credited_account
  from ({mismatched}) s"
    )
}

/// Reconciles every deposit key of `chain`: closes rounds whose money is back, credits what the
/// chain holds confirmed beyond the ledger, and opens rounds for money the chain lost.
///
/// # Cancel safety
/// Each statement is atomic; a cancelled pass leaves whatever it committed, all of it valid.
pub async fn post_chain<C: GenericClient>(client: &C, chain: Chain) -> Result<PostingReport, tokio_postgres::Error> {
    post(client, chain, None).await
}

/// Where a pass began, for the next pass to derive only what may have changed since ([`CHANGED`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Horizon {
    /// `pg_snapshot_xmin` before the pass's first statement, as text: every fact written by an
    /// older transaction was committed (or rolled back) before it, so the pass saw it.
    pub xmin: String,
    /// The chain's tip then, -1 without blocks.
    pub tip: i64,
    /// The deepest confirmation count of the chain's tiers then.
    pub deepest: i64,
}

/// Where a pass of `chain` begins: read before its first statement.
pub async fn horizon<C: GenericClient>(client: &C, chain: Chain) -> Result<Horizon, tokio_postgres::Error> {
    let row = client
        .query_one(
            "select pg_snapshot_xmin(pg_current_snapshot())::text,
                    coalesce((select height from chain_tip where chain = $1), -1)::bigint,
                    coalesce((select max(confirmations) from confirmation_policy where chain = $1), 0)::bigint",
            &[&chain.as_str()],
        )
        .await?;
    Ok(Horizon { xmin: row.get(0), tip: row.get(1), deepest: row.get(2) })
}

async fn post<C: GenericClient>(
    client: &C,
    chain: Chain,
    since: Option<&Horizon>,
) -> Result<PostingReport, tokio_postgres::Error> {
    let name = chain.as_str();
    let (scope, params): (Scope, Vec<&(dyn tokio_postgres::types::ToSql + Sync)>) = match since {
        None => (Scope::Whole, vec![&name]),
        Some(h) => (Scope::Since, vec![&name, &h.xmin, &h.tip, &h.deepest]),
    };
    let discrepancies_closed = client.execute(CLOSE_REMINED, &[&name]).await?;
    let due: Vec<Transfer> = client.query(&due_in(scope), &params).await?.iter().map(credit).collect();
    let posted = ledger::write(client, &due).await?.len();
    let reversals_proposed = client.execute(OPEN_DISCREPANCIES, &[&name]).await?;
    let mismatches: Vec<Mismatch> = client
        .query(&mismatches_in(scope), &params)
        .await?
        .iter()
        .map(|r| Mismatch { key: r.get(0), block_hash: r.get(1), observed: r.get(2), posted: r.get(3) })
        .collect();
    for m in &mismatches {
        tracing::error!(key = %m.key, block = %m.block_hash, observed = %m.observed, posted = %m.posted,
            "ALERT: a confirmed deposit disagrees with what was posted for its key; not posted again");
        metrics::counter!("custodian_deposit_posting_mismatches_total", "chain" => name).increment(1);
    }
    metrics::counter!("custodian_deposits_posted_total", "chain" => name).increment(posted as u64);
    if reversals_proposed > 0 {
        tracing::warn!(%chain, reversals_proposed,
            "ALERT: credited deposits are gone from the canonical chain past their grace period; discrepancies await review");
        metrics::counter!("custodian_deposit_discrepancies_opened_total", "chain" => name)
            .increment(reversals_proposed);
    }
    if discrepancies_closed > 0 {
        tracing::info!(%chain, discrepancies_closed, "open discrepancies closed: the money was re-mined");
    }
    Ok(PostingReport { posted: posted as u64, reversals_proposed, discrepancies_closed, mismatches })
}

/// How often the posting pass after every scan step is a whole pass at the least.
pub const WHOLE_PASS_EVERY: Duration = Duration::from_secs(600);

/// The posting pass after every scan step of one chain. The first is whole ([`post_chain`]): it
/// reads every key's postings, in time proportional to the ledger (15 s at 1,000,000 deposits).
/// Each next one derives only the observations that may have changed since the previous one began
/// ([`CHANGED`]), and a whole pass runs again once `whole_every` has passed since the last: it
/// finds what no fact records (an ownership race) and reports every mismatch again, where a pass
/// in between reports those of the keys it derived. A failed pass leaves the horizon where it
/// was, so the next one covers what it would have.
#[derive(Debug)]
pub struct ChainPasses {
    chain: Chain,
    whole_every: Duration,
    /// Where the last pass that succeeded began; none before the first.
    last: Option<Horizon>,
    /// When the last whole pass that succeeded began.
    whole_at: Option<Instant>,
}

impl ChainPasses {
    pub fn new(chain: Chain, whole_every: Duration) -> Self {
        Self { chain, whole_every, last: None, whole_at: None }
    }

    /// Runs the next pass; `Ok` with what it did and whether it was whole.
    pub async fn run<C: GenericClient>(&mut self, client: &C) -> Result<(PostingReport, bool), tokio_postgres::Error> {
        let began = horizon(client, self.chain).await?;
        let started = Instant::now();
        let since = match (&self.last, self.whole_at) {
            (Some(last), Some(at)) if at.elapsed() < self.whole_every => Some(last),
            _ => None,
        };
        let report = post(client, self.chain, since).await?;
        let whole = since.is_none();
        if whole {
            self.whole_at = Some(started);
        }
        metrics::counter!("custodian_posting_passes_total", "chain" => self.chain.as_str(),
                          "scope" => if whole { "whole" } else { "since" })
        .increment(1);
        self.last = Some(began);
        Ok((report, whole))
    }
}

/// Runs [`post_chain`] for every chain.
pub async fn post_all<C: GenericClient>(client: &C) -> Result<PostingReport, tokio_postgres::Error> {
    let mut total = PostingReport::default();
    for chain in Chain::ALL {
        let report = post_chain(client, chain).await?;
        total.posted += report.posted;
        total.reversals_proposed += report.reversals_proposed;
        total.discrepancies_closed += report.discrepancies_closed;
        total.mismatches.extend(report.mismatches);
    }
    Ok(total)
}
