//! The pure part of a BTC spend: weights and fees, coin selection (branch-and-bound for a
//! change-less match, then largest-first), the unsigned transaction, and the fee of a
//! replacement under BIP-125. No I/O; amounts are satoshis, fee rates satoshis per 1000 vbytes.

use bitcoin::{absolute, transaction, Amount, OutPoint, ScriptBuf, Sequence, Transaction, TxIn, TxOut, Witness};

use crate::btc_key::KeyPath;

/// Weight of one P2WPKH input at most: outpoint, empty script, sequence (41 bytes × 4) and the
/// witness (item count, a 73-byte signature with its sighash byte, a 33-byte key).
pub const P2WPKH_INPUT_WEIGHT: u64 = 41 * 4 + 1 + 1 + 73 + 1 + 33;
/// The script length of a P2WPKH output (our change).
pub const P2WPKH_SCRIPT_LEN: usize = 22;
/// Branch-and-bound gives up after this many steps and largest-first decides.
const BNB_TRIES: usize = 100_000;
/// A spend takes at most this many coins (standard transactions stay far below 400,000 weight).
pub const MAX_INPUTS: usize = 1_000;

/// A fee rate in satoshis per 1000 virtual bytes (Core's `CFeeRate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct FeeRate(pub u64);

impl FeeRate {
    /// From satoshis per vbyte.
    pub fn per_vb(sat: u64) -> FeeRate {
        FeeRate(sat.saturating_mul(1000))
    }

    /// The fee for `weight`, rounded up.
    pub fn fee(self, weight: u64) -> u64 {
        (u128::from(weight) * u128::from(self.0)).div_ceil(4000).try_into().unwrap_or(u64::MAX)
    }

    /// The rate `fee` pays for `vsize`, rounded down.
    pub fn of(fee: u64, vsize: u64) -> FeeRate {
        FeeRate(u64::try_from(u128::from(fee) * 1000 / u128::from(vsize.max(1))).unwrap_or(u64::MAX))
    }
}

/// One of our coins, as the selection sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Coin {
    /// The output.
    pub outpoint: OutPoint,
    /// Satoshis.
    pub amount: u64,
    /// Which of the lane's keys spends it.
    pub path: KeyPath,
}

fn varint_len(n: usize) -> u64 {
    match n {
        0..=0xfc => 1,
        0xfd..=0xffff => 3,
        _ => 5,
    }
}

/// Weight of an output with a script of `script_len` bytes.
pub fn output_weight(script_len: usize) -> u64 {
    (8 + varint_len(script_len) + script_len as u64) * 4
}

/// Weight of a segwit transaction with `inputs` P2WPKH inputs and outputs of these script lengths.
pub fn tx_weight(inputs: usize, scripts: impl IntoIterator<Item = usize>) -> u64 {
    let scripts: Vec<usize> = scripts.into_iter().collect();
    let outputs: u64 = scripts.iter().map(|len| output_weight(*len)).sum();
    (4 + 4 + varint_len(inputs) + varint_len(scripts.len())) * 4 + 2 + inputs as u64 * P2WPKH_INPUT_WEIGHT + outputs
}

/// What a selection chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Indices into the coins offered.
    pub coins: Vec<usize>,
    /// Change back to us, if any (never below the change output's dust limit).
    pub change: Option<u64>,
    /// Inputs minus outputs.
    pub fee: u64,
}

