//! A withdrawal's life as events, and the fold that turns a stream into its current state.
//!
//! States: `requested → signed → broadcast → mined → confirmed`, with `awaiting_approval`,
//! `rejected` (before any nonce), `cancel_requested`, `cancelled`, `failed_onchain` (mined with
//! status 0), and `needs_review` (stops automation for the lane). `unmined` (the block was reorged
//! out) returns to `broadcast`; `bumped` adds an attempt without changing the state.

use serde::{Deserialize, Serialize};

use crate::address::ChainAddress;
use crate::amount::Amount;
use crate::asset::Asset;
use crate::external_id::ExternalId;
use crate::hash::{BlockHash, TxHash};
use crate::ids::{AccountId, LaneName, WithdrawalId};
use crate::nonce::Nonce;

/// One event of a withdrawal's stream. The tag is the stored `event_type`; the rest is the payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event_type", rename_all = "snake_case")]
pub enum WithdrawalEvent {
    /// A client asked for it; the hold is posted in the same transaction.
    Requested {
        /// The account paying.
        account_id: AccountId,
        /// The client's idempotency key.
        external_id: ExternalId,
        /// What is paid.
        asset: Asset,
        /// Destination, on the asset's chain.
        destination: ChainAddress,
        /// Smallest units.
        amount: Amount,
        /// The lane (hot wallet) chosen by hashing the withdrawal id.
        lane: LaneName,
        /// The authenticated principal (API token name) who asked; never one of its approvers.
        /// Empty only in streams recorded before principals existed.
        #[serde(default)]
        requested_by: String,
        /// An internal withdrawal (rebalancing between hot wallets): paid from `treasury`, and
        /// `account_id` is the treasury's account, which owns every hot-wallet address.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        treasury: bool,
    },
    /// Above the asset's approval limit, or past the account's daily total: waits for
    /// `approvals` distinct principals other than the requester.
    AwaitingApproval {
        /// The limit it exceeded, smallest units.
        limit: Amount,
        /// How many distinct approvers it needs.
        #[serde(default = "one")]
        approvals: u32,
        /// Which limit: `approval_limit` (the amount) or `daily_limit` (the rolling 24-hour total).
        #[serde(default)]
        reason: String,
    },
    /// Approved by a person.
    Approved {
        /// Who approved.
        by: String,
    },
    /// Refused before any nonce was used (a deterministic simulation revert); the hold is released.
    Rejected {
        /// Why.
        reason: String,
    },
    /// A nonce (ETH) or coins (BTC) were allocated and the transaction signed, in one database
    /// transaction.
    Signed {
        /// Hot wallet address (for BTC, the lane's funding address).
        from_address: ChainAddress,
        /// The nonce; BTC has none (its attempts spend reserved coins).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<Nonce>,
        /// Hash of the signed transaction.
        tx_hash: TxHash,
        /// Chain head when signed (bumps count blocks from here).
        at_block: u64,
    },
    /// The node accepted the bytes (or already had them).
    Broadcast {
        /// The attempt sent.
        tx_hash: TxHash,
        /// The chain head when the node first accepted the bytes: a bump's age counts from here.
        /// Absent in events recorded before it was kept (their age counts from signing).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at_block: Option<u64>,
    },
    /// A sibling attempt at the same nonce with higher fees.
    Bumped {
        /// The new attempt.
        tx_hash: TxHash,
        /// Chain head when signed.
        at_block: u64,
    },
    /// One of our attempts has a receipt.
    Mined {
        /// The attempt that mined.
        tx_hash: TxHash,
        /// Its block.
        block_hash: BlockHash,
        /// Its block number.
        block_number: u64,
    },
    /// The block holding the mined attempt was reorged out; the same bytes go out again.
    Unmined {
        /// The attempt.
        tx_hash: TxHash,
        /// The retracted block.
        block_hash: BlockHash,
    },
    /// Mined with status 1 and past the confirmation depth; settled with the real fee.
    Confirmed {
        /// The attempt.
        tx_hash: TxHash,
        /// Its block.
        block_hash: BlockHash,
        /// gasUsed × effectiveGasPrice, wei.
        fee: Amount,
    },
    /// Mined with status 0: the fee is paid, the hold released.
    FailedOnchain {
        /// The attempt.
        tx_hash: TxHash,
        /// Its block.
        block_hash: BlockHash,
        /// The fee paid, wei.
        fee: Amount,
    },
    /// A cancel was asked for after signing; a replacement will race the original.
    CancelRequested {
        /// Who asked.
        by: String,
    },
    /// Cancelled: before signing, or the cancel replacement mined. The hold is released.
    Cancelled {
        /// The cancel attempt that mined, if it came to that.
        tx_hash: Option<TxHash>,
        /// The fee paid by the cancel, wei (zero before signing).
        fee: Amount,
        /// The principal who cancelled it before signing; after signing that is recorded by
        /// `cancel_requested`, and this event only says which attempt mined.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    /// Something signed with our key that we did not record, or a state we cannot explain.
    NeedsReview {
        /// What was found.
        reason: String,
    },
    /// The lowest open nonce could not be bumped within the configured maximum fee: an alert, and
    /// the withdrawal shows `stuck_at_cap` until a bump or the chain moves it on.
    FeeCapReached {
        /// The live attempt that could not be raised.
        tx_hash: TxHash,
        /// `max_fee_per_gas_wei`, wei.
        cap: Amount,
        /// Chain head when found.
        at_block: u64,
    },
    /// An operator settled a `needs_review` withdrawal with the evidence: paid by `tx_hash`
    /// (checked on chain: sent by the hot wallet, at the withdrawal's nonce, paying its
    /// destination what it asked) or not paid (the slot was consumed by something else; the hold
    /// is released).
    Resolved {
        /// Whether the destination was paid.
        paid: bool,
        /// The transaction that paid.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tx_hash: Option<TxHash>,
        /// Its block.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block_hash: Option<BlockHash>,
        /// The fee of the transaction that consumed the nonce, wei (charged either way).
        fee: Amount,
        /// The operator.
        by: String,
    },
}

fn one() -> u32 {
    1
}

impl WithdrawalEvent {
    /// The stored payload: the event's JSON without its `event_type` tag.
    pub fn payload(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).expect("BUG: withdrawal events always serialise");
        value.as_object_mut().expect("BUG: events serialise to objects").remove("event_type");
        value
    }

