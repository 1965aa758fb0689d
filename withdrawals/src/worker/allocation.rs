//! Allocation's planning: the hot wallet's funds against what the lane already has in flight, and
//! simulation, before any lock; then each batch goes to the nonce allocator
//! (`nonce_allocator.rs`). Also the check every allocator (ETH and BTC) makes before it signs:
//! what is signed is the fold of the event stream, and the projection row must agree with it.

use std::collections::HashMap;

use alloy_primitives::{Address, U256};
use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::WithdrawalId;
use custodian_domain::{Amount, Asset};

use super::nonce_allocator::Pricing;
use super::{PassReport, WorkError, Worker};
use crate::hot_wallet::Lane;
use crate::payout::{self, balance_of_call, fresh_fees, payout_call, returned_u256, token_of, TRANSFER_GAS};
use crate::signer::Signer;
use crate::sql;

/// What a withdrawal pays, as the allocator compares it between the event and the projection.
#[derive(Debug, PartialEq, Eq)]
struct PaidAs {
    account_id: i64,
    asset: String,
    destination: String,
    amount: Amount,
}

impl std::fmt::Display for PaidAs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} units of {} from account {} to {}", self.amount, self.asset, self.account_id, self.destination)
    }
}

/// Checks a locked withdrawal row (its columns from `first`: id, account_id, asset, destination,
/// amount, last_seq, event types, payloads) against its event stream: the fold must be
/// `requested` at the row's sequence, and pay what the row says. Returns the fold, or the id and
/// why nothing may be signed for it.
pub(crate) fn verified_request(row: &tokio_postgres::Row, first: usize) -> Result<Withdrawal, (i64, String)> {
    let id: i64 = row.get(first);
    let projected = PaidAs {
        account_id: row.get(first + 1),
        asset: row.get(first + 2),
        destination: row.get(first + 3),
        amount: Amount::from_units(row.get::<_, U256>(first + 4)),
    };
    let types: Vec<String> = row.get::<_, Option<Vec<String>>>(first + 6).unwrap_or_default();
    let payloads: Vec<serde_json::Value> = row.get::<_, Option<Vec<serde_json::Value>>>(first + 7).unwrap_or_default();
    let stream: Result<Vec<WithdrawalEvent>, _> =
        types.iter().zip(&payloads).map(|(t, p)| WithdrawalEvent::from_stored(t, p)).collect();
    let folded = stream.ok().and_then(|events| Withdrawal::fold(WithdrawalId::new(id), &events));
    let row_seq: i32 = row.get(first + 5);
    let Some(folded) = folded else {
        return Err((
            id,
            format!("the withdrawal row has no readable event stream ({} events); nothing was signed", types.len()),
        ));
    };
    if folded.state() != WithdrawalState::Requested || folded.last_seq() != row_seq {
        return Err((
            id,
            format!(
                "the withdrawal row says requested at event {row_seq}, its event stream says {} at event {}; \
                 nothing was signed",
                folded.state().as_str(),
                folded.last_seq()
            ),
        ));
    }
    let fact = PaidAs {
        account_id: folded.account_id().get(),
        asset: folded.asset().key(),
        destination: folded.destination().stored(),
        amount: folded.amount(),
    };
    if fact != projected {
        return Err((
            id,
            format!(
                "the withdrawal row does not match its requested event: the event pays {fact}, the row says \
                 {projected}; nothing was signed"
            ),
        ));
    }
    Ok(folded)
}

/// What the lane can still spend, per asset: the hot wallet's balance at the latest block less
/// what its in-flight attempts may still take (for ether the worst case of every sibling: value
/// plus its whole gas at its max fee), less what this round has already planned.
struct Funds {
    ether: U256,
    tokens: HashMap<String, U256>,
    in_flight_tokens: HashMap<String, U256>,
}

/// Every attempt of the lane's withdrawals that are signed and not yet mined, with what each
/// withdrawal pays.
const IN_FLIGHT: &str = "
select w.id, w.asset, w.amount, a.raw_tx
  from withdrawal w join withdrawal_attempt a on a.withdrawal_id = w.id
 where w.chain = 'eth' and w.lane = $1 and w.state in ('signed', 'broadcast', 'cancel_requested')";

