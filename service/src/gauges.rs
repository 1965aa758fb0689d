//! Gauges read on a timer: withdrawals per state, paused lanes, the webhook backlog (sealing the
//! history as it goes), and each hot wallet's balance against its low-balance threshold. A failed
//! read leaves a gauge as it was; none of these loops stops the service.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use custodian_store::Pool;
use custodian_withdrawals::{hot_wallet, EthNode};
use tokio::sync::watch;

/// How often projection gauges (withdrawals per state, paused lanes) are refreshed.
const INTERVAL: Duration = Duration::from_secs(5);

/// How often the hot wallets' balances are read for their gauges.
const HOT_WALLET_INTERVAL: Duration = Duration::from_secs(30);

/// `[metrics] low_balance`: per lane, the balance of its native coin below which it is low, in
/// units of 10^-18 of the coin (ETH's wei; a BTC lane's threshold is divided down to satoshis).
pub type Thresholds = HashMap<String, alloy_primitives::U256>;

/// Withdrawals per state and paused lanes, read from the projections.
pub async fn projections(pool: Pool, mut stopped: watch::Receiver<bool>) {
    while !*stopped.borrow() {
        if let Ok(client) = pool.get().await {
            // Every state, zero included: a state that empties must read 0, not its last count.
            let per_state =
                "select s.state, count(w.id) from unnest(array['requested', 'awaiting_approval', 'rejected',
                                     'signed', 'broadcast', 'mined', 'confirmed', 'failed_onchain', 'cancel_requested',
                                     'cancelled', 'needs_review']) as s (state)
                               left join withdrawal w on w.state = s.state group by s.state";
            if let Ok(rows) = client.query(per_state, &[]).await {
                for row in rows {
                    metrics::gauge!("custodian_withdrawals", "state" => row.get::<_, String>(0))
                        .set(row.get::<_, i64>(1) as f64);
                }
            }
            if let Ok(row) = client.query_one("select count(*) from hot_wallet where paused_at is not null", &[]).await
            {
                metrics::gauge!("custodian_paused_lanes").set(row.get::<_, i64>(0) as f64);
            }
            if let Err(e) = custodian_api::webhooks::record_gauges(&client).await {
                tracing::warn!("reading the webhook backlog failed; retried next round: {e}");
            }
            // The history's hash chain follows every writer (withdrawals, operator actions too).
            if let Err(e) = custodian_projections::seals::seal(&client).await {
                tracing::warn!("sealing the history failed; retried next round: {e}");
            }
        }
        tokio::select! {
            _ = stopped.changed() => {}
            _ = tokio::time::sleep(INTERVAL) => {}
        }
    }
}

/// Each hot wallet's balance of its native coin as `custodian_hot_wallet_balance{chain,lane}`
/// (smallest units: ETH from the node at its latest block, BTC the lane's spendable coins), and
/// `custodian_hot_wallet_low{lane}` against `[metrics] low_balance`. Node calls happen outside
/// any transaction; a failed read leaves the gauge as it was.
pub async fn hot_wallets(pool: Pool, eth: Option<EthNode>, thresholds: Thresholds, mut stopped: watch::Receiver<bool>) {
    let mut alerted: HashSet<String> = HashSet::new();
    while !*stopped.borrow() {
        let mut balances: Vec<(&'static str, String, alloy_primitives::U256)> = Vec::new();
        if let Ok(client) = pool.get().await {
            if let Ok(lanes) = hot_wallet::btc_lanes(&client).await {
                for lane in lanes {
                    if let Ok(spendable) = lane.spendable.parse::<alloy_primitives::U256>() {
                        balances.push(("btc", lane.lane, spendable));
                    }
                }
            }
            let eth_lanes = hot_wallet::lanes(&client).await.unwrap_or_default();
            drop(client);
            if let Some(node) = &eth {
                for lane in eth_lanes {
                    if let Ok(balance) = node.balance(lane.address.as_alloy()).await {
                        balances.push(("eth", lane.lane.to_string(), balance));
                    }
                }
            }
        }
        for (chain, lane, balance) in balances {
            metrics::gauge!("custodian_hot_wallet_balance", "chain" => chain, "lane" => lane.clone())
                .set(u128::try_from(balance).unwrap_or(u128::MAX) as f64);
            let Some(threshold) = thresholds.get(&lane) else { continue };
            // Thresholds are parsed to 18 decimals; BTC counts in 8.
            let threshold =
                if chain == "btc" { *threshold / alloy_primitives::U256::from(10_000_000_000u64) } else { *threshold };
            let low = balance < threshold;
            metrics::gauge!("custodian_hot_wallet_low", "lane" => lane.clone()).set(if low { 1.0 } else { 0.0 });
            if low && alerted.insert(lane.clone()) {
                tracing::error!(chain, lane = %lane, %balance, %threshold, "ALERT: hot wallet below its low-balance threshold; top it up");
            } else if !low {
                alerted.remove(&lane);
            }
        }
        tokio::select! {
            _ = stopped.changed() => {}
            _ = tokio::time::sleep(HOT_WALLET_INTERVAL) => {}
        }
    }
}