    /// Reads a stored event back from its type and payload.
    pub fn from_stored(event_type: &str, payload: &serde_json::Value) -> Result<WithdrawalEvent, serde_json::Error> {
        let mut value = payload.clone();
        if let Some(object) = value.as_object_mut() {
            object.insert("event_type".into(), serde_json::Value::String(event_type.to_owned()));
        }
        serde_json::from_value(value)
    }

    /// The stored `event_type`.
    pub fn event_type(&self) -> &'static str {
        match self {
            WithdrawalEvent::Requested { .. } => "requested",
            WithdrawalEvent::AwaitingApproval { .. } => "awaiting_approval",
            WithdrawalEvent::Approved { .. } => "approved",
            WithdrawalEvent::Rejected { .. } => "rejected",
            WithdrawalEvent::Signed { .. } => "signed",
            WithdrawalEvent::Broadcast { .. } => "broadcast",
            WithdrawalEvent::Bumped { .. } => "bumped",
            WithdrawalEvent::Mined { .. } => "mined",
            WithdrawalEvent::Unmined { .. } => "unmined",
            WithdrawalEvent::Confirmed { .. } => "confirmed",
            WithdrawalEvent::FailedOnchain { .. } => "failed_onchain",
            WithdrawalEvent::CancelRequested { .. } => "cancel_requested",
            WithdrawalEvent::Cancelled { .. } => "cancelled",
            WithdrawalEvent::NeedsReview { .. } => "needs_review",
            WithdrawalEvent::FeeCapReached { .. } => "fee_cap_reached",
            WithdrawalEvent::Resolved { .. } => "resolved",
        }
    }
}

/// Where a withdrawal stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WithdrawalState {
    /// Waiting for a nonce.
    Requested,
    /// Waiting for a person.
    AwaitingApproval,
    /// Refused; the hold was released.
    Rejected,
    /// Signed, not yet accepted by a node.
    Signed,
    /// Accepted by a node, not yet mined.
    Broadcast,
    /// Mined, not yet deep enough.
    Mined,
    /// Settled.
    Confirmed,
    /// Mined with status 0.
    FailedOnchain,
    /// A cancel replacement is racing the original.
    CancelRequested,
    /// Cancelled.
    Cancelled,
    /// Automation stopped; a person must look.
    NeedsReview,
}