/// Chooses coins paying `payouts` (their script lengths and amounts) at `rate`, with change to a
/// P2WPKH output worth at least `dust`: first branch-and-bound for a set whose surplus over the
/// change-less fee is below what a change output would cost (no change), then largest-first.
/// `None`: the coins do not cover it.
pub fn select(coins: &[Coin], payouts: &[(usize, u64)], rate: FeeRate, dust: u64) -> Option<Selection> {
    let total: u64 = payouts.iter().map(|(_, a)| *a).try_fold(0u64, |s, a| s.checked_add(a))?;
    let scripts: Vec<usize> = payouts.iter().map(|(len, _)| *len).collect();
    // Effective values, scaled by 4000 so the fees of parts add up exactly: what each coin brings
    // after paying for its own input.
    let scale = |sat: u64| u128::from(sat) * 4000;
    let cost = |weight: u64| u128::from(weight) * u128::from(rate.0);
    let mut order: Vec<usize> =
        (0..coins.len()).filter(|i| scale(coins[*i].amount) > cost(P2WPKH_INPUT_WEIGHT)).collect();
    order.sort_by(|a, b| coins[*b].amount.cmp(&coins[*a].amount).then(a.cmp(b)));
    let values: Vec<u128> = order.iter().map(|i| scale(coins[*i].amount) - cost(P2WPKH_INPUT_WEIGHT)).collect();
    let target = scale(total) + cost(tx_weight(0, scripts.iter().copied()));
    let cost_of_change = cost(output_weight(P2WPKH_SCRIPT_LEN)) + cost(P2WPKH_INPUT_WEIGHT) + scale(dust);
    if let Some(picked) = branch_and_bound(&values, target, cost_of_change) {
        let chosen: Vec<usize> = picked.into_iter().map(|p| order[p]).collect();
        let sum: u64 = chosen.iter().map(|i| coins[*i].amount).sum();
        return Some(Selection { coins: chosen, change: None, fee: sum - total });
    }
    let mut chosen = Vec::new();
    let mut sum = 0u64;
    for i in order.iter().copied().take(MAX_INPUTS) {
        chosen.push(i);
        sum += coins[i].amount;
        let with_change = tx_weight(chosen.len(), scripts.iter().copied().chain([P2WPKH_SCRIPT_LEN]));
        let fee = rate.fee(with_change);
        if sum >= total + fee + dust {
            return Some(Selection { coins: chosen, change: Some(sum - total - fee), fee });
        }
        let without = rate.fee(tx_weight(chosen.len(), scripts.iter().copied()));
        if sum >= total + without {
            // Enough, but what is left is below dust: it goes to the miners.
            return Some(Selection { coins: chosen, change: None, fee: sum - total });
        }
    }
    None
}

/// Depth-first search over values in descending order for a sum in `[target, target +
/// tolerance]`, the least surplus found within [`BNB_TRIES`] steps; positions into `values`.
fn branch_and_bound(values: &[u128], target: u128, tolerance: u128) -> Option<Vec<usize>> {
    let mut remaining: Vec<u128> = vec![0; values.len() + 1];
    for i in (0..values.len()).rev() {
        remaining[i] = remaining[i + 1] + values[i];
    }
    if remaining[0] < target {
        return None;
    }
    let mut best: Option<(u128, Vec<usize>)> = None;
    // Inclusion first; on backtracking the last included value is excluded instead.
    let mut picked: Vec<usize> = Vec::new();
    let mut sum = 0u128;
    let mut position = 0usize;
    for _ in 0..BNB_TRIES {
        let backtrack = if sum > target + tolerance || sum + remaining[position] < target {
            true
        } else if sum >= target {
            let surplus = sum - target;
            if best.as_ref().is_none_or(|(b, _)| surplus < *b) {
                best = Some((surplus, picked.clone()));
            }
            // Adding more only raises the surplus.
            true
        } else if position == values.len() || picked.len() >= MAX_INPUTS {
            true
        } else {
            picked.push(position);
            sum += values[position];
            position += 1;
            false
        };
        if backtrack {
            let Some(last) = picked.pop() else { break };
            sum -= values[last];
            position = last + 1;
            // Excluding a coin and then including one of the same value only repeats sums
            // already tried (Bitcoin Core's BnB skips them alike).
            while position < values.len() && values[position] == values[last] {
                position += 1;
            }
            if best.as_ref().is_some_and(|(b, _)| *b == 0) {
                break;
            }
        }
    }
    best.map(|(_, picked)| picked)
}