/// Allocation batches one lane signs in a pass at most (with the default batch of 64: 2,048).
const MAX_BATCHES_PER_PASS: usize = 32;

impl Worker {
    /// Simulates what needs it, then allocates consecutive nonces and signs, a batch per
    /// transaction: the backlog (up to [`MAX_BATCHES_PER_PASS`] batches) is priced and its funds
    /// read once, so a burst is signed in one pass. Withdrawals the hot wallet cannot cover
    /// (after what is already in flight) wait, oldest first, and the lane reports the shortage;
    /// they are never rejected for our own shortage. Returns how many were signed.
    pub(super) async fn allocate(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        chain_id: u64,
        report: &mut PassReport,
    ) -> Result<usize, WorkError> {
        let client = self.pool.get().await?;
        let batch = usize::try_from(self.config.batch_size).expect("BUG: negative batch").max(1);
        let pass = batch.saturating_mul(MAX_BATCHES_PER_PASS);
        let candidates = sql::in_state(&client, lane.lane.as_str(), WithdrawalState::Requested, Some(pass)).await?;
        if candidates.is_empty() {
            self.set_shortage(lane, None).await?;
            return Ok(0);
        }
        let (base, tip) = self.node.fees().await?;
        let (max_fee, priority_fee) = fresh_fees(base, tip, self.config.max_fee_per_gas_wei);
        let head = self.node.block_number().await?;
        let mut funds = self.funds(lane, signer.address()).await?;
        let loaded: Vec<(i64, Option<Withdrawal>)> =
            candidates.iter().copied().zip(sql::load_many(&client, &candidates).await?).collect();
        // Whether each plain-ether destination holds code, in one batch: an address without code
        // costs exactly 21,000 gas and needs no simulation.
        let plain: Vec<Address> = loaded
            .iter()
            .filter_map(|(_, w)| w.as_ref())
            .map(payout_call)
            .filter(|c| c.data.is_empty())
            .map(|c| c.to)
            .collect();
        let mut codes = match self.node.have_code(&plain).await {
            Ok(codes) => codes.into_iter(),
            Err(e) => {
                tracing::warn!(lane = %lane.lane, "reading the destinations' code failed, retried next pass: {e}");
                return Ok(0);
            }
        };
        let mut gas = HashMap::new();
        let mut short = None;
        for (id, w) in loaded {
            // A row without events is tampering: the allocation below reviews it.
            let Some(w) = w else {
                gas.insert(id, TRANSFER_GAS);
                continue;
            };
            let call = payout_call(&w);
            let has_code = call.data.is_empty() && codes.next().expect("BUG: one answer per plain payout");
            if let Some(token) = token_of(w.asset()) {
                let left = self.token_left(&mut funds, &w.asset().key(), token, signer.address()).await?;
                if left < w.amount().units() {
                    short =
                        Some(format!(
                        "{} of {}: the hot wallet can spend {left} after its in-flight payouts, withdrawal {} needs {}",
                        w.asset(), lane.address.to_lowercase_hex(), w.id(), w.amount()
                    ));
                    break;
                }
            }
            let Some(limit) = self.simulate(signer.address(), &w, &call, has_code, report).await? else { continue };
            let cost = call.value.saturating_add(U256::from(limit).saturating_mul(max_fee));
            if funds.ether < cost {
                short = Some(format!(
                    "ETH of {}: the hot wallet can spend {} wei after its in-flight attempts, withdrawal {} needs up to \
                     {cost} wei (value and gas at {max_fee} wei per gas)",
                    lane.address.to_lowercase_hex(), funds.ether, w.id()
                ));
                break;
            }
            funds.ether -= cost;
            if token_of(w.asset()).is_some() {
                let left = funds.tokens.get_mut(&w.asset().key()).expect("BUG: token funds read above");
                *left -= w.amount().units();
            }
            gas.insert(id, limit);
        }
        drop(client);
        if let Some(reason) = &short {
            report.short_lanes.push(format!("{}: {reason}", lane.lane));
        }
        self.set_shortage(lane, short).await?;
        let pricing = Pricing { chain_id, max_fee, priority_fee, head };
        let mut ready: Vec<(i64, u64)> = gas.into_iter().collect();
        ready.sort_unstable();
        let mut signed = 0;
        for chunk in ready.chunks(batch) {
            signed += self.sign_batch(lane, signer, &pricing, chunk).await?;
        }
        report.signed += signed;
        Ok(usize::try_from(signed).unwrap_or(0))
    }

