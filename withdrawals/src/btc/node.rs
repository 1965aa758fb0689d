//! What the BTC worker asks Bitcoin Core, and how its answers are classified: fee estimates and
//! broadcasts over the shared transport ([`custodian_store::btc_rpc`]).

use custodian_store::btc_rpc::{BtcRpc, RpcFault, TransportError};
use serde_json::{json, Value};

use super::tx::FeeRate;

/// Core's `RPC_VERIFY_ERROR`: for `sendrawtransaction`, inputs missing or spent.
const RPC_VERIFY_ERROR: i64 = -25;
/// Core's `RPC_VERIFY_REJECTED`: the mempool refused it, with its reason.
const RPC_VERIFY_REJECTED: i64 = -26;
/// Core's `RPC_VERIFY_ALREADY_IN_CHAIN`.
const RPC_VERIFY_ALREADY_IN_CHAIN: i64 = -27;

/// How a broadcast ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// The node accepted the bytes now.
    Accepted,
    /// The node had them already: in its mempool or in the chain.
    AlreadyKnown,
    /// Refused for its fee (below the relay or mempool minimum, or not enough to replace what the
    /// mempool holds): a replacement with a higher fee is due.
    Underpriced(String),
    /// An input is neither unspent nor in the mempool: a coin was spent, by our own sibling or by
    /// someone else. The chain's observations decide which.
    InputsMissing(String),
    /// Refused for another reason (a script failure, a non-standard transaction): alerted.
    Refused(String),
}

/// Classifies Core's error object for `sendrawtransaction`.
pub fn classify(fault: &RpcFault) -> Sent {
    let message = fault.message.clone();
    match fault.code {
        RPC_VERIFY_ALREADY_IN_CHAIN => Sent::AlreadyKnown,
        RPC_VERIFY_REJECTED if message.contains("txn-already-in-mempool") || message.contains("txn-already-known") => {
            Sent::AlreadyKnown
        }
        RPC_VERIFY_REJECTED
            if message.contains("insufficient fee")
                || message.contains("min relay fee not met")
                || message.contains("mempool min fee not met") =>
        {
            Sent::Underpriced(message)
        }
        RPC_VERIFY_ERROR if message.contains("missing") || message.contains("spent") => Sent::InputsMissing(message),
        _ => Sent::Refused(format!("code {}: {message}", fault.code)),
    }
}

/// Reads BTC in Core's JSON number form (`0.00012000`, or `1.2e-4` as a JSON parser may print
/// it) as satoshis, exactly: no floating point.
pub fn btc_to_sat(text: &str) -> Option<u64> {
    let (mantissa, exponent) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i32>().ok()?),
        None => (text, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.starts_with('-') || !(whole.chars().chain(fraction.chars())).all(|c| c.is_ascii_digit()) {
        return None;
    }
    let digits = format!("{whole}{fraction}");
    // The value is digits × 10^(exponent − len(fraction)); in satoshis, × 10^8 more.
    let shift = exponent + 8 - i32::try_from(fraction.len()).ok()?;
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() {
        return Some(0);
    }
    if shift >= 0 {
        let value: u64 = digits.parse().ok()?;
        value.checked_mul(10u64.checked_pow(u32::try_from(shift).ok()?)?)
    } else {
        let cut = usize::try_from(-shift).ok()?;
        if cut >= digits.len() {
            return Some(0);
        }
        digits[..digits.len() - cut].parse().ok()
    }
}

/// The BTC worker's view of Bitcoin Core.
#[derive(Clone, Debug)]
pub struct BtcNode {
    rpc: BtcRpc,
}

/// A node call that got no usable answer; the pass is retried.
#[derive(Debug, thiserror::Error)]
pub enum BtcNodeError {
    /// No answer.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// An answer we cannot read.
    #[error("{method}: {message}")]
    Unexpected {
        /// The method.
        method: &'static str,
        /// What was wrong.
        message: String,
    },
}

impl BtcNode {
    /// Over `rpc`.
    pub fn new(rpc: BtcRpc) -> BtcNode {
        BtcNode { rpc }
    }

    /// `estimatesmartfee target`: the rate, or `None` when the node has no estimate yet.
    ///
    /// # Cancel safety
    /// A read.
    pub async fn estimate_fee_rate(&self, target: u16) -> Result<Option<FeeRate>, BtcNodeError> {
        let answer =
            self.rpc.call("estimatesmartfee", json!([target])).await?.map_err(|fault| BtcNodeError::Unexpected {
                method: "estimatesmartfee",
                message: format!("code {}: {}", fault.code, fault.message),
            })?;
        match answer.get("feerate") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => {
                btc_to_sat(&n.to_string()).map(|sat| Some(FeeRate(sat))).ok_or_else(|| BtcNodeError::Unexpected {
                    method: "estimatesmartfee",
                    message: format!("feerate {n} is not an amount"),
                })
            }
            Some(other) => Err(BtcNodeError::Unexpected {
                method: "estimatesmartfee",
                message: format!("feerate {other} is not a number"),
            }),
        }
    }

    /// `sendrawtransaction` of stored bytes, classified.
    ///
    /// # Cancel safety
    /// The node may have accepted the bytes whatever the caller saw: they are sent again later.
    pub async fn send(&self, raw: &[u8]) -> Result<Sent, BtcNodeError> {
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        Ok(match self.rpc.call("sendrawtransaction", json!([hex])).await? {
            Ok(_) => Sent::Accepted,
            Err(fault) => classify(&fault),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_are_read_exactly() {
        assert_eq!(btc_to_sat("0.00012000"), Some(12_000));
        assert_eq!(btc_to_sat("0.0001"), Some(10_000));
        assert_eq!(btc_to_sat("1e-5"), Some(1_000));
        assert_eq!(btc_to_sat("1.5E-4"), Some(15_000));
        assert_eq!(btc_to_sat("21"), Some(2_100_000_000));
        assert_eq!(btc_to_sat("0"), Some(0));
        assert_eq!(btc_to_sat("-1"), None);
        assert_eq!(btc_to_sat("abc"), None);
    }

    #[test]
    fn core_answers_are_classified() {
        let fault = |code, message: &str| RpcFault { code, message: message.to_owned() };
        assert_eq!(classify(&fault(-27, "Transaction outputs already in utxo set")), Sent::AlreadyKnown);
        assert_eq!(classify(&fault(-26, "txn-already-in-mempool")), Sent::AlreadyKnown);
        assert!(matches!(classify(&fault(-26, "min relay fee not met, 100 < 141")), Sent::Underpriced(_)));
        assert!(matches!(
            classify(&fault(
                -26,
                "insufficient fee, rejecting replacement ab, not enough additional fees to relay; 1 < 2"
            )),
            Sent::Underpriced(_)
        ));
        assert!(matches!(classify(&fault(-25, "Inputs missing or spent")), Sent::InputsMissing(_)));
        assert!(matches!(classify(&fault(-26, "mandatory-script-verify-flag-failed (x)")), Sent::Refused(_)));
    }
}
