//! Ethereum over JSON-RPC: blocks with full transactions plus `eth_getBlockReceipts`.
//!
//! A native deposit is a transaction with a recipient, a non-zero value and a successful receipt
//! (a reverted transaction moves no value). An ERC-20 deposit is a `Transfer(address,address,
//! uint256)` log with three topics; which contracts count is decided by the scanner from the
//! registered tokens. ETH moved by contract calls (a Safe paying us, a batch payout, a WETH unwrap)
//! is found in the block's call traces (`debug_traceBlockByNumber` with the `callTracer`): every
//! value-carrying call that did not revert, inside a successful transaction. The payload kept is
//! `{"block":…,"receipts":…,"traces":…}` holding the node's answers verbatim (no `traces` when
//! they are turned off), so [`parse_payload`] can re-derive everything without the node.
//!
//! Keys are stable across re-mining: a native deposit is index 0, a log its position in the
//! transaction's own receipt, an internal call its position in the transaction's call tree
//! (depth-first, the top-level call being 0).

use std::collections::HashMap;

use alloy::rpc::client::RpcClient;
use alloy::transports::{RpcError, TransportErrorKind};
use alloy_primitives::{b256, Address, Bytes, B256, U256, U64};
use custodian_domain::{BlockHash, Chain, ChainAddress, EthAddress, TxHash};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::block::{DepositKind, FetchedBlock, Transfer, TransferAsset};
use crate::reader::{ChainIdentity, ChainReader, ReadError};

/// keccak256("Transfer(address,address,uint256)"), topic 0 of every ERC-20 transfer log.
pub const TRANSFER_TOPIC: B256 = b256!("ddf252ad1be2c89b69c2b068fc378daa952ba7f163c4a11628f55a4df523b3ef");

/// Reads blocks from an Ethereum JSON-RPC node.
#[derive(Clone)]
pub struct EthReader {
    client: RpcClient,
    traces: bool,
}

