//! Broadcast: the stored bytes of each withdrawal's live attempt go out, first time and whenever
//! the node no longer knows them, and the node's answer is classified (DESIGN §7.4). A timeout is
//! never answered by re-signing.

use std::collections::HashMap;

use alloy_primitives::{Address, B256};
use custodian_domain::withdrawal::{WithdrawalEvent, WithdrawalState};

use super::{PassReport, Recording, WorkError, Worker, UNMINED};
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
    /// mined. One nonce count per lane says which are mined already (settlement's, not sent);
    /// the node is asked whether it knows the rest, and sent what it lacks, in JSON-RPC batches.
    /// Returns the withdrawals whose live attempt the node refused as underpriced, with that
    /// attempt's hash.
    pub(super) async fn broadcast(
        &self,
        lane: &Lane,
        report: &mut PassReport,
    ) -> Result<HashMap<i64, String>, WorkError> {
        let address: Address = lane.address.parse().expect("BUG: stored hot wallet is not an address");
        let head = self.node.block_number().await?;
        let mined = self.node.nonce(address, false).await?;
        let client = self.pool.get().await?;
        let ids = sql::in_states(&client, &lane.lane, &UNMINED).await?;
        // (withdrawal, first broadcast, live attempt) for every withdrawal whose nonce is open.
        let loaded = sql::load_many(&client, &ids).await?;
        let attempts = sql::attempts_many(&client, &ids).await?;
        let mut open = Vec::new();
        for ((id, w), attempts) in ids.into_iter().zip(loaded).zip(attempts) {
            let w = w.expect("BUG: listed withdrawal has no events");
            if w.nonce.is_some_and(|nonce| nonce < mined) {
                continue;
            }
            let Some(live) = super::replacement::live(&w, &attempts) else { continue };
            open.push((id, w.state == WithdrawalState::Signed, live.clone()));
        }
        drop(client);
        let sent_before: Vec<B256> = open
            .iter()
            .filter(|(_, first, _)| !first)
            .map(|(_, _, a)| a.tx_hash.parse().expect("BUG: stored hash"))
            .collect();
        let mut known = self.node.knows_all(&sent_before).await?.into_iter();
        let to_send: Vec<_> = open
            .into_iter()
            .filter(|(_, first, _)| *first || !known.next().expect("BUG: one answer per hash"))
            .collect();
        let raws: Vec<&[u8]> = to_send.iter().map(|(_, _, a)| a.raw.as_slice()).collect();
        let answers = match self.node.send_raw_all(&raws).await {
            Ok(answers) => answers,
            Err(e) => {
                tracing::warn!(lane = %lane.lane, "broadcasts got no answer, sent again next pass: {e}");
                return Ok(HashMap::new());
            }
        };
        let mut refused = HashMap::new();
        let mut broadcast = Vec::new();
        for ((id, first, live), answer) in to_send.into_iter().zip(answers) {
            match self.classify(lane, answer, report).await? {
                Sent::Accepted if first => broadcast.push(Recording {
                    id,
                    still: Box::new(|w| w.state == WithdrawalState::Signed),
                    event: WithdrawalEvent::Broadcast { tx_hash: live.tx_hash.clone(), at_block: Some(head) },
                    movements: Vec::new(),
                }),
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
        let recorded = super::record_all(&self.pool, broadcast).await?;
        report.broadcast += recorded.iter().filter(|r| **r).count() as u64;
        Ok(refused)
    }

    /// Classifies the node's answer to a broadcast (DESIGN §7.4).
    pub(super) async fn classify(
        &self,
        lane: &Lane,
        answer: Result<B256, crate::rpc::NodeError>,
        report: &mut PassReport,
    ) -> Result<Sent, WorkError> {
        match answer {
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
