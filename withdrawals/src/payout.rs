//! The pure parts of paying out: what a withdrawal's transaction calls, what a cancel calls, fee
//! maths, decoding stored bytes, and reading a token payment from a receipt's logs. No I/O.

use alloy::consensus::{TxEip1559, TxEnvelope};
use alloy::eips::eip2718::Decodable2718;
use alloy_primitives::{b256, Address, Bytes, TxKind, B256, U256};
use custodian_domain::withdrawal::Withdrawal;
use custodian_domain::Asset;

use crate::rpc::Log;
use crate::sql::Intent;

/// Gas of a plain ether transfer.
pub const TRANSFER_GAS: u64 = 21_000;

/// `keccak256("Transfer(address,address,uint256)")`.
pub const TRANSFER_TOPIC: B256 = b256!("ddf252ad1be2c89b69c2b068fc378daa952ba7f163c4a11628f55a4df523b3ef");

/// `transfer(address,uint256)`.
const TRANSFER_SELECTOR: [u8; 4] = [0xa9, 0x05, 0x9c, 0xbb];

/// `balanceOf(address)`.
const BALANCE_OF_SELECTOR: [u8; 4] = [0x70, 0xa0, 0x82, 0x31];

/// The `to`, `value` and calldata of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// Called address.
    pub to: Address,
    /// Wei sent.
    pub value: U256,
    /// Calldata.
    pub data: Bytes,
}

impl Call {
    /// The call `tx` makes (`None` for a contract creation, which we never sign).
    pub fn of(tx: &TxEip1559) -> Option<Call> {
        match tx.to {
            TxKind::Call(to) => Some(Call { to, value: tx.value, data: tx.input.clone() }),
            TxKind::Create => None,
        }
    }
}

/// Where an ETH withdrawal pays. The ETH worker and actions hold only ETH withdrawals: their
/// lanes are `eth` lanes, and a request's destination is parsed on its asset's chain.
pub(crate) fn eth_destination(w: &Withdrawal) -> Address {
    w.destination().eth().expect("BUG: an ETH withdrawal pays an ETH address").as_alloy()
}

/// The ERC-20 contract of a token asset key (`eth:0x…`), `None` for ether.
pub fn token_of(asset: Asset) -> Option<Address> {
    match asset {
        Asset::Erc20(contract) => Some(contract.as_alloy()),
        Asset::Native(_) => None,
    }
}

/// What the payout of `w` calls: ether straight to the destination, or the token's
/// `transfer(destination, amount)`.
pub fn payout_call(w: &Withdrawal) -> Call {
    let destination = eth_destination(w);
    match token_of(w.asset()) {
        None => Call { to: destination, value: w.amount().units(), data: Bytes::new() },
        Some(contract) => {
            let mut data = Vec::with_capacity(68);
            data.extend_from_slice(&TRANSFER_SELECTOR);
            data.extend_from_slice(&[0u8; 12]);
            data.extend_from_slice(destination.as_slice());
            data.extend_from_slice(&w.amount().units().to_be_bytes::<32>());
            Call { to: contract, value: U256::ZERO, data: Bytes::from(data) }
        }
    }
}

/// What a cancel calls: nothing, sent to ourselves.
pub fn cancel_call(hot_wallet: Address) -> Call {
    Call { to: hot_wallet, value: U256::ZERO, data: Bytes::new() }
}

/// The call that asks a token for `holder`'s balance.
pub fn balance_of_call(token: Address, holder: Address) -> Call {
    let mut data = Vec::with_capacity(36);
    data.extend_from_slice(&BALANCE_OF_SELECTOR);
    data.extend_from_slice(&[0u8; 12]);
    data.extend_from_slice(holder.as_slice());
    Call { to: token, value: U256::ZERO, data: Bytes::from(data) }
}

/// Which intent the mined transaction `tx` fulfils, compared field by field: the payout of the
/// withdrawal, a cancel, or neither (then our stored bytes pay something no intent asked for).
pub fn classify(tx: &TxEip1559, payout: &Call, cancel: &Call) -> Option<Intent> {
    let call = Call::of(tx)?;
    if call == *payout {
        Some(Intent::Payout)
    } else if call == *cancel {
        Some(Intent::Cancel)
    } else {
        None
    }
}

