//! The simulator's mempool: acceptance as Bitcoin Core 28's `AcceptToMemoryPool` with default
//! policy (full replace-by-fee, 1 sat/vB minimum relay and incremental fee, 3 sat/vB dust), every
//! input script verified by Bitcoin Core's own interpreter (`bitcoinconsensus`), and the reasons
//! and codes `sendrawtransaction` / `testmempoolaccept` answer with (`src/validation.cpp`,
//! `src/policy/rbf.cpp`, `src/node/transaction.cpp`, `src/common/messages.cpp`).

use std::collections::{HashMap, HashSet};

use bitcoin::hashes::{hash160, Hash};
use bitcoin::{Amount, OutPoint, Transaction, TxOut, Txid, Wtxid};

/// Core's `COINBASE_MATURITY`.
const COINBASE_MATURITY: u64 = 100;
/// `-minrelaytxfee` and `-incrementalrelayfee` defaults: 1 sat/vB.
const MIN_RELAY_SAT_PER_KVB: u64 = 1_000;
/// `sendrawtransaction`'s default `maxfeerate`: 0.10 BTC/kvB.
const MAX_FEE_RATE_SAT_PER_KVB: u64 = 10_000_000;

/// A coin the chain (or the mempool) can spend.
#[derive(Debug, Clone)]
pub(super) struct Coin {
    pub(super) txout: TxOut,
    /// Height of the block that created it; `None` for a mempool output.
    pub(super) height: Option<u64>,
    pub(super) coinbase: bool,
}

/// One accepted transaction.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) tx: Transaction,
    pub(super) wtxid: Wtxid,
    pub(super) fee: Amount,
    pub(super) vsize: u64,
    /// Seconds since the epoch when it entered.
    pub(super) time: u64,
    /// Chain height when it entered.
    pub(super) height: u64,
}

/// Transactions waiting for a block, and which mempool transaction spends each outpoint.
#[derive(Debug, Default)]
pub(super) struct Mempool {
    pub(super) entries: HashMap<Txid, Entry>,
    spends: HashMap<OutPoint, Txid>,
    /// Acceptance order, so blocks include parents before children.
    order: Vec<Txid>,
}

/// Why a transaction was refused: Core's `TransactionError` with its state string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// An output already exists in the UTXO set: the transaction is in the chain (-27).
    AlreadyInUtxoSet,
    /// An input is neither in the UTXO set nor in the mempool (-25).
    MissingInputs,
    /// `maxfeerate` exceeded (-25).
    MaxFeeExceeded,
    /// Rejected by the mempool (-26), with Core's state string.
    Rejected(String),
}

impl Refusal {
    /// The JSON-RPC error code and message `sendrawtransaction` answers with.
    pub(super) fn rpc(&self) -> (i32, String) {
        match self {
            Refusal::AlreadyInUtxoSet => (-27, "Transaction outputs already in utxo set".to_owned()),
            Refusal::MissingInputs => (-25, "Inputs missing or spent".to_owned()),
            Refusal::MaxFeeExceeded => {
                (-25, "Fee exceeds maximum configured by user (e.g. -maxtxfee, maxfeerate)".to_owned())
            }
            Refusal::Rejected(reason) => (-26, reason.clone()),
        }
    }

    /// The `reject-reason` `testmempoolaccept` reports.
    pub(super) fn reject_reason(&self) -> String {
        match self {
            Refusal::AlreadyInUtxoSet => "txn-already-known".to_owned(),
            Refusal::MissingInputs => "missing-inputs".to_owned(),
            Refusal::MaxFeeExceeded => "max-fee-exceeded".to_owned(),
            Refusal::Rejected(reason) => reason.clone(),
        }
    }
}

/// What acceptance found, before anything changes.
pub(super) struct Accepted {
    pub(super) entry: Entry,
    /// Mempool transactions it replaces (direct conflicts and their descendants).
    pub(super) replaced: Vec<Txid>,
}

/// Core's `FormatMoney`: at least two decimals, trailing zeros beyond them trimmed.
pub(super) fn format_money(amount: Amount) -> String {
    let sat = amount.to_sat();
    let mut text = format!("{}.{:08}", sat / 100_000_000, sat % 100_000_000);
    while text.ends_with('0') && text.len() - text.find('.').expect("BUG: a decimal point") > 3 {
        text.pop();
    }
    text
}

/// Core's `CFeeRate::ToString`: `0.00001000 BTC/kvB`.
fn format_fee_rate(sat_per_kvb: u64) -> String {
    format!("{}.{:08} BTC/kvB", sat_per_kvb / 100_000_000, sat_per_kvb % 100_000_000)
}

/// Fee per 1000 virtual bytes, as `CFeeRate(fee, vsize)` computes it.
fn rate(fee: Amount, vsize: u64) -> u64 {
    fee.to_sat().saturating_mul(1000) / vsize.max(1)
}

