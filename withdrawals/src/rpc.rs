//! The Ethereum node as the withdrawal worker uses it: fees, simulation, broadcast, receipts and
//! nonces. Every call here happens outside any database transaction.

use alloy::rpc::client::RpcClient;
use alloy::transports::RpcError;
use alloy_primitives::{Address, Bytes, B256, U256, U64};
use custodian_domain::Nonce;
use serde::Deserialize;
use serde_json::json;

/// Why a node call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NodeError {
    /// Unreachable, timed out, or the connection broke: retry later, never re-sign.
    #[error("node unreachable: {0}")]
    Transport(String),
    /// The node answered with a JSON-RPC error.
    #[error("node refused {method}: {message} (code {code})")]
    Rpc {
        /// Method.
        method: &'static str,
        /// JSON-RPC error code.
        code: i64,
        /// Message.
        message: String,
    },
    /// The answer could not be decoded.
    #[error("node answered {0} with something unexpected")]
    Malformed(&'static str),
}

impl NodeError {
    /// A deterministic execution revert (simulation): the same call will fail again.
    pub fn is_revert(&self) -> bool {
        matches!(self, NodeError::Rpc { code, message, .. } if *code == 3 || message.to_ascii_lowercase().contains("revert"))
    }

    /// The node already holds the transaction (in its pool or mined): as good as sent.
    pub fn is_already_known(&self) -> bool {
        let message = self.message();
        ["already known", "known transaction", "transaction already exists", "already imported"]
            .iter()
            .any(|m| message.contains(m))
    }

    /// The lower-cased message of an RPC error.
    pub fn message(&self) -> String {
        match self {
            NodeError::Rpc { message, .. } => message.to_ascii_lowercase(),
            other => other.to_string().to_ascii_lowercase(),
        }
    }
}

/// What a receipt says about an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// 1 success, 0 reverted.
    pub success: bool,
    /// Block hash.
    pub block_hash: B256,
    /// Block number.
    pub block_number: u64,
    /// gasUsed × effectiveGasPrice.
    pub fee: U256,
    /// The events it emitted, in order.
    pub logs: Vec<Log>,
}

/// One event of a receipt.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Log {
    /// The contract that emitted it.
    pub address: Address,
    /// Its topics.
    pub topics: Vec<B256>,
    /// Its data.
    pub data: Bytes,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RpcReceipt {
    status: Option<U64>,
    block_hash: B256,
    block_number: U64,
    gas_used: U256,
    effective_gas_price: U256,
    #[serde(default)]
    logs: Vec<Log>,
}

/// A transaction as the node reports it (the evidence an operator's resolution is checked against).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChainTx {
    /// Hash.
    pub hash: B256,
    /// Sender.
    pub from: Address,
    /// Called address (`None` for a creation).
    pub to: Option<Address>,
    /// Nonce.
    pub nonce: U64,
    /// Wei sent.
    pub value: U256,
    /// Calldata.
    pub input: Bytes,
    /// Its block, once mined.
    pub block_hash: Option<B256>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RpcHeader {
    hash: B256,
    base_fee_per_gas: Option<U256>,
}

/// A JSON-RPC Ethereum node.
#[derive(Clone)]
pub struct EthNode {
    client: RpcClient,
}

