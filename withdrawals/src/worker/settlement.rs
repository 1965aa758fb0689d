//! Settlement: which attempt mined (keyed on the lane's mined nonce count), what the mined bytes
//! did compared with the intents, confirmation depth, receipts of tokens, reorgs; and the cursor
//! check against the chain's pending nonce.

use alloy_primitives::{Address, B256};
use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::{Amount, BlockHash, Nonce, TxHash};

use super::{PassReport, Recording, WorkError, Worker, UNMINED};
use crate::hot_wallet::Lane;
use crate::payout::{self, cancel_call, classify, payout_call, token_of, token_paid};
use crate::rpc::Receipt;
use crate::sql::{self, Intent};

impl Worker {
    /// Which attempt mined, once the address's mined nonce count passes a withdrawal's nonce;
    /// then confirmation depth, what the mined bytes did, and reorgs of mined attempts.
    pub(super) async fn settle(&self, lane: &Lane, report: &mut PassReport) -> Result<(), WorkError> {
        let address = lane.address.as_alloy();
        // The mined count is read at one block, whose hash is read again before concluding that
        // a nonce was consumed by something we did not sign: a reorg (or a node behind a load
        // balancer answering from another block) between the count and the receipts is not
        // evidence, and waits for the next pass.
        let head = self.node.block_number().await?;
        let head_hash = self.node.block_hash(head).await?;
        let mined_count = self.node.nonce_at(address, head).await?;
        let client = self.pool.get().await?;
        // Receipts only for the nonces the count says are used, every attempt's in one batch;
        // the streams of the rest are not even read.
        let mut used = Vec::new();
        let mut used_ids = Vec::new();
        for (id, nonce) in sql::nonces_in_states(&client, lane.lane.as_str(), &UNMINED).await? {
            let Some(nonce) = nonce.filter(|n| *n < mined_count) else {
                self.clear_suspect(id);
                continue;
            };
            used.push((id, nonce));
            used_ids.push(id);
        }
        let used: Vec<(i64, Nonce, Vec<sql::Attempt>)> = used
            .into_iter()
            .zip(sql::attempts_many(&client, &used_ids).await?)
            .map(|((id, nonce), attempts)| (id, nonce, attempts))
            .collect();
        let hashes: Vec<B256> = used
            .iter()
            .flat_map(|(_, _, attempts)| attempts.iter().map(|a| a.tx_hash.eth().expect("BUG: an ETH attempt")))
            .collect();
        let mut receipts = self.node.receipts(&hashes).await?.into_iter();
        let mut mined_now = Vec::new();
        for (id, nonce, attempts) in used {
            let mut found = None;
            for attempt in attempts {
                let receipt = receipts.next().expect("BUG: one receipt per hash");
                if let (None, Some(receipt)) = (&found, receipt) {
                    found = Some((attempt, receipt));
                }
            }
            match found {
                Some((attempt, receipt)) => {
                    self.clear_suspect(id);
                    mined_now.push(Recording {
                        id,
                        still: Box::new(|w| UNMINED.contains(&w.state())),
                        event: WithdrawalEvent::Mined {
                            tx_hash: attempt.tx_hash,
                            block_hash: BlockHash::Eth(receipt.block_hash),
                            block_number: receipt.block_number,
                        },
                    });
                }
                None if self.node.block_hash(head).await? != head_hash => {
                    tracing::info!(withdrawal = %id, "the chain moved while settling; looked at again next pass");
                }
                None if !self.seen_again(id, head) => {
                    tracing::warn!(
                        withdrawal = %id,
                        %nonce,
                        "the chain counts our nonce as used but none of our attempts has \
                        a receipt; looked at again at a later block before raising it"
                    );
                }
                None => {
                    let reason = format!(
                        "nonce {nonce} of {} was used by a transaction this service did not sign",
                        lane.address.to_lowercase_hex()
                    );
                    metrics::counter!("custodian_unknown_transaction_alerts_total", "address" => lane.address.to_lowercase_hex())
                        .increment(1);
                    tracing::error!(withdrawal = %id, lane = %lane.lane, "ALERT: {reason}");
                    let pause = format!("needs review: {reason}");
                    self.review(lane, id, |w| UNMINED.contains(&w.state()), &reason, &pause, true, report).await?;
                }
            }
        }
        let recorded = super::record_all(&self.pool, mined_now).await?;
        report.mined += recorded.iter().filter(|r| **r).count() as u64;
        let mined_ids = sql::in_state(&client, lane.lane.as_str(), WithdrawalState::Mined, None).await?;
        let mined: Vec<Withdrawal> = sql::load_many(&client, &mined_ids)
            .await?
            .into_iter()
            .map(|w| w.expect("BUG: listed withdrawal has no events"))
            .collect();
        let mut mined_attempts = sql::attempts_many(&client, &mined_ids).await?.into_iter();
        let hashes: Vec<B256> = mined
            .iter()
            .map(|w| w.tx_hash().and_then(TxHash::eth).expect("BUG: an ETH withdrawal mined without a hash"))
            .collect();
        let receipts = self.node.receipts(&hashes).await?;
        let mut settled = Vec::new();
        let mut reviews = Vec::new();
        for (w, receipt) in mined.into_iter().zip(receipts) {
            let attempts_of_this = mined_attempts.next().expect("BUG: one attempt list per withdrawal");
            let id = w.id();
            let tx_hash = w.tx_hash().expect("BUG: mined without a hash");
            let mined_in = w.mined_block_hash().expect("BUG: mined without a block");
            let still_mined_there =
                move |w: &Withdrawal| w.state() == WithdrawalState::Mined && w.mined_block_hash() == Some(mined_in);
            let Some(receipt) = receipt.filter(|r| BlockHash::Eth(r.block_hash) == mined_in) else {
                // Unmined only when the chain no longer has that block at that height: a node that
                // lost a receipt (a lagging replica, an answer from a stale block) is not a reorg.
                let height = w.mined_block_number().expect("BUG: mined without a height");
                if self.node.block_hash(height).await?.map(BlockHash::Eth) == Some(mined_in) {
                    tracing::warn!(withdrawal = %id, %tx_hash, "the node has the mined block but no receipt for it; asked again next pass");
                    continue;
                }
                tracing::warn!(withdrawal = %id, %tx_hash, block = %mined_in, "mined block reorged out; the mined bytes go out again");
                if self
                    .record(id.get(), &still_mined_there, WithdrawalEvent::Unmined { tx_hash, block_hash: mined_in })
                    .await?
                {
                    report.unmined += 1;
                }
                continue;
            };
            if head + 1 < receipt.block_number + self.config.confirmations {
                continue;
            }
            let attempts = attempts_of_this;
            let mined = attempts.iter().find(|a| a.tx_hash == tx_hash).expect("BUG: mined an attempt we do not hold");
            let event = outcome(&w, address, mined, &receipt, mined_in);
            if let WithdrawalEvent::NeedsReview { reason } = event {
                reviews.push((id.get(), still_mined_there, reason));
                continue;
            }
            let short_paid = matches!(&event, WithdrawalEvent::FailedOnchain { .. }) && receipt.success;
            settled.push((
                Recording { id: id.get(), still: Box::new(still_mined_there), event: event.clone() },
                event,
                short_paid,
            ));
        }
        let (recordings, outcomes): (Vec<_>, Vec<_>) =
            settled.into_iter().map(|(recording, event, short_paid)| (recording, (event, short_paid))).unzip();
        let recorded = super::record_all(&self.pool, recordings).await?;
        // Each with its lane's pause; after the others, which a failure here must not hold up.
        for (id, still, reason) in reviews {
            let pause = "a mined attempt pays something no intent of its withdrawal asked for";
            self.review(lane, id, still, &reason, pause, false, report).await?;
        }
        for ((event, short_paid), done) in outcomes.into_iter().zip(recorded) {
            if !done {
                continue;
            }
            match &event {
                WithdrawalEvent::Cancelled { .. } => report.cancelled += 1,
                WithdrawalEvent::Confirmed { .. } => report.confirmed += 1,
                WithdrawalEvent::FailedOnchain { .. } => report.failed_onchain += 1,
                other => unreachable!("BUG: a settlement recorded as {}", other.event_type()),
            }
            if short_paid {
                report.short_paid += 1;
            }
        }
        self.reorged_past_depth(lane, &client, head, mined_count, report).await?;
        Ok(())
    }

