//! What operators and clients do to a withdrawal after requesting it: approve, cancel, and
//! resolve one that needs review.

use custodian_domain::withdrawal::{AttemptKind, Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::{Amount, BlockHash, Chain, ChainAddress, TxHash};

use crate::payout::{hex, token_of, token_paid};
use crate::rpc::EthNode;
use crate::sql::{self, StoreError};
use custodian_store::AppendError;

/// Why an action was refused. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    /// No such withdrawal.
    #[error("no withdrawal {0}")]
    Unknown(i64),
    /// The action does not apply in the current state.
    #[error("withdrawal {id} is {state}: {message}")]
    WrongState {
        /// Withdrawal.
        id: i64,
        /// Its state.
        state: &'static str,
        /// What would be needed.
        message: &'static str,
    },
    /// A decision needs an authenticated principal.
    #[error("a decision needs the authenticated principal making it (an API token)")]
    Anonymous,
    /// Four eyes: the requester may not approve their own withdrawal.
    #[error("withdrawal {id} was requested by {by:?}, who may not approve it: another principal must")]
    SelfApproval {
        /// Withdrawal.
        id: i64,
        /// The requester, who tried to approve.
        by: String,
    },
    /// The database failed.
    /// The evidence offered for a resolution does not hold on chain.
    #[error("withdrawal {id} not resolved: {reason}")]
    Evidence {
        /// Withdrawal.
        id: i64,
        /// What did not hold.
        reason: String,
    },
    /// The node could not be asked for the evidence.
    #[error("asking the node for the evidence: {0}")]
    Node(String),
    /// The database failed; the SQLSTATE stays in the source.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[source] tokio_postgres::Error),
    /// Another writer appended to the withdrawal's stream first: decided again, the same action
    /// may be refused or change nothing.
    #[error("the withdrawal changed meanwhile: {0}")]
    Conflict(#[source] custodian_store::AppendError),
}

impl ActionError {
    /// True when the action itself was refused (exit 2, a client error); false when the node or
    /// the database failed, or a concurrent writer came first, and the same action may succeed
    /// when retried.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, ActionError::Database(_) | ActionError::Node(_) | ActionError::Conflict(_))
    }
}

impl From<tokio_postgres::Error> for ActionError {
    fn from(e: tokio_postgres::Error) -> Self {
        ActionError::Database(e)
    }
}

impl From<StoreError> for ActionError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Database(e) | StoreError::Conflict(AppendError::Database { source: e, .. }) => {
                ActionError::Database(e)
            }
            StoreError::Conflict(conflict) => ActionError::Conflict(conflict),
        }
    }
}

/// Records `by`'s approval of a withdrawal waiting in `awaiting_approval`. It leaves that state
/// once as many distinct principals as its `awaiting_approval` event asks for have approved,
/// none of them its requester (refused with [`ActionError::SelfApproval`]). The same principal
/// approving again changes nothing (`false`).
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub async fn approve(
    client: &mut deadpool_postgres::Object,
    id: i64,
    by: &str,
) -> Result<(Withdrawal, bool), ActionError> {
    let by = by.trim();
    if by.is_empty() {
        return Err(ActionError::Anonymous);
    }
    let tx = client.transaction().await?;
    let mut w = sql::lock(&tx, id).await?.ok_or(ActionError::Unknown(id))?;
    if w.requested_by() == by {
        return Err(ActionError::SelfApproval { id, by: by.to_owned() });
    }
    if w.approvers().iter().any(|approver| approver == by) {
        return Ok((w, false));
    }
    if w.state() != WithdrawalState::AwaitingApproval {
        let approved_before = sql::events(&tx, id).await?.iter().any(|e| matches!(e, WithdrawalEvent::Approved { .. }));
        if approved_before {
            return Ok((w, false));
        }
        return Err(ActionError::WrongState {
            id,
            state: w.state().as_str(),
            message: "only a withdrawal awaiting approval can be approved",
        });
    }
    sql::append(&tx, &mut w, WithdrawalEvent::Approved { by: by.to_owned() }).await?;
    tx.commit().await?;
    Ok((w, true))
}

