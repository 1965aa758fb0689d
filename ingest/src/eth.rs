//! Ethereum over JSON-RPC: blocks with full transactions plus `eth_getBlockReceipts`.
//!
//! A native deposit is a transaction with a recipient, a non-zero value and a successful receipt
//! (a reverted transaction moves no value). An ERC-20 deposit is a `Transfer(address,address,
//! uint256)` log with three topics; which contracts count is decided by the scanner from the
//! registered tokens. The payload kept is `{"block":…,"receipts":…}` holding the node's two
//! answers verbatim, so [`parse_payload`] can re-derive everything without the node.

use std::collections::HashMap;

use alloy::rpc::client::RpcClient;
use alloy::transports::{RpcError, TransportErrorKind};
use alloy_primitives::{b256, Address, Bytes, B256, U256, U64};
use custodian_domain::Chain;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::block::{FetchedBlock, Transfer, TransferAsset};
use crate::reader::{ChainReader, ReadError};

/// keccak256("Transfer(address,address,uint256)"), topic 0 of every ERC-20 transfer log.
pub const TRANSFER_TOPIC: B256 = b256!("ddf252ad1be2c89b69c2b068fc378daa952ba7f163c4a11628f55a4df523b3ef");

/// Reads blocks from an Ethereum JSON-RPC node.
#[derive(Clone)]
pub struct EthReader {
    client: RpcClient,
}

impl EthReader {
    /// A reader for the node at `url` (`http://…`).
    pub fn new(url: &str) -> Result<EthReader, ReadError> {
        custodian_store::tls::install_crypto_provider();
        let url = url.parse().map_err(|e| ReadError::Unavailable {
            chain: Chain::Eth,
            message: format!("invalid Ethereum RPC URL: {e}"),
        })?;
        Ok(EthReader { client: RpcClient::new_http(url) })
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
    log_index: U64,
}

#[derive(Deserialize)]
struct Payload<'a> {
    #[serde(borrow)]
    block: &'a RawValue,
    #[serde(borrow)]
    receipts: &'a RawValue,
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

    let mut transfers = Vec::new();
    for tx in &block.transactions {
        let Some(receipt) = successful.get(&tx.hash) else { continue };
        if let Some(to) = tx.to.filter(|_| !tx.value.is_zero()) {
            transfers.push(Transfer {
                tx_hash: hex(tx.hash),
                output_index: 0,
                to: hex(to),
                asset: TransferAsset::Native,
                amount: tx.value,
            });
        }
        for log in &receipt.logs {
            if log.topics.len() != 3 || log.topics[0] != TRANSFER_TOPIC || log.data.len() != 32 {
                continue;
            }
            let amount = U256::from_be_slice(&log.data);
            if amount.is_zero() {
                continue;
            }
            let to = Address::from_word(log.topics[2]);
            let output_index = u32::try_from(log.log_index.to::<u64>()).map_err(malformed)?;
            transfers.push(Transfer {
                tx_hash: hex(tx.hash),
                output_index,
                to: hex(to),
                asset: TransferAsset::Erc20(hex(log.address)),
                amount,
            });
        }
    }
    Ok(FetchedBlock {
        height: block.number.to::<u64>(),
        hash: hex(block.hash),
        parent_hash: hex(block.parent_hash),
        payload: payload.to_vec(),
        transfers,
    })
}

impl ChainReader for EthReader {
    fn chain(&self) -> Chain {
        Chain::Eth
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
        let payload = format!("{{\"block\":{},\"receipts\":{}}}", block.get(), receipts.get()).into_bytes();
        match parse_payload(&payload) {
            // The node reorged between the two calls: the receipts belong to another block.
            Err(ReadError::Malformed { message, .. }) if message.contains("belongs to block") => {
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
        assert_eq!(block.hash, format!("0x{}", "1".repeat(64)));
        assert_eq!(block.parent_hash, format!("0x{}", "2".repeat(64)));
        let recipient = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".to_owned();
        assert_eq!(
            block.transfers,
            vec![
                Transfer {
                    tx_hash: format!("0x{}", "a".repeat(64)),
                    output_index: 0,
                    to: recipient.clone(),
                    asset: TransferAsset::Native,
                    amount: U256::from(1_000_000_000_000_000_000u64),
                },
                Transfer {
                    tx_hash: format!("0x{}", "d".repeat(64)),
                    output_index: 3,
                    to: recipient,
                    asset: TransferAsset::Erc20("0x5fbdb2315678afecb367f032d93f642f64180aa3".into()),
                    amount: U256::from(1_234_567u64),
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
}