    /// The gas limit for `w`'s payout, or `None` when it is not to be signed this pass (rejected
    /// by a deterministic simulation failure, or the simulation could not be run). Plain ether to
    /// an address without code (`has_code` false) costs exactly 21,000 gas; to a contract (a Safe,
    /// an exchange's deposit contract) its receive code runs and is simulated, as is every token
    /// transfer, whose return value must not be `false`.
    async fn simulate(
        &self,
        from: Address,
        w: &Withdrawal,
        call: &payout::Call,
        has_code: bool,
        report: &mut PassReport,
    ) -> Result<Option<u64>, WorkError> {
        if call.data.is_empty() && !has_code {
            return Ok(Some(TRANSFER_GAS));
        }
        let refusal = match self.node.call_at_latest(from, call.to, call.value, &call.data).await {
            Ok(returned) if call.data.is_empty() || payout::transfer_returned_true(&returned) => None,
            Ok(_) => Some("the token's transfer returned false".to_owned()),
            Err(e) if e.is_revert() => Some(format!("simulation reverted: {e}")),
            Err(e) => {
                tracing::warn!(withdrawal = %w.id(), "simulation failed, retried next pass (no nonce used): {e}");
                return Ok(None);
            }
        };
        let refusal = match refusal {
            Some(reason) => reason,
            None => match self.node.estimate_gas(from, call.to, call.value, &call.data).await {
                Ok(estimate) => return Ok(Some(estimate + estimate / 5)),
                Err(e) if e.is_revert() => format!("simulation reverted: {e}"),
                Err(e) => {
                    tracing::warn!(
                        withdrawal = %w.id(),
                        "estimating gas failed, retried next pass (no nonce used): {e}"
                    );
                    return Ok(None);
                }
            },
        };
        let rejected = WithdrawalEvent::Rejected { reason: refusal };
        if self.record(w.id().get(), |w| w.state() == WithdrawalState::Requested, rejected).await? {
            report.rejected += 1;
        }
        Ok(None)
    }

    /// The lane's ether at the latest block less the worst case of its in-flight attempts; the
    /// token amounts in flight are kept for [`Worker::token_left`].
    async fn funds(&self, lane: &Lane, hot_wallet: Address) -> Result<Funds, WorkError> {
        let ether = self.node.balance(hot_wallet).await?;
        let rows = self.pool.get().await?.query(IN_FLIGHT, &[&lane.lane.as_str()]).await?;
        let mut worst: HashMap<i64, U256> = HashMap::new();
        let mut in_flight_tokens: HashMap<String, U256> = HashMap::new();
        let mut counted = std::collections::HashSet::new();
        for row in &rows {
            let (id, asset, amount, raw): (i64, String, U256, Vec<u8>) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            let cost = payout::worst_cost(&payout::decode(&raw));
            let entry = worst.entry(id).or_default();
            *entry = (*entry).max(cost);
            let stored = Asset::parse_key(&asset).expect("BUG: withdrawal.asset references asset");
            if token_of(stored).is_some() && counted.insert(id) {
                let sum = in_flight_tokens.entry(asset).or_default();
                *sum = sum.saturating_add(amount);
            }
        }
        let committed = worst.values().fold(U256::ZERO, |sum, cost| sum.saturating_add(*cost));
        Ok(Funds { ether: ether.saturating_sub(committed), tokens: HashMap::new(), in_flight_tokens })
    }

    /// What the lane can still spend of `asset`: `balanceOf` at the latest block less its
    /// in-flight payouts and what this round planned (read once per asset per round).
    async fn token_left(
        &self,
        funds: &mut Funds,
        asset: &str,
        token: Address,
        hot_wallet: Address,
    ) -> Result<U256, WorkError> {
        if let Some(left) = funds.tokens.get(asset) {
            return Ok(*left);
        }
        let call = balance_of_call(token, hot_wallet);
        let returned = self.node.call_at_latest(hot_wallet, call.to, call.value, &call.data).await?;
        let balance = returned_u256(&returned).unwrap_or_default();
        let in_flight = funds.in_flight_tokens.get(asset).copied().unwrap_or_default();
        let left = balance.saturating_sub(in_flight);
        funds.tokens.insert(asset.to_owned(), left);
        Ok(left)
    }