/// What `from` paid `to` in `token` according to a receipt's logs: the sum of the token's
/// `Transfer(from, to, value)` events. A token that returns `false`, takes a fee or pays less
/// shows less than asked here, whatever its receipt status.
pub fn token_paid(logs: &[Log], token: Address, from: Address, to: Address) -> U256 {
    logs.iter()
        .filter(|log| {
            log.address == token
                && log.topics.len() == 3
                && log.topics[0] == TRANSFER_TOPIC
                && log.topics[1] == from.into_word()
                && log.topics[2] == to.into_word()
                && log.data.len() == 32
        })
        .fold(U256::ZERO, |sum, log| sum.saturating_add(U256::from_be_slice(&log.data)))
}

/// Whether a token's `transfer` answered success in a simulation: no return data (tokens that
/// predate the standard, like USDT) or a first word that is not zero. A token that answers
/// `false` refuses the payment as surely as one that reverts.
pub fn transfer_returned_true(returned: &[u8]) -> bool {
    returned.is_empty() || (returned.len() >= 32 && returned[..32].iter().any(|b| *b != 0))
}

/// A `uint256` return value (`balanceOf`); `None` if the answer is not one.
pub fn returned_u256(returned: &[u8]) -> Option<U256> {
    (returned.len() >= 32).then(|| U256::from_be_slice(&returned[..32]))
}

/// Fees for a new attempt: twice the base fee plus the tip, within the cap.
pub fn fresh_fees(base: U256, tip: U256, cap: U256) -> (U256, U256) {
    let max_fee = base.saturating_mul(U256::from(2)).saturating_add(tip).min(cap);
    (max_fee, tip.min(max_fee))
}

/// At least 12.5% more than `old` (geth requires 10%), rounded up.
pub fn raised(old: U256) -> U256 {
    old.saturating_add(old.div_ceil(U256::from(8))).max(old.saturating_add(U256::from(1)))
}

/// The fees of a replacement of an attempt paying `old_max` / `old_tip`: both raised by at least
/// 12.5%, at least what a fresh attempt would pay now, within `cap`. `None` when the cap leaves no
/// room for a valid replacement.
pub fn replacement_fees(old_max: U256, old_tip: U256, base: U256, tip: U256, cap: U256) -> Option<(U256, U256)> {
    let (fresh_max, fresh_tip) = fresh_fees(base, tip, cap);
    let priority_fee = raised(old_tip).max(fresh_tip).min(cap);
    let max_fee = raised(old_max).max(fresh_max).max(priority_fee).min(cap);
    (priority_fee >= raised(old_tip) && max_fee >= raised(old_max)).then_some((max_fee, priority_fee))
}

/// The most an attempt can cost the hot wallet in ether: its value and its whole gas at its max fee.
pub fn worst_cost(tx: &TxEip1559) -> U256 {
    tx.value.saturating_add(U256::from(tx.gas_limit).saturating_mul(U256::from(tx.max_fee_per_gas)))
}

/// Decodes stored bytes, which we signed: anything else is a bug.
pub fn decode(raw: &[u8]) -> TxEip1559 {
    let envelope = TxEnvelope::decode_2718(&mut &raw[..]).expect("BUG: a stored attempt does not decode");
    envelope.as_eip1559().expect("BUG: attempts are EIP-1559").tx().clone()
}