    /// Confirmed withdrawals whose transaction the chain no longer holds (their nonce is not
    /// counted any more: a reorg deeper than the confirmation depth) go back to `needs_review`
    /// with an alert, and the lane pauses. Only the lane's tail of nonces is read (the
    /// allocation's primary key), and, as for any consumed-nonce evidence, only a second sighting
    /// at a later block counts.
    async fn reorged_past_depth(
        &self,
        lane: &Lane,
        client: &deadpool_postgres::Object,
        head: u64,
        mined_count: Nonce,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        let gone = client
            .query(
                "select n.withdrawal_id, n.nonce from nonce_allocation n join withdrawal w on w.id = n.withdrawal_id
                  where n.chain = 'eth' and n.from_address = $1 and n.nonce >= $2 and w.state = 'confirmed'
                  order by n.nonce",
                &[&lane.address.to_lowercase_hex(), &mined_count.stored()],
            )
            .await?;
        for row in gone {
            let (id, nonce): (i64, i64) = (row.get(0), row.get(1));
            if !self.seen_again(id, head) {
                continue;
            }
            let w = sql::load(client, id).await?.expect("BUG: listed withdrawal has no events");
            let reason = format!(
                "confirmed in block {} (height {}), but the chain no longer holds its transaction: nonce {nonce} is not \
                 counted at block {head} (a reorg deeper than the confirmation depth of {})",
                w.mined_block_hash().map_or("?".to_owned(), |h| h.to_string()),
                w.mined_block_number().map_or("?".to_owned(), |h| h.to_string()),
                self.config.confirmations
            );
            metrics::counter!("custodian_deep_reorg_alerts_total", "lane" => lane.lane.to_string()).increment(1);
            tracing::error!(withdrawal = %id, lane = %lane.lane, "ALERT: {reason}");
            let pause = format!("needs review: {reason}");
            self.review(lane, id, |w| w.state() == WithdrawalState::Confirmed, &reason, &pause, false, report).await?;
        }
        Ok(())
    }

