//! Replacement: fee bumps and cancels, both a sibling of the live attempt at the same nonce with
//! both fee fields raised at least 12.5% (DESIGN §7 items 5, 7, 13), signed by one helper under
//! the lane lock so two workers never replace the same attempt twice.

use std::collections::HashMap;

use alloy_primitives::{Bytes, TxKind, U256};
use custodian_domain::withdrawal::{AttemptKind, Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::{Amount, Nonce, TxHash};

use super::{PassReport, WorkError, Worker};
use crate::hot_wallet::Lane;
use crate::payout::{self, cancel_call, hex, replacement_fees, TRANSFER_GAS};
use crate::signer::Signer;
use crate::sql::{self, Intent, NewAttempt};

/// Why a replacement is signed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// The client cancelled after signing: the first cancel attempt.
    Cancel,
    /// The live attempt is old enough, or the node refused it as underpriced: a bump that keeps
    /// its intent.
    Bump,
}

/// What a replacement came to.
#[derive(Debug, PartialEq, Eq)]
enum Replaced {
    /// Signed, stored and sent.
    Signed,
    /// Not due any more (another worker got there, or the withdrawal moved on).
    NotDue,
    /// The fee cap leaves no room: alerted (once per attempt).
    AtCap {
        /// Whether this call raised the alert.
        newly: bool,
    },
}

impl Worker {
    /// Cancel replacements for withdrawals whose cancel was requested after signing.
    pub(super) async fn cancel_attempts(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        let ids =
            sql::in_state(&self.pool.get().await?, lane.lane.as_str(), WithdrawalState::CancelRequested, None).await?;
        for id in ids {
            match self.replace(lane, signer, id, Why::Cancel, None).await? {
                Replaced::Signed => report.cancel_attempts += 1,
                Replaced::AtCap { newly: true } => report.fee_cap_reached += 1,
                _ => {}
            }
        }
        Ok(())
    }

    /// Bumps the lowest open nonce of the lane, and only it (every later nonce waits behind it,
    /// so bumping them would only overpay): when its live attempt has been accepted for
    /// `bump_after_blocks`, or the node refused it as underpriced (an original included). The
    /// same rule is re-checked under the lane lock.
    pub(super) async fn bump(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        refused: &HashMap<i64, TxHash>,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        let address = lane.address.as_alloy();
        let client = self.pool.get().await?;
        let lowest = client
            .query_opt(
                "select id, nonce from withdrawal
                  where chain = 'eth' and lane = $1 and state in ('signed', 'broadcast', 'cancel_requested')
                  order by nonce limit 1",
                &[&lane.lane.as_str()],
            )
            .await?;
        drop(client);
        let Some(row) = lowest else { return Ok(()) };
        let (id, nonce): (i64, Option<i64>) = (row.get(0), row.get(1));
        let Some(nonce) = nonce.map(Nonce::from_stored) else { return Ok(()) };
        if self.node.nonce(address, false).await? > nonce {
            return Ok(()); // mined by one of its attempts: settlement records which
        }
        let head = self.node.block_number().await?;
        let client = self.pool.get().await?;
        let w = sql::load(&client, id).await?.expect("BUG: listed withdrawal has no events");
        let attempts = sql::attempts(&client, id).await?;
        drop(client);
        if !self.bump_due(&w, &attempts, head, refused.get(&id)) {
            return Ok(());
        }
        match self.replace(lane, signer, id, Why::Bump, refused.get(&id)).await? {
            Replaced::Signed => report.bumped += 1,
            Replaced::AtCap { newly: true } => report.fee_cap_reached += 1,
            _ => {}
        }
        Ok(())
    }

    /// Whether `w`'s live attempt is due for a bump at `head`: accepted `bump_after_blocks` ago
    /// (age counted from first acceptance), or refused as underpriced now (`refused`, the hash
    /// the node refused, counts only while it is still the live attempt: another worker may have
    /// replaced it since; an original the node never took included). A cancel is bumped like a
    /// payout once it exists; a cancel requested and not yet signed is signed by
    /// [`Worker::cancel_attempts`], never replaced by a payout.
    fn bump_due(&self, w: &Withdrawal, attempts: &[sql::Attempt], head: u64, refused: Option<&TxHash>) -> bool {
        let refused = refused.is_some_and(|hash| live(w, attempts).is_some_and(|a| a.tx_hash == *hash));
        let aged = w.attempt_at_block().is_some_and(|at| head >= at + self.config.bump_after_blocks);
        match w.state() {
            WithdrawalState::Signed => refused,
            WithdrawalState::Broadcast => aged || refused,
            WithdrawalState::CancelRequested => {
                (aged || refused) && live(w, attempts).is_some_and(|a| a.intent == Intent::Cancel)
            }
            _ => false,
        }
    }

