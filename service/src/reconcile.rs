//! The ledger against the chain (DESIGN §9). Per asset, what the ledger says
//! we hold (`custody`) against what the chain says our addresses hold at our tip — ETH: the
//! balance and every registered token's `balanceOf` of every hot wallet and deposit address at
//! our tip's block; BTC: the unspent outputs we observed — less what the chain holds that the
//! ledger has not credited yet (canonical observations not posted: pending deposits, or money that
//! arrived before an address was ours); and what we owe customers (available plus held) against
//! custody.

use std::time::Duration;

use custodian_domain::{Amount, Chain, SignedAmount};
use custodian_store::Pool;
use custodian_withdrawals::EthNode;
use serde::Serialize;
use tokio::sync::watch;

/// How often `serve` reconciles the ledger with the chain.
pub const INTERVAL: Duration = Duration::from_secs(300);
/// How soon a reconciliation that could not read everything (or failed) is tried again.
const RETRY: Duration = Duration::from_secs(5);

/// Why a reconciliation could not finish (what it found is a [`Reconciliation`], not an error).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The database failed.
    #[error("reading the ledger: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
    /// No connection could be taken.
    #[error("taking a database connection: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    /// The Ethereum node failed.
    #[error("the Ethereum node: {0}")]
    Node(String),
    /// A sum beyond the range of balances.
    #[error("reconciling {0}: beyond the range of balances")]
    Overflow(String),
}

/// One asset's figures, in smallest units.
#[derive(Debug, Serialize)]
pub struct AssetLine {
    pub asset: String,
    /// What the chain says our addresses hold.
    pub chain: SignedAmount,
    /// The ledger's `custody`.
    pub custody: SignedAmount,
    /// Observed on our canonical chain, not credited: the chain holds it, the ledger does not yet.
    pub uncredited: SignedAmount,
    /// chain − custody − uncredited.
    pub difference: SignedAmount,
    /// What customers are owed: available plus held.
    pub owed: SignedAmount,
    /// custody − owed: the treasury's own (negative: we owe more than we hold).
    pub surplus: SignedAmount,
}

/// `a - b`, exact over the whole range of balances (a token's may be anything below 2^256).
fn sub(a: SignedAmount, b: SignedAmount) -> Result<SignedAmount, ReconcileError> {
    a.checked_sub(b).map_err(|_| ReconcileError::Overflow(format!("{a} - {b}")))
}

fn parse(text: &str) -> SignedAmount {
    text.parse().expect("BUG: the database returned a non-integer amount")
}

/// What one reconciliation found.
#[derive(Debug, Serialize)]
pub struct Reconciliation {
    /// Per asset.
    pub assets: Vec<AssetLine>,
    /// Each difference, named.
    pub differences: Vec<String>,
    /// Assets that could not be read (no node configured, nothing scanned yet).
    pub skipped: Vec<String>,
}

