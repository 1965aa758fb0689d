//! The posting rules of withdrawals, stated once: which transfers each event of a withdrawal's
//! stream entails ([`entailed`]), and what each transfer moves from whom to whom ([`booking`]).
//!
//! The live path posts what an event entails in the transaction that appends it
//! (`withdrawals::sql::post_entailed`, through `store::ledger`); `replay --verify` books every
//! stream with the same rules ([`bookings`]) and compares the result with the ledger. A transfer
//! is keyed `withdrawal:{id}:{hold|release|settle|fee}`, so each is booked once, as first entailed:
//! a payment confirmed, reorged out past the depth and resolved as paid settles once, with the
//! first fee.

use std::collections::HashSet;

use crate::withdrawal::{Withdrawal, WithdrawalEvent};
use crate::{Amount, Asset, LedgerAccount, WithdrawalId};

/// The kinds of transfer a withdrawal makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Movement {
    /// Request: the payer's money goes to `withdrawal_holds`.
    Hold,
    /// Rejected, cancelled, failed on chain or resolved as not paid: the hold goes back.
    Release,
    /// Confirmed or resolved as paid: the held amount left custody.
    Settle,
    /// The real fee, paid from custody to the network.
    Fee,
}

/// The movements `event` entails, each with the fee it carries (zero but for [`Movement::Fee`]).
pub fn entailed(event: &WithdrawalEvent) -> Vec<(Movement, Amount)> {
    use Movement::{Fee, Hold, Release, Settle};
    match event {
        WithdrawalEvent::Requested { .. } => vec![(Hold, Amount::ZERO)],
        WithdrawalEvent::Rejected { .. } => vec![(Release, Amount::ZERO)],
        // The fee of whatever consumed the nonce (or spent the coins) left our wallet either way.
        WithdrawalEvent::Cancelled { fee, .. } | WithdrawalEvent::FailedOnchain { fee, .. } => {
            vec![(Release, Amount::ZERO), (Fee, *fee)]
        }
        WithdrawalEvent::Confirmed { fee, .. } => vec![(Settle, Amount::ZERO), (Fee, *fee)],
        WithdrawalEvent::Resolved { paid, fee, .. } => {
            vec![(if *paid { Settle } else { Release }, Amount::ZERO), (Fee, *fee)]
        }
        _ => Vec::new(),
    }
}

/// The asset a withdrawal of `asset` pays its network fee in: its chain's own coin (gas is paid
/// in ether whatever an ETH withdrawal pays; a BTC fee in bitcoin).
pub fn fee_asset(asset: Asset) -> Asset {
    Asset::Native(asset.chain())
}

/// One transfer of a withdrawal, as the ledger books it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booking {
    /// `withdrawal:{id}:{hold|release|settle|fee}`.
    pub key: String,
    /// The transfer's kind.
    pub kind: &'static str,
    /// Debited.
    pub debit: LedgerAccount,
    /// Credited.
    pub credit: LedgerAccount,
    /// What moves.
    pub asset: Asset,
    /// More than zero.
    pub amount: Amount,
}

/// What `movement` books for `w` (`fee` for [`Movement::Fee`]); `None` when it moves nothing.
pub fn booking(w: &Withdrawal, movement: Movement, fee: Amount) -> Option<Booking> {
    use LedgerAccount::{Custody, NetworkFees, WithdrawalHolds};
    let payer = LedgerAccount::payer(w.account_id().get(), w.treasury());
    let (kind, suffix, debit, credit, asset, amount) = match movement {
        Movement::Hold => ("withdrawal_hold", "hold", payer, WithdrawalHolds, w.asset(), w.amount()),
        Movement::Release => ("withdrawal_release", "release", WithdrawalHolds, payer, w.asset(), w.amount()),
        Movement::Settle => ("withdrawal_settle", "settle", WithdrawalHolds, Custody, w.asset(), w.amount()),
        Movement::Fee => ("network_fee", "fee", NetworkFees, Custody, fee_asset(w.asset()), fee),
    };
    (!amount.is_zero()).then(|| Booking {
        key: format!("withdrawal:{}:{suffix}", w.id()),
        kind,
        debit,
        credit,
        asset,
        amount,
    })
}