    /// Signs a sibling of `id`'s live attempt at the same nonce, fees raised at least 12.5%:
    /// a cancel (zero value to ourselves) or a bump of the live attempt's intent. Under the
    /// lane's row lock, then the withdrawal's, with the reason re-checked there; the node calls
    /// happen before (fees, head) and after (the send) the transaction.
    async fn replace(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        id: i64,
        why: Why,
        refused: Option<&TxHash>,
    ) -> Result<Replaced, WorkError> {
        let (base, tip) = self.node.fees().await?;
        let head = self.node.block_number().await?;
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        tx.query_one("select 1 from hot_wallet where chain = 'eth' and lane = $1 for update", &[&lane.lane.as_str()])
            .await?;
        let Some(mut w) = sql::lock(&tx, id).await? else { return Ok(Replaced::NotDue) };
        let attempts = sql::attempts(&tx, id).await?;
        let due = match why {
            Why::Cancel => {
                w.state() == WithdrawalState::CancelRequested && !attempts.iter().any(|a| a.intent == Intent::Cancel)
            }
            Why::Bump => self.bump_due(&w, &attempts, head, refused),
        };
        if !due {
            return Ok(Replaced::NotDue);
        }
        let live = live(&w, &attempts).expect("BUG: a signed withdrawal without attempts");
        let intent = if why == Why::Cancel { Intent::Cancel } else { live.intent };
        let previous = payout::decode(&live.raw);
        let cap = self.config.max_fee_per_gas_wei;
        let (old_max, old_tip) = (U256::from(previous.max_fee_per_gas), U256::from(previous.max_priority_fee_per_gas));
        let Some((max_fee, priority_fee)) = replacement_fees(old_max, old_tip, base, tip, cap) else {
            if w.stuck_at_cap() {
                return Ok(Replaced::AtCap { newly: false });
            }
            let event =
                WithdrawalEvent::FeeCapReached { tx_hash: live.tx_hash, cap: Amount::from_units(cap), at_block: head };
            sql::append(&tx, &mut w, event).await?;
            tx.commit().await?;
            metrics::counter!("custodian_fee_cap_reached_total", "lane" => lane.lane.to_string()).increment(1);
            tracing::error!(
                withdrawal = %id, lane = %lane.lane, cap = %cap, tx = %live.tx_hash,
                "ALERT: the lowest open nonce cannot be replaced within the fee cap ([eth] max_fee_per_gas_wei); \
                 the lane waits behind it until the base fee falls or the cap is raised"
            );
            return Ok(Replaced::AtCap { newly: true });
        };
        let mut next = previous.clone();
        next.max_fee_per_gas = max_fee.to::<u128>();
        next.max_priority_fee_per_gas = priority_fee.to::<u128>();
        if intent == Intent::Cancel {
            let cancel = cancel_call(signer.address());
            next.to = TxKind::Call(cancel.to);
            next.value = cancel.value;
            next.input = Bytes::new();
            next.gas_limit = TRANSFER_GAS;
        }
        let call = payout::Call::of(&next).expect("BUG: we never sign a creation");
        let signed = signer.sign(next)?;
        let hash = TxHash::Eth(signed.hash);
        let kind = if why == Why::Cancel { AttemptKind::Cancel } else { AttemptKind::Bump };
        let to = hex(call.to);
        let attempt = NewAttempt {
            from: &lane.address.to_lowercase_hex(),
            nonce: Nonce::new(previous.nonce),
            kind,
            intent,
            call: (&to, call.value, &call.data),
            hash,
            raw: &signed.raw,
            max_fee,
            priority_fee,
        };
        sql::insert_attempt(&tx, &w, &attempt).await?;
        sql::append(&tx, &mut w, WithdrawalEvent::Bumped { tx_hash: hash, at_block: head }).await?;
        tx.commit().await?;
        metrics::counter!("custodian_bumps_total", "kind" => kind.as_str()).increment(1);
        if let Err(e) = self.node.send_raw(&signed.raw).await {
            tracing::warn!(withdrawal = %id, %hash, "sending the {kind} attempt failed; retried next pass: {e}");
        }
        Ok(Replaced::Signed)
    }
}

/// `w`'s live attempt: the one its events keep alive, or (for streams older than that) its latest.
pub(super) fn live<'a>(w: &Withdrawal, attempts: &'a [sql::Attempt]) -> Option<&'a sql::Attempt> {
    w.live_attempt().and_then(|hash| attempts.iter().find(|a| a.tx_hash == hash)).or(attempts.last())
}