    /// Forgets a suspicion the chain no longer supports: a later single answer must not count as
    /// its second sighting.
    fn clear_suspect(&self, id: i64) {
        self.suspects.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&id);
    }

    /// Whether `id` was already suspect at a head below `head` (and records it as suspect).
    fn seen_again(&self, id: i64, head: u64) -> bool {
        let mut suspects = self.suspects.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match suspects.get(&id) {
            Some(first) if *first < head => {
                suspects.remove(&id);
                true
            }
            Some(_) => false,
            None => {
                suspects.insert(id, head);
                false
            }
        }
    }

    /// A pending nonce above our cursor means the key signed something we did not allocate; one
    /// below it with nothing of ours in flight means transactions we recorded are not on chain.
    pub(super) async fn check_cursor(&self, lane: &Lane, report: &mut PassReport) -> Result<(), WorkError> {
        let address = lane.address.as_alloy();
        let pending = self.node.nonce(address, true).await?;
        // Read our cursor after the node: every nonce the node has seen from us was committed
        // before it was sent, so a cursor read now covers it (a cursor read earlier, with other
        // workers allocating meanwhile, would not).
        let row = self
            .pool
            .get()
            .await?
            .query_one(
                "select next_nonce,
                        exists (select 1 from withdrawal
                                 where chain = 'eth' and lane = $1
                                   and state in ('signed', 'broadcast', 'cancel_requested', 'mined'))
                   from hot_wallet where chain = 'eth' and lane = $1",
                &[&lane.lane.as_str()],
            )
            .await?;
        let (next, in_flight): (i64, bool) = (row.get(0), row.get(1));
        let next = Nonce::from_stored(next);
        if pending > next {
            let reason =
                format!("chain nonce {pending} is above our next nonce {next}: the key was used outside the service");
            metrics::counter!("custodian_unknown_transaction_alerts_total", "address" => lane.address.to_lowercase_hex())
                .increment(1);
            self.pause_for_resync(lane, &reason, report).await?;
        } else if pending < next && !in_flight {
            metrics::counter!("custodian_nonce_gap_alerts_total", "lane" => lane.lane.to_string()).increment(1);
            report.nonce_gaps.push(format!("{}: chain nonce {pending}, ours {next}", lane.lane));
            tracing::error!(
                lane = %lane.lane, %pending, %next,
                "ALERT: the chain's nonce is below our next nonce with nothing of ours in flight: transactions we \
                 recorded as settled are not on this chain (a reorg deeper than the confirmation depth, or another \
                 node); see `custodian withdrawals list --state needs_review` and `hot-wallet resync`"
            );
        }
        Ok(())
    }
}