/// The unsigned transaction spending `coins` to `outputs`: version 2, every input signalling
/// replaceability (BIP-125), no lock time.
pub fn unsigned(coins: &[&Coin], outputs: Vec<TxOut>) -> Transaction {
    Transaction {
        version: transaction::Version::TWO,
        lock_time: absolute::LockTime::ZERO,
        input: coins
            .iter()
            .map(|c| TxIn {
                previous_output: c.outpoint,
                script_sig: ScriptBuf::new(),
                sequence: Sequence::ENABLE_RBF_NO_LOCKTIME,
                witness: Witness::new(),
            })
            .collect(),
        output: outputs,
    }
}

/// A payout output.
pub fn pay(script: ScriptBuf, amount: u64) -> TxOut {
    TxOut { value: Amount::from_sat(amount), script_pubkey: script }
}

/// An unmined transaction of ours that a transaction needs mined first (its change is among the
/// transaction's inputs): what it pays and its size. A miner weighs the two together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ancestor {
    /// Its fee, satoshis.
    pub fee: u64,
    /// Its size, vbytes.
    pub vsize: u64,
}

/// The rate a transaction paying `fee` for `vsize` is mined at with `ancestors`, as a miner
/// weighs it: with those ancestors that pay less than the package they make (one paying more is
/// mined on its own first, and helps nothing).
fn effective_rate((fee, vsize): (u64, u64), ancestors: &[Ancestor]) -> FeeRate {
    let mut with: Vec<&Ancestor> = ancestors.iter().collect();
    loop {
        let rate = FeeRate::of(
            with.iter().fold(fee, |sum, a| sum.saturating_add(a.fee)),
            with.iter().fold(vsize, |sum, a| sum.saturating_add(a.vsize)),
        );
        let before = with.len();
        with.retain(|a| FeeRate::of(a.fee, a.vsize) < rate);
        if with.len() == before {
            return rate;
        }
    }
}

/// Bitcoin Core's `sendrawtransaction` refuses a transaction paying more than 0.10 BTC/kvB for its
/// own size (its default `maxfeerate`: `max-fee-exceeded`), whatever its ancestors: a replacement
/// paying for large ones could reach it before the cap, which applies to the package. Kept 5%
/// below, as a replacement's size is estimated before it is signed (sat/kvB).
pub const NODE_MAX_FEE_RATE: FeeRate = FeeRate(9_500_000);