/// Cancels a withdrawal. Before signing it is cancelled at once and the hold released. After
/// signing, a cancel is requested: the worker signs a zero-value replacement at the same nonce,
/// and whatever mines decides. A second cancel changes nothing.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub async fn cancel(
    client: &mut deadpool_postgres::Object,
    id: i64,
    by: &str,
) -> Result<(Withdrawal, bool), ActionError> {
    let tx = client.transaction().await?;
    let mut w = sql::lock(&tx, id).await?.ok_or(ActionError::Unknown(id))?;
    match w.state() {
        WithdrawalState::Requested | WithdrawalState::AwaitingApproval => {
            let cancelled = WithdrawalEvent::Cancelled { tx_hash: None, fee: Amount::ZERO, by: Some(by.to_owned()) };
            sql::append(&tx, &mut w, cancelled).await?;
        }
        WithdrawalState::Signed | WithdrawalState::Broadcast => {
            // A BTC cancel replaces the whole transaction: inside a batch it would cancel the
            // other withdrawals too, so it is refused and the batch stands. Its spend and how many
            // withdrawals that spend pays, if it is one (ETH: none).
            let spend: Option<(i64, i64)> = tx
                .query_opt(
                    "select p.spend_id, (select count(*) from btc_spend_payout q where q.spend_id = p.spend_id)
                       from btc_spend_payout p where p.withdrawal_id = $1",
                    &[&id],
                )
                .await?
                .map(|r| (r.get(0), r.get(1)));
            if spend.is_some_and(|(_, batch)| batch > 1) {
                return Err(ActionError::WrongState {
                    id,
                    state: w.state().as_str(),
                    message: "it is paid by one transaction together with other withdrawals (a batch); cancelling it \
                              would replace that transaction and cancel them too, so the batch stands",
                });
            }
            // A payout a reorg sent back may have its change spent by a later payout of ours: its
            // cancel would take that change away, and the later payout could never be mined.
            let spent_on = match (spend, w.live_attempt()) {
                (Some((spend, _)), Some(live)) => {
                    tx.query_one(crate::btc::SPENT_ON, &[&live.to_string(), &spend]).await?.get::<_, bool>(0)
                }
                _ => false,
            };
            if spent_on {
                return Err(ActionError::WrongState {
                    id,
                    state: w.state().as_str(),
                    message: "a later payout of ours spends its transaction's change; cancelling it would take that \
                              change away and the later payout could never be mined",
                });
            }
            sql::append(&tx, &mut w, WithdrawalEvent::CancelRequested { by: by.to_owned() }).await?;
        }
        WithdrawalState::CancelRequested | WithdrawalState::Cancelled => return Ok((w, false)),
        other => {
            return Err(ActionError::WrongState { id, state: other.as_str(), message: "too late to cancel" });
        }
    }
    tx.commit().await?;
    Ok((w, true))
}

/// How an operator says a `needs_review` withdrawal ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// Paid by this transaction (`0x…` hash): checked on chain before anything is written.
    PaidBy(String),
    /// Not paid: the nonce was consumed by something else and none of our attempts mined.
    NotPaid,
}

/// What a resolution recorded.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Resolved {
    /// The withdrawal after the resolution.
    pub withdrawal: Withdrawal,
    /// Whether the destination was paid.
    pub paid: bool,
    /// The fee charged, wei.
    pub fee: Amount,
}

