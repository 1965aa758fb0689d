//! Value-dependent confirmation policy: small deposits are fast, large ones wait.
//!
//! A deposit needs the confirmations of its asset's tier with the largest `min_amount` not above
//! what its transaction pays the same account in that asset (splitting a payment does not make it
//! faster). An asset without its own tiers uses the chain's deepest tier, never a native tier read
//! in token units; a BTC coinbase output needs 100 blocks whatever the tier. The `deposit_status`
//! view implements the lookup; this module edits and lists the tiers.

use alloy_primitives::U256;
use custodian_domain::{Amount, Chain};
use deadpool_postgres::GenericClient;
use serde::Serialize;

/// One tier as configured.
#[derive(Debug, Clone, Serialize)]
pub struct Tier {
    /// Chain.
    pub chain: String,
    /// Asset key.
    pub asset: String,
    /// Asset symbol.
    pub symbol: String,
    /// Smallest amount the tier applies to, in smallest units.
    pub min_amount: Amount,
    /// The same in whole units.
    pub min_amount_display: String,
    /// Confirmations required.
    pub confirmations: i32,
}

/// Sets (inserts or replaces) the tier starting at `min_amount` for `asset` on `chain`.
pub async fn set_tier<C: GenericClient>(
    client: &C,
    chain: Chain,
    asset: &str,
    min_amount: Amount,
    confirmations: u32,
    by: &str,
) -> Result<(), tokio_postgres::Error> {
    let confirmations = i32::try_from(confirmations).expect("BUG: confirmations validated by the caller");
    client.execute(SET_TIER, &[&chain.as_str(), &asset, &min_amount.units(), &confirmations, &by]).await?;
    Ok(())
}

/// The tier and its `policy_set` operator action, in one statement.
const SET_TIER: &str = "
with tier as (
    insert into confirmation_policy (chain, asset, min_amount, confirmations) values ($1, $2, $3, $4)
    on conflict (chain, asset, min_amount) do update set confirmations = excluded.confirmations
    returning chain, asset, min_amount, confirmations
)
insert into operator_action (action, principal, details)
select 'policy_set', $5, jsonb_build_object('chain', chain, 'asset', asset, 'min_amount', min_amount::text,
                                            'confirmations', confirmations)
  from tier";

/// Every tier, by chain, asset and amount.
pub async fn tiers<C: GenericClient>(client: &C) -> Result<Vec<Tier>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select p.chain, p.asset, a.symbol, a.decimals, p.min_amount, p.confirmations
               from confirmation_policy p join asset a on a.asset = p.asset
              order by p.chain, p.asset, p.min_amount",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let decimals = u8::try_from(r.get::<_, i16>(3)).expect("BUG: decimals outside 0..=77");
            let min_amount = Amount::from_units(r.get::<_, U256>(4));
            Tier {
                chain: r.get(0),
                asset: r.get(1),
                symbol: r.get(2),
                min_amount,
                min_amount_display: min_amount.to_decimal_string(decimals),
                confirmations: r.get(5),
            }
        })
        .collect())
}

/// Confirmations the policy requires for `amount` of `asset` on `chain`.
pub async fn required_confirmations<C: GenericClient>(
    client: &C,
    chain: Chain,
    asset: &str,
    amount: Amount,
) -> Result<Option<i32>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "select coalesce(
                 (select cp.confirmations from confirmation_policy cp
                   where cp.chain = $1 and cp.asset = $2 and cp.min_amount <= $3
                   order by cp.min_amount desc limit 1),
                 (select max(cp.confirmations) from confirmation_policy cp
                   where cp.chain = $1 and cp.asset = case $1 when 'eth' then 'ETH' else 'BTC' end))",
            &[&chain.as_str(), &asset, &amount.units()],
        )
        .await?;
    Ok(row.and_then(|r| r.get(0)))
}