/// What a mined attempt past the confirmation depth comes to, decided by decoding its bytes
/// against the withdrawal's intents (never by a label): a cancel mined → cancelled; the payout
/// mined with status 1 and, for a token, its `Transfer` of the whole amount from our hot wallet to
/// the destination in the receipt → confirmed; status 0 or a token that paid less (or nothing) →
/// failed on chain, the fee charged and the hold released; bytes matching neither → needs review.
fn outcome(
    w: &Withdrawal,
    hot_wallet: Address,
    mined: &sql::Attempt,
    receipt: &Receipt,
    block_hash: BlockHash,
) -> WithdrawalEvent {
    let tx_hash = mined.tx_hash;
    let tx = payout::decode(&mined.raw);
    match classify(&tx, &payout_call(w), &cancel_call(hot_wallet)) {
        Some(intent) => {
            if intent != mined.intent {
                // A label recorded before intents were (a bump of a cancel was once called a
                // bump): the bytes decide, and the disagreement is logged.
                tracing::warn!(withdrawal = %w.id(), %tx_hash, recorded = mined.intent.as_str(), decoded = intent.as_str(),
                    "the mined attempt's recorded intent disagrees with its bytes; settled by the bytes");
            }
            settle_as(w, intent, hot_wallet, tx_hash, block_hash, receipt)
        }
        None => {
            let reason = format!(
                "attempt {tx_hash} mined, but its bytes pay neither the withdrawal ({}) nor a cancel",
                w.destination().stored()
            );
            tracing::error!(withdrawal = %w.id(), "ALERT: {reason}");
            WithdrawalEvent::NeedsReview { reason }
        }
    }
}

/// The outcome of `intent` mined with `receipt`.
fn settle_as(
    w: &Withdrawal,
    intent: Intent,
    hot_wallet: Address,
    tx_hash: TxHash,
    block_hash: BlockHash,
    receipt: &Receipt,
) -> WithdrawalEvent {
    let fee = Amount::from_units(receipt.fee);
    if intent == Intent::Cancel {
        return WithdrawalEvent::Cancelled { tx_hash: Some(tx_hash), fee, by: None };
    }
    if !receipt.success {
        return WithdrawalEvent::FailedOnchain { tx_hash, block_hash, fee };
    }
    if let Some(token) = token_of(w.asset()) {
        let destination = crate::payout::eth_destination(w);
        let paid = token_paid(&receipt.logs, token, hot_wallet, destination);
        if paid != w.amount().units() {
            metrics::counter!("custodian_token_payout_mismatch_total", "asset" => w.asset().key()).increment(1);
            tracing::error!(
                withdrawal = %w.id(), %tx_hash, asset = %w.asset(), asked = %w.amount().units(), paid = %paid,
                "ALERT: the token's transfer succeeded but its Transfer events pay the destination {} of {}: \
                 failed on chain, the hold released; reconcile the hot wallet's token balance",
                paid, w.amount().units()
            );
            return WithdrawalEvent::FailedOnchain { tx_hash, block_hash, fee };
        }
    }
    WithdrawalEvent::Confirmed { tx_hash, block_hash, fee }
}