/// Reconciles once and sets `custodian_reconciliation_difference{asset}` (1 when the asset's
/// chain and ledger disagree, 0 when equal). Used by `custodian reconcile` and, [`periodically`], by `serve`.
pub async fn once(eth: Option<&EthNode>, pool: &Pool) -> Result<Reconciliation, ReconcileError> {
    let client = pool.get().await?;
    // What the ledger says, per asset: custody, uncredited observations, and what is owed.
    let rows = client
        .query(
            "with custody as (
                 select asset, sum(case direction when 'debit' then amount else -amount end) as custody
                   from ledger_posting where ledger_account = 'custody' group by asset
             ), uncredited as (
                 select s.asset, sum(s.amount) as uncredited
                   from (select distinct on (deposit_key) asset, amount, custody_posted, orphaned, tx_hash
                           from deposit_status order by deposit_key, orphaned, height desc) s
                  where not s.orphaned and s.custody_posted = 0
                    -- change of our own BTC transactions is custody coming back, not uncredited
                    and not exists (select 1 from btc_attempt a where a.tx_hash = s.tx_hash)
                  group by s.asset
             ), owed as (
                 select asset, sum(available + held) as owed from account_balance group by asset
             )
             select a.chain, a.asset, a.contract, coalesce(c.custody, 0)::text, coalesce(u.uncredited, 0)::text,
                    coalesce(o.owed, 0)::text
               from asset a
               left join custody c using (asset) left join uncredited u using (asset) left join owed o using (asset)
              order by a.chain, a.asset",
            &[],
        )
        .await?;
    let mut lines = Vec::new();
    let mut skipped = Vec::new();
    let eth_tip: Option<i64> = client
        .query_one("select max(height) from chain_block where chain = 'eth' and orphaned_at is null", &[])
        .await?
        .get(0);
    let eth_addresses: Vec<String> = client
        .query(
            "select address from wallet_address where chain = 'eth' union select address from hot_wallet where chain = 'eth'
              order by 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let btc_held: String = client
        .query_one("select coalesce(sum(amount), 0)::text from unspent_output where chain = 'btc'", &[])
        .await?
        .get(0);
    drop(client);
    let node = eth_tip.and(eth);
    // Tokens whose holdings the chain answered with no amount: each a difference of its own.
    let mut unreadable = Vec::new();
    'assets: for row in rows {
        let (chain, asset, contract): (String, String, Option<String>) = (row.get(0), row.get(1), row.get(2));
        let (custody, uncredited, owed) = (parse(row.get(3)), parse(row.get(4)), parse(row.get(5)));
        let held = match chain.parse::<Chain>().expect("BUG: asset.chain is checked by the table") {
            Chain::Btc => parse(&btc_held),
            Chain::Eth => {
                let (Some(node), Some(tip)) = (node, eth_tip) else {
                    skipped.push(if eth.is_none() {
                        format!("{asset}: no Ethereum node configured (--eth-rpc)")
                    } else {
                        format!("{asset}: no Ethereum block scanned yet")
                    });
                    continue;
                };
                // Our tip, or the node's if it is behind ours (it cannot answer for blocks it lacks).
                let node_tip =
                    node.block_number().await.map_err(|e| ReconcileError::Node(format!("reading its tip: {e}")))?;
                let tip = u64::try_from(tip).expect("BUG: a negative height").min(node_tip);
                let mut sum = alloy_primitives::U256::ZERO;
                for address in &eth_addresses {
                    let parsed: alloy_primitives::Address = address.parse().expect("BUG: a stored address");
                    // Ok(Err(bytes)): a token's answer that is no amount, this many bytes long.
                    let balance = match &contract {
                        None => node.balance_at(parsed, tip).await.map(Ok),
                        Some(token) => {
                            let call = custodian_withdrawals::payout::balance_of_call(
                                token.parse().expect("BUG: a stored contract"),
                                parsed,
                            );
                            node.call_at(call.to, &call.data, tip)
                                .await
                                .map(|out| custodian_withdrawals::payout::returned_u256(&out).ok_or(out.len()))
                        }
                    }
                    .map_err(|e| {
                        ReconcileError::Node(format!("reading {asset} held by {address} at block {tip}: {e}"))
                    })?;
                    // Not zero: an answer that is no amount says nothing of what we hold (a
                    // contract without code answers nothing at all).
                    let balance = match balance {
                        Ok(held) => held,
                        Err(bytes) => {
                            let token = contract.as_deref().unwrap_or_default();
                            unreadable.push(format!(
                                "{asset}: cannot read what the chain holds: the token at {token} answered \
                                 balanceOf({address}) at block {tip} with {bytes} bytes, not an amount (no contract \
                                 there, or not a token)"
                            ));
                            metrics::gauge!("custodian_reconciliation_difference", "asset" => asset.clone()).set(1.0);
                            continue 'assets;
                        }
                    };
                    sum = sum.checked_add(balance).ok_or_else(|| ReconcileError::Overflow(format!("{asset} held")))?;
                }
                SignedAmount::from(Amount::from_units(sum))
            }
        };
        lines.push(AssetLine {
            asset,
            chain: held,
            custody,
            uncredited,
            difference: sub(sub(held, custody)?, uncredited)?,
            owed,
            surplus: sub(custody, owed)?,
        });
    }
    // A difference: the chain and the ledger disagree, or customers are owed more than we hold,
    // or the chain's answer for a token is no amount.
    let mut differences: Vec<String> = lines
        .iter()
        .filter(|l| !l.difference.is_zero() || l.surplus.is_negative())
        .map(|l| {
            if !l.difference.is_zero() {
                format!(
                    "{}: the chain holds {} at our addresses, the ledger's custody is {} with {} observed and not yet \
                     credited: {} unexplained",
                    l.asset, l.chain, l.custody, l.uncredited, l.difference
                )
            } else {
                format!("{}: customers are owed {}, custody is {}", l.asset, l.owed, l.custody)
            }
        })
        .collect();
    differences.extend(unreadable);
    for line in &lines {
        metrics::gauge!("custodian_reconciliation_difference", "asset" => line.asset.clone())
            .set(if line.difference.is_zero() { 0.0 } else { 1.0 });
    }
    Ok(Reconciliation { assets: lines, differences, skipped })
}

