//! The one trait every chain reader implements.

use std::future::Future;

use custodian_domain::Chain;

use crate::block::FetchedBlock;

/// Why a read from a node failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The node could not be reached or did not answer in time. Retried with backoff.
    #[error("{chain} node unreachable: {message}")]
    Unavailable {
        /// Which chain's node.
        chain: Chain,
        /// What the transport said.
        message: String,
    },
    /// The node answered with an error.
    #[error("{chain} node refused {method}: {message}")]
    Rpc {
        /// Which chain's node.
        chain: Chain,
        /// The JSON-RPC method.
        method: &'static str,
        /// The node's message.
        message: String,
    },
    /// The node answered with something we cannot decode. Not retried: a parser bug or a
    /// misbehaving node needs a person.
    #[error("{chain} node sent a payload we cannot decode: {message}")]
    Malformed {
        /// Which chain's node.
        chain: Chain,
        /// What was wrong.
        message: String,
    },
    /// The node serves another network than configured, or lacks an API the configuration
    /// needs: never scanned.
    #[error("{chain} node refused: {message}")]
    WrongNetwork {
        /// Which chain.
        chain: Chain,
        /// What differs.
        message: String,
    },
    /// The node changed its chain between two calls for one block; fetch again.
    #[error("{chain} node changed its chain while block {height} was being read")]
    Inconsistent {
        /// Which chain.
        chain: Chain,
        /// The block being read.
        height: u64,
    },
}

impl ReadError {
    /// Whether retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, ReadError::Unavailable { .. } | ReadError::Inconsistent { .. } | ReadError::Rpc { .. })
    }
}

/// Which network a node serves: recorded on the first scan, checked by every scanner and worker.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChainIdentity {
    /// BTC: Bitcoin Core's `chain` (`main`, `test`, `testnet4`, `signet`, `regtest`); ETH: `ethereum`.
    pub network: String,
    /// The genesis block's hash in the chain's stored form.
    pub genesis_hash: String,
    /// ETH: `eth_chainId`.
    pub chain_id: Option<u64>,
}

impl std::fmt::Display for ChainIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "network {}, genesis {}", self.network, self.genesis_hash)?;
        if let Some(id) = self.chain_id {
            write!(f, ", chain id {id}")?;
        }
        Ok(())
    }
}

/// A source of blocks for one chain.
pub trait ChainReader: Send + Sync {
    /// The chain this reader serves.
    fn chain(&self) -> Chain;

    /// The node's network, genesis block and (ETH) chain id.
    fn identity(&self) -> impl Future<Output = Result<ChainIdentity, ReadError>> + Send;

    /// The node's current tip height.
    fn tip_height(&self) -> impl Future<Output = Result<u64, ReadError>> + Send;

    /// The hash of the node's block at `height`, or `None` above its tip.
    fn block_hash(&self, height: u64) -> impl Future<Output = Result<Option<String>, ReadError>> + Send;

    /// The node's block at `height` with its payload and transfers, or `None` above its tip.
    fn fetch_block(&self, height: u64) -> impl Future<Output = Result<Option<FetchedBlock>, ReadError>> + Send;
}
