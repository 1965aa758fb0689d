//! `custodian deposits`: observations with their block, confirmations and whether orphaned.

use anyhow::{Context, Result};
use custodian_domain::Chain;
use custodian_store::ownership;

use crate::exit::{invalid, Exit};
use crate::settings::Settings;

/// Observations newest first, a page at a time: a full page says on stderr where the next one
/// starts (`--before`), so nothing is cut off silently.
pub async fn list(
    settings: &Settings,
    account: Option<&str>,
    chain: Option<Chain>,
    before: Option<i64>,
    limit: i64,
) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let client = pool.get().await.context("taking a database connection")?;
    let account_id = match account {
        Some(key) => Some(ownership::find_account(&client, key).await.map_err(|e| invalid(e.to_string()))?.id),
        None => None,
    };
    let deposits = custodian_projections::deposits::list(&client, account_id, chain, before, limit)
        .await
        .context("listing deposits")?;
    let full = i64::try_from(deposits.len()).is_ok_and(|n| n == limit);
    if let Some(last) = deposits.last().filter(|_| full) {
        eprintln!("{limit} deposits shown; the next page: --before {}", last.id);
    }
    if settings.json {
        return super::print_json(&deposits).map(|()| Exit::Success);
    }
    if deposits.is_empty() {
        println!("no deposits observed");
    }
    for d in &deposits {
        let reversed = !d.reversed.units().is_zero();
        let state = if d.orphaned {
            "orphaned".to_owned()
        } else if d.posted && !d.recredited.units().is_zero() {
            "credited, reversed, re-credited".to_owned()
        } else if d.posted {
            "credited".to_owned()
        } else if reversed {
            "reversed".to_owned()
        } else if d.confirmed {
            "confirmed".to_owned()
        } else {
            format!("pending {}/{}", d.confirmations, d.required_confirmations.unwrap_or(0))
        };
        println!(
            "{:<4} {:>8} {} {}:{}:{} {} {} -> {} [{}]",
            d.chain,
            d.height,
            d.block_hash.to_string().get(..12).unwrap_or_default(),
            d.tx_hash,
            d.kind,
            d.output_index,
            d.amount_display,
            d.symbol,
            d.account_ref.clone().unwrap_or_else(|| d.address.stored()),
            state
        );
    }
    Ok(Exit::Success)
}