impl WithdrawalState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            WithdrawalState::Requested => "requested",
            WithdrawalState::AwaitingApproval => "awaiting_approval",
            WithdrawalState::Rejected => "rejected",
            WithdrawalState::Signed => "signed",
            WithdrawalState::Broadcast => "broadcast",
            WithdrawalState::Mined => "mined",
            WithdrawalState::Confirmed => "confirmed",
            WithdrawalState::FailedOnchain => "failed_onchain",
            WithdrawalState::CancelRequested => "cancel_requested",
            WithdrawalState::Cancelled => "cancelled",
            WithdrawalState::NeedsReview => "needs_review",
        }
    }

    /// Whether the withdrawal still holds the customer's funds.
    pub fn holds_funds(self) -> bool {
        !matches!(
            self,
            WithdrawalState::Rejected
                | WithdrawalState::Confirmed
                | WithdrawalState::FailedOnchain
                | WithdrawalState::Cancelled
        )
    }
}

impl std::str::FromStr for WithdrawalState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "requested" => WithdrawalState::Requested,
            "awaiting_approval" => WithdrawalState::AwaitingApproval,
            "rejected" => WithdrawalState::Rejected,
            "signed" => WithdrawalState::Signed,
            "broadcast" => WithdrawalState::Broadcast,
            "mined" => WithdrawalState::Mined,
            "confirmed" => WithdrawalState::Confirmed,
            "failed_onchain" => WithdrawalState::FailedOnchain,
            "cancel_requested" => WithdrawalState::CancelRequested,
            "cancelled" => WithdrawalState::Cancelled,
            "needs_review" => WithdrawalState::NeedsReview,
            other => return Err(format!("unknown withdrawal state {other:?}")),
        })
    }
}

/// Why a signed payload (an attempt) exists: the first signature of a withdrawal, a fee bump of
/// its live attempt, or a cancel replacing it (DESIGN §7 items 5, 7, 13). On both chains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptKind {
    /// The first payload signed for the withdrawal (or its BTC batch).
    Original,
    /// A replacement with higher fees and the same intent.
    Bump,
    /// A replacement that pays nothing out: zero value to ourselves (ETH), or the inputs back to
    /// our change (BTC).
    Cancel,
}

impl AttemptKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptKind::Original => "original",
            AttemptKind::Bump => "bump",
            AttemptKind::Cancel => "cancel",
        }
    }

    /// The kind of a replacement of an attempt of this kind: a cancel stays a cancel once one
    /// exists; anything else is bumped.
    pub fn replaced(self) -> AttemptKind {
        if self == AttemptKind::Cancel {
            AttemptKind::Cancel
        } else {
            AttemptKind::Bump
        }
    }
}

impl std::fmt::Display for AttemptKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for AttemptKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "original" => AttemptKind::Original,
            "bump" => AttemptKind::Bump,
            "cancel" => AttemptKind::Cancel,
            other => return Err(format!("unknown attempt kind {other:?}")),
        })
    }
}

/// The fold of a stream: everything the `withdrawal` projection row holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Withdrawal {
    /// Id.
    id: WithdrawalId,
    /// Account paying.
    account_id: AccountId,
    /// Client idempotency key.
    external_id: ExternalId,
    /// What is paid.
    asset: Asset,
    /// Destination.
    destination: ChainAddress,
    /// Smallest units.
    amount: Amount,
    /// Current state.
    state: WithdrawalState,
    /// Lane.
    lane: LaneName,
    /// Hot wallet, once signed.
    from_address: Option<ChainAddress>,
    /// Nonce, once signed.
    nonce: Option<Nonce>,
    /// The attempt that matters now: the latest signed, or the one mined.
    tx_hash: Option<TxHash>,
    /// Block of the mined attempt.
    mined_block_hash: Option<BlockHash>,
    /// Last sequence number applied.
    last_seq: i32,
    /// State before a cancel was requested.
    state_before_cancel: Option<WithdrawalState>,
    /// Chain head when the live attempt was first accepted by the node (or signed, for a bump or
    /// an event recorded before acceptance was kept; after a reorg, the block it had been mined
    /// in): bumps count blocks from here.
    attempt_at_block: Option<u64>,
    /// The attempt to keep alive on the network: the latest signed (original, bump or cancel),
    /// or, after its block was reorged out, the one that had been mined.
    live_attempt: Option<TxHash>,
    /// The live attempt cannot be bumped within the fee cap (an alert was raised).
    stuck_at_cap: bool,
    /// Height of the block of the mined attempt.
    mined_block_number: Option<u64>,
    /// Its hold was settled or released once (confirmed, failed on chain, cancelled, rejected,
    /// resolved): a later `needs_review` (its payment reorged out past the confirmation depth)
    /// holds nothing.
    settled: bool,
    /// Internal (rebalancing): held from and released to `treasury`, not a customer.
    treasury: bool,
    /// The principal who requested it (empty for streams older than principals).
    requested_by: String,
    /// Distinct approvers it needs while awaiting approval.
    approvals_required: u32,
    /// Distinct principals who approved it, in order.
    approvers: Vec<String>,
}

