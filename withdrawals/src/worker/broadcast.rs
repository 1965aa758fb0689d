//! Broadcast: the stored bytes of each withdrawal's live attempt go out, first time and whenever
//! the node no longer knows them, and the node's answer is classified (DESIGN §7.4). A timeout is
//! never answered by re-signing.

use std::collections::HashMap;

use custodian_domain::withdrawal::{WithdrawalEvent, WithdrawalState};

use super::{PassReport, WorkError, Worker, UNMINED};
use crate::hot_wallet::Lane;
use crate::sql;

/// What broadcasting stored bytes came to.
pub(super) enum Sent {
    /// The node has them (accepted now, or already known).
    Accepted,
    /// Refused because they pay too little (underpriced, or a fee cap below the base fee): a
    /// replacement with higher fees is due.
    Underpriced,
    /// Not accepted for another reason; looked at again next pass.
    Pending,
}

/// Answers that mean the fees are too low for the node to take the transaction at all.
const UNDERPRICED: [&str; 5] = [
    "underpriced",
    "fee cap less than block base fee",
    "less than block base fee",
    "fee too low",
    "max fee per gas less than",
];

impl Worker {
    /// Sends stored bytes: first broadcasts, and again whenever the node no longer knows them.
    /// The attempt sent is the live one: the latest signed, or after a reorg the one that had
    /// mined. Returns the withdrawals whose live attempt the node refused as underpriced, with
    /// that attempt's hash.
    pub(super) async fn broadcast(
        &self,
        lane: &Lane,
        report: &mut PassReport,
    ) -> Result<HashMap<i64, String>, WorkError> {
        let head = self.node.block_number().await?;
        let client = self.pool.get().await?;
        let ids = sql::in_states(&client, &lane.lane, &UNMINED).await?;
        let mut refused = HashMap::new();
        for id in ids {
            let w = sql::load(&client, id).await?.expect("BUG: listed withdrawal has no events");
            let attempts = sql::attempts(&client, id).await?;
            let Some(live) = super::replacement::live(&w, &attempts) else { continue };
            let hash = live.tx_hash.parse().expect("BUG: stored hash");
            if w.state != WithdrawalState::Signed && self.node.knows(hash).await? {
                continue;
            }
            match self.send(lane, &live.raw, report).await? {
                Sent::Accepted if w.state == WithdrawalState::Signed => {
                    let event = WithdrawalEvent::Broadcast { tx_hash: live.tx_hash.clone(), at_block: Some(head) };
                    if self.record(id, |w| w.state == WithdrawalState::Signed, event, &[]).await? {
                        report.broadcast += 1;
                    }
                }
                Sent::Accepted => {
                    tracing::info!(withdrawal = id, tx = %live.tx_hash, "the node had lost the attempt; sent the same bytes again");
                    report.rebroadcast += 1;
                }
                Sent::Underpriced => {
                    refused.insert(id, live.tx_hash.clone());
                }
                Sent::Pending => {}
            }
        }
        Ok(refused)
    }

    /// Sends bytes and classifies the node's answer (DESIGN §7.4).
    pub(super) async fn send(&self, lane: &Lane, raw: &[u8], report: &mut PassReport) -> Result<Sent, WorkError> {
        match self.node.send_raw(raw).await {
            Ok(_) => Ok(Sent::Accepted),
            Err(e) => {
                let message = e.message();
                if e.is_already_known() {
                    Ok(Sent::Accepted)
                } else if message.contains("nonce too low") {
                    // Benign for the broadcaster (settlement decides), but outside a slot that was
                    // just settled it is the signature of double allocation: count it.
                    metrics::counter!("custodian_nonce_too_low_total", "address" => lane.address.clone()).increment(1);
                    Ok(Sent::Pending)
                } else if message.contains("insufficient funds") {
                    self.pause(lane, &format!("hot wallet cannot pay: {e}"), report).await?;
                    Ok(Sent::Pending)
                } else if UNDERPRICED.iter().any(|m| message.contains(m)) {
                    tracing::info!(lane = %lane.lane, "broadcast refused as underpriced; a replacement is due: {e}");
                    Ok(Sent::Underpriced)
                } else {
                    // Transport errors and the rest wait for the next pass.
                    tracing::warn!(lane = %lane.lane, "broadcast not accepted, retried next pass: {e}");
                    Ok(Sent::Pending)
                }
            }
        }
    }
}