/// The reason Core's interpreter gives for a P2WPKH spend that fails: the witness's public key
/// does not hash to the program (`OP_EQUALVERIFY`), or its signature does not verify
/// (`NULLFAIL`, which standard policy checks first); for other scripts the interpreter's final
/// verdict.
fn script_error(spent: &TxOut, tx: &Transaction, input: usize) -> &'static str {
    let witness = &tx.input[input].witness;
    if spent.script_pubkey.is_p2wpkh() {
        if witness.len() != 2 {
            return "Witness program hash mismatch";
        }
        let program = &spent.script_pubkey.as_bytes()[2..];
        let pubkey = witness.nth(1).unwrap_or_default();
        if hash160::Hash::hash(pubkey).as_byte_array() != program {
            return "Script failed an OP_EQUALVERIFY operation";
        }
        return "Signature must be zero for failed CHECK(MULTI)SIG operation";
    }
    "Script evaluated without error but finished with a false/empty top stack element"
}

impl Mempool {
    /// Whether `txid` waits here.
    pub(super) fn contains(&self, txid: &Txid) -> bool {
        self.entries.contains_key(txid)
    }

    /// Every waiting transaction, parents before children.
    pub(super) fn in_order(&self) -> Vec<Transaction> {
        self.order.iter().filter_map(|txid| self.entries.get(txid)).map(|e| e.tx.clone()).collect()
    }

    /// The mempool's own output `outpoint`, if a waiting transaction creates it.
    fn output(&self, outpoint: &OutPoint) -> Option<TxOut> {
        self.entries.get(&outpoint.txid).and_then(|e| e.tx.output.get(outpoint.vout as usize)).cloned()
    }

    /// `txid` and every waiting transaction that spends its outputs, recursively.
    fn with_descendants(&self, txid: Txid) -> Vec<Txid> {
        let mut found = vec![txid];
        let mut cursor = 0;
        while cursor < found.len() {
            let parent = found[cursor];
            if let Some(entry) = self.entries.get(&parent) {
                for vout in 0..entry.tx.output.len() {
                    let outpoint = OutPoint { txid: parent, vout: u32::try_from(vout).expect("BUG: vout beyond u32") };
                    if let Some(child) = self.spends.get(&outpoint).filter(|c| !found.contains(c)) {
                        found.push(*child);
                    }
                }
            }
            cursor += 1;
        }
        found
    }