/// Resolves a `needs_review` withdrawal on `by`'s authority with evidence checked on chain first
/// (outside any transaction), buried under `confirmations` blocks (the withdrawals' depth): a
/// shallow reorg must not turn the evidence around after the hold has moved. `PaidBy(hash)` must be mined with status 1, sent by the
/// withdrawal's hot wallet at its nonce, and pay the destination the amount (ether: the
/// transaction's value to it; a token: its `Transfer` events); then the hold settles. `NotPaid`
/// finds the transaction that consumed the nonce (bisecting the nonce count, then reading that
/// block), which must be none of the withdrawal's attempts and must not pay the destination;
/// then the hold is released. Either way the consuming transaction's fee is charged. Recorded
/// as the `resolved` event and an operator action in one transaction.
pub async fn resolve(
    client: &mut deadpool_postgres::Object,
    node: &EthNode,
    id: i64,
    resolution: &Resolution,
    confirmations: u64,
    by: &str,
) -> Result<Resolved, ActionError> {
    let (w, by) = under_review(client, id, by).await?;
    let refuse = |reason: String| ActionError::Evidence { id, reason };
    let node_error = |e: crate::rpc::NodeError| ActionError::Node(e.to_string());
    let (Some(from), Some(nonce)) = (w.from_address().and_then(ChainAddress::eth), w.nonce()) else {
        // Never signed (a row found tampered with before allocation): nothing on chain can have
        // paid it, so not paid is the only outcome, and it releases the hold.
        if *resolution != Resolution::NotPaid {
            return Err(refuse("it was never signed: nothing on chain can have paid it; resolve it --not-paid".into()));
        }
        return record_resolution(client, id, paid_nothing(by), by, None).await;
    };
    let hot = from.as_alloy();
    let from = from.to_lowercase_hex();
    let event = match resolution {
        Resolution::PaidBy(hash) => {
            let parsed: alloy_primitives::B256 =
                hash.parse().map_err(|_| refuse(format!("{hash:?} is not a transaction hash")))?;
            let tx = node.transaction(parsed).await.map_err(node_error)?;
            let tx = tx.ok_or_else(|| refuse(format!("the node does not know transaction {hash}")))?;
            let block_hash = tx.block_hash.ok_or_else(|| refuse(format!("transaction {hash} is not mined")))?;
            if tx.from != hot {
                return Err(refuse(format!(
                    "transaction {hash} was sent by {}, not by the hot wallet {from}",
                    hex(tx.from)
                )));
            }
            if tx.nonce.to::<u64>() != nonce.get() {
                return Err(refuse(format!(
                    "transaction {hash} used nonce {}, the withdrawal nonce {nonce}",
                    tx.nonce.to::<u64>()
                )));
            }
            let receipt = node.receipt(parsed).await.map_err(node_error)?;
            let receipt = receipt.ok_or_else(|| refuse(format!("transaction {hash} has no receipt")))?;
            if !receipt.success {
                return Err(refuse(format!("transaction {hash} failed on chain (status 0): it paid nothing")));
            }
            buried(node, &receipt, confirmations, hash).await.map_err(|e| e.for_withdrawal(id))?;
            let paid = paid_by(&w, hot, &tx, &receipt);
            if paid != w.amount().units() {
                return Err(refuse(format!(
                    "transaction {hash} pays {} {paid} units of {}, the withdrawal asks for {}",
                    w.destination().stored(),
                    w.asset(),
                    w.amount()
                )));
            }
            let fee = Amount::from_units(receipt.fee);
            WithdrawalEvent::Resolved {
                paid: true,
                tx_hash: Some(TxHash::Eth(parsed)),
                block_hash: Some(BlockHash::Eth(block_hash)),
                fee,
                by: by.to_owned(),
            }
        }
        Resolution::NotPaid if w.settled() => {
            return Err(refuse(
                "its hold was settled as paid before its block was reorged out: resolve it with --paid-by once its \
                 transaction is mined again"
                    .into(),
            ));
        }
        Resolution::NotPaid => {
            // The transaction that consumed the nonce, found on chain: it must be none of ours
            // and must not pay the destination (then it is --paid-by).
            let consumer = node.consumer_of(hot, nonce).await.map_err(node_error)?.ok_or_else(|| {
                refuse(format!(
                    "nonce {nonce} of {from} is not consumed on chain yet: the withdrawal may still be paid; wait, or \
                     cancel it"
                ))
            })?;
            let consumer_hash = TxHash::Eth(consumer.hash);
            if sql::attempts(&*client, id).await?.iter().any(|a| a.tx_hash == consumer_hash) {
                return Err(refuse(format!(
                    "its own attempt {consumer_hash} consumed the nonce: resolve it with --paid-by {consumer_hash} if it paid"
                )));
            }
            let receipt = node.receipt(consumer.hash).await.map_err(node_error)?;
            let receipt = receipt.ok_or_else(|| refuse(format!("transaction {consumer_hash} has no receipt yet")))?;
            buried(node, &receipt, confirmations, &consumer_hash.to_string())
                .await
                .map_err(|e| e.for_withdrawal(id))?;
            if receipt.success && paid_by(&w, hot, &consumer, &receipt) == w.amount().units() {
                return Err(refuse(format!(
                    "transaction {consumer_hash} consumed nonce {nonce} and pays the destination what the withdrawal \
                     asks: resolve it with --paid-by {consumer_hash}"
                )));
            }
            WithdrawalEvent::Resolved {
                paid: false,
                tx_hash: Some(consumer_hash),
                block_hash: consumer.block_hash.map(BlockHash::Eth),
                fee: Amount::from_units(receipt.fee),
                by: by.to_owned(),
            }
        }
    };
    record_resolution(client, id, event, by, None).await
}