/// Every transfer the stream `events` of withdrawal `id` entails, each once, as first entailed;
/// empty when the stream does not start with `requested`.
pub fn bookings(id: WithdrawalId, events: &[WithdrawalEvent]) -> Vec<Booking> {
    let Some(w) = events.first().and_then(|first| Withdrawal::start(id, first)) else { return Vec::new() };
    let mut booked: HashSet<Movement> = HashSet::new();
    let mut out = Vec::new();
    for event in events {
        for (movement, fee) in entailed(event) {
            if let Some(b) = booking(&w, movement, fee) {
                if booked.insert(movement) {
                    out.push(b);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::address::fixtures::eth;
    use crate::hash::fixtures::{block, tx};
    use crate::withdrawal::WithdrawalEvent as E;
    use crate::LaneName;

    /// A token's asset key.
    const USDC: &str = "eth:0x00000000000000000000000000000000000000c0";

    fn requested(treasury: bool) -> E {
        E::Requested {
            account_id: crate::AccountId::new(7),
            external_id: crate::ExternalId::parse("x").unwrap(),
            asset: Asset::parse_key(USDC).unwrap(),
            destination: eth(0x01),
            amount: Amount::from_u64(500),
            lane: LaneName::parse("a").unwrap(),
            requested_by: "app".into(),
            treasury,
        }
    }

    fn keys(bookings: &[Booking]) -> Vec<(String, String, String, String, String)> {
        bookings
            .iter()
            .map(|b| {
                (b.key.clone(), b.debit.to_string(), b.credit.to_string(), b.asset.to_string(), b.amount.to_string())
            })
            .collect()
    }

    #[test]
    fn a_token_payout_holds_settles_and_pays_its_fee_in_ether_once() {
        let confirmed = |fee| E::Confirmed { tx_hash: tx(0x01), block_hash: block(0xb1), fee: Amount::from_u64(fee) };
        let resolved_paid =
            E::Resolved { paid: true, tx_hash: None, block_hash: None, fee: Amount::from_u64(9), by: "o".into() };
        let stream = [requested(false), confirmed(30), E::NeedsReview { reason: "reorged".into() }, resolved_paid];
        let s = |x: &str| x.to_owned();
        assert_eq!(
            keys(&bookings(crate::WithdrawalId::new(4), &stream)),
            [
                (s("withdrawal:4:hold"), s("user:7"), s("withdrawal_holds"), s(USDC), s("500")),
                (s("withdrawal:4:settle"), s("withdrawal_holds"), s("custody"), s(USDC), s("500")),
                (s("withdrawal:4:fee"), s("network_fees"), s("custody"), s("ETH"), s("30")),
            ]
        );
    }

    #[test]
    fn a_release_returns_the_hold_to_its_payer_and_a_free_cancel_books_no_fee() {
        let cancelled = E::Cancelled { tx_hash: None, fee: Amount::ZERO, by: Some("c".into()) };
        let s = |x: &str| x.to_owned();
        assert_eq!(
            keys(&bookings(crate::WithdrawalId::new(5), &[requested(true), cancelled])),
            [
                (s("withdrawal:5:hold"), s("treasury"), s("withdrawal_holds"), s(USDC), s("500")),
                (s("withdrawal:5:release"), s("withdrawal_holds"), s("treasury"), s(USDC), s("500")),
            ]
        );
        let failed = E::FailedOnchain { tx_hash: tx(0x01), block_hash: block(0xb1), fee: Amount::from_u64(3) };
        let booked = bookings(crate::WithdrawalId::new(6), &[requested(false), failed]);
        assert_eq!(
            booked.iter().map(|b| b.kind).collect::<Vec<_>>(),
            ["withdrawal_hold", "withdrawal_release", "network_fee"]
        );
        assert!(
            bookings(crate::WithdrawalId::new(6), &[E::Rejected { reason: "r".into() }]).is_empty(),
            "a stream starts with requested"
        );
    }
}