    /// Core's acceptance of `tx` against `utxos` (the active chain's unspent outputs) at
    /// `height`, without changing anything. `max_fee_rate` is `sendrawtransaction`'s (sat/kvB;
    /// zero: no limit).
    pub(super) fn check(
        &self,
        tx: &Transaction,
        utxos: &HashMap<OutPoint, Coin>,
        height: u64,
        max_fee_rate: Option<u64>,
        now: u64,
    ) -> Result<Accepted, Refusal> {
        let txid = tx.compute_txid();
        let reject = |reason: String| Err(Refusal::Rejected(reason));
        if tx.input.is_empty() || tx.output.is_empty() {
            return reject(if tx.input.is_empty() { "bad-txns-vin-empty" } else { "bad-txns-vout-empty" }.into());
        }
        if tx.is_coinbase() {
            return reject("coinbase".into());
        }
        let unique: HashSet<&OutPoint> = tx.input.iter().map(|i| &i.previous_output).collect();
        if unique.len() != tx.input.len() {
            return reject("bad-txns-inputs-duplicate".into());
        }
        if (0..tx.output.len()).any(|vout| {
            utxos.contains_key(&OutPoint { txid, vout: u32::try_from(vout).expect("BUG: vout beyond u32") })
        }) {
            return Err(Refusal::AlreadyInUtxoSet);
        }
        // Standardness of the outputs: dust.
        if tx.output.iter().any(|o| !o.script_pubkey.is_op_return() && o.value < o.script_pubkey.minimal_non_dust()) {
            return reject("dust".into());
        }
        // Inputs: the chain's coins, the mempool's outputs, or a conflict with a waiting spend.
        let mut spent = Vec::with_capacity(tx.input.len());
        let mut conflicts = Vec::new();
        for input in &tx.input {
            let outpoint = input.previous_output;
            if let Some(other) = self.spends.get(&outpoint) {
                if !conflicts.contains(other) {
                    conflicts.push(*other);
                }
            }
            let coin = utxos
                .get(&outpoint)
                .cloned()
                .or_else(|| self.output(&outpoint).map(|txout| Coin { txout, height: None, coinbase: false }));
            let Some(coin) = coin else { return Err(Refusal::MissingInputs) };
            if coin.coinbase {
                let depth = height + 1 - coin.height.expect("BUG: a coinbase coin is confirmed");
                if depth < COINBASE_MATURITY {
                    return reject(format!(
                        "bad-txns-premature-spend-of-coinbase, tried to spend coinbase at depth {depth}"
                    ));
                }
            }
            spent.push(coin.txout);
        }
        let value_in = spent.iter().map(|o| o.value).sum::<Amount>();
        let value_out = tx.output.iter().map(|o| o.value).sum::<Amount>();
        if value_in < value_out {
            return reject(format!(
                "bad-txns-in-belowout, value in ({}) < value out ({})",
                format_money(value_in),
                format_money(value_out)
            ));
        }
        let fee = value_in - value_out;
        let vsize = tx.vsize() as u64;
        let minimum = Amount::from_sat(MIN_RELAY_SAT_PER_KVB * vsize / 1000);
        if fee < minimum {
            return reject(format!("min relay fee not met, {} < {}", fee.to_sat(), minimum.to_sat()));
        }
        // Replacement (full RBF, as Core 28 by default): a higher fee rate than every direct
        // conflict, and enough more absolute fee to pay for relaying the replacement.
        let mut replaced = Vec::new();
        if !conflicts.is_empty() {
            for conflict in &conflicts {
                let old = &self.entries[conflict];
                if rate(fee, vsize) <= rate(old.fee, old.vsize) {
                    return reject(format!(
                        "insufficient fee, rejecting replacement {txid}; new feerate {} <= old feerate {}",
                        format_fee_rate(rate(fee, vsize)),
                        format_fee_rate(rate(old.fee, old.vsize))
                    ));
                }
            }
            for conflict in &conflicts {
                for evicted in self.with_descendants(*conflict) {
                    if !replaced.contains(&evicted) {
                        replaced.push(evicted);
                    }
                }
            }
            let replaced_fees = replaced.iter().map(|t| self.entries[t].fee).sum::<Amount>();
            let needed = replaced_fees + Amount::from_sat(MIN_RELAY_SAT_PER_KVB * vsize / 1000);
            if fee < needed {
                return reject(format!(
                    "insufficient fee, rejecting replacement {txid}, not enough additional fees to relay; {} < {}",
                    format_money(fee - replaced_fees.min(fee)),
                    format_money(needed - replaced_fees)
                ));
            }
        }
        // Every input script, by Bitcoin Core's interpreter.
        let prevouts: HashMap<OutPoint, TxOut> =
            tx.input.iter().map(|i| i.previous_output).zip(spent.iter().cloned()).collect();
        if tx.verify(|outpoint| prevouts.get(outpoint).cloned()).is_err() {
            let failing = (0..tx.input.len())
                .find(|i| {
                    let spent = &prevouts[&tx.input[*i].previous_output];
                    let bytes = bitcoin::consensus::serialize(tx);
                    spent.script_pubkey.verify(*i, spent.value, &bytes).is_err()
                })
                .unwrap_or(0);
            let spent = &prevouts[&tx.input[failing].previous_output];
            return reject(format!("mandatory-script-verify-flag-failed ({})", script_error(spent, tx, failing)));
        }
        if max_fee_rate.is_some_and(|max| max > 0 && rate(fee, vsize) > max) {
            return Err(Refusal::MaxFeeExceeded);
        }
        let entry = Entry { wtxid: tx.compute_wtxid(), tx: tx.clone(), fee, vsize, time: now, height };
        Ok(Accepted { entry, replaced })
    }

    /// Adds what [`Mempool::check`] accepted, evicting what it replaces.
    pub(super) fn insert(&mut self, accepted: Accepted) {
        for txid in &accepted.replaced {
            self.remove(txid);
        }
        let txid = accepted.entry.tx.compute_txid();
        for input in &accepted.entry.tx.input {
            self.spends.insert(input.previous_output, txid);
        }
        self.order.push(txid);
        self.entries.insert(txid, accepted.entry);
    }

    /// Removes `txid` (not its descendants).
    pub(super) fn remove(&mut self, txid: &Txid) -> Option<Entry> {
        let entry = self.entries.remove(txid)?;
        for input in &entry.tx.input {
            if self.spends.get(&input.previous_output) == Some(txid) {
                self.spends.remove(&input.previous_output);
            }
        }
        self.order.retain(|t| t != txid);
        Some(entry)
    }

    /// After a block: removes what it mined and what now conflicts with it (with descendants).
    pub(super) fn remove_for_block(&mut self, mined: &[Transaction]) {
        for tx in mined {
            let txid = tx.compute_txid();
            self.remove(&txid);
            for input in &tx.input {
                if let Some(conflict) = self.spends.get(&input.previous_output).copied() {
                    for evicted in self.with_descendants(conflict) {
                        self.remove(&evicted);
                    }
                }
            }
        }
    }

    /// The default `maxfeerate` of `sendrawtransaction`, sat/kvB.
    pub(super) fn default_max_fee_rate() -> u64 {
        MAX_FEE_RATE_SAT_PER_KVB
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn money_and_fee_rates_are_formatted_as_core_does() {
        assert_eq!(format_money(Amount::from_sat(1_000_000)), "0.01");
        assert_eq!(format_money(Amount::from_sat(100_000_000)), "1.00");
        assert_eq!(format_money(Amount::from_sat(12_345_678)), "0.12345678");
        assert_eq!(format_money(Amount::from_sat(141)), "0.00000141");
        assert_eq!(format_fee_rate(1_000), "0.00001000 BTC/kvB");
        assert_eq!(rate(Amount::from_sat(141), 141), 1_000);
    }
}