/// Resolves a BTC withdrawal in `needs_review` on `by`'s authority, from the chain as scanned:
/// whichever transaction spent its spend's reserved coins in a canonical block, buried under
/// `confirmations` blocks, decides. One of its own payouts (the original or a bump; a payout
/// confirmed before a reorg deeper than the depth took it, then mined again): `PaidBy` that
/// transaction, with its share of the fee (a settlement already booked is not booked again). Its
/// cancel: `NotPaid`, the hold released and its share of the cancel's fee charged. A transaction
/// none of ours (the key used outside the service): `NotPaid` releases the hold, and what it took
/// is a loss `reconcile` keeps naming until finance books it; `PaidBy` is refused, as its outputs
/// to addresses we do not watch are not observed. Once no withdrawal of the spend is left in
/// review, its reservations are released (its other coins are spendable again). Nothing spent the
/// coins: refused; `rebroadcast_btc` sends the bytes again.
///
/// # Cancel safety
/// One transaction after the reads; cancelled, it writes nothing.
pub async fn resolve_btc(
    client: &mut deadpool_postgres::Object,
    id: i64,
    resolution: &Resolution,
    confirmations: u64,
    by: &str,
) -> Result<Resolved, ActionError> {
    let (w, by) = under_review(client, id, by).await?;
    let refuse = |reason: String| ActionError::Evidence { id, reason };
    // A txid as stored: lowercase hex.
    let resolution = &match resolution {
        Resolution::PaidBy(hash) => Resolution::PaidBy(hash.trim().to_ascii_lowercase()),
        Resolution::NotPaid => Resolution::NotPaid,
    };
    let spend: Option<i64> = client
        .query_opt("select spend_id from btc_spend_payout where withdrawal_id = $1", &[&id])
        .await?
        .map(|r| r.get(0));
    let Some(spend) = spend else {
        if let Resolution::PaidBy(hash) = resolution {
            return Err(refuse(format!("it was never signed: no transaction of ours, {hash} or another, paid it")));
        }
        return record_resolution(client, id, paid_nothing(by), by, None).await;
    };
    // Each reserved coin spent on the canonical chain: by which transaction, in which block, how
    // deep, and, when the spender is one of the spend's own attempts, its kind and fee.
    let spent = client
        .query(
            "select s.spending_tx, b.block_hash, t.height - b.height + 1, a.kind, a.fee::text
               from utxo_reservation r
               join output_spend s on s.chain = 'btc' and s.tx_hash = r.tx_hash and s.output_index = r.output_index
               join chain_block b on b.chain = 'btc' and b.block_hash = s.block_hash and b.orphaned_at is null
               join chain_tip t on t.chain = 'btc'
               left join btc_attempt a on a.tx_hash = s.spending_tx and a.spend_id = r.spend_id
              where r.spend_id = $1",
            &[&spend],
        )
        .await?;
    // A coin its transaction spends that can never exist (its parent replaced on the canonical
    // chain): nothing of this transaction can be mined, so it paid nothing.
    if let Some(lost) = client.query_opt(crate::btc::VANISHED_INPUTS, &[&vec![spend]]).await? {
        let (coin, index, replaced_by): (String, i32, String) = (lost.get(1), lost.get(2), lost.get(3));
        let depth = u64::try_from(lost.get::<_, i64>(5)).unwrap_or(0);
        return match resolution {
            Resolution::PaidBy(hash) => Err(refuse(format!(
                "its transaction can never be mined, so {hash} did not pay it: coin {coin}:{index} it spends was \
                 never created ({replaced_by} took its parent's place)"
            ))),
            Resolution::NotPaid if depth < confirmations => Err(refuse(format!(
                "{replaced_by}, which took the place of the transaction creating coin {coin}:{index}, has {depth} \
                 confirmations, fewer than {confirmations}: a reorg could still bring the coin back"
            ))),
            Resolution::NotPaid if w.settled() => Err(refuse(format!(
                "its hold was settled as paid before its block was reorged out, and its transaction can never be \
                 mined again (coin {coin}:{index} was never created): the customer was not paid; book it with finance"
            ))),
            Resolution::NotPaid => record_resolution(client, id, paid_nothing(by), by, Some(spend)).await,
        };
    }
    let Some(spender) = spent.iter().find(|r| r.get::<_, Option<&str>>(3).is_some()).or(spent.first()) else {
        return Err(refuse(
            "no reserved coin of its transaction is spent on the canonical chain: nothing stops it from being \
             mined; send it again (withdrawals rebroadcast) and resolve it --paid-by once it is mined and buried"
                .into(),
        ));
    };
    let (tx_hash, block_hash): (String, String) = (spender.get(0), spender.get(1));
    let depth = u64::try_from(spender.get::<_, i64>(2)).unwrap_or(0);
    if depth < confirmations {
        return Err(refuse(format!(
            "transaction {tx_hash}, which spent its reserved coins, has {depth} confirmations, fewer than \
             {confirmations}: a reorg could still undo it"
        )));
    }
    let kind: Option<AttemptKind> = spender.get::<_, Option<&str>>(3).map(sql::stored_kind);
    let evidence = || {
        (
            Some(TxHash::parse(Chain::Btc, &tx_hash).expect("BUG: output_spend.spending_tx is checked by the table")),
            Some(
                BlockHash::parse(Chain::Btc, &block_hash).expect("BUG: chain_block.block_hash is checked by the table"),
            ),
        )
    };
    let event = match (resolution, kind) {
        // One of its own payouts (the original or a bump) spent the coins: it paid, with its share
        // of that transaction's fee (once: a withdrawal confirmed before a deep reorg settles once).
        (Resolution::PaidBy(hash), Some(AttemptKind::Original | AttemptKind::Bump)) if *hash == tx_hash => {
            let (tx_hash, block_hash) = evidence();
            let fee = fee_share(client, spend, id, spender.get::<_, String>(4).parse().expect("BUG: a fee")).await?;
            WithdrawalEvent::Resolved { paid: true, tx_hash, block_hash, fee, by: by.to_owned() }
        }
        (Resolution::PaidBy(hash), _) if *hash != tx_hash => {
            return Err(refuse(format!(
                "transaction {hash} did not spend its reserved coins on the canonical chain; {tx_hash} did"
            )))
        }
        (Resolution::PaidBy(hash), Some(AttemptKind::Cancel)) => {
            return Err(refuse(format!(
                "transaction {hash} is its cancel: it paid the coins back to us, not the customer"
            )))
        }
        (Resolution::PaidBy(hash), _) => {
            return Err(refuse(format!(
                "a BTC withdrawal cannot be resolved --paid-by {hash}, a transaction none of ours: its outputs to \
                 addresses we do not watch are not observed; check it on a node, and if it paid, book it with \
                 finance; --not-paid releases the hold"
            )))
        }
        (Resolution::NotPaid, Some(AttemptKind::Original | AttemptKind::Bump)) => {
            return Err(refuse(format!(
                "its own payout {tx_hash} spent the reserved coins: resolve it --paid-by {tx_hash}"
            )))
        }
        (Resolution::NotPaid, _) if w.settled() => {
            return Err(refuse(format!(
                "its hold was settled as paid before its block was reorged out, and {tx_hash}, not a payout of ours, \
                 spent its coins since: the customer was not paid; book it with finance"
            )))
        }
        // Its cancel spent the coins: not paid, with its share of the cancel's fee.
        (Resolution::NotPaid, Some(AttemptKind::Cancel)) => {
            let (tx_hash, block_hash) = evidence();
            let fee = fee_share(client, spend, id, spender.get::<_, String>(4).parse().expect("BUG: a fee")).await?;
            WithdrawalEvent::Resolved { paid: false, tx_hash, block_hash, fee, by: by.to_owned() }
        }
        (Resolution::NotPaid, None) => paid_nothing(by),
    };
    record_resolution(client, id, event, by, Some(spend)).await
}