/// [`once`] every [`INTERVAL`], each difference an alert; soon again while an asset could not be
/// read yet (its chain not scanned yet) or the reconciliation failed. Which assets it skips, and
/// why, is logged when that changes, not every round.
pub async fn periodically(eth: Option<EthNode>, pool: Pool, mut stopped: watch::Receiver<bool>) {
    let mut skipping: Vec<String> = Vec::new();
    while !*stopped.borrow() {
        let found = once(eth.as_ref(), &pool).await;
        match &found {
            Ok(found) => {
                for difference in &found.differences {
                    tracing::error!("ALERT: reconciliation: {difference}");
                }
                if found.skipped != skipping {
                    if found.skipped.is_empty() {
                        tracing::info!("reconciliation: every asset is reconciled again");
                    }
                    for skipped in &found.skipped {
                        tracing::warn!("reconciliation skips {skipped}");
                    }
                    skipping.clone_from(&found.skipped);
                }
            }
            Err(e) => tracing::warn!("reconciling the ledger with the chain failed; tried again soon: {e}"),
        }
        tokio::select! {
            _ = stopped.changed() => {}
            _ = tokio::time::sleep(next_round(eth.is_some(), &found)) => {}
        }
    }
}

/// How long until the next reconciliation: soon after a failure, or while the Ethereum node is
/// configured and an asset was skipped (nothing scanned yet: it will be); else [`INTERVAL`]. An
/// asset skipped because no node is configured stays skipped: retrying it soon reads the ledger
/// every few seconds for nothing.
fn next_round(eth_configured: bool, found: &Result<Reconciliation, ReconcileError>) -> Duration {
    match found {
        Ok(found) if eth_configured && !found.skipped.is_empty() => RETRY,
        Ok(_) => INTERVAL,
        Err(_) => RETRY,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skipping(skipped: &[&str]) -> Result<Reconciliation, ReconcileError> {
        Ok(Reconciliation {
            assets: Vec::new(),
            differences: Vec::new(),
            skipped: skipped.iter().map(|s| (*s).to_owned()).collect(),
        })
    }

    #[test]
    fn an_asset_skipped_for_want_of_a_node_waits_the_interval_one_not_scanned_yet_is_retried_soon() {
        assert_eq!(next_round(false, &skipping(&["ETH: no Ethereum node configured (--eth-rpc)"])), INTERVAL);
        assert_eq!(next_round(true, &skipping(&["ETH: no Ethereum block scanned yet"])), RETRY);
        assert_eq!(next_round(true, &skipping(&[])), INTERVAL);
        assert_eq!(next_round(false, &skipping(&[])), INTERVAL);
        assert_eq!(next_round(true, &Err(ReconcileError::Node("down".into()))), RETRY);
        assert_eq!(next_round(false, &Err(ReconcileError::Overflow("ETH".into()))), RETRY);
    }
}