/// The fee a replacement of a transaction that paid `old_fee` for `old_vsize` must pay at least,
/// for `new_weight`, to be accepted (BIP-125 rules 3–4 as Core applies them, plus ours), with its
/// unmined `ancestors` (child pays for parent): the rate it was mined at with them
/// ([`effective_rate`]) raised at least 12.5% and at least `incremental`, at least `target`. The
/// replacement pays that rate for its own size plus what each ancestor pays below that rate for
/// its own, and at least the old fee plus `incremental` for its own size. The old fee paid for
/// the ancestors too, so a second replacement raises what the package pays, never pays for the
/// ancestors twice. `None`: that rate is above `cap`, or the replacement would pay more for its
/// own size than the node relays ([`NODE_MAX_FEE_RATE`]).
pub fn replacement_fee(
    (old_fee, old_vsize): (u64, u64),
    ancestors: &[Ancestor],
    new_weight: u64,
    target: FeeRate,
    incremental: FeeRate,
    cap: FeeRate,
) -> Option<(u64, FeeRate)> {
    let old = effective_rate((old_fee, old_vsize), ancestors);
    let raised = FeeRate(old.0.saturating_mul(9).div_ceil(8).max(old.0.saturating_add(incremental.0)));
    let rate = raised.max(target);
    if rate > cap {
        return None;
    }
    let shortfall = ancestors
        .iter()
        .fold(0u64, |sum, a| sum.saturating_add(rate.fee(a.vsize.saturating_mul(4)).saturating_sub(a.fee)));
    let fee = rate.fee(new_weight).saturating_add(shortfall).max(old_fee.saturating_add(incremental.fee(new_weight)));
    (FeeRate::of(fee, new_weight.div_ceil(4)) <= NODE_MAX_FEE_RATE).then_some((fee, rate))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bitcoin::hashes::Hash;

    fn coin(n: u8, amount: u64) -> Coin {
        Coin {
            outpoint: OutPoint { txid: bitcoin::Txid::from_byte_array([n; 32]), vout: 0 },
            amount,
            path: KeyPath::Funding,
        }
    }

    #[test]
    fn weights_match_a_signed_p2wpkh_transaction() {
        // One input, two P2WPKH outputs: 141 vbytes with a 72-byte signature, 140.75 with 71.
        let weight = tx_weight(1, [22, 22]);
        assert_eq!(weight, 42 + P2WPKH_INPUT_WEIGHT + 2 * 31 * 4);
        assert_eq!(FeeRate::per_vb(2).fee(weight), weight.div_ceil(2));
    }

    #[test]
    fn exact_match_needs_no_change() {
        let rate = FeeRate::per_vb(1);
        let fee_one_input = rate.fee(tx_weight(1, [22]));
        let coins = [coin(1, 70_000), coin(2, 50_000 + fee_one_input), coin(3, 10_000)];
        let s = select(&coins, &[(22, 50_000)], rate, 294).expect("covered");
        assert_eq!(s.coins, vec![1]);
        assert_eq!(s.change, None);
        assert_eq!(s.fee, fee_one_input);
    }

    #[test]
    fn largest_first_with_change_when_nothing_matches() {
        let rate = FeeRate::per_vb(5);
        let coins = [coin(1, 30_000), coin(2, 400_000), coin(3, 90_000)];
        let s = select(&coins, &[(22, 100_000), (34, 50_000)], rate, 294).expect("covered");
        assert_eq!(s.coins, vec![1]);
        let fee = rate.fee(tx_weight(1, [22, 34, 22]));
        assert_eq!(s.fee, fee);
        assert_eq!(s.change, Some(400_000 - 150_000 - fee));
    }

    #[test]
    fn equal_coins_are_searched_once() {
        // 500 equal coins and no exact match: without skipping equal values the search would try
        // every combination of them before giving up.
        let rate = FeeRate::per_vb(1);
        let coins: Vec<Coin> = (0..500).map(|i| coin((i % 250) as u8, 50_000)).collect();
        let started = std::time::Instant::now();
        let s = select(&coins, &[(22, 1_000_000)], rate, 294).expect("covered");
        assert!(started.elapsed() < std::time::Duration::from_millis(200), "{:?}", started.elapsed());
        assert_eq!(s.coins.len(), 21, "largest-first after the search");
        assert!(s.change.is_some());
    }

    #[test]
    fn not_enough_is_none_never_partial() {
        let coins = [coin(1, 30_000), coin(2, 20_000)];
        assert_eq!(select(&coins, &[(22, 50_000)], FeeRate::per_vb(1), 294), None);
        assert_eq!(select(&[], &[(22, 1)], FeeRate::per_vb(1), 294), None);
    }

    #[test]
    fn a_replacement_raises_the_rate_and_the_absolute_fee() {
        let none = &[];
        let (fee, rate) =
            replacement_fee((1_410, 141), none, 564, FeeRate::per_vb(1), FeeRate::per_vb(1), FeeRate::per_vb(100))
                .expect("under cap");
        assert_eq!(rate, FeeRate(11_250), "10 sat/vB raised by 12.5%");
        assert!(fee >= 1_410 + 141, "pays for its own relay: {fee}");
        assert_eq!(fee, FeeRate(11_250).fee(564));
        // Low rates: the incremental fee decides.
        let (_, rate) = replacement_fee((141, 141), none, 564, FeeRate(0), FeeRate::per_vb(1), FeeRate::per_vb(100))
            .expect("under cap");
        assert_eq!(rate, FeeRate(2_000));
        assert_eq!(
            replacement_fee((14_100, 141), none, 564, FeeRate(0), FeeRate::per_vb(1), FeeRate::per_vb(100)),
            None
        );
    }

    /// With an unmined parent (250 vB paying 500 sats) and the market at 20 sat/vB: the first
    /// replacement of a 150 vB child paying 150 brings the two to 20 sat/vB; a second one raises
    /// that package rate by 12.5%, to 22.5. Priced on the child's own rate with the parent's
    /// shortfall added each time, the second paid 21,173 sats (56 sat/vB on the child alone, the
    /// parent's shortfall at that rate on top): the old fee held the first shortfall already.
    #[test]
    fn a_second_replacement_raises_the_packages_rate_without_paying_for_the_parent_twice() {
        let parent = [Ancestor { fee: 500, vsize: 250 }];
        let (cap, incremental) = (FeeRate::per_vb(500), FeeRate::per_vb(1));
        let (first, rate) =
            replacement_fee((150, 150), &parent, 600, FeeRate::per_vb(20), incremental, cap).expect("under cap");
        assert_eq!((first, rate), (20 * 400 - 500, FeeRate::per_vb(20)), "the two at 20 sat/vB");
        let (second, rate) =
            replacement_fee((first, 150), &parent, 600, FeeRate::per_vb(20), incremental, cap).expect("under cap");
        assert_eq!(rate, FeeRate(22_500));
        assert_eq!(second, 22_500 * 400 / 1000 - 500, "the two at 22.5 sat/vB");
        // Without ancestors, as before.
        let alone = replacement_fee((first, 150), &[], 600, FeeRate::per_vb(20), incremental, cap);
        assert_eq!(alone.map(|(_, rate)| rate), Some(FeeRate(FeeRate::of(first, 150).0 * 9 / 8)));
    }

    /// An ancestor paying more than the rate needs no help (a miner takes it on its own first) and
    /// lowers nothing: a parent of 1,000 vB at 100 sat/vB beside a child of 150 vB at 1 sat/vB,
    /// market at 20. Averaged into the package, the two were at 87 sat/vB and the child paid
    /// 12,668 sats (84 sat/vB, or the fee cap); it pays 20 sat/vB for itself. Beside a parent at
    /// 22 sat/vB, averaging left the child at 17.3 sat/vB of its own, below the market.
    #[test]
    fn an_ancestor_paying_more_than_the_rate_is_neither_averaged_in_nor_paid_for() {
        let (cap, incremental, market) = (FeeRate::per_vb(500), FeeRate::per_vb(1), FeeRate::per_vb(20));
        let rich = [Ancestor { fee: 100_000, vsize: 1_000 }];
        assert_eq!(replacement_fee((150, 150), &rich, 600, market, incremental, cap), Some((3_000, market)));
        let above = [Ancestor { fee: 4_400, vsize: 200 }];
        assert_eq!(replacement_fee((150, 150), &above, 600, market, incremental, cap), Some((3_000, market)));
        // Beside one that needs help, only that one is paid for.
        let both = [rich[0], Ancestor { fee: 500, vsize: 250 }];
        assert_eq!(replacement_fee((150, 150), &both, 600, market, incremental, cap), Some((3_000 + 4_500, market)));
    }

    /// A small child paying for a large parent at a high market rate would pay more for its own
    /// size than Core relays (0.10 BTC/kvB): none, as at the cap, where the node would refuse it
    /// at every pass. A parent of 20,000 vB at 1 sat/vB and a child of 141 vB, market 100 sat/vB:
    /// 1,994,100 sats, 14,142 sat/vB of its own. At 20 sat/vB, 382,820 sats (2,715 sat/vB).
    #[test]
    fn a_replacement_the_node_would_refuse_for_its_own_rate_is_none() {
        let (cap, incremental) = (FeeRate::per_vb(500), FeeRate::per_vb(1));
        let parent = [Ancestor { fee: 20_000, vsize: 20_000 }];
        assert_eq!(replacement_fee((141, 141), &parent, 564, FeeRate::per_vb(100), incremental, cap), None);
        assert_eq!(
            replacement_fee((141, 141), &parent, 564, FeeRate::per_vb(20), incremental, cap),
            Some((382_820, FeeRate::per_vb(20)))
        );
    }
}