/// Withdrawal `id`'s share of its spend's `fee` (satoshis), by weight as settlement splits it.
async fn fee_share(client: &deadpool_postgres::Object, spend: i64, id: i64, fee: u64) -> Result<Amount, ActionError> {
    let payouts = client
        .query(
            "select withdrawal_id, weight from btc_spend_payout where spend_id = $1 order by output_index",
            &[&spend],
        )
        .await?;
    let weights: Vec<u64> = payouts.iter().map(|r| u64::try_from(r.get::<_, i32>(1)).expect("BUG: weight")).collect();
    let shares = crate::btc::fee_shares(fee, &weights);
    let at =
        payouts.iter().position(|r| r.get::<_, i64>(0) == id).expect("BUG: the withdrawal is a payout of its spend");
    Ok(Amount::from_u64(shares[at]))
}

/// Resolved as not paid, naming no transaction and charging no fee: an ETH withdrawal never
/// signed, or a BTC one whose coins an outside transaction spent.
fn paid_nothing(by: &str) -> WithdrawalEvent {
    WithdrawalEvent::Resolved { paid: false, tx_hash: None, block_hash: None, fee: Amount::ZERO, by: by.to_owned() }
}

/// `id` loaded for a resolution on `by`'s authority: it must need review, and `by` be someone.
async fn under_review<'a>(
    client: &deadpool_postgres::Object,
    id: i64,
    by: &'a str,
) -> Result<(Withdrawal, &'a str), ActionError> {
    let by = by.trim();
    if by.is_empty() {
        return Err(ActionError::Anonymous);
    }
    let w = sql::load(client, id).await?.ok_or(ActionError::Unknown(id))?;
    if w.state() != WithdrawalState::NeedsReview {
        return Err(ActionError::WrongState {
            id,
            state: w.state().as_str(),
            message: "only a withdrawal that needs review can be resolved",
        });
    }
    Ok((w, by))
}