/// `0x`-prefixed lower-case hex, as addresses and hashes are stored.
pub fn hex(value: impl std::fmt::LowerHex) -> String {
    format!("{value:#x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloy_primitives::address;
    use custodian_domain::withdrawal::WithdrawalEvent;
    use custodian_domain::Amount;
    use custodian_domain::{AccountId, ChainAddress, EthAddress, ExternalId, LaneName, WithdrawalId};

    const HOT: Address = address!("70997970c51812dc3a010c7d01b50e0d17dc79c8");
    const DEST: Address = address!("0000000000000000000000000000000051510001");
    const TOKEN: Address = address!("5fbdb2315678afecb367f032d93f642f64180aa3");

    fn withdrawal(asset: &str, amount: u64) -> Withdrawal {
        let requested = WithdrawalEvent::Requested {
            account_id: AccountId::new(1),
            external_id: ExternalId::parse("e").unwrap(),
            asset: Asset::parse_key(asset).unwrap(),
            destination: ChainAddress::Eth(EthAddress::from_alloy(DEST)),
            amount: Amount::from_u64(amount),
            lane: LaneName::parse("a").unwrap(),
            requested_by: "c".into(),
            treasury: false,
        };
        Withdrawal::fold(WithdrawalId::new(1), &[requested]).unwrap()
    }

    fn log(address: Address, from: Address, to: Address, value: u64) -> Log {
        Log {
            address,
            topics: vec![TRANSFER_TOPIC, from.into_word(), to.into_word()],
            data: Bytes::from(U256::from(value).to_be_bytes::<32>().to_vec()),
        }
    }

    #[test]
    fn bumps_raise_by_at_least_an_eighth_and_fresh_fees_respect_the_cap() {
        for (old, expected) in
            [(0u64, 1u64), (1, 2), (8, 9), (9, 11), (1_000_000_000, 1_125_000_000), (1_000_000_001, 1_125_000_002)]
        {
            assert_eq!(raised(U256::from(old)), U256::from(expected), "raised({old})");
            assert!(raised(U256::from(old)) * U256::from(8) >= U256::from(old) * U256::from(9));
        }
        let cap = U256::from(100u64);
        assert_eq!(fresh_fees(U256::from(10u64), U256::from(2u64), cap), (U256::from(22u64), U256::from(2u64)));
        assert_eq!(fresh_fees(U256::from(60u64), U256::from(2u64), cap), (cap, U256::from(2u64)));
        assert_eq!(fresh_fees(U256::from(60u64), U256::from(200u64), cap), (cap, cap));
    }

    #[test]
    fn a_replacement_raises_both_fields_or_is_refused_at_the_cap() {
        let u = |v: u64| U256::from(v);
        // Both fields raised by an eighth, or to what a fresh attempt pays now if that is more.
        assert_eq!(replacement_fees(u(80), u(8), u(10), u(2), u(1000)), Some((u(90), u(9))));
        assert_eq!(replacement_fees(u(80), u(8), u(100), u(2), u(1000)), Some((u(202), u(9))));
        // At the cap nothing valid remains: the replacement would be refused as underpriced.
        assert_eq!(replacement_fees(u(95), u(8), u(10), u(2), u(100)), None);
        assert_eq!(replacement_fees(u(100), u(100), u(10), u(2), u(100)), None);
    }

    #[test]
    fn a_mined_transaction_is_classified_by_what_it_calls_not_by_a_label() {
        let w = withdrawal("ETH", 5);
        let payout = payout_call(&w);
        let cancel = cancel_call(HOT);
        let tx = |call: &Call| TxEip1559 {
            to: TxKind::Call(call.to),
            value: call.value,
            input: call.data.clone(),
            ..Default::default()
        };
        assert_eq!(classify(&tx(&payout), &payout, &cancel), Some(Intent::Payout));
        assert_eq!(classify(&tx(&cancel), &payout, &cancel), Some(Intent::Cancel));
        let other = Call { to: DEST, value: U256::from(6u64), data: Bytes::new() };
        assert_eq!(classify(&tx(&other), &payout, &cancel), None, "pays another amount");
        let token = withdrawal(&format!("eth:{}", hex(TOKEN)), 7);
        let call = payout_call(&token);
        assert_eq!((call.to, call.value, call.data.len()), (TOKEN, U256::ZERO, 68));
        assert_eq!(&call.data[..4], &TRANSFER_SELECTOR);
        assert_eq!(U256::from_be_slice(&call.data[36..]), U256::from(7u64));
    }

    #[test]
    fn a_token_payment_is_what_the_transfer_logs_say() {
        let logs = vec![
            log(TOKEN, HOT, DEST, 90),
            log(TOKEN, HOT, HOT, 10),   // to someone else (a fee collector)
            log(DEST, HOT, DEST, 1000), // another contract's event
            log(TOKEN, DEST, HOT, 5),   // the other way
        ];
        assert_eq!(token_paid(&logs, TOKEN, HOT, DEST), U256::from(90u64));
        assert_eq!(token_paid(&[], TOKEN, HOT, DEST), U256::ZERO, "returned false: nothing moved");
        let mut two = logs.clone();
        two.push(log(TOKEN, HOT, DEST, 10));
        assert_eq!(token_paid(&two, TOKEN, HOT, DEST), U256::from(100u64));
    }

    #[test]
    fn a_transfer_that_answers_false_is_a_refusal() {
        let word = |v: u8| {
            let mut w = vec![0u8; 32];
            w[31] = v;
            w
        };
        assert!(transfer_returned_true(&[]), "no return value: tokens older than the standard");
        assert!(transfer_returned_true(&word(1)));
        assert!(!transfer_returned_true(&word(0)));
        assert!(!transfer_returned_true(&[1]), "not a word");
        assert_eq!(returned_u256(&word(7)), Some(U256::from(7u64)));
        assert_eq!(returned_u256(&[]), None);
    }
}
