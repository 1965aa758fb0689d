//! `custodian reconcile`: the ledger against the chain (DESIGN §9). Per asset, what the ledger says
//! we hold (`custody`) against what the chain says our addresses hold at our tip — ETH: the
//! balance and every registered token's `balanceOf` of every hot wallet and deposit address at
//! our tip's block; BTC: the unspent outputs we observed — less what the chain holds that the
//! ledger has not credited yet (canonical observations not posted: pending deposits, or money that
//! arrived before an address was ours); and what we owe customers (available plus held) against
//! custody. Exit 0 when everything is equal, 3 with each difference named.

use anyhow::{Context, Result};
use custodian_domain::{Amount, Chain, SignedAmount};
use serde::Serialize;
use serde_json::json;

use crate::exit::Exit;
use crate::settings::Settings;

/// One asset's figures, in smallest units.
#[derive(Debug, Serialize)]
struct AssetLine {
    asset: String,
    /// What the chain says our addresses hold.
    chain: SignedAmount,
    /// The ledger's `custody`.
    custody: SignedAmount,
    /// Observed on our canonical chain, not credited: the chain holds it, the ledger does not yet.
    uncredited: SignedAmount,
    /// chain − custody − uncredited.
    difference: SignedAmount,
    /// What customers are owed: available plus held.
    owed: SignedAmount,
    /// custody − owed: the treasury's own (negative: we owe more than we hold).
    surplus: SignedAmount,
}

/// `a - b`, exact over the whole range of balances (a token's may be anything below 2^256).
fn sub(a: SignedAmount, b: SignedAmount) -> Result<SignedAmount> {
    a.checked_sub(b).with_context(|| format!("reconciling {a} - {b}"))
}

fn parse(text: &str) -> SignedAmount {
    text.parse().expect("BUG: the database returned a non-integer amount")
}

/// What one reconciliation found.
#[derive(Debug, Serialize)]
pub struct Reconciliation {
    assets: Vec<AssetLine>,
    /// Each difference, named.
    pub differences: Vec<String>,
    /// Assets that could not be read (no node configured, nothing scanned yet).
    pub skipped: Vec<String>,
}

pub async fn reconcile(settings: &Settings) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let Reconciliation { assets: lines, differences, skipped } =
        run(settings.eth_rpc.as_deref(), settings.eth_rpc_timeout, &pool).await?;
    if settings.json {
        super::print_json(&json!({
            "reconciled": differences.is_empty(),
            "assets": lines,
            "differences": differences,
            "skipped": skipped,
        }))?;
    } else {
        for l in &lines {
            println!(
                "{:<10} chain {:>24}  custody {:>24}  uncredited {:>18}  difference {:>12}  owed {:>24}",
                l.asset, l.chain, l.custody, l.uncredited, l.difference, l.owed
            );
        }
        for s in &skipped {
            println!("SKIPPED {s}");
        }
        for d in &differences {
            println!("DIFFERENCE {d}");
        }
    }
    Ok(if differences.is_empty() { Exit::Success } else { Exit::Verification })
}

/// Reconciles once and sets `custodian_reconciliation_difference{asset}` (1 when the asset's
/// chain and ledger disagree, 0 when equal). Used by the command and, periodically, by `serve`.
pub async fn run(
    eth_rpc: Option<&str>,
    eth_rpc_timeout: std::time::Duration,
    pool: &custodian_store::Pool,
) -> Result<Reconciliation> {
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
    let node = match (eth_rpc, eth_tip) {
        (Some(url), Some(_)) => Some(
            custodian_withdrawals::EthNode::with_timeout(url, eth_rpc_timeout)
                .map_err(|e| crate::exit::invalid(e.to_string()))?,
        ),
        _ => None,
    };
    for row in rows {
        let (chain, asset, contract): (String, String, Option<String>) = (row.get(0), row.get(1), row.get(2));
        let (custody, uncredited, owed) = (parse(row.get(3)), parse(row.get(4)), parse(row.get(5)));
        let held = match chain.parse::<Chain>().map_err(|e| anyhow::anyhow!(e))? {
            Chain::Btc => parse(&btc_held),
            Chain::Eth => {
                let (Some(node), Some(tip)) = (&node, eth_tip) else {
                    skipped.push(format!("{asset}: no Ethereum node configured (--eth-rpc) or nothing scanned yet"));
                    continue;
                };
                // Our tip, or the node's if it is behind ours (it cannot answer for blocks it lacks).
                let node_tip = node.block_number().await.context("reading the Ethereum node's tip")?;
                let tip = u64::try_from(tip).expect("BUG: a negative height").min(node_tip);
                let mut sum = alloy_primitives::U256::ZERO;
                for address in &eth_addresses {
                    let parsed: alloy_primitives::Address = address.parse().expect("BUG: a stored address");
                    let balance = match &contract {
                        None => node.balance_at(parsed, tip).await,
                        Some(token) => {
                            let call = custodian_withdrawals::payout::balance_of_call(
                                token.parse().expect("BUG: a stored contract"),
                                parsed,
                            );
                            node.call_at(call.to, &call.data, tip)
                                .await
                                .map(|out| custodian_withdrawals::payout::returned_u256(&out).unwrap_or_default())
                        }
                    }
                    .with_context(|| format!("reading {asset} held by {address} at block {tip}"))?;
                    sum = sum.checked_add(balance).with_context(|| format!("{asset} held beyond 2^256 - 1"))?;
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
    // A difference: the chain and the ledger disagree, or customers are owed more than we hold.
    let differences: Vec<String> = lines
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
    for line in &lines {
        metrics::gauge!("custodian_reconciliation_difference", "asset" => line.asset.clone())
            .set(if line.difference.is_zero() { 0.0 } else { 1.0 });
    }
    Ok(Reconciliation { assets: lines, differences, skipped })
}