/// Appends the resolution under the withdrawal's lock (still in review), with its movements and
/// the operator action, in one transaction; for a BTC spend, once none of its withdrawals is left
/// in review, its reservations are released.
async fn record_resolution(
    client: &mut deadpool_postgres::Object,
    id: i64,
    event: WithdrawalEvent,
    by: &str,
    btc_spend: Option<i64>,
) -> Result<Resolved, ActionError> {
    let tx = client.transaction().await?;
    let mut w = sql::lock(&tx, id).await?.ok_or(ActionError::Unknown(id))?;
    if w.state() != WithdrawalState::NeedsReview {
        return Err(ActionError::WrongState { id, state: w.state().as_str(), message: "it was resolved meanwhile" });
    }
    let (paid, fee) = match &event {
        WithdrawalEvent::Resolved { paid, fee, .. } => (*paid, *fee),
        _ => unreachable!("BUG: a resolution is a resolved event"),
    };
    let details = serde_json::json!({"withdrawal_id": id, "event": event.payload()});
    // Settled (paid) or released, and the fee of whatever consumed the nonce charged either way.
    sql::append(&tx, &mut w, event).await?;
    if let Some(spend) = btc_spend {
        // The last withdrawal of a BTC spend resolved: its coins are no longer anyone's.
        tx.execute(
            "update utxo_reservation set released_at = now()
              where spend_id = $1 and released_at is null
                and not exists (select 1 from btc_spend_payout p join withdrawal o on o.id = p.withdrawal_id
                                 where p.spend_id = $1 and o.state = 'needs_review')",
            &[&spend],
        )
        .await?;
    }
    custodian_store::operator::record(&tx, custodian_store::operator::Action::WithdrawalResolved, by, &details).await?;
    tx.commit().await?;
    Ok(Resolved { withdrawal: w, paid, fee })
}

/// What `tx` (mined with `receipt`) paid `w`'s destination from the hot wallet: ether by its
/// value, a token by its `Transfer` events.
fn paid_by(
    w: &Withdrawal,
    hot: alloy_primitives::Address,
    tx: &crate::rpc::ChainTx,
    receipt: &crate::rpc::Receipt,
) -> alloy_primitives::U256 {
    let destination = crate::payout::eth_destination(w);
    match token_of(w.asset()) {
        None if tx.to == Some(destination) => tx.value,
        None => alloy_primitives::U256::ZERO,
        Some(token) => token_paid(&receipt.logs, token, hot, destination),
    }
}

