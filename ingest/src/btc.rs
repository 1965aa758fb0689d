//! Bitcoin over Bitcoin Core's JSON-RPC: `getblockhash`, then `getblock <hash> 0`, decoded locally
//! with the `bitcoin` crate so amounts are exact satoshis and the bytes kept are the node's own.
//!
//! Every output whose script pays an address (P2PKH, P2SH, P2WPKH, P2WSH, P2TR, and any future
//! witness version) is a transfer keyed by `(txid, vout)`. Coinbase outputs are deposits too (a pool
//! paying its miners in the coinbase); they are marked, because they can be spent, and so
//! confirmed, only after 100 blocks.

use alloy_primitives::U256;
use bitcoin::consensus::deserialize;
use custodian_domain::{BlockHash, BtcAddress, BtcNetwork, Chain, ChainAddress, TxHash};
use serde_json::{json, Value};

use crate::block::{DepositKind, FetchedBlock, Spend, Transfer, TransferAsset};
use crate::reader::{ChainIdentity, ChainReader, ReadError};

pub use custodian_store::btc_rpc::{BtcAuth, RPC_TIMEOUT};
use custodian_store::btc_rpc::{BtcRpc, RpcFault, TransportError};

/// Bitcoin Core's RPC_INVALID_PARAMETER, returned by `getblockhash` above the tip.
const RPC_INVALID_PARAMETER: i64 = -8;

/// Reads blocks from Bitcoin Core (or anything answering exactly as it does).
#[derive(Clone, Debug)]
pub struct BtcReader {
    rpc: BtcRpc,
    network: BtcNetwork,
}

fn unavailable(message: impl std::fmt::Display) -> ReadError {
    ReadError::Unavailable { chain: Chain::Btc, message: message.to_string() }
}

fn transport(e: TransportError) -> ReadError {
    match e {
        TransportError::Unavailable { .. } => unavailable(e),
        TransportError::Unauthorized { method, .. } => {
            ReadError::Rpc { chain: Chain::Btc, method, message: e.to_string() }
        }
        TransportError::Malformed { .. } => malformed(e),
    }
}

fn malformed(message: impl std::fmt::Display) -> ReadError {
    ReadError::Malformed { chain: Chain::Btc, message: message.to_string() }
}

impl BtcReader {
    /// A reader for the node at `url` on `network`.
    pub fn new(url: &str, auth: BtcAuth, network: BtcNetwork) -> Result<BtcReader, ReadError> {
        let rpc = BtcRpc::new(url, auth).map_err(transport)?;
        Ok(BtcReader { rpc, network })
    }

    /// The transport, for callers that speak other methods to the same node (the withdrawal
    /// worker).
    pub fn rpc(&self) -> &BtcRpc {
        &self.rpc
    }

    async fn call(&self, method: &'static str, params: Value) -> Result<Result<Value, RpcFault>, ReadError> {
        self.rpc.call(method, params).await.map_err(transport)
    }

    async fn call_ok(&self, method: &'static str, params: Value) -> Result<Value, ReadError> {
        self.call(method, params).await?.map_err(|e| ReadError::Rpc {
            chain: Chain::Btc,
            method,
            message: format!("code {}: {}", e.code, e.message),
        })
    }

    /// The network this reader decodes addresses for.
    pub fn network(&self) -> BtcNetwork {
        self.network
    }
}

/// Decodes a stored BTC block (consensus bytes) at `height` into its identity and transfers.
pub fn parse_block(payload: &[u8], height: u64, network: BtcNetwork) -> Result<FetchedBlock, ReadError> {
    let block: bitcoin::Block = deserialize(payload).map_err(|e| malformed(format!("block {height}: {e}")))?;
    let mut transfers = Vec::new();
    let mut spends = Vec::new();
    for tx in &block.txdata {
        let coinbase = tx.is_coinbase();
        let txid = TxHash::Btc(tx.compute_txid());
        if !coinbase {
            for (index, input) in tx.input.iter().enumerate() {
                spends.push(Spend {
                    tx_hash: txid,
                    input_index: u32::try_from(index).map_err(malformed)?,
                    prev_tx: TxHash::Btc(input.previous_output.txid),
                    prev_vout: input.previous_output.vout,
                });
            }
        }
        for (vout, output) in tx.output.iter().enumerate() {
            if output.value.to_sat() == 0 {
                continue;
            }
            let Ok(address) = bitcoin::Address::from_script(&output.script_pubkey, network.to_bitcoin()) else {
                continue;
            };
            transfers.push(Transfer {
                tx_hash: txid,
                kind: DepositKind::Output,
                output_index: u32::try_from(vout).map_err(malformed)?,
                to: ChainAddress::Btc(BtcAddress::from_bitcoin(address)),
                asset: TransferAsset::Native,
                amount: U256::from(output.value.to_sat()),
                coinbase,
            });
        }
    }
    Ok(FetchedBlock {
        height,
        hash: BlockHash::Btc(block.block_hash()),
        parent_hash: BlockHash::Btc(block.header.prev_blockhash),
        payload: payload.to_vec(),
        transfers,
        spends,
    })
}

fn as_hash(value: Value, method: &str) -> Result<String, ReadError> {
    match value {
        Value::String(s) if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(s.to_ascii_lowercase()),
        other => Err(malformed(format!("{method} returned {other} instead of a block hash"))),
    }
}

impl ChainReader for BtcReader {
    fn chain(&self) -> Chain {
        Chain::Btc
    }

    async fn tip_height(&self) -> Result<u64, ReadError> {
        let count = self.call_ok("getblockcount", json!([])).await?;
        count.as_u64().ok_or_else(|| malformed(format!("getblockcount returned {count}")))
    }

    async fn block_hash(&self, height: u64) -> Result<Option<String>, ReadError> {
        match self.call("getblockhash", json!([height])).await? {
            Ok(value) => as_hash(value, "getblockhash").map(Some),
            Err(e) if e.code == RPC_INVALID_PARAMETER => Ok(None),
            Err(e) => Err(ReadError::Rpc { chain: Chain::Btc, method: "getblockhash", message: e.message }),
        }
    }

    async fn identity(&self) -> Result<ChainIdentity, ReadError> {
        let info = self.call_ok("getblockchaininfo", json!([])).await?;
        let network = info["chain"]
            .as_str()
            .ok_or_else(|| malformed(format!("getblockchaininfo has no chain: {info:.200}")))?
            .to_owned();
        if network.parse::<BtcNetwork>().ok() != Some(self.network) {
            return Err(ReadError::WrongNetwork {
                chain: Chain::Btc,
                message: format!("the node serves Bitcoin {network}, configured for {}", self.network.as_str()),
            });
        }
        let genesis = self.block_hash(0).await?.ok_or_else(|| malformed("getblockhash 0 found no genesis block"))?;
        Ok(ChainIdentity { network, genesis_hash: genesis, chain_id: None })
    }

    async fn fetch_block(&self, height: u64) -> Result<Option<FetchedBlock>, ReadError> {
        let Some(hash) = self.block_hash(height).await? else { return Ok(None) };
        let hex = match self.call_ok("getblock", json!([hash, 0])).await? {
            Value::String(hex) => hex,
            other => return Err(malformed(format!("getblock {hash} 0 returned {other:.100}"))),
        };
        let bytes = decode_hex(&hex).ok_or_else(|| malformed(format!("getblock {hash} 0 returned invalid hex")))?;
        let block = parse_block(&bytes, height, self.network)?;
        if block.hash.to_string() != hash {
            return Err(malformed(format!("asked for block {hash}, got {}", block.hash)));
        }
        Ok(Some(block))
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
}