/// How long one node call may take by default before it counts as failed.
pub const NODE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl EthNode {
    /// The node at `url` (several, comma-separated: reads fail over, broadcasts go to all), every
    /// call bounded by [`NODE_TIMEOUT`].
    pub fn new(url: &str) -> Result<EthNode, NodeError> {
        EthNode::with_timeout(url, NODE_TIMEOUT)
    }

    /// The node at `url`, every call bounded by `timeout`: a silent node is a transport error
    /// (retried later, that lane backed off), never a frozen worker.
    pub fn with_timeout(url: &str, timeout: std::time::Duration) -> Result<EthNode, NodeError> {
        let nodes = custodian_store::nodes::EthNodes::new(url, timeout).map_err(NodeError::Transport)?;
        Ok(EthNode { client: nodes.client() })
    }

    async fn call<P, R>(&self, method: &'static str, params: P) -> Result<R, NodeError>
    where
        P: alloy::rpc::json_rpc::RpcSend,
        R: alloy::rpc::json_rpc::RpcRecv,
    {
        self.client.request(method, params).await.map_err(|e| node_error(method, e))
    }

    /// The same call for each of `params`, in JSON-RPC batches of at most [`BATCH`]: one round
    /// trip per batch. Each answer keeps its own error (a refused broadcast among accepted ones);
    /// a batch that got no answer at all is the outer error.
    async fn batch<P, R>(&self, method: &'static str, params: &[P]) -> Result<Vec<Result<R, NodeError>>, NodeError>
    where
        P: alloy::rpc::json_rpc::RpcSend,
        R: alloy::rpc::json_rpc::RpcRecv,
    {
        let mut answers = Vec::with_capacity(params.len());
        for chunk in params.chunks(BATCH) {
            if let [one] = chunk {
                // One call needs no batch (and a node without batch support still serves it).
                answers.push(match self.call::<_, R>(method, one.clone()).await {
                    Err(NodeError::Transport(e)) => return Err(NodeError::Transport(e)),
                    answer => answer,
                });
                continue;
            }
            let mut batch = self.client.new_batch();
            let waiters = chunk
                .iter()
                .map(|p| batch.add_call::<_, R>(method, p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| node_error(method, e))?;
            batch.send().await.map_err(|e| node_error(method, e))?;
            for waiter in waiters {
                answers.push(waiter.await.map_err(|e| node_error(method, e)));
            }
        }
        Ok(answers)
    }

    /// The receipts of `hashes` (`None` where not mined), in batches.
    pub async fn receipts(&self, hashes: &[B256]) -> Result<Vec<Option<Receipt>>, NodeError> {
        let params: Vec<(B256,)> = hashes.iter().map(|h| (*h,)).collect();
        self.batch::<_, Option<RpcReceipt>>("eth_getTransactionReceipt", &params)
            .await?
            .into_iter()
            .map(|answer| answer.map(|r| r.map(receipt_of)))
            .collect()
    }

    /// Whether the node knows each of `hashes` (in its pool or mined), in batches.
    pub async fn knows_all(&self, hashes: &[B256]) -> Result<Vec<bool>, NodeError> {
        let params: Vec<(B256,)> = hashes.iter().map(|h| (*h,)).collect();
        self.batch::<_, Option<serde_json::Value>>("eth_getTransactionByHash", &params)
            .await?
            .into_iter()
            .map(|answer| answer.map(|tx| tx.is_some_and(|v| !v.is_null())))
            .collect()
    }

    /// Whether each of `addresses` holds contract code at the latest block, in batches.
    pub async fn have_code(&self, addresses: &[Address]) -> Result<Vec<bool>, NodeError> {
        let params: Vec<(Address, &str)> = addresses.iter().map(|a| (*a, "latest")).collect();
        self.batch::<_, Bytes>("eth_getCode", &params)
            .await?
            .into_iter()
            .map(|answer| answer.map(|code| !code.is_empty()))
            .collect()
    }

    /// `eth_sendRawTransaction` of each of `raws`, in batches, in order; each answer on its own.
    pub async fn send_raw_all(&self, raws: &[&[u8]]) -> Result<Vec<Result<B256, NodeError>>, NodeError> {
        let params: Vec<(Bytes,)> = raws.iter().map(|raw| (Bytes::copy_from_slice(raw),)).collect();
        self.batch("eth_sendRawTransaction", &params).await
    }

    /// `eth_chainId`.
    pub async fn chain_id(&self) -> Result<u64, NodeError> {
        Ok(self.call::<_, U64>("eth_chainId", ()).await?.to::<u64>())
    }

    /// `eth_blockNumber`.
    pub async fn block_number(&self) -> Result<u64, NodeError> {
        Ok(self.call::<_, U64>("eth_blockNumber", ()).await?.to::<u64>())
    }

    /// The latest block's base fee and the node's suggested priority fee, wei per gas.
    pub async fn fees(&self) -> Result<(U256, U256), NodeError> {
        let header: RpcHeader = self.call("eth_getBlockByNumber", ("latest", false)).await?;
        let priority: U256 = self.call("eth_maxPriorityFeePerGas", ()).await?;
        Ok((header.base_fee_per_gas.unwrap_or_default(), priority))
    }

    /// `eth_estimateGas`: the simulation. A revert comes back as an error with `is_revert`.
    pub async fn estimate_gas(&self, from: Address, to: Address, value: U256, data: &Bytes) -> Result<u64, NodeError> {
        let gas: U64 =
            self.call("eth_estimateGas", (json!({"from": from, "to": to, "value": value, "data": data}),)).await?;
        Ok(gas.to::<u64>())
    }

    /// Whether `address` holds contract code at the latest block.
    pub async fn has_code(&self, address: Address) -> Result<bool, NodeError> {
        let code: Bytes = self.call("eth_getCode", (address, "latest")).await?;
        Ok(!code.is_empty())
    }

    /// `eth_sendRawTransaction` of stored bytes.
    pub async fn send_raw(&self, raw: &[u8]) -> Result<B256, NodeError> {
        self.call("eth_sendRawTransaction", (Bytes::copy_from_slice(raw),)).await
    }

    /// Whether the node knows the transaction (in its pool or mined).
    pub async fn knows(&self, hash: B256) -> Result<bool, NodeError> {
        let tx: Option<serde_json::Value> = self.call("eth_getTransactionByHash", (hash,)).await?;
        Ok(tx.is_some_and(|v| !v.is_null()))
    }

    /// The receipt of `hash`, if mined.
    pub async fn receipt(&self, hash: B256) -> Result<Option<Receipt>, NodeError> {
        let receipt: Option<RpcReceipt> = self.call("eth_getTransactionReceipt", (hash,)).await?;
        Ok(receipt.map(receipt_of))
    }

    /// `eth_getTransactionByHash`.
    pub async fn transaction(&self, hash: B256) -> Result<Option<ChainTx>, NodeError> {
        self.call("eth_getTransactionByHash", (hash,)).await
    }

    /// Every transaction of the canonical block at `number` (empty if there is none).
    pub async fn block_transactions(&self, number: u64) -> Result<Vec<ChainTx>, NodeError> {
        #[derive(Debug, Deserialize)]
        struct Block {
            transactions: Vec<ChainTx>,
        }
        let block: Option<Block> = self.call("eth_getBlockByNumber", (format!("0x{number:x}"), true)).await?;
        Ok(block.map(|b| b.transactions).unwrap_or_default())
    }

    /// The transaction that consumed `nonce` of `address` on the canonical chain, found by
    /// bisecting the nonce count over block numbers and reading that block: `None` while the
    /// nonce is not consumed.
    pub async fn consumer_of(&self, address: Address, nonce: Nonce) -> Result<Option<ChainTx>, NodeError> {
        let head = self.block_number().await?;
        if self.nonce_at(address, head).await? <= nonce {
            return Ok(None);
        }
        // The first block whose count passes `nonce`: its transactions consumed it.
        let (mut low, mut high) = (0u64, head);
        while low < high {
            let middle = low + (high - low) / 2;
            if self.nonce_at(address, middle).await? > nonce {
                high = middle;
            } else {
                low = middle + 1;
            }
        }
        let found = self
            .block_transactions(low)
            .await?
            .into_iter()
            .find(|tx| tx.from == address && tx.nonce.to::<u64>() == nonce.get());
        Ok(found)
    }

    /// `eth_call` at the latest block: what the call returns. A revert is an error with `is_revert`.
    pub async fn call_at_latest(
        &self,
        from: Address,
        to: Address,
        value: U256,
        data: &Bytes,
    ) -> Result<Bytes, NodeError> {
        self.call("eth_call", (json!({"from": from, "to": to, "value": value, "data": data}), "latest")).await
    }

    /// `eth_getBalance` at block `number`, wei.
    pub async fn balance_at(&self, address: Address, number: u64) -> Result<U256, NodeError> {
        self.call("eth_getBalance", (address, format!("0x{number:x}"))).await
    }

    /// `eth_call` at block `number`: what the call returns.
    pub async fn call_at(&self, to: Address, data: &Bytes, number: u64) -> Result<Bytes, NodeError> {
        self.call("eth_call", (json!({"to": to, "data": data}), format!("0x{number:x}"))).await
    }

    /// `eth_getBalance` at the latest block, wei.
    pub async fn balance(&self, address: Address) -> Result<U256, NodeError> {
        self.call("eth_getBalance", (address, "latest")).await
    }

    /// `eth_getTransactionCount` at block `number`: how many of `address`'s transactions that
    /// block and its ancestors hold, which is the next nonce after them.
    pub async fn nonce_at(&self, address: Address, number: u64) -> Result<Nonce, NodeError> {
        let count = self.call::<_, U64>("eth_getTransactionCount", (address, format!("0x{number:x}"))).await?;
        Ok(Nonce::new(count.to::<u64>()))
    }

    /// `eth_getTransactionCount` at `latest` (mined) or `pending`.
    pub async fn nonce(&self, address: Address, pending: bool) -> Result<Nonce, NodeError> {
        let tag = if pending { "pending" } else { "latest" };
        Ok(Nonce::new(self.call::<_, U64>("eth_getTransactionCount", (address, tag)).await?.to::<u64>()))
    }

    /// The hash of the canonical block at `number`.
    pub async fn block_hash(&self, number: u64) -> Result<Option<B256>, NodeError> {
        let header: Option<RpcHeader> = self.call("eth_getBlockByNumber", (format!("0x{number:x}"), false)).await?;
        Ok(header.map(|h| h.hash))
    }
}

/// Calls per JSON-RPC batch at most (nodes commonly cap batches at 1,000 calls or a body size).
pub const BATCH: usize = 200;

fn node_error(method: &'static str, error: RpcError<alloy::transports::TransportErrorKind>) -> NodeError {
    match error {
        RpcError::ErrorResp(payload) => {
            NodeError::Rpc { method, code: payload.code, message: payload.message.to_string() }
        }
        RpcError::DeserError { .. } => NodeError::Malformed(method),
        RpcError::NullResp => NodeError::Malformed(method),
        other => NodeError::Transport(other.to_string()),
    }
}

fn receipt_of(r: RpcReceipt) -> Receipt {
    Receipt {
        success: r.status == Some(U64::from(1)),
        block_hash: r.block_hash,
        block_number: r.block_number.to::<u64>(),
        fee: r.gas_used.saturating_mul(r.effective_gas_price),
        logs: r.logs,
    }
}
