//! What a reader hands the scanner: one block's identity, its raw payload and its transfers.

use alloy_primitives::U256;
use custodian_domain::{BlockHash, ChainAddress, EthAddress, TxHash};

/// One block as the node returned it, with every value transfer decoded from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedBlock {
    /// Height of the block.
    pub height: u64,
    /// Block hash.
    pub hash: BlockHash,
    /// Parent block hash.
    pub parent_hash: BlockHash,
    /// The exact bytes (BTC) or JSON (ETH) the node returned, retained for re-derivation.
    pub payload: Vec<u8>,
    /// Every transfer in the block, to any address; the scanner keeps those to watched ones.
    pub transfers: Vec<Transfer>,
    /// BTC: every input of every transaction but the coinbase; stored for the outputs we hold.
    pub spends: Vec<Spend>,
}

/// An input spending an output (BTC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spend {
    /// The spending transaction.
    pub tx_hash: TxHash,
    /// The input's position in it.
    pub input_index: u32,
    /// The spent output's transaction.
    pub prev_tx: TxHash,
    /// The spent output's vout.
    pub prev_vout: u32,
}

/// Value moved to an address by a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Transaction hash.
    pub tx_hash: TxHash,
    /// Where in the transaction the money was found.
    pub kind: DepositKind,
    /// Stable across re-mining: BTC vout; ETH native 0; ERC-20 the log's position in the
    /// transaction's receipt; internal the call's position in the transaction's call tree.
    pub output_index: u32,
    /// Recipient.
    pub to: ChainAddress,
    /// What moved.
    pub asset: TransferAsset,
    /// How much, in the asset's smallest unit; never zero.
    pub amount: U256,
    /// A BTC coinbase output (confirmable only after 100 blocks).
    pub coinbase: bool,
}

/// Where a deposit was found, part of its key (`deposit:{chain}:{tx}:{kind}:{index}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DepositKind {
    /// The ETH value of the transaction itself (index 0).
    Native,
    /// An ERC-20 `Transfer` log (its position in the transaction's receipt).
    Log,
    /// ETH moved by a contract call (the call's position in the call tree, the top call being 0).
    Internal,
    /// A BTC output (its vout).
    Output,
}

impl DepositKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            DepositKind::Native => "native",
            DepositKind::Log => "log",
            DepositKind::Internal => "internal",
            DepositKind::Output => "output",
        }
    }
}

/// The asset of a transfer, as far as the block itself can say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferAsset {
    /// The chain's native coin.
    Native,
    /// An ERC-20 `Transfer` log emitted by this contract. Only contracts an operator registered
    /// count as deposits.
    Erc20(EthAddress),
}