/// Refuses evidence mined fewer than `confirmations` blocks deep.
async fn buried(
    node: &EthNode,
    receipt: &crate::rpc::Receipt,
    confirmations: u64,
    hash: &str,
) -> Result<(), ActionError> {
    let head = node.block_number().await.map_err(|e| ActionError::Node(e.to_string()))?;
    let depth = (head + 1).saturating_sub(receipt.block_number);
    if depth < confirmations {
        return Err(ActionError::Evidence {
            id: 0,
            reason: format!(
                "transaction {hash} has {depth} of the {confirmations} confirmations withdrawals need; resolve it once \
                 it is buried that deep"
            ),
        });
    }
    Ok(())
}

impl ActionError {
    fn for_withdrawal(self, id: i64) -> ActionError {
        match self {
            ActionError::Evidence { reason, .. } => ActionError::Evidence { id, reason },
            other => other,
        }
    }
}

/// The transaction of withdrawal `id` to send again by hand: it must be in review and have one.
async fn to_send_again(client: &deadpool_postgres::Object, id: i64) -> Result<TxHash, ActionError> {
    let w = sql::load(client, id).await?.ok_or(ActionError::Unknown(id))?;
    if w.state() != WithdrawalState::NeedsReview {
        return Err(ActionError::WrongState {
            id,
            state: w.state().as_str(),
            message: "only a withdrawal in review is sent by hand (the worker keeps the others alive)",
        });
    }
    w.tx_hash().ok_or_else(|| ActionError::Evidence { id, reason: "it has no signed transaction to send".into() })
}

/// Sends the stored bytes of a withdrawal in review once more: the transaction that was mined (a
/// payment reorged out deeper than the confirmation depth), so that it can mine again and be
/// resolved `--paid-by`. Nothing is signed and nothing is written; the node's answer is returned
/// ("already known" counts as sent).
pub async fn rebroadcast(client: &deadpool_postgres::Object, node: &EthNode, id: i64) -> Result<TxHash, ActionError> {
    let hash = to_send_again(client, id).await?;
    let attempt = sql::attempts(client, id).await?.into_iter().find(|a| a.tx_hash == hash).ok_or_else(|| {
        ActionError::Evidence { id, reason: format!("its transaction {hash} is not one of its attempts") }
    })?;
    match node.send_raw(&attempt.raw).await {
        Ok(_) => Ok(hash),
        Err(e) if e.is_already_known() => Ok(hash),
        Err(e) => Err(ActionError::Node(e.to_string())),
    }
}

/// [`rebroadcast`] for a BTC withdrawal in review: the stored bytes of its transaction that was
/// mined (a payout reorged out deeper than the confirmation depth). Nothing is signed and nothing
/// is written.
pub async fn rebroadcast_btc(
    client: &deadpool_postgres::Object,
    node: &crate::btc::node::BtcNode,
    id: i64,
) -> Result<TxHash, ActionError> {
    use crate::btc::node::Sent;
    let hash = to_send_again(client, id).await?;
    let raw: Vec<u8> = client
        .query_opt(
            "select a.raw_tx from btc_attempt a join btc_spend_payout p on p.spend_id = a.spend_id
              where p.withdrawal_id = $1 and a.tx_hash = $2",
            &[&id, &hash.to_string()],
        )
        .await?
        .ok_or_else(|| ActionError::Evidence {
            id,
            reason: format!("its transaction {hash} is not one of its attempts"),
        })?
        .get(0);
    match node.send(&raw).await {
        Ok(Sent::Accepted | Sent::AlreadyKnown) => Ok(hash),
        Ok(Sent::Underpriced(why) | Sent::InputsMissing(why) | Sent::Refused(why)) => {
            Err(ActionError::Node(format!("the node refused {hash}: {why}")))
        }
        Err(e) => Err(ActionError::Node(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::ActionError;

    #[test]
    fn a_failure_of_the_node_or_a_concurrent_writer_is_not_a_refusal() {
        assert!(!ActionError::Node("connection refused".into()).is_refusal());
        assert!(!ActionError::Conflict(custodian_store::AppendError::Conflict { withdrawal_id: 1, expected_seq: 2 })
            .is_refusal());
        assert!(ActionError::Anonymous.is_refusal());
        assert!(ActionError::Unknown(7).is_refusal());
    }
}