impl Withdrawal {
    // What the fold has made of the stream; nothing else sets these.
    /// Id.
    pub fn id(&self) -> WithdrawalId {
        self.id
    }

    /// Account paying.
    pub fn account_id(&self) -> AccountId {
        self.account_id
    }

    /// Client idempotency key.
    pub fn external_id(&self) -> &ExternalId {
        &self.external_id
    }

    /// Asset key.
    pub fn asset(&self) -> Asset {
        self.asset
    }

    /// Destination.
    pub fn destination(&self) -> &ChainAddress {
        &self.destination
    }

    /// Smallest units.
    pub fn amount(&self) -> Amount {
        self.amount
    }

    /// Current state.
    pub fn state(&self) -> WithdrawalState {
        self.state
    }

    /// Lane.
    pub fn lane(&self) -> &LaneName {
        &self.lane
    }

    /// Hot wallet, once signed.
    pub fn from_address(&self) -> Option<&ChainAddress> {
        self.from_address.as_ref()
    }

    /// Nonce, once signed.
    pub fn nonce(&self) -> Option<Nonce> {
        self.nonce
    }

    /// The attempt that matters now: the latest signed, or the one mined.
    pub fn tx_hash(&self) -> Option<TxHash> {
        self.tx_hash
    }

    /// Block of the mined attempt.
    pub fn mined_block_hash(&self) -> Option<BlockHash> {
        self.mined_block_hash
    }

    /// Last sequence number applied.
    pub fn last_seq(&self) -> i32 {
        self.last_seq
    }

    /// State before a cancel was requested.
    pub fn state_before_cancel(&self) -> Option<WithdrawalState> {
        self.state_before_cancel
    }

    /// Chain head when the live attempt was first accepted by the node (or signed, for a bump or
    /// an event recorded before acceptance was kept; after a reorg, the block it had been mined
    /// in): bumps count blocks from here.
    pub fn attempt_at_block(&self) -> Option<u64> {
        self.attempt_at_block
    }

    /// The attempt to keep alive on the network: the latest signed (original, bump or cancel),
    /// or, after its block was reorged out, the one that had been mined.
    pub fn live_attempt(&self) -> Option<TxHash> {
        self.live_attempt
    }

    /// The live attempt cannot be bumped within the fee cap (an alert was raised).
    pub fn stuck_at_cap(&self) -> bool {
        self.stuck_at_cap
    }

    /// Height of the block of the mined attempt.
    pub fn mined_block_number(&self) -> Option<u64> {
        self.mined_block_number
    }

    /// Its hold was settled or released once (confirmed, failed on chain, cancelled, rejected,
    /// resolved): a later `needs_review` (its payment reorged out past the confirmation depth)
    /// holds nothing.
    pub fn settled(&self) -> bool {
        self.settled
    }

    /// Internal (rebalancing): held from and released to `treasury`, not a customer.
    pub fn treasury(&self) -> bool {
        self.treasury
    }

    /// The principal who requested it (empty for streams older than principals).
    pub fn requested_by(&self) -> &str {
        &self.requested_by
    }

    /// Distinct approvers it needs while awaiting approval.
    pub fn approvals_required(&self) -> u32 {
        self.approvals_required
    }

    /// Distinct principals who approved it, in order.
    pub fn approvers(&self) -> &[String] {
        &self.approvers
    }

    /// Whether its hold is still held: a state that holds funds and no settlement or release
    /// before (a confirmed withdrawal sent back to review by a deep reorg holds nothing).
    pub fn holds_funds(&self) -> bool {
        self.state.holds_funds() && !self.settled
    }

