//! Broadcast: the stored bytes of each withdrawal's live attempt go out, first time and whenever
//! the node no longer knows them, and the node's answer is classified (DESIGN §7.4). A timeout is
//! never answered by re-signing.

use std::collections::HashMap;

use alloy_primitives::B256;
use custodian_domain::withdrawal::{WithdrawalEvent, WithdrawalState};
use custodian_domain::{Nonce, TxHash};

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
    /// mined. The lane's mined and pending nonce counts say which are mined already
    /// (settlement's, not sent) and which the node's pool holds; the node is asked whether it
    /// knows the rest, and sent what it lacks, in JSON-RPC batches.
    /// Returns the withdrawals whose live attempt the node refused as underpriced, with that
    /// attempt's hash.
    pub(super) async fn broadcast(
        &self,
        lane: &Lane,
        report: &mut PassReport,
    ) -> Result<HashMap<i64, TxHash>, WorkError> {
        let address = lane.address.as_alloy();
        let (mined, pending) = futures::try_join!(self.node.nonce(address, false), self.node.nonce(address, true))?;
        let client = self.pool.get().await?;
        // Which withdrawals need a look: a first broadcast; a nonce the node's pool lacks (at or
        // past its pending count); or a nonce it has (mined count to pending count) for a
        // withdrawal with siblings, where what the node holds may be a sibling rather than the
        // live attempt. A lone attempt whose nonce the pool holds is known: asking the node for
        // it by hash would cost it a signature recovery for nothing, at every pass.
        let candidates = client
            .query(
                "select w.id, w.nonce, w.state = 'signed',
                        (select count(*) from withdrawal_attempt a where a.withdrawal_id = w.id)
                   from withdrawal w
                  where w.chain = 'eth' and w.lane = $1 and w.state = any($2) order by w.id",
                &[&lane.lane.as_str(), &UNMINED.iter().map(|s| s.as_str()).collect::<Vec<_>>()],
            )
            .await?;
        let ids: Vec<i64> = candidates
            .iter()
            .filter(|r| {
                let nonce = r.get::<_, Option<i64>>(1).map(Nonce::from_stored);
                let (first, siblings) = (r.get::<_, bool>(2), r.get::<_, i64>(3) > 1);
                match nonce {
                    None => true,
                    Some(nonce) if nonce < mined => false,
                    Some(nonce) => first || nonce >= pending || siblings,
                }
            })
            .map(|r| r.get(0))
            .collect();
        // (withdrawal, first broadcast, live attempt) for every withdrawal whose nonce is open.
        let loaded = sql::load_many(&client, &ids).await?;
        let attempts = sql::attempts_many(&client, &ids).await?;
        let mut open = Vec::new();
        for ((id, w), attempts) in ids.into_iter().zip(loaded).zip(attempts) {
            let w = w.expect("BUG: listed withdrawal has no events");
            let Some(live) = super::replacement::live(&w, &attempts) else { continue };
            open.push((id, w.state() == WithdrawalState::Signed, live.clone()));
        }
        drop(client);
        let sent_before: Vec<B256> = open
            .iter()
            .filter(|(_, first, _)| !first)
            .map(|(_, _, a)| a.tx_hash.eth().expect("BUG: an ETH attempt"))
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
        // A bump is due `bump_after_blocks` after acceptance: counted from the head after the
        // node answered, not from the one read before this pass's reads and sends, which a busy
        // worker may have taken blocks earlier.
        // Unanswered, the first broadcasts are recorded by the next pass (the node then knows them).
        let accepted_at = if to_send.iter().any(|(_, first, _)| *first) { self.node.block_number().await? } else { 0 };
        let mut refused = HashMap::new();
        let mut broadcast = Vec::new();
        for ((id, first, live), answer) in to_send.into_iter().zip(answers) {
            match self.classify(lane, answer, report).await? {
                Sent::Accepted if first => broadcast.push(Recording {
                    id,
                    still: Box::new(|w| w.state() == WithdrawalState::Signed),
                    event: WithdrawalEvent::Broadcast { tx_hash: live.tx_hash, at_block: Some(accepted_at) },
                }),
                Sent::Accepted => {
                    tracing::info!(withdrawal = %id, tx = %live.tx_hash, "the node had lost the attempt; sent the same bytes again");
                    report.rebroadcast += 1;
                }
                Sent::Underpriced => {
                    refused.insert(id, live.tx_hash);
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
                    metrics::counter!("custodian_nonce_too_low_total", "address" => lane.address.to_lowercase_hex())
                        .increment(1);
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
