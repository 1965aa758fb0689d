//! What a reader hands the scanner: one block's identity, its raw payload and its transfers.

use alloy_primitives::U256;

/// One block as the node returned it, with every value transfer decoded from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedBlock {
    /// Height of the block.
    pub height: u64,
    /// Block hash in the chain's stored form.
    pub hash: String,
    /// Parent block hash in the chain's stored form.
    pub parent_hash: String,
    /// The exact bytes (BTC) or JSON (ETH) the node returned, retained for re-derivation.
    pub payload: Vec<u8>,
    /// Every transfer in the block, to any address; the scanner keeps those to watched ones.
    pub transfers: Vec<Transfer>,
}

/// Value moved to an address by a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Transaction hash in the chain's stored form.
    pub tx_hash: String,
    /// BTC: the output's vout. ETH native: 0. ERC-20: the log index.
    pub output_index: u32,
    /// Recipient in the chain's stored form (lowercase `0x` hex for ETH).
    pub to: String,
    /// What moved.
    pub asset: TransferAsset,
    /// How much, in the asset's smallest unit; never zero.
    pub amount: U256,
}

/// The asset of a transfer, as far as the block itself can say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferAsset {
    /// The chain's native coin.
    Native,
    /// An ERC-20 `Transfer` log emitted by this contract (lowercase `0x` hex). Only contracts an
    /// operator registered count as deposits.
    Erc20(String),
}