    /// Starts a stream from its first event, which must be `requested`.
    pub fn start(id: WithdrawalId, first: &WithdrawalEvent) -> Option<Withdrawal> {
        let WithdrawalEvent::Requested {
            account_id,
            external_id,
            asset,
            destination,
            amount,
            lane,
            requested_by,
            treasury,
        } = first
        else {
            return None;
        };
        Some(Withdrawal {
            id,
            account_id: *account_id,
            external_id: external_id.clone(),
            asset: *asset,
            destination: destination.clone(),
            amount: *amount,
            state: WithdrawalState::Requested,
            lane: lane.clone(),
            from_address: None,
            nonce: None,
            tx_hash: None,
            mined_block_hash: None,
            last_seq: 1,
            state_before_cancel: None,
            attempt_at_block: None,
            live_attempt: None,
            stuck_at_cap: false,
            mined_block_number: None,
            settled: false,
            treasury: *treasury,
            requested_by: requested_by.clone(),
            approvals_required: 0,
            approvers: Vec::new(),
        })
    }

    /// Applies the next event.
    pub fn apply(&mut self, event: &WithdrawalEvent) {
        use WithdrawalEvent as E;
        use WithdrawalState as S;
        self.last_seq += 1;
        match event {
            E::Requested { .. } => panic!("BUG: withdrawal {} requested twice", self.id),
            E::AwaitingApproval { approvals, .. } => {
                self.approvals_required = *approvals;
                self.state = S::AwaitingApproval;
            }
            E::Approved { by } => {
                // Four eyes: the requester's own approval, or a second one by the same
                // principal, never counts (the action refuses both; the fold agrees).
                if *by != self.requested_by && !self.approvers.contains(by) {
                    self.approvers.push(by.clone());
                }
                let enough = self.approvers.len() >= usize::try_from(self.approvals_required).unwrap_or(usize::MAX);
                if self.state == S::AwaitingApproval && enough {
                    self.state = S::Requested;
                }
            }
            E::Rejected { .. } => {
                self.settled = true;
                self.state = S::Rejected;
            }
            E::Signed { from_address, nonce, tx_hash, at_block } => {
                self.attempt_at_block = Some(*at_block);
                self.from_address = Some(from_address.clone());
                self.nonce = *nonce;
                self.tx_hash = Some(*tx_hash);
                self.live_attempt = Some(*tx_hash);
                if self.state != S::CancelRequested {
                    self.state = S::Signed;
                }
            }
            E::Broadcast { tx_hash, at_block } => {
                self.tx_hash = Some(*tx_hash);
                if let Some(at_block) = at_block {
                    self.attempt_at_block = Some(*at_block);
                }
                if self.state == S::Signed {
                    self.state = S::Broadcast;
                }
            }
            E::Bumped { tx_hash, at_block } => {
                self.attempt_at_block = Some(*at_block);
                self.live_attempt = Some(*tx_hash);
                self.stuck_at_cap = false;
                if self.state != S::CancelRequested {
                    self.tx_hash = Some(*tx_hash);
                }
            }
            E::Mined { tx_hash, block_hash, block_number } => {
                self.tx_hash = Some(*tx_hash);
                self.mined_block_hash = Some(*block_hash);
                self.mined_block_number = Some(*block_number);
                self.stuck_at_cap = false;
                self.state = S::Mined;
            }
            E::Unmined { tx_hash, .. } => {
                // The mined bytes go out again; a cancel requested before they mined still
                // stands (whichever of our attempts mines next decides the outcome). Their age
                // counts from the block they were mined in: a reorg is no sign that their fee
                // was too low, and a replacement sent at once would have to outbid any spend of
                // their change too (BIP-125).
                self.attempt_at_block = self.mined_block_number.or(self.attempt_at_block);
                self.mined_block_hash = None;
                self.mined_block_number = None;
                self.live_attempt = Some(*tx_hash);
                self.state = if self.state_before_cancel.is_some() { S::CancelRequested } else { S::Broadcast };
            }
            E::FeeCapReached { .. } => self.stuck_at_cap = true,
            E::Resolved { paid, tx_hash, block_hash, .. } => {
                self.stuck_at_cap = false;
                self.settled = true;
                if *paid {
                    self.tx_hash = *tx_hash;
                    self.mined_block_hash = *block_hash;
                    self.state = S::Confirmed;
                } else {
                    self.state = S::Cancelled;
                }
            }
            E::Confirmed { .. } => {
                self.settled = true;
                self.state = S::Confirmed;
            }
            E::FailedOnchain { .. } => {
                self.settled = true;
                self.state = S::FailedOnchain;
            }
            E::CancelRequested { .. } => {
                self.state_before_cancel = Some(self.state);
                self.state = S::CancelRequested;
            }
            E::Cancelled { tx_hash, .. } => {
                if let Some(hash) = tx_hash {
                    self.tx_hash = Some(*hash);
                }
                self.settled = true;
                self.state = S::Cancelled;
            }
            E::NeedsReview { .. } => self.state = S::NeedsReview,
        }
    }