/// How long one node call may take by default before it counts as unreachable (and is retried).
pub const RPC_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl EthReader {
    /// A reader for the node at `url` (`http://…`; several, comma-separated, fail over), every call
    /// bounded by [`RPC_TIMEOUT`].
    pub fn new(url: &str) -> Result<EthReader, ReadError> {
        EthReader::with_timeout(url, RPC_TIMEOUT)
    }

    /// A reader whose every call is bounded by `timeout`: a silent node is a transient failure,
    /// retried with backoff and shown as `retrying`, never a scanner frozen on a call.
    pub fn with_timeout(url: &str, timeout: std::time::Duration) -> Result<EthReader, ReadError> {
        let nodes = custodian_store::nodes::EthNodes::new(url, timeout)
            .map_err(|message| ReadError::Unavailable { chain: Chain::Eth, message })?;
        Ok(EthReader { client: nodes.client(), traces: true })
    }

    /// Whether call traces are read (internal deposits). On by default; a node without a trace
    /// API must be configured with them off, knowingly.
    pub fn with_traces(mut self, traces: bool) -> Self {
        self.traces = traces;
        self
    }

    /// Checks that the node answers `debug_traceBlockByNumber` with the `callTracer` (when traces
    /// are on): a node without it is a start-up error, not a silent gap.
    pub async fn check_traces(&self) -> Result<(), ReadError> {
        if !self.traces {
            return Ok(());
        }
        // The latest block: geth refuses to trace the genesis block, and any node can trace its head.
        match self.call::<_, Box<RawValue>>("debug_traceBlockByNumber", ("latest", call_tracer())).await {
            Ok(_) => Ok(()),
            // The node answered, and refused: it has no trace API (or not the callTracer).
            Err(ReadError::Rpc { message, .. }) => Err(ReadError::WrongNetwork {
                chain: Chain::Eth,
                message: format!(
                    "the node does not answer debug_traceBlockByNumber with the callTracer ({message}); ETH sent by \
                     contracts would not be seen. Use a node with the debug API, or set [eth] traces = false \
                     (CUSTODIAN_ETH_TRACES=false) to scan without internal deposits"
                ),
            }),
            Err(other) => Err(other),
        }
    }

    async fn call<P, R>(&self, method: &'static str, params: P) -> Result<R, ReadError>
    where
        P: alloy::rpc::json_rpc::RpcSend,
        R: alloy::rpc::json_rpc::RpcRecv,
    {
        self.client.request(method, params).await.map_err(|e| rpc_error(method, e))
    }
}

fn rpc_error(method: &'static str, error: RpcError<TransportErrorKind>) -> ReadError {
    match error {
        RpcError::ErrorResp(payload) => ReadError::Rpc { chain: Chain::Eth, method, message: payload.to_string() },
        RpcError::DeserError { err, .. } => {
            ReadError::Malformed { chain: Chain::Eth, message: format!("{method}: {err}") }
        }
        other => ReadError::Unavailable { chain: Chain::Eth, message: other.to_string() },
    }
}

fn quantity(height: u64) -> String {
    format!("0x{height:x}")
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockHeader {
    hash: B256,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RpcBlock {
    hash: B256,
    parent_hash: B256,
    number: U64,
    transactions: Vec<RpcTransaction>,
}

/// Whether a block answered with full transactions holds any.
fn has_transactions(block: &RawValue) -> Result<bool, ReadError> {
    #[derive(Deserialize)]
    struct Transactions {
        transactions: Vec<serde::de::IgnoredAny>,
    }
    let parsed: Transactions = serde_json::from_str(block.get()).map_err(malformed)?;
    Ok(!parsed.transactions.is_empty())
}

fn call_tracer() -> serde_json::Value {
    serde_json::json!({"tracer": "callTracer"})
}

#[derive(Deserialize)]
struct RpcTransaction {
    hash: B256,
    to: Option<Address>,
    value: U256,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RpcReceipt {
    transaction_hash: B256,
    block_hash: B256,
    status: Option<U64>,
    logs: Vec<RpcLog>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RpcLog {
    address: Address,
    topics: Vec<B256>,
    data: Bytes,
}

#[derive(Deserialize)]
struct Payload<'a> {
    #[serde(borrow)]
    block: &'a RawValue,
    #[serde(borrow)]
    receipts: &'a RawValue,
    #[serde(borrow, default)]
    traces: Option<&'a RawValue>,
}

/// One transaction's trace as `debug_traceBlockByNumber` answers it (geth and anvil name the
/// transaction; older geth answers in block order without it).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TxTrace {
    tx_hash: Option<B256>,
    result: Option<CallFrame>,
}

/// A `callTracer` frame.
#[derive(Deserialize)]
struct CallFrame {
    #[serde(rename = "type")]
    kind: String,
    to: Option<Address>,
    value: Option<U256>,
    error: Option<String>,
    #[serde(default)]
    calls: Vec<CallFrame>,
}

/// The value-carrying calls of a frame's tree that did not revert, as (position, to, value), the
/// position counted depth-first over every frame with the top-level call at 0. A reverted frame
/// reverts everything below it.
fn internal_calls(root: &CallFrame) -> Vec<(u32, Address, U256)> {
    fn walk(frame: &CallFrame, next: &mut u32, reverted: bool, out: &mut Vec<(u32, Address, U256)>) {
        let position = *next;
        *next += 1;
        let reverted = reverted || frame.error.is_some();
        let moves_value = matches!(frame.kind.as_str(), "CALL" | "SELFDESTRUCT");
        if let (false, true, Some(to), Some(value), true) = (reverted, moves_value, frame.to, frame.value, position > 0)
        {
            if !value.is_zero() {
                out.push((position, to, value));
            }
        }
        for call in &frame.calls {
            walk(call, next, reverted, out);
        }
    }
    let mut out = Vec::new();
    walk(root, &mut 0, false, &mut out);
    out
}

fn malformed(message: impl std::fmt::Display) -> ReadError {
    ReadError::Malformed { chain: Chain::Eth, message: message.to_string() }
}

fn hex(value: impl std::fmt::LowerHex) -> String {
    format!("{value:#x}")
}

/// Decodes a stored ETH payload into the block's identity and transfers.
pub fn parse_payload(payload: &[u8]) -> Result<FetchedBlock, ReadError> {
    let wrapper: Payload<'_> = serde_json::from_slice(payload).map_err(malformed)?;
    let block: RpcBlock = serde_json::from_str(wrapper.block.get()).map_err(malformed)?;
    let receipts: Vec<RpcReceipt> = serde_json::from_str(wrapper.receipts.get()).map_err(malformed)?;
    if let Some(stray) = receipts.iter().find(|r| r.block_hash != block.hash) {
        return Err(malformed(format!(
            "receipt of {} belongs to block {}, not {}",
            stray.transaction_hash, stray.block_hash, block.hash
        )));
    }
    let successful: HashMap<B256, &RpcReceipt> =
        receipts.iter().filter(|r| r.status == Some(U64::from(1))).map(|r| (r.transaction_hash, r)).collect();
    let traces: Vec<TxTrace> = match wrapper.traces {
        Some(traces) => serde_json::from_str(traces.get()).map_err(malformed)?,
        None => Vec::new(),
    };
    if !traces.is_empty() && traces.len() != block.transactions.len() {
        return Err(malformed(format!(
            "{} traces for the {} transactions of block {}",
            traces.len(),
            block.transactions.len(),
            block.hash
        )));
    }
    let mut trace_of: HashMap<B256, &CallFrame> = HashMap::new();
    for (position, trace) in traces.iter().enumerate() {
        let hash = trace.tx_hash.unwrap_or(block.transactions[position].hash);
        if let Some(frame) = &trace.result {
            trace_of.insert(hash, frame);
        }
    }

    let mut transfers = Vec::new();
    for tx in &block.transactions {
        let Some(receipt) = successful.get(&tx.hash) else { continue };
        if let Some(to) = tx.to.filter(|_| !tx.value.is_zero()) {
            transfers.push(Transfer {
                tx_hash: TxHash::Eth(tx.hash),
                kind: DepositKind::Native,
                output_index: 0,
                to: ChainAddress::Eth(EthAddress::from_alloy(to)),
                asset: TransferAsset::Native,
                amount: tx.value,
                coinbase: false,
            });
        }
        if let Some(frame) = trace_of.get(&tx.hash) {
            for (position, to, value) in internal_calls(frame) {
                transfers.push(Transfer {
                    tx_hash: TxHash::Eth(tx.hash),
                    kind: DepositKind::Internal,
                    output_index: position,
                    to: ChainAddress::Eth(EthAddress::from_alloy(to)),
                    asset: TransferAsset::Native,
                    amount: value,
                    coinbase: false,
                });
            }
        }
        for (position, log) in receipt.logs.iter().enumerate() {
            if log.topics.len() != 3 || log.topics[0] != TRANSFER_TOPIC || log.data.len() != 32 {
                continue;
            }
            let amount = U256::from_be_slice(&log.data);
            if amount.is_zero() {
                continue;
            }
            let to = Address::from_word(log.topics[2]);
            transfers.push(Transfer {
                tx_hash: TxHash::Eth(tx.hash),
                kind: DepositKind::Log,
                output_index: u32::try_from(position).map_err(malformed)?,
                to: ChainAddress::Eth(EthAddress::from_alloy(to)),
                asset: TransferAsset::Erc20(EthAddress::from_alloy(log.address)),
                amount,
                coinbase: false,
            });
        }
    }
    Ok(FetchedBlock {
        height: block.number.to::<u64>(),
        hash: BlockHash::Eth(block.hash),
        parent_hash: BlockHash::Eth(block.parent_hash),
        payload: payload.to_vec(),
        transfers,
        spends: Vec::new(),
    })
}

impl ChainReader for EthReader {
    fn chain(&self) -> Chain {
        Chain::Eth
    }

    async fn identity(&self) -> Result<ChainIdentity, ReadError> {
        let chain_id: U64 = self.call("eth_chainId", ()).await?;
        let genesis = self.block_hash(0).await?.ok_or_else(|| malformed("the node has no block 0"))?;
        Ok(ChainIdentity {
            network: "ethereum".to_owned(),
            genesis_hash: genesis,
            chain_id: Some(chain_id.to::<u64>()),
        })
    }

    async fn tip_height(&self) -> Result<u64, ReadError> {
        let tip: U64 = self.call("eth_blockNumber", ()).await?;
        Ok(tip.to::<u64>())
    }

    async fn block_hash(&self, height: u64) -> Result<Option<String>, ReadError> {
        let header: Option<BlockHeader> = self.call("eth_getBlockByNumber", (quantity(height), false)).await?;
        Ok(header.map(|h| hex(h.hash)))
    }

    async fn fetch_block(&self, height: u64) -> Result<Option<FetchedBlock>, ReadError> {
        let block: Box<RawValue> = self.call("eth_getBlockByNumber", (quantity(height), true)).await?;
        if block.get() == "null" {
            return Ok(None);
        }
        let receipts: Box<RawValue> = self.call("eth_getBlockReceipts", (quantity(height),)).await?;
        // A node behind a load balancer, or one still indexing, can answer `null` for a block it
        // has just named: ask again later.
        if receipts.get() == "null" {
            return Err(ReadError::Inconsistent { chain: Chain::Eth, height });
        }
        // A block without transactions has no traces (and geth refuses to trace the genesis block).
        let payload = if self.traces && has_transactions(&block)? {
            let traces: Box<RawValue> =
                self.call("debug_traceBlockByNumber", (quantity(height), call_tracer())).await?;
            format!("{{\"block\":{},\"receipts\":{},\"traces\":{}}}", block.get(), receipts.get(), traces.get())
        } else {
            format!("{{\"block\":{},\"receipts\":{}}}", block.get(), receipts.get())
        }
        .into_bytes();
        match parse_payload(&payload) {
            // The node reorged between the two calls: the receipts belong to another block.
            Err(ReadError::Malformed { message, .. })
                if message.contains("belongs to block") || message.contains("traces for the") =>
            {
                Err(ReadError::Inconsistent { chain: Chain::Eth, height })
            }
            Err(other) => Err(other),
            Ok(parsed) if parsed.height != height => {
                Err(malformed(format!("asked for block {height}, node returned {}", parsed.height)))
            }
            Ok(parsed) => Ok(Some(parsed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: &str = r#"{"hash":"0x1111111111111111111111111111111111111111111111111111111111111111",
        "parentHash":"0x2222222222222222222222222222222222222222222222222222222222222222","number":"0x10",
        "transactions":[
          {"hash":"0xaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","to":"0x70997970C51812dc3A010C7d01b50e0d17dc79C8","value":"0xde0b6b3a7640000"},
          {"hash":"0xbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","to":"0x70997970c51812dc3a010c7d01b50e0d17dc79c8","value":"0x5"},
          {"hash":"0xcccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc","to":null,"value":"0x0"},
          {"hash":"0xdddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd","to":"0x5fbdb2315678afecb367f032d93f642f64180aa3","value":"0x0"}]}"#;

    fn receipt(tx: char, status: &str, logs: &str) -> String {
        format!(
            r#"{{"transactionHash":"0x{}","blockHash":"0x{}","status":"{status}","logs":[{logs}]}}"#,
            tx.to_string().repeat(64),
            "1".repeat(64)
        )
    }

    #[test]
    fn decodes_native_and_erc20_transfers_of_successful_transactions_only() {
        let transfer_log = format!(
            r#"{{"address":"0x5fbdb2315678afecb367f032d93f642f64180aa3","topics":["{TRANSFER_TOPIC:#x}",
               "0x000000000000000000000000f39fd6e51aad88f6f4ce6ab8827279cfffb92266",
               "0x00000000000000000000000070997970c51812dc3a010c7d01b50e0d17dc79c8"],
               "data":"0x000000000000000000000000000000000000000000000000000000000012d687","logIndex":"0x3"}}"#
        );
        let receipts = format!(
            "[{},{},{},{}]",
            receipt('a', "0x1", ""),
            receipt('b', "0x0", ""),
            receipt('c', "0x1", ""),
            receipt('d', "0x1", &transfer_log)
        );
        let payload = format!(r#"{{"block":{BLOCK},"receipts":{receipts}}}"#);
        let block = parse_payload(payload.as_bytes()).expect("valid payload");
        assert_eq!(block.height, 16);
        assert_eq!(block.hash.to_string(), format!("0x{}", "1".repeat(64)));
        assert_eq!(block.parent_hash.to_string(), format!("0x{}", "2".repeat(64)));
        let recipient = ChainAddress::parse_stored("0x70997970c51812dc3a010c7d01b50e0d17dc79c8").unwrap();
        let tx = |digit: &str| TxHash::parse(Chain::Eth, &format!("0x{}", digit.repeat(64))).unwrap();
        assert_eq!(
            block.transfers,
            vec![
                Transfer {
                    tx_hash: tx("a"),
                    kind: DepositKind::Native,
                    output_index: 0,
                    to: recipient.clone(),
                    asset: TransferAsset::Native,
                    amount: U256::from(1_000_000_000_000_000_000u64),
                    coinbase: false,
                },
                Transfer {
                    tx_hash: tx("d"),
                    kind: DepositKind::Log,
                    // the block-wide log index is 3; its position in its own receipt is 0
                    output_index: 0,
                    to: recipient,
                    asset: TransferAsset::Erc20(
                        EthAddress::parse("0x5fbdb2315678afecb367f032d93f642f64180aa3").unwrap()
                    ),
                    amount: U256::from(1_234_567u64),
                    coinbase: false,
                },
            ],
            "the reverted 0x5 transfer and the contract creation are not transfers"
        );
    }

    #[test]
    fn a_receipt_from_another_block_is_refused() {
        let receipts = format!("[{}]", receipt('a', "0x1", "").replace(&"1".repeat(64), &"9".repeat(64)));
        let payload = format!(r#"{{"block":{BLOCK},"receipts":{receipts}}}"#);
        assert!(matches!(parse_payload(payload.as_bytes()), Err(ReadError::Malformed { .. })));
        assert!(matches!(parse_payload(b"not json"), Err(ReadError::Malformed { .. })));
    }

    #[test]
    fn internal_calls_are_numbered_depth_first_and_a_reverted_frame_reverts_its_subtree() {
        let frame: CallFrame = serde_json::from_str(
            r#"{"type":"CALL","to":"0x1000000000000000000000000000000000000001","value":"0x9","calls":[
                 {"type":"CALL","to":"0x2000000000000000000000000000000000000002","value":"0x5"},
                 {"type":"CALL","to":"0x3000000000000000000000000000000000000003","value":"0x6","error":"execution reverted",
                  "calls":[{"type":"CALL","to":"0x4000000000000000000000000000000000000004","value":"0x7"}]},
                 {"type":"STATICCALL","to":"0x5000000000000000000000000000000000000005"},
                 {"type":"DELEGATECALL","to":"0x6000000000000000000000000000000000000006","value":"0x1"},
                 {"type":"CALL","to":"0x7000000000000000000000000000000000000007","value":"0x0"},
                 {"type":"CALL","to":"0x8000000000000000000000000000000000000008","value":"0x8"}]}"#,
        )
        .expect("a callTracer frame");
        let found: Vec<(u32, String, u64)> =
            internal_calls(&frame).into_iter().map(|(p, to, v)| (p, hex(to), v.to::<u64>())).collect();
        assert_eq!(
            found,
            vec![
                (1, "0x2000000000000000000000000000000000000002".to_owned(), 5),
                (7, "0x8000000000000000000000000000000000000008".to_owned(), 8),
            ],
            "the top call is the native deposit; the reverted call and its child, value-less and delegate calls are not deposits"
        );
    }
}
