//! `custodian reconcile`: the ledger against the chain (DESIGN §9). Per asset, what the ledger says
//! we hold (`custody`) against what the chain says our addresses hold at our tip — ETH: the
//! balance and every registered token's `balanceOf` of every hot wallet and deposit address at
//! our tip's block; BTC: the unspent outputs we observed — less what the chain holds that the
//! ledger has not credited yet (canonical observations not posted: pending deposits, or money that
//! arrived before an address was ours); and what we owe customers (available plus held) against
//! custody. Exit 0 when everything is equal, 3 with each difference named.

use anyhow::Result;
use custodian_service::reconcile::{self, Reconciliation};
use serde_json::json;

use crate::exit::{invalid, Exit};
use crate::settings::Settings;

pub async fn reconcile(settings: &Settings) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let node = eth_node(settings)?;
    let Reconciliation { assets: lines, differences, skipped } = reconcile::once(node.as_ref(), &pool).await?;
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

/// The Ethereum node reconciliation reads, if one is configured.
pub fn eth_node(settings: &Settings) -> Result<Option<custodian_withdrawals::EthNode>> {
    settings
        .eth_rpc
        .as_deref()
        .map(|url| custodian_withdrawals::EthNode::with_timeout(url, settings.eth_rpc_timeout))
        .transpose()
        .map_err(|e| invalid(e.to_string()))
}