    /// Folds a whole stream.
    pub fn fold(id: WithdrawalId, events: &[WithdrawalEvent]) -> Option<Withdrawal> {
        let (first, rest) = events.split_first()?;
        let mut withdrawal = Withdrawal::start(id, first)?;
        for event in rest {
            withdrawal.apply(event);
        }
        Some(withdrawal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::address::fixtures::eth;
    use crate::hash::fixtures::{block, tx};

    #[test]
    fn attempt_kinds_round_trip_through_their_stored_names_and_unknown_names_are_refused() {
        for kind in [AttemptKind::Original, AttemptKind::Bump, AttemptKind::Cancel] {
            assert_eq!(kind.as_str().parse::<AttemptKind>(), Ok(kind));
        }
        assert!("Cancel".parse::<AttemptKind>().is_err());
        assert_eq!(AttemptKind::Original.replaced(), AttemptKind::Bump);
        assert_eq!(AttemptKind::Bump.replaced(), AttemptKind::Bump);
        assert_eq!(AttemptKind::Cancel.replaced(), AttemptKind::Cancel);
    }

    fn requested() -> WithdrawalEvent {
        WithdrawalEvent::Requested {
            account_id: crate::AccountId::new(1),
            external_id: crate::ExternalId::parse("e-1").unwrap(),
            asset: Asset::Native(crate::Chain::Eth),
            destination: eth(0x01),
            amount: Amount::from_u64(5),
            lane: LaneName::parse("a").unwrap(),
            requested_by: "client".into(),
            treasury: false,
        }
    }

    fn awaiting(approvals: u32) -> WithdrawalEvent {
        WithdrawalEvent::AwaitingApproval { limit: Amount::ZERO, approvals, reason: "approval_limit".into() }
    }

    #[test]
    fn events_round_trip_as_tagged_json() {
        let event = WithdrawalEvent::Signed {
            from_address: eth(0xab),
            nonce: Some(Nonce::new(7)),
            tx_hash: tx(0x01),
            at_block: 3,
        };
        let json = serde_json::to_value(&event).expect("serialise");
        assert_eq!(json["event_type"], "signed");
        assert_eq!(json["nonce"], 7);
        assert_eq!(serde_json::from_value::<WithdrawalEvent>(json).expect("deserialise"), event);
        let amount = serde_json::to_value(requested()).expect("serialise");
        assert_eq!(amount["amount"], "5", "amounts travel as decimal strings");
    }

    #[test]
    fn the_fold_follows_the_life_of_a_withdrawal() {
        use WithdrawalEvent as E;
        use WithdrawalState as S;
        let signed = E::Signed { from_address: eth(0xab), nonce: Some(Nonce::ZERO), tx_hash: tx(0x01), at_block: 1 };
        let mined = E::Mined { tx_hash: tx(0x02), block_hash: block(0xb1), block_number: 5 };
        let cases: Vec<(Vec<WithdrawalEvent>, S, Option<TxHash>)> = vec![
            (vec![requested()], S::Requested, None),
            (vec![requested(), awaiting(1)], S::AwaitingApproval, None),
            (vec![requested(), awaiting(1), E::Approved { by: "x".into() }], S::Requested, None),
            (vec![requested(), awaiting(2), E::Approved { by: "x".into() }], S::AwaitingApproval, None),
            (
                vec![requested(), awaiting(2), E::Approved { by: "x".into() }, E::Approved { by: "x".into() }],
                S::AwaitingApproval,
                None,
            ),
            (
                vec![requested(), awaiting(2), E::Approved { by: "client".into() }, E::Approved { by: "x".into() }],
                S::AwaitingApproval,
                None,
            ),
            (
                vec![requested(), awaiting(2), E::Approved { by: "x".into() }, E::Approved { by: "y".into() }],
                S::Requested,
                None,
            ),
            (
                vec![requested(), signed.clone(), E::Broadcast { tx_hash: tx(0x01), at_block: None }],
                S::Broadcast,
                Some(tx(0x01)),
            ),
            (
                vec![
                    requested(),
                    signed.clone(),
                    E::Broadcast { tx_hash: tx(0x01), at_block: None },
                    E::Bumped { tx_hash: tx(0x02), at_block: 4 },
                    mined.clone(),
                ],
                S::Mined,
                Some(tx(0x02)),
            ),
            (
                vec![
                    requested(),
                    signed.clone(),
                    mined.clone(),
                    E::Unmined { tx_hash: tx(0x02), block_hash: block(0xb1) },
                ],
                S::Broadcast,
                Some(tx(0x02)),
            ),
            (
                vec![
                    requested(),
                    signed.clone(),
                    E::CancelRequested { by: "x".into() },
                    E::Bumped { tx_hash: tx(0x03), at_block: 2 },
                ],
                S::CancelRequested,
                Some(tx(0x01)),
            ),
            (
                vec![requested(), E::Cancelled { tx_hash: None, fee: Amount::ZERO, by: Some("client".into()) }],
                S::Cancelled,
                None,
            ),
        ];
        for (events, state, hash) in cases {
            let folded = Withdrawal::fold(crate::WithdrawalId::new(9), &events).expect("starts with requested");
            assert_eq!(folded.state, state, "{events:?}");
            assert_eq!(folded.tx_hash, hash, "{events:?}");
            assert_eq!(folded.last_seq as usize, events.len());
        }
        assert!(Withdrawal::fold(crate::WithdrawalId::new(9), &[E::Approved { by: "x".into() }]).is_none());
        // A cancel requested before the payout mined still stands when its block is reorged out,
        // and the bytes that were mined are the ones kept alive, not the latest signed.
        let raced = Withdrawal::fold(
            crate::WithdrawalId::new(9),
            &[
                requested(),
                signed.clone(),
                E::Broadcast { tx_hash: tx(0x01), at_block: Some(3) },
                E::CancelRequested { by: "x".into() },
                E::Bumped { tx_hash: tx(0x03), at_block: 4 },
                E::Mined { tx_hash: tx(0x01), block_hash: block(0xb1), block_number: 5 },
                E::Unmined { tx_hash: tx(0x01), block_hash: block(0xb1) },
            ],
        )
        .unwrap();
        assert_eq!(raced.state, S::CancelRequested);
        assert_eq!(raced.live_attempt, Some(tx(0x01)));
        // Its age counts from the block it was mined in, not from the bump before it mined.
        assert_eq!(raced.attempt_at_block, Some(5));
        // Age counts from first acceptance, not from signing; a bump restarts it.
        let accepted = Withdrawal::fold(
            crate::WithdrawalId::new(9),
            &[requested(), signed.clone(), E::Broadcast { tx_hash: tx(0x01), at_block: Some(7) }],
        )
        .unwrap();
        assert_eq!(accepted.attempt_at_block, Some(7));
        let cap = E::FeeCapReached { tx_hash: tx(0x01), cap: Amount::from_u64(9), at_block: 8 };
        let stuck = Withdrawal::fold(crate::WithdrawalId::new(9), &[requested(), signed.clone(), cap.clone()]).unwrap();
        assert!(stuck.stuck_at_cap);
        let moved = Withdrawal::fold(
            crate::WithdrawalId::new(9),
            &[requested(), signed.clone(), cap, E::Bumped { tx_hash: tx(0x04), at_block: 9 }],
        )
        .unwrap();
        assert!(!moved.stuck_at_cap);
        // A stream recorded before approvals were counted still reads (one approver).
        let old = WithdrawalEvent::from_stored("awaiting_approval", &serde_json::json!({"limit": "1"})).unwrap();
        assert_eq!(
            old,
            WithdrawalEvent::AwaitingApproval { limit: Amount::from_u64(1), approvals: 1, reason: String::new() }
        );
        assert!(S::Broadcast.holds_funds() && !S::Confirmed.holds_funds());
    }
}