    /// Records (or clears, with `None`) what the lane is short of; the start of a shortage is an
    /// alert, its end a notice.
    async fn set_shortage(&self, lane: &Lane, shortage: Option<String>) -> Result<(), WorkError> {
        // One statement under the lane row's lock: of two workers seeing the same shortage, one
        // records (and alerts) it, the other finds it recorded.
        let changed = self
            .pool
            .get()
            .await?
            .query_opt(
                "with old as (select shortage from hot_wallet where chain = 'eth' and lane = $1 for update)
                 update hot_wallet h set shortage = $2,
                        shortage_since = case when $2::text is null then null else coalesce(h.shortage_since, now()) end
                   from old
                  where h.chain = 'eth' and h.lane = $1 and h.shortage is distinct from $2
                 returning old.shortage",
                &[&lane.lane.as_str(), &shortage],
            )
            .await?;
        let before: Option<Option<String>> = changed.map(|row| row.get(0));
        metrics::gauge!("custodian_hot_wallet_short", "lane" => lane.lane.to_string()).set(if shortage.is_some() {
            1.0
        } else {
            0.0
        });
        match (&before, &shortage) {
            (Some(None), Some(reason)) => {
                metrics::counter!("custodian_hot_wallet_shortages_total", "lane" => lane.lane.to_string()).increment(1);
                tracing::error!(lane = %lane.lane, %reason,
                    "ALERT: the hot wallet is short; its withdrawals wait until it is topped up");
            }
            (Some(Some(_)), None) => tracing::info!(lane = %lane.lane, "the hot wallet's shortage is over"),
            _ => {}
        }
        Ok(())
    }
}

/// Why a lane pauses when one of its withdrawal rows was tampered with.
const TAMPERED: &str = "a withdrawal row did not match its requested event";

/// Each withdrawal whose projection disagrees with its event stream (what it pays, its state
/// or its sequence) goes to `needs_review` with both versions, and the lane pauses in the same
/// transaction: nothing more leaves it until a person has looked. A row without a readable
/// stream cannot take an event; it is alerted on and its lane pauses all the same.
pub(crate) async fn review_tampered(
    pool: &custodian_store::Pool,
    chain: &'static str,
    lane: &str,
    tampered: Vec<(i64, String)>,
) -> Result<(), WorkError> {
    for (id, reason) in tampered {
        tracing::error!(withdrawal = %id, lane, %reason, "ALERT: withdrawal projection tampered with");
        metrics::counter!("custodian_withdrawal_tampered_total").increment(1);
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        // The lane's row before the withdrawal's, as the allocator locks them.
        tx.execute("select 1 from hot_wallet where chain = $1 and lane = $2 for update", &[&chain, &lane]).await?;
        if tx.query_opt("select 1 from withdrawal where id = $1 for update", &[&id]).await?.is_none() {
            continue;
        }
        let events: Result<Vec<WithdrawalEvent>, _> = tx
            .query("select event_type, payload from withdrawal_event where withdrawal_id = $1 order by seq", &[&id])
            .await?
            .iter()
            .map(|r| WithdrawalEvent::from_stored(r.get(0), &r.get(1)))
            .collect();
        let Some(mut w) = events.ok().and_then(|events| Withdrawal::fold(WithdrawalId::new(id), &events)) else {
            continue;
        };
        if !w.holds_funds() {
            // Settled, cancelled or refused: its money is where its events put it. Put the
            // row back as the stream says; there is nothing left for a person to decide.
            sql::write_projection(&tx, &w).await?;
            tx.commit().await?;
        } else if w.state() != WithdrawalState::NeedsReview {
            sql::append(&tx, &mut w, WithdrawalEvent::NeedsReview { reason }).await?;
            sql::pause_lane_on(&tx, chain, lane, TAMPERED, false).await?;
            tx.commit().await?;
        }
    }
    sql::pause_lane_on(&pool.get().await?, chain, lane, TAMPERED, false).await?;
    Ok(())
}
